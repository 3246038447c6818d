#!/usr/bin/env python
"""SPD generation: answer prompts with Speculative Pipeline Decoding and print the answers and SPD metrics.

One process (reference decoder, CPU or one GPU)::

    python launch/infer.py --config launch/configs/smollm2_spd.yaml [section.key=value ...]

Through DeepSpeed's pipeline engine (n stage ranks; several nodes with ``--hostfile``)::

    deepspeed --num_gpus 2 launch/infer.py --config launch/configs/smollm2_spd.yaml

At temperature 0 the answers are checked token for token against autoregressive decoding of the same target on
the same stage code (``--no-compare-ar`` skips it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spd_ds import builder  # noqa: E402
from spd_ds.cli import chosen_engine, experiment_parser  # noqa: E402
from spd_ds.pipe.topology import detect_world_size  # noqa: E402
from spd_ds.config import ConfigError, load_config  # noqa: E402
from spd_ds.decoding.metrics import SPDMetrics, pooled_decode_tok_s  # noqa: E402

log = logging.getLogger("spd_ds.infer")


def parse_args(argv=None) -> argparse.Namespace:
    ap = experiment_parser(__doc__, overrides_help="section.key=value overrides, e.g. partition.num_stages=3",
                           engine_help="auto: DeepSpeed engine when launched with WORLD_SIZE > 1, else the reference "
                                       "decoder")
    ap.add_argument("--prompt", action="append", help="a prompt text (repeatable); default: data.prompts")
    ap.add_argument("--compare-ar", dest="compare_ar", action=argparse.BooleanOptionalAction, default=True,
                    help="at T=0, check SPD's tokens against AR decoding on the same stage code")
    ap.add_argument("--output", help="write per-prompt results as JSONL here")
    return ap.parse_args(argv)


def load_prompt_texts(cfg, args) -> list[tuple[str, str]]:
    """(id, text) pairs: ``--prompt`` values, else the first turn of each record of ``data.prompts``."""
    if args.prompt:
        return [(f"prompt{i}", p) for i, p in enumerate(args.prompt)]
    from spd_ds.eval.prompts import load_prompts

    recs = load_prompts(cfg.data.prompts, cfg.data.num_prompts, builder.resolve_path(cfg.data.eval_dir))
    return [(str(r["question_id"]), r["turns"][0]) for r in recs]


def main(argv=None) -> int:
    """Run the job; user errors (config, model, head, prompt) end it with a one-line message and exit code 2."""
    from spd_ds.decoding.reference import PromptError
    from spd_ds.head import HeadMismatchError
    from spd_ds.models.adapter import UnsupportedModelError
    from spd_ds.zoo import ModelUnavailableError

    try:
        return _main(argv)
    except (ConfigError, PromptError, HeadMismatchError, UnsupportedModelError, ModelUnavailableError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(args.config, args.overrides)
    world = detect_world_size()
    engine = chosen_engine(args.engine)

    arch = builder.build_arch(cfg)
    tok = builder.load_tokenizer(arch)
    prompts = load_prompt_texts(cfg, args)
    ids = [builder.encode_prompt(tok, text, cfg.decoding.chat_template) for _, text in prompts]
    if engine == "deepspeed":
        from spd_ds.pipe.runner import run_distributed_inference

        if int(os.environ.get("RANK", "0")) == 0:
            log.info("engine deepspeed: %d rank(s), partition.num_stages=%d, head.placement=%s", world,
                     cfg.partition.num_stages, cfg.head.placement)

        compare = args.compare_ar and cfg.decoding.temperature == 0
        out = run_distributed_inference(cfg, ids, cfg.decoding.max_new_tokens, with_ar=compare)
        if out is None:  # not the verifying rank
            return 0
        results, ar = out if compare else (out, None)
        ar_tokens = [r.tokens for r in ar] if ar is not None else None
        report(cfg, arch, tok, prompts, ids, results, args, ar_tokens, "AR through the same pipeline")
        return 0
    results = run_reference(cfg, arch, tok, ids)
    report(cfg, arch, tok, prompts, ids, results, args)
    return 0


def run_reference(cfg, arch, tok, ids):
    """Generate every prompt with the single-process reference decoder."""
    from spd_ds.decoding.reference import SPDReferenceDecoder

    part = builder.build_partition(cfg, arch)
    target = builder.build_target(cfg, arch, part)
    head = builder.build_head(cfg, arch, part)
    eos = builder.eos_token_ids(cfg, arch, tok)
    log.info("target %s: %d layers in %d stages %s, anchors %s, device %s", arch.model_dir.name, arch.num_layers,
             part.num_stages, list(part.stage_layers), list(part.anchors), target.device)
    results = []
    oracle = cfg.decoding.drafter == "oracle"
    drafter = None if oracle else builder.build_drafter(cfg, head, arch, target.device)  # one head drafter (graph)
    for i, p in enumerate(ids):
        if oracle:
            from spd_ds.decoding.ar import ARDecoder

            ar = ARDecoder(target, builder.sampling_params(cfg), eos, cfg.decoding.max_length)
            reference = list(p) + ar.generate(p, cfg.decoding.max_new_tokens + part.num_stages).tokens
            drafter = builder.build_drafter(cfg, head, arch, target.device, reference)
        dec = SPDReferenceDecoder(target, drafter, builder.sampling_params(cfg), eos, cfg.decoding.max_length)
        results.append(dec.generate(p, cfg.decoding.max_new_tokens))
    return results


def report(cfg, arch, tok, prompts, ids, results, args, ar_tokens=None, ar_name="AR decoding") -> None:
    """Print answers, per-prompt metrics, the AR comparison and the totals.

    ``ar_tokens``: AR continuations already decoded (under DeepSpeed: through the same pipeline); if ``None`` and the
    comparison is on (T = 0), the single-process AR decoder runs here.
    """
    if ar_tokens is None and args.compare_ar and cfg.decoding.temperature == 0:
        from spd_ds.decoding.ar import ARDecoder

        part = builder.build_partition(cfg, arch)
        target = builder.build_target(cfg, arch, part)
        ar = ARDecoder(target, builder.sampling_params(cfg), builder.eos_token_ids(cfg, arch, tok), cfg.decoding.max_length)
        ar_tokens = [ar.generate(p, cfg.decoding.max_new_tokens).tokens for p in ids]
    total = SPDMetrics.pooled([r.metrics for r in results])
    rows = []
    for i, ((qid, text), res) in enumerate(zip(prompts, results)):
        m = res.metrics
        print(f"\n=== [{qid}] {text[:200]}")
        print(tok.decode(res.tokens, skip_special_tokens=True))
        same = None if ar_tokens is None else ar_tokens[i] == res.tokens
        print(f"--- {m.num_new_tokens} tokens in {m.num_cycles} cycles, draft acceptance "
              f"{m.draft_acceptance_rate:.3f}, equivalent accept length {m.equivalent_accept_length:.2f}, "
              f"{m.decode_tok_s:.1f} tok/s" + ("" if same is None else f", identical to AR: {'yes' if same else 'NO'}"))
        rows.append({"question_id": qid, "tokens": res.tokens, "finish_reason": res.finish_reason,
                     "identical_to_ar": same, **m.to_dict()})
    print("\n=== totals")
    totals = {k: v for k, v in total.to_dict().items() if not isinstance(v, list)}
    totals["decode_tok_s"] = pooled_decode_tok_s([r.metrics for r in results])  # prefill token excluded per prompt
    print(json.dumps(totals, indent=1))
    if ar_tokens is not None:
        n_same = sum(r["identical_to_ar"] for r in rows)
        print(f"identical to {ar_name}: {n_same}/{len(rows)} prompts")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
