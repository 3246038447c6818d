"""Attention masks of spd-ds's own forwards (the pipeline stages, their static-cache CUDA graphs and the speculation
head's tower), in the form the layers' transformers attention backend reads.

The stages call transformers' decoder layers with an explicit mask over their KV cache (length-based on the CPU
exactness path; ``max_len`` slots with future ones masked off in static mode). ``sdpa`` takes it as a boolean mask
(True = attend); ``eager`` adds the mask to the scores, so it gets an additive one (0 / the dtype's lowest value).
The other backends (``flash_attention_*`` read a ``[B, kv]`` padding mask and derive causality themselves, which a
static cache's empty future slots break; ``flex_attention`` and hub kernels have their own mask forms) are refused
by the config check (:func:`check_stage_attention`, also run by :func:`spd_ds.builder.build_arch`).
"""

from __future__ import annotations

import torch

from spd_ds.config import ATTN_IMPLEMENTATIONS, ConfigError


def check_stage_attention(attn_implementation: str, decoding: bool = True) -> None:
    """Refuse an attention backend that the stages' explicit masks do not fit.

    Args:
        attn_implementation: ``model.attn_implementation``.
        decoding: decoding (:data:`spd_ds.config.ATTN_IMPLEMENTATIONS`: ``sdpa`` or ``eager``) or training
            (``sdpa``: the teacher builds boolean packed masks, or FlexAttention block masks under
            ``train.teacher_attention=flex``).
    Raises:
        ConfigError: one line naming the value and what to use instead (before any model loads or collective).
    """
    if str(attn_implementation) not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"model.attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)} (spd-ds's "
                          "stages pass an explicit mask over a static KV cache, which the other transformers "
                          f"backends do not take), got {attn_implementation!r}")
    if decoding or str(attn_implementation) == "sdpa":
        return
    raise ConfigError(f"model.attn_implementation={attn_implementation} does not apply to training: the teacher's "
                      "attention is train.teacher_attention (sdpa or flex); leave model.attn_implementation=sdpa")


def causal_mask(q: int, past: int, device, single_row_mask: bool | None = None) -> torch.Tensor | None:
    """Boolean attention mask ``[1, 1, q, past + q]`` (True = attend) for ``q`` new rows after ``past`` cached ones,
    on ``device``.

    For ``q == 1`` (a single row attends to everything before it) the mask is all True, or ``None`` when
    ``single_row_mask`` is false; by default (``None``) it is ``None`` on CPU and a mask elsewhere, so that on a GPU
    the eager decoder runs the attention kernel of the static-cache decoders (CUDA graphs), which always pass a mask:
    without one, transformers asks SDPA for grouped-query attention, which the memory-efficient kernel does not run,
    and torch takes another kernel (flash or math) with other rounding.

    Args:
        q: new rows (tokens) in this forward, >= 1. past: cached positions before them, >= 0.
        device: a ``torch.device`` or its name; the mask is allocated there. single_row_mask: see above.

    Returns:
        ``torch.bool`` tensor ``[1, 1, q, past + q]``, or ``None`` (one row, no mask). Raises nothing of its own
        (``torch.device`` raises ``RuntimeError`` for an unknown device name).
    """
    if q == 1:
        if single_row_mask is None:
            single_row_mask = torch.device(device).type != "cpu"
        return torch.ones(1, 1, 1, past + 1, dtype=torch.bool, device=device) if single_row_mask else None
    k = torch.arange(past + q, device=device)
    rows = torch.arange(q, device=device)[:, None] + past
    return (k[None, :] <= rows)[None, None]


def layer_mask(mask: torch.Tensor | None, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor | None:
    """``mask`` (boolean, True = attend, ``[.., q, kv]``) as the layers' backend reads it: unchanged for ``sdpa``
    (``None``, or a mask already in another form, stays as it is); for ``eager`` an additive mask of ``dtype`` (the
    scores' dtype), 0 where a row attends and ``torch.finfo(dtype).min`` elsewhere (transformers' eager attention
    adds the mask to the scores: a boolean one would add 1 and mask nothing). No host synchronisation (capturable in
    a CUDA graph)."""
    if attn_implementation not in ("eager", "paged|eager") or not isinstance(mask, torch.Tensor) \
            or mask.dtype != torch.bool:  # (None, a FlexAttention BlockMask, an additive mask)
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


__all__ = ["check_stage_attention", "causal_mask", "layer_mask"]
