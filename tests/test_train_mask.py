"""spd_ds.train.mask: the training layout reproduces exactly what the reference decoder feeds the head.

Two independent checks:

1. against a slow construction written from the *pipeline snapshot* point of view (loops, no vectorisation);
2. against the real :class:`SPDReferenceDecoder`: a recording drafter interns the full computation graph of every
   head row (position, aggregation type, and the identities of all rows it attends to, recursively) while the
   decoder runs with accepts and rejections; the training row (block 0, position P) at the same fill must have
   the same identity. Equal identities mean equal tower outputs for any number of tower layers.
"""

from __future__ import annotations

import gc
import itertools
import random

import pytest
import torch

from spd_ds.decoding.drafters import Draft, OracleDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from spd_ds.train.mask import (
    COMPLETE, block_types, key_kind, packed_causal_block_mask, packed_causal_mask, row_kinds, sample_fill,
    segment_positions, structural_block_mask, structural_mask, structural_mask_mod,
)
from tests.tiny_models import make_tiny_model

# (num_layers, stage_layers, anchors) covering injective f, non-injective f, f(n-1) = m-1, n = 1..6
PARTITIONS = [
    (4, (4,), None),
    (4, (2, 2), None),
    (6, (2, 2, 2), None),
    (8, (2, 2, 2, 2), (0, 4, 8)),  # f = 0,0,1,1,2: non-injective
    (8, (2, 2, 2, 2), (0, 4, 6)),  # f = 0,0,1,2,2: type m-1 also at depth n-1 (in flight)
    (8, (2, 2, 1, 1, 1, 1), (0, 2, 5, 8)),  # n = 6, f = 0,1,1,2,2,2,3
    (8, (2, 2, 1, 1, 1, 1), None),
]


def _random_segments(rng: random.Random, B: int, S: int) -> torch.Tensor:
    seg = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        t, doc = 0, 1
        while t < S:
            L = rng.randint(1, S)
            if rng.random() < 0.15 and t > 0:
                break  # leave padding at the end
            seg[b, t:t + L] = doc
            t, doc = t + L, doc + 1
    return seg


def _slow_mask(segments: torch.Tensor, fill: int) -> torch.Tensor:
    """Snapshot construction: a query row of kind d at t lives in the pipeline snapshot whose newest token is t + d.
    In that snapshot token T is in flight at depth (t + d) - T if that is < F, else complete. A COMPLETE row was
    computed when every earlier token was complete. Same document only; padding sees itself."""
    B, S = segments.shape
    kinds = row_kinds(fill)
    nb = len(kinds)
    out = torch.zeros(B, 1, nb * S, nb * S, dtype=torch.bool)
    for b in range(B):
        for qi, qk in enumerate(kinds):
            for t in range(S):
                q = qi * S + t
                if segments[b, t] == 0:
                    out[b, 0, q, q] = True
                    continue
                for T in range(t + 1):
                    if segments[b, T] != segments[b, t]:
                        continue
                    if qk == COMPLETE:
                        kk = COMPLETE
                    else:
                        depth_T = (t + qk) - T
                        kk = depth_T if depth_T < fill else COMPLETE
                    out[b, 0, q, kinds.index(kk) * S + T] = True
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
def test_mask_equals_slow_construction(n):
    rng = random.Random(n)
    for fill in range(1, n + 1):
        for S in (1, 2, 5, 9):
            seg = _random_segments(rng, 3, S)
            fast = structural_mask(seg, fill)
            assert fast.dtype == torch.bool and fast.shape == (3, 1, (fill + 1) * S, (fill + 1) * S)
            assert torch.equal(fast, _slow_mask(seg, fill)), (n, fill, S, seg.tolist())


def test_every_real_row_reads_one_key_per_earlier_position_of_its_document():
    seg = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0]])
    for fill in (1, 2, 3):
        m = structural_mask(seg, fill)[0, 0]
        S = seg.shape[1]
        for q in range(m.shape[0]):
            t = q % S
            if seg[0, t] == 0:
                assert m[q].nonzero().flatten().tolist() == [q]
                continue
            keys = m[q].nonzero().flatten()
            same_doc = [T for T in range(t + 1) if seg[0, T] == seg[0, t]]
            assert sorted((keys % S).tolist()) == same_doc
            assert bool(m[q, q])  # the row sees itself


def test_block_types_and_key_kind():
    part = StagePartition.build(8, stage_layers=(2, 2, 2, 2), anchors=(0, 4, 8))
    f = part.depth_to_type
    assert f == (0, 0, 1, 1, 2)
    assert block_types(4, f) == [0, 0, 1, 1, 2]
    assert block_types(2, f) == [0, 0, 2]
    assert key_kind(0, 1, 2) == 1 and key_kind(1, 1, 2) == COMPLETE and key_kind(COMPLETE, 0, 2) == COMPLETE
    with pytest.raises(ValueError):
        block_types(5, f)
    with pytest.raises(ValueError):
        structural_mask(torch.ones(1, 3, dtype=torch.long), 0)


# ---------------------------------------------------------------------------------------------------- identities
class _Interner:
    """Integer ids for computation graphs: id(pos, type, ids of the other rows attended) (hash-consing)."""

    def __init__(self) -> None:
        self.table: dict = {}

    def __call__(self, pos: int, typ: int, keys: tuple) -> int:
        return self.table.setdefault((pos, typ, keys), len(self.table))


class _RecordingDrafter:
    """A drafter that, instead of running a tower, records the identity of each row the head would compute."""

    def __init__(self, m: int, intern: _Interner) -> None:
        self.m, self.intern = m, intern
        self.cache: list[int] = []
        self.records: list[tuple[int, int, int]] = []  # (position of the newest row, fill, identity)

    def start(self, prompt_feats):
        self.cache = []
        for p in range(prompt_feats.shape[0]):
            self.cache.append(self.intern(p, self.m - 1, tuple(self.cache)))

    def propose(self, completed, inflight, inflight_types, start_pos, sampling):
        assert len(self.cache) == start_pos
        types = [self.m - 1] * completed.shape[0] + list(inflight_types)
        window: list[int] = []
        for i, typ in enumerate(types):
            window.append(self.intern(start_pos + i, typ, tuple(self.cache + window)))
        self.cache += window[: completed.shape[0]]
        self.records.append((start_pos + len(types) - 1, inflight.shape[0], window[-1]))
        return Draft(0)


def _training_identities(intern: _Interner, S: int, fill: int, f: tuple[int, ...]) -> list[int]:
    """Identities of the training rows (block 0, position t) for t = 0..S-1, from the mask and the block types."""
    mask = structural_mask(torch.ones(1, S, dtype=torch.long), fill)[0, 0]
    types = block_types(fill, f)
    ids: dict[int, int] = {}
    for t in range(S):  # position order: every key of a row is already interned
        for b in range(fill + 1):
            r = b * S + t
            assert bool(mask[r, r])
            keys = sorted((k for k in mask[r].nonzero().flatten().tolist() if k != r), key=lambda k: k % S)
            ids[r] = intern(t, types[b], tuple(ids[k] for k in keys))
    return [ids[t] for t in range(S)]


def _reference_v11_mask(S: int, fill: int, part: StagePartition) -> torch.Tensor:
    """The reference project's layout (one block per type, blocks ordered by type here) and rule
    ρ(k, δ) = m-1 if δ >= F else f(min(n, μ(k)+δ)) — kept to show that the identity test catches its mismatch."""
    m, n, f, mu = part.num_types, part.num_stages, part.depth_to_type, part.type_min_depth
    mask = torch.zeros(m * S, m * S, dtype=torch.bool)
    for kq in range(m):
        for t in range(S):
            for T in range(t + 1):
                d = t - T
                kk = m - 1 if d >= fill else f[min(n, mu[kq] + d)]
                mask[kq * S + t, kk * S + T] = True
    return mask


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", num_layers=8)


# the hybrid partition (Qwen3.5: linear-attention layers 0-2, 4-6, full attention 3, 7): stages of linear layers only,
# anchors on linear- and on full-attention layers
HYBRID_PARTITIONS = [(8, (4, 4), None), (8, (3, 3, 2), None), (8, (2, 2, 2, 2), (0, 4, 8))]


@pytest.mark.parametrize("family,L,stage_layers,anchors", [("llama", *p) for p in PARTITIONS]
                         + [("qwen3_5_text", *p) for p in HYBRID_PARTITIONS])
def test_mask_matches_reference_decoder(tiny8, family, L, stage_layers, anchors):
    arch = TargetArch(tiny8)
    if L != arch.num_layers or family != "llama":  # smaller L: a shallower tiny model; or another family
        arch = TargetArch(make_tiny_model(tiny8.parent, family, num_layers=L))
    part = StagePartition.build(L, stage_layers=stage_layers, anchors=anchors)
    n, m, f = part.num_stages, part.num_types, part.depth_to_type
    target = Target(arch, part, torch.float32, "cpu")
    prompt = [3, 17, 5, 9, 2]
    ref_dec = SPDReferenceDecoder(target, OracleDrafter([], 0.0, vocab_size=arch.vocab_size), max_len=64)
    ref_out = ref_dec.generate(prompt, 32)
    reference = prompt + ref_out.tokens
    intern = _Interner()
    seen_fills = set()
    for alpha in (0.5, 0.85):
        rec = _RecordingDrafter(m, intern)
        dec = SPDReferenceDecoder(target, OracleDrafter(reference, alpha, base=rec, seed=int(alpha * 100)), max_len=64)
        out = dec.generate(prompt, 32)
        assert out.tokens == ref_out.tokens  # lossless, whatever the drafts
        S = len(reference) + n + 1
        train_ids = {F: _training_identities(intern, S, F, f) for F in range(1, n + 1)}
        for P, fill, ident in rec.records:
            seen_fills.add(fill)
            assert ident == train_ids[fill][P], (part, P, fill)
    assert seen_fills == set(range(1, n + 1))

    # The reference project's rule (one block per type, threshold δ >= F from every query) is caught:
    if (family, L, stage_layers, anchors) == ("llama", 8, (2, 2, 2, 2), (0, 4, 8)):
        # non-injective f, full pipeline: the reference treats the depth-1 row (type 0) as if it were at depth 0
        S = 12
        ref_mask = _reference_v11_mask(S, 4, part)
        assert not _same_first_query(intern, S, 4, part, ref_mask)
    if (family, L, stage_layers, anchors) == ("llama", 6, (2, 2, 2), None):
        # injective f, partial fill 2: the reference thresholds δ >= F from every query
        S = 12
        ref_mask = _reference_v11_mask(S, 2, part)
        assert not _same_first_query(intern, S, 2, part, ref_mask)


def _same_first_query(intern, S, fill, part, ref_mask) -> bool:
    m = part.num_types
    memo: dict[int, int] = {}

    def ident_v11(r: int) -> int:
        if r not in memo:
            keys = sorted((k for k in ref_mask[r].nonzero().flatten().tolist() if k != r), key=lambda k: k % S)
            memo[r] = intern(r % S, r // S, tuple(ident_v11(k) for k in keys))
        return memo[r]

    t = S - 1
    for tt in range(t + 1):
        for b in range(m):
            ident_v11(b * S + tt)
    return ident_v11(t) == _training_identities(intern, S, fill, part.depth_to_type)[t]


# ---------------------------------------------------------------------------------------------------- the rest
def test_sample_fill_distribution_and_determinism():
    n = 4
    draws = [sample_fill(n, 0.5, 7, step) for step in range(4000)]
    assert draws == [sample_fill(n, 0.5, 7, step) for step in range(4000)]
    full = sum(d == n for d in draws) / len(draws)
    assert abs(full - 0.5) < 0.04  # F = n only from the coin
    for k in range(1, n):
        share = sum(d == k for d in draws) / len(draws)
        assert abs(share - 0.5 / (n - 1)) < 0.04
    assert set(draws) == set(range(1, n + 1))
    assert all(sample_fill(1, 0.5, 0, s) == 1 for s in range(10))
    assert all(sample_fill(3, 1.0, 0, s) == 3 for s in range(10))


def test_mask_memory_does_not_grow_with_distinct_lengths():
    def live_bool_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.dtype == torch.bool)

    before = live_bool_tensors()
    for S, fill in itertools.product(range(3, 40), (1, 2, 3)):
        structural_mask(torch.ones(2, S, dtype=torch.long), fill)
    assert live_bool_tensors() == before


def test_segment_positions_and_packed_causal_mask():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0], list(range(7))]
    m = packed_causal_mask(seg)[:, 0]
    assert m[0, 4].tolist() == [False, False, False, True, True, False, False]
    assert m[0, 5].tolist() == [False] * 5 + [True, False]
    assert torch.equal(m[1], torch.tril(torch.ones(7, 7, dtype=torch.bool)))


# ---------------------------------------------------------------------------------------------------- block mask
def _rows(lengths: list[list[int]], S: int) -> torch.Tensor:
    """Packed rows from document lengths (ids 1, 2, .. per row; cut at S; the rest padding)."""
    seg = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, row in enumerate(lengths):
        t = 0
        for d, L in enumerate(row, 1):
            seg[b, t:t + L] = d
            t += L
    return seg


def _packed_rows(S: int, bs: int) -> torch.Tensor:
    """Documents crossing tile edges, a one-token document, padding at the end, a fully padded row, a row-long
    document, a document ending exactly on a tile edge."""
    return _rows([[bs // 2 + 3, 1, bs + 1, 2, S], [], [S], [bs, bs // 2, 1, S], [3, 1, 1, S - 2 * bs - 9]], S)


def _tiles(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``[B, Q, KV]`` bool tiles listed by a BlockMask's ``(num_blocks [B, 1, Q], indices [B, 1, Q, KV])``."""
    nkv = idx.shape[-1]
    keep = torch.arange(nkv) < num[..., None]
    dense = torch.zeros(*idx.shape[:-1], nkv + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(keep, idx, nkv).long(), True)
    return dense[:, 0, :, :nkv]


def _expand(bm, B: int, R: int) -> torch.Tensor:
    """What the FlexAttention kernel attends with ``bm``: FULL tiles all True, PARTIAL tiles ``mask_mod``, unlisted
    tiles False; ``[B, 1, R, R]``."""
    bq, bk = bm.BLOCK_SIZE

    def up(tiles):
        return tiles.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[:, :R, :R]

    full = up(_tiles(bm.full_kv_num_blocks, bm.full_kv_indices))
    part = up(_tiles(bm.kv_num_blocks, bm.kv_indices))
    i = torch.arange(R)
    mod = bm.mask_mod(torch.arange(B)[:, None, None], 0, i[None, :, None], i[None, None, :])
    return (full | (part & mod))[:, None]


def _reference_block_mask(segments: torch.Tensor, fill: int, bs: int):
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = segments.shape
    R = (fill + 1) * S
    return create_block_mask(structural_mask_mod(segments, fill), B, None, R, R, device="cpu", BLOCK_SIZE=bs)


_TILE_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("fill", range(1, 9))  # every fill of n = 1..8 (the mask depends on n only through F <= n)
def test_fast_block_mask_is_exact_and_lists_the_tiles_of_create_block_mask(fill, monkeypatch):
    """S a multiple of the tile: the tiles come from the segments (create_block_mask is never called); expanding the
    BlockMask as the kernel does gives the dense structural mask entry for entry, and the PARTIAL and FULL tile lists
    are create_block_mask's, index for index."""
    import torch.nn.attention.flex_attention as fa

    rng = random.Random(fill)
    cases = [(_packed_rows(k * 16, 16), 16) for k in (2, 3)]
    cases += [(_random_segments(rng, 3, k * bs), bs) for k, bs in ((2, 4), (3, 8), (4, 2))]
    reference = {id(seg): _reference_block_mask(seg, fill, bs) for seg, bs in cases}
    monkeypatch.setattr(fa, "create_block_mask", None)  # the fast path must not evaluate the mask_mod per entry
    for seg, bs in cases:
        B, S = seg.shape
        R, Q = (fill + 1) * S, (fill + 1) * S // bs
        bm = structural_block_mask(seg, fill, block_size=bs)
        assert bm.BLOCK_SIZE == (bs, bs) and bm.seq_lengths == (R, R)
        assert bm.kv_num_blocks.shape == bm.full_kv_num_blocks.shape == (B, 1, Q)
        assert bm.kv_indices.shape == bm.full_kv_indices.shape == (B, 1, Q, Q)
        assert bm.kv_indices.dtype == bm.full_kv_num_blocks.dtype == torch.int32
        partial, full = _tiles(bm.kv_num_blocks, bm.kv_indices), _tiles(bm.full_kv_num_blocks, bm.full_kv_indices)
        assert not (partial & full).any()
        assert torch.equal(_expand(bm, B, R), structural_mask(seg, fill)), (fill, bs, seg.tolist())
        ref = reference[id(seg)]
        for name in _TILE_FIELDS:
            assert torch.equal(getattr(bm, name), getattr(ref, name)), (name, fill, bs, seg.tolist())


def test_packed_causal_block_mask_is_the_packed_causal_mask():
    """The teacher's FlexAttention mask (train.teacher_attention=flex): expanded as the kernel reads it, it is
    packed_causal_mask entry for entry, from the segments' tiles (create_block_mask's tiles, index for index) and,
    when the tile does not divide the row, from create_block_mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    rng = random.Random(0)
    for seg, bs in [(_packed_rows(48, 16), 16), (_random_segments(rng, 3, 32), 8), (_random_segments(rng, 2, 19), 4)]:
        B, S = seg.shape
        bm = packed_causal_block_mask(seg, block_size=bs)
        assert bm.seq_lengths == (S, S)
        assert torch.equal(_expand(bm, B, S), packed_causal_mask(seg)), (bs, seg.tolist())
        ref = create_block_mask(bm.mask_mod, B, None, S, S, device="cpu", BLOCK_SIZE=bs)
        for name in _TILE_FIELDS:
            assert torch.equal(getattr(bm, name), getattr(ref, name)), (name, bs, seg.tolist())
    with pytest.raises(ValueError, match="segments must be"):
        packed_causal_block_mask(torch.ones(4, dtype=torch.long))


def test_fast_block_mask_tile_counts():
    """A hand-counted case (S = 8, tiles of 4, F = 1): row [1 1 1 1 | 1 2 2 0]. Query block 0 (depth 0) reads the
    COMPLETE block at distances >= 1 and itself at distance 0; the COMPLETE block reads itself causally."""
    seg = torch.tensor([[1, 1, 1, 1, 1, 2, 2, 0]])
    bm = structural_block_mask(seg, 1, block_size=4)
    partial, full = _tiles(bm.kv_num_blocks, bm.kv_indices)[0], _tiles(bm.full_kv_num_blocks, bm.full_kv_indices)[0]
    # tiles: q rows (depth0 x0, depth0 x1, COMPLETE x0, COMPLETE x1) against the same kv columns
    assert partial.int().tolist() == [[1, 0, 1, 0], [0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert not full.any()  # no tile lies inside one document
    bm = structural_block_mask(torch.tensor([[1] * 8]), 1, block_size=4)
    full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices)[0]
    # depth 0, x1 reads COMPLETE x0 at distances 1..7 >= F = 1; COMPLETE x1 reads COMPLETE x0 at 1..7 >= 0
    assert full.int().tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]


@pytest.mark.parametrize("fill", [1, 2, 4])
def test_flex_attention_with_fast_block_mask(fill):
    """flex_attention's forward (eager, CPU) with the fast BlockMask equals it with create_block_mask's and the
    dense-masked SDPA (fp32). The eager kernel applies only mask_mod; the tile lists are checked by the expansion test
    and, compiled, by test_compiled_flex_attention_reads_the_fast_tiles."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(fill)
    bs = 16
    seg = _packed_rows(3 * bs, bs)
    B, S = seg.shape
    R = (fill + 1) * S
    q, k, v = (torch.randn(B, 2, R, 8) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=structural_mask(seg, fill))
    fast = flex_attention(q, k, v, block_mask=structural_block_mask(seg, fill, block_size=bs))
    ref = flex_attention(q, k, v, block_mask=_reference_block_mask(seg, fill, bs))
    assert fast.shape == (B, 2, R, 8)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast, dense, rtol=0, atol=1e-5)


def test_block_mask_without_whole_tiles_uses_create_block_mask():
    """S not a multiple of the tile: the BlockMask is create_block_mask's (last tile cut at R) and just as exact."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    seg = torch.tensor([[1] * 7 + [2] * 9 + [0] * 3, [1] * 4 + [2] * 4 + [3] * 11])
    B, S = seg.shape
    for fill, bs in ((1, 16), (3, 16), (2, 128)):
        R = (fill + 1) * S
        bm = structural_block_mask(seg, fill, block_size=bs)
        ref = _reference_block_mask(seg, fill, bs)
        assert bm.seq_lengths == (R, R) and bm.kv_indices.shape == (B, 1, -(-R // bs), -(-R // bs))
        for name in _TILE_FIELDS:
            assert torch.equal(getattr(bm, name), getattr(ref, name)), name
        assert torch.equal(_expand(bm, B, R), structural_mask(seg, fill))
        q, k, v = (torch.randn(B, 2, R, 8) for _ in range(3))
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=structural_mask(seg, fill))
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=bm), dense, rtol=0, atol=1e-5)
    with pytest.raises(ValueError):
        structural_block_mask(seg, 0)
    with pytest.raises(ValueError):
        structural_block_mask(seg[0], 1)


@pytest.mark.slow
def test_compiled_flex_attention_reads_the_fast_tiles():
    """Compiled on CPU, FlexAttention skips unlisted tiles and does not apply mask_mod on FULL ones: with the fast
    BlockMask it equals the dense-masked SDPA, and dropping the FULL tiles changes the result (so the lists are read).
    Slow tier: a C++ compile."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    torch.manual_seed(0)
    bs, fill = 32, 3
    seg = _packed_rows(3 * bs, bs)
    B, S = seg.shape
    R = (fill + 1) * S
    q, k, v = (torch.randn(B, 2, R, 16) for _ in range(3))
    bm = structural_block_mask(seg, fill, block_size=bs)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=structural_mask(seg, fill))
    compiled = torch.compile(flex_attention)
    torch.testing.assert_close(compiled(q, k, v, block_mask=bm), dense, rtol=0, atol=1e-5)
    no_full = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, torch.zeros_like(bm.full_kv_num_blocks),
                                       bm.full_kv_indices, BLOCK_SIZE=bs, mask_mod=bm.mask_mod, seq_lengths=(R, R))
    assert int(bm.full_kv_num_blocks.sum()) > 0
    assert not torch.allclose(compiled(q, k, v, block_mask=no_full), dense, atol=1e-3)
