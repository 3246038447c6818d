#!/usr/bin/env python
"""One line per training run: steps, tokens/s, the last logged loss and agreement by fill, and the validation figures
(predicted draft acceptance and equivalent accept length, best step) when the run logged them.

    python scripts/train_report.py runs/heads/smollm2_n2 [more runs] [--name label] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def report(run: Path) -> dict:
    """Figures of one run directory (``train_log.jsonl``, ``train_summary.json``)."""
    out: dict = {"run": str(run)}
    summ = run / "train_summary.json"
    if summ.exists():
        s = json.loads(summ.read_text())
        out.update({k: s.get(k) for k in ("steps", "total_steps", "finished", "elapsed_s", "tokens_per_s", "best")})
    log = run / "train_log.jsonl"
    recs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    train = [r for r in recs if "loss" in r]
    if train:
        last = train[-1]
        out["last"] = {k: last.get(k) for k in ("step", "loss", "top1_agreement", "agreement_by_fill", "lr")}
        rates = [r["tokens_per_s"] for r in train[1:]] or [train[0]["tokens_per_s"]]
        out["median_tokens_per_s"] = sorted(rates)[len(rates) // 2]
    vals = [r for r in recs if any(k.startswith("val_") for k in r)]
    if vals:
        out["val_last"] = {k: v for k, v in vals[-1].items() if k.startswith("val_") or k == "step"}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--name", default=None, help="label printed before the figures")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a line")
    args = ap.parse_args(argv)
    for run in args.runs:
        r = report(run)
        if args.json:
            print(json.dumps(r))
            continue
        last = r.get("last", {})
        print(f"{args.name or run.name}: steps {r.get('steps')}/{r.get('total_steps')} finished={r.get('finished')} "
              f"median {r.get('median_tokens_per_s', 0):,.0f} tok/s, loss {last.get('loss')}, "
              f"agree {last.get('top1_agreement')} by fill {last.get('agreement_by_fill')}; "
              f"val {r.get('val_last')}; best {r.get('best')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
