"""spd_ds.commands.pipe_bench (SPD against AR through the same pipeline) in one process on CPU, with the oracle
drafter whose reference is the pipeline AR run just made."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pipe_bench_oracle_equals_pipeline_ar(smollm2_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "spd_ds.commands.pipe_bench", "--config",
                        "launch/configs/smollm2_spd.yaml", "--num-prompts", "1", "--max-new-tokens", "6",
                        "--warmup", "0", "--set", "decoding.drafter=oracle", "--set", "decoding.oracle_alpha=1.0",
                        "--set", "deepspeed.timeout_s=60", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "pipe_bench.json").read_text())
    assert out["summary"]["all_equal_to_pipeline_ar"] and out["summary"]["config"]["drafter"] == "oracle"
    rec = out["prompts"][0]
    assert rec["spd_tokens"] == rec["ar_tokens"] and len(rec["spd_tokens"]) == 6
    assert rec["spd"]["draft_acceptance_rate"] == 1.0  # alpha 1: the oracle proposes the pipeline AR's tokens


def test_pipe_bench_refuses_stop_strings_in_one_line():
    r = subprocess.run([sys.executable, "-m", "spd_ds.commands.pipe_bench", "--set", 'decoding.stop=["x"]'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "decoding.stop is for launch/infer.py" in r.stderr and "Traceback" not in r.stderr


def _pipe_bench(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "spd_ds.commands.pipe_bench", *args], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_pipe_bench_refuses_counts_below_their_minimum():
    # --num-prompts -3 ran the first 2 prompts (PROMPTS[:-3]) and 0 ran none, reporting all_equal_to_pipeline_ar
    # true with exit status 0; --max-new-tokens 0 fell back to decoding.max_new_tokens
    for option, value in (("--num-prompts", "-3"), ("--num-prompts", "0"), ("--max-new-tokens", "0"),
                          ("--warmup", "-1")):
        r = _pipe_bench(option, value)
        assert r.returncode == 2, (option, value, r.stdout[-500:], r.stderr[-2000:])
        assert f"argument {option}: must be >=" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_pipe_bench_checks_out_before_the_run(tmp_path):
    # a --out that cannot be a folder failed after the whole run, with a traceback (NotADirectoryError) and status 1
    (tmp_path / "afile").write_text("")
    r = _pipe_bench("--out", str(tmp_path / "afile" / "sub"), "--set", "model.name=/nonexistent/model")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert lines == [f"error: --out {tmp_path / 'afile' / 'sub'} cannot be created as a folder (a file stands at it "
                     "or above it); give another path"], r.stderr[-2000:]
    # a refused run leaves no empty --out behind
    r = _pipe_bench("--out", str(tmp_path / "new" / "out"), "--set", 'decoding.stop=["x"]')
    assert r.returncode == 2 and "decoding.stop is for launch/infer.py" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "new").exists()


def test_pipe_bench_takes_positional_overrides_as_the_other_programs_do():
    """README: any config value is overridden as ``section.key=value``; pipe_bench took them only after --set and
    stopped on ``unrecognized arguments: partition.num_stages=3``. Positional overrides go with --set's, anywhere."""
    r = _pipe_bench("decoding.max_new_tokens=4", "--num-prompts", "1", 'decoding.stop=["x"]')
    assert r.returncode == 2 and "unrecognized arguments" not in r.stderr, r.stderr[-2000:]
    assert "decoding.stop is for launch/infer.py" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = _pipe_bench("--set", "decoding.max_new_tokens=4", "decoding.max_new_tokns=4")
    assert r.returncode == 2 and "unknown config key 'decoding.max_new_tokns'" in r.stderr, r.stderr[-2000:]
