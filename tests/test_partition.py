import itertools

import pytest

from spd_ds.partition import PartitionError, StagePartition


@pytest.mark.parametrize("L", [1, 2, 3, 6, 7, 12, 24, 30, 32, 36, 48])
def test_uniform_partition_properties(L):
    for n in range(1, min(L, 20) + 1):
        p = StagePartition.build(L, n)
        assert p.num_stages == n and sum(p.stage_layers) == L
        assert max(p.stage_layers) - min(p.stage_layers) <= 1
        # stages tile [0, L) contiguously
        layers = list(itertools.chain.from_iterable(p.stage_range(s) for s in range(n)))
        assert layers == list(range(L))
        b, f, mu = p.anchors, p.depth_to_type, p.type_min_depth
        assert b[0] == 0 and list(b) == sorted(set(b)) and b[-1] <= L and len(b) <= n + 1
        assert f[0] == 0 and f[n] == p.num_types - 1
        assert all(x <= y for x, y in zip(f, f[1:]))  # monotone in depth
        assert set(f) == set(range(p.num_types))  # no dead aggregation type
        for k in range(p.num_types):
            assert f[mu[k]] == k and all(f[d] != k for d in range(mu[k]))
            # every anchor of type k is available at depth mu(k)
            assert all(a <= p.available(mu[k]) for a in b[: k + 1])
        for a in b:  # ownership: the stage that computes that hidden state
            s = p.anchor_owner(a)
            assert a == 0 and s == 0 or a - 1 in p.stage_range(s)
        assert sorted(sum((p.stage_anchors(s) for s in range(n)), ())) == list(b)


def test_default_anchors_n2_and_reference_failure_case():
    # the reference's auto anchors fail for n=2; ours hold for every n >= 1
    p = StagePartition.build(32, 2)
    assert p.anchors == (0, 16, 32) and p.depth_to_type == (0, 1, 2)
    p = StagePartition.build(32, 8)
    assert len(p.anchors) == 5 and set(p.depth_to_type) == set(range(5))


def test_explicit_stage_layers_and_anchors():
    p = StagePartition.build(30, stage_layers=[4, 13, 13], anchors=[0, 4, 30])
    assert p.stage_starts == (0, 4, 17) and p.depth_to_type == (0, 1, 1, 2)
    assert p.anchor_owner(30) == 2 and p.anchor_owner(4) == 0
    assert StagePartition.from_dict(p.to_dict()) == p


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=6, num_stages=7), "exceeds the model's 6 decoder layers"),
        (dict(num_layers=6, num_stages=0), ">= 1"),
        (dict(num_layers=6, stage_layers=[3, 2]), "sums to 5"),
        (dict(num_layers=6, stage_layers=[6, 0]), ">= 1 layer"),
        (dict(num_layers=6, num_stages=3, stage_layers=[3, 3]), "agree"),
        (dict(num_layers=6, num_stages=2, anchors=[1, 3]), "start with 0"),
        (dict(num_layers=6, num_stages=2, anchors=[0, 3, 3]), "strictly increasing"),
        (dict(num_layers=6, num_stages=2, anchors=[0, 3, 7]), "<= num_layers"),
        (dict(num_layers=6, num_stages=2, anchors=[0, 1, 3, 6]), "at most 3"),
        (dict(num_layers=6, num_stages=3, anchors=[0, 1, 2, 6]), "never used"),
    ],
)
def test_bad_partitions_raise_clear_errors(kwargs, match):
    with pytest.raises(PartitionError, match=match):
        StagePartition.build(**kwargs)
