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
    COMPLETE, block_types, key_kind, packed_causal_mask, row_kinds, sample_fill, segment_positions, structural_mask,
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
