"""SPD's instructions on the head rank: the cycle of :mod:`spd_ds.decoding.cycle`, with the stage forwards run where
the stages live (locally, or by message) and the draft made beside them.

Each instruction of :class:`~spd_ds.pipe.schedule.HeadSPDSchedule` is one short method here that hands the state
change to :class:`~spd_ds.decoding.cycle.SPDGeneration` and the transport to :class:`~spd_ds.pipe.head_rank.HeadRank`;
what remains is scheduling: which token goes where, and on which CUDA stream the head drafts.
"""

from __future__ import annotations

import time

import torch

from spd_ds.decoding.cycle import DraftView, InFlight, RollbackPlan, SPDGeneration
from spd_ds.pipe import schedule as sch
from spd_ds.pipe.comm import FLAG_ANCHORS
from spd_ds.pipe.head_rank import HeadDriver, HeadRank


class SPDHead(HeadDriver):
    """The head rank's SPD generations (paper §3 over DeepSpeed's pipeline: the head drafts while every stage runs a
    different in-flight token).

    Args:
        rank: the :class:`~spd_ds.pipe.head_rank.HeadRank`.
        overlap: on CUDA, draft on a stream of the head's own, overlapping stage 0's forward (``False``: on the default
            stream after it, no concurrency).
    """

    def __init__(self, rank: HeadRank, overlap: bool = True) -> None:
        super().__init__(rank)
        self.head_stream = torch.cuda.Stream(rank.device) if (rank.cuda and overlap) else None
        # reused every cycle (a wait captures the event's latest record, so re-recording later is safe)
        self._snapshot_ready = torch.cuda.Event() if self.head_stream is not None else None
        self.gen: SPDGeneration | None = None
        self.view: DraftView | None = None
        self.at_stage: dict[int, InFlight] = {}

    def schedule(self, engine) -> sch.HeadSPDSchedule:
        """The schedule of one generation."""
        return sch.HeadSPDSchedule(engine, self)

    @property
    def rejected(self) -> bool:
        """Whether the last verification rejected its draft (a Rollback step follows)."""
        return self.gen.rejected

    def _rewind(self, plan: RollbackPlan) -> None:
        for r in self.rank.runners.values():  # remote stages crop when the replacement's position reaches them
            r.crop(plan.keep)

    # ------------------------------------------------------------------ instructions
    def load_prompt(self) -> None:
        """LoadPrompt: check the prompt and start the cycle's state."""
        super().load_prompt()
        r = self.rank
        self.gen = SPDGeneration(r.plan.partition, self.drafter, self.sampling, r.eos, self.max_new, r.embed,
                                 r.ends.logits, self._rewind, new_seq=r.next_seq, metrics=self.metrics, stop=r.stop,
                                 on_token=self.on_token)
        self.out = self.gen.out
        self.view, self.at_stage = None, {}

    def prefill(self) -> None:
        """Prefill: the prompt through every stage with its anchors; the first token; the drafter started."""
        t0 = time.perf_counter()
        final, feats = self.rank.prefill(self.prompt, self.gen.anchors)
        self.gen.start(len(self.prompt), self.rank.ends.logits(final[-1]), feats, since=t0)
        if not self.gen.finished:
            self.start_decoding()

    def load_token(self) -> None:
        """LoadToken: the token entering depth 0 (prefill token, draft or replacement) goes to a remote stage 0."""
        if self.rank.plan.first_remote == 0:
            self.rank.send_token(self.gen.newest, FLAG_ANCHORS)

    def prepare_draft(self) -> None:
        """PrepareDraft: the draft's view (the head's stream waits for it only, not for the stage forward launched
        next); every in-flight token moves one stage."""
        self.view, self.at_stage = self.gen.begin_cycle()
        if self._snapshot_ready is not None:
            self._snapshot_ready.record()

    def stage_forward(self, stage: int) -> None:
        """StageForward: a local target stage on its in-flight token."""
        e = self.at_stage.get(stage)
        if e is not None:
            self.rank.forward_local(stage, e, self.gen.anchors)

    def send_hidden(self, stage: int) -> None:
        """SendHidden: the last local stage's output to the first remote stage."""
        e = self.at_stage.get(stage)
        if e is not None:
            self.rank.send_token(e, FLAG_ANCHORS)

    def draft(self) -> None:
        """Draft: the drafter proposes from the view (on GPU on the head's stream, beside the stages); it enters."""
        if self.head_stream is None:
            draft = self.gen.propose(self.view)
        else:
            self.head_stream.wait_event(self._snapshot_ready)
            with torch.cuda.stream(self.head_stream):
                draft = self.gen.propose(self.view)
            torch.cuda.current_stream(self.rank.device).wait_stream(self.head_stream)
        self.gen.enter_draft(draft)

    def recv_anchors(self, final: bool) -> None:
        """RecvAnchors: ``final``: the last stage's message of the token leaving the pipeline (its output verifies);
        else the anchors of the remote stages' tokens still in flight (the next view needs them)."""
        gen, last, remote = self.gen, self.rank.n - 1, set(self.rank.plan.remote_stages)
        if final:
            if last in remote and gen.verifiable:
                self.rank.receive(gen.pipeline[0], last, gen.anchors, host_sync=True)
            return
        live = {id(e) for e in gen.pipeline}
        for s, e in self.at_stage.items():
            if s in remote and s != last and id(e) in live and self.rank.plan.up_rows(s):
                self.rank.receive(e, s, gen.anchors)

    def verify(self) -> None:
        """Verify: the oldest draft, once the token before it has left the last stage."""
        if self.gen.verifiable:
            self.gen.verify()

    def rollback(self) -> None:
        """Rollback: local caches rewound, the in-flight tokens flushed, the replacement in."""
        self.gen.rollback()
