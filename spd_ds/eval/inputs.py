"""What an evaluation runs on, prepared before any generation: the model name (``random:<shape>`` resolved), the
prompts (prompt sets with the chat template, or random token ids) as :class:`EvalPrompt` s, the KV capacity they need,
and for a PPSD head its partition and the target seen through it. Used by :mod:`spd_ds.eval.runner`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Sequence

import torch

from spd_ds import builder
from spd_ds.config import ConfigError, ExperimentConfig
from spd_ds.models.adapter import RANDOM_PREFIX, random_model_dir
from spd_ds.partition import PartitionError, StagePartition

log = logging.getLogger("spd_ds.eval.runner")  # the runner's logger: its warnings read as before

RANDOM_SET = "random"


@dataclasses.dataclass
class EvalPrompt:
    """One prompt of the run.

    Attributes:
        prompt_set: set name (``mt_bench``, ..., ``random``, or a jsonl file's stem).
        question_id: id within the set (string).
        ids: prompt token ids (chat template applied when the tokenizer has one and ``decoding.chat_template``).
        text: the user turn (``None`` for random token prompts).
    """

    prompt_set: str
    question_id: str
    ids: list[int]
    text: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        """``(prompt_set, question_id)``."""
        return (self.prompt_set, self.question_id)


def resolve_model_name(cfg: ExperimentConfig) -> ExperimentConfig:
    """A copy of ``cfg`` whose ``model.name`` ``random:<shape>`` is replaced by the shape's directory (so every
    builder, the pipeline engine included, finds it as a local model directory).

    Raises:
        ConfigError: unknown shape.
    """
    cfg = copy.deepcopy(cfg)
    if cfg.model.name.startswith(RANDOM_PREFIX):
        try:
            cfg.model.name = str(random_model_dir(cfg.model.name))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg


def random_prompt_ids(count: int, lengths: Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random token ids; prompt ``i`` has ``lengths[i % len(lengths)]`` tokens drawn uniformly
    from ``[0, vocab_size)`` by a generator seeded with ``(seed, i)`` (the same on every rank and machine).

    Raises:
        ValueError: no lengths, or a length < 1.
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"eval.random_prompt_lengths must be a non-empty list of lengths >= 1, got {list(lengths)}")
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + i)
        out.append(torch.randint(0, vocab_size, (int(lengths[i % len(lengths)]),), generator=g).tolist())
    return out


def load_eval_records(cfg: ExperimentConfig, tokenizer_free: bool = False) -> list[tuple[str, list[dict] | None]]:
    """The records of ``eval.prompt_sets`` (first ``data.num_prompts`` of each; ``data.eval_dir`` for set names),
    read before any model is fetched or loaded, so that an empty set ends the run at once.

    Args:
        cfg: the experiment.
        tokenizer_free: the model has no tokenizer (random weights): only ``random`` sets are allowed.
    Returns:
        ``(label, records)`` per set, in order; ``records`` is ``None`` for a ``random`` set (made later, it needs the
        vocabulary size).
    Raises:
        ConfigError: no prompt sets, a set that holds no prompts, malformed records (an empty or whitespace-only
            user turn included: the message names the set, ``file:line`` and the record's index), or a named set on
            a model without tokenizer.
        FileNotFoundError / PromptSetUnavailableError: from :func:`spd_ds.eval.prompts.load_prompts` (with the
            default ``eval.prompt_sets``, a set that cannot be had after the first is skipped with a warning instead:
            gsm8k without the hub).
    """
    from spd_ds.builder import resolve_path
    from spd_ds.config import DEFAULT_PROMPT_SETS
    from spd_ds.eval.prompts import PromptSetUnavailableError, canonical_name, load_prompts

    if not cfg.eval.prompt_sets:
        raise ConfigError("eval.prompt_sets is empty; give set names (mt_bench, humaneval, gsm8k, random) "
                          "or jsonl paths")
    # the default list (or the same sets spelled otherwise): an unavailable set after the first is skipped
    default_sets = tuple(canonical_name(s) or s for s in cfg.eval.prompt_sets) == DEFAULT_PROMPT_SETS
    eval_dir = resolve_path(cfg.data.eval_dir)
    out: list[tuple[str, list[dict] | None]] = []
    given: dict[str, str] = {}  # label -> the entry that gave it: the report groups rows by label
    for name in cfg.eval.prompt_sets:
        label = _set_label(name)
        key = canonical_name(name) or label  # a set's aliases (MT-Bench, mt_bench) are the same set
        if key in given:
            if canonical_name(name) or given[key] == name:
                raise ConfigError(f"eval.prompt_sets: {name!r} is given twice ({given[key]!r}); give each set once")
            raise ConfigError(f"eval.prompt_sets: {name!r} and {given[key]!r} both report as {label!r}; rename one "
                              "of the files")
        given[key] = name
        if name == RANDOM_SET:
            out.append((RANDOM_SET, None))
            continue
        if tokenizer_free:
            raise ConfigError(f"prompt set {name!r} needs a tokenizer, and {cfg.model.name} has none (random weights); "
                              f"use eval.prompt_sets=[{RANDOM_SET}]")
        try:
            recs = load_prompts(name, cfg.data.num_prompts, eval_dir)
        except PromptSetUnavailableError as e:
            if default_sets and name != cfg.eval.prompt_sets[0]:
                log.warning("skipping prompt set %r of the default eval.prompt_sets: %s", name, e)
                continue
            raise PromptSetUnavailableError(
                f"{e} (or: python launch/prepare_eval_data.py --source-dir DIR; data.eval_dir=DIR; or drop {name!r} "
                "from eval.prompt_sets)") from None
        except ValueError as e:  # malformed records
            raise ConfigError(f"prompt set {name!r}: {e}") from None
        if not recs:
            raise ConfigError(f"prompt set {name!r} holds no prompts; give a jsonl file with records (one "
                              "{\"turns\": [\"...\"]} a line) or drop it from eval.prompt_sets")
        out.append((label, recs))
    return out


def warn_unused_prompts(cfg: ExperimentConfig) -> bool:
    """Log a warning when ``data.prompts`` (launch/infer.py's prompt set), set to other than its default, names a
    set that ``eval.prompt_sets`` leaves out: eval reads ``eval.prompt_sets`` alone. Returns whether it warned."""
    from spd_ds.config import DataConfig
    from spd_ds.eval.prompts import canonical_name

    def key(name: str) -> str:
        return canonical_name(name) or name

    if key(cfg.data.prompts) in {key(DataConfig.prompts)} | {key(s) for s in cfg.eval.prompt_sets}:
        return False
    log.warning("data.prompts=%s is ignored: eval runs eval.prompt_sets=%s (set that to evaluate other prompts)",
                cfg.data.prompts, list(cfg.eval.prompt_sets))
    return True


def _set_label(name: str) -> str:
    """A prompt set's name in the report: a set name as given, a jsonl file's stem (``<dir>/question.jsonl``: the
    folder's name), a folder's name."""
    from pathlib import Path

    label = Path(name).stem if name.endswith(".jsonl") else (Path(name).name if os.sep in name else name)
    return Path(name).parent.name if label == "question" else label


def encode_eval_prompts(cfg: ExperimentConfig, sets: Sequence[tuple[str, list[dict] | None]], tokenizer,
                        vocab_size: int) -> list[EvalPrompt]:
    """:class:`EvalPrompt` s of :func:`load_eval_records`' sets: a record's first user turn encoded with
    :func:`spd_ds.builder.encode_prompt`; a ``random`` set as ``data.num_prompts`` (default 5) prompts of random token
    ids of ``eval.random_prompt_lengths`` below ``vocab_size``."""
    count = cfg.data.num_prompts if cfg.data.num_prompts is not None else 5
    out: list[EvalPrompt] = []
    for label, recs in sets:
        if recs is None:
            ids = random_prompt_ids(count, cfg.eval.random_prompt_lengths, vocab_size, cfg.decoding.seed)
            out += [EvalPrompt(RANDOM_SET, f"random-{i}", p) for i, p in enumerate(ids)]
            continue
        for r in recs:
            text = r["turns"][0]
            out.append(EvalPrompt(label, str(r["question_id"]),
                                  builder.encode_prompt(tokenizer, text, cfg.decoding.chat_template), text))
    return out


def load_eval_prompts(cfg: ExperimentConfig, tokenizer, vocab_size: int) -> list[EvalPrompt]:
    """The prompts of ``eval.prompt_sets``: :func:`load_eval_records` (``tokenizer`` ``None`` = a model without
    one) then :func:`encode_eval_prompts`; the errors of the former."""
    return encode_eval_prompts(cfg, load_eval_records(cfg, tokenizer is None), tokenizer, vocab_size)


def fit_max_length(cfg: ExperimentConfig, prompts: Sequence[EvalPrompt], num_stages: int) -> int:
    """KV capacity the run needs: the longest prompt + ``max_new_tokens`` + room for the in-flight tokens and the
    oracle's reference run, rounded up to 64, at most ``decoding.max_length``."""
    longest = max(len(p.ids) for p in prompts)
    need = longest + cfg.decoding.max_new_tokens + 2 * num_stages + 2
    return min(cfg.decoding.max_length, -(-need // 64) * 64)


def check_prompt_lengths(cfg: ExperimentConfig, prompts: Sequence[EvalPrompt], num_stages: int, arch) -> None:
    """Every prompt fits ``decoding.max_length`` (as the run resolved it) with its generation and the ``num_stages``
    in-flight tokens, by the decoders' own rule (:func:`~spd_ds.decoding.cycle.check_prompt`), before any weight
    loads: the reference decoder checked it only as it ran, after the target had loaded and the warm-up begun.

    Raises:
        PromptError: the first prompt that does not fit, named by its set and id.
    """
    from spd_ds.decoding.cycle import PromptError, check_prompt

    for p in prompts:
        try:
            check_prompt(p.ids, cfg.decoding.max_new_tokens, cfg.decoding.max_length, num_stages, arch.max_positions,
                         arch.max_positions_source)
        except PromptError as e:
            raise PromptError(f"[{p.prompt_set} {p.question_id}] {e}") from None


def check_same_stages(ppsd: StagePartition, run: StagePartition) -> None:
    """Raise :class:`~spd_ds.config.ConfigError` unless the PPSD head's partition ``ppsd`` has the stage ranges of the
    run's ``run`` (both heads draft beside the same stages; only the anchors may differ)."""
    if tuple(ppsd.stage_layers) != tuple(run.stage_layers):
        raise ConfigError(f"the PPSD head's stages {list(ppsd.stage_layers)} differ from the run's "
                          f"{list(run.stage_layers)}; train the PPSD head for the same "
                          "partition.num_stages/stage_layers (or evaluate it alone: eval.spd=false)")


class _TargetView:
    """The same target weights seen through another partition with the same stage ranges (other anchors): the
    stages are shallow copies that capture the view's anchors; modules and parameters are shared."""

    def __init__(self, target, partition: StagePartition) -> None:
        check_same_stages(partition, target.partition)
        self.arch, self.partition, self.ends = target.arch, partition, target.ends
        self.dtype, self.device = target.dtype, target.device
        self.stages = []
        for s, stage in enumerate(target.stages):
            view = copy.copy(stage)  # shares _modules/_parameters; only ``capture`` differs
            view.capture = {j - 1: j for j in partition.stage_anchors(s) if j >= 1}
            self.stages.append(view)

    def new_caches(self, max_len: int):
        """One KV cache per stage (as :meth:`Target.new_caches`)."""
        return [self.arch.new_cache(st.layer_ids, max_len, self.dtype, self.device) for st in self.stages]


def target_view(target, partition: StagePartition):
    """``target`` (a :class:`~spd_ds.models.adapter.Target`) seen through ``partition`` (same stage ranges, other
    anchors), without copying weights; usable by the reference decoder.

    Raises:
        ConfigError: different stage ranges.
    """
    if partition == target.partition:
        return target
    return _TargetView(target, partition)


def ppsd_partition(path: str, arch) -> StagePartition:
    """The partition stored in the PPSD head checkpoint ``path`` (anchors ``(0, e_1)`` for a true PPSD head).

    Raises:
        ConfigError: unreadable checkpoint or a partition for another model.
    """
    from spd_ds.head import SpeculationHead

    try:
        part = StagePartition.from_dict(SpeculationHead.read_config(path, "eval.ppsd_checkpoint")["partition"])
    except FileNotFoundError as e:  # the message names eval.ppsd_checkpoint and what to give
        raise ConfigError(str(e)) from None
    except (ValueError, KeyError, PartitionError) as e:
        raise ConfigError(f"eval.ppsd_checkpoint: {e}") from None
    if part.num_layers != arch.num_layers:
        raise ConfigError(f"eval.ppsd_checkpoint {path} is for a {part.num_layers}-layer model, not {arch.num_layers}")
    if len(part.anchors) != 2:
        log.warning("eval.ppsd_checkpoint %s has anchors %s: a PPSD head uses (0, e_1), features from stage 1 only",
                    path, list(part.anchors))
    return part
