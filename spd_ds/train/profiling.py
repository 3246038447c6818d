"""``train.profile_steps``: a ``torch.profiler`` run over a few training steps and what it leaves in the run folder.

``profile.txt`` (the 40 costliest operators by device time on CUDA, else CPU time), ``profile_cpu.txt`` (the same by
host time: what the launching thread spends per operator) and ``trace.json.gz`` (the Chrome trace of the profiled
steps, for chrome://tracing or Perfetto: where the device idles between kernels and why). On CUDA the warm-up and
recorded steps also run under ``torch.cuda.set_sync_debug_mode("warn")`` (switched off when the recorded steps end):
every operation that makes the host wait for the device warns once per source line, so the run's log names each
host sync of a step.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

import torch


def start_profiler(steps: int, device: torch.device):
    """A started ``torch.profiler.profile`` that records ``steps`` steps after 5 warm-up steps (CPU + CUDA); on CUDA,
    host syncs warn from now until the recorded steps end.

    Args:
        steps: training steps to record (each ends with the profiler's ``step()``).
        device: the training device (CUDA adds device activity and the sync-debug mode).
    Returns:
        the started ``torch.profiler.profile``; pass it to :func:`write_profile` when the run ends.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts, schedule=schedule(wait=0, warmup=5, active=int(steps), repeat=1),
                   on_trace_ready=(lambda _: torch.cuda.set_sync_debug_mode("default")) if cuda else None)
    prof.start()
    return prof


def write_profile(prof, out_dir: Path) -> str:
    """Stop ``prof`` and write ``profile.txt``, ``profile_cpu.txt`` and ``trace.json.gz`` under ``out_dir``.

    Returns:
        a one-line report for the log: the files written, or why not. Never raises: profiling must not fail a run.
    """
    prof.stop()
    if torch.cuda.is_available():  # a run that ended inside the recorded steps
        torch.cuda.set_sync_debug_mode("default")
    written: list[Path] = []
    try:
        avg = prof.key_averages()
        device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        for name, key in (("profile.txt", device_key), ("profile_cpu.txt", "self_cpu_time_total")):
            try:
                table = avg.table(sort_by=key, row_limit=40)
            except Exception:  # noqa: BLE001 - older torch names the device column differently
                table = avg.table(sort_by="self_device_time_total", row_limit=40)
            (out_dir / name).write_text(table)
            written.append(out_dir / name)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(out_dir / "trace.json.gz", "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            written.append(out_dir / "trace.json.gz")
        events = len(prof.profiler.function_events) if prof.profiler else 0
        return f"profile of {events} events -> {', '.join(str(p) for p in written)}"
    except Exception as e:  # noqa: BLE001 - profiling must never fail a training run
        return f"profile not written ({', '.join(p.name for p in written) or 'nothing'} was): {type(e).__name__}: {e}"
