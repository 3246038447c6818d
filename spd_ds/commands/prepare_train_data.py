"""Prepare head-training data files: export conversations or prompts, regenerate or self-distil answers.

Examples::

    # the offline ShareGPT (registry package) -> the first 6000 usable conversations, small enough to carry
    python launch/prepare_train_data.py export --data sharegpt --limit 6000 --out runs/train_data/sharegpt6k.jsonl.gz

    # answer each conversation's first user turn with the target itself (GPU; batched generate)
    python launch/prepare_train_data.py regenerate --model smollm2-135m-instruct \\
        --data runs/train_data/sharegpt6k.jsonl.gz --out runs/train_data/regen.jsonl.gz --time-budget 150

    # only what the GPU needs to self-distil: the system/user turns of every usable ShareGPT conversation
    python launch/prepare_train_data.py export-prompts --out runs/train_data/sharegpt_prompts.jsonl.gz

    # the target answers every user turn (rounds; its own earlier answers as context), greedy + 2 samples at T=1,
    # into resumable .npz shards + manifest.json (GPU: batched HF generate with a static cache)
    python launch/prepare_train_data.py selfdistill --model smollm2-135m-instruct \
        --data runs/train_data/sharegpt_prompts.jsonl.gz --out runs/sd --greedy 1 --samples 2 --time-budget 200

``export`` writes ``{"messages": [{role, content}, ...]}`` JSON lines (deterministic bytes; gzipped when ``--out``
ends in ``.gz``, as with ``regenerate`` and ``export-prompts``); ``regenerate`` writes pre-tokenised ``{"input_ids",
"assistant_mask"}`` lines (with the source's ``conv_id``); ``selfdistill`` writes a directory of shards
(``spd_ds.train.selfdistill``). All are valid ``data.train_files`` entries;
``export-prompts`` writes ``{"id", "rounds"}`` lines, input for ``selfdistill`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path



_EXPORT_LIMIT = 6000  # export's default --limit


def _export(args) -> int:
    from spd_ds.train.data import load_records, write_jsonl

    recs = load_records(args.data, limit=args.limit + 1)  # one more: whether --limit cut the sources short
    cut = len(recs) > args.limit
    recs = recs[:args.limit]
    if args.max_chars is not None:
        recs = [_clip(r, args.max_chars) for r in recs]
    n = write_jsonl(recs, args.out)
    limit = f"--limit {args.limit}{' (the default)' if args.limit == _EXPORT_LIMIT else ''}"
    print(f"prepare_train_data: {n} conversations -> {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)"
          + (f"; stopped at {limit}, the sources hold more (raise --limit to keep them)" if cut else ""),
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
    return {**rec, "messages": out}  # the rest (conv_id: the held-out split keys on it) as it was


def _regenerate(args) -> int:
    import torch

    from spd_ds.builder import load_tokenizer
    from spd_ds.train.chat import set_chat_template
    from spd_ds.train.data import load_records, write_jsonl
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
    if not out:  # nothing to write: an earlier file at --out stays as it was
        print(f"prepare_train_data: regenerated 0 answers of {len(recs)} records (none with a first user turn within "
              f"--max-prompt-tokens {args.max_prompt_tokens}, or --time-budget ended first); {args.out} not written",
              file=sys.stderr)
        return 1
    n = write_jsonl(out, args.out)
    gen = sum(sum(r["assistant_mask"]) for r in out)
    ended = sum(r["input_ids"][-1] in eos for r in out)
    print(f"prepare_train_data: regenerated {n} answers ({gen} tokens, {ended} ended with EOS) in {dt:.0f} s, "
          f"{gen / max(dt, 1e-9):.0f} generated tokens/s -> {args.out}", file=sys.stderr)
    return 0 if n else 1


def _export_prompts(args) -> int:
    from spd_ds.train.selfdistill import load_prompt_conversations, write_prompts

    convs = load_prompt_conversations(args.data, limit=args.limit)
    read = len(convs)
    if args.max_turn_chars:
        convs = [c for c in (_clip_rounds(c, args.max_turn_chars) for c in convs) if c.rounds]
    if not convs:  # nothing to write: an earlier file at --out stays as it was
        print(f"prepare_train_data: kept 0 of {read} conversations (each first turn is longer than --max-turn-chars "
              f"{args.max_turn_chars}); {args.out} not written", file=sys.stderr)
        return 1
    n = write_prompts(convs, args.out)
    turns = sum(len(c.rounds) for c in convs)
    print(f"prepare_train_data: {n} conversations, {turns} user turns -> {args.out} "
          f"({Path(args.out).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def _clip_rounds(conv, max_chars: int):
    """Keep the rounds before the first one whose text exceeds ``max_chars`` (it would not fit a prompt anyway)."""
    keep = []
    for r in conv.rounds:
        if sum(len(m["content"]) for m in r) > max_chars:
            break
        keep.append(r)
    conv.rounds = keep
    return conv


def _selfdistill(args) -> int:
    import signal

    import torch

    from spd_ds.builder import load_tokenizer
    from spd_ds.compile_cache import load_compile_cache, save_compile_cache
    from spd_ds.train.chat import set_chat_template
    from spd_ds.train.selfdistill import (
        SelfDistillConfig, load_prompt_conversations, run_selfdistill, throughput_table,
    )
    from spd_ds.zoo import resolve_model

    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: flush the finished answers on the way out
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # prompts are batch-encoded here; nothing forks afterwards
    cfg = SelfDistillConfig(
        greedy=args.greedy, samples=args.samples, temperature=args.temperature, seed=args.seed,
        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, max_rounds=args.max_rounds,
        batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, chunk_new_tokens=args.chunk_new_tokens,
        min_alive=args.min_alive, wave_conversations=args.wave_conversations, cache=args.cache,
        compile=not args.no_compile, attention=args.attention, cache_quantum=args.cache_quantum,
        time_budget_s=args.time_budget, shard_bytes=args.shard_bytes, flush_every_s=args.flush_every)
    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    set_chat_template(tok, args.chat_template)
    convs = load_prompt_conversations(args.data, limit=args.limit)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[args.dtype]
    print(f"prepare_train_data: self-distilling {len(convs)} conversations "
          f"({sum(len(c.rounds) for c in convs)} user turns) x {cfg.num_variants} answers with {args.model} "
          f"-> {args.out}", file=sys.stderr)
    if args.compile_cache:
        print(f"prepare_train_data: compile cache {args.compile_cache}: {load_compile_cache(args.compile_cache)} "
              "artifacts loaded", file=sys.stderr)
    try:
        run = run_selfdistill(convs, model_dir, tok, args.out, cfg, device=args.device, dtype=dtype,
                              source=args.data, model_name=args.model, t_start=t0)
    finally:  # also after SIGTERM: what compiled so far is kept
        if args.compile_cache:
            print(f"prepare_train_data: compile cache {args.compile_cache}: "
                  f"{save_compile_cache(args.compile_cache)} bytes saved", file=sys.stderr)
    print(throughput_table(run), file=sys.stderr)
    tot = run["totals"]
    print(f"prepare_train_data: selfdistill generated {run['answers']} answers, {run['generated_tokens']} tokens in "
          f"{run['wall_s']:.0f} s = {run['generated_tokens_per_s']:.0f} generated tokens/s; {args.out} now holds "
          f"{tot['records']} records, {tot['tokens']} tokens ({tot['assistant_tokens']} answer tokens), "
          f"{tot['bytes'] / 1e6:.1f} MB in shards", file=sys.stderr)
    stopped = run.get("chains_stopped", {})
    if stopped:  # answer chains (conversation x variant) that end before their last user turn, by cause (manifest too)
        print("prepare_train_data: answer chains stopped early: " + ", ".join(f"{n} {k.replace('_', ' ')}"
              for k, n in sorted(stopped.items())) + (f" (prompt too long: over --max-prompt-tokens "
              f"{args.max_prompt_tokens})" if stopped.get("prompt_too_long") else ""), file=sys.stderr)
    return 0 if tot["items"] else 1


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand (module docstring; ``--help`` documents each). Exit status 0 on success, 1 when nothing
    was produced, 2 after a user error (one line: arguments, data, model, chat template, output path, a resumed
    self-distillation's settings)."""
    from spd_ds.cli import data_user_errors, run_cli

    return run_cli(_main, argv, user_errors=data_user_errors, prog="prepare_train_data")


def build_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`: one subcommand per output kind, every option documented in ``--help``."""
    from spd_ds.cli import add_version_argument, float_in, int_at_least
    from spd_ds.cli_args import torch_device

    pos, nonneg = int_at_least(1), int_at_least(0)
    model_help = "the target: a model name spd-ds knows or a Hugging Face model folder (default: %(default)s)"
    template_help = "a Jinja chat template (text or a file) in place of the tokenizer's own (needed where it has none)"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_version_argument(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="normalise conversations into one JSON-lines file")
    ex.add_argument("--data", action="append", default=None, help="source (default: sharegpt); repeatable")
    ex.add_argument("--limit", type=pos, default=_EXPORT_LIMIT, help="conversations to keep (default: %(default)s)")
    ex.add_argument("--max-chars", type=pos, default=None,
                    help="drop the turns past this many characters of a conversation (its first exchange is always "
                         "kept; default: no limit)")
    ex.add_argument("--out", default="runs/train_data/sharegpt6k.jsonl.gz",
                    help="the JSON-lines file written, gzipped if it ends in .gz (default: %(default)s)")
    rg = sub.add_parser("regenerate", help="answer first user turns with the target (pre-tokenised output)")
    rg.add_argument("--model", default="smollm2-135m-instruct", help=model_help)
    rg.add_argument("--data", action="append", required=True, help="conversation source; repeatable")
    rg.add_argument("--out", required=True,
                    help="the JSON-lines file written (pre-tokenised answers), gzipped if it ends in .gz")
    rg.add_argument("--limit", type=pos, default=None, help="conversations read at most (default: all)")
    rg.add_argument("--max-new-tokens", type=pos, default=512, help="longest answer (default: %(default)s)")
    rg.add_argument("--max-prompt-tokens", type=pos, default=512,
                    help="first user turns with a longer prompt are skipped (default: %(default)s)")
    rg.add_argument("--batch-size", type=pos, default=256, help="prompts per generate call (default: %(default)s)")
    rg.add_argument("--temperature", type=float_in(0.0), default=0.0, help="0 = greedy")
    rg.add_argument("--sample-fraction", type=float_in(0.0, 1.0), default=None,
                    help="share of prompts sampled (at --temperature, or at 1.0 when --temperature is 0); the rest "
                         "greedy")
    rg.add_argument("--time-budget", type=float_in(0.0, above=True), default=None,
                    help="stop starting batches after this many seconds")
    rg.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    rg.add_argument("--chat-template", default=None, help=template_help)
    rg.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    ep = sub.add_parser("export-prompts", help="only the system/user turns, grouped in rounds (input of selfdistill)")
    ep.add_argument("--data", action="append", default=None, help="source (default: sharegpt); repeatable")
    ep.add_argument("--limit", type=pos, default=None, help="conversations to keep (default: all)")
    ep.add_argument("--max-turn-chars", type=nonneg, default=32000,
                    help="end a conversation before a turn longer than this (it would not fit a prompt); 0 = no limit")
    ep.add_argument("--out", default="runs/train_data/sharegpt_prompts.jsonl.gz",
                    help="the JSON-lines file written, gzipped if it ends in .gz (default: %(default)s)")
    sd = sub.add_parser("selfdistill", help="the target answers every user turn (rounds) into resumable shards")
    sd.add_argument("--model", default="smollm2-135m-instruct", help=model_help)
    sd.add_argument("--data", action="append", required=True,
                    help="prompts (export-prompts output) or any conversation source; repeatable")
    sd.add_argument("--out", required=True, help="output directory (shards + manifest.json); reruns resume it")
    sd.add_argument("--limit", type=pos, default=None, help="conversations (default: all)")
    sd.add_argument("--greedy", type=nonneg, default=1, help="1 = one greedy answer per turn, 0 = none")
    sd.add_argument("--samples", type=nonneg, default=2, help="sampled answers per turn (at --temperature)")
    sd.add_argument("--temperature", type=float, default=1.0, help="of the sampled answers (default: %(default)s)")
    sd.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    sd.add_argument("--max-new-tokens", type=pos, default=768, help="longest answer (cut answers end the chain)")
    sd.add_argument("--max-prompt-tokens", type=pos, default=2048, help="turns with a longer prompt are not asked")
    sd.add_argument("--max-rounds", type=pos, default=None, help="user turns per conversation at most")
    sd.add_argument("--batch-size", type=pos, default=1024, help="rows per generate call at most")
    sd.add_argument("--max-batch-tokens", type=pos, default=1024 * 1280,
                    help="rows x static-cache length per call at most (long prompts get fewer rows)")
    sd.add_argument("--chunk-new-tokens", type=pos, default=256,
                    help="new tokens per generate call; unfinished answers continue in a later call")
    sd.add_argument("--min-alive", type=float, default=0.25,
                    help="end a call once fewer than this share of its rows still generate (they continue later)")
    sd.add_argument("--wave-conversations", type=pos, default=4096,
                    help="conversations tokenised and length-sorted together")
    sd.add_argument("--cache", choices=["static", "dynamic"], default="static",
                    help="the KV cache of generate: static (compiled, CUDA graphs on a GPU) or dynamic (default: "
                         "%(default)s)")
    sd.add_argument("--no-compile", action="store_true", help="no torch.compile of the decode step (static cache)")
    sd.add_argument("--compile-cache", default=None,
                    help="file of torch.compile artifacts: loaded before the first compile, rewritten at the end "
                         "(carry it to the next machine of the same kind; spd_ds/compile_cache.py)")
    sd.add_argument("--attention", choices=["gqa-decode", "sdpa"], default="gqa-decode",
                    help="gqa-decode: SDPA without repeat_kv for the decode step (default); sdpa: transformers' own")
    sd.add_argument("--cache-quantum", type=pos, default=128,
                    help="static cache = longest prompt rounded to a power of two up to this, a multiple above")
    sd.add_argument("--time-budget", type=float_in(0.0, above=True), default=None,
                    help="stop starting generate calls after this many s")
    sd.add_argument("--shard-bytes", type=pos, default=12_000_000, help="uncompressed bytes per shard at most")
    sd.add_argument("--flush-every", type=float_in(0.0, above=True), default=60.0,
                    help="write finished answers at least this often (s)")
    sd.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    sd.add_argument("--device", type=torch_device, default=None,
                    help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    sd.add_argument("--chat-template", default=None, help=template_help)
    return ap


def _main(argv: list[str] | None = None) -> int:
    from spd_ds.cli import check_output_file, ensure_output_dir, removed_if_left_empty
    from spd_ds.compile_cache import check_compile_cache_path

    args = build_parser().parse_args(argv)
    out_dir = args.out if args.cmd == "selfdistill" else os.path.dirname(os.path.abspath(args.out))
    cache = getattr(args, "compile_cache", None)  # selfdistill's; its folder is made at the start too
    with (removed_if_left_empty(out_dir),  # a refused run leaves no empty output folder behind
          removed_if_left_empty(os.path.dirname(os.path.abspath(cache))) if cache else contextlib.nullcontext()):
        if args.cmd == "selfdistill":  # before the model loads: a bad output path fails now, not after generating
            ensure_output_dir(args.out, "--out")
            if cache:  # written at the end: a folder, or a path it cannot be written to, lost the compiled kernels
                check_compile_cache_path(cache, "--compile-cache")
        else:
            check_output_file(args.out, "--out")
        if getattr(args, "chat_template", None):  # regenerate's, selfdistill's: before the model resolves and loads
            from spd_ds.train.chat import read_chat_template

            read_chat_template(args.chat_template)
        if args.cmd in ("export", "export-prompts"):
            args.data = args.data or ["sharegpt"]
            return _export(args) if args.cmd == "export" else _export_prompts(args)
        if args.cmd == "selfdistill":
            return _selfdistill(args)
        return _regenerate(args)


if __name__ == "__main__":
    sys.exit(main())
