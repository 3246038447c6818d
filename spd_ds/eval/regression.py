"""Acceptance regression: a committed head keeps its recorded acceptance on a fixed prompt set.

Next to a head checkpoint, ``acceptance.json`` records what to run and what it gave::

    {"spec": {"model", "prompt_set", "num_prompts", "max_new_tokens", "dtype", "device", "temperature"},
     "recorded": {"equivalent_accept_length", "draft_acceptance_rate", "tokens_per_cycle", "num_new_tokens",
                  "num_cycles"},
     "tolerance": {"equivalent_accept_length": 0.05},
     "recorded_with": {"torch", "transformers"}}

Record (once, when the head is committed) and check::

    python -m spd_ds.eval.regression spd_ds/assets/heads/smollm2-135m-instruct-n2 --record --eval-dir eval_data
    python -m spd_ds.eval.regression spd_ds/assets/heads/smollm2-135m-instruct-n2 --eval-dir eval_data

Greedy decoding in fp32 on CPU is deterministic, so the value only moves when the head, the target, the decoder or
the numerics of the libraries change.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ACCEPTANCE_FILE = "acceptance.json"
DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[1] / "assets" / "heads" / "smollm2-135m-instruct-n2"
DEFAULT_SPEC = {"model": "smollm2-135m-instruct", "prompt_set": "mt_bench", "num_prompts": 4, "max_new_tokens": 48,
                "dtype": "float32", "device": "cpu", "temperature": 0.0}
DEFAULT_TOLERANCE = {"equivalent_accept_length": 0.05}


def measure_acceptance(head_dir: str | Path, spec: dict, eval_dir: str | Path | None = None) -> dict:
    """Run the head of ``head_dir`` with the reference decoder as ``spec`` says and return the pooled acceptance.

    Args:
        head_dir: a head checkpoint directory (its partition decides ``n``).
        spec: see the module docstring (``prompt_set`` may be ``random`` for a model without tokenizer).
        eval_dir: where prompt sets are (``data.eval_dir``; default ``eval_data``).
    Returns:
        ``{"equivalent_accept_length", "draft_acceptance_rate", "tokens_per_cycle", "num_new_tokens", "num_cycles"}``.
    Raises:
        FileNotFoundError: no head checkpoint; the prompt loaders' and the config's errors.
    """
    from spd_ds.config import load_config
    from spd_ds.decoding.metrics import SPDMetrics
    from spd_ds.eval.runner import run_eval
    from spd_ds.head import SpeculationHead

    part = SpeculationHead.read_config(head_dir)["partition"]
    ov = [f"model.name={spec['model']}", f"model.dtype={spec['dtype']}", f"model.device={spec['device']}",
          f"head.checkpoint={head_dir}", f"partition.stage_layers={part['stage_layers']}",
          f"partition.num_stages={len(part['stage_layers'])}", f"partition.anchors={part['anchors']}",
          f"eval.prompt_sets=[{spec['prompt_set']}]", f"data.num_prompts={spec['num_prompts']}",
          f"decoding.max_new_tokens={spec['max_new_tokens']}", f"decoding.temperature={spec['temperature']}",
          "decoding.drafter=head", "eval.baselines=[]", "eval.warmup_prompts=0", "eval.plots=false",
          "eval.progress=false"]
    if eval_dir is not None:
        ov.append(f"data.eval_dir={eval_dir}")
    run = run_eval(load_config(None, ov), engine="reference")
    m = SPDMetrics.pooled([r.metrics for r in run.methods["spd"].results.values()], len(part["stage_layers"]))
    return {"equivalent_accept_length": m.equivalent_accept_length, "draft_acceptance_rate": m.draft_acceptance_rate,
            "tokens_per_cycle": m.tokens_per_cycle, "num_new_tokens": m.num_new_tokens, "num_cycles": m.num_cycles}


def record_acceptance(head_dir: str | Path, spec: dict | None = None, tolerance: dict | None = None,
                      eval_dir: str | Path | None = None) -> Path:
    """Measure and write ``head_dir/acceptance.json``; returns its path."""
    import torch
    import transformers

    spec = dict(DEFAULT_SPEC, **(spec or {}))
    recorded = measure_acceptance(head_dir, spec, eval_dir)
    out = Path(head_dir) / ACCEPTANCE_FILE
    out.write_text(json.dumps({"spec": spec, "recorded": recorded, "tolerance": tolerance or dict(DEFAULT_TOLERANCE),
                               "recorded_with": {"torch": torch.__version__,
                                                 "transformers": transformers.__version__}}, indent=1))
    return out


def check_acceptance(head_dir: str | Path, eval_dir: str | Path | None = None) -> tuple[bool, str, dict]:
    """Re-measure the head of ``head_dir`` as its ``acceptance.json`` says and compare within the tolerance.

    Returns:
        ``(ok, one-line message, measured)``.
    Raises:
        FileNotFoundError: no ``acceptance.json`` (record one with ``--record``).
    """
    path = Path(head_dir) / ACCEPTANCE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; record it with: python -m spd_ds.eval.regression {head_dir} --record")
    rec = json.loads(path.read_text())
    measured = measure_acceptance(head_dir, rec["spec"], eval_dir)
    bad = []
    for key, tol in rec["tolerance"].items():
        want, got = rec["recorded"][key], measured[key]
        if abs(got - want) > tol:
            bad.append(f"{key} {got:.4f} vs recorded {want:.4f} (tolerance {tol})")
    msg = ("acceptance kept: " + ", ".join(f"{k} {measured[k]:.4f}" for k in rec["tolerance"])) if not bad else \
        f"acceptance of {head_dir} moved: " + "; ".join(bad)
    return not bad, msg, measured


def main(argv=None) -> int:
    """CLI: check (exit status 1 when the acceptance moved) or ``--record``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head_dir", nargs="?", default=str(DEFAULT_HEAD_DIR))
    ap.add_argument("--record", action="store_true", help="measure and write acceptance.json")
    ap.add_argument("--eval-dir", help="data.eval_dir holding the prompt set (default eval_data)")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE["equivalent_accept_length"],
                    help="absolute tolerance on the equivalent accept length (with --record)")
    args = ap.parse_args(argv)
    if args.record:
        p = record_acceptance(args.head_dir, tolerance={"equivalent_accept_length": args.tolerance},
                              eval_dir=args.eval_dir)
        print(p.read_text())
        return 0
    ok, msg, _ = check_acceptance(args.head_dir, args.eval_dir)
    print(msg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
