"""``SPDPipelineEngine``: DeepSpeed's ``PipelineEngine`` running SPD's own schedule.

The engine is built by ``deepspeed.initialize`` from an :class:`~spd_ds.pipe.module.SPDPipelineModule` (see
:class:`spd_ds.pipe.runner.SPDSession`), like DeepSpeed's own ``DualPipeVEngine``: a subclass whose
``_INSTRUCTION_MAP`` adds SPD's instructions (:mod:`spd_ds.pipe.schedule`) to the parent's, and whose schedules are
dispatched by the parent's ``_exec_schedule``.

The head rank's cycle is the reference decoder's cycle (:mod:`spd_ds.decoding.reference`) with the stage forwards
replaced by messages, so the tokens are the same for the same config and seed (randomness is keyed by position).
How a cycle overlaps across ranks: every stage forwards the token it holds as soon as its input arrives; the head
drafts from the previous cycle's anchors meanwhile (on GPU on its own CUDA stream); only stage 0's next token waits
for verification, and since no other stage waits for it, that wait is spread over ``n`` cycles. Stage ranks never
read the device on the host (headers come over gloo), so on GPU their launches run ahead of their kernels; the head
synchronises for the draft token and for verification.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from spd_ds.decoding.drafters import Draft, Drafter
from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.decoding.reference import GenerationResult, check_prompt, eos_set, first_token
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.verify import verify_draft
from spd_ds.models.adapter import TargetStage
from spd_ds.models.graphs import GraphedStage
from spd_ds.pipe import schedule as sch
from spd_ds.pipe.comm import FLAG_ABORT, FLAG_ANCHORS, FlatBuffer, Header, Kind, Link, PipeAborted, PipeProtocolError
from spd_ds.pipe.topology import PipePlan

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 3600.0  # how long stage ranks wait for the next generation (a dead head is noticed at once)


class Watchdog:
    """Ends this process when it makes no progress for ``limit_s`` while it is inside a schedule.

    Waits on other ranks are bounded by ``deepspeed.timeout_s`` (they raise), so a rank that passes no schedule
    step for ``2 x timeout_s`` is stalled itself (a stuck kernel, a deadlock): it prints one line and exits, so the run
    ends on every rank instead of leaving one process hanging. Idle time outside schedules is not watched.

    Args:
        limit_s: seconds without progress before the process exits.
        name: this rank's description, for the message.
    """

    def __init__(self, limit_s: float, name: str) -> None:
        import threading

        self.limit_s, self.name = float(limit_s), name
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spd-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Progress was made now: the stall deadline restarts."""
        self._last = time.monotonic()

    def idle(self) -> None:
        """Waiting for work on purpose (between generations): no deadline until the next :meth:`beat`."""
        self._last = None

    def stop(self) -> None:
        """End the watchdog thread."""
        self._stop.set()

    def _run(self) -> None:
        import os
        import sys

        while not self._stop.wait(min(1.0, self.limit_s / 4)):
            last = self._last
            if last is not None and time.monotonic() - last > self.limit_s:
                sys.stderr.write(f"spd-ds watchdog: {self.name} made no progress for {self.limit_s:g}s "
                                 f"(2 x deepspeed.timeout_s); this rank is stalled, exiting\n")
                sys.stderr.flush()
                os._exit(70)


class StageRunner:
    """Forwards of one target stage held by this rank.

    Eager mode (CPU, and GPU without graphs) runs :meth:`TargetStage.forward` over a length-based
    :class:`~spd_ds.models.kv_cache.StageKVCache` exactly as the reference decoder does; a token at a position below
    the cache length crops the cache first (rollback). Static mode runs a :class:`~spd_ds.models.graphs.GraphedStage`
    (static cache, CUDA graph when ``graphs``): the position alone decides what is visible.

    Args:
        stage: the :class:`TargetStage`.
        max_len: KV capacity in positions.
        static: use the static cache.
        graphs: capture the single-token forward as a CUDA graph (static mode on CUDA only).
        pool: CUDA graph memory pool to share.
    """

    def __init__(self, stage: TargetStage, max_len: int, static: bool, graphs: bool, pool=None) -> None:
        self.stage = stage
        p = next(stage.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cuda = self.device.type == "cuda"
        self.static = static
        self.graph_stage = None
        if static:
            try:
                self.graph_stage = GraphedStage(stage, max_len, use_graph=graphs, pool=pool)
            except RuntimeError as e:  # e.g. MoE routing with data-dependent shapes cannot be captured
                if not graphs:
                    raise
                logger.warning("stage %s: CUDA graph capture failed (%s); running it eagerly on the static cache",
                               stage.layer_ids, str(e).splitlines()[0])
                self.graph_stage = GraphedStage(stage, max_len, use_graph=False)
        self.cache = None if static else stage.arch.new_cache(stage.layer_ids, max_len, self.dtype, self.device)
        self.forward_s = 0.0
        self.forwards = 0
        self._events: list = []

    def _timed(self, fn, *args):
        """Decode forwards are timed (CUDA: events read at :meth:`take_stats`); prefill is not."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn(*args)
            b.record()
            self._events.append((a, b))
        else:
            t = time.perf_counter()
            out = fn(*args)
            self.forward_s += time.perf_counter() - t
        self.forwards += 1
        return out

    @torch.no_grad()
    def prefill(self, hidden: torch.Tensor):
        """Prompt states ``[1, q, H]`` at positions ``0..q-1`` (the cache starts empty). Returns ``(hidden, captured)``."""
        q = hidden.shape[1]
        if self.static:
            self.graph_stage.reset()
            return self.graph_stage.prefill(hidden)
        self.cache.reset()
        return self.stage(hidden, torch.arange(q, device=self.device), self.cache)

    @torch.no_grad()
    def decode(self, hidden: torch.Tensor, pos: int):
        """One token ``[1, 1, H]`` at position ``pos``. Returns ``(hidden, captured)`` (static mode: static tensors).

        Raises:
            PipeProtocolError: ``pos`` beyond the cache length (a token was skipped).
        """
        if self.static:
            return self._timed(self.graph_stage.step, hidden, pos)
        if pos < self.cache.length:
            self.cache.crop(pos)
        elif pos > self.cache.length:
            raise PipeProtocolError(f"token at position {pos} but the stage cache holds {self.cache.length}")
        return self._timed(self.stage, hidden, torch.tensor([pos], device=self.device), self.cache)

    def crop(self, length: int) -> None:
        """Rollback: keep positions ``[0, length)`` (eager mode; static mode needs nothing)."""
        if self.cache is not None and length < self.cache.length:
            self.cache.crop(length)

    def take_stats(self) -> tuple[float, int]:
        """``(decode forward seconds, decode forwards)`` since the last call (CUDA: event times; synchronises)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.forward_s += sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
            self._events = []
        out = (self.forward_s, self.forwards)
        self.forward_s, self.forwards = 0.0, 0
        return out


@dataclasses.dataclass
class _Entry:
    """A token in flight (head's bookkeeping; the reference decoder's ``_InFlight`` plus a sequence number)."""

    pos: int
    token: int
    seq: int
    hidden: torch.Tensor  # [1, 1, H]: input of the next local stage; after the last stage its output
    feats: torch.Tensor | None  # [m, H] anchors gathered so far (SPD)
    depth: int = 0
    verified: bool = False
    fill: int = 0
    draft: Draft | None = None


@dataclasses.dataclass
class _Generation:
    """Per-generation state of the head rank."""

    mode: str
    prompt: list[int]
    max_new: int
    drafter: Drafter | None
    metrics: SPDMetrics
    out: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""
    pipeline: list[_Entry] = dataclasses.field(default_factory=list)
    completed: list[torch.Tensor] = dataclasses.field(default_factory=list)
    head_start: int = 0
    snapshot: tuple | None = None
    at_stage: dict = dataclasses.field(default_factory=dict)
    pending: _Entry | None = None
    ar_entry: _Entry | None = None
    rejected: bool = False
    replacement: tuple[int, int] | None = None
    t_decode: float | None = None
    wait0: float = 0.0


class SPDPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` that serves SPD generations (built by ``deepspeed.initialize``; then call
    :meth:`setup_spd` on every rank).

    Head rank (pipe stage 0): :meth:`generate` (SPD) and :meth:`generate_ar` (AR through the same pipeline).
    Stage ranks: :meth:`serve` until the head calls :meth:`shutdown_pipeline`.
    """

    # ------------------------------------------------------------------ setup
    def setup_spd(self, plan: PipePlan, sampling: SamplingParams, eos_token_ids: Sequence[int], max_len: int, *,
                  timeout_s: float, static_cache: bool, cuda_graphs: bool, head_overlap: bool = True) -> None:
        """Create links, buffers and stage runners; every rank calls it (it creates process groups).

        Args:
            plan: the run's :class:`PipePlan` (its world size equals the engine's pipe degree).
            sampling: decoding distribution and seed.
            eos_token_ids: ids that end a generation.
            max_len: KV capacity (prompt + new tokens + tokens in flight).
            timeout_s: deadline of every wait on another rank.
            static_cache: static KV caches (GPU speed path); ``cuda_graphs``: capture stage forwards.
            head_overlap: on CUDA, draft on a stream of the head's own, overlapping stage 0's forward (``False``:
                on the default stream after it, no concurrency).
        Raises:
            RuntimeError: the plan's world size is not the engine's pipe degree.
        """
        if plan.world_size != self.num_stages:
            raise RuntimeError(f"plan for {plan.world_size} pipe stages but the engine has {self.num_stages}")
        self.plan = plan
        part = plan.partition
        self.n, self.m, self.L = part.num_stages, part.num_types, part.num_layers
        self.f = part.depth_to_type
        self.k_of = {a: k for k, a in enumerate(part.anchors)}
        self.sampling = sampling
        self.eos = eos_set(list(eos_token_ids))
        self.max_len = int(max_len)
        self.timeout_s = float(timeout_s)
        mod = self.module
        stages = mod.target_stages
        any_param = next(iter(stages.values())).parameters() if stages else mod.head_ends.ends.parameters()
        p0 = next(any_param)
        self.spd_device, self.spd_dtype = p0.device, p0.dtype
        self.cuda = self.spd_device.type == "cuda"
        self._arrived = torch.cuda.Event() if self.cuda else None  # marks received rows for host waits
        self.H = (next(iter(stages.values())).arch.hidden_size if stages
                  else int(mod.head_ends.ends.embedding.weight.shape[1]))
        pool = torch.cuda.graph_pool_handle() if (self.cuda and static_cache and cuda_graphs) else None
        self.runners = {s: StageRunner(st, self.max_len, static_cache, cuda_graphs and self.cuda, pool)
                        for s, st in stages.items()}
        self.is_head = self.stage_id == 0
        self._seq = 0
        self._wait_mark = 0.0
        self.spd: _Generation | None = None
        self.stage_msg: Header | None = None
        self.watchdog = Watchdog(2 * self.timeout_s, self._name(self.stage_id))
        self._build_links()
        if self.is_head:
            self.ends = mod.head_ends.ends
            self.head_module = mod.head_ends.head
            self.head_stream = torch.cuda.Stream(self.spd_device) if (self.cuda and head_overlap) else None
            # reused every cycle (a wait captures the event's latest record, so re-recording later is safe)
            self._snapshot_ready = torch.cuda.Event() if self.head_stream is not None else None
            self._token_ids = torch.zeros(1, 1, dtype=torch.long, device=self.spd_device)
        self._warmup()

    def heartbeat(self) -> None:
        """Called at every schedule step (see :class:`Watchdog`)."""
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

    def _rank_of(self, pipe: int) -> int:
        return self.grid.stage_to_global(stage_id=pipe)

    def _name(self, pipe: int) -> str:
        stages = self.plan.stages_on(pipe)
        what = ["head"] if pipe == 0 else []
        what += [f"target stage {s}" for s in stages]
        return f"rank {self._rank_of(pipe)} ({', '.join(what)})"

    def _build_links(self) -> None:
        plan = self.plan
        self.down_link: Link | None = None
        self.up_links: dict[int, Link] = {}
        self.in_link = self.out_link = self.head_link = None
        if plan.world_size == 1:
            return
        ranks = list(range(dist.get_world_size()))
        import datetime

        td = datetime.timedelta(seconds=self.timeout_s)
        down_group = self.grid.get_pipe_parallel_group()  # hidden states flow down on the grid's pipe group
        up_group = dist.new_group(ranks=ranks, timeout=td)  # anchors flow up on their own group
        ctrl_group = dist.new_group(ranks=ranks, backend="gloo", timeout=td)
        me, mine = self.global_rank, self._name(self.stage_id)

        def link(pipe: int, data_group) -> Link:
            return Link(me, self._rank_of(pipe), mine, self._name(pipe), data_group, ctrl_group, self.timeout_s,
                        self.spd_device)

        H = self.H
        if self.is_head:
            self.down_link = link(plan.pipe_of(plan.first_remote), down_group)
            self.up_buffers: dict[int, FlatBuffer] = {}
            for s in plan.remote_stages:
                self.up_links[s] = link(plan.pipe_of(s), up_group)
                rows = max(len(plan.up_rows(s)), 1)
                self.up_buffers[s] = FlatBuffer(self.max_len * rows * H, self.spd_dtype, self.spd_device)
        else:
            (s,) = plan.stages_on(self.stage_id)
            self.my_stage = s
            self.in_link = link(plan.upstream_pipe(s), down_group)
            nxt = plan.downstream_pipe(s)
            self.out_link = link(nxt, down_group) if nxt is not None else None
            self.head_link = link(0, up_group)
            self.in_buffer = FlatBuffer(self.max_len * H, self.spd_dtype, self.spd_device)

    def _links(self) -> list[Link]:
        return [x for x in [self.down_link, self.in_link, self.out_link, self.head_link, *self.up_links.values()] if x]

    def _comm_wait_s(self) -> float:
        return sum(x.wait_s for x in self._links())

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, drafter: Drafter) -> GenerationResult:
        """SPD generation of up to ``max_new_tokens`` verified tokens after ``prompt`` (head rank only).

        Args:
            prompt: token ids (non-empty).
            max_new_tokens: limit, the prefill token included.
            drafter: the proposer (:class:`~spd_ds.decoding.drafters.HeadDrafter`, oracle, ...).
        Returns:
            :class:`~spd_ds.decoding.reference.GenerationResult` with per-cycle timings in its metrics.
        Raises:
            PromptError: empty or too long prompt (before any message is sent).
            PipeCommError: a stage rank died or stalled.
        """
        return self._run_head("spd", prompt, max_new_tokens, drafter)

    @torch.no_grad()
    def generate_ar(self, prompt: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """Autoregressive generation through the same pipeline and stage code (head rank only): the exactness
        reference on the same kernels and the oracle drafter's source. Same contract as :meth:`generate`."""
        return self._run_head("ar", prompt, max_new_tokens, None)

    def _run_head(self, mode, prompt, max_new_tokens, drafter) -> GenerationResult:
        if not self.is_head:
            raise RuntimeError("generate() runs on the head rank (pipe stage 0) only")
        self.spd = _Generation(mode, list(prompt), int(max_new_tokens), drafter, SPDMetrics(num_stages=self.n))
        self._exec_schedule(sch.HeadSPDSchedule(self) if mode == "spd" else sch.HeadARSchedule(self))
        st = self.spd
        return GenerationResult(st.out, st.finish_reason, st.metrics)

    def serve(self) -> None:
        """Stage ranks: forward every message from upstream until SHUTDOWN."""
        if self.is_head:
            raise RuntimeError("serve() runs on stage ranks only")
        self._exec_schedule(sch.StageServeSchedule(self))

    def shutdown_pipeline(self) -> None:
        """Head rank: stop the stage ranks (SHUTDOWN down the pipe, acknowledged by the last stage)."""
        if self.is_head and self.down_link is not None:
            self._exec_schedule(_OneStep(self, [sch.Shutdown()]))

    def abort_pipeline(self) -> None:
        """Head rank, best effort after an error that left the links usable (e.g. a bad prompt): tell the stage ranks
        to stop; they raise :class:`~spd_ds.pipe.comm.PipeAborted`. Errors on broken links are swallowed."""
        if self.is_head and self.down_link is not None:
            try:
                self._exec_shutdown(abort=True)
            except Exception:  # noqa: BLE001 - the links may be broken already
                pass

    # ------------------------------------------------------------------ helpers (head)
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _enter(self, pos: int, token: int, verified: bool, fill: int = 0, draft: Draft | None = None) -> _Entry:
        if self.cuda:  # fill_ passes the id as a kernel argument: no blocking host-to-device copy
            ids = self._token_ids.fill_(token)
        else:
            ids = torch.tensor([[token]], device=self.spd_device)
        h = self.ends.embed(ids)
        feats = None
        if self.spd.mode == "spd":
            feats = h.new_zeros(self.m, h.shape[-1])
            feats[0] = h[0, 0]
        return _Entry(pos, token, self._next_seq(), h, feats, verified=verified, fill=fill, draft=draft)

    def _rows(self, stage: int, flags: int) -> tuple[int, ...]:
        if flags & FLAG_ANCHORS:
            return self.plan.up_rows(stage)
        return (self.L,) if stage == self.n - 1 else ()

    def _flags(self) -> int:
        return FLAG_ANCHORS if self.spd.mode == "spd" else 0

    def _recv_up(self, stage: int, seq: int, host_sync: bool = False) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The message of token ``seq`` from stage ``stage`` (dropping older, flushed tokens' messages).

        Returns ``(rows [q, k, H], row indices j)``; the rows live in the stage's receive buffer until the next
        receive from that stage.
        """
        link, buf = self.up_links[stage], self.up_buffers[stage]
        while True:
            hdr = link.recv_header()
            if hdr.kind not in (Kind.PREFILL, Kind.DECODE):
                raise PipeProtocolError(f"{link.me_name}: expected token {seq} from {link.peer_name}, got {hdr}")
            rows = self._rows(stage, hdr.flags)
            view = link.recv_payload(buf.view(hdr.q, len(rows), self.H))
            if hdr.seq == seq:
                break
            if hdr.seq > seq:
                raise PipeProtocolError(f"{link.me_name}: expected token {seq} from {link.peer_name}, got {hdr.seq}")
        if host_sync and self.cuda:
            self._arrived.record()  # one event for every host wait (each wait ends before the next record)
            link.host_wait(self._arrived, f"token {seq}")
        return view, rows

    def _store_rows(self, e: _Entry, stage: int, view: torch.Tensor, rows: tuple[int, ...], pos_slice=0) -> None:
        for idx, j in enumerate(rows):
            if e.feats is not None and j in self.k_of:
                e.feats[self.k_of[j]] = view[pos_slice, idx]
            if j == self.L and stage == self.n - 1:
                e.hidden = view[pos_slice, idx].view(1, 1, -1)

    def _finish(self, reason: str) -> None:
        st = self.spd
        st.finished, st.finish_reason = True, reason

    # ------------------------------------------------------------------ head instructions
    def _exec_load_prompt(self, mode: str) -> None:
        st = self.spd
        check_prompt(st.prompt, st.max_new, self.max_len, self.n)
        st.head_start = len(st.prompt)
        st.wait0 = self._comm_wait_s()

    def _exec_prefill(self) -> None:
        st, dev = self.spd, self.spd_device
        t0 = time.perf_counter()
        s0 = len(st.prompt)
        h = self.ends.embed(torch.tensor([st.prompt], device=dev))  # [1, s0, H]
        spd = st.mode == "spd"
        feats = h.new_zeros(s0, self.m, self.H) if spd else None
        if spd:
            feats[:, 0] = h[0]
        seq = self._next_seq()
        final = None
        for s in self.plan.head_stages:
            h, captured = self.runners[s].prefill(h)
            if spd:
                for j, t in captured.items():
                    feats[:, self.k_of[j]] = t[0]
        if self.plan.head_stages and self.plan.head_stages[-1] == self.n - 1:
            final = h[0]
        if self.down_link is not None:
            self.down_link.send(Kind.PREFILL, seq, 0, s0, self._flags(), h.contiguous())
            for s in self.plan.remote_stages:
                if not self._rows(s, self._flags()):
                    continue
                view, rows = self._recv_up(s, seq, host_sync=(s == self.n - 1))
                for idx, j in enumerate(rows):
                    if spd and j in self.k_of:
                        feats[:, self.k_of[j]] = view[:, idx]
                    if j == self.L and s == self.n - 1:
                        final = view[:, idx]
        logits = self.ends.logits(final[-1])
        tok = first_token(logits, self.sampling, s0)
        if spd:
            st.drafter.start(feats)
        st.metrics.prefill_s = time.perf_counter() - t0
        st.out = [tok]
        if tok in self.eos or st.max_new == 1:
            self._finish("eos" if tok in self.eos else "length")
            return
        st.t_decode = time.perf_counter()
        st.wait0 = self._comm_wait_s()
        e = self._enter(s0, tok, True)
        st.pipeline = [e]
        st.pending = e

    def _exec_load_token(self) -> None:
        st = self.spd
        e, st.pending = st.pending, None
        if st.mode == "ar":
            st.ar_entry = e
        if self.plan.first_remote == 0:
            self.down_link.send(Kind.DECODE, e.seq, e.pos, 1, self._flags(), e.hidden.contiguous())

    def _exec_prepare_draft(self) -> None:
        st = self.spd
        st.metrics.num_cycles += 1
        inflight = torch.stack([e.feats for e in st.pipeline])
        comp = torch.stack(st.completed) if st.completed else inflight.new_zeros(0, self.m, inflight.shape[-1])
        st.snapshot = (comp, inflight, [self.f[e.depth] for e in st.pipeline], st.head_start)
        if self._snapshot_ready is not None:  # the head's stream waits for the snapshot only, not for the stage
            self._snapshot_ready.record()        # forward launched next
        st.head_start += len(st.completed)
        st.completed = []
        st.at_stage = {}
        for e in st.pipeline:  # every in-flight token runs one stage this cycle
            st.at_stage[e.depth] = e
            e.depth += 1

    def _head_stage_forward(self, stage: int) -> None:
        st = self.spd
        e = st.ar_entry if st.mode == "ar" else st.at_stage.get(stage)
        if e is None:
            return
        if st.mode == "ar":
            if e.depth != stage:
                raise PipeProtocolError(f"AR token at depth {e.depth} reached stage {stage}")
            e.depth += 1
        runner = self.runners[stage]
        out, captured = runner.decode(e.hidden, e.pos)
        if e.feats is not None:
            for j, hj in captured.items():
                e.feats[self.k_of[j]] = hj[0, 0]
        e.hidden = out.clone() if runner.static else out

    def _exec_draft(self) -> None:
        st = self.spd
        comp, inflight, types, start = st.snapshot
        t = time.perf_counter()
        if self.head_stream is not None:
            self.head_stream.wait_event(self._snapshot_ready)
            with torch.cuda.stream(self.head_stream):
                draft = st.drafter.propose(comp, inflight, types, start, self.sampling)
            torch.cuda.current_stream(self.spd_device).wait_stream(self.head_stream)
        else:
            draft = st.drafter.propose(comp, inflight, types, start, self.sampling)
        st.metrics.head_s += time.perf_counter() - t
        newest = st.pipeline[-1]
        st.pipeline.append(self._enter(newest.pos + 1, draft.token, False, fill=len(st.pipeline), draft=draft))

    def _exec_recv_anchors(self, final: bool) -> None:
        st, n = self.spd, self.n
        remote = set(self.plan.remote_stages)
        if final:
            if (n - 1) not in remote:
                return
            if st.mode == "ar":
                e = st.ar_entry
                e.depth = n
            else:
                e = st.pipeline[0]
                if e.depth < n:
                    return
            view, rows = self._recv_up(n - 1, e.seq, host_sync=True)
            self._store_rows(e, n - 1, view, rows)
            return
        live = {id(e) for e in st.pipeline}
        for s, e in st.at_stage.items():
            if s in remote and s != n - 1 and id(e) in live and self.plan.up_rows(s):
                view, rows = self._recv_up(s, e.seq)
                self._store_rows(e, s, view, rows)

    def _exec_verify(self) -> None:
        st, n, sampling = self.spd, self.n, self.sampling
        st.rejected = False
        oldest = st.pipeline[0]
        if oldest.depth < n:
            st.pending = st.pipeline[-1]
            return
        t = time.perf_counter()
        cand = st.pipeline[1]
        logits = self.ends.logits(oldest.hidden[0, 0])
        ok, token = verify_draft(logits, cand.token, cand.draft.q_full, cand.pos, sampling)
        m = st.metrics
        m.num_drafts += 1
        m.drafts_by_fill[cand.fill] += 1
        st.completed.append(oldest.feats)
        st.pipeline.pop(0)
        if ok:
            m.num_accepted_tokens += 1
            m.accepted_by_fill[cand.fill] += 1
            cand.verified = True
            st.pending = st.pipeline[-1]
        else:
            st.rejected = True
            st.replacement = (cand.pos, token)
        st.out.append(token)
        m.verify_s += time.perf_counter() - t
        if token in self.eos:
            self._finish("eos")
        elif len(st.out) >= st.max_new:
            self._finish("length")

    def _exec_rollback(self) -> None:
        st = self.spd
        pos, token = st.replacement
        st.metrics.num_rollbacks += 1
        for r in self.runners.values():  # remote stages crop when the replacement's position reaches them
            r.crop(pos)
        e = self._enter(pos, token, True)
        st.pipeline = [e]
        st.pending = e

    def _exec_sample_target(self) -> None:
        st = self.spd
        e = st.ar_entry
        t = time.perf_counter()
        tok = first_token(self.ends.logits(e.hidden[0, 0]), self.sampling, e.pos + 1)
        st.metrics.verify_s += time.perf_counter() - t
        st.metrics.num_cycles += 1
        st.out.append(tok)
        if tok in self.eos:
            self._finish("eos")
        elif len(st.out) >= st.max_new:
            self._finish("length")
        else:
            st.pending = self._enter(e.pos + 1, tok, True)

    def _head_end_generation(self) -> None:
        st = self.spd
        m = st.metrics
        if st.t_decode is not None:
            m.decode_s = time.perf_counter() - st.t_decode
            m.comm_s = self._comm_wait_s() - st.wait0
        m.num_new_tokens = len(st.out)
        for s, r in self.runners.items():
            m.stage_forward_s[s] = r.take_stats()[0]
        if self.down_link is not None:
            self.down_link.send(Kind.END, self._next_seq())
            for s in self.plan.remote_stages:
                link = self.up_links[s]
                while True:
                    hdr = link.recv_header()
                    if hdr.kind in (Kind.PREFILL, Kind.DECODE):  # a flushed token's message
                        link.recv_payload(self.up_buffers[s].view(hdr.q, len(self._rows(s, hdr.flags)), self.H))
                    elif hdr.kind == Kind.END:
                        stats = link.recv_stats(hdr.q)
                        m.stage_forward_s[s] = float(stats[0])
                        break
                    else:
                        raise PipeProtocolError(f"{link.me_name}: unexpected {hdr} from {link.peer_name}")
        local = sum(m.stage_forward_s[s] for s in self.plan.head_stages)
        m.control_s = max(0.0, m.decode_s - m.head_s - m.verify_s - m.comm_s - local)

    # ------------------------------------------------------------------ stage instructions
    def _exec_recv_hidden(self) -> None:
        prev = self.stage_msg
        if prev is None or prev.kind in (Kind.END, Kind.WARMUP):  # between generations the head may be busy
            self.watchdog.idle()  # elsewhere (e.g. an evaluation's baselines): wait up to IDLE_TIMEOUT_S
            hdr = self.in_link.recv_header(timeout_s=max(self.timeout_s, IDLE_TIMEOUT_S))
            self.watchdog.beat()
        else:
            hdr = self.in_link.recv_header()
        self.stage_msg = hdr
        if hdr.kind in (Kind.PREFILL, Kind.DECODE, Kind.WARMUP):
            self.stage_in = self.in_link.recv_payload(self.in_buffer.view(1, hdr.q, self.H))

    def _exec_stage_forward(self, stage: int) -> None:
        if self.is_head:
            return self._head_stage_forward(stage)
        msg, runner = self.stage_msg, self.runners[stage]
        if msg.kind == Kind.PREFILL:
            self.stage_out, self.stage_cap = runner.prefill(self.stage_in)
        else:
            self.stage_out, self.stage_cap = runner.decode(self.stage_in, msg.pos)

    def _exec_send_hidden(self, stage: int) -> None:
        if self.is_head:
            st = self.spd
            e = st.ar_entry if st.mode == "ar" else st.at_stage.get(stage)
            if e is not None:
                self.down_link.send(Kind.DECODE, e.seq, e.pos, 1, self._flags(), e.hidden.contiguous())
            return
        if self.out_link is not None:
            msg = self.stage_msg
            out = self.stage_out.clone() if self.runners[stage].static else self.stage_out.contiguous()
            self.out_link.send(msg.kind, msg.seq, msg.pos, msg.q, msg.flags, out)

    def _exec_send_anchors(self, stage: int) -> None:
        msg = self.stage_msg
        rows = self._rows(stage, msg.flags)
        if not rows:
            return
        last = stage == self.n - 1
        parts = [self.stage_out if (last and j == self.L) else self.stage_cap[j] for j in rows]
        pack = torch.stack(parts, dim=2).view(msg.q, len(rows), self.H)  # [q, k, H], a fresh tensor
        self.head_link.send(msg.kind, msg.seq, msg.pos, msg.q, msg.flags, pack)

    def _exec_end_generation(self) -> None:
        if self.is_head:
            return self._head_end_generation()
        fs, nf = self.runners[self.my_stage].take_stats()
        total_wait = self._comm_wait_s()
        wait, self._wait_mark = total_wait - self._wait_mark, total_wait
        self.head_link.send_stats(Kind.END, torch.tensor([fs, nf, wait, 0.0], dtype=torch.float64))
        if self.out_link is not None:
            self.out_link.send(Kind.END, self.stage_msg.seq)

    def _exec_shutdown(self, abort: bool = False) -> None:
        if self.is_head:
            self.down_link.send(Kind.SHUTDOWN, self._next_seq(), flags=FLAG_ABORT if abort else 0)
            if abort:
                self.down_link.flush()
                return
            link = self.up_links[self.n - 1]
            while True:  # the last stage acknowledges once every stage has passed SHUTDOWN on
                hdr = link.recv_header()
                if hdr.kind == Kind.SHUTDOWN:
                    break
                if hdr.kind in (Kind.PREFILL, Kind.DECODE):
                    link.recv_payload(self.up_buffers[self.n - 1].view(hdr.q, len(self._rows(self.n - 1, hdr.flags)),
                                                                       self.H))
            for x in self._links():
                x.flush()
            return
        aborted = bool(self.stage_msg.flags & FLAG_ABORT)
        if self.out_link is not None:
            self.out_link.send(Kind.SHUTDOWN, self.stage_msg.seq, flags=self.stage_msg.flags)
            self.out_link.flush()
        elif not aborted:
            self.head_link.send(Kind.SHUTDOWN, self.stage_msg.seq)
        if aborted:
            raise PipeAborted(f"{self.in_link.me_name}: the head rank stopped the run after an error (see its log)")
        for x in self._links():
            x.flush()

    def _exec_warmup(self) -> None:
        zeros = torch.zeros(1, 1, self.H, dtype=self.spd_dtype, device=self.spd_device)
        if self.is_head:
            self.down_link.send(Kind.WARMUP, 0, 0, 1, 0, zeros)
            for s in self.plan.remote_stages:
                link = self.up_links[s]
                hdr = link.recv_header()
                if hdr.kind != Kind.WARMUP:
                    raise PipeProtocolError(f"{link.me_name}: expected WARMUP from {link.peer_name}, got {hdr}")
                link.recv_payload(self.up_buffers[s].view(1, 1, self.H))
            return
        if self.out_link is not None:
            self.out_link.send(Kind.WARMUP, 0, 0, 1, 0, zeros)
        self.head_link.send(Kind.WARMUP, 0, 0, 1, 0, zeros.clone())

    def _warmup(self) -> None:
        """Exercise every link once (head: send and collect; stage: serve one message)."""
        if self.plan.world_size == 1:
            return
        if self.is_head:
            self._exec_schedule(_OneStep(self, [sch.Warmup()]))
        else:
            self._exec_schedule(_OneStep(self, [sch.RecvHidden()]))
            if self.stage_msg.kind != Kind.WARMUP:
                raise PipeProtocolError(f"expected WARMUP first, got {self.stage_msg}")
            self._exec_schedule(_OneStep(self, [sch.Warmup()]))

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        sch.LoadPrompt: _exec_load_prompt,
        sch.Prefill: _exec_prefill,
        sch.PrepareDraft: _exec_prepare_draft,
        sch.StageForward: _exec_stage_forward,
        sch.SendHidden: _exec_send_hidden,
        sch.RecvHidden: _exec_recv_hidden,
        sch.SendAnchors: _exec_send_anchors,
        sch.RecvAnchors: _exec_recv_anchors,
        sch.Draft: _exec_draft,
        sch.Verify: _exec_verify,
        sch.Rollback: _exec_rollback,
        sch.LoadToken: _exec_load_token,
        sch.SampleTarget: _exec_sample_target,
        sch.EndGeneration: _exec_end_generation,
        sch.Shutdown: _exec_shutdown,
        sch.Warmup: _exec_warmup,
    }


class _OneStep(sch._EngineSchedule):
    """A one-step schedule (start-up and shutdown)."""

    def __init__(self, engine, cmds) -> None:
        super().__init__(engine)
        self.cmds = cmds

    def steps(self):
        yield self.cmds

