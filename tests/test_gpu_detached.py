"""scripts/gpu_detached.sh: a job that outlives the call that started it, waited for by later calls."""

import os
import signal
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_detached.sh"


def _run(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, WORK=str(work)))


def test_the_job_outlives_its_caller_and_wait_reports_its_exit_status(tmp_path):
    gate, marker = tmp_path / "gate", tmp_path / "done"
    job = f"while [ ! -f {gate} ]; do sleep 0.1; done; echo 'a b'; touch {marker}; exit 3"
    # the caller runs in a process group of its own, killed as a device call's command would be when it ends
    caller = subprocess.Popen(["bash", str(SCRIPT), "start", "job", "bash", "-c", job], start_new_session=True,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, WORK=str(tmp_path)))
    out, _ = caller.communicate(timeout=60)
    assert caller.returncode == 0 and "job started" in out
    try:
        os.killpg(caller.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing left in the caller's group: the job runs in its own session
    again = _run(tmp_path, "start", "job", "touch", str(tmp_path / "second"))
    assert "still running" in again.stdout  # never a second job under one name
    assert "still running" in _run(tmp_path, "wait", "job", "0").stdout
    gate.touch()
    done = _run(tmp_path, "wait", "job", "30")
    assert "job ended: exit 3" in done.stdout and "a b" in done.stdout
    assert marker.exists() and not (tmp_path / "second").exists()
    # once ended, the name can start a new job
    assert "job started" in _run(tmp_path, "start", "job", "true").stdout
    assert "job ended: exit 0" in _run(tmp_path, "wait", "job", "30").stdout


def test_usage_errors_and_unknown_names(tmp_path):
    assert _run(tmp_path, "start").returncode == 2
    assert _run(tmp_path, "start", "x").returncode == 2  # no command
    assert _run(tmp_path, "start", "../x", "true").returncode == 2
    assert _run(tmp_path, "bogus", "x").returncode == 2
    assert _run(tmp_path, "wait", "x", "5s").returncode == 2
    assert "left no exit status" in _run(tmp_path, "wait", "never", "0").stdout
