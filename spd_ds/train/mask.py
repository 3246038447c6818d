"""Simulated pipeline occupancy and the structural attention mask of head training.

What inference feeds the head (``spd_ds.decoding.reference``, ``HeadDrafter``)
------------------------------------------------------------------------------
At draft time the pipeline holds ``F`` in-flight tokens (the *fill*, ``1 <= F <= n``): the newest token ``P`` at
depth 0, ``P-1`` at depth 1, ..., ``P-F+1`` at depth ``F-1``. Every older token is complete. ``F = n`` in steady
state; after a rejection (and right after prefill) only the replacement is in flight (``F = 1``) and ``F`` grows by
one per cycle. The head runs its tower over

* the **committed** rows: one per complete token, type ``m-1``, computed once when the token completed, attending
  only to earlier committed rows (they sit in the head's KV cache);
* the **window** rows: one per in-flight token at depth ``d``, type ``f(d)``, attending causally to the committed
  rows and to the window rows before it.

The output of the depth-0 row of ``P`` predicts ``x_{P+1}``.

Training layout
---------------
One training sequence stands for every draft position at once, with one fill ``F`` per micro-batch. A row's whole
computation (all tower layers) is fixed by its *kind* and position: kind ``d < F`` = "in flight at depth ``d`` of a
pipeline holding ``F`` tokens", kind :data:`COMPLETE` = "committed". From the list above, a query of kind ``d`` at
position ``t`` reads, at each position ``T <= t``, exactly one key row::

    key_kind(d, t - T) = d + (t - T)   if d + (t - T) < F      (still in flight in the same snapshot)
                       = COMPLETE      otherwise
    key_kind(COMPLETE, .) = COMPLETE

So rows are laid out block-major, one block per kind: ``[depth 0 | depth 1 | ... | depth F-1 | COMPLETE]``, each
block ``S`` rows long (``(F+1)·S`` rows, position ids repeat per block). Block ``d`` holds ``g_{f(d)}``, the
COMPLETE block holds ``g_{m-1}``. The loss reads only block 0.

This is exact for any number of tower layers, for non-injective ``f`` (two depths of one type are two kinds with
different attention) and for partial fill (the threshold is ``d + δ >= F``, measured from the query's own depth).
The reference implementation lays out one block per *type* with ``ρ(k, δ) = f(min(n, μ(k)+δ))`` and a threshold
``δ >= F`` from every query, which is wrong for both (tests show the difference).

Packing: several documents share a row of ``S`` tokens; ``segments [B, S]`` (1, 2, ... per document, 0 = padding)
keeps attention inside a document. The mask is built per batch on the batch's device and never cached, so its
memory does not depend on how many distinct sequence lengths a run has seen.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: Kind id of committed (complete) rows.
COMPLETE = -1


def sample_fill(num_stages: int, full_prob: float, seed: int, *keys: int) -> int:
    """Simulated pipeline fill ``F`` for one micro-batch (paper: "simulated pipeline occupancy").

    With probability ``full_prob`` the pipeline is full (``F = n``); otherwise ``F ~ Uniform{1, .., n-1}``.
    ``n = 1`` always gives 1. The draw is a pure function of ``(seed, *keys)`` (e.g. step, micro-batch, rank), so a
    resumed run draws the same fills as an uninterrupted one without saving any RNG state.

    Returns:
        ``F`` in ``1..n``.
    """
    if num_stages <= 1:
        return 1
    g = torch.Generator().manual_seed(_mix(seed, *keys))
    u = torch.rand((), generator=g).item()
    if u < full_prob:
        return num_stages
    return 1 + int(torch.randint(num_stages - 1, (), generator=g).item())


def _mix(*xs: int) -> int:
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def row_kinds(fill: int) -> list[int]:
    """Kinds of the row blocks for fill ``F``: ``[0, 1, .., F-1, COMPLETE]`` (block 0 = depth 0 = the loss rows)."""
    if fill < 1:
        raise ValueError(f"pipeline fill must be >= 1, got {fill}")
    return list(range(fill)) + [COMPLETE]


def block_types(fill: int, depth_to_type: Sequence[int]) -> list[int]:
    """Aggregation type of each block: ``f(d)`` for depth blocks, ``m-1`` for the COMPLETE block.

    Raises:
        ValueError: ``fill`` larger than the number of stages ``n = len(depth_to_type) - 1``.
    """
    n = len(depth_to_type) - 1
    if fill > max(n, 1):
        raise ValueError(f"pipeline fill {fill} exceeds the {n} stages")
    m_last = depth_to_type[-1]
    return [depth_to_type[d] if d != COMPLETE else m_last for d in row_kinds(fill)]


def key_kind(query_kind: int, delta: int, fill: int) -> int:
    """The kind of the row a query of kind ``query_kind`` reads at distance ``delta >= 0`` (see module doc)."""
    if query_kind == COMPLETE:
        return COMPLETE
    d = query_kind + delta
    return d if d < fill else COMPLETE


def _check_layout(segments: torch.Tensor, fill: int) -> None:
    if segments.dim() != 2:
        raise ValueError(f"segments must be [B, S], got shape {tuple(segments.shape)}")
    if fill < 1:
        raise ValueError(f"pipeline fill must be >= 1, got {fill}")


def structural_mask(segments: torch.Tensor, fill: int) -> torch.Tensor:
    """Boolean attention mask of the training layout (True = attend).

    Args:
        segments: ``[B, S]`` int document ids per token (``> 0``), ``0`` for padding. Tokens of one document are
            contiguous and their distance in the row equals their distance in the document.
        fill: pipeline fill ``F`` (``1..n``).

    Returns:
        ``[B, 1, (F+1)·S, (F+1)·S]`` bool on ``segments.device``; row/column ``b·S + t`` is block ``b``
        (kind ``row_kinds(F)[b]``) at position ``t``. Padding rows attend only to themselves (their outputs are
        ignored; this keeps softmax finite).

    Raises:
        ValueError: ``fill < 1`` or ``segments`` not 2-D.
    """
    _check_layout(segments, fill)
    B, S = segments.shape
    nb = fill + 1
    dev = segments.device
    t = torch.arange(S, device=dev)
    delta = t[:, None] - t[None, :]  # [S, S] query t minus key T
    doc = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0) & (delta >= 0)  # [B, S, S]
    # Block index of the key each query block reads at distance delta: min(qb + delta, F) for depth blocks,
    # F (COMPLETE) for the COMPLETE block.
    qb = torch.arange(nb, device=dev)
    want = torch.clamp(qb[:, None, None] + delta.clamp(min=0)[None], max=fill)  # [nb, S, S]
    want[fill] = fill
    kb = torch.arange(nb, device=dev)
    blocks = want[:, None] == kb[None, :, None, None]  # [nb(q), nb(k), S, S]
    mask = blocks[None] & doc[:, None, None]  # [B, nbq, nbk, S, S]
    mask = mask.permute(0, 1, 3, 2, 4).reshape(B, nb * S, nb * S)
    pad = (segments == 0).repeat(1, nb)  # [B, nb*S]
    idx = torch.arange(nb * S, device=dev)
    mask[:, idx, idx] |= pad  # unconditionally: testing for padding first would read the device
    return mask[:, None]


def structural_mask_mod(segments: torch.Tensor, fill: int):
    """The structural mask as a FlexAttention ``mask_mod`` (same rule as :func:`structural_mask`, never materialised).

    Args:
        segments: ``[B, S]`` int64 document ids (``0`` = padding), on the device attention runs on. The rule itself
            allows any ids; the tiles :func:`structural_block_mask` derives from the segments (when the tile divides
            ``S``) assume each document is one contiguous run, as ``BatchPlanner`` packs them (ids 1, 2, ... left to
            right): a repeated id elsewhere in the row would lose tiles.
        fill: pipeline fill ``F`` (``1..n``; ``0``: the packed-causal mask of :func:`packed_causal_block_mask`).

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over the ``(F+1)·S`` rows of the training layout: True where
        :func:`structural_mask` ``[b, 0, q_idx, kv_idx]`` is True.
    """
    S = segments.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // S, kv_idx // S
        tq, tk = q_idx - qb * S, kv_idx - kb * S
        sq, sk = segments[b, tq], segments[b, tk]
        delta = tq - tk
        reach = qb + delta  # depth the query's own snapshot holds at distance delta; >= F means COMPLETE
        want = torch.where((qb == fill) | (reach >= fill), fill, reach)
        keep = (sq == sk) & (sq > 0) & (delta >= 0) & (kb == want)
        return keep | ((sq == 0) & (q_idx == kv_idx))  # padding rows see only themselves (as the dense mask)

    return mask_mod


def structural_block_mask(segments: torch.Tensor, fill: int, block_size: int = 128):
    """Block-sparse :class:`~torch.nn.attention.flex_attention.BlockMask` of the training layout.

    The dense mask has ``((F+1)·S)²`` entries of which about ``(F+1)·S²/2`` are True (every query block reads the
    COMPLETE block causally plus ``F - d`` diagonal keys); the block mask keeps only the tiles that hold a True entry,
    so FlexAttention's work and memory follow the True entries, not the square.

    When ``block_size`` divides ``S`` (every tile then lies inside one kind block and covers one token range of the
    query and one of the key), the tiles are derived from ``segments`` directly (:func:`_structural_tiles`: a few
    vectorised ops on ``[B, S]`` and ``[B, (F+1)·S/block_size, (F+1)·S/block_size]`` tensors on ``segments.device``,
    no host sync) instead of evaluating ``mask_mod`` on all ``B·R²`` entries as ``create_block_mask`` does. This path
    relies on the contract of :func:`structural_mask`: each document id is one contiguous run. It lists the same
    tiles as ``create_block_mask`` (FULL tiles skip ``mask_mod``, PARTIAL ones apply it per entry), except that with
    ``block_size = 1`` a padding token's own tile is listed as PARTIAL rather than FULL. Otherwise the mask is built
    by ``create_block_mask``: with a compiled kernel on CUDA (no ``[B, R, R]`` tensor), eagerly elsewhere.

    Args:
        segments: ``[B, S]`` int64 document ids (``0`` = padding; one contiguous run per document).
        fill: pipeline fill ``F`` (``1..n``).
        block_size: tile edge in rows (FlexAttention's default 128).

    Returns:
        A ``BlockMask`` for ``B`` batch rows, all heads (head dimension 1), ``R = (F+1)·S`` queries and keys, tiles
        ``block_size x block_size``, ``mask_mod`` = :func:`structural_mask_mod`; its ``kv_num_blocks`` /
        ``full_kv_num_blocks`` are ``[B, 1, ceil(R/block_size)]`` int32 and its ``kv_indices`` / ``full_kv_indices``
        ``[B, 1, ceil(R/block_size), ceil(R/block_size)]`` int32 (listed tiles first, in increasing order), on
        ``segments.device``.

    Raises:
        ValueError: ``fill < 1`` or ``segments`` not 2-D.
    """
    _check_layout(segments, fill)
    return _block_mask(segments, fill, block_size)


def _block_mask(segments: torch.Tensor, fill: int, block_size: int):
    """:func:`structural_block_mask` for ``fill >= 0`` (``0``: :func:`packed_causal_block_mask`), unchecked."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    B, S = segments.shape
    R = (fill + 1) * S
    mask_mod = structural_mask_mod(segments, fill)
    if S % block_size:
        return create_block_mask(mask_mod, B, None, R, R, device=segments.device, BLOCK_SIZE=block_size,
                                 _compile=segments.device.type == "cuda")
    partial, full = _structural_tiles(segments, fill, block_size)
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(R, R))


def _structural_tiles(segments: torch.Tensor, fill: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ``block_size`` tiles of :func:`structural_mask` hold a True entry, and which hold only True entries.

    Tile ``(i, j)`` is query kind block ``qb = i // K``, token block ``x = i % K`` against key kind block ``kb`` and
    token block ``y`` (``K = S / block_size``). By the rule of :func:`structural_mask_mod`, a real query reads the
    keys of its own document at distances ``tq - tk`` in an interval ``[lo, hi]`` fixed by ``(qb, kb)`` alone:
    ``[F - qb, ∞)`` (``[0, ∞)`` for ``qb = F``) in the COMPLETE column, ``{kb - qb}`` for ``qb <= kb < F``, none
    otherwise. Within tile ``(x, y)`` the distances of same-document pairs form an interval too (documents are
    contiguous runs): for ``x > y`` the one document crossing from the last token of ``y`` to the first of ``x``
    gives ``[x0 - y1, end - start]`` (``x0``/``y1`` first/last token of ``x``/``y``, ``start``/``end`` that document
    clipped to ``y``/``x``); for ``x = y`` the longest run inside the block gives ``[0, length - 1]``. The tile holds
    a True entry iff the two intervals meet, or it is on the diagonal of a kind block (``qb = kb``, ``x = y``: every
    row sees itself there, padding included). It holds only True entries iff every distance in the tile lies in
    ``[lo, hi]`` and one document covers all its queries and keys.

    Returns:
        ``(partial, full)``: ``[B, (F+1)·K, (F+1)·K]`` bool, disjoint; ``partial | full`` are the tiles with a True
        entry.
    """
    B, S = segments.shape
    K, nb, dev = S // block_size, fill + 1, segments.device
    idx = torch.arange(S, device=dev)
    first = torch.ones_like(segments, dtype=torch.bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    start = torch.cummax(torch.where(first, idx, 0), dim=1).values  # first token of each token's run
    end = torch.cummin(torch.where(last, idx, S).flip(1), dim=1).values.flip(1)  # last token of each token's run
    # the longest same-document distance inside each token block (-1: only padding)
    inner = idx - torch.maximum(start, idx // block_size * block_size)
    longest = torch.where(segments > 0, inner, -1).view(B, K, block_size).amax(-1)  # [B, K]
    x0 = torch.arange(K, device=dev) * block_size  # first token of each token block
    x1 = x0 + block_size - 1  # last token
    gap = x0[:, None] - x0[None, :]  # [K(x), K(y)]
    span_lo, span_hi = gap - (block_size - 1), gap + (block_size - 1)  # distances covered by tile (x, y)
    cross = (segments[:, x0, None] == segments[:, None, x1]) & (segments[:, x0, None] > 0) & (gap > 0)
    cross_hi = torch.minimum(end[:, x0], x1)[:, :, None] - torch.maximum(start[:, x1], x0)[:, None, :]
    pair_hi = torch.where(cross, cross_hi, torch.where(gap == 0, longest[:, :, None], -1))  # [B, K, K]
    pair_lo = span_lo.clamp(min=0)
    # distances [lo, hi] each (query kind block, key kind block) reads; lo > hi: none
    k = torch.arange(nb, device=dev)
    qk, kk = k[:, None], k[None, :]
    lo = torch.where(kk == fill, (fill - qk).clamp(min=0), torch.where(kk >= qk, kk - qk, S))  # [nb, nb]
    hi = torch.where(kk == fill, S, torch.where(kk >= qk, kk - qk, -1))

    # broadcast to [B, nb(qb), K(x), nb(kb), K(y)]
    lo, hi, own = lo[:, None, :, None], hi[:, None, :, None], (qk == kk)[:, None, :, None]
    pair_lo, span_lo, span_hi, diag = pair_lo[:, None], span_lo[:, None], span_hi[:, None], (gap == 0)[:, None]
    pair_hi = pair_hi[:, None, :, None]
    listed = (torch.maximum(lo, pair_lo) <= torch.minimum(hi, pair_hi)) | (own & diag)
    full = (lo <= span_lo) & (hi >= span_hi) & (pair_hi == span_hi)
    R = nb * K
    return (listed & ~full).view(B, R, R), full.view(B, R, R)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's ``(num_blocks [B, 1, Q], indices [B, 1, Q, KV])`` int32 from ``[B, Q, KV]`` bool tiles."""
    num = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return num[:, None], order.to(torch.int32)[:, None]


def structural_mask_bytes(batch: int, seq_len: int, fill: int) -> int:
    """Bytes of :func:`structural_mask`'s output (bool), for sizing micro-batches."""
    return batch * ((fill + 1) * seq_len) ** 2


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """RoPE positions ``[B, S]`` int64 that restart at 0 for every document of a packed row (0 on padding)."""
    B, S = segments.shape
    idx = torch.arange(S, device=segments.device).expand(B, S)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx))
    first = torch.cummax(first, dim=1).values
    return torch.where(segments > 0, idx - first, torch.zeros_like(idx))


def document_gather(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of packed rows as a right-padded batch, for layers that must see one document at a time
    (linear attention carries a state along the row that a mask cannot cut).

    Args:
        segments: ``[B, S]`` int64 document ids (0 = padding); a document is a run of one nonzero id.
    Returns:
        ``(gather [D, Lmax] int64, valid [D, Lmax] bool)``: ``gather[d, t]`` is the flat index (into ``B * S``) of
        position ``t`` of document ``d``, or ``B * S`` (an extra zero row) beyond the document's end.
    """
    B, S = segments.shape
    flat = segments.reshape(-1)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start = (start & (segments > 0)).reshape(-1)
    real = flat > 0
    D = int(start.sum())
    pos = segment_positions(segments).reshape(-1)
    L = int(pos[real].max()) + 1 if D else 0
    doc = torch.cumsum(start.long(), 0) - 1
    gather = torch.full((D, L), B * S, dtype=torch.long, device=segments.device)
    gather[doc[real], pos[real]] = torch.arange(B * S, device=segments.device)[real]
    return gather, gather < B * S


def packed_causal_block_mask(segments: torch.Tensor, block_size: int = 128):
    """:func:`packed_causal_mask` as a FlexAttention ``BlockMask`` (the teacher's attention with
    ``train.teacher_attention=flex``): only the tiles inside one document's causal triangle are computed, so the
    attention work follows ``Σ_doc len²/2`` instead of ``S²``.

    It is the structural mask of a zero-fill layout (the COMPLETE block alone: a query reads the earlier keys of its
    document; padding sees itself), built as :func:`structural_block_mask` builds it: from the segments' tiles when
    ``block_size`` divides ``S``, else with ``create_block_mask``.

    Args:
        segments: ``[B, S]`` int64 document ids (``0`` = padding; one contiguous run per document).
        block_size: tile edge in rows.
    Returns:
        A ``BlockMask`` over ``B`` rows, all heads, ``S`` queries and keys, on ``segments.device``.
    Raises:
        ValueError: ``segments`` not 2-D.
    """
    if segments.dim() != 2:
        raise ValueError(f"segments must be [B, S], got shape {tuple(segments.shape)}")
    return _block_mask(segments, 0, block_size)


def packed_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Causal, document-local mask ``[B, 1, S, S]`` bool for the target's own forward (padding sees itself)."""
    B, S = segments.shape
    t = torch.arange(S, device=segments.device)
    causal = t[:, None] >= t[None, :]
    m = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0) & causal
    m[:, t, t] |= segments == 0  # unconditionally: testing for padding first would read the device (a sync per stage)
    return m[:, None]


def num_blocks_max(num_stages: int) -> int:
    """Largest number of row blocks a run uses (fill ``n``): ``n + 1``."""
    return max(num_stages, 1) + 1


def expected_blocks(num_stages: int, full_prob: float) -> float:
    """Mean number of row blocks per micro-batch under :func:`sample_fill` (for throughput estimates)."""
    n = num_stages
    if n <= 1:
        return 2.0
    part = sum(f + 1 for f in range(1, n)) / (n - 1)
    return full_prob * (n + 1) + (1 - full_prob) * part


__all__ = [
    "COMPLETE", "sample_fill", "row_kinds", "block_types", "key_kind", "structural_mask", "structural_mask_mod",
    "structural_block_mask", "structural_mask_bytes",
    "segment_positions", "packed_causal_mask", "num_blocks_max", "expected_blocks",
]

