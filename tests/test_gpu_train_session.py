"""scripts/gpu_train_session.sh, step 3 (FETCH=1): what a session returns of its torch.compile caches.

The session runs for real in a scratch directory, on a run that has already finished (no trainer starts) and with a
stand-in for python (``PYTHON=true``), so only the shell's own logic is under test."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_train_session.sh"


def _session(tmp_path, rc=0, **env):
    """Run the session on the finished run ``n2`` with one 2 MB cache in runs/compile_cache; checks its exit status is
    ``rc``; returns OUT's file names and its log."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "heads" / "n2").mkdir(parents=True, exist_ok=True)
    (work / "heads" / "n2" / "train_summary.json").write_text('{"finished": true}')
    (tmp_path / "runs" / "compile_cache").mkdir(parents=True, exist_ok=True)
    (tmp_path / "runs" / "compile_cache" / "train_n2.bin").write_bytes(os.urandom(2_000_000))
    (tmp_path / "data.jsonl").write_text("")
    out.mkdir(exist_ok=True)
    r = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON="true", WORK=str(work), OUT=str(out), FETCH="1",
                                SPD_TRAIN_DATA=str(tmp_path / "data.jsonl"), VARIANTS="n2:partition.num_stages=2",
                                **env))
    assert r.returncode == rc, r.stderr
    return sorted(p.name for p in out.iterdir()), (out / "log.txt").read_text()


def test_fetch_returns_the_compile_caches_gzipd_unless_told_not_to(tmp_path):
    files, log = _session(tmp_path)
    assert "n2 finished" in log and "heads.tgz.part-00" in files
    assert "compile_cache.tgz.part-00" in files and "compile caches (" in log  # returned by default
    for f in files:
        if f.startswith("compile_cache.tgz.part-"):
            os.remove(tmp_path / "out" / f)
    files, log = _session(tmp_path, CACHE_RETURN_MB="0")  # gpu_continue_heads.sh returns one per base itself
    assert not [f for f in files if f.startswith("compile_cache")]
    assert "compile caches: kept in runs/compile_cache, not returned (CACHE_RETURN_MB=0)" in log
    files, log = _session(tmp_path, CACHE_RETURN_MB="1")  # over the limit (2 MB of random bytes stays ~2 MB)
    assert not [f for f in files if f.startswith("compile_cache")] and "over CACHE_RETURN_MB=1: not returned" in log


def test_a_bad_cache_return_limit_is_refused_before_any_work(tmp_path):
    for bad in ("45MB", "-1", "08"):  # "08" would be an octal error in bash arithmetic, after the training
        files, log = _session(tmp_path, rc=2, CACHE_RETURN_MB=bad)
        assert f"error: CACHE_RETURN_MB must be a whole number of MB (0 = no caches returned), got '{bad}'" in log
        assert not [f for f in files if f.startswith(("heads", "compile_cache"))]  # stopped before step 3
