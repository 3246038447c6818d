"""Distillation loss: forward KL from the target's distribution to the head's, over the draft vocabulary ``D``.

For a loss position ``t`` (its next token is an assistant token), with teacher logits ``z`` over the full vocabulary
``V`` and head logits ``s`` over ``D`` (all fp32, temperature ``T``)::

    p_t = softmax(z_t[D] / T)                      the teacher restricted to D and renormalised
    q_t = softmax(s_t / T)
    KL_t = Σ_{v∈D} p_t(v) (log p_t(v) − log q_t(v))
    loss = T² · Σ_t w_t KL_t / Σ_t w_t

Positions whose teacher argmax lies outside ``D`` (``train.outside_vocab``):

* ``weight`` (default): ``w_t = P_T(D | z_t) = Σ_{v∈D} softmax(z_t / T)(v)``, the teacher's mass inside ``D``. A
  head can only draft from ``D``; at T > 0 the best it can do at ``t`` is accept with probability ``P(D)``, reached by
  ``q = p_t`` — so such positions still teach the right within-``D`` distribution, weighted by how much acceptance
  they can bring. Positions with the argmax in ``D`` usually have ``w ≈ 1``.
* ``drop``: ``w_t = 1[argmax z_t ∈ D]`` — the reference implementation (those positions can never be accepted at
  T = 0, and at T > 0 only through the residual mass).
* ``keep``: ``w_t = 1``.

Top-1 agreement (the head's argmax mapped back to target ids equals the teacher's full-vocabulary argmax) is what
T = 0 acceptance measures; positions with the teacher argmax outside ``D`` count as disagreements.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from spd_ds.train.chat import EmptyMaskError

OUTSIDE_VOCAB_POLICIES = ("weight", "drop", "keep")


@dataclasses.dataclass
class TeacherTargets:
    """What the frozen target gives the loss, at the loss positions only (``N`` of them, row-major order).

    Attributes:
        logits_draft: ``[N, V_d]`` fp32 teacher logits at the draft-vocabulary ids.
        lse_full: ``[N]`` fp32 ``logsumexp(z / T)`` over the full vocabulary.
        argmax_full: ``[N]`` int64 teacher argmax over the full vocabulary (target ids).
    """

    logits_draft: torch.Tensor
    lse_full: torch.Tensor
    argmax_full: torch.Tensor

    def select(self, idx: torch.Tensor) -> "TeacherTargets":
        """The positions ``idx`` (``[N']`` int64)."""
        return TeacherTargets(self.logits_draft[idx], self.lse_full[idx], self.argmax_full[idx])


def position_weights(t: TeacherTargets, draft_ids: torch.Tensor, temperature: float, policy: str) -> torch.Tensor:
    """Per-position loss weights ``[N]`` fp32 for ``policy`` (see module doc).

    Raises:
        ValueError: unknown policy.
    """
    if policy == "weight":
        lse_d = torch.logsumexp(t.logits_draft.float() / temperature, dim=-1)
        return torch.exp(lse_d - t.lse_full).clamp(max=1.0)
    if policy == "drop":
        in_vocab = torch.isin(t.argmax_full, draft_ids.to(t.argmax_full.device))
        return in_vocab.float()
    if policy == "keep":
        return torch.ones_like(t.lse_full, dtype=torch.float32)
    raise ValueError(f"train.outside_vocab must be one of {OUTSIDE_VOCAB_POLICIES}, got {policy!r}")


def kd_loss(student_logits: torch.Tensor, teacher: TeacherTargets, weights: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """Weighted forward KL(teacher || head) over the draft vocabulary, in fp32 (see module doc).

    Args:
        student_logits: ``[N, V_d]`` head logits (any float dtype; computed in fp32).
        teacher: :class:`TeacherTargets` at the same ``N`` positions.
        weights: ``[N]`` per-position weights (:func:`position_weights`).
        temperature: ``T > 0``.

    Returns:
        Scalar fp32 loss (differentiable w.r.t. ``student_logits``).

    Raises:
        EmptyMaskError: ``N == 0`` or all weights zero — never train silently on nothing.
        ValueError: shape mismatch or ``T <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"train.kd_temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher.logits_draft.shape:
        raise ValueError(f"head logits {tuple(student_logits.shape)} != teacher {tuple(teacher.logits_draft.shape)}")
    total = weights.sum()
    if student_logits.shape[0] == 0 or not bool(total > 0):
        raise EmptyMaskError("this batch has no loss position (empty assistant mask or all weights zero)")
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher.logits_draft.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return temperature ** 2 * (weights * kl).sum() / total


def kl_chunk(student_logits: torch.Tensor, teacher_logits: torch.Tensor, weights: torch.Tensor, temperature: float,
             grad_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row chunk of the distillation loss and its gradient, in one pass (see module doc).

    Args:
        student_logits: ``[c, V_d]`` head logits (any float dtype; computed in fp32).
        teacher_logits: ``[c, V_d]`` teacher logits at the draft-vocabulary ids.
        weights: ``[c]`` fp32 per-position weights.
        temperature: ``T > 0``.
        grad_scale: 0-d fp32 ``T / W`` (``W`` the weights' sum over all chunks).
    Returns:
        ``(Σ_t w_t KL_t`` 0-d fp32, ``∂(T² · Σ_t w_t KL_t / W)/∂s = T · (w_t / W) · (q_t − p_t)``
        ``[c, V_d]`` in ``student_logits``' dtype``)``.
    """
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    p = log_p.exp()
    kl = (weights * (p * (log_p - log_q)).sum(-1)).sum()
    grad = (log_q.exp() - p) * (grad_scale * weights)[:, None]
    return kl, grad.to(student_logits.dtype)


_COMPILED_KL: dict[str, object] = {}


def _kl_chunk_fn(backend: str | None):
    if backend is None:
        return kl_chunk
    if backend not in _COMPILED_KL:  # dynamic: the number of loss positions changes every micro-batch
        _COMPILED_KL[backend] = torch.compile(kl_chunk, backend=backend, dynamic=True)
    return _COMPILED_KL[backend]


class _ChunkedKL(torch.autograd.Function):
    """``T² · Σ_t w_t KL_t / W`` (see module doc) computed ``chunk`` rows at a time; the gradient
    (:func:`kl_chunk`) is written in the same pass and only scaled by the incoming gradient in ``backward``.

    No ``[N, V_d]`` fp32 temporary outlives a chunk: peak memory is the logits, the gradient and one chunk.
    """

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, weights, temperature: float, chunk: int, backend):
        total = weights.sum().clamp_min(torch.finfo(torch.float32).tiny)
        fn = _kl_chunk_fn(backend)
        acc = student_logits.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(student_logits)
        scale = temperature / total
        for c in range(0, student_logits.shape[0], chunk):
            kl, grad[c:c + chunk] = fn(student_logits[c:c + chunk], teacher_logits[c:c + chunk],
                                       weights[c:c + chunk], temperature, scale)
            acc = acc + kl
        ctx.save_for_backward(grad)
        return temperature ** 2 * acc / total

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None, None, None


def kd_loss_chunked(student_logits: torch.Tensor, teacher: TeacherTargets, weights: torch.Tensor,
                    temperature: float = 1.0, chunk: int = 4096, compile_backend: str | None = None) -> torch.Tensor:
    """:func:`kd_loss` computed in row chunks with its gradient written in the same pass (no host sync, bounded
    memory; ``compile_backend``: each chunk's pass as one ``torch.compile`` graph, ``train.compile_loss``).

    Same value and gradient as :func:`kd_loss` (fp32). Unlike it, it does not check that the weights sum to a
    positive number (that check reads the device): an all-zero-weight batch gives loss 0 and zero gradient, and the
    training loop counts such batches and raises :class:`EmptyMaskError` at its next log step.

    Args:
        student_logits: ``[N, V_d]`` head logits (any float dtype; computed in fp32).
        teacher: :class:`TeacherTargets` at the same ``N`` positions.
        weights: ``[N]`` fp32 per-position weights (:func:`position_weights`; treated as constants).
        temperature: ``T > 0``.
        chunk: rows per chunk (bounds the fp32 ``[chunk, V_d]`` temporaries).
        compile_backend: a ``torch.compile`` backend for :func:`kl_chunk` (``None``: eager; ``inductor`` fuses the
            two log-softmaxes, the KL and the gradient into a few kernels; dynamic in the chunk's rows).

    Returns:
        Scalar fp32 loss.

    Raises:
        EmptyMaskError: ``N == 0`` (known from the shape, no sync).
        ValueError: shape mismatch or ``T <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"train.kd_temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher.logits_draft.shape:
        raise ValueError(f"head logits {tuple(student_logits.shape)} != teacher {tuple(teacher.logits_draft.shape)}")
    if student_logits.shape[0] == 0:
        raise EmptyMaskError("this batch has no loss position (empty assistant mask)")
    return _ChunkedKL.apply(student_logits, teacher.logits_draft, weights.detach().float(), float(temperature),
                            int(chunk), compile_backend)


@torch.no_grad()
def draft_overlap(student_logits: torch.Tensor, teacher: TeacherTargets, temperature: float = 1.0,
                  chunk: int = 1024) -> torch.Tensor:
    """Acceptance probability of a sampled draft: ``Σ_{v∈D} min(p_T(v), q_T(v))`` per position.

    Speculative sampling (``spd_ds.decoding.verify.verify_sampling``; Leviathan et al. 2023, Chen et al. 2023; the
    SPD paper's lossless verification at T > 0) accepts a draft ``x ~ q_T`` with probability ``min(1, p_T(x)/q_T(x))``,
    so its acceptance probability is ``Σ_v q_T(v)·min(1, p_T(v)/q_T(v)) = Σ_v min(p_T(v), q_T(v))``. Here ``p_T`` is
    the teacher's **full-vocabulary** distribution at temperature ``T`` (``exp(z/T − lse_full)`` at the draft ids,
    not renormalised: the mass outside ``D`` can never be drafted) and ``q_T = softmax(s/T)`` the head's over ``D``;
    plain temperature sampling (no top-k / top-p). At ``T → 0`` it tends to :func:`top1_agreement`.

    Args:
        student_logits: ``[N, V_d]`` head logits (any float dtype; computed in fp32).
        teacher: :class:`TeacherTargets` at the same ``N`` positions; its ``lse_full`` must be at ``temperature``
            (the teacher computes it at ``train.kd_temperature``).
        temperature: ``T > 0``.
        chunk: rows per chunk (bounds the fp32 ``[chunk, V_d]`` temporaries).
    Returns:
        ``[N]`` fp32 in ``[0, 1]``, on the head logits' device.
    Raises:
        ValueError: ``T <= 0`` or a shape mismatch.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher.logits_draft.shape:
        raise ValueError(f"head logits {tuple(student_logits.shape)} != teacher {tuple(teacher.logits_draft.shape)}")
    out = []
    for c in range(0, student_logits.shape[0], chunk):
        log_q = F.log_softmax(student_logits[c:c + chunk].float() / temperature, dim=-1)
        log_p = (teacher.logits_draft[c:c + chunk].to(log_q.device).float() / temperature
                 - teacher.lse_full[c:c + chunk, None].to(log_q.device).float())
        out.append(torch.minimum(log_p, log_q).exp().sum(-1).clamp(max=1.0))
    return torch.cat(out) if out else torch.zeros(0, device=student_logits.device)


@torch.no_grad()
def top1_agreement(student_logits: torch.Tensor, teacher: TeacherTargets, draft_ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the head's greedy draft (a target id) equals the teacher's full-vocabulary argmax."""
    drafted = draft_ids.to(student_logits.device)[student_logits.argmax(-1)]
    return drafted == teacher.argmax_full.to(drafted.device)
