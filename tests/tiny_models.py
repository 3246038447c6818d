"""Tiny random-initialised configs of real architectures, saved as local HF directories (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=96, max_position_embeddings=512, tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=96, max_position_embeddings=512, sliding_window=None),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=96, max_position_embeddings=512, use_sliding_window=False),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  vocab_size=96, max_position_embeddings=512),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=96, max_position_embeddings=512),
}
# Qwen3.5 (hybrid): layer i is full attention iff (i + 1) % 4 == 0; partial RoPE 0.25 of head_dim 32 = 8 dims,
# mRoPE sections [2, 1, 1] (as transformers' own tests); linear attention with 2 key / 4 value heads of 16.
_QWEN3_5 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
                max_position_embeddings=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
TINY["qwen3_5_text"] = dict(_QWEN3_5, intermediate_size=128)
TINY["qwen3_5_moe_text"] = dict(_QWEN3_5, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2)
# composite checkpoints (text model + a one-block vision tower), saved in their own layout (model.language_model.*)
COMPOSITE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4,
                   temporal_patch_size=2, spatial_merge_size=1, num_position_embeddings=16)


def make_tiny_model(root: Path, model_type: str = "llama", num_layers: int = 6, seed: int = 0, **overrides) -> Path:
    """Write a random ``model_type`` model with ``num_layers`` layers to ``root/<model_type>-<L>`` and return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tag = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    out = Path(root) / f"{model_type}-{num_layers}-{seed}{tag}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    if model_type in COMPOSITE:
        from transformers import AutoModelForImageTextToText

        text = dict(TINY[COMPOSITE[model_type]], num_hidden_layers=num_layers, **overrides)
        cfg = AutoConfig.for_model(model_type, text_config=text, vision_config=dict(TINY_VISION),
                                   tie_word_embeddings=text.get("tie_word_embeddings", False))
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    else:
        kw = dict(TINY[model_type], num_hidden_layers=num_layers, **overrides)
        cfg = AutoConfig.for_model(model_type, **kw)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so that logits are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out
