import json

import pytest
import torch

from spd_ds.head import HeadMismatchError, SpeculationHead, load_draft_vocab
from spd_ds.models.adapter import TargetArch
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model


@pytest.fixture()
def arch(tiny_root):
    return TargetArch(make_tiny_model(tiny_root, "qwen3", 6))


def test_head_shapes_and_init(arch):
    part = StagePartition.build(6, 3)
    ids = list(range(0, 96, 3))
    head = SpeculationHead(arch, part, num_layers=2, draft_token_ids=ids)
    assert len(head.aggr) == part.num_types and head.aggr[2].in_features == 3 * arch.hidden_size
    torch.testing.assert_close(head.lm_head.weight, arch.load_tensor("lm_head.weight")[ids])
    feats = torch.randn(5, part.num_types, arch.hidden_size)
    rows = head.aggregate(feats, [3, 3, 2, 1, 0])
    # type k only reads anchors 0..k
    feats2 = feats.clone()
    feats2[4, 1:] = 7.0
    assert torch.equal(head.aggregate(feats2, [3, 3, 2, 1, 0])[4], rows[4])
    out = head.logits(head.tower(rows[None], torch.arange(5)))
    assert out.shape == (1, 5, len(ids)) and out.dtype == torch.float32


def test_save_load_roundtrip(arch, tmp_path):
    part = StagePartition.build(6, 2)
    head = SpeculationHead(arch, part, draft_token_ids=list(range(10, 60)))
    head.save(tmp_path / "h")
    meta = json.loads((tmp_path / "h" / "head_config.json").read_text())
    assert meta["partition"] == part.to_dict() and meta["draft_vocab_size"] == 50
    back = SpeculationHead.load(tmp_path / "h", arch)
    for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k


def test_lm_head_from_target_is_frozen_and_not_stored(arch, tmp_path):
    """``lm_head_from_target``: the LM head is the target's rows at the draft ids, takes no gradient, is left out of
    the checkpoint (smaller file) and comes back from the target on load; the rest round-trips exactly."""
    part = StagePartition.build(6, 2)
    ids = list(range(10, 60))
    head = SpeculationHead(arch, part, draft_token_ids=ids, lm_head_from_target=True)
    assert not head.lm_head.weight.requires_grad
    with torch.no_grad():
        head.aggr[0].weight.add_(1.0)
    head.save(tmp_path / "h")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h" / "head.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    back = SpeculationHead.load(tmp_path / "h", arch)
    assert back.lm_head_from_target and not back.lm_head.weight.requires_grad
    torch.testing.assert_close(back.lm_head.weight, arch.load_tensor("lm_head.weight")[ids], rtol=0, atol=0)
    for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k


def test_load_mismatch_errors(arch, tiny_root, tmp_path):
    part = StagePartition.build(6, 2)
    SpeculationHead(arch, part).save(tmp_path / "h")
    with pytest.raises(HeadMismatchError, match="trained for partition"):
        SpeculationHead.load(tmp_path / "h", arch, StagePartition.build(6, 3))
    other = TargetArch(make_tiny_model(tiny_root, "qwen3", 6, seed=5))
    with pytest.raises(HeadMismatchError, match="another base model"):
        SpeculationHead.load(tmp_path / "h", other)


def test_draft_vocab_file(tmp_path):
    f = tmp_path / "dv.json"
    f.write_text(json.dumps({"token_ids": [1, 5, 9], "draft_vocab_size": 3}))
    assert load_draft_vocab(f) == [1, 5, 9]
    f.write_text(json.dumps({"token_ids": [1, 9, 5], "draft_vocab_size": 3}))
    with pytest.raises(ValueError, match="sorted"):
        load_draft_vocab(f)
    f.write_text(json.dumps({"token_ids": [1, 5], "draft_vocab_size": 3}))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        load_draft_vocab(f)
