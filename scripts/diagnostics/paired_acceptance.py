#!/usr/bin/env python
"""Two heads on the same prompts: is the difference in draft acceptance larger than the prompt-to-prompt spread?

Reads suite (c)'s ``per_prompt.jsonl`` files (``launch/benchmark.py --suite c --out DIR`` writes
``DIR/c<n>/per_prompt.jsonl``; a run with ``--spd-head`` and ``--ppsd-head`` holds both methods in one file) and
prints, for methods A and B: pooled draft acceptance (accepted / verified drafts) and equivalent accept length
(L' = n·ΣN/ΣK, as suite (c)'s table) overall and per prompt set, then the per-prompt paired difference of draft
acceptance A - B: its mean, standard deviation, standard error, the prompts where A leads, and the spread of A's own
per-prompt acceptance. "Ahead by more than the prompt-to-prompt spread" is read as: mean difference > 2 standard errors.
Prompts where either method verified no draft are left out of the paired difference.

At T > 0 each head samples its own text, so one draw per prompt is noisy: a side may be several draws of the same
head (runs with different ``decoding.seed``) joined by commas; its figures are then pooled over the draws, per prompt
too (Σaccepted / Σdrafts of that prompt's draws), and the paired difference is taken on those per-prompt figures.

    python scripts/diagnostics/paired_acceptance.py runs/ev10_n3/c3/per_prompt.jsonl            # spd vs ppsd
    python scripts/diagnostics/paired_acceptance.py A/c2/per_prompt.jsonl B/c6/per_prompt.jsonl  # spd of each file
    python scripts/diagnostics/paired_acceptance.py A/c3/per_prompt.jsonl B/c3/per_prompt.jsonl \\
        --methods spd ppsd
    python scripts/diagnostics/paired_acceptance.py A_T1/c3/per_prompt.jsonl,A_T1_seed1/c3/per_prompt.jsonl \\
        B_T1/c3/per_prompt.jsonl,B_T1_seed1/c3/per_prompt.jsonl  # two draws a side
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


class RecordsError(ValueError):
    """A ``per_prompt.jsonl`` that cannot be read: missing, unreadable, or a line that is not a suite (c) record."""


def load(path: str) -> dict[str, dict[tuple[str, str], dict]]:
    """``{method: {(prompt_set, question_id): record}}`` of one ``per_prompt.jsonl``.

    Raises:
        RecordsError: the file is missing or unreadable, or a line is not JSON or lacks a record's fields.
    """
    out: dict[str, dict] = defaultdict(dict)
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    out[r["method"]][(r["prompt_set"], str(r["question_id"]))] = r
                except (ValueError, KeyError, TypeError) as e:
                    raise RecordsError(f"{path}, line {number}: not a suite (c) per-prompt record ({e!r}); give "
                                       "the per_prompt.jsonl that launch/benchmark.py --suite c wrote") from None
    except OSError as e:
        raise RecordsError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise RecordsError(f"{path} is not UTF-8 text; give the per_prompt.jsonl that launch/benchmark.py --suite c "
                           "wrote") from None
    return out


def load_draws(paths: str, method: str) -> dict[tuple[str, str], dict] | None:
    """``{(prompt_set, question_id): record}`` of ``method`` pooled over the comma-separated ``per_prompt.jsonl``
    files in ``paths`` (draws of one head; counts summed, ``draft_acceptance_rate`` recomputed); ``None`` if a file
    does not hold ``method``. Prompts missing from any draw are left out."""
    draws = []
    for path in paths.split(","):
        held = load(path)
        if method not in held:
            return None
        draws.append(held[method])
    keys = set(draws[0]).intersection(*draws[1:])
    out = {}
    for k in keys:
        recs = [d[k] for d in draws]
        r = dict(recs[0])
        for f in ("num_drafts", "num_accepted_tokens", "num_new_tokens", "num_cycles"):
            r[f] = sum(x[f] for x in recs)
        r["draft_acceptance_rate"] = r["num_accepted_tokens"] / r["num_drafts"] if r["num_drafts"] else 0.0
        out[k] = r
    return out


def pooled(recs) -> tuple[float, float]:
    """(draft acceptance, L') pooled over records: Σaccepted / Σdrafts and n·ΣN / ΣK (as suite (c)'s table)."""
    recs = list(recs)
    drafts = sum(r["num_drafts"] for r in recs)
    acc = sum(r["num_accepted_tokens"] for r in recs)
    n = recs[0]["num_stages"]
    return acc / max(1, drafts), n * sum(r["num_new_tokens"] for r in recs) / max(1, sum(r["num_cycles"] for r in recs))


def main(argv=None) -> int:
    """Print the per-method table and the paired difference; returns 0. Exits with argparse's usage error (status 2)
    for a missing or damaged file, a wrong number of files, a method a file does not hold, no shared prompt, or fewer
    than two prompts with drafts under both methods."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="one per_prompt.jsonl with two methods, or two files (A then B); "
                    "several draws of one side joined by commas")
    ap.add_argument("--methods", nargs=2, default=None, metavar=("A", "B"),
                    help="method A and method B (one file: default spd ppsd; two files: A of the first, B of the "
                         "second, default spd spd)")
    args = ap.parse_args(argv)
    if len(args.files) not in (1, 2):
        ap.error("give one file with two methods or two files")
    ma, mb = args.methods or (("spd", "ppsd") if len(args.files) == 1 else ("spd", "spd"))
    fa, fb = args.files[0], args.files[-1]
    sides = []
    for path, method in ((fa, ma), (fb, mb)):
        try:
            side = load_draws(path, method)
        except RecordsError as e:
            ap.error(str(e))
        if side is None:
            bad = next(p for p in path.split(",") if method not in load(p))
            ap.error(f"{bad} holds no method {method!r} (it holds {', '.join(sorted(load(bad)))}): pick one with "
                     "--methods")
        sides.append(side)
    a, b = sides
    la, lb = (ma, mb) if fa == fb else (f"{fa} ({ma})", f"{fb} ({mb})")
    keys = sorted(set(a) & set(b))
    if not keys:
        ap.error("the two methods share no prompt")
    paired = [k for k in keys if a[k]["num_drafts"] and b[k]["num_drafts"]]
    if len(paired) < 2:
        ap.error(f"{len(paired)} prompt(s) with drafts under both methods: the paired difference needs two or more")
    sets = sorted({k[0] for k in keys})
    print("| method | draft acc. | L' | " + " | ".join(f"{x}: acc. / L'" for x in sets) + " |")
    print("|---|---|---|" + "---|" * len(sets))
    for label, m in ((la, a), (lb, b)):
        cells = [pooled(m[k] for k in keys if k[0] == s) for s in sets]
        alpha, lp = pooled(m[k] for k in keys)
        print(f"| {label} | {alpha:.3f} | {lp:.3f} | " + " | ".join(f"{x:.3f} / {y:.3f}" for x, y in cells) + " |")
    diff = [a[k]["draft_acceptance_rate"] - b[k]["draft_acceptance_rate"] for k in paired]
    mean, sd = statistics.mean(diff), statistics.stdev(diff)
    se = sd / len(diff) ** 0.5
    spread = statistics.stdev(a[k]["draft_acceptance_rate"] for k in paired)
    lead = sum(d > 0 for d in diff)
    print(f"\nper-prompt paired difference A - B ({len(diff)} prompts): mean {mean:+.4f}, sd {sd:.4f}, "
          f"standard error {se:.4f} ({mean / se if se else float('inf'):+.1f} s.e.); A leads on {lead}, "
          f"B on {sum(d < 0 for d in diff)}; A's per-prompt acceptance spread (sd) {spread:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
