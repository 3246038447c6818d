"""``train.profile_steps``: what the profiler leaves in the run folder (spd_ds.train.profiling)."""

from __future__ import annotations

import gzip
import json

import torch

from spd_ds.train.profiling import start_profiler, write_profile


def test_profile_writes_both_tables_and_the_trace(tmp_path):
    prof = start_profiler(2, torch.device("cpu"))
    x = torch.randn(64, 64)
    for _ in range(8):  # 5 warm-up steps, then the 2 recorded ones
        (x @ x).softmax(-1).sum()
        prof.step()
    report = write_profile(prof, tmp_path)
    assert report.startswith("profile of ") and "trace.json.gz" in report
    for name in ("profile.txt", "profile_cpu.txt"):
        assert "aten::mm" in (tmp_path / name).read_text()
    trace = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])


def test_profile_failure_is_reported_not_raised(tmp_path):
    prof = start_profiler(1, torch.device("cpu"))
    report = write_profile(prof, tmp_path / "missing")  # no such folder: nothing can be written
    assert report.startswith("profile not written")
