"""Per-stage cache for hybrid targets (Qwen3.5): KV for full-attention layers, snapshot rings for linear attention.

A Gated DeltaNet layer (transformers' ``Qwen3_5GatedDeltaNet``) keeps two states per sequence instead of keys and
values: the depthwise causal conv's input window ``conv [1, conv_dim, K]`` (compute dtype) and the recurrent state
``recurrent [1, value_heads, key_dim, value_dim]`` (fp32). Cropping the KV length does not undo them, and SPD rolls a
stage back by up to ``n - 1`` tokens (the in-flight tokens behind a rejected draft). :class:`HybridStageCache` keeps,
for every linear-attention layer, a **ring of snapshots indexed by sequence length**: slot ``l % R`` holds the
states after ``l`` tokens. A forward at length ``l`` reads slot ``l % R`` and writes its result into slot
``(l + q) % R``; the prefill (one multi-token forward) seeds the ring with the state after the prompt.

* **Rollback** (:meth:`crop` to length ``l``) moves the length only: the next forward reads slot ``l % R``, which
  still holds the state after ``l`` tokens as long as ``l >= length - (R - 1)``; older targets raise
  :class:`RollbackError` (never a silently wrong state). No device work at all, whatever the rewind.
* **Per token** (nothing rejected): the layer's new recurrent state is copied into its slot (transformers' own cache
  copies it into its buffer too) and the conv window (``conv_dim x K`` elements) is copied once more, because the
  single-token conv update works in place. O(1) in sequence length and in ``n``.
* **Memory** per linear-attention layer: ``R x (conv_dim x K x bytes(dtype) + value_heads x key_dim x value_dim x 4)``
  with ``R = max_rollback + 1 = n`` slots (static mode: ``n + 1``, one all-zero slot for position 0). Qwen3.5-4B
  (conv_dim 8192, K 4, 32 x 128 x 128, bf16): 64 KiB + 2 MiB = 2.06 MiB per slot, so ``2.06 n`` MiB per layer and
  ``49.5 n`` MiB for its 24 linear layers (KV of its 8 full-attention layers: 32 KiB per token).
* **Static mode** (CUDA graphs, :mod:`spd_ds.models.graphs`): the read and write slots are computed on the device
  from the bound positions (``where(p == 0, zero slot, p % R)`` and ``(p_last + 1) % R``) and the states are
  gathered/scattered with ``index_select`` / ``index_copy_``, so a captured forward replays unchanged and a rollback
  is, as for the KV, just the next token's position.

The layers are transformers' own; this object implements the cache methods their forward calls (both spellings:
transformers 5.5-5.17 ``has_previous_state`` + ``layers[i].conv_states`` / ``recurrent_states`` / ``record_past``,
5.2x ``get_conv_state`` / ``get_recurrent_state`` / ``is_recording_past`` (5.25 also ``get_recurrent_states_to_keep``,
``increase_count``); and ``update_conv_state`` / ``update_recurrent_state`` in both). :data:`CACHE_CONTRACT` lists
every name; ``tests/test_linear_cache.py::test_cache_contract_with_the_installed_transformers`` runs the installed
transformers' layers on a proxy that refuses any other name and compares with transformers' own cache, so a change of
that contract fails a test instead of silently computing something else.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from spd_ds.models.kv_cache import StageKVCache

# Every attribute a transformers linear-attention layer may read from the cache object it is given (5.5 .. 5.25).
CACHE_CONTRACT = frozenset({
    "update",  # full-attention layers (StageKVCache)
    "get_conv_state", "get_recurrent_state", "is_recording_past",  # 5.2x
    "get_recurrent_states_to_keep", "increase_count",  # 5.25
    "has_previous_state", "layers",  # 5.5 .. 5.17 (``layers[i].conv_states[0]`` etc.)
    "update_conv_state", "update_recurrent_state",  # both
})


class RollbackError(RuntimeError):
    """A crop to a length whose linear-attention state is no longer held (rewind deeper than the ring)."""


class CacheContractError(RuntimeError):
    """transformers handed the cache a state of another shape than the one it preallocated (API drift)."""


@dataclasses.dataclass(frozen=True)
class LinearStateShape:
    """Geometry of one Gated DeltaNet layer's per-sequence state (batch 1).

    Attributes:
        conv_dim: channels of the depthwise conv (``2 x key_heads x key_dim + value_heads x value_dim``).
        conv_kernel: conv kernel ``K`` (the cached window is ``K`` inputs wide, as in transformers).
        value_heads, key_dim, value_dim: recurrent state ``[1, value_heads, key_dim, value_dim]``.
    """

    conv_dim: int
    conv_kernel: int
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def from_config(cls, cfg) -> "LinearStateShape":
        """From a Qwen3.5 / Qwen3-Next text config (``linear_*`` fields)."""
        kh, kd = int(cfg.linear_num_key_heads), int(cfg.linear_key_head_dim)
        vh, vd = int(cfg.linear_num_value_heads), int(cfg.linear_value_head_dim)
        return cls(2 * kh * kd + vh * vd, int(cfg.linear_conv_kernel_dim), vh, kd, vd)

    @property
    def conv(self) -> tuple[int, ...]:
        """``(1, conv_dim, K)``."""
        return (1, self.conv_dim, self.conv_kernel)

    @property
    def recurrent(self) -> tuple[int, ...]:
        """``(1, value_heads, key_dim, value_dim)``."""
        return (1, self.value_heads, self.key_dim, self.value_dim)

    def slot_bytes(self, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one snapshot (conv window in ``dtype`` + recurrent state in ``state_dtype``)."""
        conv = self.conv_dim * self.conv_kernel * torch.empty((), dtype=dtype).element_size()
        rec = self.value_heads * self.key_dim * self.value_dim * torch.empty((), dtype=state_dtype).element_size()
        return conv + rec


class _LayerView:
    """``cache.layers[i]`` as transformers 5.5-5.17 linear layers read it (``record_past``, ``conv_states[0]``,
    ``recurrent_states[0]``)."""

    record_past = False

    def __init__(self, cache: "HybridStageCache", layer_idx: int) -> None:
        self._cache, self._idx = cache, layer_idx

    @property
    def conv_states(self) -> dict:
        return {0: self._cache.get_conv_state(self._idx)}

    @property
    def recurrent_states(self) -> dict:
        return {0: self._cache.get_recurrent_state(self._idx)}


class HybridStageCache(StageKVCache):
    """A :class:`StageKVCache` over a stage's full-attention layers plus snapshot rings for its linear-attention
    layers (see the module doc for the method, its cost and its memory).

    Args:
        layer_ids: every global layer index of the stage.
        linear_layer_ids: those that are linear attention (the rest get KV buffers).
        num_kv_heads, head_dim, max_len, dtype, device, static: as :class:`StageKVCache`.
        shape: the layers' :class:`LinearStateShape`.
        max_rollback: deepest rewind :meth:`crop` must support (``n - 1`` for ``n`` stages); ``R = max_rollback + 1``.
        state_dtype: dtype of the recurrent state (fp32: what transformers' torch path and fla kernels produce).

    Raises:
        ValueError: ``max_rollback < 0`` or linear layers outside ``layer_ids``.
    """

    def __init__(self, layer_ids: Iterable[int], linear_layer_ids: Iterable[int], num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device, *, shape: LinearStateShape, max_rollback: int,
                 static: bool = False, state_dtype: torch.dtype = torch.float32) -> None:
        ids = list(layer_ids)
        self.linear_layer_ids = [int(i) for i in linear_layer_ids]
        if not set(self.linear_layer_ids) <= set(ids):
            raise ValueError(f"linear layers {self.linear_layer_ids} are not all in the stage's layers {ids}")
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        super().__init__([i for i in ids if i not in self.linear_layer_ids], num_kv_heads, head_dim, max_len, dtype,
                         device, static=static)
        self.all_layer_ids = ids
        self.shape = shape
        self.slots = int(max_rollback) + 1  # R
        self.zero_slot = self.slots  # static mode: an all-zero state read at position 0
        n_alloc = self.slots + (1 if self.static else 0)
        self.conv_ring = {i: torch.zeros((n_alloc, *shape.conv), dtype=dtype, device=device)
                          for i in self.linear_layer_ids}
        self.rec_ring = {i: torch.zeros((n_alloc, *shape.recurrent), dtype=state_dtype, device=device)
                         for i in self.linear_layer_ids}
        self._slot_len = [-1] * self.slots  # eager mode: length whose state each slot holds (-1: none)
        self._conv: dict[int, torch.Tensor] = {}  # this forward's working conv window per layer
        self._rec_in: dict[int, torch.Tensor] = {}  # this forward's input recurrent state per layer
        self._rec_out: dict[int, torch.Tensor] = {}  # eager: new recurrent states, committed by ``advance``
        self._ridx = self._widx = None  # static mode: device int64 [1] read / write slots
        self.layers = {i: _LayerView(self, i) for i in self.linear_layer_ids}

    # ---- geometry ---------------------------------------------------------------------------------
    @property
    def state_bytes(self) -> int:
        """Bytes held by the snapshot rings (all linear layers, all slots)."""
        return sum(t.numel() * t.element_size() for d in (self.conv_ring, self.rec_ring) for t in d.values())

    def held_lengths(self) -> list[int]:
        """Eager mode: the lengths whose linear-attention state the ring holds (sorted), besides 0."""
        return sorted(x for x in self._slot_len if x >= 0)

    def linear_state(self, layer_idx: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of linear layer ``layer_idx`` after ``length`` tokens (default: the current length), as views of
        the ring: ``(conv [1, conv_dim, K], recurrent [1, value_heads, key_dim, value_dim] fp32)``. Static mode does not
        check that the slot holds that length (the device decides what is written).

        Raises:
            RollbackError: eager mode, the state is not held (or ``length`` is 0: there is no state yet).
        """
        length = self.length if length is None else int(length)
        slot = length % self.slots
        if not self.static and (length <= 0 or self._slot_len[slot] != length):
            raise RollbackError(f"no linear-attention state after {length} tokens (held: {self.held_lengths()})")
        return self.conv_ring[layer_idx][slot], self.rec_ring[layer_idx][slot]

    # ---- what transformers' linear-attention layers call ----------------------------------------
    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether a forward now continues a sequence (5.5-5.17 API). Static mode: always (position 0 reads zeros)."""
        return self.static or self.length > 0

    def is_recording_past(self, layer_idx: int) -> bool:
        """Never: rollback is the snapshot ring's job (5.2x API)."""
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """No intermediate recurrent states: the ring keeps one state per length, committed by :meth:`advance`
        (5.25 API: the layers then return only the final state)."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """No-op (5.25 API: the single-token conv update in place counts a token there); the cache's length moves
        only with :meth:`advance`, and the in-place update writes into this forward's working window
        (:meth:`get_conv_state`), which :meth:`update_recurrent_state` commits."""

    def _read_slot(self) -> int:
        slot = self.length % self.slots
        if self._slot_len[slot] != self.length:
            raise RollbackError(
                f"linear-attention state after {self.length} tokens is not held (ring of {self.slots} holds "
                f"{self.held_lengths()}); build the cache with max_rollback >= the pipeline's n - 1"
            )
        return slot

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The conv window ``[1, conv_dim, K]`` this forward starts from (a working copy: the single-token update
        writes into it), or ``None`` at length 0 (eager mode)."""
        return self._start_state(self.conv_ring, self._conv, layer_idx, copy=True)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The recurrent state ``[1, value_heads, key_dim, value_dim]`` fp32 this forward starts from (read only),
        or ``None`` at length 0 (eager mode)."""
        return self._start_state(self.rec_ring, self._rec_in, layer_idx, copy=False)

    def _start_state(self, rings: dict, memo: dict, layer_idx: int, copy: bool) -> torch.Tensor | None:
        """The state layer ``layer_idx`` starts this forward from: read once per forward from its ring (the slot of
        the current length; on the device from the position in static mode), a copy when ``copy``; memoised in
        ``memo``. ``None`` at length 0 in eager mode."""
        x = memo.get(layer_idx)
        if x is not None:
            return x
        if self.static:
            x = rings[layer_idx].index_select(0, self._ridx)[0]
        elif self.length == 0:
            return None
        else:
            x = rings[layer_idx][self._read_slot()]
            x = x.clone() if copy else x
        memo[layer_idx] = x
        return x

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Multi-token conv input ``[1, conv_dim, q]``: returns the window the conv must see (the previous ``K``
        inputs, or left zero padding to ``K`` at length 0, then the new ones) and keeps its last ``K`` inputs."""
        k = int(conv_kernel_size or self.shape.conv_kernel)
        prev = self.get_conv_state(layer_idx)
        if prev is None:
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([prev, conv_states.to(prev.dtype)], dim=-1)
        self._conv[layer_idx] = full[..., -k:].contiguous()
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """The layer's new recurrent state after this forward. Static mode writes both states into the write slot
        now; eager mode keeps a reference until :meth:`advance` commits the forward.

        Raises:
            CacheContractError: the state's shape is not the preallocated one.
        """
        if tuple(recurrent_states.shape) != self.shape.recurrent:
            raise CacheContractError(
                f"layer {layer_idx}: transformers produced a recurrent state of shape {tuple(recurrent_states.shape)}, "
                f"the cache holds {self.shape.recurrent}; this transformers version changed the Gated DeltaNet state"
            )
        conv = self._conv.get(layer_idx)
        if conv is None or tuple(conv.shape) != self.shape.conv:
            got = None if conv is None else tuple(conv.shape)
            raise CacheContractError(
                f"layer {layer_idx}: conv window {got} before the recurrent update, expected {self.shape.conv}; "
                "this transformers version changed the order or shape of the Gated DeltaNet cache calls"
            )
        if self.static:
            self.conv_ring[layer_idx].index_copy_(0, self._widx, conv[None])
            self.rec_ring[layer_idx].index_copy_(0, self._widx, recurrent_states[None].to(torch.float32))
        else:
            self._rec_out[layer_idx] = recurrent_states
        return recurrent_states

    # ---- SPD bookkeeping ------------------------------------------------------------------------
    def _end_forward(self) -> None:
        self._conv, self._rec_in, self._rec_out = {}, {}, {}

    def advance(self, q: int) -> None:
        """Commit the forward of ``q`` tokens: its linear states go into slot ``(length + q) % R`` (eager mode).

        Raises:
            CacheContractError: a linear-attention layer of the stage did not update its state.
        """
        if not self.static and self.linear_layer_ids:
            missing = [i for i in self.linear_layer_ids if i not in self._rec_out]
            if missing:
                self._end_forward()
                raise CacheContractError(f"linear-attention layers {missing} did not update their state in this "
                                         "forward (a transformers cache-API change?)")
            end = self.length + q
            w = end % self.slots
            for i in self.linear_layer_ids:
                self.rec_ring[i][w].copy_(self._rec_out[i])
                self.conv_ring[i][w].copy_(self._conv[i])
            self._slot_len[w] = end
        self._end_forward()
        super().advance(q)

    def crop(self, length: int) -> None:
        """Keep positions ``[0, length)``: the KV length and the linear layers' states after ``length`` tokens
        (O(1), no device work).

        Raises:
            ValueError: ``length`` beyond the current length.
            RollbackError: eager mode, the state after ``length`` tokens is no longer held (rewind deeper than
                ``max_rollback``, or into a multi-token forward).
        """
        if length > self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        if not self.static and 0 < length < self.length and self._slot_len[length % self.slots] != length:
            raise RollbackError(
                f"cannot roll linear-attention state back from {self.length} to {length} tokens: the ring of "
                f"{self.slots} holds {self.held_lengths()}; build the cache with max_rollback >= "
                f"{self.length - length} (n - 1 for n pipeline stages)"
            )
        self._slot_len = [x if x <= length else -1 for x in self._slot_len]
        self._end_forward()
        super().crop(length)

    def reset(self) -> None:
        """Forget everything (new prompt); the rings need no clearing (length 0 reads no state)."""
        self._slot_len = [-1] * self.slots
        self._end_forward()
        super().reset()

    def bind(self, positions: torch.Tensor) -> None:
        """Static mode: bind the positions of the next forward (see :meth:`StageKVCache.bind`); also derives the
        linear layers' read slot (state after ``positions[0]`` tokens; the zero slot at position 0) and write slot
        (state after ``positions[-1] + 1`` tokens) on the device."""
        super().bind(positions)
        first, last = positions[:1], positions[-1:]
        self._ridx = torch.where(first == 0, torch.full_like(first, self.zero_slot), first % self.slots)
        self._widx = (last + 1) % self.slots
        self._end_forward()
