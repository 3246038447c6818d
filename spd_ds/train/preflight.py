"""The training settings checked by :func:`spd_ds.train.loop.train` on every rank before it starts the process group
(or loads anything large): a bad value is one line (naming the setting and what to give) within seconds, not after
the target is loaded, and every rank raises the same error before any collective can hang.
:func:`check_train_settings` needs neither the target nor a process group; :func:`check_target_settings` needs only
the target's geometry (its ``config.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spd_ds.config import ConfigError, ExperimentConfig

if TYPE_CHECKING:
    from spd_ds.models.adapter import TargetArch
    from spd_ds.partition import StagePartition

AUTOCAST_MODES = ("auto", "bf16", "off")


def training_device_type() -> str:
    """``cuda`` where DeepSpeed's accelerator is CUDA (the device :func:`~spd_ds.train.loop.train` trains on), else
    ``cpu``; needs no process group."""
    from deepspeed.accelerator import get_accelerator

    return "cuda" if get_accelerator().device_name() == "cuda" else "cpu"


def check_train_settings(cfg: ExperimentConfig, world: int, device_type: str) -> None:
    """Refuse the ``train:``/``data:`` values that training would otherwise refuse only once the target is loaded.

    Checks ``train.outside_vocab``, ``train.autocast``, ``train.attention`` (``flex`` needs CUDA), a set
    ``train.teacher_pipe_degree`` and ``data.micro_batch_size`` against it (:func:`check_pipe_degree`; ``n`` is the
    configured number of stages, ``partition.stage_layers`` or ``partition.num_stages``, left to the partition when
    neither is set), ``data.chat_template`` (an existing file or Jinja text), and ``train.compile_cache``: a file that
    can be written (its folder is created now; a folder, a path ending in ``/``, or one that cannot be written or
    whose folder cannot be, is refused: :func:`~spd_ds.compile_cache.check_compile_cache_path`), not a cache lost
    after the run.

    Args:
        cfg: the experiment.
        world: processes in the launch (the launcher's ``WORLD_SIZE``).
        device_type: ``cuda`` or ``cpu`` (:func:`training_device_type`).
    Raises:
        ConfigError / ChatTemplateError: one line naming the setting and what to change.
    """
    from spd_ds.builder import configured_num_stages
    from spd_ds.compile_cache import check_compile_cache_path
    from spd_ds.train.chat import read_chat_template
    from spd_ds.train.loss import OUTSIDE_VOCAB_POLICIES
    from spd_ds.train.student import resolve_attention

    tc, dc = cfg.train, cfg.data
    if tc.outside_vocab not in OUTSIDE_VOCAB_POLICIES:
        raise ConfigError(f"train.outside_vocab must be one of {OUTSIDE_VOCAB_POLICIES}, got {tc.outside_vocab!r}")
    check_autocast(tc.autocast)
    try:  # a resumed run's own attention only changes what auto picks, which is never refused
        resolve_attention(tc.attention, torch.device(device_type))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if tc.teacher_pipe_degree is not None:  # a set one (an automatic one needs the target's size: checked later)
        known = cfg.partition.stage_layers or cfg.partition.num_stages is not None
        check_pipe_degree(tc.teacher_pipe_degree, configured_num_stages(cfg) if known else None, world,
                          dc.micro_batch_size)
    read_chat_template(dc.chat_template)
    if tc.compile_cache:  # written at the end by the logging rank: a path it cannot write lost the run's kernels
        check_compile_cache_path(tc.compile_cache, "train.compile_cache")


def check_autocast(mode: str) -> None:
    """Refuse a ``train.autocast`` that is not one of :data:`AUTOCAST_MODES`.

    Raises:
        ConfigError: one line naming the value and the modes.
    """
    if mode not in AUTOCAST_MODES:
        raise ConfigError(f"train.autocast must be auto, bf16 or off, got {mode!r}")


def check_pipe_degree(degree: int, n: int | None, world: int, micro_batch_size: int) -> None:
    """Refuse a teacher pipeline degree (``train.teacher_pipe_degree``, set or automatic) that is not 1 or ``n``
    (the stages) or does not divide the world size ``world`` (processes), or that ``data.micro_batch_size`` (rows)
    is no multiple of (each pipeline rank trains the head on its share of the rows). ``n`` None: the stage count is
    not known yet (left to the partition), so only the micro-batch rule applies.

    Raises:
        ConfigError: one line naming the setting and what it must be.
    """
    if n is not None and (degree not in (1, n) or world % degree):
        raise ConfigError(f"train.teacher_pipe_degree={degree} must be 1 or n={n} and divide the world size {world}")
    if micro_batch_size % degree:
        raise ConfigError(f"data.micro_batch_size={micro_batch_size} must be a multiple of "
                          f"train.teacher_pipe_degree={degree} (each pipeline rank trains the head on its share)")


def check_target_settings(cfg: ExperimentConfig, arch: "TargetArch") -> "StagePartition":
    """Refuse the settings that need the target's geometry (its ``config.json``, read by the
    :class:`~spd_ds.models.adapter.TargetArch` that :func:`spd_ds.builder.build_arch` makes; no weight is read), on
    every rank before the process group starts: the partition (``partition.num_stages`` / ``stage_layers`` /
    ``anchors`` against the target's layers, and against ``head.checkpoint``'s partition;
    :func:`~spd_ds.builder.build_partition`), ``data.max_seq_length`` against the target's context, a new head's
    ``head.tower_init_layer`` against its layers (:func:`~spd_ds.head.tower_init_index`) and ``head.draft_vocab``'s ids
    against its vocabulary (:func:`~spd_ds.builder.draft_vocab_ids`).

    Args:
        cfg: the experiment (``head.checkpoint`` / ``head.draft_vocab`` resolved in it, as the builders do).
        arch: the target's :class:`~spd_ds.models.adapter.TargetArch`.
    Returns:
        The run's :class:`~spd_ds.partition.StagePartition`.
    Raises:
        ConfigError: one line naming the setting and what to give.
    """
    from spd_ds.builder import build_partition, draft_vocab_ids
    from spd_ds.head import tower_init_index

    part = build_partition(cfg, arch)
    dc = cfg.data
    if dc.max_seq_length > arch.max_positions:  # a document may fill a row; the teacher's features end at its context
        why = " (its sliding window)" if arch.max_positions_source == "sliding_window" else ""
        raise ConfigError(f"data.max_seq_length={dc.max_seq_length} exceeds the target's context of "
                          f"{arch.max_positions} positions{why}; set data.max_seq_length <= {arch.max_positions}")
    if cfg.head.tower_init_layer is not None and not cfg.head.checkpoint:  # (a loaded head ignores it)
        tower_init_index(cfg.head.tower_init_layer, arch)
    if cfg.head.draft_vocab:
        draft_vocab_ids(cfg.head.draft_vocab, arch.vocab_size)
    return part


def resume_note(resume: bool, ckpt_dir: Path) -> str | None:
    """The line that says a ``--resume`` (``train.resume=true``) finds no checkpoint in ``ckpt_dir`` and starts
    fresh (said before anything is loaded, so that a mistyped ``train.output_dir`` can be stopped at once), or
    ``None``."""
    if resume and not (Path(ckpt_dir) / "latest").exists():
        return f"train.resume: no checkpoint under {ckpt_dir}; starting fresh"
    return None


__all__ = ["AUTOCAST_MODES", "check_autocast", "check_pipe_degree", "check_target_settings", "check_train_settings",
           "resume_note", "training_device_type"]
