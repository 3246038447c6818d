"""scripts/gpu_detached.sh: a job that outlives the call that started it, waited for by later calls."""

import os
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_detached.sh"


def _run(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, WORK=str(work)))


def test_start_outlives_the_caller_and_wait_reports_the_exit_status(tmp_path):
    marker = tmp_path / "done"
    r = _run(tmp_path, "start", "job", "bash", "-c", f"sleep 2; echo 'a b'; touch {marker}; exit 3")
    assert r.returncode == 0 and "job started" in r.stdout
    assert not marker.exists()  # start returned at once
    again = _run(tmp_path, "start", "job", "touch", str(tmp_path / "second"))
    assert "still running" in again.stdout  # never a second job under one name
    early = _run(tmp_path, "wait", "job", "0")
    assert "still running" in early.stdout
    done = _run(tmp_path, "wait", "job", "30")
    assert "job ended: exit 3" in done.stdout and "a b" in done.stdout
    assert marker.exists() and not (tmp_path / "second").exists()
    # once ended, the name can start a new job
    r = _run(tmp_path, "start", "job", "true")
    assert "job started" in r.stdout
    t0 = time.time()
    assert "job ended: exit 0" in _run(tmp_path, "wait", "job", "30").stdout
    assert time.time() - t0 < 30


def test_usage_errors_and_unknown_names(tmp_path):
    assert _run(tmp_path, "start").returncode == 2
    assert _run(tmp_path, "start", "x").returncode == 2  # no command
    assert _run(tmp_path, "start", "../x", "true").returncode == 2
    assert _run(tmp_path, "bogus", "x").returncode == 2
    assert "left no exit status" in _run(tmp_path, "wait", "never", "0").stdout
