"""The main job as a user runs it: launch/infer.py on SmolLM2 (one process, plain python and under deepspeed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "launch" / "configs" / "smollm2_spd.yaml"


def run(cmd, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "deepspeed"])
def test_infer_answers_match_ar(smollm2_dir, tmp_path, launcher):
    # python: reference decoder, checked against the single-process AR decoder; deepspeed: 2 ranks (2 stages, gloo)
    # through the pipeline engine, checked against AR through the same pipeline. Both with the shipped n=2 head.
    args = ["launch/infer.py", "--config", str(CONFIG), "decoding.max_new_tokens=12",
            "--prompt", "What is the capital of France?", "--prompt", "Name three colours.",
            "--output", str(tmp_path / "out.jsonl")]
    cmd = [sys.executable, *args] if launcher == "python" else ["deepspeed", "--num_gpus", "2", *args]
    r = run(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    ar = "AR decoding" if launcher == "python" else "AR through the same pipeline"
    assert f"identical to {ar}: 2/2 prompts" in r.stdout
    assert "Paris" in r.stdout
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"equivalent_accept_length"' in lines[0]


def test_unknown_key_is_a_one_line_error():
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "partition.stages=3"])
    assert r.returncode == 2
    assert "unknown config key 'partition.stages'; valid keys of partition: num_stages" in r.stderr


@pytest.mark.slow
def test_too_many_stages_is_a_clear_error(smollm2_dir):
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "partition.num_stages=31", "--prompt", "hi"])
    assert r.returncode == 2
    assert "partition.num_stages=31 exceeds the model's 30 decoder layers" in r.stderr


@pytest.mark.slow
def test_head_for_another_partition_is_refused(smollm2_dir):
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "partition.num_stages=3", "--prompt", "hi"])
    assert r.returncode == 2
    assert "was trained for partition" in r.stderr and "partition.num_stages=2" in r.stderr
