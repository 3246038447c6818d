"""``SPDPipelineEngine``: DeepSpeed's ``PipelineEngine`` running SPD's own schedule.

The engine is built by ``deepspeed.initialize`` from an :class:`~spd_ds.pipe.module.SPDPipelineModule` (see
:class:`spd_ds.pipe.runner.SPDSession`), like DeepSpeed's own ``DualPipeVEngine``: a subclass whose
``_INSTRUCTION_MAP`` adds SPD's instructions (:mod:`spd_ds.pipe.schedule`) to the parent's, and whose schedules are
dispatched by the parent's ``_exec_schedule``.

The engine only wires a rank and schedules; every instruction is executed by the rank's *role*, chosen once:

* head rank (pipe stage 0): :class:`~spd_ds.pipe.spd_head.SPDHead` during an SPD generation (it drives the cycle of
  :mod:`spd_ds.decoding.cycle`, the same code as the reference decoder, so the tokens are the same for the same config
  and seed), :class:`~spd_ds.pipe.ar_pipe.PipeAR` during an AR one, :class:`~spd_ds.pipe.head_rank.HeadRank` between
  generations (warm-up, shutdown);
* stage ranks: :class:`~spd_ds.pipe.stage_rank.StageRank`.

How a cycle overlaps across ranks: every stage forwards the token it holds as soon as its input arrives; the head
drafts from the previous cycle's anchors meanwhile (on GPU on its own CUDA stream); only stage 0's next token waits
for verification, and since no other stage waits for it, that wait is spread over ``n`` cycles. Stage ranks never
read the device on the host (headers come over gloo), so on GPU their launches run ahead of their kernels; the head
synchronises for the draft token and for verification.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from spd_ds.decoding.cycle import GenerationResult, eos_set
from spd_ds.decoding.drafters import Drafter
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.stopping import StopStrings
from spd_ds.models.graphs import new_graph_pool
from spd_ds.pipe import schedule as sch
from spd_ds.pipe.ar_pipe import PipeAR
from spd_ds.pipe.head_rank import HeadDriver, HeadRank
from spd_ds.pipe.links import PipeLinks, rank_name
from spd_ds.pipe.spd_head import SPDHead
from spd_ds.pipe.stage_rank import StageRank
from spd_ds.pipe.stage_runner import StageRunner
from spd_ds.pipe.topology import PipePlan
from spd_ds.pipe.watchdog import Watchdog


def _to_role(instruction: type) -> Callable:
    """An ``_INSTRUCTION_MAP`` entry: ``instruction`` runs as the role's method of the same name in snake case
    (``StageForward(stage=1)`` -> ``role.stage_forward(stage=1)``)."""
    name = re.sub(r"(?<!^)(?=[A-Z])", "_", instruction.__name__).lower()

    def run(self, *args, **kwargs):
        return getattr(self.role, name)(*args, **kwargs)

    run.__name__ = run.__qualname__ = f"_exec_{name}"
    return run


class SPDPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` that serves SPD generations (built by ``deepspeed.initialize``; then call
    :meth:`setup_spd` on every rank).

    Head rank (pipe stage 0): :meth:`generate` (SPD) and :meth:`generate_ar` (AR through the same pipeline).
    Stage ranks: :meth:`serve` until the head calls :meth:`shutdown_pipeline`.
    """

    # ------------------------------------------------------------------ setup
    def setup_spd(self, plan: PipePlan, sampling: SamplingParams, eos_token_ids: Sequence[int], max_len: int, *,
                  timeout_s: float, static_cache: bool, cuda_graphs: bool, head_overlap: bool = True,
                  stop_strings: StopStrings | None = None, model_max: int | None = None,
                  model_max_source: str = "max_position_embeddings") -> None:
        """Create links, buffers, stage runners and this rank's role; every rank calls it (it creates process groups).

        Args:
            plan: the run's :class:`PipePlan` (its world size equals the engine's pipe degree).
            sampling: decoding distribution and seed.
            eos_token_ids: ids that end a generation.
            max_len: KV capacity (prompt + new tokens + tokens in flight).
            timeout_s: deadline of every wait on another rank.
            static_cache: static KV caches (GPU speed path); ``cuda_graphs``: capture stage forwards.
            head_overlap: on CUDA, draft on a stream of the head's own, overlapping stage 0's forward (``False``:
                on the default stream after it, no concurrency).
            stop_strings: the head rank's stop strings (:class:`~spd_ds.decoding.stopping.StopStrings`); the head
                rank alone decides where a generation ends, the other ranks follow its messages.
            model_max: the target's own maximum context in positions (``None``: unknown); a prompt that needs more is
                told so, not told to raise ``decoding.max_length``. model_max_source: the config.json key that sets it
                (``TargetArch.max_positions_source``: a sliding window is named as such).
        Raises:
            RuntimeError: the plan's world size is not the engine's pipe degree.
        """
        if plan.world_size != self.num_stages:
            raise RuntimeError(f"plan for {plan.world_size} pipe stages but the engine has {self.num_stages}")
        self.plan, self.sampling = plan, sampling  # the sampling of the next generations (their uniforms' key)
        self.timeout_s = float(timeout_s)
        mod = self.module
        stages = mod.target_stages
        any_param = next(iter(stages.values())).parameters() if stages else mod.head_ends.ends.parameters()
        p0 = next(any_param)
        device, dtype = p0.device, p0.dtype
        cuda = device.type == "cuda"
        H = (next(iter(stages.values())).arch.hidden_size if stages
             else int(mod.head_ends.ends.embedding.weight.shape[1]))
        pool = new_graph_pool() if (cuda and static_cache and cuda_graphs) else None
        runners = {s: StageRunner(st, int(max_len), static_cache, cuda_graphs and cuda, pool)
                   for s, st in stages.items()}
        self.is_head = self.stage_id == 0
        rank_of = self._rank_of
        self.watchdog = Watchdog(2 * self.timeout_s, rank_name(plan, self.stage_id, rank_of(self.stage_id)))
        links = PipeLinks(plan, self.stage_id, self.global_rank, rank_of, self.grid.get_pipe_parallel_group,
                          self.timeout_s, device)
        self.links = links
        self.head_rank: HeadRank | None = None
        self.spd_head: SPDHead | None = None
        self.pipe_ar: PipeAR | None = None
        if self.is_head:
            self.head_rank = HeadRank(links, runners, mod.head_ends.ends, eos_set(list(eos_token_ids)), max_len, H,
                                      dtype, device, stop=stop_strings, model_max=model_max,
                                      model_max_source=model_max_source)
            self.spd_head, self.pipe_ar = SPDHead(self.head_rank, head_overlap), PipeAR(self.head_rank)
            self.role = self.head_rank
            warmup = [sch.Warmup()]  # send, and collect every stage's answer
        else:
            (s,) = plan.stages_on(self.stage_id)
            self.role = StageRank(links, s, runners[s], int(max_len), H, dtype, device, self.watchdog, self.timeout_s)
            warmup = [sch.RecvHidden(), sch.Warmup()]  # serve one message
        if plan.world_size > 1:  # exercise every link once
            self._exec_schedule(sch.OneStep(self, warmup))

    def _rank_of(self, pipe: int) -> int:
        return self.grid.stage_to_global(stage_id=pipe)

    def heartbeat(self) -> None:
        """Called at every schedule step (see :class:`~spd_ds.pipe.watchdog.Watchdog`)."""
        wd = getattr(self, "watchdog", None)
        if wd is not None:
            wd.beat()

    def _exec_schedule(self, pipe_schedule):
        try:
            super()._exec_schedule(pipe_schedule)
        finally:
            wd = getattr(self, "watchdog", None)
            if wd is not None:
                wd.idle()

    def close_spd(self) -> None:
        """Stop the watchdog (the session is over)."""
        wd = getattr(self, "watchdog", None)
        if wd is not None:
            wd.stop()

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, drafter: Drafter, *,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """SPD generation of up to ``max_new_tokens`` verified tokens after ``prompt`` (head rank only).

        Args:
            prompt: token ids (non-empty).
            max_new_tokens: limit, the prefill token included.
            drafter: the proposer (:class:`~spd_ds.decoding.drafters.HeadDrafter`, oracle, ...).
            on_token: called with each verified token as it is returned (streaming), or ``None``.
        Returns:
            :class:`~spd_ds.decoding.cycle.GenerationResult` with per-cycle timings in its metrics.
        Raises:
            RuntimeError: not the head rank.
            PromptError: empty or too long prompt (before any message is sent).
            PipeCommError: a stage rank died or stalled.
        """
        return self._run_head(self.spd_head, prompt, max_new_tokens, drafter, on_token)

    @torch.no_grad()
    def generate_ar(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None, *,
                    stop_strings: bool = True) -> GenerationResult:
        """Autoregressive generation through the same pipeline and stage code (head rank only): the exactness
        reference on the same kernels and the oracle drafter's source. Same contract as :meth:`generate`;
        ``sampling`` replaces :attr:`sampling` for this generation (the oracle's reference decodes greedily:
        :func:`~spd_ds.decoding.drafters.oracle_reference_sampling`); ``stop_strings=False`` runs past the stop
        strings (the oracle's reference, as the reference decoder's: its drafts go past them too)."""
        return self._run_head(self.pipe_ar, prompt, max_new_tokens, None, sampling=sampling, stop_strings=stop_strings)

    def _run_head(self, driver: HeadDriver | None, prompt, max_new_tokens, drafter, on_token=None,
                  sampling: SamplingParams | None = None, stop_strings: bool = True) -> GenerationResult:
        if driver is None:
            raise RuntimeError("generate() runs on the head rank (pipe stage 0) only")
        driver.request(prompt, max_new_tokens, drafter, sampling or self.sampling, on_token, stop_strings)
        self.role = driver
        try:
            self._exec_schedule(driver.schedule(self))
        finally:
            self.role = self.head_rank
        return driver.result

    def serve(self) -> None:
        """Stage ranks: forward every message from upstream until SHUTDOWN.

        Raises:
            RuntimeError: called on the head rank.
        """
        if self.is_head:
            raise RuntimeError("serve() runs on stage ranks only")
        self._exec_schedule(sch.StageServeSchedule(self, self.role))

    def shutdown_pipeline(self) -> None:
        """Head rank: stop the stage ranks (SHUTDOWN down the pipe, acknowledged by the last stage)."""
        if self.is_head and self.links.down_link is not None:
            self._exec_schedule(sch.OneStep(self, [sch.Shutdown()]))

    def abort_pipeline(self) -> None:
        """Head rank, best effort after an error that left the links usable (e.g. a bad prompt): tell the stage ranks
        to stop; they raise :class:`~spd_ds.pipe.comm.PipeAborted`. Errors on broken links are swallowed."""
        if self.is_head and self.links.down_link is not None:
            try:
                self.head_rank.shutdown(abort=True)
            except Exception:  # noqa: BLE001 - the links may be broken already
                pass

    # ------------------------------------------------------------------ instructions: run by the role
    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, **{cls: _to_role(cls) for cls in sch.SPD_INSTRUCTIONS}}
    _exec_stage_forward = _INSTRUCTION_MAP[sch.StageForward]  # by name too (a test wraps it to inject faults)
