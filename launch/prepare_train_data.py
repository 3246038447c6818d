#!/usr/bin/env python
"""Prepare head-training data files: export conversations, or regenerate answers with the target.

Examples::

    # the offline ShareGPT (registry package) -> the first 6000 usable conversations, small enough to carry
    python launch/prepare_train_data.py export --data sharegpt --limit 6000 --out runs/train_data/sharegpt6k.jsonl.gz

    # answer each conversation's first user turn with the target itself (GPU; batched generate)
    python launch/prepare_train_data.py regenerate --model smollm2-135m-instruct \\
        --data runs/train_data/sharegpt6k.jsonl.gz --out runs/train_data/regen.jsonl.gz --time-budget 150

``export`` writes ``{"messages": [{role, content}, ...]}`` JSON lines (gzipped, deterministic bytes); ``regenerate``
writes pre-tokenised ``{"input_ids", "assistant_mask"}`` lines. Both are valid ``data.train_files`` entries.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's spd_ds, even if another is installed


def _export(args) -> int:
    from spd_ds.train.data import load_records, write_jsonl_gz

    recs = load_records(args.data, limit=args.limit)
    if args.max_chars:
        recs = [_clip(r, args.max_chars) for r in recs]
    n = write_jsonl_gz(recs, args.out)
    print(f"prepare_train_data: {n} conversations -> {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)",
          file=sys.stderr)
    return 0


def _clip(rec: dict, max_chars: int) -> dict:
    """Keep whole turns while the conversation stays under ``max_chars`` characters (always the first exchange)."""
    if "messages" not in rec:
        return rec
    out, total = [], 0
    for m in rec["messages"]:
        total += len(m["content"])
        if total > max_chars and any(x["role"] == "assistant" for x in out):
            break
        out.append(m)
    return {"messages": out}


def _regenerate(args) -> int:
    import torch

    from spd_ds.builder import load_tokenizer
    from spd_ds.train.chat import set_chat_template
    from spd_ds.train.data import load_records, write_jsonl_gz
    from spd_ds.train.regenerate import regenerate_records
    from spd_ds.zoo import resolve_model

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    set_chat_template(tok, args.chat_template)
    recs = load_records(args.data, limit=args.limit)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[args.dtype]
    eos = [tok.eos_token_id]
    t0 = time.perf_counter()
    out = regenerate_records(recs, model_dir, tok, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             sample_fraction=args.sample_fraction, batch_size=args.batch_size,
                             max_prompt_tokens=args.max_prompt_tokens, dtype=dtype, time_budget_s=args.time_budget,
                             seed=args.seed, eos_token_ids=eos)
    dt = time.perf_counter() - t0
    n = write_jsonl_gz(out, args.out)
    gen = sum(sum(r["assistant_mask"]) for r in out)
    ended = sum(r["input_ids"][-1] in eos for r in out)
    print(f"prepare_train_data: regenerated {n} answers ({gen} tokens, {ended} ended with EOS) in {dt:.0f} s, "
          f"{gen / max(dt, 1e-9):.0f} generated tokens/s -> {args.out}", file=sys.stderr)
    return 0 if n else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="normalise conversations into one gzipped JSON-lines file")
    ex.add_argument("--data", action="append", default=None, help="source (default: sharegpt); repeatable")
    ex.add_argument("--limit", type=int, default=6000, help="conversations to keep (default: %(default)s)")
    ex.add_argument("--max-chars", type=int, default=None, help="drop turns past this many characters")
    ex.add_argument("--out", default="runs/train_data/sharegpt6k.jsonl.gz")
    rg = sub.add_parser("regenerate", help="answer first user turns with the target (pre-tokenised output)")
    rg.add_argument("--model", default="smollm2-135m-instruct")
    rg.add_argument("--data", action="append", required=True, help="conversation source; repeatable")
    rg.add_argument("--out", required=True)
    rg.add_argument("--limit", type=int, default=None)
    rg.add_argument("--max-new-tokens", type=int, default=512)
    rg.add_argument("--max-prompt-tokens", type=int, default=512)
    rg.add_argument("--batch-size", type=int, default=256)
    rg.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    rg.add_argument("--sample-fraction", type=float, default=None,
                    help="share of prompts sampled at --temperature (1.0 if 0); the rest greedy")
    rg.add_argument("--time-budget", type=float, default=None, help="stop starting batches after this many seconds")
    rg.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    rg.add_argument("--chat-template", default=None)
    rg.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "export":
        args.data = args.data or ["sharegpt"]
        return _export(args)
    return _regenerate(args)


if __name__ == "__main__":
    sys.exit(main())
