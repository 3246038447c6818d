"""Autoregressive decoding through the SPD pipeline: the exactness reference on the same stage code and kernels, and
the oracle drafter's source. Each token crosses every stage before the next one is sampled."""

from __future__ import annotations

import time

from spd_ds.decoding.cycle import InFlight, first_token
from spd_ds.pipe import schedule as sch
from spd_ds.pipe.comm import PipeProtocolError
from spd_ds.pipe.head_rank import HeadDriver, HeadRank


class PipeAR(HeadDriver):
    """The head rank's AR generations (:class:`~spd_ds.pipe.schedule.HeadARSchedule`): one token in the pipeline at a
    time; only the last stage answers, with its output (no anchors). Sampling uses the keyed uniforms of
    :class:`~spd_ds.decoding.ar.ARDecoder`, so at T = 0 greedy SPD through the same pipeline must equal it.

    Args:
        rank: the :class:`~spd_ds.pipe.head_rank.HeadRank`.
    """

    def __init__(self, rank: HeadRank) -> None:
        super().__init__(rank)
        self.entry: InFlight | None = None  # the token in the pipeline
        self.pending: InFlight | None = None  # the next one, sampled

    def schedule(self, engine) -> sch.HeadARSchedule:
        """The schedule of one generation."""
        return sch.HeadARSchedule(engine, self)

    def prefill(self) -> None:
        """Prefill: the prompt through every stage; the first token."""
        t0 = time.perf_counter()
        final, _ = self.rank.prefill(self.prompt, None)
        s0 = len(self.prompt)
        tok = first_token(self.rank.ends.logits(final[-1]), self.sampling, s0)
        self.metrics.observe_prefill(time.perf_counter() - t0)
        if not self.out.emit(tok):
            self.start_decoding()
            self.pending = self.rank.ar_entry(s0, tok)

    def load_token(self) -> None:
        """LoadToken: the sampled token enters (sent when stage 0 is remote)."""
        self.entry, self.pending = self.pending, None
        if self.rank.plan.first_remote == 0:
            self.rank.send_token(self.entry, 0)

    def stage_forward(self, stage: int) -> None:
        """StageForward: a local stage on the token.

        Raises:
            PipeProtocolError: the token is not at that stage's depth.
        """
        e = self.entry
        if e.depth != stage:
            raise PipeProtocolError(f"AR token at depth {e.depth} reached stage {stage}")
        e.depth += 1
        self.rank.forward_local(stage, e, None)

    def send_hidden(self, stage: int) -> None:
        """SendHidden: the last local stage's output to the first remote stage."""
        self.rank.send_token(self.entry, 0)

    def recv_anchors(self, final: bool) -> None:
        """RecvAnchors(final=True): the last stage's output of the token, when that stage is remote."""
        last = self.rank.n - 1
        if final and last in self.rank.plan.remote_stages:
            self.entry.depth = self.rank.n
            self.rank.receive(self.entry, last, None, host_sync=True)

    def sample_target(self) -> None:
        """SampleTarget: the next token from the target's logits; it is returned and, unless it stops the generation,
        enters next."""
        e = self.entry
        t = time.perf_counter()
        tok = first_token(self.rank.ends.logits(e.hidden[0, 0]), self.sampling, e.pos + 1)
        self.metrics.observe_time("verify", time.perf_counter() - t)
        self.metrics.observe_cycle()
        if not self.out.emit(tok):
            self.pending = self.rank.ar_entry(e.pos + 1, tok)
