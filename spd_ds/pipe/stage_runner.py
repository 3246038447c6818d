"""Forwards of one target stage on the rank that holds it (eager cache, or static cache + CUDA graph)."""

from __future__ import annotations

import logging
import time

import torch

from spd_ds.models.adapter import TargetStage
from spd_ds.models.graphs import GraphedStage
from spd_ds.pipe.comm import PipeProtocolError

logger = logging.getLogger(__name__)


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
        """Prompt states ``[1, q, H]`` at positions ``0..q-1`` (the cache starts empty). Returns
        ``(hidden, captured)``."""
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
