import json
import re

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


def test_set_draft_vocab_widens_a_target_tied_head_and_keeps_its_logits(arch, tmp_path):
    """A head with the target's LM-head rows drafts over another vocabulary: the new rows are the target's, the rest
    of the head is unchanged, so the logits of ids in both vocabularies are equal (the whole vocabulary: the same
    logits at the old ids, more ids); it saves and loads with its new vocabulary; a head with its own LM head and a
    bad vocabulary are refused."""
    part = StagePartition.build(6, 2)
    ids = list(range(10, 60, 2))
    head = SpeculationHead(arch, part, draft_token_ids=ids, lm_head_from_target=True)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:  # a trained head: unlike its initialisation, its LM head still the target's rows
                p.add_(0.01 * torch.randn_like(p))
    feats = torch.randn(4, part.num_types, arch.hidden_size)
    hidden = head.tower(head.aggregate(feats, [2, 2, 1, 0])[None], torch.arange(4))
    before = head.logits(hidden)
    head.set_draft_vocab(None)
    assert head.draft_vocab_size == arch.vocab_size and torch.equal(head.draft_ids, torch.arange(arch.vocab_size))
    assert not head.lm_head.weight.requires_grad
    torch.testing.assert_close(head.lm_head.weight, arch.load_tensor("lm_head.weight"), rtol=0, atol=0)
    after = head.logits(head.tower(head.aggregate(feats, [2, 2, 1, 0])[None], torch.arange(4)))
    assert after.shape[-1] == arch.vocab_size
    torch.testing.assert_close(after[..., ids], before, rtol=0, atol=0)
    head.save(tmp_path / "full")
    assert json.loads((tmp_path / "full" / "head_config.json").read_text())["draft_vocab_size"] == arch.vocab_size
    back = SpeculationHead.load(tmp_path / "full", arch)
    assert back.draft_vocab_size == arch.vocab_size
    torch.testing.assert_close(back.logits(hidden), after, rtol=0, atol=0)
    back.set_draft_vocab(ids[::2])  # and narrower again
    torch.testing.assert_close(back.logits(hidden), before[..., ::2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="sorted, unique"):
        back.set_draft_vocab([5, 3])
    own = SpeculationHead(arch, part, draft_token_ids=ids)
    with pytest.raises(ValueError, match="lm_head_from_target=true"):
        own.set_draft_vocab(None)
    half = SpeculationHead.load(tmp_path / "full", arch).to(torch.bfloat16)  # a bf16 head stays bf16, frozen
    half.set_draft_vocab(ids)
    assert half.lm_head.weight.dtype == torch.bfloat16 and not half.lm_head.weight.requires_grad
    assert torch.equal(half.lm_head.weight, arch.load_tensor("lm_head.weight")[ids].to(torch.bfloat16))


def test_head_draft_vocab_config_for_a_loaded_head(arch, tmp_path, caplog):
    """``head.draft_vocab`` with a checkpoint: ``full`` widens a target-tied head, a file narrows it (a training run
    warm-started from a widened head trains over the file's vocabulary), unset keeps the checkpoint's; a head with
    its own LM head keeps its vocabulary, with a warning."""
    from spd_ds.builder import build_head
    from spd_ds.config import load_config

    part = StagePartition.build(6, 2)
    ids = list(range(10, 60, 2))
    vocab = tmp_path / "v.json"
    vocab.write_text(json.dumps({"token_ids": ids[:10], "draft_vocab_size": 10}))
    SpeculationHead(arch, part, draft_token_ids=ids, lm_head_from_target=True).save(tmp_path / "tied")
    SpeculationHead(arch, part, draft_token_ids=ids).save(tmp_path / "own")

    def load(name, *over):
        cfg = load_config(None, [f"model.name={arch.model_dir}", f"head.checkpoint={tmp_path / name}", *over])
        return build_head(cfg, arch, part)

    assert load("tied").draft_vocab_size == len(ids)
    assert load("tied", "head.draft_vocab=full").draft_vocab_size == arch.vocab_size
    assert load("tied", f"head.draft_vocab={vocab}").draft_ids.tolist() == ids[:10]
    with caplog.at_level("WARNING"):
        assert load("own", "head.draft_vocab=full").draft_ids.tolist() == ids
    assert "stores its own LM head" in caplog.text
    # the engine's every-rank check before any collective: the same vocabulary errors (naming head.draft_vocab),
    # `full` passes
    from spd_ds.config import ConfigError
    from spd_ds.pipe.runner import _precheck_head

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"token_ids": [5, 3], "draft_vocab_size": 2}))

    def precheck(v):
        _precheck_head(load_config(None, [f"model.name={arch.model_dir}", f"head.checkpoint={tmp_path / 'tied'}",
                                          f"head.draft_vocab={v}"]), arch)

    precheck("full")
    precheck(vocab)
    with pytest.raises(ConfigError, match=r"head.draft_vocab: .*bad.json: token_ids must be sorted"):
        precheck(bad)
    with pytest.raises(ConfigError, match=r"head.draft_vocab=.*none.json does not exist; give a draft-vocabulary JSON"):
        precheck(tmp_path / "none.json")
    # a file built for a larger vocabulary (another model): one line on every rank before any collective, and from
    # build_head (a new head or a loaded one), not the head's ValueError traceback
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"token_ids": [2, arch.vocab_size + 5], "draft_vocab_size": 2}))
    outside = rf"head.draft_vocab=.*other.json holds ids in \[2, {arch.vocab_size + 5}\], outside the target's " \
              rf"vocabulary of {arch.vocab_size} ids"
    with pytest.raises(ConfigError, match=outside):
        precheck(other)
    with pytest.raises(ConfigError, match=outside):
        load("tied", f"head.draft_vocab={other}")
    with pytest.raises(ConfigError, match=outside):
        build_head(load_config(None, [f"model.name={arch.model_dir}", f"head.draft_vocab={other}"]), arch, part)
    for content, match in (({"token_ids": []}, "token_ids must be a non-empty list of integer token ids"),
                           ({"token_ids": 5}, "token_ids must be a non-empty list of integer token ids"),
                           ({"token_ids": ["a"]}, "token_ids must be a non-empty list of integer token ids"),
                           ([1, 2, 3], "is a JSON list, not an object with token_ids")):
        bad.write_text(json.dumps(content))
        with pytest.raises(ConfigError, match=f"head.draft_vocab: .*bad.json.*{match}"):
            precheck(bad)


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


def _copy_model(src, dst, change):
    """A copy of model directory ``src`` at ``dst`` with ``change(state)`` applied to its tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    state = load_file(str(f))
    change(state)
    save_file(state, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("what", ["late_embedding_row", "final_norm"])
def test_fingerprint_refuses_a_model_changed_late(arch, tmp_path, what):
    """A head trained for one model is refused by a model that differs only in one late embedding row (the last,
    which the sampled rows include) or in its final norm; the version-1 fingerprint (first 8 rows) missed both."""
    part = StagePartition.build(6, 2)
    SpeculationHead(arch, part).save(tmp_path / "h")

    def change(state):
        if what == "late_embedding_row":
            state["model.embed_tokens.weight"][-1] += 0.5
        else:
            state["model.norm.weight"] *= 1.01

    other = TargetArch(_copy_model(arch.model_dir, tmp_path / "other", change))
    assert other.legacy_fingerprint() == arch.legacy_fingerprint()  # what version 1 could not tell apart
    assert other.fingerprint() != arch.fingerprint()
    with pytest.raises(HeadMismatchError, match="another base model"):
        SpeculationHead.check_base_model(tmp_path / "h", other)
    assert json.loads((tmp_path / "h" / "head_config.json").read_text())["fingerprint_version"] == 2


def test_version1_fingerprint_still_loads_with_a_warning(arch, tiny_root, tmp_path, caplog):
    part = StagePartition.build(6, 2)
    SpeculationHead(arch, part).save(tmp_path / "h")
    cfg = tmp_path / "h" / "head_config.json"
    meta = json.loads(cfg.read_text())
    meta.pop("fingerprint_version")
    meta["base_model_fingerprint"] = arch.legacy_fingerprint()
    cfg.write_text(json.dumps(meta))
    with caplog.at_level("WARNING"):
        SpeculationHead.load(tmp_path / "h", arch)
    assert "version-1 base-model fingerprint" in caplog.text and "re-save" in caplog.text
    other = TargetArch(make_tiny_model(tiny_root, "qwen3", 6, seed=5))
    with pytest.raises(HeadMismatchError, match="another base model"):
        SpeculationHead.check_base_model(tmp_path / "h", other)


@pytest.mark.parametrize("n", [2, 3])
def test_shipped_head_loads(smollm2_arch, n):
    """The committed SmolLM2 heads (n = 2, the default, and n = 3) keep loading onto SmolLM2-135M-Instruct; they
    store no LM head (the target's rows at the draft ids are read on load), draft over the whole vocabulary (trained
    over a 16k-id one, widened with set_draft_vocab: docs/training.md, "Draft vocabulary") and are small: at most
    40 MB together (the tracked tree travels to the GPU machine): both are two-layer heads in bf16, 18 MB (n = 2) and
    21 MB (n = 3)."""
    from spd_ds.eval.regression import DEFAULT_HEAD_DIR

    head_dir = DEFAULT_HEAD_DIR.parent / f"smollm2-135m-instruct-n{n}"
    meta = SpeculationHead.check_base_model(head_dir, smollm2_arch)
    head = SpeculationHead.load(head_dir, smollm2_arch)
    assert head.draft_vocab_size == meta["draft_vocab_size"] == smollm2_arch.vocab_size
    assert head.partition.num_stages == n
    assert meta["lm_head_from_target"]
    sizes = [(DEFAULT_HEAD_DIR.parent / f"smollm2-135m-instruct-n{k}" / "head.safetensors").stat().st_size
             for k in (2, 3)]
    assert sum(sizes) <= 40e6, sizes
    name = "model.embed_tokens.weight" if smollm2_arch.tied_embeddings else "lm_head.weight"
    assert torch.equal(head.lm_head.weight,
                       smollm2_arch.load_tensor(name)[head.draft_ids].to(head.lm_head.weight.dtype))


@pytest.mark.parametrize("damage", ["truncated", "header", "header_length", "shapes"])
def test_damaged_head_weights_are_a_one_line_error(arch, tmp_path, damage):
    from spd_ds.head import HeadCheckpointError

    part = StagePartition.build(6, 2)
    SpeculationHead(arch, part).save(tmp_path / "h")
    f = tmp_path / "h" / "head.safetensors"
    data = f.read_bytes()
    if damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        f.write_bytes(data[:8] + b"\xff\x00garbage" + data[17:])
    elif damage == "header_length":
        f.write_bytes((10 ** 12).to_bytes(8, "little") + data[8:])
    else:  # a readable file of another head
        SpeculationHead(arch, StagePartition.build(6, 3)).save(tmp_path / "other")
        f.write_bytes((tmp_path / "other" / "head.safetensors").read_bytes())
    with pytest.raises(HeadCheckpointError) as ei:
        SpeculationHead.check_base_model(tmp_path / "h", arch)
    msg = str(ei.value)
    assert "\n" not in msg and "head.safetensors" in msg and ("damaged" in msg or "does not match" in msg)
    with pytest.raises(HeadCheckpointError):
        SpeculationHead.load(tmp_path / "h", arch)


# ---------------------------------------------------------------------------------------------------- Qwen3.5 heads
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_5"])
def test_qwen3_5_head_tower_is_a_gated_attention_layer_with_a_dense_mlp(tiny_root, tmp_path, family):
    arch = TargetArch(make_tiny_model(tiny_root, family, 8))
    part = StagePartition.build(8, 4)
    head = SpeculationHead(arch, part, num_layers=2, draft_token_ids=list(range(0, 96, 2)))
    cfg = arch.config
    for layer in head.layers:
        assert type(layer).__name__ == "Qwen3_5DecoderLayer"  # the dense family's class, MoE targets too
        assert not hasattr(layer, "linear_attn") and hasattr(layer.mlp, "gate_proj")
        assert layer.self_attn.q_proj.out_features == 2 * cfg.num_attention_heads * cfg.head_dim  # output gate
    want = (cfg.intermediate_size if family != "qwen3_5_moe_text"
            else cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    assert head.layers[0].mlp.gate_proj.out_features == want
    feats = torch.randn(5, part.num_types, arch.hidden_size)
    out = head.logits(head.tower(head.aggregate(feats, [4, 3, 2, 1, 0])[None], torch.arange(5)))
    assert out.shape == (1, 5, 48) and torch.isfinite(out).all()
    head.save(tmp_path / "h")
    meta = json.loads((tmp_path / "h" / "head_config.json").read_text())
    assert meta["base_model_type"] == cfg.model_type and meta["base_model_fingerprint"] == arch.fingerprint()
    back = SpeculationHead.load(tmp_path / "h", arch)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))


@pytest.mark.parametrize("head_family,target_family", [("qwen3_5_text", "qwen3"), ("qwen3", "qwen3_5_text"),
                                                       ("qwen3_5_text", "qwen3_5_moe_text")])
def test_head_of_another_family_is_refused_in_one_line(tiny_root, tmp_path, head_family, target_family):
    a = TargetArch(make_tiny_model(tiny_root, head_family, 8))
    b = TargetArch(make_tiny_model(tiny_root, target_family, 8))
    SpeculationHead(a, StagePartition.build(8, 2)).save(tmp_path / "h")
    with pytest.raises(HeadMismatchError, match=f"trained for a {head_family} target but .* is {target_family}") as e:
        SpeculationHead.check_base_model(tmp_path / "h", b)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("shape", ["random:qwen3.5-4b", "random:qwen3.5-moe"])
def test_partitions_and_head_towers_of_the_32_and_24_layer_shapes(shape):
    """Default partitions and anchors of the real-size hybrid shapes (32 and 24 layers) for n = 2..8, every stage's
    cache (built on the meta device) and the head tower's layer (a gated full-attention layer, dense MLP)."""
    from spd_ds.models.adapter import head_layer_config
    from spd_ds.models.linear_cache import HybridStageCache

    arch = TargetArch(shape)
    L = arch.num_layers
    assert L == (32 if shape.endswith("4b") else 24)
    for n in range(2, 9):
        part = StagePartition.build(L, n)
        assert part.anchors[0] == 0 and part.anchors[-1] == L and set(part.depth_to_type) == set(range(part.num_types))
        linear = 0
        for s in range(n):
            c = arch.new_cache(part.stage_range(s), 8, torch.bfloat16, "meta", max_rollback=n - 1)
            lin = [i for i in part.stage_range(s) if arch.is_linear(i)]
            linear += len(lin)
            assert (isinstance(c, HybridStageCache) and c.linear_layer_ids == lin and c.slots == n) or not lin
        assert linear == 3 * L // 4
    cfg = head_layer_config(arch, 1)
    with torch.device("meta"):
        layer = arch.head_layer_class(cfg)(cfg, layer_idx=0)
    assert hasattr(layer, "self_attn") and hasattr(layer.mlp, "gate_proj") and not hasattr(layer, "linear_attn")


def test_a_loaded_head_keeps_its_shape_and_the_config_records_it(arch, tmp_path, caplog):
    """``head.num_layers``, ``head.intermediate_size`` and ``head.lm_head_from_target`` shape new heads: a loaded
    head keeps its own, the config takes them (a warm start's config.yaml said ``num_layers: 1`` for a two-layer
    head), and a value set to other than the default is named in a warning (it was dropped without a word)."""
    from spd_ds.builder import build_head
    from spd_ds.config import load_config

    part = StagePartition.build(6, 2)
    SpeculationHead(arch, part, num_layers=2, intermediate_size=48, lm_head_from_target=True).save(tmp_path / "h")

    def load(*over):
        cfg = load_config(None, [f"model.name={arch.model_dir}", f"head.checkpoint={tmp_path / 'h'}", *over])
        with caplog.at_level("WARNING", logger="spd_ds.builder"):
            head = build_head(cfg, arch, part)
        return cfg.head, head

    hc, head = load()  # the defaults (1 layer, the target's width, own LM head): no warning, the head's values kept
    assert (hc.num_layers, hc.intermediate_size, hc.lm_head_from_target) == (2, 48, True) and head.num_layers == 2
    assert "ignored" not in caplog.text
    hc, head = load("head.num_layers=3", "head.intermediate_size=64", "head.lm_head_from_target=false")
    assert (hc.num_layers, hc.intermediate_size, hc.lm_head_from_target) == (2, 48, True) and head.num_layers == 2
    for line in ("head.num_layers=3 ignored: head.checkpoint", "has num_layers=2 (a loaded head keeps its own shape)",
                 "head.intermediate_size=64 ignored", "has intermediate_size=48"):
        assert line in caplog.text, line
    assert "lm_head_from_target" not in caplog.text  # false is the default: nothing to tell from a config file's
    caplog.clear()
    SpeculationHead(arch, part).save(tmp_path / "h")  # the target's width (stored as null), named as such
    hc, _ = load(f"head.intermediate_size={arch.config.intermediate_size}")  # the same width: nothing to say
    assert "ignored" not in caplog.text
    hc, _ = load("head.intermediate_size=7")
    assert hc.intermediate_size is None and f"has the target's width {arch.config.intermediate_size}" in caplog.text


# ---------------------------------------------------------------------------------------------------- tower init
def test_tower_init_from_a_target_layer(arch):
    """``head.tower_init_layer``: every tower layer starts as a copy of the target layer (all its tensors match the
    dense tower of a Qwen3 target); out-of-range indices are one-line errors."""
    from spd_ds.builder import build_head
    from spd_ds.config import ConfigError, load_config

    cfg = load_config(None, [f"model.name={arch.model_dir}", "head.num_layers=2", "head.tower_init_layer=-2"])
    head = build_head(cfg, arch, StagePartition.build(6, 3))
    for tower in head.layers:
        for name, p in tower.named_parameters():
            assert torch.equal(p, arch.load_tensor(f"model.layers.4.{name}")), name
    fresh = SpeculationHead(arch, StagePartition.build(6, 3))
    assert not torch.equal(fresh.layers[0].self_attn.q_proj.weight, head.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ConfigError, match=r"tower_init_layer=6 is outside \[-6, 6\)"):
        fresh.init_tower_from_layer(6)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_tower_init_on_a_hybrid_target(tiny_root, family):
    """Qwen3.5: a linear-attention layer is refused (naming full-attention ones); from a full-attention layer the
    gated attention and norms are copied, the dense MLP only where the target's layer is dense."""
    from spd_ds.config import ConfigError

    arch = TargetArch(make_tiny_model(tiny_root, family, 8))
    head = SpeculationHead(arch, StagePartition.build(8, 2), draft_token_ids=list(range(0, 96, 2)))
    lin = next(i for i in range(8) if arch.is_linear(i))
    full = max(i for i in range(8) if not arch.is_linear(i))
    with pytest.raises(ConfigError, match=f"target layer {lin} is linear attention"):
        head.init_tower_from_layer(lin)
    copied = head.init_tower_from_layer(full)
    assert "self_attn.q_proj.weight" in copied and "input_layernorm.weight" in copied
    assert ("mlp.gate_proj.weight" in copied) == (family == "qwen3_5_text")
    assert torch.equal(head.layers[0].self_attn.o_proj.weight,
                       arch.load_tensor(f"model.layers.{full}.self_attn.o_proj.weight"))


# ---------------------------------------------------------------------------------------------------- bad checkpoints
def _saved_head(arch, tmp_path, **kw):
    """A one-layer 2-stage head saved at ``tmp_path / "h"``; returns the folder."""
    return SpeculationHead(arch, StagePartition.build(6, 2), draft_token_ids=list(range(10, 60)), **kw).save(
        tmp_path / "h")


def _edit_config(head_dir, change):
    f = head_dir / "head_config.json"
    meta = json.loads(f.read_text())
    change(meta)
    f.write_text(json.dumps(meta))


def _edit_weights(head_dir, change):
    from safetensors.torch import load_file, save_file

    f = head_dir / "head.safetensors"
    state = load_file(str(f))
    change(state)
    save_file(state, str(f))


def _one_line_error(exc, fn, *args):
    """The error ``fn(*args)`` raises: of type ``exc``, one line; returns its message."""
    with pytest.raises(exc) as ei:
        fn(*args)
    msg = str(ei.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("num_layers"), r"has no 'num_layers' \(an integer >= 1\)"),
    (lambda m: m.pop("partition"), r"has no 'partition' \(an object with num_layers, stage_layers and anchors\)"),
    (lambda m: m["partition"].pop("anchors"), r"has no 'partition.anchors' \(a list of integers"),
    (lambda m: m.update(partition="2 stages"), r"'partition' is \"2 stages\", expected an object"),
    (lambda m: m["partition"].update(anchors=[0, 6, 3]), r"bad 'partition' \(partition.anchors must be strictly "
                                                         r"increasing, got \[0, 6, 3\]\)"),
    (lambda m: m.update(hidden_size="64"), r"'hidden_size' is \"64\", expected an integer >= 1"),
    (lambda m: m.update(draft_vocab_size=None), r"'draft_vocab_size' is null, expected an integer >= 1"),
    (lambda m: m.update(lm_head_from_target="yes"), r"'lm_head_from_target' is \"yes\", expected true or false"),
    (lambda m: m.pop("base_model_fingerprint"), r"has no 'base_model_fingerprint' \(a string\)"),
], ids=["no_num_layers", "no_partition", "no_anchors", "partition_str", "bad_anchors", "hidden_size_str",
        "draft_vocab_null", "lm_head_flag_str", "no_fingerprint"])
def test_head_config_with_missing_or_mistyped_keys_is_a_one_line_error(arch, tmp_path, edit, match):
    """Missing keys or keys of the wrong type in head_config.json: a HeadCheckpointError naming the file, the key and
    what is expected, from read_config (every rank, before any collective), not a KeyError / TypeError /
    PartitionError traceback or a fingerprint message with the same fingerprint twice."""
    from spd_ds.head import HeadCheckpointError

    h = _saved_head(arch, tmp_path)
    _edit_config(h, edit)
    for fn, args in ((SpeculationHead.read_config, (h,)), (SpeculationHead.check_base_model, (h, arch)),
                     (SpeculationHead.load, (h, arch))):
        msg = _one_line_error(HeadCheckpointError, fn, *args)
        assert str(h / "head_config.json") in msg and "launch/train.py? retrain or restore it" in msg, msg
        assert re.search(match, msg), msg
        assert "fingerprint" not in msg or "base_model_fingerprint" in msg


def _two_layer_weights(arch, tmp_path):
    def change(state):
        from safetensors.torch import load_file

        two = SpeculationHead(arch, StagePartition.build(6, 2), 2, list(range(10, 60))).save(tmp_path / "two")
        state.update({k: v for k, v in load_file(str(two / "head.safetensors")).items() if k.startswith("layers.1.")})
    return change


@pytest.mark.parametrize("case,match", [
    ("missing_tensor", r"missing layers\.0\.mlp\.down_proj\.weight"),
    ("wrong_shape", r"shape of layers\.0\.self_attn\.o_proj\.weight \[\d+, \d+\] \(expected \[\d+, \d+\]\)"),
    ("extra_layer", r"unexpected layers\.1\.\S+, layers\.1\.\S+, layers\.1\.\S+ \(\+\d+ more\)"),
    ("intermediate_size", r"shape of layers\.0\.mlp\.\w+_proj\.weight \[\d+, \d+\] \(expected"),
    ("num_layers", r"missing layers\.1\."),
    ("lm_head_stored", r"unexpected lm_head\.weight"),
], ids=["missing_tensor", "wrong_shape", "extra_layer", "intermediate_size", "num_layers", "lm_head_stored"])
def test_tower_weights_that_do_not_match_the_config_fail_the_precheck(arch, tmp_path, case, match):
    """head.safetensors whose tensors (names and shapes) differ from what head_config.json implies for this target
    fails check_base_model, the check every rank runs before torch.distributed starts, in one line naming the
    tensors; not load_state_dict's multi-line RuntimeError on the head rank only, after the process group exists."""
    from spd_ds.config import load_config
    from spd_ds.head import HeadCheckpointError
    from spd_ds.pipe.runner import _precheck_head

    h = _saved_head(arch, tmp_path, lm_head_from_target=case == "lm_head_stored")
    if case == "missing_tensor":
        _edit_weights(h, lambda s: s.pop("layers.0.mlp.down_proj.weight"))
    elif case == "wrong_shape":
        _edit_weights(h, lambda s: s.update({"layers.0.self_attn.o_proj.weight": torch.zeros(3, 5)}))
    elif case == "extra_layer":
        _edit_weights(h, _two_layer_weights(arch, tmp_path))
    elif case == "intermediate_size":
        _edit_config(h, lambda m: m.update(intermediate_size=2 * arch.config.intermediate_size))
    elif case == "num_layers":
        _edit_config(h, lambda m: m.update(num_layers=2))
    else:  # a from-target head's file holding an LM head
        _edit_weights(h, lambda s: s.update({"lm_head.weight": torch.zeros(50, arch.hidden_size)}))
    for fn, args in ((SpeculationHead.check_base_model, (h, arch)), (SpeculationHead.load, (h, arch))):
        msg = _one_line_error(HeadCheckpointError, fn, *args)
        assert "head.safetensors does not match head_config.json" in msg and re.search(match, msg), msg
    with pytest.raises(HeadCheckpointError, match=match):
        _precheck_head(load_config(None, [f"model.name={arch.model_dir}", f"head.checkpoint={h}"]), arch)


def test_expected_tensors_are_what_save_writes(tiny_root, tmp_path):
    """The meta-device expectation equals the saved file's names and shapes for each family, with and without a
    stored LM head (and, without the target, for the aggregation / LM head / draft mask)."""
    from safetensors import safe_open

    for family, L in (("qwen3", 6), ("qwen3_5_text", 8), ("qwen3_5_moe_text", 8)):
        a = TargetArch(make_tiny_model(tiny_root, family, L))
        for tied in (False, True):
            h = SpeculationHead(a, StagePartition.build(L, 3), 2, list(range(0, 90, 3)), lm_head_from_target=tied)
            d = h.save(tmp_path / f"{family}{tied}")
            with safe_open(str(d / "head.safetensors"), "pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            meta = SpeculationHead.read_config(d)
            assert SpeculationHead.expected_tensors(meta, a) == shapes
            assert SpeculationHead.expected_tensors(meta).items() <= shapes.items()


@pytest.mark.parametrize("case,match", [
    ("no_mask", r"does not match head_config.json: missing draft_mask"),
    ("empty_mask", r"the head's draft_mask in head.safetensors is empty \(selects no token\) but head_config.json "
                   r"says draft_vocab_size 50: it is damaged"),
    ("short_mask", r"the head's draft_mask in head.safetensors selects 49 tokens but head_config.json says "
                   r"draft_vocab_size 50"),
], ids=["no_mask", "empty_mask", "short_mask"])
def test_damaged_draft_mask_is_named(arch, tmp_path, case, match):
    """A missing or damaged draft_mask is a one-line HeadCheckpointError saying so (not KeyError 'draft_ids', nor
    advice about a draft-vocab file nobody gave); an older head storing draft_ids still loads."""
    from spd_ds.head import HeadCheckpointError

    h = _saved_head(arch, tmp_path)

    def change(state):
        if case == "no_mask":
            del state["draft_mask"]
        else:
            state["draft_mask"][:] = False
            if case == "short_mask":
                state["draft_mask"][11:60] = True

    _edit_weights(h, change)
    for fn in (SpeculationHead.check_base_model, SpeculationHead.load):
        msg = _one_line_error(HeadCheckpointError, fn, h, arch)
        assert re.search(match, msg) and "draft-vocab file" not in msg, msg
    old = _saved_head(arch, tmp_path / "old")  # the draft vocabulary as an id list (heads before the mask)
    _edit_weights(old, lambda s: s.update(draft_ids=s.pop("draft_mask").nonzero().flatten()))
    assert SpeculationHead.load(old, arch).draft_ids.tolist() == list(range(10, 60))


@pytest.mark.parametrize("case,match", [
    ("int_weight", r"holds tensors of the wrong dtype: aggr\.0\.weight int32 \(expected floating point: float32, "
                   r"bfloat16 or float16\); it was not written by launch/train.py: copy the checkpoint again"),
    ("many_int", r"wrong dtype: aggr\.0\.weight int64 \(expected floating point[^)]*\), aggr\.1\.weight int64 "
                 r"\(expected floating point[^)]*\), \S+ int64 \(expected floating point[^)]*\) \(\+\d+ more\); "),
    ("int_mask", r"wrong dtype: draft_mask uint8 \(expected bool\)"),
    ("float_ids", r"wrong dtype: draft_ids float32 \(expected an integer type\)"),
], ids=["int_weight", "many_int", "int_mask", "float_ids"])
def test_tensors_of_the_wrong_dtype_are_refused(arch, tmp_path, case, match):
    """head.safetensors with an integer weight (names and shapes right), a non-bool draft_mask or a legacy
    draft_ids of floats: a one-line HeadCheckpointError from the precheck naming the tensor, its dtype and what it
    should be (an int32 aggr weight used to load, converted by load_state_dict; float draft_ids were truncated)."""
    from spd_ds.head import HeadCheckpointError

    h = _saved_head(arch, tmp_path)

    def change(state):
        if case == "int_weight":
            state["aggr.0.weight"] = state["aggr.0.weight"].to(torch.int32)
        elif case == "many_int":
            state.update({k: v.long() for k, v in state.items() if k != "draft_mask"})
        elif case == "int_mask":
            state["draft_mask"] = state["draft_mask"].to(torch.uint8)
        else:
            state["draft_ids"] = state.pop("draft_mask").nonzero().flatten().float()

    _edit_weights(h, change)
    for fn in (SpeculationHead.check_base_model, SpeculationHead.load):
        msg = _one_line_error(HeadCheckpointError, fn, h, arch)
        assert re.search(match, msg) and str(h) in msg, msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_floating_dtypes_and_legacy_integer_ids_load(arch, tmp_path, dtype):
    """Heads saved in fp32, bf16 (the shipped ones) or fp16 load, and so does an older head's int32 draft_ids."""
    head = SpeculationHead(arch, StagePartition.build(6, 2), draft_token_ids=list(range(10, 60)))
    h = head.save(tmp_path / "h", dtype=dtype)
    assert torch.equal(SpeculationHead.load(h, arch).aggr[0].weight, head.aggr[0].weight.to(dtype).float())
    _edit_weights(h, lambda s: s.update(draft_ids=s.pop("draft_mask").nonzero().flatten().int()))
    assert SpeculationHead.load(h, arch).draft_ids.tolist() == list(range(10, 60))


@pytest.mark.parametrize("version,exc,match", [
    (2, HeadMismatchError, r"head format version 2 was written by a newer spd-ds \(this one, {version}, reads "
                           r"version 1\); upgrade spd-ds"),
    (0, HeadMismatchError, r"head format version 0 is older than 1; retrain or convert it"),
    ("1", ValueError, r"'format_version' \"1\", not an integer; was it written by launch/train.py"),
    (None, ValueError, r"has no 'format_version'; was it written by launch/train.py"),
], ids=["newer", "older", "string", "missing"])
def test_head_format_version_messages(arch, tmp_path, version, exc, match):
    h = _saved_head(arch, tmp_path)
    _edit_config(h, lambda m: m.update(format_version=version) if version is not None else m.pop("format_version"))
    import spd_ds

    msg = _one_line_error(exc, SpeculationHead.read_config, h)
    assert re.search(match.replace("{version}", re.escape(spd_ds.__version__)), msg), msg
    assert version == 0 or "retrain or convert" not in msg


def test_head_path_messages_point_at_the_head_folders(arch, tmp_path):
    """head.checkpoint=<a training output_dir>, one of its DeepSpeed checkpoints/stepN folders, or the
    head.safetensors file: the message names the run's best_head / head folders (or the folder holding the file)
    and launch/train.py, not an internal method."""
    part = StagePartition.build(6, 2)
    run = tmp_path / "run"
    for name in ("head", "best_head"):
        SpeculationHead(arch, part).save(run / name)
    (run / "checkpoints" / "step5").mkdir(parents=True)
    (run / "checkpoints" / "step5" / "mp_rank_00_model_states.pt").write_bytes(b"")
    both = f"did you mean {run / 'best_head'} or {run / 'head'}?"
    for where, extra in ((run, ""), (run / "checkpoints" / "step5", "is a training checkpoint, not a head"),
                         (run / "checkpoints", "is a training checkpoint, not a head")):
        for fn, args in ((SpeculationHead.read_config, (where,)), (SpeculationHead.load, (where, arch))):
            msg = _one_line_error(FileNotFoundError, fn, *args)
            assert both in msg and extra in msg and "launch/train.py" in msg, msg
            assert "SpeculationHead.save" not in msg
    only_best = tmp_path / "run2"
    SpeculationHead(arch, part).save(only_best / "best_head")
    assert f"did you mean {only_best / 'best_head'}?" in _one_line_error(FileNotFoundError,
                                                                          SpeculationHead.read_config, only_best)
    msg = _one_line_error(FileNotFoundError, SpeculationHead.read_config, run / "head" / "head.safetensors")
    assert msg == (f"head.checkpoint {run / 'head' / 'head.safetensors'} is a file; give the folder that holds it "
                   f"({run / 'head'})")
    assert "head_config.json/" not in msg
    msg = _one_line_error(FileNotFoundError, SpeculationHead.read_config, tmp_path / "nowhere")
    assert "does not exist" in msg and "launch/train.py" in msg
    (run / "head" / "head.safetensors").unlink()
    msg = _one_line_error(FileNotFoundError, SpeculationHead.check_base_model, run / "head", arch)
    assert "head.safetensors not found" in msg and "launch/train.py" in msg and "SpeculationHead.save" not in msg


def test_a_file_of_a_training_run_as_head_checkpoint_names_the_run_heads(arch, tmp_path):
    """head.checkpoint=<a file>: the folder holding it when that is a head; the run's best_head / head when the file
    lies in a training output_dir (its train_summary.json) or up to three folders inside it (a DeepSpeed checkpoint's
    files, the checkpoints' ``latest``), not "give the folder that holds it" naming a folder that is no head; a file
    elsewhere is said to be no head checkpoint."""
    part = StagePartition.build(6, 2)
    run = tmp_path / "run"
    for name in ("head", "best_head"):
        SpeculationHead(arch, part).save(run / name)
    (run / "best_head" / "best.json").write_text("{}")
    (run / "train_summary.json").write_text("{}")
    step = run / "checkpoints" / "global_step5"
    (step / "zero").mkdir(parents=True)
    for f in (step / "mp_rank_00_model_states.pt", step / "zero" / "optim_states.pt", run / "checkpoints" / "latest"):
        f.write_bytes(b"")
    both = f"did you mean {run / 'best_head'} or {run / 'head'}?"
    for f, where in ((run / "train_summary.json", ""),
                     (step / "mp_rank_00_model_states.pt", f"{step} is a training checkpoint, not a head; "),
                     (step / "zero" / "optim_states.pt", f"{step / 'zero'} is a training checkpoint, not a head; "),
                     (run / "checkpoints" / "latest", f"{run / 'checkpoints'} is a training checkpoint, not a head; ")):
        for fn, args in ((SpeculationHead.read_config, (f,)), (SpeculationHead.load, (f, arch))):
            msg = _one_line_error(FileNotFoundError, fn, *args)
            assert msg.startswith(f"head.checkpoint {f} is a file, not a head: {where}{both}"), msg
            assert "give the folder that holds it" not in msg and "launch/train.py" in msg, msg
    msg = _one_line_error(FileNotFoundError, SpeculationHead.read_config, run / "best_head" / "best.json")
    assert msg == f"head.checkpoint {run / 'best_head' / 'best.json'} is a file; give the folder that holds it " \
                  f"({run / 'best_head'})"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.txt").write_text("")
    msg = _one_line_error(FileNotFoundError, SpeculationHead.read_config, tmp_path / "elsewhere" / "notes.txt")
    assert msg.startswith(f"head.checkpoint {tmp_path / 'elsewhere' / 'notes.txt'} is a file, not a head checkpoint; "
                          "give a head folder (head.checkpoint is a head folder, with head_config.json and "
                          "head.safetensors, written by launch/train.py)"), msg
    assert "did you mean" not in msg


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077], ids=oct)
def test_saved_head_files_get_the_umask_mode(arch, tmp_path, umask):
    """head.safetensors and head_config.json get 0o666 & ~umask (0644 with the usual 022, so a head can be shared),
    not the 0600 safetensors creates; re-saving over a 0600 file fixes it too."""
    import os
    import stat

    old = os.umask(umask)
    try:
        h = SpeculationHead(arch, StagePartition.build(6, 2))
        d = h.save(tmp_path / "h")
        os.chmod(d / "head.safetensors", 0o600)
        h.save(d)
        assert os.umask(umask) == umask  # save read the umask without changing it
    finally:
        os.umask(old)
    for name in ("head.safetensors", "head_config.json"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o666 & ~umask, name


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size"])
def test_head_config_sizes_of_another_target_are_named(arch, tmp_path, key):
    """A head_config.json whose sizes are not the target's (with the target's fingerprint): one line naming the key,
    from the precheck every rank runs (a vocabulary of another size failed in load, on the head rank, after the
    collectives had started)."""
    from spd_ds.head import HeadCheckpointError

    h = _saved_head(arch, tmp_path)
    _edit_config(h, lambda m: m.update({key: m[key] * 2}))
    msg = _one_line_error(HeadCheckpointError, SpeculationHead.check_base_model, h, arch)
    assert f"says {key} {2 * getattr(arch, key)} but" in msg and f"has {getattr(arch, key)}" in msg, msg
