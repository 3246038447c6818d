"""SPD's pipeline instructions and schedules (run by :class:`~spd_ds.pipe.engine.SPDPipelineEngine`).

DeepSpeed's stock schedules are fixed fill-and-drain plans. SPD's plan depends on what verification decides, so
these schedules are generators that read the engine's state between steps (``PipelineEngine._exec_schedule`` pulls
the next step only after executing the previous one).

**Head rank** (pipe stage 0), one step per decode cycle, mirroring the reference decoder's cycle::

    PrepareDraft  StageForward(s)* SendHidden?  Draft  RecvAnchors(final)  Verify  [Rollback]  LoadToken  RecvAnchors

``PrepareDraft`` snapshots the pipeline *input* states (the reference's step 1) and advances every in-flight token one
stage; local stages (target stage 0 when co-located) run, and the first remote stage gets the output; the head drafts
while all stages compute; the token leaving the last stage arrives, verifies the oldest draft, and either the draft
or the replacement is loaded into stage 0. The anchors of the other in-flight tokens are received last: only the
next cycle's draft needs them.

**Stage ranks**, one step per message from upstream::

    RecvHidden  StageForward  SendHidden  SendAnchors          (PREFILL / DECODE)
    RecvHidden  EndGeneration | Shutdown | Warmup              (control)

A stage needs no rollback message: a token's position tells it where to write (a position below its cache length
crops the cache first), so tokens flushed by a rollback simply drain through the idle slots behind the
replacement, and the head drops their messages by sequence number.
"""

from __future__ import annotations

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule


class SPDInstruction(PipeInstruction):
    """Base of SPD's instructions (keyword arguments become attributes, as for DeepSpeed's)."""


class LoadPrompt(SPDInstruction):
    """Head: start a generation (reset per-prompt state; ``mode`` = ``spd`` or ``ar``)."""


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


class _EngineSchedule(PipeSchedule):
    """A schedule bound to an engine whose state decides the next step."""

    def __init__(self, engine) -> None:
        super().__init__(micro_batches=1, stages=engine.num_stages, stage_id=engine.stage_id)
        self.engine = engine

    def num_pipe_buffers(self) -> int:
        return 1

    def __next__(self):
        self.engine.heartbeat()  # the engine's watchdog sees progress at every step
        return super().__next__()


class HeadSPDSchedule(_EngineSchedule):
    """Head rank: one SPD generation (prompt and limits are on ``engine.spd``)."""

    def steps(self):
        eng = self.engine
        st = eng.spd
        yield [LoadPrompt(mode="spd"), Prefill()]
        if not st.finished:
            yield [LoadToken()]  # the prefill token enters at depth 0
        while not st.finished:
            cycle = [PrepareDraft()]
            for s in eng.plan.head_stages:
                cycle.append(StageForward(stage=s))
            if eng.plan.head_stages and eng.plan.first_remote is not None:
                cycle.append(SendHidden(stage=eng.plan.head_stages[-1]))
            cycle += [Draft(), RecvAnchors(final=True), Verify()]
            yield cycle
            if st.rejected:
                yield [Rollback()]
            if not st.finished:
                yield [LoadToken(), RecvAnchors(final=False)]
        yield [EndGeneration()]


class HeadARSchedule(_EngineSchedule):
    """Head rank: one autoregressive generation through the same pipeline (each token crosses every stage)."""

    def steps(self):
        eng = self.engine
        st = eng.spd
        yield [LoadPrompt(mode="ar"), Prefill()]
        while not st.finished:
            step = [LoadToken()]
            for s in eng.plan.head_stages:
                step.append(StageForward(stage=s))
            if eng.plan.head_stages and eng.plan.first_remote is not None:
                step.append(SendHidden(stage=eng.plan.head_stages[-1]))
            step += [RecvAnchors(final=True), SampleTarget()]
            yield step
        yield [EndGeneration()]


class StageServeSchedule(_EngineSchedule):
    """Stage rank: serve messages until SHUTDOWN."""

    def steps(self):
        from spd_ds.pipe.comm import Kind

        eng = self.engine
        s = eng.plan.stages_on(eng.stage_id)[0]
        while True:
            yield [RecvHidden()]
            kind = eng.stage_msg.kind
            if kind == Kind.SHUTDOWN:
                yield [Shutdown()]
                return
            if kind == Kind.END:
                yield [EndGeneration()]
            elif kind == Kind.WARMUP:
                yield [Warmup()]
            else:
                yield [StageForward(stage=s), SendHidden(stage=s), SendAnchors(stage=s)]
