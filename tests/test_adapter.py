import re

import pytest
import torch

from spd_ds.models.adapter import Target, TargetArch, UnsupportedModelError
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model


def run_stages(target, caches, ids, pos0):
    h = target.ends.embed(ids)
    pos = torch.arange(pos0, pos0 + ids.shape[1])
    for s, st in enumerate(target.stages):
        h, _ = st(h, pos, caches[s])
    return target.ends.logits(h)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text",
                                        "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_stages_in_turn_reproduce_hf_logits(tiny_root, model_type, n):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tiny_root, model_type, 6)
    arch = TargetArch(path)
    target = Target(arch, StagePartition.build(6, n), torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        caches = target.new_caches(64)
        mine = [run_stages(target, caches, ids[:, :8], 0)[0]]  # prefill 8, then 4 single-token steps
        for i in range(8, 12):
            mine.append(run_stages(target, caches, ids[:, i:i + 1], i)[0])
    torch.testing.assert_close(torch.cat(mine), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_eager_attention_stages_reproduce_hf_eager_logits_on_both_cache_paths(tiny_root, model_type):
    """model.attn_implementation=eager: transformers' eager attention adds the mask to the scores, so the stages pass
    an additive mask (a boolean one masked nothing: the prefill saw later tokens and the answers were wrong while
    still equal to AR, which runs the same stages). Length-based caches (CPU path) and static caches (GPU path)."""
    from transformers import AutoModelForCausalLM

    from spd_ds.models.graphs import GraphedStage

    path = make_tiny_model(tiny_root, model_type, 6)
    target = Target(TargetArch(path, "eager"), StagePartition.build(6, 2), torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, target.arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        caches = target.new_caches(64)
        mine = [run_stages(target, caches, ids[:, :8], 0)[0]] + [run_stages(target, caches, ids[:, i:i + 1], i)[0]
                                                                  for i in range(8, 12)]
        torch.testing.assert_close(torch.cat(mine), ref, atol=1e-4, rtol=1e-4)
        graphed = [GraphedStage(st, 64, use_graph=False) for st in target.stages]  # static caches, eager forwards
        h = target.ends.embed(ids[:, :8])
        for g in graphed:
            h, _ = g.prefill(h)
        static = [target.ends.logits(h[0])]
        for i in range(8, 12):
            h = target.ends.embed(ids[:, i:i + 1])
            for g in graphed:
                h, _ = g.step(h, i)
            static.append(target.ends.logits(h[0]))
        torch.testing.assert_close(torch.cat(static), ref, atol=1e-4, rtol=1e-4)


def test_kv_crop_rollback_recomputes_identically(tiny_root):
    path = make_tiny_model(tiny_root, "qwen3", 6)
    target = Target(TargetArch(path), StagePartition.build(6, 2), torch.float32, "cpu")
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        caches = target.new_caches(32)
        run_stages(target, caches, ids[:, :6], 0)
        a = [run_stages(target, caches, ids[:, i:i + 1], i) for i in range(6, 10)]
        for c in caches:  # roll back to 7 positions and recompute with other tokens, then the originals
            c.crop(7)
        run_stages(target, caches, torch.tensor([[5]]), 7)
        for c in caches:
            c.crop(7)
        b = [run_stages(target, caches, ids[:, i:i + 1], i) for i in range(7, 10)]
    for x, y in zip(a[1:], b):
        assert torch.equal(x, y)


def test_stage_captures_raw_anchor_states(tiny_root):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tiny_root, "llama", 6)
    part = StagePartition.build(6, 3)
    target = Target(TargetArch(path), part, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states  # hs[L] is post-norm in transformers 5
        h, got = target.ends.embed(ids), {}
        for s, st in enumerate(target.stages):
            h, cap = st(h, torch.arange(4), None)
            got.update(cap)
    assert set(got) == {a for a in part.anchors if a > 0}
    for j, t in got.items():
        if j < 6:
            torch.testing.assert_close(t, hs[j], atol=1e-5, rtol=1e-5)
    # anchor L is the raw last-layer output, not HF's normed hidden_states[L]
    torch.testing.assert_close(target.ends.norm(got[6]), hs[6], atol=1e-5, rtol=1e-5)


def test_sliding_window_caps_the_context(tiny_root):
    """A window over every layer (Mistral's ``sliding_window``): the stages attend to the whole context, equal to the
    window's attention while the context fits it, so the window caps the context spd-ds decodes (it used to decode past
    it with full attention: other tokens than the model's own)."""
    from transformers import AutoModelForCausalLM

    from spd_ds.decoding.ar import ARDecoder
    from spd_ds.decoding.reference import PromptError

    path = make_tiny_model(tiny_root, "mistral", 4, sliding_window=16)
    arch = TargetArch(path)
    assert arch.sliding_window == 16 and arch.max_positions == 16
    assert TargetArch(make_tiny_model(tiny_root, "mistral", 4)).max_positions == 512  # no window
    target = Target(arch, StagePartition.build(4, 2), torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, arch.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = run_stages(target, target.new_caches(32), ids, 0)[0]
        ref = hf(ids).logits[0]
    torch.testing.assert_close(mine[:16], ref[:16], atol=1e-4, rtol=1e-4)  # within the window: the same
    assert not torch.allclose(mine[16:], ref[16:], atol=1e-2)  # past it the window matters
    # the prompt check names the window on every path: single-process AR and SPD, the head rank, before a session
    assert arch.max_positions_source == "sliding_window"
    window = (r"exceeds the model's sliding-window context of 16 positions \(config.json sliding_window; full "
              r"attention is exact only within it\); shorten the prompt")
    with pytest.raises(PromptError, match=window):
        ARDecoder(target, max_len=512).generate(list(range(1, 11)), 6)
    from spd_ds.decoding.drafters import OracleDrafter
    from spd_ds.decoding.reference import SPDReferenceDecoder

    with pytest.raises(PromptError, match=window):
        spd = SPDReferenceDecoder(target, OracleDrafter(list(range(40)), vocab_size=96), max_len=512)
        spd.generate(list(range(1, 11)), 6)
    from types import SimpleNamespace

    from spd_ds.pipe.head_rank import HeadDriver

    driver = HeadDriver(SimpleNamespace(n=2, max_len=16, model_max=16, model_max_source=arch.max_positions_source,
                                        eos=frozenset({0}), stop=None))
    driver.request(list(range(1, 11)), 6, None, driver.sampling)
    with pytest.raises(PromptError, match=window):
        driver.load_prompt()
    import torch.distributed as dist

    from spd_ds.config import load_config
    from spd_ds.pipe.runner import SPDSession

    cfg = load_config(None, [f"model.name={path}", "partition.num_stages=2", "head.checkpoint=null"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")
        mp.setattr("spd_ds.pipe.runner.init_distributed", _no_collective)
        with pytest.raises(PromptError, match=window):
            SPDSession(cfg, prompts=[list(range(1, 11))], max_new_tokens=6)
    assert not (dist.is_available() and dist.is_initialized())
    # a window no shorter than max_position_embeddings is not what limits the context
    wide = TargetArch(make_tiny_model(tiny_root, "mistral", 4, sliding_window=512))
    assert wide.max_positions == 512 and wide.max_positions_source == "max_position_embeddings"
    assert TargetArch(make_tiny_model(tiny_root, "mistral", 4)).max_positions_source == "max_position_embeddings"


def _no_collective(*args, **kwargs):
    raise AssertionError("a collective was reached (init_distributed, PipelineModule) before the check")


def test_unsupported_model_is_refused(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=50)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not supported"):
        TargetArch(tmp_path)


def test_partition_must_match_model(tiny_root):
    path = make_tiny_model(tiny_root, "llama", 6)
    with pytest.raises(ValueError, match="partition has 4 layers"):
        Target(TargetArch(path), StagePartition.build(4, 2), torch.float32, "cpu")


def test_composite_checkpoint_stage_reads_only_its_language_model_layers(tiny_root, monkeypatch):
    """A composite Qwen3.5 checkpoint (text model + vision tower): the text config drives the stages, and a stage
    reads only its own layers' tensors (never the vision tower's)."""
    from spd_ds.models import weights
    from spd_ds.models.adapter import TargetStage

    arch = TargetArch(make_tiny_model(tiny_root, "qwen3_5", 8))
    assert arch.composite and arch.config.model_type == "qwen3_5_text" and arch.hybrid
    seen = []
    orig = weights.SafetensorsIndex.get
    monkeypatch.setattr(weights.SafetensorsIndex, "get", lambda self, n: seen.append(n) or orig(self, n))
    TargetStage(arch, range(4, 8), torch.float32, "cpu")
    assert seen and all(n.startswith("model.language_model.layers.") for n in seen)
    assert {int(n.split(".")[3]) for n in seen} == {4, 5, 6, 7}


def test_qwen3_5_layers_other_than_linear_and_full_attention_are_refused(tmp_path):
    from transformers import AutoConfig

    from tests.tiny_models import TINY

    cfg = AutoConfig.for_model("qwen3_5_text", **TINY["qwen3_5_text"], num_hidden_layers=2,
                               layer_types=["linear_attention", "sliding_attention"])
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="only full_attention and linear_attention"):
        TargetArch(tmp_path)


@pytest.mark.parametrize("top_tie,text_tie", [(True, False), (False, True), (True, True)])
def test_composite_checkpoint_ties_the_lm_head_as_its_own_model(tmp_path, top_tie, text_tie):
    """A composite checkpoint's LM head is tied (or not) as the composite model itself decides (its top-level flag):
    logits equal transformers' image-text-to-text model's on text input."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests.tiny_models import TINY, TINY_VISION

    text = dict(TINY["qwen3_5_text"], num_hidden_layers=4, tie_word_embeddings=text_tie)
    cfg = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=dict(TINY_VISION),
                               tie_word_embeddings=top_tie)
    torch.manual_seed(0)
    vlm = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in vlm.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    vlm.save_pretrained(tmp_path)
    vlm = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    arch = TargetArch(tmp_path)
    assert arch.tied_embeddings == top_tie
    target = Target(arch, StagePartition.build(4, 2), torch.float32, "cpu")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = vlm(input_ids=ids).logits[0]
        torch.testing.assert_close(run_stages(target, target.new_caches(16), ids, 0)[0], want, atol=1e-5, rtol=1e-5)


def test_damaged_or_mismatched_model_files_are_one_line_user_errors(tiny_root, tmp_path, capsys):
    """A model directory that cannot be read, or whose tensors are not its config's, is a ModelFileError (one line,
    exit status 2 in every command) instead of a traceback from safetensors, transformers or a KeyError."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from spd_ds.builder import generation_eos_ids, load_tokenizer
    from spd_ds.commands import infer
    from spd_ds.models.adapter import ModelFileError
    from spd_ds.zoo import resolve_model
    from tests.test_train_data import make_chat_model

    good = make_chat_model(tiny_root, 4)

    def copy(name):
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    bad = copy("json")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"config.json cannot be read as a transformers config .*re-download"):
        TargetArch(bad)
    bad = copy("no_type")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["model_type"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="cannot be read as a transformers config"):
        TargetArch(bad)
    bad = copy("truncated")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ModelFileError, match=r"model.safetensors is not a readable safetensors file"):
        TargetArch(bad)
    bad = copy("bin")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    with pytest.raises(ModelFileError, match=r"holds PyTorch .bin/.pt weights and no \*.safetensors; convert them"):
        TargetArch(bad)
    tensors = load_file(str(good / "model.safetensors"))
    bad = copy("missing")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.3.mlp.down_proj.weight"},
              str(bad / "model.safetensors"))
    with pytest.raises(ModelFileError, match="tensor 'model.layers.3.mlp.down_proj.weight' is not in the checkpoint"):
        Target(TargetArch(bad), StagePartition.build(4, 2), torch.float32, "cpu")
    bad = copy("shape")
    save_file({k: (v[:, :32].contiguous() if k == "model.layers.0.mlp.down_proj.weight" else v)
               for k, v in tensors.items()}, str(bad / "model.safetensors"))
    with pytest.raises(ModelFileError,
                       match=r"down_proj.weight has shape \(64, 32\) in the checkpoint but \(64, 128\)"):
        Target(TargetArch(bad), StagePartition.build(4, 2), torch.float32, "cpu")
    # sharded: the shards the index names are read, another safetensors beside them is not; a missing shard is named
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(good).save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(sharded / "consolidated.safetensors"))
    arch = TargetArch(sharded)
    assert not arch.has_tensor("layers.0.attention.wq.weight")
    torch.testing.assert_close(arch.load_tensor("model.norm.weight"), tensors["model.norm.weight"])
    (sharded / shards[-1]).unlink()
    with pytest.raises(ModelFileError, match=f"lacks 1 of the {len(shards)} weight shards .*{shards[-1]}"):
        TargetArch(sharded)
    bad = copy("tokenizer")
    (bad / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelFileError, match="the tokenizer in .* cannot be loaded"):
        load_tokenizer(bad)
    (bad / "generation_config.json").write_text('{"eos_token_id": "two"}')
    with pytest.raises(ModelFileError, match="generation_config.json cannot be read"):
        generation_eos_ids(bad)
    (bad / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    assert generation_eos_ids(bad) == [2, 5] and generation_eos_ids(tmp_path) == []
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="fake.gguf cannot be converted from GGUF"):
        resolve_model(str(fake), cache_dir=tmp_path / "cache")
    # the commands: one line, exit status 2 (an unsupported architecture too)
    from transformers import AutoConfig

    AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=50).save_pretrained(tmp_path / "gpt2")
    for model in (tmp_path / "gpt2", tmp_path / "json"):
        capsys.readouterr()
        assert infer.main([f"model.name={model}", "head.checkpoint=null", "model.device=cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err


def _damaged(good, out, edit):
    """A copy of model folder ``good`` at ``out`` whose safetensors are ``edit(name -> tensor)``'s."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(good, out)
    tensors = edit(load_file(str(out / "model.safetensors")))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _narrow(name):
    return lambda t: {k: (v[: v.shape[0] // 2].contiguous() if k == name else v) for k, v in t.items()}


@pytest.mark.parametrize("model_type,edit,match", [
    ("qwen3", _drop("model.layers.5.mlp.down_proj.weight"),
     "tensor 'model.layers.5.mlp.down_proj.weight' is not in the checkpoint of"),
    ("qwen3", _narrow("model.layers.4.self_attn.k_proj.weight"),
     r"tensor model.layers.4.self_attn.k_proj.weight has shape \(32, 64\) in the checkpoint but \(64, 64\) by "
     "config.json; the weights and the config are of different models"),
    ("qwen3", _narrow("model.layers.5.self_attn.k_norm.weight"), r"k_norm.weight has shape \(16,\)"),
    ("qwen3", _narrow("lm_head.weight"), r"tensor lm_head.weight has shape \(48, 64\) in the checkpoint but \(96, 64"),
    ("qwen3", _narrow("model.norm.weight"), r"tensor model.norm.weight has shape \(32,\)"),
    ("llama", _narrow("model.embed_tokens.weight"), r"model.embed_tokens.weight has shape \(48, 64\)"),  # tied
    ("qwen3_moe", _narrow("model.layers.5.mlp.experts.3.up_proj.weight"),
     r"tensor model.layers.5.mlp.experts.3.up_proj.weight has shape \(16, 64\) in the checkpoint but \(32, 64\)"),
    ("qwen3_moe", _drop("model.layers.4.mlp.experts.1.down_proj.weight"),
     "tensor 'model.layers.4.mlp.experts.1.down_proj.weight' is not in the checkpoint"),
    ("qwen3_5_moe_text", _narrow("model.layers.5.linear_attn.conv1d.weight"), "linear_attn.conv1d.weight has shape"),
    ("qwen3_5", _drop("model.language_model.layers.5.mlp.down_proj.weight"),  # composite: its stored name
     "tensor 'model.language_model.layers.5.mlp.down_proj.weight' is not in the checkpoint"),
])
def test_every_stage_tensor_is_checked_from_the_headers_before_any_process_group(tiny_root, tmp_path, monkeypatch,
                                                                                  model_type, edit, match):
    """A tensor of a late stage missing or of another shape: every rank finds it from the safetensors headers (no
    tensor data read) before init_distributed, with the line of the rank that would load it; it used to be found only
    by that rank, after the process group, and the others said "another rank failed"."""
    import torch.distributed as dist

    from spd_ds.config import load_config
    from spd_ds.models.adapter import ModelFileError
    from spd_ds.models.weights import SafetensorsIndex
    from spd_ds.pipe.runner import SPDSession

    good = make_tiny_model(tiny_root, model_type, 6)
    TargetArch(good).check_weights()  # an intact checkpoint passes
    bad = _damaged(good, tmp_path / "bad", edit)
    with pytest.raises(ModelFileError, match=match) as loading:  # what the loading rank says
        Target(TargetArch(bad), StagePartition.build(6, 2), torch.float32, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("spd_ds.pipe.runner.init_distributed", _no_collective)
    monkeypatch.setattr(SafetensorsIndex, "get", lambda self, name: pytest.fail(f"tensor data read: {name}"))
    cfg = load_config(None, [f"model.name={bad}", "partition.num_stages=2", "head.checkpoint=null"])
    with pytest.raises(ModelFileError, match=match) as checking:
        SPDSession(cfg, prompts=[[1, 2, 3]])
    assert "\n" not in str(checking.value) and str(checking.value) == str(loading.value)
    assert not (dist.is_available() and dist.is_initialized())
    # training: the teacher's builder checks too, before the PipelineModule's collectives
    from spd_ds.train.teacher import build_teacher_module

    monkeypatch.setattr("deepspeed.pipe.PipelineModule", _no_collective)
    with pytest.raises(ModelFileError, match=match):
        build_teacher_module(TargetArch(bad), StagePartition.build(6, 2), torch.float32, 2, list(range(96)))


def test_random_weights_and_a_smollm2_checkpoint_check_from_headers_alone(smollm2_dir, monkeypatch):
    """The check of a real checkpoint reads the file headers only, not one tensor (17 ms on SmolLM2 here); random
    weights have nothing to check (nothing is generated)."""
    from spd_ds.models.weights import RandomWeights, SafetensorsIndex

    def no_data(self, name):
        raise AssertionError(f"tensor data read: {name}")

    monkeypatch.setattr(SafetensorsIndex, "get", no_data)
    monkeypatch.setattr(SafetensorsIndex, "rows", no_data)
    monkeypatch.setattr(RandomWeights, "get", no_data)
    TargetArch(smollm2_dir).check_weights()
    TargetArch("random:qwen3-4b").check_weights()


def test_stage_layers_override_num_stages_with_a_warning(tiny_root, caplog):
    """``partition.stage_layers`` decides the stages; a ``num_stages`` that disagrees is said to be ignored."""
    import logging

    from spd_ds.builder import build_partition
    from spd_ds.config import load_config

    path = make_tiny_model(tiny_root, "llama", 6)
    cfg = load_config(None, [f"model.name={path}", "partition.num_stages=3", "partition.stage_layers=[3,3]"])
    with caplog.at_level(logging.WARNING, logger="spd_ds.builder"):
        assert build_partition(cfg, TargetArch(path)).num_stages == 2
    assert "partition.stage_layers gives 2 stages; partition.num_stages=3 is ignored" in caplog.text
    caplog.clear()
    cfg = load_config(None, [f"model.name={path}", "partition.num_stages=2", "partition.stage_layers=[2,4]"])
    with caplog.at_level(logging.WARNING, logger="spd_ds.builder"):
        build_partition(cfg, TargetArch(path))
    assert "ignored" not in caplog.text


def test_a_head_of_another_partition_names_the_settings_that_differ(tiny_root, tmp_path):
    """The message says which partition settings to change: num_stages for a default split, the anchors of a PPSD
    head (it said 'set partition.num_stages=2' when that was already 2)."""
    from spd_ds.builder import build_partition
    from spd_ds.config import ConfigError, load_config
    from spd_ds.head import SpeculationHead

    path = make_tiny_model(tiny_root, "llama", 6)
    arch = TargetArch(path)
    SpeculationHead(arch, StagePartition.build(6, 2, anchors=[0, 3])).save(tmp_path / "ppsd")
    SpeculationHead(arch, StagePartition.build(6, 2)).save(tmp_path / "spd")
    SpeculationHead(arch, StagePartition.build(6, 3, anchors=[0, 3, 6])).save(tmp_path / "n3_anchors")
    SpeculationHead(arch, StagePartition.build(6, None, [1, 2, 3])).save(tmp_path / "n3_split")
    for head, over, fix in (("ppsd", [], "set partition.anchors=[0,3] or"),
                            ("spd", ["partition.num_stages=3"], "set partition.num_stages=2 or"),
                            ("spd", ["partition.stage_layers=[2,4]"], "set partition.stage_layers=[3,3] or"),
                            ("spd", ["partition.anchors=[0,2]", "partition.num_stages=3"],
                             "set partition.num_stages=2 partition.anchors=[0,3,6] or"),
                            # a new stage count moves the default anchors: they are named too (it said num_stages and
                            # stage_layers alone, and the run that followed the advice stopped on the anchors)
                            ("n3_anchors", [], "set partition.num_stages=3 partition.anchors=[0,3,6] or"),
                            ("n3_split", [], "set partition.num_stages=3 partition.stage_layers=[1,2,3] or"),
                            ("n3_split", ["partition.stage_layers=[3,3]"],
                             "set partition.num_stages=3 partition.stage_layers=[1,2,3] or")):
        cfg = load_config(None, [f"model.name={path}", f"head.checkpoint={tmp_path / head}", *over])
        with pytest.raises(ConfigError, match=re.escape(fix)) as info:
            build_partition(cfg, arch)
        advice = str(info.value).split("; set ")[1].split(" or ")[0].split()  # following the advice loads the head
        cfg = load_config(None, [f"model.name={path}", f"head.checkpoint={tmp_path / head}", *over, *advice])
        assert build_partition(cfg, arch) == StagePartition.from_dict(SpeculationHead.read_config(tmp_path / head)
                                                                      ["partition"])
