"""spd_ds.compile_cache: what one process compiled loads into a fresh one (inductor on CPU, separate processes with
separate local caches, as on a fresh machine); a damaged or missing file is not an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys, torch
from spd_ds.compile_cache import load_compile_cache, save_compile_cache
mode, path = sys.argv[1], sys.argv[2]
loaded = load_compile_cache(path) if mode == "load" else 0
f = torch.compile(lambda x: torch.sin(x) * 2 + x.cos(), backend="inductor")
y = f(torch.arange(8, dtype=torch.float32))
saved = save_compile_cache(path + ".out" if mode == "load" else path)
print(loaded, saved, round(float(y.sum()), 5))
"""


def _run(mode: str, path: Path, cache_dir: Path) -> list[str]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split()


def test_save_then_load_in_a_fresh_process(tmp_path):
    path = tmp_path / "nested" / "cc.bin"
    loaded, saved, total = _run("save", path, tmp_path / "ind1")
    assert loaded == "0" and int(saved) > 0 and path.stat().st_size == int(saved)
    loaded2, saved2, total2 = _run("load", path, tmp_path / "ind2")  # a new local cache: only the file carries it
    assert int(loaded2) > 0 and total2 == total and int(saved2) > 0


def test_missing_none_and_damaged_files(tmp_path, caplog):
    from spd_ds.compile_cache import load_compile_cache, save_compile_cache

    assert load_compile_cache(None) == 0 and load_compile_cache(tmp_path / "nope.bin") == 0
    assert save_compile_cache(None) == 0
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a cache")
    assert load_compile_cache(bad) == 0
    assert "not loaded" in caplog.text


def test_a_failed_save_is_a_warning(tmp_path, caplog):
    """A destination that cannot be written (here a directory) loses the cache, never the run."""
    import torch

    from spd_ds.compile_cache import save_compile_cache

    torch.compile(lambda x: x * 3 + 1, backend="inductor")(torch.ones(4))  # something to save
    (tmp_path / "cc.bin").mkdir()
    assert save_compile_cache(tmp_path / "cc.bin") == 0
    assert "not saved" in caplog.text and not [f.name for f in tmp_path.iterdir() if ".tmp" in f.name]


def test_a_compile_cache_whose_folder_takes_no_file_is_refused_at_the_start(tmp_path):
    """save_compile_cache replaces the file through a temporary file beside it: an existing, writable file in a folder
    that takes no new file (here /proc, which root may 'write' by access() but where nothing can be created) passed
    the start-of-run check and lost the run's kernels at its end ('0 bytes saved'). Training's and selfdistill's
    checks now try the folder too."""
    import pytest

    from spd_ds.compile_cache import check_compile_cache_path
    from spd_ds.config import ConfigError, load_config
    from spd_ds.train.preflight import check_train_settings

    if not os.path.isfile("/proc/version"):
        pytest.skip("needs Linux's /proc")
    with pytest.raises(ConfigError, match=r"^train.compile_cache.* /proc"):
        check_train_settings(load_config(None, ["train.compile_cache=/proc/version"]), 1, "cpu")
    with pytest.raises(ConfigError, match=r"^--compile-cache.* /proc"):
        check_compile_cache_path("/proc/version", "--compile-cache")
    (tmp_path / "cc.bin").write_bytes(b"x")  # an existing file in a writable folder, and a new one: fine
    check_compile_cache_path(tmp_path / "cc.bin", "--compile-cache")
    check_compile_cache_path(tmp_path / "new" / "cc.bin", "--compile-cache")
    assert (tmp_path / "new").is_dir()


def test_an_interrupted_save_leaves_no_temporary_file_and_a_private_file_stays_private(tmp_path, monkeypatch):
    """save_compile_cache writes through spd_ds.files.replaced_when_done: Ctrl-C while the bytes were written left
    '.cc.bin.<pid>.tmp' beside the file (only an OSError removed it), and a cache file made private (0600) became
    0644 when a run replaced it. Now the temporary file goes whatever stops the write, the earlier file stays whole,
    and a replaced file keeps its permission bits."""
    import pathlib

    import pytest
    import torch

    from spd_ds.compile_cache import save_compile_cache

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"new kernels", None))
    dest = tmp_path / "cc.bin"
    dest.write_bytes(b"old kernels")
    dest.chmod(0o600)
    real_write_bytes = pathlib.Path.write_bytes

    def interrupted(self, data):
        real_write_bytes(self, data[:3])
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_bytes", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_compile_cache(dest)
    assert [f.name for f in tmp_path.iterdir()] == ["cc.bin"] and dest.read_bytes() == b"old kernels"
    assert save_compile_cache(dest) == len(b"new kernels") and dest.read_bytes() == b"new kernels"
    assert dest.stat().st_mode & 0o777 == 0o600 and [f.name for f in tmp_path.iterdir()] == ["cc.bin"]
