"""The speculation head over a static KV cache, one CUDA graph per cycle (the drafter's GPU speed path).

With graphed stages the head is what limits an SPD cycle on GPU (SmolLM2, n = 2, one H200: 14.6 ms per cycle
against 1.79 ms for the slowest graphed stage): aggregation, tower, final norm, LM head and argmax are a few dozen
small kernels, launched eagerly with host decisions in between. :class:`GraphedHeadDrafter` computes exactly what
:class:`~spd_ds.decoding.drafters.HeadDrafter` computes (paper §3.2 multi-depth aggregation, §3.4 drafting from the
pipeline input states), but with fixed shapes and no host decision, so one cycle's work is one graph replay:

* **fixed rows**: a cycle's ``R`` rows (``Rc`` completed, then ``Ri`` in flight) are padded to ``R_pad`` rows
  (default ``n + 1``: one token completed since the last cycle plus at most ``n`` in flight, which is the most a cycle
  of the reference decoder or the engine ever has). A call with more rows runs the same static computation eagerly,
  unpadded, and is counted in :attr:`GraphedHeadDrafter.fallbacks`;
* **aggregation by index**: every type's projection for every row, row ``r`` taking ``g_{k_r}`` through a device
  type-index tensor (:meth:`~spd_ds.head.SpeculationHead.aggregate_indexed`);
* **static cache**: the tower runs over a :class:`~spd_ds.models.kv_cache.StageKVCache` (``static=True``) as
  :func:`~spd_ds.models.graphs.static_stage_forward` does: keys/values written at a positions tensor, each row
  attending to positions ``<= `` its own;
* the final norm and LM head run on the last *real* row (its index is a device tensor) and the argmax stays on the
  device: the host reads one int, the draft token, per cycle. At T > 0 the draft is sampled from a copy of the static
  logits by :func:`~spd_ds.decoding.drafters.draft_from_logits`, with the same position-keyed uniforms.

**Padding invariant.** Real rows sit at positions ``C .. C+R-1`` (``C = start_pos``), padding rows at
``C+R .. C+R_pad-1``, so the cache holds ``max_len + R_pad`` positions. Every position below the committed length
holds a committed completed row (padding only ever writes *after* the real rows, i.e. beyond what is committed), and
a real row at position ``p`` reads positions ``0..p`` only: the committed ones, and this call's real rows at
``C..p``. Padding rows and the in-flight rows of earlier calls therefore only leave keys/values at positions that no
row reads before a real row rewrites them, and a rollback (fewer in-flight rows, or ``start_pos`` going back) needs
no work on the device. Padding rows get stale features (finite; their outputs are never read).

With ``use_graph=False`` (CPU, tests) the identical static computation runs eagerly. The eager
:class:`~spd_ds.decoding.drafters.HeadDrafter` over a length-based cache stays the CPU path of every decoder.
"""

from __future__ import annotations

from typing import Sequence

import torch

from spd_ds.decoding.drafters import Draft, draft_from_logits
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.head import SpeculationHead
from spd_ds.models.graphs import capture_graph
from spd_ds.models.kv_cache import CacheOverflowError, StageKVCache


def static_head_tower(head: SpeculationHead, cache: StageKVCache, rows: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """The head's ``L_s`` tower layers over a static cache (no host synchronisation; capturable).

    Args:
        head: the :class:`~spd_ds.head.SpeculationHead`.
        cache: a static :class:`StageKVCache` over layers ``0..L_s-1``.
        rows: ``[1, q, H]`` aggregated rows.
        positions: int64 ``[q]`` token positions on the head's device (RoPE positions and KV write positions).
    Returns:
        ``[1, q, H]`` tower output (before the final norm).
    Raises:
        RuntimeError: ``cache`` is not a static cache.
    """
    cache.bind(positions)
    return head.tower(rows, positions, cache, mask=cache.attention_mask(positions))  # advance(): host count only


class GraphedHeadDrafter:
    """The SPD speculation head as a :class:`~spd_ds.decoding.drafters.Drafter` over a static KV cache, each cycle's
    work replayed as one CUDA graph (see the module docstring for the row layout and the padding invariant).

    Args:
        head: a :class:`~spd_ds.head.SpeculationHead` (moved to ``device``/``dtype`` in place, as HeadDrafter does).
        max_len: KV capacity in positions for real rows (the cache holds ``max_len + max_rows``).
        dtype, device: compute dtype/device of the head.
        use_graph: capture a CUDA graph; ``None`` = when ``device`` is CUDA. ``False`` runs the same static
            computation eagerly.
        max_rows: ``R_pad``, rows per replay; ``None`` = ``n + 1`` of the head's partition.
        warmup: eager runs on a side stream before the capture.

    Static tensors (fixed addresses, overwritten by the next :meth:`propose`):
        ``feats [R_pad, m, H]`` (head dtype) and ``meta`` int64 ``[2 + R_pad]`` = ``(start_pos, last real row,
        type of each row)`` (inputs); ``logits [V_d]`` fp32 and ``token [1]`` int64 (argmax as a target id) (outputs).

    The graph uses a private memory pool and is captured on a stream of its own (:attr:`capture_stream`, hence its
    own cuBLAS workspace): in the engine it replays on the head's stream while the stage graphs (which share one pool
    and one capture stream) replay on the default stream.

    Raises:
        ValueError: ``use_graph`` off CUDA, or ``max_rows < 1``.
    """

    def __init__(self, head: SpeculationHead, max_len: int, dtype: torch.dtype, device, *,
                 use_graph: bool | None = None, max_rows: int | None = None, warmup: int = 3) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        use_graph = cuda if use_graph is None else bool(use_graph)
        if use_graph and not cuda:
            raise ValueError(f"CUDA graphs need the head on a CUDA device, not {self.device}")
        part = head.partition
        self.rows = int(max_rows) if max_rows is not None else part.num_stages + 1
        if self.rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.rows}")
        self.head = head.to(device=self.device, dtype=dtype).eval()
        self.head.rotary.inv_freq = self.head.rotary.inv_freq.float()
        self.m, self.dtype, self.max_len = part.num_types, dtype, int(max_len)
        arch = head.arch
        self.cache = StageKVCache(range(head.num_layers), arch.num_kv_heads, arch.head_dim, self.max_len + self.rows,
                                  dtype, self.device, static=True)
        self.length = 0  # committed positions (host bookkeeping only)
        self.fallbacks = 0  # calls with more than ``rows`` rows (run eagerly, unpadded)
        self.feats = torch.zeros(self.rows, self.m, arch.hidden_size, dtype=dtype, device=self.device)
        self.meta = torch.full((2 + self.rows,), self.m - 1, dtype=torch.long, device=self.device)
        self.meta[:2] = 0
        self._meta_host = self.meta.cpu().pin_memory() if cuda else self.meta.clone()
        self._meta_np = self._meta_host.numpy()
        self._meta_copied = torch.cuda.Event() if cuda else None
        self._row_ids = torch.arange(self.rows, device=self.device)
        self.logits: torch.Tensor | None = None
        self.token: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None  # the latest call's logits (static, or a fallback's own)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capture_stream: torch.cuda.Stream | None = None
        if use_graph:
            self._capture(warmup)

    # ------------------------------------------------------------------ one cycle (capturable)
    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Aggregate, tower and draft from the static inputs. Returns ``(logits [V_d] fp32, token [1] int64)``."""
        head = self.head
        positions = self.meta[0] + self._row_ids  # [R_pad]: C .. C+R_pad-1
        rows = head.aggregate_indexed(self.feats, self.meta[2:])
        h = static_head_tower(head, self.cache, rows[None], positions)
        logits = head.logits(h[0].index_select(0, self.meta[1:2]))[0]
        return logits, head.draft_ids.index_select(0, torch.argmax(logits).view(1))

    def _capture(self, warmup: int) -> None:
        # Warm-up and capture on a stream of the head's own. cuBLAS(Lt) kernels captured in a graph keep the workspace
        # of the (handle, stream) they were captured on; torch.cuda.graph's default capture stream is one stream for
        # every capture of the process, so a head captured there would share its workspace with the stage graphs,
        # which the engine replays at the same time (head stream vs default stream). A high-priority pool stream is
        # never the (normal-priority) default capture stream. The warm-up writes garbage at positions 0..R_pad-1:
        # start() rewrites what is read.
        self.capture_stream = torch.cuda.Stream(self.device, priority=-1)
        # thread_local: the head is captured lazily, after NCCL traffic has begun, and the process group's watchdog
        # thread keeps querying its events meanwhile (legal for other threads in this mode, fatal in "global")
        self.graph, (self.logits, self.token) = capture_graph(self._step, self.device, warmup=warmup,
                                                               stream=self.capture_stream,
                                                               capture_error_mode="thread_local")

    @property
    def graphed(self) -> bool:
        """Whether :meth:`propose` replays a captured CUDA graph."""
        return self.graph is not None

    # ------------------------------------------------------------------ Drafter protocol
    @torch.no_grad()
    def start(self, prompt_feats: torch.Tensor) -> None:
        """Commit the prompt's rows (``prompt_feats [s0, m, H]``, all at the deepest type) eagerly at positions
        ``0..s0-1`` of the static cache (as :meth:`~spd_ds.models.graphs.GraphedStage.prefill` does).

        Raises:
            CacheOverflowError: ``s0 > max_len``.
        """
        s0 = prompt_feats.shape[0]
        if s0 > self.max_len:
            raise CacheOverflowError(f"head KV cache of {self.max_len} positions is full (need {s0}); "
                                     "raise decoding.max_length")
        rows = self.head.aggregate(prompt_feats.to(self.dtype), [self.m - 1] * s0)
        static_head_tower(self.head, self.cache, rows[None], torch.arange(s0, device=self.device))
        self.length = s0

    @torch.no_grad()
    def propose(self, completed: torch.Tensor, inflight: torch.Tensor, inflight_types: Sequence[int],
                start_pos: int, sampling: SamplingParams) -> Draft:
        """See :class:`~spd_ds.decoding.drafters.Drafter`. The rows of ``completed`` are committed; in-flight rows
        are not. ``start_pos`` may lie below the committed length (a crop: free on the static cache), unlike
        HeadDrafter, which needs it equal.

        Raises:
            RuntimeError: ``start_pos`` beyond the committed length (positions that were never written).
            CacheOverflowError: ``start_pos + R > max_len``.
            ValueError: an aggregation type outside ``[0, m)``.
        """
        if start_pos > self.length:
            raise RuntimeError(f"head cache holds {self.length} positions but the window starts at {start_pos}")
        Rc, Ri = completed.shape[0], inflight.shape[0]
        R = Rc + Ri
        if start_pos + R > self.max_len:
            raise CacheOverflowError(f"head KV cache of {self.max_len} positions is full (need {start_pos + R}); "
                                     "raise decoding.max_length")
        types = [self.m - 1] * Rc + [int(t) for t in inflight_types]
        if len(types) != R or any(not 0 <= t < self.m for t in types):
            raise ValueError(f"need one aggregation type in [0, {self.m}) per in-flight row, "
                             f"got {list(inflight_types)}")
        self.length = start_pos + Rc
        if R > self.rows:  # more rows than a replay holds: the same static computation, eagerly and unpadded
            self.fallbacks += 1
            feats = torch.cat([completed, inflight]).to(self.dtype)
            rows = self.head.aggregate(feats, types)
            h = static_head_tower(self.head, self.cache, rows[None],
                                  torch.arange(start_pos, start_pos + R, device=self.device))
            self.last_logits = self.head.logits(h[0, -1])
            return draft_from_logits(self.last_logits, self.head.draft_ids, sampling, start_pos + R)
        self.feats[:Rc].copy_(completed)
        self.feats[Rc:R].copy_(inflight)
        if self._meta_copied is not None:
            self._meta_copied.synchronize()  # the previous call's copy has read the pinned buffer (normally long since)
        self._meta_np[0], self._meta_np[1] = start_pos, R - 1
        self._meta_np[2:2 + R] = types  # padding rows keep earlier (valid) types
        self.meta.copy_(self._meta_host, non_blocking=True)
        if self._meta_copied is not None:
            self._meta_copied.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits, self.token = self._step()
        self.last_logits = self.logits
        if sampling.greedy:
            return Draft(int(self.token))  # the one host read of the cycle
        return draft_from_logits(self.logits, self.head.draft_ids, sampling, start_pos + R)  # warping copies them
