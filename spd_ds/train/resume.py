"""Resuming a head-distillation run: what a checkpoint must share with the invocation that resumes it, the
schedule it keeps, its log, and the RNG states it restores (used by :func:`spd_ds.train.loop.train`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from spd_ds.config import ConfigError, ExperimentConfig
from spd_ds.train.history import read_train_log

RUN_FILE = "run.json"  # in every checkpoint folder: what a resume must share with it (run_identity)


def rng_state() -> dict:
    """Python, NumPy and torch RNG states (saved in checkpoints)."""
    import numpy as np

    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    """Restore the Python, NumPy, torch (and CUDA) generators from a state saved in a checkpoint."""
    import numpy as np

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def run_identity(cfg: ExperimentConfig, arch, part, head, world: int, degree: int, gas: int) -> dict:
    """What a resumed run must share with its checkpoint, as JSON values keyed by the settings that decide them.

    The target's weights (:meth:`~spd_ds.models.adapter.TargetArch.fingerprint`), the stage partition, the head's
    shape, the world size (ZeRO-2 partitions the optimizer state by it, and the data plan shards by it) and what
    shapes the data plan (rows, row length, packing, gradient accumulation, teacher pipe degree): resuming with
    another value would load state that means something else, or fail inside DeepSpeed. Written beside every
    checkpoint (:data:`RUN_FILE`) and compared by :func:`check_resume`.
    """
    dc = cfg.data
    identity = {
        "model.name (weights)": arch.fingerprint(), "partition": part.to_dict(),
        "head.num_layers": head.num_layers, "head (draft vocabulary size)": head.draft_vocab_size,
        "world size": world, "train.teacher_pipe_degree": degree,
        "data.micro_batch_size": dc.micro_batch_size, "data.max_seq_length": dc.max_seq_length,
        "data.pack": dc.pack, "data.skip_loops": dc.skip_loops, "gradient_accumulation_steps": gas,
    }
    return json.loads(json.dumps(identity))  # as it reads back from the file (tuples become lists)


def check_resume(ckpt_dir: Path, identity: dict) -> None:
    """Refuse to resume the newest checkpoint under ``ckpt_dir`` with settings other than its run's.

    Args:
        ckpt_dir: the run's ``checkpoints`` folder (its ``latest`` names the newest).
        identity: this invocation's :func:`run_identity`.
    Raises:
        ConfigError: one line naming every setting that differs, with the run's value and the new one. Checkpoints
            written before :data:`RUN_FILE` existed are not checked. A missing checkpoint
            (:func:`check_checkpoint_files`).
    """
    check_checkpoint_files(ckpt_dir)
    path = ckpt_dir / (ckpt_dir / "latest").read_text().strip() / RUN_FILE
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    diffs = [f"{key} {saved[key]} (now {identity.get(key)})" for key in saved if identity.get(key) != saved[key]]
    if diffs:
        raise ConfigError(f"{ckpt_dir.parent} was trained with other settings: {'; '.join(diffs)}. Resume with the "
                          "run's own settings, or start a new train.output_dir (head.checkpoint=<its head or "
                          "best_head> warm-starts from it)")


def damaged_checkpoint_advice(ckpt_dir: Path, tag: str) -> str:
    """What to do when checkpoint ``tag`` cannot be resumed: resume an earlier one, or start anew."""
    earlier = sorted((d.name for d in ckpt_dir.glob("step*") if d.is_dir() and d.name != tag),
                     key=lambda name: int(name[4:]) if name[4:].isdigit() else -1, reverse=True)
    if earlier:
        return (f"resume the one before (`echo {earlier[0]} > {ckpt_dir / 'latest'}`; it holds {', '.join(earlier)}), "
                "or start a new train.output_dir")
    return "start a new train.output_dir (or drop --resume)"


def check_checkpoint_files(ckpt_dir: Path) -> None:
    """Refuse a ``latest`` that names no checkpoint, or a checkpoint without DeepSpeed's model and optimizer files
    (DeepSpeed itself fails there with a bare AssertionError).

    Raises:
        ConfigError: one line naming the checkpoint, what is missing, and what to resume instead.
    """
    tag = (ckpt_dir / "latest").read_text().strip()
    where = ckpt_dir / tag
    if not where.is_dir():
        missing = "no such folder"
    elif not (where / "mp_rank_00_model_states.pt").is_file():
        missing = "no mp_rank_00_model_states.pt"
    elif not any(where.glob("*optim_states.pt")):
        missing = "no optimizer state (*optim_states.pt)"
    else:
        return
    raise ConfigError(f"{ckpt_dir / 'latest'} names checkpoint {tag!r}, which cannot be resumed ({missing}); "
                      f"{damaged_checkpoint_advice(ckpt_dir, tag)}")


def check_resumed_schedule(schedule, base_lr: float, weight_decay: float, tc, total_steps: int,
                           say) -> None:
    """After a checkpoint is loaded: the run keeps the learning-rate schedule and optimizer settings it was saved
    with. Changed settings are ignored with one warning (through ``say``), except a longer run.

    Args:
        schedule: the restored :class:`~spd_ds.train.loop.WarmupLinear` (``warmup``, ``total`` steps, ``stable``
            fraction of the run).
        base_lr, weight_decay: the restored optimizer's.
        tc: this invocation's ``TrainConfig``; total_steps: the steps it would take.
    Raises:
        ConfigError: ``total_steps`` above the schedule's: the learning rate reaches 0 at the schedule's end, so the
            extra steps would not train (warm-start a new run from the head instead).
    """
    if total_steps > schedule.total:
        raise ConfigError(f"the run's learning-rate schedule ends at step {schedule.total} (decayed to 0); "
                          f"train.max_steps / train.epochs now ask for {total_steps} steps, which would not train. "
                          "Resume with the run's own settings, or start a new train.output_dir with "
                          "head.checkpoint=<its head or best_head>")
    ignored = [f"{key}={new:g} (the run keeps {old:g})" for key, new, old in (
        ("train.lr", tc.lr, base_lr), ("train.warmup_steps", tc.warmup_steps, schedule.warmup),
        ("train.lr_stable_fraction", tc.lr_stable_fraction, schedule.stable),
        ("train.weight_decay", tc.weight_decay, weight_decay)) if new != old]
    if ignored:
        say(f"warning: ignored on resume, from its checkpoint the run keeps its schedule: {'; '.join(ignored)}")
    if total_steps < schedule.total:
        say(f"warning: the run now ends at step {total_steps}, before its schedule's end at step {schedule.total} "
            "(the learning rate will not have decayed to 0)")


def truncate_log(path: Path, step: int) -> None:
    """Start ``train_log.jsonl`` for a run at optimizer step ``step``: a fresh run (``step = 0``) removes it, a
    resumed one keeps the records up to its checkpoint's step, so that the steps a crash had logged after it are
    not logged twice (a line the crash cut short is dropped too)."""
    if step == 0 or not path.exists():
        path.unlink(missing_ok=True)
        return
    keep = [rec for rec in read_train_log(path) if isinstance(rec.get("step"), int) and rec["step"] <= step]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in keep))  # as the loop writes them


__all__ = ["RUN_FILE", "run_identity", "check_resume", "check_checkpoint_files", "damaged_checkpoint_advice",
           "check_resumed_schedule", "truncate_log", "rng_state", "set_rng_state"]
