"""The single-process reference decoder: SPD's executable specification, and the CPU path.

One process runs the ``n`` stages in turn, but every cycle has exactly the semantics of the distributed engine
(paper §3; ``SPD_REFERENCE_NOTES.md`` §3):

1. **draft** from the pipeline *input* states: rows of the tokens completed since the last cycle (type ``m-1``)
   and of each in-flight token at its current depth ``d`` (type ``f(d)``); the head predicts the token after
   the newest in-flight one (it runs concurrently with step 2 in the engine);
2. **stage forwards**: the in-flight token at depth ``d`` runs stage ``d`` (one token per stage);
3. the draft enters the pipeline at depth 0;
4. **verify**: if the oldest token just left the last stage, its logits verify the token after it
   (T = 0 exact match; T > 0 speculative sampling); on rejection, **roll back**: crop every stage's KV cache to
   the verified prefix, flush the in-flight tokens and restart the pipeline from the replacement token.

Only verified tokens are ever returned. A draft is verified ``n - 1`` cycles after it enters; a rejection costs
``n - 1`` cycles without verification.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Sequence

import torch

from spd_ds.decoding.drafters import Draft, Drafter
from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.decoding.sampling import STREAM_TARGET, SamplingParams, logits_to_probs, sample_from_probs
from spd_ds.decoding.verify import verify_draft
from spd_ds.models.adapter import Target


class PromptError(ValueError):
    """An empty prompt or one that leaves no room for generation."""


@dataclasses.dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        tokens: new verified token ids (the prefill token first), at most ``max_new_tokens``.
        finish_reason: ``"eos"`` or ``"length"``.
        metrics: :class:`~spd_ds.decoding.metrics.SPDMetrics`.
    """

    tokens: list[int]
    finish_reason: str
    metrics: SPDMetrics


@dataclasses.dataclass
class _InFlight:
    pos: int
    token: int
    hidden: torch.Tensor  # [1, 1, H] input of the next stage
    feats: torch.Tensor  # [m, H] anchors gathered so far (zeros beyond the depth)
    depth: int = 0
    verified: bool = False
    fill: int = 0  # tokens in flight when this token was drafted
    draft: Draft | None = None


def check_prompt(prompt: Sequence[int], max_new_tokens: int, max_positions: int, num_stages: int) -> None:
    """Raise :class:`PromptError` for an empty prompt or one that does not fit the context with its generation."""
    if len(prompt) == 0:
        raise PromptError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise PromptError(f"decoding.max_new_tokens must be >= 1, got {max_new_tokens}")
    need = len(prompt) + max_new_tokens + num_stages
    if need > max_positions:
        raise PromptError(
            f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} (+{num_stages} in flight) exceeds the "
            f"context of {max_positions} positions (decoding.max_length, at most the model's maximum); shorten the "
            "prompt, lower decoding.max_new_tokens or raise decoding.max_length"
        )


def eos_set(eos: int | Iterable[int] | None) -> frozenset[int]:
    """EOS ids as a set (``None`` -> empty: never stop early)."""
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset([eos])
    return frozenset(int(e) for e in eos)


@torch.no_grad()
def prefill(target: Target, caches, prompt: Sequence[int]):
    """Run the prompt through all stages.

    Returns:
        ``(logits [V] fp32 at the last prompt position, feats [s0, m, H])`` where ``feats`` are the raw anchor states.
    """
    part = target.partition
    ids = torch.tensor([list(prompt)], device=target.device)
    s0 = ids.shape[1]
    h = target.ends.embed(ids)
    pos = torch.arange(s0, device=target.device)
    feats = h.new_zeros(s0, part.num_types, h.shape[-1])
    k_of = {a: k for k, a in enumerate(part.anchors)}
    feats[:, 0] = h[0]
    for s, stage in enumerate(target.stages):
        h, captured = stage(h, pos, caches[s])
        for j, t in captured.items():
            feats[:, k_of[j]] = t[0]
    return target.ends.logits(h[0, -1]), feats


def first_token(logits: torch.Tensor, sampling: SamplingParams, position: int) -> int:
    """The token taken from the prefill logits (argmax, or a keyed sample of the warped distribution)."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    return sample_from_probs(logits_to_probs(logits, sampling), sampling.uniform(position, STREAM_TARGET))


class SPDReferenceDecoder:
    """Single-process SPD over a :class:`~spd_ds.models.adapter.Target` split into stages.

    Args:
        target: the target (stages + embedding/norm/LM head).
        drafter: a :class:`~spd_ds.decoding.drafters.Drafter` (speculation head or oracle).
        sampling: :class:`~spd_ds.decoding.sampling.SamplingParams`.
        eos_token_ids: ids that end generation (a set; ``None`` = none).
        max_len: KV capacity in positions (prompt + new tokens + n).
    """

    def __init__(self, target: Target, drafter: Drafter, sampling: SamplingParams = SamplingParams(),
                 eos_token_ids: int | Iterable[int] | None = None, max_len: int = 4096) -> None:
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.partition = target.partition
        self.eos = eos_set(eos_token_ids)
        self.max_len = min(max_len, target.arch.max_positions)
        self.caches = target.new_caches(self.max_len)

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """Generate up to ``max_new_tokens`` verified tokens after ``prompt`` (token ids).

        Raises:
            PromptError: empty prompt, or prompt + generation longer than the context.
        """
        part, target, sampling = self.partition, self.target, self.sampling
        n, m = part.num_stages, part.num_types
        check_prompt(prompt, max_new_tokens, self.max_len, n)
        f = part.depth_to_type
        k_of = {a: k for k, a in enumerate(part.anchors)}
        metrics = SPDMetrics(num_stages=n)
        for c in self.caches:
            c.reset()
        s0 = len(prompt)

        t0 = time.perf_counter()
        logits, prompt_feats = prefill(target, self.caches, prompt)
        tok = first_token(logits, sampling, s0)
        self.drafter.start(prompt_feats)
        metrics.prefill_s = time.perf_counter() - t0

        out = [tok]
        if tok in self.eos or max_new_tokens == 1:
            metrics.num_new_tokens = 1
            return GenerationResult(out, "eos" if tok in self.eos else "length", metrics)

        def enter(pos: int, token: int, verified: bool, fill: int = 0, draft: Draft | None = None) -> _InFlight:
            h = target.ends.embed(torch.tensor([[token]], device=target.device))
            feats = h.new_zeros(m, h.shape[-1])
            feats[0] = h[0, 0]
            return _InFlight(pos, token, h, feats, verified=verified, fill=fill, draft=draft)

        pipeline: list[_InFlight] = [enter(s0, tok, True)]  # oldest first
        completed: list[torch.Tensor] = []  # anchors of completed tokens not yet committed to the head cache
        head_start = s0  # first position not committed to the head cache
        finish = None
        t_dec = time.perf_counter()
        while finish is None:
            metrics.num_cycles += 1
            # 1. draft from the pipeline input states
            t = time.perf_counter()
            inflight = torch.stack([e.feats for e in pipeline])
            comp = torch.stack(completed) if completed else inflight.new_zeros(0, m, inflight.shape[-1])
            draft = self.drafter.propose(comp, inflight, [f[e.depth] for e in pipeline], head_start, sampling)
            head_start += len(completed)
            completed = []
            metrics.head_s += time.perf_counter() - t
            # 2. stage forwards, oldest (deepest) first
            for e in pipeline:
                t = time.perf_counter()
                s = e.depth
                e.hidden, captured = target.stages[s](e.hidden, torch.tensor([e.pos], device=target.device),
                                                      self.caches[s])
                for j, hj in captured.items():
                    e.feats[k_of[j]] = hj[0, 0]
                e.depth += 1
                metrics.stage_forward_s[s] += time.perf_counter() - t
            # 3. the draft enters at depth 0
            newest = pipeline[-1].pos
            pipeline.append(enter(newest + 1, draft.token, False, fill=len(pipeline), draft=draft))
            # 4. verify the token after the oldest, if the oldest has left the last stage
            oldest = pipeline[0]
            if oldest.depth < n:
                continue
            t = time.perf_counter()
            cand = pipeline[1]
            logits = target.ends.logits(oldest.hidden[0, 0])
            ok, token = verify_draft(logits, cand.token, cand.draft.q_full, cand.pos, sampling)
            metrics.num_drafts += 1
            metrics.drafts_by_fill[cand.fill] += 1
            completed.append(oldest.feats)
            pipeline.pop(0)
            if ok:
                metrics.num_accepted_tokens += 1
                metrics.accepted_by_fill[cand.fill] += 1
                cand.verified = True
            else:  # roll back: keep positions <= oldest.pos, flush, restart from the replacement
                metrics.num_rollbacks += 1
                for c in self.caches:
                    c.crop(cand.pos)
                pipeline = [enter(cand.pos, token, True)]
            out.append(token)
            metrics.verify_s += time.perf_counter() - t
            if token in self.eos:
                finish = "eos"
            elif len(out) >= max_new_tokens:
                finish = "length"
        metrics.decode_s = time.perf_counter() - t_dec
        metrics.num_new_tokens = len(out)
        metrics.control_s = max(0.0, metrics.decode_s - metrics.head_s - metrics.verify_s - sum(metrics.stage_forward_s))
        return GenerationResult(out, finish, metrics)
