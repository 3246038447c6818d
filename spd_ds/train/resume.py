"""Resuming a head-distillation run: what a checkpoint must share with the invocation that resumes it, the
schedule it keeps, its log, and the RNG states it restores; and what a run from step 0 refuses or replaces in its
output folder (used by :func:`spd_ds.train.loop.train`)."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import shutil
from pathlib import Path

import torch

from spd_ds.config import ConfigError, ExperimentConfig
from spd_ds.files import replaced_when_done
from spd_ds.train.history import SUMMARY_FILE, read_train_log
from spd_ds.train.validate import BEST_BACKUP, BEST_DIR, BEST_TMP, eval_batches_used

CHECKPOINTS = "checkpoints"  # the run's DeepSpeed checkpoints: train.output_dir/checkpoints/step<N>, latest
RUN_FILE = "run.json"  # in every checkpoint folder: what a resume must share with it (run_identity)
DS_STAGE = "--deepspeed_config zero_optimization.stage"  # run_identity's keys for the head engine's DeepSpeed config
DS_BF16 = "--deepspeed_config bf16.enabled"
AUTOCAST = "train.autocast (head compute dtype)"  # run_identity's key for the resolved train.autocast
DRAFT_VOCAB = "head.draft_vocab"  # run_identity's key for the draft ids: {"blake2b", "size", "from" (their source)}
EVAL_BATCHES = "train.eval_batches"  # run_identity's key for the validation set: eval_batches_identity's dict


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


def draft_vocab_digest(draft_ids: torch.Tensor) -> str:
    """``blake2b:<32 hex>`` of a head's draft ids (sorted, as little-endian int64): two vocabularies of one size get
    different digests unless they hold the same ids (``head.draft_vocab=full`` and null: every id of the target)."""
    ids = torch.sort(draft_ids.detach().to("cpu", torch.int64).reshape(-1)).values.numpy().astype("<i8")
    return "blake2b:" + hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def data_identity(data, held_out: int) -> dict:
    """What a checkpoint records of the data it was trained on (the ``data`` of its client state), compared by
    :func:`check_resumed_data` on a resume: ``{"examples", "tokens", "held_out", "blake2b"}``, the last a digest
    (``blake2b:<32 hex>``) of every training example's token ids and assistant mask in order, so that other data of
    the same size is told apart from the run's. ``data``: the tokenised training examples
    (:class:`~spd_ds.train.data.TokenizedData`); ``held_out``: the number of held-out records."""
    import numpy as np

    h = hashlib.blake2b(digest_size=16)
    for ids, mask in zip(data.input_ids, data.assistant_mask):
        ids = np.asarray(ids, dtype="<i8")
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.tobytes())
        h.update(np.asarray(mask, dtype="<i1").tobytes())
    return {"examples": len(data), "tokens": int(data.num_tokens), "held_out": int(held_out),
            "blake2b": "blake2b:" + h.hexdigest()}


def check_resumed_data(ckpt_dir: Path, saved: dict | None, now: dict) -> None:
    """Refuse to resume a checkpoint on other data than it was trained on.

    Args:
        ckpt_dir: the run's ``checkpoints`` folder (for the message).
        saved: the checkpoint's :func:`data_identity` (``None``: not recorded; a checkpoint written before the
            digest holds the counts alone, which are then all that is compared).
        now: this invocation's :func:`data_identity`.
    Raises:
        ConfigError: one line naming both and what to change.
    """
    if saved is not None and any(k in saved and saved[k] != v for k, v in now.items()):
        raise ConfigError(f"{ckpt_dir} was trained on other data ({saved}; now {now}): resume with the run's "
                          "data.train_files (and data settings), or start a new train.output_dir")


def _dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (``None``: ``"off"``), as :func:`run_identity` records a dtype."""
    return "off" if dtype is None else str(dtype).removeprefix("torch.")


def _vocab_source(cfg: ExperimentConfig, head) -> str:
    """Where the head's draft ids came from, for messages: the ``head.draft_vocab`` file (or ``full``), else the
    vocabulary of ``head.checkpoint`` (which keeps its own unless its LM head is the target's)."""
    hc = cfg.head
    if hc.draft_vocab and (not hc.checkpoint or head.lm_head_from_target):
        return str(hc.draft_vocab)
    return f"that of head.checkpoint={hc.checkpoint}" if hc.checkpoint else "full"


def run_identity(cfg: ExperimentConfig, arch, part, head, world: int, degree: int, gas: int,
                 ds_config: dict | None = None, compute: dict | None = None, held_out: int | None = None) -> dict:
    """What a resumed run must share with its checkpoint, as JSON values keyed by the settings that decide them.

    The target's weights (:meth:`~spd_ds.models.adapter.TargetArch.fingerprint`), the stage partition, the head's
    shape and draft ids (:data:`DRAFT_VOCAB`: their :func:`draft_vocab_digest` and where they came from; the
    teacher's targets are built from the configured ids while the checkpoint restores the head's own), the world size
    (ZeRO-2 partitions the optimizer state by it, and the data plan shards by it) and what shapes the data plan
    (rows, row length, packing, gradient accumulation, teacher pipe degree), ``train.seed`` (the epoch plan's
    shuffle, the fills drawn, the held-out split) and the objective (``train.kd_temperature``,
    ``train.full_pipeline_prob``, ``train.outside_vocab``), the teacher's dtype (``model.dtype``: the targets and
    features the head learns from), the held-out micro-batches per validation (:data:`EVAL_BATCHES`: a best head
    restored from the checkpoint was picked on them, and the resumed run's figures are compared with it; their
    number as ``train.eval_batches`` resolves on the held-out split, :func:`eval_batches_identity`, once the caller
    knows the split: ``held_out``), and with
    ``ds_config`` (the head engine's DeepSpeed config) its ZeRO stage and bf16 switch, which decide the optimizer
    checkpoint's layout and file names; with ``compute`` the run's compute as resolved on this device:
    ``{"autocast": torch.dtype | None, "attention": "flex" | "dense", "teacher_attention": "sdpa" | "flex"}``
    (``train.autocast``, ``train.attention``, ``train.teacher_attention``; ``auto`` resolved, so a move between CPU
    and CUDA that changes them counts). Resuming with another value would load state that means something else, fail
    inside DeepSpeed (a bf16 switch changed: a missing ``bf16_`` optimizer file, reported as a damaged checkpoint;
    ZeRO-2 to 0: an ``AttributeError``), or silently train the rest of the run on another data order, loss, precision
    or kernels than the uninterrupted run (and pick its best head on other validation figures). Written beside every
    checkpoint (:data:`RUN_FILE`) and compared by :func:`check_resume` (a key that an older run's file lacks is not
    compared).

    Args:
        held_out: the held-out micro-batches of the split over all ranks
            (:attr:`~spd_ds.train.validate.Validator.available`; 0 without validation). ``None``: not known yet
            (the data is loaded after the first :func:`check_resume`): :data:`EVAL_BATCHES` then holds the setting
            alone, which :func:`check_resume` does not compare; set it with :func:`eval_batches_identity` and check
            again once the split is known.
    """
    from spd_ds.models.adapter import resolve_dtype

    dc, tc = cfg.data, cfg.train
    identity = {
        "model.name (weights)": arch.fingerprint(), "partition": part.to_dict(),
        "head.num_layers": head.num_layers, "head (draft vocabulary size)": head.draft_vocab_size,
        DRAFT_VOCAB: {"blake2b": draft_vocab_digest(head.draft_ids), "size": head.draft_vocab_size,
                      "from": _vocab_source(cfg, head)},
        "world size": world, "train.teacher_pipe_degree": degree,
        "data.micro_batch_size": dc.micro_batch_size, "data.max_seq_length": dc.max_seq_length,
        "data.pack": dc.pack, "data.skip_loops": dc.skip_loops, "gradient_accumulation_steps": gas,
        "train.seed": tc.seed, "train.kd_temperature": tc.kd_temperature,
        "train.full_pipeline_prob": tc.full_pipeline_prob, "train.outside_vocab": tc.outside_vocab,
        "model.dtype": _dtype_name(resolve_dtype(cfg.model.dtype)),
        EVAL_BATCHES: eval_batches_identity(tc.eval_batches, held_out),
    }
    if compute is not None:
        identity[AUTOCAST] = _dtype_name(compute["autocast"])
        identity["train.attention"] = compute["attention"]
        identity["train.teacher_attention"] = compute["teacher_attention"]
    if ds_config is not None:
        identity[DS_STAGE] = (ds_config.get("zero_optimization") or {}).get("stage", 0)
        identity[DS_BF16] = bool((ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled", False))
    return json.loads(json.dumps(identity))  # as it reads back from the file (tuples become lists)


def eval_batches_identity(setting: int | None, held_out: int | None) -> dict:
    """:func:`run_identity`'s :data:`EVAL_BATCHES`: ``{"setting": train.eval_batches (None = all), "micro_batches":
    the held-out micro-batches a validation runs over all ranks (the setting capped by the split's), "held_out":
    the split's}``; with ``held_out=None`` (the split not known yet) ``{"setting": ...}`` alone (not compared).

    The validation set is the first ``micro_batches`` of the split's fixed list
    (:func:`~spd_ds.train.validate.held_out_plan`): two settings that resolve to the same number (``null`` and 16 on
    a split of 16 micro-batches or fewer) evaluate on the same micro-batches, and a resume compares that number.
    """
    if held_out is None:
        return {"setting": setting}
    return {"setting": setting, "micro_batches": eval_batches_used(setting, held_out), "held_out": int(held_out)}


def _eval_batches_diff(old, new: dict) -> str | None:
    """The :data:`EVAL_BATCHES` part of :func:`check_resume`'s message, or ``None`` when the held-out micro-batches
    match (or this invocation's are not known yet, or the held-out split differs: other data, refused by the data
    check once the checkpoint is loaded, in its own words). A :data:`RUN_FILE` written before the resolved number was
    recorded holds the raw setting (an int, or null = all): it is resolved on this invocation's held-out split, which
    is the run's whenever the resume goes on (the split's layout is compared here, its data once the checkpoint is
    loaded)."""
    if not isinstance(new, dict) or "micro_batches" not in new:
        return None
    if isinstance(old, dict) and "micro_batches" in old:
        if old.get("held_out") != new["held_out"]:  # another held-out split: other data, which the data check
            return None  # names once the checkpoint is loaded ("was trained on other data")
        old_set, old_used = old.get("setting"), old["micro_batches"]
    else:
        old_set = old.get("setting") if isinstance(old, dict) else old
        old_used = eval_batches_identity(old_set, new["held_out"])["micro_batches"]
    if old_used == new["micro_batches"]:  # on one split, equal settings resolve alike: only a changed one differs
        return None

    def setting(v) -> str:
        return "null" if v is None else str(v)

    return (f"{EVAL_BATCHES} {old_used} held-out micro-batches, set to {setting(old_set)} "
            f"(now {new['micro_batches']}, set to {setting(new['setting'])})")


def write_run_file(where: Path, identity: dict) -> str | None:
    """Write ``identity`` (:func:`run_identity`) whole to ``where``/:data:`RUN_FILE` (a checkpoint folder, made if
    missing), before DeepSpeed saves into it: a kill mid-save then leaves no checkpoint named by ``latest`` without it.

    Returns:
        ``None``, or what went wrong in one line with what to do (a full disk, no permission), for the caller to
        share with the other ranks before any of them enters DeepSpeed's save.
    """
    try:
        where.mkdir(parents=True, exist_ok=True)
        with replaced_when_done(where / RUN_FILE) as tmp:
            tmp.write_text(json.dumps(identity, indent=1))
    except OSError as e:
        return (f"cannot write {where / RUN_FILE} ({e.strerror or e}); fix the cause (a full disk, no permission), "
                "then resume (--resume continues from the checkpoint before)")
    return None


def check_resume(ckpt_dir: Path, identity: dict) -> None:
    """Refuse to resume the newest checkpoint under ``ckpt_dir`` with settings other than its run's.

    Args:
        ckpt_dir: the run's ``checkpoints`` folder (its ``latest`` names the newest).
        identity: this invocation's :func:`run_identity`.
    Raises:
        ConfigError: one line naming every setting that differs, with the run's value and the new one (the draft
            vocabulary by where its ids came from and their digest; its size alone when the run's :data:`RUN_FILE`
            predates the digest; the validation set by its resolved number of held-out micro-batches, with both
            settings when they differ: :func:`eval_batches_identity`). Checkpoints written before :data:`RUN_FILE`
            existed are not checked. A missing
            checkpoint (:func:`check_checkpoint_files`), a :data:`RUN_FILE` that cannot be read or holds no JSON
            object, or a missing rank's optimizer shard (:func:`check_optimizer_shards`).
    """
    check_checkpoint_files(ckpt_dir)
    tag = (ckpt_dir / "latest").read_text().strip()
    path = ckpt_dir / tag / RUN_FILE
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # cut short or damaged on disk (a JSON or UTF-8 error is a ValueError)
            saved = e
        if not isinstance(saved, dict):
            why = f"{type(saved).__name__}: {str(saved)[:120]}" if isinstance(saved, Exception) else "not an object"
            raise ConfigError(f"{ckpt_dir / 'latest'} names checkpoint {tag!r}, whose {RUN_FILE} cannot be read "
                              f"({why}); {damaged_checkpoint_advice(ckpt_dir, tag)}")
        _check_identity(ckpt_dir, saved, identity)
    check_optimizer_shards(ckpt_dir, identity.get("world size"))


def recorded_attention(ckpt_dir: Path) -> str | None:
    """``train.attention`` as the newest checkpoint under ``ckpt_dir`` records it in its :data:`RUN_FILE`: the head's
    attention as the run ran it (``flex`` or ``dense``; ``dense`` after FlexAttention failed and ``auto`` fell back,
    in a file written since that is recorded). ``None``: no checkpoint, no such file or key, or one that cannot be
    read (:func:`check_resume` reports it)."""
    try:
        tag = (ckpt_dir / "latest").read_text().strip()
        ran = json.loads((ckpt_dir / tag / RUN_FILE).read_text()).get("train.attention")
    except (OSError, ValueError, AttributeError):
        return None
    return ran if ran in ("flex", "dense") else None


def flex_kept_message(ckpt_dir: Path) -> str:
    """What a resumed ``train.attention=auto`` run whose checkpoint ran FlexAttention says when FlexAttention fails
    on this machine (:class:`~spd_ds.train.student.HeadTrainModule`'s ``fallback``): falling back to the dense
    mask would change the run's numerics."""
    return (f"{ckpt_dir.parent} trained with train.attention=flex (run.json), which fails here; resume it where "
            "FlexAttention runs, or start a new train.output_dir (head.checkpoint=<its head or best_head> warm-starts "
            "from it)")


def _lost_ranks(shards: list[str], world: int) -> list[int]:
    """The data-parallel ranks ``r < world`` without a ZeRO optimizer shard (``..zero_pp_rank_<r>_mp_rank_..``)
    among the file names ``shards``."""
    return [r for r in range(world) if not any(f"zero_pp_rank_{r}_mp_rank_" in name for name in shards)]


def check_optimizer_shards(ckpt_dir: Path, world: int | None) -> None:
    """Refuse a ZeRO checkpoint that lacks one data-parallel rank's optimizer shard
    (``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` for every ``r < world``), so that every rank names the
    damaged checkpoint before any of them loads (DeepSpeed fails on the rank whose file is gone, and the others
    would first report a successful resume). Checkpoints without ``zero_pp_rank`` files are left alone. Every rank
    reads the same folder: the check assumes the checkpoint directory is shared by all nodes, as the resume does.

    Raises:
        ConfigError: one line naming the checkpoint, the missing ranks' shards and what to resume instead.
    """
    tag = (ckpt_dir / "latest").read_text().strip()
    where = ckpt_dir / tag
    shards = [f.name for f in where.glob("*zero_pp_rank_*optim_states.pt")]
    if not shards or not world:
        return
    missing = _lost_ranks(shards, int(world))
    if missing:
        bf16 = "bf16_" if any(name.startswith("bf16_") for name in shards) else ""
        raise ConfigError(f"{ckpt_dir / 'latest'} names checkpoint {tag!r}, which cannot be resumed (no optimizer "
                          f"state of rank {', '.join(map(str, missing))} of {world}: "
                          f"{bf16}zero_pp_rank_<rank>_mp_rank_00_optim_states.pt); "
                          f"{damaged_checkpoint_advice(ckpt_dir, tag)}")


def _check_identity(ckpt_dir: Path, saved: dict, identity: dict) -> None:
    """The settings of :func:`check_resume` compared; raises its ``ConfigError``."""

    def vocab(v) -> str:
        return f"{v.get('from')}, {v.get('size')} ids {v.get('blake2b')}" if isinstance(v, dict) else str(v)

    def digest(v):
        return v.get("blake2b") if isinstance(v, dict) else v

    diffs = {}
    for key, old in saved.items():
        new = identity.get(key)
        if key == DRAFT_VOCAB:  # the ids decide, not the file that named them
            if digest(old) != digest(new):
                diffs[key] = f"{key} {vocab(old)} (now {vocab(new)})"
        elif key == EVAL_BATCHES:  # the micro-batches evaluated decide, not the setting that capped them
            said = _eval_batches_diff(old, new)
            if said:
                diffs[key] = said
        elif new != old:
            diffs[key] = f"{key} {old} (now {new})"
    if DRAFT_VOCAB in diffs:  # names the vocabularies: their sizes add nothing
        diffs.pop("head (draft vocabulary size)", None)
    diffs = list(diffs.values())
    if diffs:
        raise ConfigError(f"{ckpt_dir.parent} was trained with other settings: {'; '.join(diffs)}. Resume with the "
                          "run's own settings, or start a new train.output_dir (head.checkpoint=<its head or "
                          "best_head> warm-starts from it)")


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step<N>``, N in ASCII digits), or ``None``."""
    digits = name[4:]
    return int(digits) if name.startswith("step") and digits.isascii() and digits.isdecimal() else None


def _missing(where: Path) -> str | None:
    """What checkpoint folder ``where`` lacks of a whole DeepSpeed checkpoint, by its files, or ``None``: the model
    states, and the optimizer state (inside the model states at ZeRO stage 0, as its :data:`RUN_FILE` records; else
    ``*optim_states.pt``, one per rank of the world its :data:`RUN_FILE` counts, or one at least without it)."""
    if not where.is_dir():
        return "no such folder"
    if not (where / "mp_rank_00_model_states.pt").is_file():
        return "no mp_rank_00_model_states.pt"
    try:
        saved = json.loads((where / RUN_FILE).read_text())
    except (OSError, ValueError):  # none (older checkpoints), or cut short: one optimizer file at least
        saved = None
    saved = saved if isinstance(saved, dict) else {}
    if saved.get(DS_STAGE) == 0:  # the optimizer's state is saved with the model's
        return None
    shards = [f.name for f in where.glob("*optim_states.pt")]
    if not shards:
        return "no optimizer state (*optim_states.pt)"
    world = saved.get("world size")
    zero = isinstance(world, int) and any("zero_pp_rank_" in s for s in shards)
    lost = _lost_ranks(shards, world) if zero else []
    return f"no optimizer state of rank {', '.join(map(str, lost))} of {world}" if lost else None


def _step_folders(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """The ``step<N>`` folders of ``ckpt_dir`` with their steps, oldest first (ties by name); other names skipped."""
    steps = [(checkpoint_step(p.name), p) for p in Path(ckpt_dir).glob("step*") if p.is_dir()]
    return sorted(((s, p) for s, p in steps if s is not None), key=lambda sp: (sp[0], sp[1].name))


def whole_checkpoints(ckpt_dir: Path, below: int | None = None) -> list[str]:
    """The ``step<N>`` folders of ``ckpt_dir`` (of steps below ``below``, when given) that hold a whole DeepSpeed
    checkpoint by their files (:func:`_missing`), newest first. A folder a kill cut short mid-save is not one."""
    steps = [p for s, p in reversed(_step_folders(ckpt_dir)) if below is None or s < below]
    return [p.name for p in steps if _missing(p) is None]


def prune_checkpoints(ckpt_dir: Path, step: int, keep: int) -> list[str]:
    """After checkpoint ``step<step>`` is saved (rank 0 only): remove the folders of later steps that hold no whole
    checkpoint (:func:`_missing`: what a kill mid-save left; nothing can resume them, and a run that ends before their
    step never replaced them), and keep the newest ``keep`` of the steps up to ``step`` (0 keeps all). A later step's
    folder with all its files (a save killed after writing them, before ``latest``) is neither counted nor removed:
    counting it would remove the checkpoint just saved; so is one that cannot be read (no error: the other ranks wait
    at the save's barrier), or a link. ``step`` counts optimizer steps; ``keep`` is ``train.keep_checkpoints``.
    Returns the names of the cut-short later folders removed (``["step12"]``), for the log."""
    def cut_short(p: Path) -> bool:
        try:
            return not p.is_symlink() and _missing(p) is not None
        except OSError:  # unreadable (no permission): not judged, kept
            return False

    steps = _step_folders(ckpt_dir)
    later = [p for s, p in steps if s > step and cut_short(p)]
    earlier = [p for s, p in steps if s <= step]
    for old in later + (earlier[:-keep] if keep > 0 else []):
        shutil.rmtree(old, ignore_errors=True)
    return [p.name for p in later if not p.exists()]


def damaged_checkpoint_advice(ckpt_dir: Path, tag: str) -> str:
    """What to do when checkpoint ``tag`` cannot be resumed: resume an earlier whole one (:func:`whole_checkpoints`
    of a lower step; a later step's folder is what a save cut short by a kill left), or start anew."""
    earlier = [name for name in whole_checkpoints(ckpt_dir, checkpoint_step(tag)) if name != tag]
    if earlier:
        return (f"resume the one before (`echo {earlier[0]} > {ckpt_dir / 'latest'}`; it holds {', '.join(earlier)}), "
                "or start a new train.output_dir")
    return f"start a new train.output_dir, or remove {ckpt_dir} to train there anew"


def check_checkpoint_files(ckpt_dir: Path) -> None:
    """Refuse a ``latest`` that names no checkpoint, or a checkpoint without DeepSpeed's model and optimizer files
    (DeepSpeed itself fails there with a bare AssertionError).

    Raises:
        ConfigError: one line naming the checkpoint, what is missing, and what to resume instead; or saying that
            ``latest`` is empty (a save cut short), with the newest whole checkpoint to name in it.
    """
    tag = (ckpt_dir / "latest").read_text().strip()
    where = ckpt_dir / tag
    if not tag:  # DeepSpeed empties the file, then writes the tag: a kill in between
        advice = damaged_checkpoint_advice(ckpt_dir, tag).replace("the one before", "the newest whole one")
        raise ConfigError(f"{ckpt_dir / 'latest'} is empty (a checkpoint save was cut short while writing it); "
                          f"{advice}")
    missing = _missing(where)
    if missing is None:
        return
    raise ConfigError(f"{ckpt_dir / 'latest'} names checkpoint {tag!r}, which cannot be resumed ({missing}); "
                      f"{damaged_checkpoint_advice(ckpt_dir, tag)}")


def check_max_steps(ckpt_dir: Path, max_steps: int | None) -> None:
    """Before any model, data or engine is built: refuse ``train.max_steps`` below the step of the checkpoint being
    resumed (:func:`checkpoint_progress`), the one case of :func:`check_resumed_schedule`'s that needs no data
    (``train.epochs`` needs the tokenized data, and is checked there).

    Raises:
        ConfigError: ``max_steps`` below the checkpoint's step (the run would write the checkpoint's head as its
            final one and call it finished, though asked to stop earlier).
    """
    progress = checkpoint_progress(ckpt_dir) if max_steps is not None else None
    if progress is not None and max_steps < progress[0]:
        raise ConfigError(f"train.max_steps={max_steps} is below the checkpoint's step {progress[0]}, and a resume "
                          f"cannot go back: resume with the run's own settings (its schedule ends at step "
                          f"{progress[1]}), or name an earlier checkpoint in checkpoints/latest")


def check_resumed_schedule(schedule, base_lr: float, weight_decay: float, tc, total_steps: int,
                           say, step: int = 0) -> None:
    """After a checkpoint is loaded: the run keeps the learning-rate schedule and optimizer settings it was saved
    with. Changed settings are ignored with one warning (through ``say``), except a longer run.

    Args:
        schedule: the restored :class:`~spd_ds.train.loop.WarmupLinear` (``warmup``, ``total`` steps, ``stable``
            fraction of the run).
        base_lr, weight_decay: the restored optimizer's.
        tc: this invocation's ``TrainConfig``; total_steps: the steps it would take.
        step: the checkpoint's optimizer step.
    Raises:
        ConfigError: ``total_steps`` above the schedule's: the learning rate reaches 0 at the schedule's end, so the
            extra steps would not train (warm-start a new run from the head instead); or below ``step``: the run
            would write the checkpoint's head as its final one and call it finished, though asked to stop earlier.
    """
    if total_steps < step:
        raise ConfigError(f"the checkpoint is at step {step}, past the {total_steps} steps train.max_steps / "
                          "train.epochs now ask for, and a resume cannot go back: resume with the run's own settings "
                          f"(its schedule ends at step {schedule.total}), or name an earlier checkpoint in "
                          "checkpoints/latest")
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


def checkpoint_progress(ckpt_dir: Path) -> tuple[int, int, float] | None:
    """``(step, the schedule's last step, training seconds)`` of the newest checkpoint under ``ckpt_dir``, read from
    its client state and scheduler state (DeepSpeed's ``mp_rank_00_model_states.pt``, memory-mapped: the head's
    weights are not read) without building an engine; ``None`` when they cannot be read (the resume then reports the
    checkpoint)."""
    try:
        tag = (ckpt_dir / "latest").read_text().strip()
        cs = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False,
                        mmap=True)
        total = cs["lr_scheduler"]["lr_lambdas"][0]["total"]  # WarmupLinear's state (LambdaLR keeps its __dict__)
        return int(cs["step"]), int(total), float(cs.get("elapsed_s", 0.0))
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, KeyError, IndexError, TypeError, ValueError):
        return None


def finished_message(out_dir: Path, step: int, total: int, elapsed_s: float, max_time_s: float | None) -> str | None:
    """The line saying that a resume has nothing to do, or ``None``.

    A run is finished at checkpoint step ``step`` when its final files were written from that checkpoint
    (``train_summary.json`` says ``"finished": true`` at ``step``) and it ended there for good: at its last step
    (``total``), or stopped by a ``train.max_time_s`` that this invocation does not raise (the summary's
    ``max_time_s``; a summary written before it was recorded: ``elapsed_s`` training seconds over ``max_time_s``).
    Otherwise (a crash between the last checkpoint and those files, or a larger time budget) the resume goes on.
    """
    if step < total and max_time_s is None:
        return None
    try:
        summary = json.loads((Path(out_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("finished") is not True or summary.get("steps") != step:
        return None
    if step < total:  # the time budget ended it: the rule the loop stopped by is the summary's own record
        ran_with = summary.get("max_time_s", elapsed_s if elapsed_s > max_time_s else None)
        if not isinstance(ran_with, (int, float)) or max_time_s > ran_with:
            return None
    heads = ", ".join(str(Path(out_dir) / d) for d in (BEST_DIR, "head") if (Path(out_dir) / d).is_dir()) or "none"
    when = (f"at step {step} of {total}" if step >= total else
            f"at step {step}, its train.max_time_s={max_time_s:g} spent ({elapsed_s:.0f} s trained; raise it to "
            "continue the run)")
    return (f"run {out_dir} already finished {when}; nothing to do (its heads: {heads}). To train further, start a "
            "new train.output_dir with head.checkpoint=<its head or best_head>")


def finished_run(out_dir: Path, ckpt_dir: Path, max_time_s: float | None) -> str | None:
    """:func:`finished_message` for the newest checkpoint under ``ckpt_dir`` (:func:`checkpoint_progress`), before
    any model or engine is built; ``None`` when it cannot be read."""
    progress = checkpoint_progress(ckpt_dir)
    return None if progress is None else finished_message(out_dir, *progress, max_time_s)


def check_fresh_output(out_dir: Path, head_checkpoint: str | None) -> None:
    """Refuse to start a run at step 0 (no checkpoint under ``out_dir``) where an earlier run's results lie.

    ``train_summary.json`` and ``head/`` are written when a run ends: beside no checkpoint (removed to save space,
    say) they are a finished run's results, which this run would replace at its end and mix with its own until then,
    as a folder holding checkpoints is refused without ``--resume``. A ``best_head/`` alone is what a run that crashed
    before its first checkpoint left; the run started again there replaces it (:func:`stale_best_heads`), unless
    ``head.checkpoint`` is in it.

    Args:
        out_dir: ``train.output_dir``.
        head_checkpoint: ``head.checkpoint`` (``None``: none).
    Raises:
        ConfigError: one line naming what is there and what to do (another ``train.output_dir``, or remove them);
            whole checkpoints without a ``latest`` naming one (:func:`whole_checkpoints`: a run from step 0 would
            prune them), with the ``echo`` that resumes the newest; raised on every rank before any collective.
    """
    whole = whole_checkpoints(Path(out_dir) / CHECKPOINTS)
    if whole:  # `latest` removed (by hand, or lost): a run from step 0 would prune them as it saves its own
        ckpt_dir = Path(out_dir) / CHECKPOINTS
        raise ConfigError(f"{ckpt_dir} holds checkpoints ({', '.join(whole)}) but no `latest` naming one; to continue "
                          f"the newest, `echo {whole[0]} > {ckpt_dir / 'latest'}` and resume (--resume); to train "
                          "anew, remove them or set another train.output_dir")
    found = [name for name in (SUMMARY_FILE, "head") if (Path(out_dir) / name).exists()]
    if found:
        raise ConfigError(f"{out_dir} holds an earlier run's results ({', '.join(found)}) and no checkpoint to resume; "
                          "set another train.output_dir (head.checkpoint=<its head or best_head> warm-starts from "
                          "it), or remove them to train there anew")
    if head_checkpoint:
        start = Path(head_checkpoint).resolve()
        for d in stale_best_heads(out_dir):
            if start == d.resolve() or d.resolve() in start.parents:
                raise ConfigError(f"head.checkpoint={head_checkpoint} is in {d}, the best head of an earlier attempt "
                                  "that this run replaces; copy it out of train.output_dir or set another "
                                  "train.output_dir")


def stale_best_heads(out_dir: Path) -> list[Path]:
    """The best heads of an earlier attempt in ``out_dir`` (``best_head/``, and the ``best_head.old/`` and
    ``best_head.tmp/`` of a replacement it did not finish) that a run starting at step 0 removes: its validation
    writes its own, and until then a reader would take them for its."""
    return [d for d in (Path(out_dir) / name for name in (BEST_DIR, BEST_BACKUP, BEST_TMP)) if d.exists()]


def truncate_log(path: Path, step: int) -> None:
    """Start ``train_log.jsonl`` for a run at optimizer step ``step``: a fresh run (``step = 0``) removes it, a
    resumed one keeps the records up to its checkpoint's step, so that the steps a crash had logged after it are
    not logged twice (a line the crash cut short is dropped too). The kept records replace the file once written
    whole: a write that fails (a full disk, where runs crash and are resumed) or is killed leaves the log as it was
    (it was truncated first, and the run's history lost)."""
    if step == 0 or not path.exists():
        path.unlink(missing_ok=True)
        return
    keep = [rec for rec in read_train_log(path) if isinstance(rec.get("step"), int) and rec["step"] <= step]
    with replaced_when_done(path) as tmp:
        tmp.write_text("".join(json.dumps(rec) + "\n" for rec in keep))  # as the loop writes them


__all__ = ["CHECKPOINTS", "RUN_FILE", "AUTOCAST", "DRAFT_VOCAB", "EVAL_BATCHES", "DS_STAGE", "DS_BF16",
           "draft_vocab_digest", "run_identity", "eval_batches_identity", "data_identity", "check_resumed_data",
           "recorded_attention", "flex_kept_message", "write_run_file", "check_resume", "check_checkpoint_files",
           "check_optimizer_shards", "checkpoint_step", "damaged_checkpoint_advice", "check_resumed_schedule",
           "checkpoint_progress", "check_max_steps", "finished_message", "finished_run", "check_fresh_output",
           "whole_checkpoints", "prune_checkpoints", "stale_best_heads", "truncate_log", "rng_state", "set_rng_state"]
