"""Preallocated per-stage KV cache with O(1) crop (the rollback primitive of SPD, paper §3.3 "synchronous rollback").

The cache duck-types the part of transformers' ``Cache`` API that attention layers call (``update``), so the HF
decoder-layer modules run unchanged on top of it. Buffers are allocated once, ``[1, kv_heads, max_len, head_dim]``
per layer; a forward writes ``q`` positions starting at :attr:`length` and :meth:`advance` commits them.
Rollback is :meth:`crop`, which only moves the length (the stale entries are overwritten later).
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
    ) -> None:
        self.layer_ids = list(layer_ids)
        self.max_len = int(max_len)
        shape = (1, num_kv_heads, self.max_len, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layer_ids}
        self.length = 0
        self._q = 0

    # ---- what HF attention calls -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key/value_states`` ``[1, kv_heads, q, head_dim]`` at positions ``[length, length+q)``.

        Returns:
            (keys, values): ``[1, kv_heads, length+q, head_dim]`` views of the buffers.
        Raises:
            CacheOverflowError: the write would pass ``max_len``.
        """
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
