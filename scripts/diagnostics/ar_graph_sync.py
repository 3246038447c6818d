#!/usr/bin/env python
"""What ``ARGraphDecoder``'s ``sync_every`` is worth: the CUDA-graph AR at T = 0 launching 1, 4, 16 or 64 replays
between two reads of its tokens, on one GPU, the same prompts, with the same tokens required of every setting.

Each setting decodes every prompt ``--repeats`` times with one decoder (one capture); the table gives the decode rate
(tokens after the prefill token over ``decode_s``, summed over prompts; best and median repeat), the wasted replays
after an EOS inside a chunk are counted in it, and whether the tokens equal those of the first ``--sync`` setting
(``sync_every=1`` by default) on every prompt. Writes ``sync.md`` and ``sync.json`` to ``--out`` and prints the table.
``--sync`` and ``--sets`` take every value after them: give config overrides before them (or after ``--``).

Usage (GPU machine, repo root, model parts staged; ``runs/eval_sets`` carried, launch/prepare_eval_data.py)::

    PYTHONPATH=$PWD:$PYTHONPATH python scripts/diagnostics/ar_graph_sync.py --out $OUT/sync --eval-dir runs/eval_sets
    python scripts/diagnostics/ar_graph_sync.py --out /tmp/sync --eval-dir runs/eval_sets --num-prompts 1 \\
        --max-new-tokens 8 --repeats 1 model.device=cpu model.dtype=float32   # a dry run on CPU (no graph)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from spd_ds import builder
from spd_ds.config import load_config
from spd_ds.eval.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="launch/configs/smollm2_spd.yaml")
    ap.add_argument("--eval-dir", default="eval_data")
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"])
    ap.add_argument("--num-prompts", type=int, default=3, help="per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--sync", type=int, nargs="+", default=[1, 4, 16, 64], help="sync_every settings (>= 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch

    from spd_ds.decoding.ar_graph import ARGraphDecoder

    cfg = load_config(args.config, ["model.dtype=bfloat16", "partition.num_stages=2", "decoding.temperature=0",
                                    f"decoding.max_new_tokens={args.max_new_tokens}",
                                    f"decoding.max_length={args.max_length}", "head.checkpoint=null",
                                    *args.overrides])
    arch = builder.build_arch(cfg)
    tok = builder.load_tokenizer(arch)
    prompts = [builder.encode_prompt(tok, rec["turns"][0])
               for s in args.sets for rec in load_prompts(s, args.num_prompts, args.eval_dir)]
    part = builder.build_partition(cfg, arch)
    device = builder.resolve_device(cfg.model.device)
    target = builder.build_target(cfg, arch, part, device)
    eos, sampling = builder.eos_token_ids(cfg, arch, tok), builder.sampling_params(cfg)
    rows, tokens = [], {}
    for k in args.sync:
        dec = ARGraphDecoder(target, sampling, eos, cfg.decoding.max_length, sync_every=k)
        rates = []
        for _ in range(args.repeats):
            out = [dec.generate(p, cfg.decoding.max_new_tokens) for p in prompts]
            decoded = sum(len(r.tokens) - 1 for r in out)
            rates.append(decoded / max(sum(r.metrics.decode_s for r in out), 1e-9))
        tokens[k] = [r.tokens for r in out]
        rows.append({"sync_every": k, "graphed": dec.graphed,
                     "tok_s_best": max(rates), "tok_s_median": statistics.median(rates), "tokens": decoded})
        del dec
    ref = tokens[args.sync[0]]
    for row in rows:
        row["same_tokens"] = sum(a == b for a, b in zip(tokens[row["sync_every"]], ref))
    head = (f"# ar_graph sync_every ({cfg.model.dtype}, {device}, {len(prompts)} prompts x {args.max_new_tokens} new "
            f"tokens, {args.repeats} repeats)")
    lines = [head, "", f"| sync_every | decode tok/s, best | median | prompts with the tokens of sync_every="
             f"{args.sync[0]} |", "|---|---|---|---|"]
    lines += [f"| {r['sync_every']} | {r['tok_s_best']:.1f} | {r['tok_s_median']:.1f} | "
              f"{r['same_tokens']}/{len(prompts)} |" for r in rows]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sync.md").write_text("\n".join(lines) + "\n")
    (out_dir / "sync.json").write_text(json.dumps({"rows": rows, "device": str(device),
                                                   "gpu": torch.cuda.get_device_name() if device.type == "cuda"
                                                   else None}, indent=1))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
