"""Tables and facts the ``scripts/gpu_*.sh`` drivers write: run environment, anchor arithmetic, the suite-(c) table of
a heads sweep, the summary of ``spd_ds.commands.pipe_bench`` runs. The shell scripts only call these, through
``python -m spd_ds.eval.collect <command>``:

* ``env [--deps]``: one JSON line (model directory when ``--model``, torch / transformers / deepspeed versions, GPUs,
  git commit); ``--deps`` exits 1 first with the missing Python packages.
* ``first-stage-layers MODEL N``: layers of stage 0 in a uniform N-stage split of MODEL (PPSD's anchor ``e_1``).
* ``suite-c WORK OUT STAGES...``: ``OUT/suite_c.{json,md}`` from ``WORK/eval/<variant>_n<n>/summary.json`` and
  ``WORK/heads/<variant>_n<n>/train_summary.json``; prints the table.
* ``pipe-bench OUT``: the markdown summary of ``OUT/bench_*/pipe_bench.json`` and ``OUT/infer_*.log``.
* ``heads-report MODEL WORK OUT STAGES... [--quick-eval] [--regenerated]``: ``OUT/report.json`` of
  ``scripts/gpu_train_heads.sh`` (training summary, log and throughput per head; with ``--quick-eval`` each head's
  draft acceptance through the reference decoder at T = 0 on a few prompts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REQUIRED_PACKAGES = ("deepspeed", "datasets", "omegaconf", "transformers", "gguf")
SUITE_C_SETS = ("mt_bench", "humaneval", "gsm8k")


def missing_packages(names: Sequence[str] = REQUIRED_PACKAGES) -> list[str]:
    """The names among ``names`` that cannot be imported (found without importing them)."""
    return [m for m in names if importlib.util.find_spec(m) is None]


def environment(model: str | None = None) -> dict:
    """The run's environment: torch, transformers and deepspeed versions, CUDA and its GPUs, the git commit of the
    working directory, and with ``model`` its resolved local directory (converting a GGUF once, before any launch
    whose ranks would race to do it)."""
    import deepspeed
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
           "cuda": torch.cuda.is_available(),
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "git": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
    if model:
        from spd_ds.zoo import resolve_model

        env["model_dir"] = str(resolve_model(model))
    return env


def first_stage_layers(model: str, num_stages: int) -> int:
    """Layers of stage 0 in the uniform ``num_stages``-stage split of ``model`` (a zoo name or a local directory):
    PPSD's anchor ``e_1`` (``partition.anchors=[0,e_1]``)."""
    from spd_ds.partition import StagePartition
    from spd_ds.zoo import resolve_model

    layers = json.loads((resolve_model(model) / "config.json").read_text())["num_hidden_layers"]
    return StagePartition.build(layers, num_stages).stage_layers[0]


def suite_c_rows(work: Path, stages: Sequence[int]) -> list[dict]:
    """One row per evaluated head of a heads sweep (``work/eval/<variant>_n<n>/summary.json``, variants ``spd`` and
    ``ppsd``; train steps from ``work/heads/<variant>_n<n>/train_summary.json`` when present): n, head, anchors,
    equivalent accept length overall and per prompt set, draft acceptance, tokens per cycle, acceptance by fill."""
    work, rows = Path(work), []
    for n in stages:
        for variant in ("spd", "ppsd"):
            s = work / "eval" / f"{variant}_n{n}" / "summary.json"
            if not s.exists():
                continue
            summ = json.loads(s.read_text())
            res = summ["results"]["spd"]
            b = res["overall"]
            ts = work / "heads" / f"{variant}_n{n}" / "train_summary.json"
            rows.append({"n": int(n), "head": variant, "anchors": summ["partition"]["anchors"],
                         "train_steps": json.loads(ts.read_text()).get("steps") if ts.exists() else None,
                         "equivalent_accept_length": b["equivalent_accept_length"],
                         "draft_acceptance_rate": b["draft_acceptance_rate"], "tokens_per_cycle": b["tokens_per_cycle"],
                         "acceptance_by_fill": [r["rate"] for r in b["acceptance_by_depth"]],
                         "eq_accept_len_by_set": {k: v["equivalent_accept_length"] for k, v in res["by_set"].items()},
                         "num_prompts": b.get("num_prompts"), "num_new_tokens": b.get("num_new_tokens"),
                         "device": summ.get("device")})
    return rows


def suite_c_markdown(rows: Sequence[dict]) -> str:
    """The suite-(c) table of :func:`suite_c_rows` in markdown (one line per row, newline-terminated)."""
    md = ["| n | head | anchors | train steps | eq. accept len | draft acc. | tok/cycle | acceptance by fill 1..n | "
          "MT-Bench | HumanEval | GSM8K |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f3 = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731 - None: no draft / no cycle (a summary's blocks)
    for r in rows:
        fills = " ".join("-" if x is None else f"{x:.2f}" for x in r["acceptance_by_fill"])
        sets = " | ".join(f3(r["eq_accept_len_by_set"].get(k, float("nan"))) for k in SUITE_C_SETS)
        rates = " | ".join(f3(r[k]) for k in ("equivalent_accept_length", "draft_acceptance_rate", "tokens_per_cycle"))
        md.append(f"| {r['n']} | {r['head'].upper()} | {r['anchors']} | {r['train_steps']} | {rates} | {fills} | "
                  f"{sets} |")
    return "\n".join(md) + "\n"


def pipe_bench_summary(out: Path) -> str:
    """Markdown summary of a ``scripts/gpu_pipe_bench.sh`` run: one table row per ``out/bench_<name>/pipe_bench.json``
    (equality with the pipeline AR, first divergence from the eager AR, tok/s, speedup, L'acc, ms per cycle of each
    stage, the head, verify, comm and control), then the AR-check line of each ``out/infer_<name>.log``."""
    out = Path(out)
    lines = ["# Distributed SPD on 2 GPUs (SmolLM2-135M-Instruct, n=2, co-located head)\n",
             "| run | equal to pipeline AR | first divergence vs eager AR | SPD tok/s | AR tok/s (same pipeline) | "
             "speedup | L'acc | ms/cycle: stage0 / stage1 / head / verify / comm / control |",
             "|---|---|---|---|---|---|---|---|"]
    for d in sorted(out.glob("bench_*/pipe_bench.json")):
        j = json.loads(d.read_text())
        s, recs = j["summary"], j["prompts"]
        cyc = sum(r["spd"]["num_cycles"] for r in recs) or 1
        t = s["time_split_s"]
        split = " / ".join(f"{1e3 * x / cyc:.3f}" for x in
                           s["stage_forward_s"] + [t["head_s"], t["verify_s"], t["comm_s"], t["control_s"]])
        div = [r.get("first_divergence_vs_single_ar") for r in recs]
        lines.append(f"| {d.parent.name[6:]} | {s['all_equal_to_pipeline_ar']} | {div} | {s['spd_decode_tok_s']:.1f} | "
                     f"{s['ar_decode_tok_s']:.1f} | {s['speedup_vs_pipeline_ar']:.2f} | "
                     f"{s['equivalent_accept_length']:.2f} | {split} |")
    for f in sorted(out.glob("infer_*.log")):
        found = [x for x in f.read_text().splitlines() if x.startswith(("identical to AR", "speed: "))]
        lines.append(f"\n`launch/infer.py` ({f.stem[6:]}): "
                     f"{'; '.join(found) if found else 'no AR comparison line (see log)'}")
    lines.append("\nCommands: see `*.cmd` in this directory.")
    return "\n".join(lines) + "\n"


QUICK_EVAL_PROMPTS = ("Give me three tips for writing clear emails.",)


def quick_eval(model: str, head_dir: Path, num_stages: int, max_new_tokens: int = 96) -> dict:
    """Draft acceptance of the head in ``head_dir`` through the reference decoder at T = 0 (bf16 on a GPU, else fp32
    on CPU) on the demo prompts and :data:`QUICK_EVAL_PROMPTS`: totals of the metrics, the equivalent accept length
    ``n * new tokens / cycles`` and the seconds taken."""
    import time

    import torch

    from spd_ds import builder
    from spd_ds.config import load_config
    from spd_ds.decoding.reference import SPDReferenceDecoder
    from spd_ds.eval.prompts import DEMO_PROMPTS

    gpu = torch.cuda.is_available()
    cfg = load_config(None, [f"model.name={model}", f"model.dtype={'bfloat16' if gpu else 'float32'}",
                             f"model.device={'cuda' if gpu else 'cpu'}", f"head.checkpoint={head_dir}",
                             f"partition.num_stages={num_stages}"])
    arch = builder.build_arch(cfg)
    tok = builder.load_tokenizer(arch)
    part = builder.build_partition(cfg, arch)
    head = builder.build_head(cfg, arch, part)
    target = builder.build_target(cfg, arch, part)
    drafter = builder.build_drafter(cfg, head, arch, target.device)
    dec = SPDReferenceDecoder(target, drafter, builder.sampling_params(cfg), builder.eos_token_ids(cfg, arch, tok),
                              max_len=1024)
    prompts, tot = list(DEMO_PROMPTS) + list(QUICK_EVAL_PROMPTS), None
    t0 = time.perf_counter()
    for p in prompts:
        m = dec.generate(builder.encode_prompt(tok, p), max_new_tokens).metrics
        tot = m if tot is None else tot + m
    return {"prompts": len(prompts), "num_new_tokens": tot.num_new_tokens, "num_cycles": tot.num_cycles,
            "num_drafts": tot.num_drafts, "num_accepted_tokens": tot.num_accepted_tokens,
            "draft_acceptance_rate": tot.draft_acceptance_rate,
            "equivalent_accept_length": num_stages * tot.num_new_tokens / max(tot.num_cycles, 1),
            "seconds": time.perf_counter() - t0}


def heads_report(model: str, work: Path, out: Path, stages: Sequence[int], *, run_quick_eval: bool = False,
                 regenerated: bool = False, max_new_tokens: int = 96) -> dict:
    """``out/report.json`` of ``scripts/gpu_train_heads.sh``: per n, ``work/heads/smollm2_n<n>``'s
    ``train_summary.json``, its ``train_log.jsonl`` with the mean tokens/s (the first record, warm-up, left out when
    there are others) and with ``run_quick_eval`` :func:`quick_eval` as ``quick_eval_T0``. The file is rewritten after
    each head (a timeout keeps the heads done) and one line per head is printed. Returns the report."""
    work, out = Path(work), Path(out)
    report = {"stages": {}, "regenerated": regenerated}
    for n in stages:
        run, entry = work / "heads" / f"smollm2_n{n}", {}
        if (run / "train_summary.json").exists():
            entry.update(json.loads((run / "train_summary.json").read_text()))
        log = run / "train_log.jsonl"
        logs = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        if logs:
            entry["train_log"] = logs
            steady = logs[1:] or logs
            entry["mean_tokens_per_s"] = sum(r["tokens_per_s"] for r in steady) / len(steady)
        report["stages"][str(n)] = entry
        (out / "report.json").write_text(json.dumps(report, indent=2))
        if run_quick_eval and (run / "head" / "head_config.json").exists():
            entry["quick_eval_T0"] = quick_eval(model, run / "head", int(n), max_new_tokens)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        print(f"n={n}: {json.dumps({k: v for k, v in entry.items() if k not in ('partition', 'train_log')})}",
              flush=True)
    return report


def main(argv=None) -> int:
    """``python -m spd_ds.eval.collect <command>`` (module docstring). Exit status 0; 1 when ``env --deps`` finds
    packages missing."""
    ap = argparse.ArgumentParser(prog="python -m spd_ds.eval.collect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env", help="environment as one JSON line")
    p.add_argument("--model", help="also resolve this model (zoo name, GGUF or directory)")
    p.add_argument("--deps", action="store_true", help="first check the required Python packages")
    p = sub.add_parser("first-stage-layers", help="layers of stage 0 in a uniform split")
    p.add_argument("model")
    p.add_argument("num_stages", type=int)
    p = sub.add_parser("suite-c", help="suite (c) table of a heads sweep")
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("stages", nargs="+", type=int)
    p = sub.add_parser("pipe-bench", help="summary of gpu_pipe_bench.sh runs")
    p.add_argument("out", type=Path)
    p = sub.add_parser("heads-report", help="report.json of gpu_train_heads.sh")
    p.add_argument("model")
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("stages", nargs="+", type=int)
    p.add_argument("--quick-eval", action="store_true", help="draft acceptance of each head (reference decoder)")
    p.add_argument("--regenerated", action="store_true", help="the training data includes regenerated answers")
    args = ap.parse_args(argv)
    if args.command == "env":
        if args.deps and missing_packages():
            print(f"missing Python packages: {missing_packages()}", file=sys.stderr)
            return 1
        print(json.dumps(environment(args.model)))
    elif args.command == "first-stage-layers":
        print(first_stage_layers(args.model, args.num_stages))
    elif args.command == "suite-c":
        rows = suite_c_rows(args.work, args.stages)
        md = suite_c_markdown(rows)
        (args.out / "suite_c.json").write_text(json.dumps(rows, indent=2))
        (args.out / "suite_c.md").write_text(md)
        print(md, end="")
    elif args.command == "pipe-bench":
        print(pipe_bench_summary(args.out), end="")
    else:
        heads_report(args.model, args.work, args.out, args.stages, run_quick_eval=args.quick_eval,
                     regenerated=args.regenerated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
