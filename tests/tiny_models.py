"""Tiny random-initialised configs of real architectures, saved as local HF directories (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=96, max_position_embeddings=512, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=96, max_position_embeddings=512, use_sliding_window=False),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  vocab_size=96, max_position_embeddings=512),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=96, max_position_embeddings=512),
}


def make_tiny_model(root: Path, model_type: str = "llama", num_layers: int = 6, seed: int = 0, **overrides) -> Path:
    """Write a random ``model_type`` model with ``num_layers`` layers to ``root/<model_type>-<L>`` and return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tag = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    out = Path(root) / f"{model_type}-{num_layers}-{seed}{tag}"
    if (out / "config.json").exists():
        return out
    kw = dict(TINY[model_type], num_hidden_layers=num_layers, **overrides)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so that logits are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out
