"""Verification of the oldest draft by the token leaving the last stage (paper §3.3; Leviathan et al. 2023).

``verify_greedy`` is the T = 0 rule (exact match). ``verify_sampling`` is standard speculative sampling:
accept draft ``x ~ q`` with probability ``min(1, p(x) / q(x))``, otherwise resample from
``norm(max(0, p - q))``; the emitted token is then distributed exactly as ``p``.
"""

from __future__ import annotations

import torch

from spd_ds.decoding.sampling import STREAM_ACCEPT, STREAM_TARGET, logits_to_probs, sample_from_probs


def verify_greedy(target_logits: torch.Tensor, draft: int) -> tuple[bool, int]:
    """T = 0: accept iff ``draft == argmax(target_logits)``.

    Args:
        target_logits: ``[V]`` logits of the target at the position before the draft.
        draft: the drafted token id.
    Returns:
        ``(accepted, token)``; ``token`` is the draft when accepted, else the target's argmax (the replacement).
    """
    best = int(torch.argmax(target_logits).item())
    return best == draft, best


def verify_sampling(p: torch.Tensor, q: torch.Tensor, draft: int, u_accept: float,
                    u_resample: float) -> tuple[bool, int]:
    """T > 0: speculative sampling with residual resampling (lossless w.r.t. ``p``).

    Args:
        p: ``[V]`` fp32 warped target distribution.
        q: ``[V]`` fp32 distribution the draft was sampled from (one-hot for a deterministic proposal).
        draft: the drafted token (``q[draft] > 0``).
        u_accept, u_resample: independent uniforms in ``[0, 1)`` for this position.
    Returns:
        ``(accepted, token)``.
    """
    px, qx = float(p[draft]), float(q[draft])
    if qx > 0.0 and u_accept * qx <= px:
        return True, draft
    residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 1e-12:  # q dominates p everywhere it matters: the residual is p itself
        residual = p
    return False, sample_from_probs(residual, u_resample)


def verify_draft(target_logits: torch.Tensor, draft_token: int, q_full, position: int, sampling) -> tuple[bool, int]:
    """The verification step every decoder runs: greedy match at T = 0, speculative sampling at T > 0.

    Args:
        target_logits: ``[V]`` fp32 target logits at the position before the draft.
        draft_token: the drafted token at ``position``.
        q_full: callable ``(V, device) -> [V]`` giving the draft distribution (only called at T > 0).
        position: the draft's token position (keys the uniforms with the seed and request, see
            ``spd_ds.decoding.sampling``).
        sampling: :class:`~spd_ds.decoding.sampling.SamplingParams`.
    Returns:
        ``(accepted, token)``: the emitted token is the draft or the replacement.
    """
    if sampling.greedy:
        return verify_greedy(target_logits, draft_token)
    p = logits_to_probs(target_logits, sampling)
    q = q_full(p.shape[0], p.device)
    return verify_sampling(p, q, draft_token, sampling.uniform(position, STREAM_ACCEPT),
                           sampling.uniform(position, STREAM_TARGET))
