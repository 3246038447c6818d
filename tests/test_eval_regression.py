"""Acceptance regression: the committed SmolLM2 head keeps its recorded equivalent accept length on a fixed prompt
set; and the record/check machinery itself on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from spd_ds.eval.prompts import materialize_prompt_set
from spd_ds.eval.regression import ACCEPTANCE_FILE, DEFAULT_HEAD_DIR, check_acceptance, record_acceptance
from tests.test_eval_random_weights import make_random_shape

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)


@pytest.mark.parametrize("n", [2, 3])
def test_committed_head_keeps_its_acceptance(tmp_path, smollm2_dir, n):
    """The committed SmolLM2 n=2 (default) and n=3 heads keep their recorded acceptance (fails, never skips, if a head
    or its record is gone)."""
    head_dir = DEFAULT_HEAD_DIR.parent / f"smollm2-135m-instruct-n{n}"
    if not (head_dir / "head_config.json").is_file():
        pytest.fail(f"no committed head at {head_dir}: train the SmolLM2 n={n} head, save it there and record "
                    f"its acceptance: python -m spd_ds.eval.regression {head_dir} --record --eval-dir DIR")
    if not (head_dir / ACCEPTANCE_FILE).is_file():
        pytest.fail(f"{head_dir} has no {ACCEPTANCE_FILE}: python -m spd_ds.eval.regression "
                    f"{head_dir} --record --eval-dir DIR")
    spec = json.loads((head_dir / ACCEPTANCE_FILE).read_text())["spec"]
    materialize_prompt_set(spec["prompt_set"], tmp_path)  # from its registry package, as the product gets it
    ok, msg, _ = check_acceptance(head_dir, eval_dir=tmp_path)
    assert ok, msg


def test_record_then_check(tmp_path):
    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch
    from spd_ds.partition import StagePartition

    shape = make_random_shape(tmp_path)
    torch.manual_seed(0)
    head = SpeculationHead(TargetArch(shape), StagePartition.build(4, 2)).save(tmp_path / "head")
    spec = {"model": str(shape), "prompt_set": "random", "num_prompts": 2, "max_new_tokens": 12}
    path = record_acceptance(head, spec)
    rec = json.loads(path.read_text())
    assert rec["recorded"]["num_new_tokens"] == 24 and rec["tolerance"] == {"equivalent_accept_length": 0.05}
    ok, msg, measured = check_acceptance(head)
    assert ok, msg
    assert measured == rec["recorded"]  # fp32 CPU greedy: bit-for-bit the same run
    rec["recorded"]["equivalent_accept_length"] += 0.2
    path.write_text(json.dumps(rec))
    ok, msg, _ = check_acceptance(head)
    assert not ok and "moved" in msg and "equivalent_accept_length" in msg
