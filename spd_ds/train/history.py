"""A head's training history across runs: how many optimizer steps lie behind a head checkpoint.

A run started from a trained head (``head.checkpoint``, a warm start) records that number as ``init_steps`` in its
``train_summary.json``, its checkpoints and its ``best_head/best.json``, so the history survives resumes and copies
and ``scripts/train_report.py`` can draw one training-token axis across warm starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from spd_ds.train.validate import BEST_FILE

SUMMARY_FILE = "train_summary.json"  # written by spd_ds.train.loop.train into the run directory


def read_train_log(path: str | os.PathLike) -> list[dict]:
    """The records of a run's ``train_log.jsonl`` (one JSON object per line), in order; a line that does not decode
    as a JSON object (the last one, cut short by a crash, or any damaged one) is left out. ``[]`` when the file does
    not exist."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def prior_steps(head_dir: str | os.PathLike) -> int | None:
    """Optimizer steps behind a head checkpoint, the steps of the head it started from included (``init_steps``).

    Read from the files training writes: ``best.json`` (step and ``init_steps``) in a ``best_head/``; for a run's final
    ``head/``, the run's ``train_summary.json`` (``steps`` + ``init_steps``); for a folder holding its own
    ``train_summary.json`` (the shipped heads: a best head copied with its run's summary), that summary's best step
    (else its ``steps``) + ``init_steps``. A run started with ``head.checkpoint`` records the result as
    ``init_steps``, so the training-token axis of ``scripts/train_report.py`` continues across warm starts.

    Returns:
        The number of steps, or ``None`` when the history is unknown: no such files, ``init_steps`` recorded as
        unknown (``null``), or unreadable / malformed files. Never raises (optional metadata must not stop a run).
    """
    d = Path(head_dir)
    try:
        best = json.loads((d / BEST_FILE).read_text()) if (d / BEST_FILE).exists() else None
        summary = next((f for f in (d / SUMMARY_FILE, d.parent / SUMMARY_FILE) if f.exists()), None)
        s = json.loads(summary.read_text()) if summary is not None else {}
        meta = best if best is not None and "init_steps" in best else s
        before = meta.get("init_steps", 0)
        if before is None:
            return None
        if best is not None:
            return int(best["step"]) + int(before)
        if summary is not None and summary.parent == d:
            return int((s.get("best") or {}).get("step", s["steps"])) + int(before)
        if summary is not None and d.name == "head":
            return int(s["steps"]) + int(before)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None

__all__ = ["SUMMARY_FILE", "prior_steps"]
