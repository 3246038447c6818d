"""SPD evaluation: acceptance and wall-clock speed against autoregressive (AR) baselines measured in the same run.

One process (reference decoder, CPU or one GPU)::

    python launch/eval.py --config launch/configs/smollm2_spd.yaml [section.key=value ...]

Through DeepSpeed's pipeline engine (n stage ranks; the baselines then run on rank 0's GPU after the pipeline)::

    deepspeed --num_gpus 2 launch/eval.py --config launch/configs/smollm2_spd.yaml

Useful overrides: ``eval.prompt_sets=[mt_bench,humaneval,gsm8k]`` (names or jsonl paths), ``data.num_prompts=10``
(per set), ``data.eval_dir=DIR``, ``eval.baselines=[hf_generate,ar,ar_graph]``, ``eval.ppsd_checkpoint=DIR`` (a PPSD
head beside the SPD head; with ``eval.spd=false`` the PPSD head alone), ``decoding.drafter=oracle
eval.oracle_alphas=[1,0.8,0.6]`` (oracle drafts), ``model.name=random:qwen3-4b model.dtype=bfloat16
eval.prompt_sets=[random]`` (random weights of a real shape).

Writes ``eval.output_dir``/``per_prompt.jsonl``, ``summary.json`` (the metrics of spd_ds.decoding.metrics.SPDMetrics,
per prompt set and pooled), ``acceptance_by_depth.png`` and ``cycle_time_split.png`` (with ``eval.plots`` and
matplotlib, ``pip install -e .[eval]``), and prints the table and the exactness check (T=0: SPD's tokens against
every AR baseline's, first divergence per prompt).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


from spd_ds.cli import (checks_outputs, decoding_user_errors, ensure_output_dir, experiment_parser,
                        rank_and_world, removed_if_left_empty, run_cli, setup_logging, setup_process)
from spd_ds.config import ConfigError, load_config

log = logging.getLogger("spd_ds.eval")


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed command line (``argv``: default ``sys.argv[1:]``; ``--help`` documents every option)."""
    ap = experiment_parser(__doc__, overrides_help="section.key=value overrides, e.g. data.num_prompts=10",
                           engine_help="auto: DeepSpeed engine when launched with WORLD_SIZE > 1, else the reference "
                                       "decoder")
    ap.add_argument("--strict-exact", dest="strict_exact", action="store_true",
                    help="exit with status 1 if at T=0 any SPD output differs from the 'ar' baseline's")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """Run the evaluation. Exit status 0; 1 with ``--strict-exact`` and a divergence; 2 after a user error (one line);
    under a launcher 1 after any other error (one rank-tagged line, traceback in a log file; ``SPD_DEBUG=1``)."""
    return run_cli(_main, argv, user_errors=decoding_user_errors, prog="eval")


def _check_strict_exact(cfg) -> None:
    """``--strict-exact`` compares SPD with the ``ar`` baseline at T = 0: refuse a run where no comparison can happen.

    Raises:
        ConfigError: T > 0, ``eval.check_exact`` false, or no ``ar`` in ``eval.baselines``.
    """
    if cfg.decoding.temperature > 0:
        raise ConfigError(f"--strict-exact compares tokens at T = 0, but decoding.temperature="
                          f"{cfg.decoding.temperature}; set decoding.temperature=0 or drop --strict-exact")
    if not cfg.eval.check_exact:
        raise ConfigError("--strict-exact needs eval.check_exact=true")
    if "ar" not in cfg.eval.baselines:
        raise ConfigError(f"--strict-exact compares SPD with the 'ar' baseline, which eval.baselines="
                          f"{list(cfg.eval.baselines)} leaves out; add ar (e.g. eval.baselines='[ar, hf_generate]')")


def _main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    setup_process()
    cfg = load_config(args.config, args.overrides)
    from spd_ds.eval.baselines import check_baseline_names

    check_baseline_names(cfg.eval.baselines)  # before the prompts are read or the model resolved
    if args.strict_exact:
        _check_strict_exact(cfg)
    with removed_if_left_empty(cfg.eval.output_dir):  # a refused run leaves no empty eval.output_dir
        if checks_outputs():  # before the model loads, not after the run (spd_ds.cli.checks_outputs: which ranks)
            ensure_output_dir(cfg.eval.output_dir, "eval.output_dir")
        return _evaluate(cfg, args)


def _evaluate(cfg, args) -> int:
    """The evaluation of ``_main`` once its output folder is checked; returns the exit status."""
    from spd_ds.eval.report import PLOT_FILES, bandwidth_line, exactness_lines, summary_table, write_reports
    from spd_ds.eval.runner import run_eval

    if args.engine == "reference" and rank_and_world()[0] != 0:
        return 0  # --engine reference under a launcher: rank 0 alone evaluates
    run = run_eval(cfg, engine=args.engine)
    if run is None:  # a stage rank of the pipeline: the head rank reports
        return 0
    summary = write_reports(run, run.cfg.eval.output_dir)
    print(f"\n=== {summary['model']['name']} ({summary['model']['dtype']}, {run.device}), "
          f"n={run.partition.num_stages}, {len(run.prompts)} prompts, engine {run.engine}")
    for scope in ["overall"] + list(summary["prompt_sets"]):
        print(f"\n--- {scope}")
        print(summary_table(summary, scope))
    print(bandwidth_line(summary))
    print("eq. accept len: n*N/K, the paper's L'_acc, with each answer's prefill token counted in N (on short answers "
          "it sits above the decode-only figure launch/infer.py prints)")
    print("\n--- exactness (T=0: SPD tokens vs AR baselines)")
    for line in exactness_lines(summary):
        print(line)
    out = Path(run.cfg.eval.output_dir)  # the plots written (none without matplotlib: write_reports warns then)
    print(f"\nwrote {out}/summary.json, per_prompt.jsonl" + "".join(f", {p}" for p in PLOT_FILES if (out / p).exists()))
    log.debug("summary: %s", json.dumps(summary["results"])[:2000])
    if args.strict_exact and summary["exactness"]["checked"]:
        ar = [r for per in summary["exactness"]["by_method"].values() for b, r in per.items() if b == "ar"]
        if any(r["divergences"] for r in ar):
            print("error: SPD output differs from the 'ar' baseline (see above)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
