"""Failure handling of the distributed engine: wrong world size, a killed stage, a stalled stage.

The fault tests start the ranks directly (the environment a launcher sets, without a launcher that would kill the
survivors as soon as one rank dies), so what is tested is that every surviving rank ends by itself with a clear
error within ``deepspeed.timeout_s``, and that a stalled rank ends too (its watchdog).
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.test_pipe_worker import deepspeed_cmd, launch, spawn_start, spawn_wait, worker_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 8


def stamp(out: str, tag: str) -> float:
    line = next(x for x in out.splitlines() if x.startswith(tag))
    return float(line.split("t=")[1])


def fault_job(kind: str, rank: int):
    return {"name": f"fault_{kind}", "model": {"type": "qwen3", "layers": 6}, "prompts": [[3, 14, 15, 92, 65]],
            "max_new_tokens": 200, "reference": False,
            "overrides": ["partition.num_stages=2", "head.placement=dedicated", f"deepspeed.timeout_s={TIMEOUT_S}",
                          "decoding.max_length=256"],
            "fault": {"rank": rank, "after": 12, "kind": kind}}


@pytest.fixture
def tiny(tiny_root):
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tiny_root, "qwen3", 6)
    return str(tiny_root)


def test_wrong_world_size_fails_at_once_under_deepspeed(tmp_path, tiny):
    job = {"name": "w", "model": {"type": "qwen3", "layers": 6}, "prompts": [[1, 2, 3]], "max_new_tokens": 4,
           "overrides": ["partition.num_stages=2", "head.placement=dedicated"]}
    t0 = time.time()
    _, rc, log = launch(deepspeed_cmd(2), {"tiny_root": tiny, "jobs": [job]}, tmp_path, timeout=300)
    assert rc != 0
    msg = "world size 2 does not fit partition.num_stages=2 with head.placement=dedicated: launch 3 processes"
    assert msg in log
    errors = [p.read_text() for p in tmp_path.glob("out.rank*.error")]  # the launcher may kill the slower rank
    assert errors and all(e.startswith("WorldSizeError: " + msg) for e in errors), errors
    assert time.time() - t0 < 120


def test_wrong_world_size_raises_before_any_collective(tmp_path, tiny):
    """Rank 0 of a claimed 3-process world, alone: it must fail without waiting for the missing ranks."""
    job = {"name": "w", "model": {"type": "qwen3", "layers": 6}, "prompts": [[1, 2, 3]], "max_new_tokens": 4,
           "overrides": ["partition.num_stages=3", "head.placement=dedicated"]}
    env = worker_env(RANK=0, WORLD_SIZE=3, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=1)
    _, rc, log = launch([sys.executable], {"tiny_root": tiny, "jobs": [job]}, tmp_path, timeout=120, env=env)
    assert rc != 0 and "world size 3 does not fit partition.num_stages=3 with head.placement=dedicated" in log


@pytest.fixture(scope="module")
def faults(tmp_path_factory, tiny_root):
    """A killed stage and a stalled stage, run at the same time (two independent 3-rank jobs)."""
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tiny_root, "qwen3", 6)
    dirs = {k: tmp_path_factory.mktemp(k) for k in ("kill", "stall")}
    procs = {k: spawn_start(3, {"tiny_root": str(tiny_root), "jobs": [fault_job(k, 2)]}, d) for k, d in dirs.items()}
    return {k: spawn_wait(procs[k], dirs[k], timeout=240) for k in dirs}


def test_killed_stage_ends_the_run_with_an_error(faults):
    ranks = faults["kill"]
    (rc0, out0), (rc1, out1), (rc2, out2) = ranks
    assert rc2 == -9, out2[-3000:]  # the victim
    assert rc0 not in (0, None) and rc1 not in (0, None), (out0[-3000:], out1[-3000:])
    assert "PipeCommError: rank 0 (head): receiving from rank 2 (target stage 1) failed" in out0
    assert "a rank died or stalled" in out0
    assert "PipeCommError" in out1 or "PipeAborted" in out1
    fault = stamp(out2, "SPD-FAULT")
    assert stamp(out0, "SPD-ERROR") - fault < TIMEOUT_S  # a dead peer is noticed at once
    assert stamp(out1, "SPD-ERROR") - fault < TIMEOUT_S + 5


def test_stalled_stage_ends_the_run_within_the_timeout(faults):
    (rc0, out0), (rc1, out1), (rc2, out2) = faults["stall"]
    assert rc0 not in (0, None) and rc1 not in (0, None), (out0[-3000:], out1[-3000:])
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in out0 and "PipeCommError: rank 0 (head)" in out0
    assert rc2 == 70 and "rank 2 (target stage 1) made no progress" in out2, out2[-3000:]  # its watchdog
    fault = stamp(out2, "SPD-FAULT")
    assert stamp(out0, "SPD-ERROR") - fault < TIMEOUT_S + 3
    assert stamp(out1, "SPD-ERROR") - fault < TIMEOUT_S + 5


def test_a_damaged_checkpoint_is_named_by_every_rank_before_the_process_group(tmp_path, tiny_root):
    """Stage 1's own layers lack a tensor: every rank finds it from the safetensors headers before the process group
    and prints the one-line model error (only stage 1's rank used to, after it; the others said another rank failed)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.tiny_models import make_tiny_model

    good = make_tiny_model(tiny_root, "qwen3", 6)
    bad = tmp_path / "model"
    shutil.copytree(good, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.5.mlp.down_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    job = {"name": "missing", "model": {"path": str(bad)}, "prompts": [[1, 2, 3]], "max_new_tokens": 4,
           "reference": False, "overrides": ["partition.num_stages=2", f"deepspeed.timeout_s={TIMEOUT_S}"]}
    ranks = spawn_wait(spawn_start(2, {"tiny_root": str(tiny_root), "jobs": [job]}, tmp_path), tmp_path, timeout=240)
    for rank, (rc, out) in enumerate(ranks):
        assert rc not in (0, None), (rank, out[-3000:])
        line = "ModelFileError: tensor 'model.layers.5.mlp.down_proj.weight' is not in the checkpoint of " + str(bad)
        assert line in out, (rank, out[-3000:])
        assert "another rank failed" not in out and "init_process_group" not in out, (rank, out[-3000:])


def test_a_rank_that_fails_while_building_names_the_cause_and_the_others_say_so(tmp_path, tiny_root, monkeypatch):
    """Stage 1's rank fails while it builds its stage (out of memory: nothing a check before the process group can
    see); that rank names the cause, and the rank that was waiting for it in DeepSpeed's set-up says another rank
    failed (not a bare gloo 'Connection closed by peer'). The fault is put in rank 1 by a sitecustomize module."""
    import os

    from tests.tiny_models import make_tiny_model

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import torch\n"
        "    from spd_ds.models import adapter\n"
        "    def _fail(self, *args, **kwargs):\n"
        "        raise torch.OutOfMemoryError('simulated: out of memory while building the stage')\n"
        "    adapter.TargetStage.__init__ = _fail\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p))
    path = make_tiny_model(tiny_root, "qwen3", 6)
    job = {"name": "oom", "model": {"path": str(path)}, "prompts": [[1, 2, 3]], "max_new_tokens": 4,
           "reference": False, "overrides": ["partition.num_stages=2", f"deepspeed.timeout_s={TIMEOUT_S}"]}
    (rc0, out0), (rc1, out1) = spawn_wait(spawn_start(2, {"tiny_root": str(tiny_root), "jobs": [job]}, tmp_path),
                                          tmp_path, timeout=240)
    assert rc1 not in (0, None) and "simulated: out of memory while building the stage" in out1, out1[-3000:]
    assert rc0 not in (0, None), out0[-3000:]
    assert "another rank failed while the pipeline was being built" in out0, out0[-3000:]
