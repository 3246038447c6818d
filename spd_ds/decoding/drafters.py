"""Proposers behind one small interface: the SPD speculation head, and an oracle for systems benchmarks.

A drafter sees, each cycle, the pipeline *input* states (paper §3.4, "zero-bubble": drafting runs while the stages
compute): the rows of tokens completed since the last cycle (deepest type ``m-1``) and of every in-flight token at
its current depth (type ``f(d)``). It returns a :class:`Draft` for the position after the newest in-flight token.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import torch

from spd_ds.decoding.sampling import (
    STREAM_DRAFT, STREAM_ORACLE, SamplingParams, keyed_uniform, logits_to_probs, sample_from_probs,
)
from spd_ds.head import SpeculationHead


@dataclasses.dataclass
class Draft:
    """A drafted token and the distribution it was drawn from.

    Attributes:
        token: target-vocabulary id.
        q_draft: ``[V_d]`` fp32 draft distribution over ``draft_ids`` (T > 0), ``None`` for a deterministic proposal
            (greedy, or an oracle token: then ``q`` is one-hot at ``token``).
        draft_ids: ``[V_d]`` int64 ids that ``q_draft`` is over.
    """

    token: int
    q_draft: torch.Tensor | None = None
    draft_ids: torch.Tensor | None = None

    def q_full(self, vocab_size: int, device) -> torch.Tensor:
        """The draft distribution scattered over the full vocabulary ``[V]`` (fp32)."""
        q = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if self.q_draft is None:
            q[self.token] = 1.0
        else:
            q.index_copy_(0, self.draft_ids.to(device), self.q_draft.to(device))
        return q


class Drafter(Protocol):
    """What the decoders need from a proposer."""

    def start(self, prompt_feats: torch.Tensor) -> None:
        """Prompt anchors ``[s0, m, H]`` (all complete) after prefill; resets per-prompt state."""

    def propose(self, completed: torch.Tensor, inflight: torch.Tensor, inflight_types: Sequence[int],
                start_pos: int, sampling: SamplingParams) -> Draft:
        """Draft the token at position ``start_pos + len(completed) + len(inflight)``.

        Args:
            completed: ``[Rc, m, H]`` anchors of tokens completed since the last call (positions from ``start_pos``).
            inflight: ``[Ri, m, H]`` anchors of in-flight tokens, oldest first (entries past their type are zero).
            inflight_types: their aggregation types ``f(depth)``.
            start_pos: position of the first row.
            sampling: the decoding distribution (greedy draft at T = 0, else a keyed sample).

        Anchors are in the target's dtype on the head's device. Returns a :class:`Draft`: the token id (a target
        vocabulary id) and, at T > 0, its draft distribution ``q_draft`` (fp32 ``[V_d]``).
        """


class HeadDrafter:
    """The SPD speculation head with its own KV cache (holds exactly the committed completed prefix). On GPU,
    :class:`~spd_ds.decoding.head_graph.GraphedHeadDrafter` computes the same over a static cache as one CUDA graph.

    Args:
        head: a :class:`~spd_ds.head.SpeculationHead`.
        max_len: KV capacity in positions.
        dtype, device: compute dtype/device of the head.
    """

    def __init__(self, head: SpeculationHead, max_len: int, dtype: torch.dtype, device) -> None:
        self.head = head.to(device=device, dtype=dtype).eval()
        self.head.rotary.inv_freq = self.head.rotary.inv_freq.float()
        self.m = head.partition.num_types
        self.dtype, self.device = dtype, torch.device(device)
        self.cache = head.new_cache(max_len, dtype, device)

    @torch.no_grad()
    def start(self, prompt_feats: torch.Tensor) -> None:
        """Commit the prompt's rows (``prompt_feats [s0, m, H]``, all at the deepest type) to the head's KV cache."""
        self.cache.reset()
        s0 = prompt_feats.shape[0]
        rows = self.head.aggregate(prompt_feats.to(self.dtype), [self.m - 1] * s0)
        self.head.tower(rows[None], torch.arange(s0, device=self.device), self.cache)

    @torch.no_grad()
    def propose(self, completed, inflight, inflight_types, start_pos, sampling) -> Draft:
        """See :class:`Drafter`. Rows of ``completed`` are committed to the cache; in-flight rows are not (their depth
        changes next cycle). Raises RuntimeError if ``start_pos`` is not the cache length (a broken cycle)."""
        C = self.cache.length
        if C != start_pos:
            raise RuntimeError(f"head cache holds {C} positions but the window starts at {start_pos}")
        feats = torch.cat([completed, inflight]).to(self.dtype)
        types = [self.m - 1] * completed.shape[0] + list(inflight_types)
        rows = self.head.aggregate(feats, types)
        R = rows.shape[0]
        h = self.head.tower(rows[None], torch.arange(C, C + R, device=self.device), self.cache)
        self.cache.crop(C + completed.shape[0])  # commit only the rows whose depth will not change
        logits = self.head.logits(h[0, -1])
        return draft_from_logits(logits, self.head.draft_ids, sampling, C + R)


def draft_from_logits(logits: torch.Tensor, draft_ids: torch.Tensor, sampling: SamplingParams, position: int) -> Draft:
    """Turn draft-vocabulary logits ``[V_d]`` into a :class:`Draft` for ``position`` (argmax, or a keyed sample)."""
    if sampling.greedy:
        return Draft(int(draft_ids[torch.argmax(logits)]))  # one host read
    q = logits_to_probs(logits, sampling)
    idx = sample_from_probs(q, sampling.uniform(position, STREAM_DRAFT))
    return Draft(int(draft_ids[idx]), q, draft_ids)


def oracle_reference_sampling(sampling: SamplingParams) -> SamplingParams:
    """How an :class:`OracleDrafter`'s reference run decodes, whatever the generation's ``sampling``: greedily.

    Speculative sampling is exact only when a draft does not depend on the uniforms that verify it (``STREAM_ACCEPT``
    and ``STREAM_TARGET`` at its position). A reference sampled at T > 0 with the generation's own uniforms proposes
    exactly the token that a rejection resamples and biases the output; the greedy continuation depends on no
    uniform, and proposes the target's likeliest token (at T = 0 it is the generation itself).
    """
    return dataclasses.replace(sampling, temperature=0.0, top_k=0, top_p=1.0)


def oracle_reference(target, prompt: Sequence[int], num_new: int, sampling: SamplingParams,
                     eos_token_ids: Sequence[int], max_len: int) -> list[int]:
    """An :class:`OracleDrafter`'s reference for one generation: ``prompt`` + the target's greedy continuation
    (:func:`oracle_reference_sampling`).

    Args:
        target: the :class:`~spd_ds.models.adapter.Target` (or a view of it) the generation runs on.
        prompt: token ids; num_new: continuation tokens (the generation's ``max_new_tokens`` + n covers every
            position the oracle can be asked for), capped at what ``max_len`` holds beside the prompt (AR keeps one
            position in flight): a generation that fits ``max_len`` exactly gets a reference one token shorter, and
            past its end the oracle proposes as when its coin fails.
        sampling: the generation's own parameters.
        eos_token_ids, max_len: as for :class:`~spd_ds.decoding.ar.ARDecoder` (the continuation may end at EOS).
    Returns:
        ``list(prompt) + continuation``.
    Raises:
        PromptError: the prompt leaves no room for one new token in ``max_len`` (or is empty).
    """
    from spd_ds.decoding.ar import ARDecoder

    ar = ARDecoder(target, oracle_reference_sampling(sampling), eos_token_ids, max_len)
    num_new = max(1, min(num_new, max_len - len(prompt) - 1))
    return list(prompt) + ar.generate(list(prompt), num_new).tokens


class OracleDrafter:
    """Systems-benchmark and test proposer: the target's own next token with probability ``alpha``.

    Args:
        reference: token ids of a prior greedy AR run (prompt + continuation) of the same target
            (:func:`oracle_reference`; a sampled one would bias the output at T > 0); ``reference[t]`` is
            proposed for position ``t``.
        alpha: probability of proposing the reference token (seeded coin per position).
        base: optional drafter that is still run every cycle (its state stays exact) and proposes when the coin fails;
            without one, a failed coin proposes a token that differs from the reference (a sure rejection at T = 0).
        vocab_size: target vocabulary size (for the "wrong token").
        seed: coin key (with the request of the ``sampling`` passed to :meth:`propose`).
    """

    def __init__(self, reference: Sequence[int], alpha: float = 1.0, base: Drafter | None = None,
                 vocab_size: int | None = None, seed: int = 1234) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"oracle alpha must be in [0, 1], got {alpha}")
        if base is None and vocab_size is None:
            raise ValueError("OracleDrafter needs a base drafter or the vocabulary size")
        self.reference, self.alpha, self.base, self.vocab_size, self.seed = (list(reference), alpha, base,
                                                                             vocab_size, seed)

    def start(self, prompt_feats: torch.Tensor) -> None:
        """Start the base drafter, if any (the oracle itself keeps no per-prompt state)."""
        if self.base is not None:
            self.base.start(prompt_feats)

    def propose(self, completed, inflight, inflight_types, start_pos, sampling) -> Draft:
        """See :class:`Drafter`: the reference token with probability ``alpha`` (deterministic, ``q`` one-hot), else
        the base drafter's draft or a sure-to-be-rejected token."""
        pos = start_pos + completed.shape[0] + inflight.shape[0]
        base = self.base.propose(completed, inflight, inflight_types, start_pos, sampling) if self.base else None
        coin = keyed_uniform(self.seed, pos, STREAM_ORACLE, sampling.request)
        hit = pos < len(self.reference) and coin < self.alpha
        if hit:
            return Draft(self.reference[pos])
        if base is not None:
            return base
        ref = self.reference[pos] if pos < len(self.reference) else 0
        return Draft((ref + 1) % self.vocab_size)
