"""Autoregressive (AR) decoding on the same stage code: the exactness reference and the AR baseline."""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.decoding.cycle import GenerationResult, TokenOutput, check_prompt, eos_set, first_token
from spd_ds.decoding.reference import prefill
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.stopping import StopStrings
from spd_ds.models.adapter import Target


class ARDecoder:
    """One token per step through all stages of a :class:`~spd_ds.models.adapter.Target`.

    Sampling uses the same position-keyed uniforms as SPD's target stream, so at T = 0 the output equals SPD's token
    for token (same kernels, same order of operations per token). It stops where SPD does (:class:`TokenOutput`):
    at an EOS of ``eos_token_ids``, at one of ``stop_strings`` (:class:`~spd_ds.decoding.stopping.StopStrings`) or
    after ``max_new_tokens``.
    """

    def __init__(self, target: Target, sampling: SamplingParams = SamplingParams(),
                 eos_token_ids: int | Iterable[int] | None = None, max_len: int = 4096, *,
                 stop_strings: StopStrings | None = None) -> None:
        self.target, self.sampling = target, sampling
        self.stop = stop_strings
        self.eos = eos_set(eos_token_ids)
        self.max_len = min(max_len, target.arch.max_positions)
        self.caches = target.new_caches(self.max_len)

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """Greedy or sampled AR continuation of ``prompt``; same contract as the SPD decoders.

        Raises:
            PromptError: empty or too long prompt.
        """
        target = self.target
        check_prompt(prompt, max_new_tokens, self.max_len, 1, target.arch.max_positions,
                     target.arch.max_positions_source)
        for c in self.caches:
            c.reset()
        metrics = SPDMetrics(num_stages=1)
        t0 = time.perf_counter()
        logits, _ = prefill(target, self.caches, prompt)
        pos = len(prompt)
        tok = first_token(logits, self.sampling, pos)
        metrics.observe_prefill(time.perf_counter() - t0)
        out = TokenOutput(self.eos, max_new_tokens, self.stop)
        out.emit(tok)
        t1 = time.perf_counter()
        while not out.finished:
            h = target.ends.embed(torch.tensor([[tok]], device=target.device))
            p = torch.tensor([pos], device=target.device)
            for s, stage in enumerate(target.stages):
                h, _ = stage(h, p, self.caches[s])
            pos += 1
            tok = first_token(target.ends.logits(h[0, 0]), self.sampling, pos)
            out.emit(tok)
            metrics.observe_cycle()
        return out.result(metrics, time.perf_counter() - t1)
