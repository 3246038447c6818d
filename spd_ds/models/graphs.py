"""Static-cache stage forwards and their CUDA-graph runner (GPU speed path).

At batch 1 a decode step is bound by kernel launches, not by bytes: 15 SmolLM2 layers take
10.8 ms eagerly and 1.28 ms as a CUDA graph on one H200. A graph needs fixed addresses and no host decisions, so the
stages run over a *static* :class:`~spd_ds.models.kv_cache.StageKVCache`: the token position lives in a device tensor,
keys/values are written there with ``index_copy_`` and attention is masked to positions ``<= p``. A rollback then
needs no work on the device at all: the next token is written at its own position and everything after it is masked.
Linear-attention layers (Qwen3.5) read and write their states in position-indexed snapshot rings
(:class:`~spd_ds.models.linear_cache.HybridStageCache`), so the same holds for them.

:class:`GraphedStage` wraps one stage, or several consecutive stages captured as one graph (an AR baseline runs the
whole target this way), behind two calls: ``prefill`` (eager, any length) and ``step`` (one token, replayed). Both use
the same static-cache code, so an SPD run and an AR run built from :class:`GraphedStage` compute every token with the
same kernels and give the same tokens. The eager CPU path (``TargetStage.forward`` over a length-based cache) is a
different computation and is not used here.

:func:`capture_graph` is the one CUDA-graph capture of the project (side-stream warm-up, capture stream, memory pool):
graphed stages, the graphed speculation head (:mod:`spd_ds.decoding.head_graph`) and the ``ar_graph`` baseline
(:mod:`spd_ds.decoding.ar_graph`) all capture through it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from spd_ds.models.adapter import TargetStage
from spd_ds.models.kv_cache import StageKVCache
from spd_ds.models.masks import layer_mask


def make_static_cache(stage: TargetStage, max_len: int, dtype: torch.dtype | None = None, device=None) -> StageKVCache:
    """A static-mode :class:`StageKVCache` ``[1, kv_heads, max_len, head_dim]`` per layer of ``stage`` (a
    :class:`~spd_ds.models.linear_cache.HybridStageCache` when the stage has linear-attention layers: its snapshot
    rings are indexed by position on the device, ``arch.max_rollback + 1`` states per layer).

    Args:
        stage: the :class:`~spd_ds.models.adapter.TargetStage` whose layers the cache serves.
        max_len: capacity in positions (prompt + new tokens + tokens in flight).
        dtype, device: default to the stage's parameters'.
    """
    p = next(stage.parameters())
    return stage.arch.new_cache(stage.layer_ids, max_len, dtype or p.dtype, device if device is not None else p.device,
                                static=True)


def static_stage_forward(stages: Sequence[TargetStage], caches: Sequence[StageKVCache], hidden: torch.Tensor,
                         positions: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run consecutive stages over static caches (no host synchronisation; capturable).

    Args:
        stages: consecutive :class:`TargetStage` s.
        caches: one static :class:`StageKVCache` per stage.
        hidden: ``[1, q, H]`` input of the first stage.
        positions: int64 ``[q]`` token positions on the stages' device (also the KV write positions).
    Returns:
        ``(hidden [1, q, H], {j: [1, q, H]})``: the last stage's output and the raw outputs of every captured layer
        (anchor index ``j`` -> state), as :meth:`TargetStage.forward` returns them.
    """
    captured: dict[int, torch.Tensor] = {}
    mask = layer_mask(caches[0].attention_mask(positions), stages[0].arch.config._attn_implementation, hidden.dtype)
    pos2 = positions[None]
    for stage, cache in zip(stages, caches):
        cache.bind(positions)
        pos_emb = stage.rotary(hidden, pos2)
        kw = {stage.arch.cache_kwarg: cache}
        for i, layer in zip(stage.layer_ids, stage.layers):
            m = None if stage.arch.is_linear(i) else mask
            hidden = layer(hidden, attention_mask=m, position_ids=pos2, position_embeddings=pos_emb, **kw)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            if i in stage.capture:
                captured[stage.capture[i]] = hidden
    return hidden, captured


class GraphedStage:
    """One-token forwards of one or more consecutive stages over static caches, replayed as a CUDA graph.

    Args:
        stages: a :class:`TargetStage`, or consecutive stages run in order as one graph.
        max_len: KV capacity in positions.
        use_graph: capture a CUDA graph (stages on a CUDA device). ``False`` runs the same static forward eagerly
            (used on CPU, and to check the graph against it).
        warmup: eager runs on a side stream before the capture (library workspaces, autotuning).
        pool: a ``torch.cuda.graph_pool_handle()`` shared with other graphs of the process (``None`` = own pool).

    Static tensors (fixed addresses; valid until the next :meth:`step`):
        ``hidden_in [1, 1, H]`` and ``pos [1]`` int64 (inputs), ``hidden_out [1, 1, H]`` and ``captured {j: [1, 1, H]}``
        (outputs).

    Raises:
        ValueError: ``use_graph`` with stages that are not on a CUDA device.
    """

    def __init__(self, stages: TargetStage | Sequence[TargetStage], max_len: int, *, use_graph: bool = True,
                 warmup: int = 3, pool=None) -> None:
        self.stages = [stages] if isinstance(stages, TargetStage) else list(stages)
        p = next(self.stages[0].parameters())
        self.device, self.dtype = p.device, p.dtype
        if use_graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the stages on a CUDA device, not {self.device}")
        self.max_len = int(max_len)
        self.caches = [make_static_cache(s, self.max_len) for s in self.stages]
        H = self.stages[0].arch.hidden_size
        self.hidden_in = torch.zeros(1, 1, H, dtype=self.dtype, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.hidden_out: torch.Tensor | None = None
        self.captured: dict[int, torch.Tensor] = {}
        self.graph = None
        if use_graph:
            self._capture(warmup, pool)

    def _capture(self, warmup: int, pool) -> None:
        def step():  # the warm-up writes garbage at position 0: harmless, prefill rewrites it
            return static_stage_forward(self.stages, self.caches, self.hidden_in, self.pos)

        self.graph, (self.hidden_out, self.captured) = capture_graph(step, self.device, warmup=warmup, pool=pool)

    @property
    def graphed(self) -> bool:
        """Whether :meth:`step` replays a captured CUDA graph."""
        return self.graph is not None

    @torch.no_grad()
    def prefill(self, hidden: torch.Tensor, positions: torch.Tensor | None = None):
        """Eager forward of ``q`` tokens (e.g. a prompt), writing their keys/values at ``positions``.

        Args:
            hidden: ``[1, q, H]``.
            positions: int64 ``[q]`` on the device (default ``0..q-1``).
        Returns:
            ``(hidden [1, q, H], {j: [1, q, H]})`` (fresh tensors).
        """
        q = hidden.shape[1]
        if positions is None:
            positions = torch.arange(q, device=self.device)
            for c in self.caches:  # host-side bookkeeping only
                c.length = q
        return static_stage_forward(self.stages, self.caches, hidden, positions)

    @torch.no_grad()
    def step(self, hidden: torch.Tensor | None = None, pos: int | torch.Tensor | None = None):
        """One token through the stages: copy the inputs into the static tensors, replay (or run eagerly).

        Args:
            hidden: ``[1, 1, H]`` input (``None``: already in :attr:`hidden_in`).
            pos: the token's position, a Python int (filled on the device without a host sync) or an int64 device
                tensor ``[1]`` (``None``: already in :attr:`pos`).
        Returns:
            ``(hidden_out [1, 1, H], captured {j: [1, 1, H]})``: the static outputs, overwritten by the next step;
            copy them before the next call if they must live longer.
        """
        if hidden is not None and hidden is not self.hidden_in:
            self.hidden_in.copy_(hidden)
        if isinstance(pos, int):
            self.pos.fill_(pos)
            for c in self.caches:
                c.length = pos + 1
        elif pos is not None and pos is not self.pos:
            self.pos.copy_(pos)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.hidden_out, self.captured = static_stage_forward(self.stages, self.caches, self.hidden_in, self.pos)
        return self.hidden_out, self.captured

    def reset(self) -> None:
        """Forget the host-side lengths (a new prompt); the device buffers need no clearing."""
        for c in self.caches:
            c.reset()


def new_graph_pool():
    """A CUDA graph memory pool handle (``torch.cuda.graph_pool_handle()``) for graphs that share memory, e.g. every
    stage graph of one process (they never replay at the same time)."""
    return torch.cuda.graph_pool_handle()


@torch.no_grad()
def capture_graph(step: Callable[[], Any], device, *, warmup: int = 3, warmup_step: Callable[[], Any] | None = None,
                  pool=None, stream: "torch.cuda.Stream | None" = None,
                  capture_error_mode: str = "global") -> tuple["torch.cuda.CUDAGraph", Any]:
    """Capture ``step`` (a function of static tensors, no host synchronisation) as a CUDA graph.

    1. **warm-up**: ``warmup_step`` (default ``step``) runs ``max(1, warmup)`` times eagerly on a side stream (library
       workspaces, autotuning, lazy initialisation happen there, not in the graph); the side stream first waits for
       the current one;
    2. **capture**: ``step`` runs once under ``torch.cuda.graph``; its allocations go to ``pool`` (``None``: a pool
       of the graph's own). Without ``stream`` the capture runs on torch's process-wide capture stream, after the
       current stream has waited for the warm-up. With ``stream`` both warm-up and capture run on it (a graph keeps
       the cuBLAS workspace of the stream it was captured on: a graph replayed beside others needs a stream of its
       own) and the current stream waits for it after the capture.

    Args:
        step: what the graph replays; returns its (static) outputs.
        device: the CUDA device.
        warmup, warmup_step: warm-up runs and what runs in them.
        pool: a memory pool handle (:func:`new_graph_pool`) to share.
        stream: the warm-up and capture stream (default: a fresh side stream, and torch's capture stream).
        capture_error_mode: ``torch.cuda.graph``'s; ``"thread_local"`` lets other threads (e.g. NCCL's watchdog)
            keep querying events during a capture that starts after communication has begun.
    Returns:
        ``(graph, outputs)``: the ``torch.cuda.CUDAGraph`` and ``step``'s outputs, overwritten by every replay.
    Raises:
        RuntimeError: something in ``step`` cannot be captured (e.g. data-dependent shapes, a host synchronisation).
    """
    current = torch.cuda.current_stream(device)
    side = stream if stream is not None else torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.no_grad(), torch.cuda.stream(side):  # inference graphs: no autograd state recorded
        for _ in range(max(1, warmup)):
            (warmup_step or step)()
    if stream is None:
        current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
        outputs = step()
    if stream is not None:
        current.wait_stream(side)
    return graph, outputs
