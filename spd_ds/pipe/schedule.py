"""SPD's pipeline instructions and schedules (run by :class:`~spd_ds.pipe.engine.SPDPipelineEngine`).

DeepSpeed's stock schedules are fixed fill-and-drain plans. SPD's plan depends on what verification decides, so
these schedules are generators that read the rank's state between steps (``PipelineEngine._exec_schedule`` pulls
the next step only after executing the previous one).

**Head rank** (pipe stage 0), one step per decode cycle, mirroring the reference decoder's cycle::

    PrepareDraft  StageForward(s)* SendHidden?  Draft  RecvAnchors(final)  Verify  [Rollback]  LoadToken  RecvAnchors

``PrepareDraft`` snapshots the pipeline *input* states (the reference's step 1) and advances every in-flight token one
stage; local stages (target stage 0 when co-located) run, and the first remote stage gets the output; the head drafts
while all stages compute; the token leaving the last stage arrives, verifies the oldest draft, and either the draft
or the replacement is loaded into stage 0. The anchors of the other in-flight tokens are received last: only the
next cycle's draft needs them.

**Stage ranks**, one step per message from upstream (see :mod:`spd_ds.pipe.stage_rank`)::

    RecvHidden  StageForward  SendHidden  SendAnchors          (PREFILL / DECODE)
    RecvHidden  EndGeneration | Shutdown | Warmup              (control)

Who executes an instruction: the engine hands it to the rank's role (:class:`~spd_ds.pipe.spd_head.SPDHead`,
:class:`~spd_ds.pipe.ar_pipe.PipeAR` or :class:`~spd_ds.pipe.head_rank.HeadRank` on the head rank,
:class:`~spd_ds.pipe.stage_rank.StageRank` elsewhere), a method of the same name in snake case.
"""

from __future__ import annotations

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule


class SPDInstruction(PipeInstruction):
    """Base of SPD's instructions (keyword arguments become attributes, as for DeepSpeed's)."""


class LoadPrompt(SPDInstruction):
    """Head: start a generation (check the prompt, reset per-prompt state)."""


class Prefill(SPDInstruction):
    """Head: the prompt through every stage (local ones here, remote ones by message); anchors; the first token."""


class PrepareDraft(SPDInstruction):
    """Head: snapshot the drafter's inputs (completed rows, in-flight rows at their depths); advance the depths."""


class StageForward(SPDInstruction):
    """Forward of target stage ``stage`` on its in-flight token (any rank holding the stage)."""


class SendHidden(SPDInstruction):
    """Send the output of target stage ``stage`` to the rank of the next stage (non-blocking)."""


class RecvHidden(SPDInstruction):
    """Stage rank: receive the next message from upstream (header, then hidden states into a preallocated buffer)."""


class SendAnchors(SPDInstruction):
    """Stage rank: send this stage's anchors (and, on the last stage, its output) to the head (non-blocking)."""


class RecvAnchors(SPDInstruction):
    """Head: receive remote stages' anchors for this cycle; ``final=True``: only the last stage's message of the
    token being verified (its output verifies); ``final=False``: those of the tokens still in flight."""


class Draft(SPDInstruction):
    """Head: the drafter proposes the next token from the snapshot (on GPU on its own stream, while stages run)."""


class Verify(SPDInstruction):
    """Head: verify the oldest draft with the token that left the last stage (greedy or speculative sampling)."""


class Rollback(SPDInstruction):
    """Head: after a rejection, flush the in-flight tokens and restart from the replacement (local caches cropped;
    remote stages crop when the replacement's position reaches them)."""


class LoadToken(SPDInstruction):
    """Head: the token entering depth 0 (draft or replacement) goes to stage 0 (sent when stage 0 is remote)."""


class SampleTarget(SPDInstruction):
    """Head, AR mode: the next token from the target's logits (same keyed uniforms as the AR decoder)."""


class EndGeneration(SPDInstruction):
    """End of one generation: the head sends END down the pipe and drains every stage's remaining messages up to its
    statistics; a stage rank reports its statistics and passes END on."""


class Shutdown(SPDInstruction):
    """Stop serving: SHUTDOWN travels down the pipe; the last stage acknowledges to the head."""


class Warmup(SPDInstruction):
    """Start-up check: a WARMUP message through every link (creates the NCCL communicators before timing starts)."""


SPD_INSTRUCTIONS = (LoadPrompt, Prefill, PrepareDraft, StageForward, SendHidden, RecvHidden, SendAnchors, RecvAnchors,
                    Draft, Verify, Rollback, LoadToken, SampleTarget, EndGeneration, Shutdown, Warmup)


class _EngineSchedule(PipeSchedule):
    """A schedule bound to an engine; ``role`` (the rank's instructions, see :mod:`spd_ds.pipe.engine`) holds the state
    that decides the next step."""

    def __init__(self, engine, role=None) -> None:
        super().__init__(micro_batches=1, stages=engine.num_stages, stage_id=engine.stage_id)
        self.engine, self.role = engine, role

    def num_pipe_buffers(self) -> int:
        return 1

    def __next__(self):
        self.engine.heartbeat()  # the engine's watchdog sees progress at every step
        return super().__next__()


def _local_forwards(plan) -> list[SPDInstruction]:
    """The head rank's own target stages on their tokens, then the last one's output down to the first remote stage."""
    step: list[SPDInstruction] = [StageForward(stage=s) for s in plan.head_stages]
    if plan.head_stages and plan.first_remote is not None:
        step.append(SendHidden(stage=plan.head_stages[-1]))
    return step


class HeadSPDSchedule(_EngineSchedule):
    """Head rank: one SPD generation (``role``: the :class:`~spd_ds.pipe.spd_head.SPDHead` holding its request)."""

    def steps(self):
        gen = self.role
        yield [LoadPrompt(), Prefill()]
        if not gen.finished:
            yield [LoadToken()]  # the prefill token enters at depth 0
        while not gen.finished:
            yield [PrepareDraft(), *_local_forwards(self.engine.plan), Draft(), RecvAnchors(final=True), Verify()]
            if gen.rejected:
                yield [Rollback()]
            if not gen.finished:
                yield [LoadToken(), RecvAnchors(final=False)]
        yield [EndGeneration()]


class HeadARSchedule(_EngineSchedule):
    """Head rank: one autoregressive generation through the same pipeline (each token crosses every stage; ``role``:
    the :class:`~spd_ds.pipe.ar_pipe.PipeAR`)."""

    def steps(self):
        gen = self.role
        yield [LoadPrompt(), Prefill()]
        while not gen.finished:
            yield [LoadToken(), *_local_forwards(self.engine.plan), RecvAnchors(final=True), SampleTarget()]
        yield [EndGeneration()]


class StageServeSchedule(_EngineSchedule):
    """Stage rank: serve messages until SHUTDOWN (``role``: the :class:`~spd_ds.pipe.stage_rank.StageRank`)."""

    def steps(self):
        from spd_ds.pipe.comm import Kind

        rank = self.role
        s = rank.stage
        while True:
            yield [RecvHidden()]
            kind = rank.msg.kind
            if kind == Kind.SHUTDOWN:
                yield [Shutdown()]
                return
            if kind == Kind.END:
                yield [EndGeneration()]
            elif kind == Kind.WARMUP:
                yield [Warmup()]
            else:
                yield [StageForward(stage=s), SendHidden(stage=s), SendAnchors(stage=s)]


class OneStep(_EngineSchedule):
    """A one-step schedule (start-up and shutdown)."""

    def __init__(self, engine, cmds) -> None:
        super().__init__(engine)
        self.cmds = cmds

    def steps(self):
        yield self.cmds
