"""The SPD cycle, written once: the state of one generation and every change a cycle makes to it (paper §3).

Both drivers run this code: the single-process reference decoder (:mod:`spd_ds.decoding.reference`) with local
stage calls, and the DeepSpeed engine's head rank (:mod:`spd_ds.pipe.spd_head`) with instructions and links. A driver
only says *where* each stage forward runs and *when* its result arrives; what the cycle does with tokens, anchors,
drafts, verification, rollback, stopping and metrics is decided here, and nothing here knows of processes.

Follow one token through :class:`SPDGeneration` (``n`` stages, ``m`` aggregation types, ``f`` = depth -> type):

1. it **enters** at depth 0 (:meth:`~SPDGeneration.enter`): the prefill token (:meth:`~SPDGeneration.start`), a draft
   (:meth:`~SPDGeneration.enter_draft`) or a replacement after a rollback. Its anchor rows ``[m, H]`` hold its
   embedding as type 0, zeros elsewhere;
2. each cycle begins with the **draft's view** (:meth:`~SPDGeneration.begin_cycle`, paper §3.4): the rows of the
   tokens completed since the last cycle (type ``m - 1``, the *pending rows*, committed to the head's cache by this
   view) and of every in-flight token at its current depth ``d`` (type ``f(d)``). Then every in-flight token moves one
   stage: the driver runs stage ``d`` on it and stores the states that stage captured (:meth:`Anchors.store`);
3. the drafter proposes the token after the newest in-flight one from that view (:meth:`~SPDGeneration.propose`; in
   the engine beside the stage forwards) and the draft enters at depth 0;
4. once the oldest token has left the last stage, its logits **verify** the token after it
   (:meth:`~SPDGeneration.verify`: exact match at T = 0, speculative sampling at T > 0, paper §3.3). The oldest
   token becomes a pending row; the verified token is returned. On rejection the :class:`RollbackPlan` says which
   stage drops how many positions, and :meth:`~SPDGeneration.rollback` (the one place a rollback happens) applies it
   through the driver's ``rewind``, flushes the in-flight tokens and restarts from the replacement;
5. the generation **stops** at an EOS, at a stop string (:mod:`spd_ds.decoding.stopping`) or after ``max_new_tokens``
   verified tokens (:class:`TokenOutput`).

Only verified tokens are returned. A draft is verified ``n - 1`` cycles after it enters; a rejection costs ``n - 1``
cycles without verification. Randomness is keyed by position (:mod:`spd_ds.decoding.sampling`): the keys are made in
:func:`first_token`, :func:`~spd_ds.decoding.verify.verify_draft` and the drafters, nowhere else.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

from spd_ds.decoding.drafters import Draft, Drafter
from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.decoding.sampling import STREAM_TARGET, SamplingParams, logits_to_probs, sample_from_probs
from spd_ds.decoding.stopping import StopStrings
from spd_ds.decoding.verify import verify_draft
from spd_ds.partition import StagePartition


class PromptError(ValueError):
    """An empty prompt or one that leaves no room for generation."""


@dataclasses.dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        tokens: new verified token ids (the prefill token first), at most ``max_new_tokens``.
        finish_reason: ``"eos"``, ``"stop"`` (a stop string) or ``"length"``.
        metrics: :class:`~spd_ds.decoding.metrics.SPDMetrics`.
    """

    tokens: list[int]
    finish_reason: str
    metrics: SPDMetrics


def check_prompt(prompt: Sequence[int], max_new_tokens: int, max_positions: int, num_stages: int,
                 model_max: int | None = None, model_max_source: str = "max_position_embeddings") -> None:
    """Raise :class:`PromptError` for an empty prompt or one that does not fit the context with its generation.

    ``max_positions`` is ``decoding.max_length`` capped at the model's maximum ``model_max`` (when known): a prompt
    and generation longer than the model's maximum is not advised to raise ``decoding.max_length``.
    ``model_max_source`` is the config.json key that sets ``model_max``
    (:attr:`~spd_ds.models.adapter.TargetArch.max_positions_source`): ``"sliding_window"`` (a window over every layer,
    within which full attention is exact) is named as such.

    Raises:
        PromptError: an empty prompt, ``max_new_tokens < 1``, or ``len(prompt) + max_new_tokens + num_stages`` over
            ``max_positions``.
    """
    if len(prompt) == 0:
        raise PromptError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise PromptError(f"decoding.max_new_tokens must be >= 1, got {max_new_tokens}")
    need = len(prompt) + max_new_tokens + num_stages
    if need > max_positions and model_max is not None and need > model_max:  # raising max_length cannot help
        context = (f"sliding-window context of {model_max} positions (config.json sliding_window; full attention is "
                   "exact only within it)" if model_max_source == "sliding_window"
                   else f"maximum context of {model_max} positions")
        raise PromptError(
            f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} (+{num_stages} in flight) exceeds the "
            f"model's {context}; shorten the prompt or lower decoding.max_new_tokens"
        )
    if need > max_positions:
        raise PromptError(
            f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} (+{num_stages} in flight) exceeds the "
            f"context of {max_positions} positions (decoding.max_length, at most the model's maximum); shorten the "
            "prompt, lower decoding.max_new_tokens or raise decoding.max_length"
            + (f" (to at most {model_max})" if model_max is not None else "")
        )


def eos_set(eos: int | Iterable[int] | None) -> frozenset[int]:
    """EOS ids as a set (``None`` -> empty: never stop early)."""
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset([eos])
    return frozenset(int(e) for e in eos)


def first_token(logits: torch.Tensor, sampling: SamplingParams, position: int) -> int:
    """The target's token at ``position`` from its logits ``[V]`` (fp32): the argmax at T = 0, else a sample of the
    warped distribution keyed by ``(seed, request, position, STREAM_TARGET)``. Used for the prefill token and by AR
    decoding."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    return sample_from_probs(logits_to_probs(logits, sampling), sampling.uniform(position, STREAM_TARGET))


class TokenOutput:
    """The verified tokens of one generation and its stop conditions, the one place every decoder stops.

    Args:
        eos: ids that end the generation.
        max_new_tokens: at most this many tokens (the prefill token included).
        stop: stop strings (:class:`~spd_ds.decoding.stopping.StopStrings`), or ``None``.
        on_token: called with every returned token id as it is returned (streaming), or ``None``.
    """

    def __init__(self, eos: frozenset[int], max_new_tokens: int, stop: StopStrings | None = None,
                 on_token: Callable[[int], None] | None = None) -> None:
        self.eos, self.max_new_tokens, self.stop, self.on_token = eos, int(max_new_tokens), stop, on_token
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        """Whether an EOS, a stop string or the length limit was reached."""
        return self.finish_reason is not None

    def emit(self, token: int) -> bool:
        """Return ``token``; stop at an EOS (``"eos"``), when the text now contains a stop string (``"stop"``) or at
        the length limit (``"length"``), in that order. Returns :attr:`finished`."""
        self.tokens.append(token)
        if self.on_token is not None:
            self.on_token(token)
        if token in self.eos:
            self.finish_reason = "eos"
        elif self.stop is not None and self.stop.hit(self.tokens):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finished

    def result(self, metrics: SPDMetrics, decode_s: float | None = None,
               split_stages: Iterable[int] | None = None) -> GenerationResult:
        """Close ``metrics`` (see :meth:`SPDMetrics.close`) and return the :class:`GenerationResult`."""
        metrics.close(len(self.tokens), decode_s, split_stages=split_stages)
        return GenerationResult(self.tokens, self.finish_reason or "length", metrics)


class Anchors:
    """Where the states a stage captures go in a token's anchor rows: anchor layer ``partition.anchors[k]`` is type
    ``k`` (type 0 is the embedding; paper §3.2 multi-depth aggregation).

    Args:
        partition: the :class:`~spd_ds.partition.StagePartition`.
    """

    def __init__(self, partition: StagePartition) -> None:
        self.m = partition.num_types
        self.k_of = {a: k for k, a in enumerate(partition.anchors)}

    def rows(self, embedded: torch.Tensor) -> torch.Tensor:
        """Anchor rows ``[q, m, H]`` (the embedding's dtype and device) of ``q`` tokens embedded as ``[q, H]``: type 0
        is the embedding, the other types are zero until their stage has run."""
        feats = embedded.new_zeros(embedded.shape[0], self.m, embedded.shape[-1])
        feats[:, 0] = embedded
        return feats

    def store(self, feats: torch.Tensor, captured: dict[int, torch.Tensor]) -> None:
        """Copy captured states into anchor rows ``feats`` (``[q, m, H]``, or ``[m, H]`` for one token) in place.

        Args:
            captured: anchor layer ``j`` -> its output for those ``q`` tokens (``[1, q, H]``, ``[q, H]`` or ``[H]``,
                as a stage returns it or as it arrived); layers that are not anchors are skipped.
        """
        for j, state in captured.items():
            k = self.k_of.get(j)
            if k is not None:
                row = feats.select(-2, k)
                row.copy_(state.reshape(row.shape))


@dataclasses.dataclass
class InFlight:
    """A token in the pipeline (oldest first in :attr:`SPDGeneration.pipeline`).

    Attributes:
        pos: its position.
        token: its id.
        hidden: ``[1, 1, H]`` the input of the stage at ``depth``; once it has left the last stage, that stage's output.
        feats: ``[m, H]`` anchor rows gathered so far (zeros beyond its depth); ``None`` when no drafter needs them.
        seq: the driver's message number (the engine drops messages of flushed tokens by it).
        depth: stages it has passed (``n``: it left the pipeline).
        verified: the prefill token, a replacement, or an accepted draft.
        fill: tokens in flight when it was drafted.
        draft: the :class:`~spd_ds.decoding.drafters.Draft` it came from (``None`` for verified tokens).
    """

    pos: int
    token: int
    hidden: torch.Tensor
    feats: torch.Tensor | None
    seq: int = 0
    depth: int = 0
    verified: bool = False
    fill: int = 0
    draft: Draft | None = None


class DraftView(NamedTuple):
    """The drafter's inputs of one cycle (see :meth:`~spd_ds.decoding.drafters.Drafter.propose`): ``completed``
    ``[Rc, m, H]`` pending rows, ``inflight`` ``[Ri, m, H]`` rows of the in-flight tokens (oldest first), their
    aggregation ``types`` ``f(depth)``, and ``start_pos``, the position of the first row."""

    completed: torch.Tensor
    inflight: torch.Tensor
    types: list[int]
    start_pos: int


@dataclasses.dataclass(frozen=True)
class RollbackPlan:
    """What a rejection undoes: every stage keeps positions ``[0, keep)``, stage ``s`` drops its ``drop[s]`` newest
    positions (those of the flushed tokens it has run), and ``token`` enters at position ``keep``.

    A stage whose state cannot simply be cut (a recurrent or linear-attention state) restores the state it had after
    ``keep`` positions from here; caches of keys and values crop to ``keep``.
    """

    keep: int
    token: int
    drop: tuple[int, ...]


class SPDGeneration:
    """One SPD generation's state and cycle (paper §3: drafting from the pipeline's input states §3.4, multi-depth
    aggregation types §3.2, verification §3.3; see the module docstring for a token's way through it).

    Args:
        partition: the :class:`~spd_ds.partition.StagePartition` (``n``, ``f``, anchors).
        drafter: the :class:`~spd_ds.decoding.drafters.Drafter`.
        sampling: :class:`~spd_ds.decoding.sampling.SamplingParams`.
        eos: ids that end the generation.
        max_new_tokens: limit, the prefill token included.
        embed: ``token id -> [1, 1, H]`` input of stage 0 (the target's embedding).
        logits: ``[H]`` last-stage output -> ``[V]`` fp32 logits (final norm and LM head).
        rewind: applies a :class:`RollbackPlan` to the stages the driver holds (called once per rollback).
        new_seq: message numbers for entering tokens (default: 1, 2, ...).
        metrics: where to observe (default: a new :class:`~spd_ds.decoding.metrics.SPDMetrics`).
        stop: stop strings (:class:`~spd_ds.decoding.stopping.StopStrings`), or ``None``.
        on_token: called with every verified token as it is returned (streaming), or ``None``.

    Attributes:
        pipeline: the in-flight :class:`InFlight` tokens, oldest (deepest) first.
        completed: pending rows ``[m, H]`` of tokens that left the pipeline, committed by the next view.
        head_start: the first position not committed to the drafter's cache.
        out: the :class:`TokenOutput`.
        plan: the pending :class:`RollbackPlan` after a rejection (``None`` otherwise).
    """

    def __init__(self, partition: StagePartition, drafter: Drafter, sampling: SamplingParams, eos: frozenset[int],
                 max_new_tokens: int, embed: Callable[[int], torch.Tensor],
                 logits: Callable[[torch.Tensor], torch.Tensor], rewind: Callable[[RollbackPlan], None], *,
                 new_seq: Callable[[], int] | None = None, metrics: SPDMetrics | None = None,
                 stop: StopStrings | None = None, on_token: Callable[[int], None] | None = None) -> None:
        self.n, self.f = partition.num_stages, partition.depth_to_type
        self.anchors = Anchors(partition)
        self.drafter, self.sampling = drafter, sampling
        self.embed, self.logits, self.rewind = embed, logits, rewind
        self.new_seq = new_seq or itertools.count(1).__next__
        self.metrics = metrics or SPDMetrics(num_stages=self.n)
        self.out = TokenOutput(eos, max_new_tokens, stop, on_token)
        self.pipeline: list[InFlight] = []
        self.completed: list[torch.Tensor] = []
        self.head_start = 0
        self.plan: RollbackPlan | None = None

    # ------------------------------------------------------------------ state
    @property
    def finished(self) -> bool:
        """Whether the generation stopped (EOS, stop string or length)."""
        return self.out.finished

    @property
    def rejected(self) -> bool:
        """Whether the last verification rejected its draft and :meth:`rollback` is due."""
        return self.plan is not None

    @property
    def newest(self) -> InFlight:
        """The newest in-flight token: the one entering stage 0 next."""
        return self.pipeline[-1]

    @property
    def verifiable(self) -> bool:
        """Whether the oldest token has left the last stage (its output verifies the token after it)."""
        return self.pipeline[0].depth >= self.n

    def enter(self, pos: int, token: int, verified: bool, fill: int = 0, draft: Draft | None = None) -> InFlight:
        """A token at depth 0: embedded, with its anchor rows (type 0 = the embedding). It is not appended."""
        h = self.embed(token)
        return InFlight(pos, token, h, self.anchors.rows(h[0])[0], self.new_seq(), verified=verified, fill=fill,
                        draft=draft)

    # ------------------------------------------------------------------ the cycle
    def start(self, prompt_len: int, logits: torch.Tensor, prompt_feats: torch.Tensor, since: float) -> None:
        """After the prefill: the first token from ``logits`` ``[V]`` (position ``prompt_len``), the drafter started on
        the prompt's anchor rows ``prompt_feats`` ``[s0, m, H]``, and (unless that token ends the generation) the token
        enters the pipeline. ``since`` is the ``time.perf_counter()`` at which the prefill began."""
        tok = first_token(logits, self.sampling, prompt_len)
        self.drafter.start(prompt_feats)
        self.metrics.observe_prefill(time.perf_counter() - since)
        self.head_start = prompt_len
        if not self.out.emit(tok):
            self.pipeline = [self.enter(prompt_len, tok, True)]

    def begin_cycle(self) -> tuple[DraftView, dict[int, InFlight]]:
        """Step 1-2 of a cycle: the draft's view of the pipeline (its *input* states; the pending rows are committed
        by it), then every in-flight token moves one stage.

        Returns:
            ``(view, at_stage)``: the :class:`DraftView`, and stage -> the token that stage runs this cycle (deepest
            first). The driver runs those forwards and stores their anchors (:meth:`Anchors.store`).
        """
        self.metrics.observe_cycle()
        inflight = torch.stack([e.feats for e in self.pipeline])
        comp = (torch.stack(self.completed) if self.completed
                else inflight.new_zeros(0, self.anchors.m, inflight.shape[-1]))
        view = DraftView(comp, inflight, [self.f[e.depth] for e in self.pipeline], self.head_start)
        self.head_start += len(self.completed)
        self.completed = []
        at_stage = {}
        for e in self.pipeline:
            at_stage[e.depth] = e
            e.depth += 1
        return view, at_stage

    def propose(self, view: DraftView) -> Draft:
        """Step 3: the drafter's proposal for the position after the newest in-flight token (timed as ``head``)."""
        t = time.perf_counter()
        draft = self.drafter.propose(view.completed, view.inflight, view.types, view.start_pos, self.sampling)
        self.metrics.observe_time("head", time.perf_counter() - t)
        return draft

    def enter_draft(self, draft: Draft) -> InFlight:
        """Step 3: the draft enters at depth 0, after the newest token; returns it."""
        e = self.enter(self.pipeline[-1].pos + 1, draft.token, False, fill=len(self.pipeline), draft=draft)
        self.pipeline.append(e)
        return e

    def verify(self) -> bool:
        """Step 4 (only when :attr:`verifiable`): the oldest token's output verifies the draft after it (greedy match
        or speculative sampling, :func:`~spd_ds.decoding.verify.verify_draft`); the oldest becomes a pending row and
        the verified token is returned (stop conditions apply). On rejection :attr:`plan` is set and the driver calls
        :meth:`rollback`. Returns whether the draft was accepted."""
        t = time.perf_counter()
        oldest, cand = self.pipeline[0], self.pipeline[1]
        ok, token = verify_draft(self.logits(oldest.hidden[0, 0]), cand.token, cand.draft.q_full, cand.pos,
                                 self.sampling)
        self.metrics.observe_verify(cand.fill, ok)
        self.completed.append(oldest.feats)
        self.pipeline.pop(0)
        if ok:
            cand.verified = True
        else:  # stage s has run every remaining in-flight token deeper than s: those positions go
            self.plan = RollbackPlan(cand.pos, token, tuple(sum(e.depth > s for e in self.pipeline)
                                                            for s in range(self.n)))
        self.out.emit(token)
        self.metrics.observe_time("verify", time.perf_counter() - t)
        return ok

    def rollback(self) -> InFlight:
        """After a rejection: the driver's stages rewind by :attr:`plan`, the in-flight tokens are flushed and the
        replacement enters at the rejected draft's position. The only place a rollback happens. Returns the
        replacement.

        Raises:
            RuntimeError: no rejection is pending.
        """
        if self.plan is None:
            raise RuntimeError("rollback without a rejected draft")
        plan, self.plan = self.plan, None
        self.metrics.observe_rollback()
        self.rewind(plan)
        e = self.enter(plan.keep, plan.token, True)
        self.pipeline = [e]
        return e

    def result(self, decode_s: float | None, split_stages: Iterable[int] | None) -> GenerationResult:
        """The :class:`GenerationResult`, metrics closed (see :meth:`TokenOutput.result`)."""
        return self.out.result(self.metrics, decode_s, split_stages)
