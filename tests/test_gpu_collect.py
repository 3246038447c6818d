"""scripts/gpu_collect.sh: what a detached job wrote, brought back within one device call's limits, once."""

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_collect.sh"


def _collect(work: Path, out: Path, *patterns: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(work), *patterns], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OUT=str(out), **env))


def _unpack(out: Path, dest: Path) -> dict[str, bytes]:
    """Join and unpack every collect_<N> archive under ``out`` into ``dest``; returns {relative path: content}."""
    parts = sorted(out.glob("collect_*.tgz.part-*"))
    for n in sorted({p.name.split(".")[0] for p in parts}):
        joined = dest.parent / f"{n}.tgz"
        joined.write_bytes(b"".join(p.read_bytes() for p in parts if p.name.startswith(n + ".")))
        with tarfile.open(joined) as tar:
            tar.extractall(dest, filter="data")
    return {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()}


def test_new_files_come_back_once_in_few_parts_and_changed_ones_again(tmp_path):
    work = tmp_path / "work"
    (work / "heads/a/best_head").mkdir(parents=True)
    (work / "out_a").mkdir()
    head = os.urandom(16_500_000)  # incompressible: two 15-MB parts
    (work / "heads/a/best_head/head.safetensors").write_bytes(head)
    (work / "out_a/log.txt").write_text("step 1\n")
    (work / "scratch.bin").write_bytes(b"not asked for")
    r = _collect(work, tmp_path / "o1", "heads/*", "out_*/log.txt")
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "o1").iterdir())
    assert files == ["collect_1.tgz.part-00", "collect_1.tgz.part-01", "collect_1.txt"]
    assert all(p.stat().st_size <= 15_000_000 for p in (tmp_path / "o1").iterdir())
    got = _unpack(tmp_path / "o1", tmp_path / "d1")
    assert got == {"heads/a/best_head/head.safetensors": head, "out_a/log.txt": b"step 1\n"}

    assert "nothing new" in _collect(work, tmp_path / "o2", "heads/*", "out_*/log.txt").stdout
    assert not list((tmp_path / "o2").glob("collect_*"))

    with open(work / "out_a/log.txt", "a") as f:
        f.write("step 2\n")
    os.utime(work / "out_a/log.txt", (1, 2_000_000_000))  # a later modification time, whatever the clock's grain
    r = _collect(work, tmp_path / "o3", "heads/*", "out_*/log.txt")
    assert "1 file(s)" in r.stdout
    assert _unpack(tmp_path / "o3", tmp_path / "d3") == {"out_a/log.txt": b"step 1\nstep 2\n"}


def test_what_does_not_fit_waits_for_the_next_call_and_a_file_too_large_is_named(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for i in range(3):
        (work / f"f{i}").write_bytes(bytes([i]) * 600_000)
        os.utime(work / f"f{i}", (1, 1_000_000_000 + i))  # oldest first: f0, f1, f2
    (work / "big").write_bytes(b"x" * 1_500_000)
    env = {"LIMIT_MB": "1"}
    r = _collect(work, tmp_path / "o1", **env)
    assert "never sent" in r.stdout and "big" in r.stdout
    assert "2 file(s) wait for the next call" in r.stdout
    assert set(_unpack(tmp_path / "o1", tmp_path / "d1")) == {"f0"}
    assert "wait for the next call" in (tmp_path / "o1/collect_1.txt").read_text()
    _collect(work, tmp_path / "o2", **env)
    _collect(work, tmp_path / "o3", **env)
    assert set(_unpack(tmp_path / "o2", tmp_path / "d2")) == {"f1"}
    assert set(_unpack(tmp_path / "o3", tmp_path / "d3")) == {"f2"}
    # RESET=1 sends everything again
    again = _collect(work, tmp_path / "o4", LIMIT_MB="5", RESET="1")
    assert set(_unpack(tmp_path / "o4", tmp_path / "d4")) == {"f0", "f1", "f2", "big"}, again.stdout


def test_usage_errors(tmp_path):
    assert _collect(tmp_path / "missing", tmp_path / "o").returncode == 2
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "OUT"})
    assert r.returncode == 2 and "OUT" in r.stderr
    assert _collect(tmp_path, tmp_path / "o", LIMIT_MB="lots").returncode == 2
