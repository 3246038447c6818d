#!/usr/bin/env python
"""Held-out predicted acceptance of trained heads, over all positions and outside loops, on CPU.

The training validation's own path (teacher stages in fp32, :class:`~spd_ds.train.student.HeadTrainModule`,
:func:`spd_ds.train.validate.evaluate`) over a random sample of the held-out split a training run used (the same
``data.train_files`` order, ``data.held_out_fraction`` and ``train.seed``), for heads trained after the run or for a
fair comparison of several heads on the same positions. The teacher runs once; every head is scored on its output.
All heads must share one partition (the first head's); one JSON line per head: the T = 0 figures, loop-free too, and
those of drafts sampled at ``train.kd_temperature`` (``..._sampled``). A warm-started run's saved ``config.yaml``
serves as ``--config`` (its ``head.checkpoint`` is ignored).

Usage (repo root; the data as the training run saw it)::

    python scripts/diagnostics/validate_heads.py HEAD_DIR [HEAD_DIR ...] \
        --data runs/sd runs/train_bench/bench1500.jsonl.gz --records 30 --threads 2

On the target's own answers of an eval run (every record; ``answers_to_records.py`` writes them)::

    python scripts/diagnostics/validate_heads.py HEAD_DIR ... --data runs/answers/x3l2_T1.jsonl --all-records \
        --config docs/train_logs/x3l2/config.yaml --threads 2

The table of docs/training.md ("Validation", loops): ``--records 30 --threads 2`` (19,472 positions); the sampled-draft
table there: ``HEAD... --data runs/train_data/sharegpt.jsonl.gz --config docs/train_logs/x2l2/config.yaml --records 30
--threads 2`` (36,838 positions, ~9 min on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch


def main(argv=None) -> int:
    """Print one JSON line per head (the figures of :func:`spd_ds.train.validate.evaluate`, with ``"head"``) and
    return 0. Raises ``SystemExit`` with a one-line message for heads of another draft vocabulary than the first, or
    a ``--draft-vocab`` a head cannot take (it stores its own LM head)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="head checkpoint directories (one partition)")
    ap.add_argument("--data", nargs="+", required=True, help="the training run's data.train_files, in its order")
    ap.add_argument("--config", default="launch/configs/train_smollm2_n2.yaml", help="the run's training config")
    ap.add_argument("--records", type=int, default=None,
                    help="records sampled (0 = all; seed 0); default 30 held-out records, all with --all-records")
    ap.add_argument("--all-records", action="store_true",
                    help="score every record of --data, no held-out split: text no run trained on, e.g. the "
                         "target's own answers of an eval run (scripts/diagnostics/answers_to_records.py)")
    ap.add_argument("--rows", type=int, default=2, help="rows of data.max_seq_length tokens per micro-batch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-vocab", default=None, metavar="FILE",
                    help="score every head over this draft vocabulary (a draft_vocab/*.json; heads whose LM head is "
                         "the target's own: SpeculationHead.set_draft_vocab), e.g. a whole-vocabulary head over the "
                         "16k one another head trained with")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the run (repeatable)")
    args = ap.parse_args(argv)
    if args.records is None:
        args.records = 0 if args.all_records else 30

    from spd_ds.builder import build_arch, build_partition, load_tokenizer
    from spd_ds.config import load_config
    from spd_ds.head import SpeculationHead
    from spd_ds.train.chat import set_chat_template
    from spd_ds.train.batching import BatchPlanner
    from spd_ds.train.data import load_records, tokenize_records
    from spd_ds.train.loss import TeacherTargets
    from spd_ds.train.split import split_held_out
    from spd_ds.train.student import HeadTrainModule
    from spd_ds.train.teacher import TeacherStage, with_loss_index
    from spd_ds.train.validate import evaluate, held_out_batches

    torch.set_num_threads(args.threads)
    try:  # every head folder, before the model: a wrong path is one line naming it
        part0 = [SpeculationHead.read_config(h, key="the head argument")["partition"] for h in args.heads][0]
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    cfg = load_config(args.config, [f"partition.num_stages={len(part0['stage_layers'])}",
                                    f"partition.stage_layers={part0['stage_layers']}",
                                    f"partition.anchors={part0['anchors']}", "model.dtype=float32",
                                    "model.device=cpu", "head.checkpoint=null",  # the heads come from the arguments
                                    *args.overrides])
    arch = build_arch(cfg)
    part = build_partition(cfg, arch)
    n, S = part.num_stages, cfg.data.max_seq_length
    tokenizer = load_tokenizer(arch)
    set_chat_template(tokenizer, cfg.data.chat_template)
    records = load_records(args.data, cfg.model.cache_dir)
    held = records if args.all_records else split_held_out(records, cfg.data.held_out_fraction, cfg.train.seed)[1]
    if args.records and args.records < len(held):
        held = random.Random(0).sample(held, args.records)
    data = tokenize_records(held, tokenizer, S, cfg.data.min_seq_length, cfg.data.overflow, 0)
    planner = BatchPlanner(data, S, args.rows, 0, 1, cfg.train.seed, True)
    heads = [SpeculationHead.load(h, arch, part).float() for h in args.heads]
    if args.draft_vocab:
        from spd_ds.head import load_draft_vocab

        ids = load_draft_vocab(args.draft_vocab)
        for path, head in zip(args.heads, heads):
            try:
                head.set_draft_vocab(ids)
            except ValueError as e:
                raise SystemExit(f"{path}: {e}") from None
    for path, head in zip(args.heads, heads):  # before the minutes of teacher forwards
        if not torch.equal(head.draft_ids, heads[0].draft_ids):
            raise SystemExit(f"{path}: another draft vocabulary than {args.heads[0]}; score it in its own call")
    T = cfg.train.kd_temperature  # the teacher's lse_full and the sampled figures at the run's temperature
    stages = [TeacherStage(arch, part, s, torch.float32, heads[0].draft_ids.tolist(), T) for s in range(n)]
    t0, cache = time.perf_counter(), []
    with torch.no_grad():
        for rows, _ in held_out_batches(planner.lengths, S, args.rows, True, 0, 1):
            batch = with_loss_index(planner.collate(rows))
            x = (batch["input_ids"], batch["segments"], batch["valid"].long(), batch["loss_index"])
            for stage in stages:
                x = stage(x)
            cache.append((batch, x[0], TeacherTargets(*x[1:])))
    print(f"teacher: {len(held)} records, {len(cache)} micro-batches, {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    for path, head in zip(args.heads, heads):
        outputs = iter(cache)
        val = evaluate(HeadTrainModule(head), lambda _b: next(outputs), [(c[0], True) for c in cache], n,
                       head.draft_ids, "cpu", reduce=False, temperature=T)
        print(json.dumps({"head": path, **val}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
