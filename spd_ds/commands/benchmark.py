"""SPD benchmarks: one table of speed and acceptance against AR baselines measured in the same run.

Suites (``spd_ds/eval/benchmark.py``; method and commands in ``docs/benchmarks.md``):

  a  SmolLM2-135M-Instruct, SPD n=2 vs ar_graph / hf_generate / ar (acceptance, decode tok/s). CPU (fp32) or GPU
     (bf16); a speedup needs the pipeline engine on one GPU per stage.
  b  Qwen3-4B-shaped random weights, n=2, oracle alpha in {1, 0.8, 0.6} (speedup, cycle vs slowest stage, GB/s).
     Needs a GPU: its 4B parameters take ~16 GB in fp32 on CPU. On CPU run it small with
     ``--suite b --model-b random:smollm2-135m``.
  c  CPU: equivalent accept length of SPD and PPSD heads on SmolLM2, n = 2, 3, 5, 6 (no PPSD row where
     ``--ppsd-head`` names no checkpoint for that n; an untrained SPD head where ``--spd-head`` names none,
     unless that n has a PPSD head: then the PPSD row alone).

Default suites: a b c on a GPU machine, a c on CPU (b is skipped there, with a note).

One process (reference decoder, CPU or one GPU), with the shipped n=2 head::

    python launch/benchmark.py --suite a c --stages 2 --spd-head 'spd_ds/assets/heads/smollm2-135m-instruct-n{n}'

Heads you trained (``launch/train.py``; ``train.output_dir``/head) are passed the same way, e.g.
``--spd-head 'runs/heads/smollm2_n{n}/head'``.

Pipeline engine (suites a and b through DeepSpeed; baselines on rank 0's GPU after the pipeline sessions), on a
machine with 2 GPUs::

    deepspeed --num_gpus 2 launch/benchmark.py --suite a b --out outputs/benchmark

``section.key=value`` overrides apply to every suite (e.g. ``data.eval_dir=/data/eval``), anywhere on the command
line: after an option that takes several values (``--suite``, ``--alphas``, ``--stages``, ``--prompt-sets``) they
are recognised as overrides, not taken as its values, and they win over the suites' own settings. ``--config``'s
file lies under the suites' settings: a warning names those of its settings that they replace. Writes
``--out``/``benchmark.md`` (tables), ``benchmark.json`` (rows + stage forward times) and each evaluation's reports
under ``--out``/``<suite>`` (suite c: ``--out``/``c<n>``, one folder per n; an ``eval.output_dir`` override is
refused). A value given twice to ``--suite``, ``--stages`` or ``--alphas`` is refused.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import re
import sys
import time
from pathlib import Path


from spd_ds.cli import (checks_outputs, chosen_engine, decoding_user_errors, ensure_output_dir, experiment_parser,
                        float_in, int_at_least, rank_and_world, removed_if_left_empty, run_cli, setup_logging,
                        setup_process)
from spd_ds.cli_args import override_key, repeated
from spd_ds.pipe.topology import detect_world_size


log = logging.getLogger("spd_ds.benchmark")


DEFAULT_MODEL_B = "random:qwen3-4b"  # suite b's target shape (4B parameters: a GPU's)
OVERRIDE_WORD = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_][\w.]*=")  # section.key=value (no path has this start)
# the config keys each option sets in the suites (spd_ds.eval.benchmark.suite_runs)
OPTION_KEYS = {"max_new_tokens": ("decoding.max_new_tokens",), "num_prompts": ("data.num_prompts",),
               "prompt_sets": ("eval.prompt_sets",), "spd_head": ("head.checkpoint",),
               "ppsd_head": ("eval.ppsd_checkpoint", "eval.spd"), "stages": ("partition.num_stages",),
               "baseline_prompts": ("eval.baseline_num_prompts",), "alphas": ("eval.oracle_alphas",),
               "model_b": ("model.name",)}
SEVERAL_VALUES = ("--suite", "--alphas", "--stages", "--prompt-sets")  # options that take every word up to the next


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help`` documents every option)."""
    ap = experiment_parser(__doc__, overrides_help="section.key=value overrides for every suite",
                           config_help="base experiment YAML under the suites' overrides",
                           engine_help="auto: DeepSpeed pipeline for suites a/b when WORLD_SIZE > 1, else the "
                                       "reference decoder")
    ap.add_argument("--suite", nargs="+", choices=["a", "b", "c"], default=None,
                    help="suites to run (default: a b c with a GPU, a c on CPU; b needs a GPU, see above)")
    ap.add_argument("--out", default="outputs/benchmark", help="output directory (default: %(default)s)")
    ap.add_argument("--spd-head", help="SPD head checkpoint path pattern with {n}, e.g. "
                    "'spd_ds/assets/heads/smollm2-135m-instruct-n{n}' (default: suite a uses that shipped n=2 head, "
                    "suite c untrained heads, or none where --ppsd-head names one)")
    ap.add_argument("--ppsd-head", help="PPSD head checkpoint path pattern with {n} (suite c; default: no PPSD row)")
    ap.add_argument("--model-b", default=None,
                    help=f"random-weight shape of suite b (default: {DEFAULT_MODEL_B}, which needs a GPU: without one "
                         "suite b stops unless --model-b is given; random:smollm2-135m fits a CPU)")
    ap.add_argument("--alphas", nargs="+", type=float_in(0.0, 1.0), default=[1.0, 0.8, 0.6],
                    help="oracle alphas of suite b, each in [0, 1] (default: %(default)s)")
    ap.add_argument("--stages", nargs="+", type=int_at_least(1), default=[2, 3, 5, 6],
                    help="n values of suite c, each >= 1 (default: %(default)s)")
    ap.add_argument("--prompt-sets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"],
                    help="prompt sets of suites a and c (names or jsonl paths; suite b uses random token prompts; "
                         "gsm8k needs the hub and is skipped with a warning offline; default: %(default)s)")
    ap.add_argument("--num-prompts", type=int_at_least(1), default=4,
                    help="prompts per prompt set (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=128,
                    help="new tokens per prompt, the prefill token included (default: %(default)s)")
    ap.add_argument("--no-tp-baseline", dest="tp_baseline", action="store_false",
                    help="with the pipeline engine over >= 2 ranks, suites a and b also measure tp_ar (AR with "
                         "DeepSpeed AutoTP tensor parallelism over the same ranks); this leaves it out")
    ap.add_argument("--baseline-prompts", type=int_at_least(0), default=2,
                    help="prompts per set for the baselines (0 = all; default: %(default)s)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed command line (``argv``: default ``sys.argv[1:]``; ``--help`` documents every option).

    The options of :data:`SEVERAL_VALUES` take every word up to the next option, so ``section.key=value`` words among
    them are taken out first and applied as the overrides they are (``--prompt-sets gsm8k data.eval_dir=DIR``,
    ``--stages 2 decoding.temperature=1``; argparse read the latter as a bad stage count). ``args.option_keys`` lists
    the config keys (``key=``, :data:`OPTION_KEYS`) of the options given a value other than their default: the user's
    choice, not the suites'."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, moved, several = [], [], False
    for w in argv:
        if w.startswith("-") and not _is_number(w):  # an option (a negative number is a value: --alphas -1 is refused
            several = w in SEVERAL_VALUES           # by its type, not taken for an option)
        elif several and OVERRIDE_WORD.match(w):
            moved.append(w)
            continue
        rest.append(w)
    ap = build_parser()
    args = ap.parse_args(rest)
    args.overrides = sorted([*args.overrides, *moved], key=argv.index)  # in command-line order: a later one wins
    args.option_keys = [f"{key}=" for dest, keys in OPTION_KEYS.items() if getattr(args, dest) != ap.get_default(dest)
                        for key in keys]
    return args


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def main(argv=None) -> int:
    """Run the suites. Exit status 0; 2 after a user error (one line); under a launcher 1 after any other error (one
    rank-tagged line, traceback in a log file; ``SPD_DEBUG=1`` prints it)."""
    return run_cli(_main, argv, user_errors=decoding_user_errors, prog="benchmark")


def tp_skip_reason(cfg) -> str | None:
    """Why the benchmark leaves ``tp_ar`` out of a suite's baselines (its target AutoTP cannot split), else ``None``."""
    from spd_ds import builder
    from spd_ds.eval.inputs import resolve_model_name
    from spd_ds.eval.tp_baseline import tp_unsupported

    return tp_unsupported(builder.build_arch(resolve_model_name(cfg)))


def _main(argv=None) -> int:
    args = parse_args(argv)
    with removed_if_left_empty(args.out):  # a refused run leaves no empty --out behind
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The suites of :func:`main` once its arguments are parsed; returns the exit status."""
    setup_logging()
    setup_process()
    import torch

    from spd_ds import builder
    from spd_ds.config import ConfigError
    from spd_ds.eval import benchmark as bm
    from spd_ds.eval.baselines import check_baseline_names
    from spd_ds.eval.inputs import resolve_model_name
    from spd_ds.eval.report import summarize, write_reports
    from spd_ds.eval.runner import run_baselines, run_eval

    given = [o for o in args.overrides if override_key(o) == "eval.output_dir"]
    if given:  # each suite's reports go to --out/<suite>: the override would be dropped without a word
        raise ConfigError(f"override {given[-1]!r}: the benchmark writes each suite's reports under --out/<suite> "
                          f"(here {args.out}); give --out DIR instead of eval.output_dir")
    for flag, values in (("--suite", args.suite), ("--stages", args.stages),
                         ("--alphas", [f"{a:g}" for a in args.alphas])):  # one report folder / row per value
        twice = repeated(values or [])
        if twice:
            raise ConfigError(f"{flag} gives {twice[0]} twice; give each value once (a second run would replace the "
                              "first's results)")
    world = detect_world_size()
    engine = chosen_engine(args.engine)
    out = Path(args.out)
    if checks_outputs():  # before any suite runs, not after them (spd_ds.cli.checks_outputs: which ranks)
        ensure_output_dir(out, "--out")
    cuda = bm.is_cuda_run()
    suites = args.suite or bm.default_suites(cuda)
    if "b" in suites and not cuda and args.model_b is None:
        raise ConfigError(f"suite b's default model {DEFAULT_MODEL_B} (4B parameters, ~16 GB in fp32) needs a GPU; on "
                          "CPU add --model-b random:smollm2-135m (or --model-b random:qwen3-4b to run it anyway)")
    model_b = args.model_b or DEFAULT_MODEL_B
    if args.suite is None and not cuda:
        log.info("no GPU: suites a and c; suite b needs a GPU (its default model is 4B parameters; on CPU run it small "
                 "with --suite b --model-b random:smollm2-135m)")
    runs = bm.suite_runs(suites, cuda=cuda, spd_head=args.spd_head, ppsd_head=args.ppsd_head,
                         model_b=model_b, alphas=args.alphas, stages_c=args.stages, num_prompts=args.num_prompts,
                         max_new_tokens=args.max_new_tokens, baseline_prompts=args.baseline_prompts or None,
                         prompt_sets=args.prompt_sets, extra=args.overrides)
    for sr in runs:
        tag = sr.suite + (sr.label.rsplit("n=", 1)[-1] if sr.suite == "c" else "")
        sr.overrides.append(f"eval.output_dir={out / tag}")
        if (sr.suite in ("a", "b") and engine == "deepspeed" and world > 1 and args.tp_baseline
                and not any(o.startswith("eval.baselines=") for o in args.overrides)):
            tp_why = tp_skip_reason(bm.config_of(sr, args.config))
            if tp_why is None:
                sr.overrides.append("eval.baselines=[ar_graph,hf_generate,ar,tp_ar]")
            else:
                log.warning("suite %s (%s): no tp_ar baseline: %s", sr.suite, sr.label, tp_why)
    t0 = time.time()
    cfgs = [bm.config_of(sr, args.config) for sr in runs]
    for cfg in cfgs:  # eval.baselines (an override, or the file's): before any head, model or prompt is read
        check_baseline_names(cfg.eval.baselines)
    replaced = bm.replaced_file_settings(args.config, runs, [*args.overrides, *args.option_keys], cfgs)
    if replaced:  # the file lies under the suites' settings: say which of its values are not used
        log.warning("--config %s: the suites' own settings replace its %s; give them with the benchmark's options "
                    "(--max-new-tokens, --num-prompts, --prompt-sets, --spd-head, ...) or as section.key=value on the "
                    "command line, which wins over the suites", args.config, "; ".join(replaced))
    for cfg in cfgs:  # every suite's head files, then its partition (and its head's) against its model, before
        if cfg.decoding.drafter == "head":  # the first suite runs
            builder.check_head_inputs(cfg, ppsd=True)
    for cfg in cfgs:
        builder.build_partition(cfg, builder.build_arch(resolve_model_name(cfg)))
    piped = [k for k, sr in enumerate(runs) if engine == "deepspeed" and sr.suite in ("a", "b")]
    head = rank_and_world()[0] == 0
    if not piped and not head:  # e.g. suite c under the launcher: the head rank alone runs it
        return 0
    if piped:  # phase 1, every rank: all pipeline sessions, one process group
        import torch.distributed as dist

        c0 = cfgs[piped[0]]
        from spd_ds.dist import init_process_group, init_timeout_s

        init_process_group(c0.deepspeed.backend, init_timeout_s(c0))
        head = dist.get_rank() == 0
        try:
            for k in piped:
                runs[k].run = run_eval(cfgs[k], engine="deepspeed", baselines=False)
        finally:
            dist.destroy_process_group()
        if not head:
            return 0
    for k, sr in enumerate(runs):  # phase 2, head rank: baselines, stage timings, reports
        if sr.run is None:
            sr.run = run_eval(cfgs[k], engine="reference")
        else:
            run_baselines(sr.run)
        if sr.suite in ("a", "b"):
            bm.measure_stage_forwards(sr)
        sr.summary = summarize(sr.run)
        if sr.stage_forward_ms is not None:
            sr.summary["stage_forward_ms_alone"] = sr.stage_forward_ms
        write_reports(sr.run, sr.run.cfg.eval.output_dir, summary=sr.summary)
        sr.run.target = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    table = bm.render(runs)
    print("\n" + table)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"# spd-ds benchmark ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"engine {engine}, world {world}, {time.time() - t0:.0f} s)\n\n")
    (out / "benchmark.md").write_text(header + table + "\n")
    rows = {"speed": [r for sr in runs if sr.suite in ("a", "b") for r in bm.speed_rows(sr, bm.with_tp(runs))],
            "acceptance": [r for sr in runs if sr.suite == "c" for r in bm.accept_rows(sr)],
            "speed_headers": bm.speed_headers(runs), "acceptance_headers": bm.ACCEPT_HEADERS,
            "stage_forward_ms_alone": {f"{sr.suite} {sr.label}": sr.stage_forward_ms for sr in runs},
            "summaries": {f"{sr.suite} {sr.label}": str(Path(sr.run.cfg.eval.output_dir) / "summary.json")
                          for sr in runs}}
    (out / "benchmark.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {out}/benchmark.md, benchmark.json")
    stale = bm.earlier_results(out, [sr.run.cfg.eval.output_dir for sr in runs])
    if stale:
        log.warning("%s also holds results of an earlier run (%s/), which benchmark.md and benchmark.json leave out",
                    out, "/, ".join(stale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
