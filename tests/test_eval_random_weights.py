"""Random weights of real shapes (``random:<shape>``): seeded, stage-local, with a well-defined fingerprint; the
``hf_generate`` baseline gets the same weights."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from spd_ds.decoding.sampling import SamplingParams
from spd_ds.models.adapter import RandomWeights, Target, TargetArch, is_random_model_dir, random_model_dir
from spd_ds.models.weights import random_shapes
from spd_ds.partition import StagePartition

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)


TINY_SHAPES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 96, "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 2},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 96, "max_position_embeddings": 512, "tie_word_embeddings": False,
              "use_sliding_window": False, "eos_token_id": 2},
}


def make_random_shape(root: Path, model_type: str = "llama", seed: int = 0, std: float = 0.2, **overrides) -> Path:
    """A tiny shape directory (``config.json`` + ``random_weights.json``) under ``root``; large ``std`` so that
    logits are far from ties."""
    cfg = dict(TINY_SHAPES[model_type], **overrides)
    d = Path(root) / f"shape-{model_type}-{seed}-{std}-{cfg['num_hidden_layers']}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "random_weights.json").write_text(json.dumps({"seed": seed, "std": std}))
    return d


def test_committed_shapes_have_the_public_parameter_counts():
    from transformers import AutoModelForCausalLM

    assert {"qwen3-4b", "llama-3.1-8b", "smollm2-135m", "qwen3.5-4b", "qwen3.5-moe"} <= set(random_shapes())
    # qwen3.5-4b: the text model of Qwen/Qwen3.5-4B (its vision tower is not part of the shape); qwen3.5-moe: 24
    # layers of Qwen3.5-35B-A3B's layout with 32 experts (a small MoE of the real layout)
    want = {"qwen3-4b": 4.022e9, "llama-3.1-8b": 8.030e9, "smollm2-135m": 0.1345e9, "qwen3.5-4b": 4.206e9,
            "qwen3.5-moe": 4.281e9}
    for name, n in want.items():
        arch = TargetArch(f"random:{name}")
        assert arch.random_weights and is_random_model_dir(arch.model_dir)
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(arch.config)
        assert sum(p.numel() for p in m.parameters()) == pytest.approx(n, rel=2e-3)
    cfg = TargetArch("random:llama-3.1-8b").config
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3" and rope.get("rope_theta", getattr(cfg, "rope_theta", None)) == 500000.0
    assert TargetArch("random:qwen3-4b").config.head_dim == 128
    q = TargetArch("random:qwen3.5-4b")
    assert q.hybrid and q.tied_embeddings and [i for i in range(32) if not q.is_linear(i)] == list(range(3, 32, 4))
    assert q.config.rope_parameters["partial_rotary_factor"] == 0.25 and q.config.head_dim == 256
    m = TargetArch("random:qwen3.5-moe")
    assert m.num_layers == 24 and m.config.num_experts == 32 and m.config.num_experts_per_tok == 8
    with pytest.raises(ValueError, match="known: random:"):
        random_model_dir("random:nope-1b")


def test_weights_are_seeded_per_tensor_and_stage_local(tmp_path, monkeypatch):
    d = make_random_shape(tmp_path)
    a, b = TargetArch(d), TargetArch(d)
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(a.load_tensor(name), b.load_tensor(name))
    assert not torch.equal(a.load_tensor(name), a.load_tensor("model.layers.2.mlp.up_proj.weight"))
    assert torch.equal(a.load_tensor("model.layers.0.input_layernorm.weight"), torch.ones(64))
    assert a.fingerprint() == b.fingerprint()
    other = TargetArch(make_random_shape(tmp_path, seed=1))
    assert other.fingerprint() != a.fingerprint()
    assert not torch.equal(other.load_tensor(name), a.load_tensor(name))
    assert a.tied_embeddings

    # a stage builds (generates) only its own layers
    seen: list[str] = []
    orig = RandomWeights.get

    def spy(self, n):
        seen.append(n)
        return orig(self, n)

    monkeypatch.setattr(RandomWeights, "get", spy)
    from spd_ds.models.adapter import TargetStage

    part = StagePartition.build(4, 2)
    TargetStage(a, part.stage_range(1), torch.float32, "cpu")
    layers = {int(n.split(".")[2]) for n in seen if n.startswith("model.layers.")}
    assert layers == {2, 3}


def test_zero_centred_norms_are_generated_as_their_identity():
    """Qwen3.5's RMSNorms scale by ``1 + w`` (identity: zeros), its gated norm by ``w`` (identity: ones)."""
    a = TargetArch("random:qwen3.5-tiny")
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.q_norm.weight",
                 "model.norm.weight"):
        assert torch.equal(a.load_tensor(name), torch.zeros_like(a.load_tensor(name))), name
    assert torch.equal(a.load_tensor("model.layers.0.linear_attn.norm.weight"), torch.ones(16))
    b = TargetArch("random:smollm2-135m")  # other families: unchanged (ones), so are their fingerprints
    assert not b._weights.zero_norms and torch.equal(b.load_tensor("model.norm.weight"), torch.ones(576))


def test_hf_generate_baseline_uses_the_target_weights(tmp_path):
    from spd_ds.decoding.ar import ARDecoder
    from spd_ds.eval.baselines import BaselineContext, build_baseline

    for mt in ("llama", "qwen3"):
        arch = TargetArch(make_random_shape(tmp_path, mt))
        target = Target(arch, StagePartition.build(4, 2), torch.float32, "cpu")
        ctx = BaselineContext(target, SamplingParams(), [], 128)
        hf = build_baseline("hf_generate", ctx)
        prompt = [5, 17, 33, 2, 60, 61]
        want = ARDecoder(target, eos_token_ids=[], max_len=128).generate(prompt, 16).tokens
        forwards = []
        hook = hf.model.register_forward_hook(lambda mod, args, out: forwards.append(1))
        t0 = time.perf_counter()
        got = hf.generate(prompt, 16)
        wall = time.perf_counter() - t0
        hook.remove()
        assert got.tokens == want, mt
        m = got.metrics
        assert m.num_new_tokens == 16 and m.decode_s > 0 and m.prefill_s > 0 and m.prefill_s + m.decode_s <= wall
        # both times come from generate's own forwards: no separate prompt forward (it computed every position's
        # logits, was longer than generate's prefill and made decode_s come out too small, even negative)
        assert len(forwards) == 16
    for shape in ("qwen3.5-tiny", "qwen3.5-moe-tiny"):  # hybrid shapes: transformers' own cache and generate
        arch = TargetArch(f"random:{shape}")
        target = Target(arch, StagePartition.build(8, 2), torch.float32, "cpu")
        hf = build_baseline("hf_generate", BaselineContext(target, SamplingParams(), [], 128))
        prompt = [5, 17, 33, 2, 60, 61]
        want = ARDecoder(target, eos_token_ids=[], max_len=128).generate(prompt, 16).tokens
        assert hf.generate(prompt, 16).tokens == want, shape


def test_a_prompt_too_long_for_the_context_is_refused_before_the_weights_load(tmp_path):
    """A reference-decoder eval found a prompt that cannot fit the model's context with its generation only as it
    decoded it: after the target's weights had loaded and the warm-up begun (minutes for a large model). prepare()
    refuses it now, by the decoders' rule, naming the prompt; a prompt that fits still passes."""
    from spd_ds.config import load_config
    from spd_ds.decoding.cycle import PromptError
    from spd_ds.eval.runner import prepare

    shape = make_random_shape(tmp_path)  # max_position_embeddings 512
    base = [f"model.name={shape}", "eval.prompt_sets=[random]", "data.num_prompts=1", "decoding.max_new_tokens=8"]
    with pytest.raises(PromptError) as e:
        prepare(load_config(None, [*base, "eval.random_prompt_lengths=[503]"]))
    assert str(e.value) == ("[random random-0] prompt of 503 tokens + max_new_tokens=8 (+2 in flight) exceeds the "
                            "model's maximum context of 512 positions; shorten the prompt or lower "
                            "decoding.max_new_tokens"), str(e.value)
    cfg, arch, part, tok, prompts = prepare(load_config(None, [*base, "eval.random_prompt_lengths=[502]"]))
    assert [len(p.ids) for p in prompts] == [502] and cfg.decoding.max_length == 512


def test_the_prompt_check_of_a_ppsd_head_alone_counts_its_own_stages(tmp_path):
    """eval.spd=false decodes with the PPSD head's partition (run_eval), not partition.num_stages: prepare() fitted
    max_length and checked the prompts for the config's stages, so a prompt that fits the PPSD head's 2 stages was
    refused for the config's 4 (+4 in flight)."""
    from spd_ds.config import load_config
    from spd_ds.eval.runner import prepare
    from spd_ds.head import SpeculationHead

    shape = make_random_shape(tmp_path)  # max_position_embeddings 512
    ppsd = SpeculationHead(TargetArch(shape), StagePartition.build(TargetArch(shape).num_layers, 2, anchors=[0, 2]))
    ppsd = ppsd.save(tmp_path / "ppsd-n2")
    cfg, arch, part, tok, prompts = prepare(load_config(None, [
        f"model.name={shape}", "eval.prompt_sets=[random]", "data.num_prompts=1", "decoding.max_new_tokens=8",
        "eval.random_prompt_lengths=[502]", "partition.num_stages=4", "eval.spd=false",
        f"eval.ppsd_checkpoint={ppsd}"]))
    assert part.num_stages == 2 and list(part.anchors) == [0, 2] and cfg.decoding.max_length == 512
