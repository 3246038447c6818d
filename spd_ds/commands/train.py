"""Distil a speculation head for a target (knowledge distillation, DeepSpeed ZeRO-2).

Examples::

    deepspeed launch/train.py --config launch/configs/train_smollm2_n3.yaml --deepspeed_config ds_configs/zero2.json
    deepspeed --num_gpus 8 launch/train.py --config EXP.yaml --deepspeed_config ds_configs/zero2.json train.lr=3e-4
    deepspeed launch/train.py --config EXP.yaml --deepspeed_config ds_configs/zero2.json --resume

Overrides are ``section.key=value`` (values parsed as YAML; unknown keys are refused). The run directory
(``train.output_dir``) receives ``config.yaml``, ``train_log.jsonl``, ``checkpoints/`` and the final ``head/``.
See docs/training.md.
"""

from __future__ import annotations

import contextlib
import os
import sys



def main(argv: list[str] | None = None) -> int:
    """Train. Exit status 0; 2 after a user error (one line: config, data, chat template, model); under a launcher 1
    after any other error (one rank-tagged line, traceback in a log file; ``SPD_DEBUG=1`` prints it)."""
    from spd_ds.cli import data_user_errors, run_cli

    return run_cli(_main, argv, user_errors=data_user_errors, prog="train")


def _main(argv: list[str] | None = None) -> int:
    from spd_ds.cli import experiment_parser, removed_if_left_empty, setup_process

    ap = experiment_parser(__doc__.split("\n\n")[0], overrides_help="section.key=value overrides, e.g. train.lr=3e-4",
                           config_help="experiment YAML (sections model, partition, head, data, train)")
    ap.add_argument("--deepspeed_config", default="ds_configs/zero2.json", help="DeepSpeed JSON of the head's engine")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in train.output_dir")
    args = ap.parse_args(argv)
    setup_process()

    from spd_ds.config import load_config

    cfg = load_config(args.config, args.overrides)
    from spd_ds.train.loop import train

    cache = cfg.train.compile_cache  # its folder is made at the start (spd_ds.train.preflight)
    try:  # a refused run leaves no empty train.output_dir, nor an empty folder made for train.compile_cache
        with (removed_if_left_empty(cfg.train.output_dir),
              removed_if_left_empty(os.path.dirname(os.path.abspath(cache))) if cache else contextlib.nullcontext()):
            train(cfg, args.deepspeed_config, resume=True if args.resume else None)
    finally:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
