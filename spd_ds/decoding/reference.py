"""The single-process reference decoder: SPD's executable specification, and the CPU path.

One process runs the ``n`` stages in turn; the cycle itself is :class:`~spd_ds.decoding.cycle.SPDGeneration`, the same
code the distributed engine's head rank drives (paper §3):

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

import time
from typing import Callable, Iterable, Sequence

import torch

from spd_ds.decoding.cycle import (Anchors, GenerationResult, PromptError, RollbackPlan, SPDGeneration, check_prompt,
                                   eos_set, first_token)
from spd_ds.decoding.drafters import Drafter
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.stopping import StopStrings
from spd_ds.models.adapter import Target

__all__ = ["GenerationResult", "PromptError", "SPDReferenceDecoder", "check_prompt", "eos_set", "first_token",
           "prefill"]


@torch.no_grad()
def prefill(target: Target, caches, prompt: Sequence[int]):
    """Run the prompt through all stages (their caches start empty).

    Returns:
        ``(logits [V] fp32 at the last prompt position, feats [s0, m, H])`` where ``feats`` are the raw anchor states.
    """
    anchors = Anchors(target.partition)
    ids = torch.tensor([list(prompt)], device=target.device)
    s0 = ids.shape[1]
    h = target.ends.embed(ids)
    pos = torch.arange(s0, device=target.device)
    feats = anchors.rows(h[0])
    for s, stage in enumerate(target.stages):
        h, captured = stage(h, pos, caches[s])
        anchors.store(feats, captured)
    return target.ends.logits(h[0, -1]), feats


class SPDReferenceDecoder:
    """Single-process SPD over a :class:`~spd_ds.models.adapter.Target` split into stages.

    Args:
        target: the target (stages + embedding/norm/LM head).
        drafter: a :class:`~spd_ds.decoding.drafters.Drafter` (speculation head or oracle).
        sampling: :class:`~spd_ds.decoding.sampling.SamplingParams`.
        eos_token_ids: ids that end generation (a set; ``None`` = none).
        max_len: KV capacity in positions (prompt + new tokens + n).
        stop_strings: end a generation once its text contains one of these
            (:class:`~spd_ds.decoding.stopping.StopStrings`; ``None`` = none).
    """

    def __init__(self, target: Target, drafter: Drafter, sampling: SamplingParams = SamplingParams(),
                 eos_token_ids: int | Iterable[int] | None = None, max_len: int = 4096, *,
                 stop_strings: StopStrings | None = None) -> None:
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.stop = stop_strings
        self.partition = target.partition
        self.eos = eos_set(eos_token_ids)
        self.max_len = min(max_len, target.arch.max_positions)
        self.caches = target.new_caches(self.max_len)

    def _embed(self, token: int) -> torch.Tensor:
        return self.target.ends.embed(torch.tensor([[token]], device=self.target.device))

    def _rewind(self, plan: RollbackPlan) -> None:
        for c in self.caches:  # keep the verified prefix
            c.crop(plan.keep)

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, *,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` verified tokens after ``prompt`` (token ids); ``on_token`` is called with
        each verified token as it is returned (streaming).

        Raises:
            PromptError: empty prompt, or prompt + generation longer than the context.
        """
        target, n = self.target, self.partition.num_stages
        check_prompt(prompt, max_new_tokens, self.max_len, n, target.arch.max_positions,
                     target.arch.max_positions_source)
        for c in self.caches:
            c.reset()
        gen = SPDGeneration(self.partition, self.drafter, self.sampling, self.eos, max_new_tokens, self._embed,
                            target.ends.logits, self._rewind, stop=self.stop, on_token=on_token)
        t0 = time.perf_counter()
        logits, prompt_feats = prefill(target, self.caches, prompt)
        gen.start(len(prompt), logits, prompt_feats, since=t0)
        t_dec = time.perf_counter() if not gen.finished else None
        while not gen.finished:
            view, at_stage = gen.begin_cycle()  # 1. the draft's view; every in-flight token moves one stage
            draft = gen.propose(view)  # 1. draft (beside the stage forwards in the engine)
            for s, e in at_stage.items():  # 2. stage forwards, oldest (deepest) first
                t = time.perf_counter()
                e.hidden, captured = target.stages[s](e.hidden, torch.tensor([e.pos], device=target.device),
                                                      self.caches[s])
                gen.anchors.store(e.feats, captured)
                gen.metrics.observe_time("stage_forward", time.perf_counter() - t, stage=s)
            gen.enter_draft(draft)  # 3. the draft enters at depth 0
            if gen.verifiable:  # 4. verify the token after the oldest; on rejection roll back
                gen.verify()
                if gen.rejected:
                    gen.rollback()
        decode_s = time.perf_counter() - t_dec if t_dec is not None else None
        return gen.result(decode_s, split_stages=range(n))
