"""SPD against AR through the same DeepSpeed pipeline: token equality and speed.

Run on every rank, like ``launch/infer.py``::

    deepspeed --num_gpus 2 --module spd_ds.commands.pipe_bench --config EXP.yaml --set partition.num_stages=2 \\
        --set model.dtype=bfloat16 --max-new-tokens 128 --out runs/pipe_bench

``section.key=value`` overrides may also stand alone, before or after the options, as in ``launch/infer.py``.

For each prompt the head rank runs AR through the pipeline (every token crosses all stages: same stage code, same
kernels, same CUDA graphs as SPD's stages) and then SPD; at temperature 0 the tokens must be equal, and the first
divergence is reported if they are not. ``--single-ar`` also runs the single-process eager AR decoder afterwards
(a different computation at bf16: its first divergence is informational). Writes ``<out>/pipe_bench.json`` and
prints one line per prompt and a summary (decode tok/s, time split). Exit status 1 when SPD and the pipeline AR
differ at T = 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from spd_ds.cli import ExperimentParser, add_version_argument, int_at_least
from spd_ds.cli_args import GivenOnce
from spd_ds.eval.prompts import DEMO_PROMPTS as PROMPTS


def main(argv=None) -> int:
    """Run on every rank: SPD and AR through the same pipeline, compared token for token; writes the timings. A user
    error (config, prompts, head, world size) is one line and exit status 2 (``spd_ds.cli.run_cli``)."""
    from spd_ds.cli import decoding_user_errors, run_cli

    return run_cli(_main, argv, user_errors=decoding_user_errors, prog="pipe_bench")


def _main(argv=None) -> int:
    ap = ExperimentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version_argument(ap)
    ap.add_argument("--config", default=None, action=GivenOnce, help="experiment YAML")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, as the other programs take them "
                    "(before or after the options; the same as --set)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--prompts", default=None, help="prompt set name or EAGLE jsonl (default: 5 built-in prompts)")
    ap.add_argument("--num-prompts", type=int_at_least(1), default=5, help="prompts to run (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                    help="new tokens per prompt (default: decoding.max_new_tokens)")
    ap.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed SPD+AR runs of the first prompt")
    ap.add_argument("--single-ar", action="store_true", help="also run the single-process AR decoder (head rank)")
    ap.add_argument("--out", default=None, help="output directory (head rank writes pipe_bench.json)")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = ap.parse_args(argv)
    from spd_ds.cli import checks_outputs, ensure_output_dir, removed_if_left_empty, setup_logging, setup_process

    setup_logging()
    setup_process()  # CPU threads per rank, the launcher watch (as launch/infer.py)
    if args.out is None:
        return _run(args)
    with removed_if_left_empty(args.out):  # a refused run leaves no empty --out behind
        if checks_outputs():  # before any model loads, not after the run (spd_ds.cli.checks_outputs: which ranks)
            ensure_output_dir(args.out, "--out")
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The benchmark of ``_main`` once its arguments are parsed and ``--out`` is checked; returns the exit status."""
    import torch

    from spd_ds.builder import build_arch, encode_prompt, prompt_tokenizer, resolve_path
    from spd_ds.config import ConfigError, load_config
    from spd_ds.eval.runner import first_divergence
    from spd_ds.pipe.runner import SPDSession

    cfg = load_config(args.config, [*args.set, *args.overrides])
    if cfg.decoding.stop:
        raise ConfigError("decoding.stop is for launch/infer.py and the Python API; pipe_bench measures fixed-length "
                          "generations: remove decoding.stop")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else cfg.decoding.max_new_tokens
    arch = build_arch(cfg)
    tok = prompt_tokenizer(cfg, arch)
    if args.prompts:
        from spd_ds.eval.prompts import load_prompts

        texts = [r["turns"][0] for r in load_prompts(args.prompts, args.num_prompts, resolve_path(cfg.data.eval_dir))]
    else:
        texts = PROMPTS[: args.num_prompts]
    prompts = [encode_prompt(tok, t, cfg.decoding.chat_template) for t in texts]

    ar_runs: dict[int, list[int]] = {}

    def factory(head, prompt, ar_reference):
        from spd_ds.builder import build_drafter, build_head_drafter

        if cfg.decoding.drafter == "oracle":  # at T = 0 the AR run just made through the pipeline is the reference;
            # at T > 0 the greedy one (drafters.oracle_reference_sampling)
            greedy = cfg.decoding.temperature == 0
            reference = list(prompt) + ar_runs[len(ar_runs) - 1] if greedy else ar_reference()
            return build_drafter(cfg, None, arch, session.device, reference=reference)
        if not hasattr(factory, "head_drafter"):
            factory.head_drafter = build_head_drafter(cfg, head, session.max_len, session.device)
        return factory.head_drafter

    session = SPDSession(cfg, factory, prompts, max_new)
    records = []
    try:
        if not session.is_head:
            session.serve()
            return 0
        for _ in range(args.warmup):
            ar_runs[len(ar_runs)] = session.generate_ar(prompts[0], max_new).tokens
            session.generate(prompts[0], max_new)
        for i, p in enumerate(prompts):
            ar = session.generate_ar(p, max_new)
            ar_runs[len(ar_runs)] = ar.tokens
            spd = session.generate(p, max_new)
            div = first_divergence(spd.tokens, ar.tokens)
            rec = {"prompt": i, "prompt_tokens": len(p), "spd_tokens": spd.tokens, "ar_tokens": ar.tokens,
                   "equal_to_pipeline_ar": div is None, "first_divergence": div,
                   "spd": spd.metrics.to_dict(), "ar": ar.metrics.to_dict()}
            records.append(rec)
            m = spd.metrics
            print(f"[pipe-bench] prompt {i}: {len(spd.tokens)} tokens, equal_to_ar={div is None} "
                  f"(first divergence {div}), SPD {m.decode_tok_s:.1f} tok/s, AR {ar.metrics.decode_tok_s:.1f} tok/s, "
                  f"cycles {m.num_cycles}, accept {m.draft_acceptance_rate:.2f}, "
                  f"L'acc {m.equivalent_accept_length:.2f}",
                  flush=True)
        session.shutdown()
    except BaseException:
        session.abort()
        raise
    finally:
        session.close()

    if args.single_ar:
        from spd_ds.builder import build_partition, build_target, eos_token_ids, sampling_params
        from spd_ds.decoding.ar import ARDecoder

        target = build_target(cfg, arch, build_partition(cfg, arch), session.device)
        dec = ARDecoder(target, sampling_params(cfg), eos_token_ids(cfg, arch), session.max_len)
        for rec, p in zip(records, prompts):
            single = dec.generate(p, max_new).tokens
            rec["single_ar_tokens"] = single
            rec["first_divergence_vs_single_ar"] = first_divergence(rec["spd_tokens"], single)

    def tot(key, side="spd"):
        return sum(r[side][key] for r in records)

    n_dec = sum(max(len(r["spd_tokens"]) - 1, 0) for r in records)
    n_dec_ar = sum(max(len(r["ar_tokens"]) - 1, 0) for r in records)
    summary = {
        "config": {"partition": vars(cfg.partition), "placement": cfg.head.placement, "dtype": cfg.model.dtype,
                   "drafter": cfg.decoding.drafter, "oracle_alpha": cfg.decoding.oracle_alpha,
                   "temperature": cfg.decoding.temperature, "max_new_tokens": max_new,
                   "static_cache": cfg.deepspeed.static_cache, "cuda_graphs": cfg.deepspeed.cuda_graphs},
        "device": str(session.device), "torch": torch.__version__,
        "all_equal_to_pipeline_ar": all(r["equal_to_pipeline_ar"] for r in records),
        "spd_decode_tok_s": n_dec / tot("decode_s") if tot("decode_s") else 0.0,
        "ar_decode_tok_s": n_dec_ar / tot("decode_s", "ar") if tot("decode_s", "ar") else 0.0,
        "equivalent_accept_length": (session.partition.num_stages * tot("num_new_tokens") / tot("num_cycles")
                                     if tot("num_cycles") else 0.0),
        "time_split_s": {k: tot(k) for k in ("prefill_s", "decode_s", "head_s", "verify_s", "comm_s", "control_s")},
        "stage_forward_s": [sum(r["spd"]["stage_forward_s"][s] for r in records)
                            for s in range(session.partition.num_stages)],
    }
    summary["speedup_vs_pipeline_ar"] = (summary["spd_decode_tok_s"] / summary["ar_decode_tok_s"]
                                         if summary["ar_decode_tok_s"] else 0.0)
    print("[pipe-bench] " + json.dumps({k: v for k, v in summary.items() if k != "config"}), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipe_bench.json").write_text(json.dumps({"summary": summary, "prompts": records,
                                                         "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    greedy = cfg.decoding.temperature == 0
    return 1 if (greedy and not summary["all_equal_to_pipeline_ar"]) else 0


if __name__ == "__main__":
    sys.exit(main())
