#!/usr/bin/env python
"""How much of the self-distilled training answers are loops: the share of answer tokens that close a 9-gram already
in the same answer (:func:`spd_ds.eval.report.repeat_flags`, the test behind ``repeated_ngram_share`` and the
validation's loop-free figures), by variant kind (greedy / sampled), over the whole answers and their first 128
tokens (the benchmark's answer length).

Usage (repo root)::

    python scripts/diagnostics/loop_shares.py runs/sd

Prints one line per kind. The loop figures of docs/training.md ("Validation", loops) came from it.
"""
from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sd_dir", help="a folder of self-distilled shards (launch/prepare_train_data.py selfdistill)")
    ap.add_argument("--head-tokens", type=int, default=128, help="also the share within each answer's first tokens")
    args = ap.parse_args(argv)

    from spd_ds.eval.report import REPEAT_NGRAM, repeat_flags
    from spd_ds.train.selfdistill.storage import read_items, shard_files

    greedy = json.loads(open(f"{args.sd_dir}/manifest.json").read())["variants"]["greedy"]
    stats: dict[str, list[int]] = {}  # kind -> [answers, tokens, positions, repeated, head positions, head repeated]
    for shard in shard_files(args.sd_dir):
        for item in read_items(shard):
            answer = item.tokens[item.prompt_len:].tolist()
            flags = repeat_flags(answer)
            s = stats.setdefault("greedy" if item.variant < greedy else "sampled", [0] * 6)
            s[0] += 1
            s[1] += len(answer)
            s[2] += max(0, len(answer) - REPEAT_NGRAM + 1)  # positions as repeated_ngram_share counts them
            s[3] += sum(flags)
            s[4] += max(0, min(len(answer), args.head_tokens) - REPEAT_NGRAM + 1)
            s[5] += sum(flags[:args.head_tokens])
    for kind, (n, tokens, pos, rep, head_pos, head_rep) in sorted(stats.items()):
        print(f"{kind}: {n} answers, mean {tokens / max(n, 1):.0f} tokens; tokens closing a repeated "
              f"{REPEAT_NGRAM}-gram: {rep / max(pos, 1):.3f} of all, {head_rep / max(head_pos, 1):.3f} within the "
              f"first {args.head_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
