"""Preallocated per-stage KV cache with O(1) crop (the rollback primitive of SPD, paper §3.3 "synchronous rollback").

The cache duck-types the part of transformers' ``Cache`` API that attention layers call (``update``), so the HF
decoder-layer modules run unchanged on top of it. Buffers are allocated once, ``[1, kv_heads, max_len, head_dim]``
per layer; a forward writes ``q`` positions starting at :attr:`length` and :meth:`advance` commits them.
Rollback is :meth:`crop`, which only moves the length (the stale entries are overwritten later).

**Static mode** (``static=True``, for CUDA graphs): the write position is a *device* tensor bound with :meth:`bind`
instead of the host-side :attr:`length`; ``update`` writes with ``index_copy_`` at those positions and returns the
whole buffers, and :meth:`attention_mask` hides every position after the query row's own. A row at position ``p``
therefore sees exactly positions ``[0, p]``, whatever stale entries lie beyond: a rollback needs no crop on the
device (writing the next token at its position *is* the crop), so a captured stage forward replays unchanged.
The eager mode above is untouched and stays the exactness path on CPU.
"""

from __future__ import annotations

from typing import Iterable

import torch


class CacheOverflowError(RuntimeError):
    """More positions were written than the cache was allocated for."""


class StageKVCache:
    """KV cache for a set of decoder layers (one pipeline stage, the whole target, or the head's tower).

    Args:
        layer_ids: global layer indices this cache serves (``layer.self_attn.layer_idx`` values).
        num_kv_heads, head_dim: per-layer KV geometry.
        max_len: capacity in positions.
        dtype, device: buffer dtype/device (the compute dtype of the layers).

    ``update`` returns the keys/values of positions ``[0, length + q)`` (a view; no copy).
    """

    is_compileable = False

    def __init__(
        self,
        layer_ids: Iterable[int],
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        static: bool = False,
    ) -> None:
        self.layer_ids = list(layer_ids)
        self.max_len = int(max_len)
        shape = (1, num_kv_heads, self.max_len, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layer_ids}
        self.length = 0
        self._q = 0
        self.static = bool(static)
        self._write_pos: torch.Tensor | None = None  # static mode: int64 [q] positions written by ``update``
        self._key_pos = torch.arange(self.max_len, device=device) if self.static else None

    # ---- what HF attention calls -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key/value_states`` ``[1, kv_heads, q, head_dim]`` at positions ``[length, length+q)``.

        Returns:
            (keys, values): ``[1, kv_heads, length+q, head_dim]`` views of the buffers.
        Raises:
            CacheOverflowError: the write would pass ``max_len``.

        In static mode the states are written at the bound positions (:meth:`bind`) and the full buffers
        ``[1, kv_heads, max_len, head_dim]`` are returned (use :meth:`attention_mask`); nothing is checked on the host.
        """
        if self.static:
            if self._write_pos is None:
                raise RuntimeError("static StageKVCache: call bind(positions) before the forward")
            k, v = self.keys[layer_idx], self.values[layer_idx]
            k.index_copy_(2, self._write_pos, key_states)
            v.index_copy_(2, self._write_pos, value_states)
            return k, v
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.max_len:
            raise CacheOverflowError(
                f"KV cache of {self.max_len} positions is full (need {end}); raise decoding.max_length"
            )
        self._q = q
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:, :, self.length:end].copy_(key_states)
        v[:, :, self.length:end].copy_(value_states)
        return k[:, :, :end], v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Committed positions (same for every layer of the cache)."""
        return self.length

    # ---- SPD bookkeeping ------------------------------------------------------------------------
    def advance(self, q: int) -> None:
        """Commit ``q`` positions written by the last forward."""
        self.length += q

    def crop(self, length: int) -> None:
        """Keep positions ``[0, length)`` (rollback). ``length`` must not exceed the current length."""
        if length > self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = int(length)

    def reset(self) -> None:
        """Forget everything (new prompt)."""
        self.length = 0

    # ---- static mode (CUDA graphs) -----------------------------------------------------------
    def bind(self, positions: torch.Tensor) -> None:
        """Static mode: the int64 device tensor ``[q]`` of positions the next forward writes (kept by reference, so a
        captured graph reads whatever the caller later stores in it).

        Raises:
            RuntimeError: the cache is not static.
        """
        if not self.static:
            raise RuntimeError("bind() needs a StageKVCache built with static=True")
        self._write_pos = positions

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """Static mode: boolean mask ``[1, 1, q, max_len]`` (True = attend) letting the row at position ``p`` see
        cache positions ``0..p`` only. ``positions``: int64 ``[q]`` on the cache's device."""
        if not self.static:
            raise RuntimeError("attention_mask() needs a StageKVCache built with static=True")
        return (self._key_pos[None, :] <= positions[:, None])[None, None]
