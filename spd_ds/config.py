"""Experiment configuration: one YAML file per experiment, typed sections, ``section.key=value`` overrides.

Sections: ``model``, ``partition``, ``head``, ``decoding``, ``data``, ``train``, ``eval``, ``deepspeed``.
Loading is done with OmegaConf structured configs (types checked, unknown keys refused); the error for an
unknown key names the valid keys of its section. The value checks that need no model are in
:mod:`spd_ds.config_checks` (run on every config :func:`load_config` returns).
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import os
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException


DIST_BACKENDS = ("gloo", "nccl", "ccl", "mpi", "ucc", "xccl", "hccl")  # deepspeed.backend (torch.distributed backends)
SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")  # model.sdpa_backends (torch.backends.cuda.enable_*_sdp)
# model.attn_implementation: the transformers attention backends spd-ds's stages run (spd_ds.models.masks)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
# model.sdpa_backends=None: the memory-efficient kernel for every decoding attention call on CUDA, torch's choice on CPU
DEFAULT_SDPA_BACKENDS = {"cuda": ("efficient", "math"), "cpu": ("flash", "efficient", "math")}
# Settings that name files or folders (of a list, every item): load_config expands a leading ~ (~user) in each
PATH_KEYS = ("model.name", "model.cache_dir", "head.checkpoint", "head.draft_vocab", "data.prompts", "data.eval_dir",
             "data.train_files", "train.output_dir", "train.compile_cache", "eval.output_dir", "eval.ppsd_checkpoint",
             "eval.prompt_sets", "deepspeed.config")


class ConfigError(ValueError):
    """A bad experiment file or override; the message says what to change."""


@dataclasses.dataclass
class ModelConfig:
    """The target. ``name``: zoo name (default ``smollm2-135m-instruct``), local HF directory or hub id.

    ``attn_implementation``: transformers' attention backend of the target's layers, the head's tower and the HF
    baselines: ``sdpa`` (the default) or ``eager`` (:mod:`spd_ds.models.masks`); training takes ``sdpa`` only (its
    teacher's attention is ``train.teacher_attention``).

    ``sdpa_backends``: the scaled-dot-product-attention kernels a decoding process may use (``flash``,
    ``efficient``, ``math``, ``cudnn``; torch picks among them per call), set process-wide by
    :func:`spd_ds.builder.build_arch` for decoding (not for training); it matters with ``attn_implementation=sdpa``.
    ``None`` (the default) = :data:`DEFAULT_SDPA_BACKENDS` of the device: on CUDA ``[efficient, math]``, so that the
    eager decoder and the static-cache decoders of the CUDA graphs run the same kernel (both pass a mask on GPU:
    :func:`spd_ds.models.masks.causal_mask`): with ``flash`` allowed the eager decoder, then unmasked for one new
    token, ran flash and parted from the CUDA-graph AR, and with ``cudnn`` separately captured CUDA-graph AR decoders
    parted from one another at bf16 near-ties (``docs/benchmarks.md`` (a)); on CPU ``[flash, efficient, math]``
    (torch's own choice there). A list must be able to run every call: on CPU it needs ``math`` or ``flash``, on
    CUDA ``math`` or ``efficient``."""

    name: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"  # ATTN_IMPLEMENTATIONS: sdpa | eager
    device: str = "auto"  # auto | cpu | cuda
    cache_dir: Optional[str] = None
    sdpa_backends: Optional[list[Any]] = None


@dataclasses.dataclass
class PartitionConfig:
    """Pipeline split: ``num_stages`` uniform stages or explicit ``stage_layers`` (given, they decide the number of
    stages; a ``num_stages`` that disagrees is ignored with a warning); ``anchors`` (None = default)."""

    num_stages: int = 2
    stage_layers: Optional[list[int]] = None
    anchors: Optional[list[int]] = None


@dataclasses.dataclass
class HeadConfig:
    """Speculation head: ``checkpoint`` directory (None = untrained head), tower ``num_layers`` (L_s; new heads),
    ``draft_vocab``: a draft-vocabulary JSON or ``full`` (every id); None = every id for a new head, the checkpoint's
    own for a loaded one (a loaded head with ``lm_head_from_target`` drafts over a given one), ``placement`` in the
    distributed engine
    (``colocated``: inside the first stage's process, world n; ``dedicated``: its own rank, world n + 1),
    ``cuda_graph``: draft through a static KV cache replayed as one CUDA graph per cycle
    (``spd_ds.decoding.head_graph``) when the head is on a CUDA device (default true; false: the eager head, ~5x
    slower per cycle, ``docs/benchmarks.md`` (a)); null (configs saved when it followed ``deepspeed.cuda_graphs``)
    = true. Ignored on CPU,
    where the head runs eagerly.
    ``overlap`` (GPU engine): draft on the head's own CUDA stream while stage 0 runs (false: after it, on the default
    stream; slower, no concurrency: a check for the question above).
    ``lm_head_from_target`` (new heads): the LM head is the target's rows, frozen, not stored.
    ``tower_init_layer`` (new heads): the tower starts from that target layer's weights (negative: from the end)."""

    checkpoint: Optional[str] = None
    num_layers: int = 1
    draft_vocab: Optional[str] = None
    intermediate_size: Optional[int] = None
    placement: str = "colocated"
    dtype: Optional[str] = None  # None = model.dtype
    cuda_graph: Optional[bool] = True  # null (saved before it was a bool: follow the stages' graphs, on) = true
    overlap: bool = True  # GPU engine: draft on a CUDA stream of its own, concurrently with stage 0's forward
    lm_head_from_target: bool = False  # new heads: the LM head is the target's rows at the draft ids, frozen and not
    # stored in the checkpoint (smaller files); a loaded checkpoint says for itself
    tower_init_layer: Optional[int] = None  # new heads: start the tower layers from this target layer's weights
    # (negative = from the end, -1 = last; SpeculationHead.init_tower_from_layer); None = random init


@dataclasses.dataclass
class DecodingConfig:
    """Generation: ``temperature`` 0 = greedy; ``eos_token_ids`` None = the model's generation config;
    ``stop``: stop strings, a generation ends with the token whose text completes one of them (finish reason
    ``stop``; ``spd_ds.decoding.stopping``; needs the model's tokenizer; ``launch/infer.py`` and the Python API, not
    the benchmarks); ``drafter``: ``head`` or ``oracle`` (the target's own greedy next token with probability
    ``oracle_alpha``)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: Optional[list[int]] = None
    stop: list[Any] = dataclasses.field(default_factory=list)  # checked to be strings (YAML would turn No into False)
    max_length: int = 4096
    drafter: str = "head"
    oracle_alpha: float = 1.0
    chat_template: bool = True


@dataclasses.dataclass
class DataConfig:
    """Prompts for inference/eval (``prompts``: a prompt-set name or a jsonl path) and training files.

    ``held_out_fraction``: share of the training records held out for validation while training (a record is held
    out when a hash of its content and ``train.seed`` says so: the same records on every rank, resume and world size;
    at least one record when > 0); 0 = no split (and no validation). See ``spd_ds.train.validate``."""

    prompts: str = "mt_bench"
    num_prompts: Optional[int] = 5
    eval_dir: str = "eval_data"
    train_files: list[str] = dataclasses.field(default_factory=list)
    max_seq_length: int = 2048
    min_seq_length: int = 10
    regenerate: bool = False
    num_workers: int = 0
    # training batches (spd_ds.train.batching): rows of max_seq_length tokens, micro_batch_size rows per micro-batch
    micro_batch_size: int = 8
    pack: bool = True  # pack several conversations per row (else one per row, length-grouped)
    overflow: str = "truncate"  # conversations longer than max_seq_length: truncate | drop
    max_conversations: Optional[int] = None  # use at most this many conversations (None = all)
    chat_template: Optional[str] = None  # Jinja template (file or string) replacing the tokenizer's (training
    # and the prompts of decoding: spd_ds.builder.prompt_tokenizer)
    # data.regenerate=true: answer every conversation's first user turn with the target itself (spd_ds.train.regenerate)
    regenerate_max_new_tokens: int = 512
    regenerate_temperature: float = 0.0
    regenerate_batch_size: int = 64
    regenerate_max_prompt_tokens: int = 1024
    held_out_fraction: float = 0.02  # records held out for validation while training (0 = none; train.eval_every)
    # train on positions whose next token closes a 9-gram already in the same answer (a loop) or not: the tokens stay
    # as context either way; validation scores every position (spd_ds.train.batching.loop_positions, docs/training.md)
    skip_loops: bool = False


@dataclasses.dataclass
class TrainConfig:
    """Head distillation (knowledge distillation, forward KL over the draft vocabulary).

    Validation (``spd_ds.train.validate``): every ``eval_every`` optimizer steps and at the end of the run, the head
    runs at every pipeline fill on ``eval_batches`` held-out micro-batches (``data.held_out_fraction``; the same ones
    each time, shared over the data-parallel ranks); its top-1 agreement by fill gives the predicted T = 0 draft
    acceptance and equivalent accept length ``n/(1+(n-1)(1-α))`` (``spd_ds.train.acceptance``), logged as
    ``val_*`` and used to keep the best head in ``<output_dir>/best_head/``. ``eval_every=0`` turns it off (nothing
    is held out then)."""

    output_dir: str = "runs/head"
    epochs: int = 1  # passes over the training data (0 = no limit: train.max_steps alone ends the run)
    max_steps: Optional[int] = None  # at most this many optimizer steps (None = epochs alone)
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 100
    lr_stable_fraction: float = 0.0  # share of the run after warm-up (steps or time, whichever is further) at the
    # full learning rate before the linear decay to 0: 0 = decay from the start; e.g. 0.8 = warmup-stable-decay
    kd_temperature: float = 1.0
    full_pipeline_prob: float = 0.5
    save_every: int = 500
    log_every: int = 10
    seed: int = 42
    resume: bool = False
    tensorboard: bool = False
    # spd_ds.train additions
    teacher_pipe_degree: Optional[int] = None  # 1 | partition.num_stages; None = 1 if the target fits one GPU, else n
    autocast: str = "auto"  # auto (bf16 on CUDA, off on CPU) | bf16 | off: head compute dtype; weights stay fp32
    outside_vocab: str = "weight"  # positions whose teacher argmax is outside the draft vocab: weight | drop | keep
    keep_checkpoints: int = 2  # newest DeepSpeed checkpoints kept under output_dir/checkpoints (0 = keep all)
    max_time_s: Optional[float] = None  # stop (and save) after this many seconds of training, counted over the whole
    # run: a resumed run continues the clock (and the time-based LR decay) where its checkpoint left it
    session_time_s: Optional[float] = None  # end this invocation (checkpoint saved) after this many seconds without
    # ending the run: `--resume` continues it (a cluster job's time limit; the LR schedule is unaffected)
    save_dtype: str = "float32"  # dtype of the final head's weights (bfloat16 halves the file)
    progress: bool = True  # tqdm progress bar on the logging rank
    attention: str = "auto"  # head attention in training: auto (flex on CUDA, dense elsewhere) | flex | dense
    teacher_attention: str = "auto"  # the frozen target's attention over packed rows: auto (= sdpa, the faster on an
    # H200) | sdpa (the packed-causal boolean mask) | flex (FlexAttention: tiles between documents skipped)
    flex_compile: str = "static"  # CUDA FlexAttention: static (a compile per fill) | dynamic (automatic dynamic shapes)
    loss_chunk: int = 4096  # loss positions per chunk of the KL over the draft vocabulary (bounds fp32 temporaries)
    prefetch: int = 4  # micro-batches collated ahead in a DataLoader worker process (0 = in the training process)
    profile_steps: Optional[int] = None  # profile this many steps (after 5 warm-up steps) with torch.profiler;
    # output_dir gets profile.txt / profile_cpu.txt (costliest operators by device / host time), trace.json.gz
    eval_every: int = 200  # validate every this many optimizer steps and at the end (0 = never)
    eval_batches: Optional[int] = 16  # held-out micro-batches per evaluation, over all ranks (None = every one)
    compile_cache: Optional[str] = None  # a file of torch.compile artifacts: loaded before the first compile, rewritten
    # at the end by the logging rank (spd_ds.compile_cache; carries compiled kernels to a fresh machine)
    compile_teacher: Optional[str] = "auto"  # torch.compile backend for the frozen target's decoder layers in training:
    # auto (inductor on CUDA with Triton, else eager) | "inductor" (fused elementwise kernels) | "aot_eager" |
    # null = eager
    compile_loss: Optional[str] = "auto"  # torch.compile backend for each chunk of the distillation loss and its
    # gradient (spd_ds.train.loss.kl_chunk), same values as compile_teacher


# The default evaluation prompt sets. gsm8k comes from the hub only: when it cannot be had, a run on this list (in
# any spelling of the names) skips it with a warning; any other list fails instead.
DEFAULT_PROMPT_SETS = ("mt_bench", "humaneval", "gsm8k")


@dataclasses.dataclass
class EvalConfig:
    """Evaluation: prompt sets, baselines measured in the same run, output directory (``spd_ds.eval``).

    ``prompt_sets``: set names or jsonl paths; ``random`` = random token ids of ``random_prompt_lengths`` (the only
    kind a model without tokenizer, e.g. ``model.name=random:qwen3-4b``, gets). ``baselines``: names of
    ``spd_ds.eval.baselines.BASELINES`` (``hf_generate``, ``ar``, ``ar_graph``; ``tp_ar``, AR with tensor
    parallelism over every rank, with the pipeline engine only). ``ppsd_checkpoint``: a second head
    (features from the first stage only) reported beside the SPD head; ``spd=false`` reports the PPSD head alone
    (no ``spd`` row is evaluated; drafter ``head`` only)."""

    prompt_sets: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_PROMPT_SETS))
    baselines: list[str] = dataclasses.field(default_factory=lambda: ["hf_generate", "ar", "ar_graph"])
    output_dir: str = "outputs/eval"
    plots: bool = True
    warmup_prompts: int = 1
    ppsd_checkpoint: Optional[str] = None
    spd: bool = True  # the SPD head's row (false: only eval.ppsd_checkpoint's, which must then be set)
    oracle_alphas: Optional[list[float]] = None  # drafter=oracle: one SPD variant per alpha (None: oracle_alpha)
    random_prompt_lengths: list[int] = dataclasses.field(default_factory=lambda: [128])
    baseline_num_prompts: Optional[int] = None  # run the baselines on the first k prompts of each set (None = all)
    # at T=0: SPD's tokens against the AR baselines', first divergence per prompt (false: neither summary.json's
    # exactness nor per_prompt.jsonl's first_divergence is computed)
    check_exact: bool = True
    fit_max_length: bool = True  # shrink decoding.max_length (static KV caches) to the longest prompt + generation
    # memory bandwidth per GPU (GB/s) for the % HBM column; None = the GPU's own figure from
    # spd_ds.eval.speed.GPU_BANDWIDTH_GBPS (named in the report); GB/s and % HBM are reported on GPUs only
    hbm_gbps: Optional[float] = None
    progress: bool = True  # tqdm progress bar


@dataclasses.dataclass
class DeepSpeedConfig:
    """Distributed settings: DeepSpeed JSON config, per-operation timeout (seconds) for dead/stalled ranks,
    ``static_cache`` (static KV caches so stage forwards can be CUDA graphs; None = on with CUDA, off on CPU)."""

    config: Optional[str] = None
    timeout_s: float = 120.0
    backend: Optional[str] = None  # None = DeepSpeed's choice (nccl on GPU, gloo on CPU)
    cuda_graphs: bool = True
    static_cache: Optional[bool] = None


@dataclasses.dataclass
class ExperimentConfig:
    """A whole experiment (one YAML file)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    partition: PartitionConfig = dataclasses.field(default_factory=PartitionConfig)
    head: HeadConfig = dataclasses.field(default_factory=HeadConfig)
    decoding: DecodingConfig = dataclasses.field(default_factory=DecodingConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    deepspeed: DeepSpeedConfig = dataclasses.field(default_factory=DeepSpeedConfig)


_SECTIONS = {f.name: f.type for f in dataclasses.fields(ExperimentConfig)}
_SECTION_KEYS = {f.name: [g.name for g in dataclasses.fields(f.default_factory)]  # section -> its keys, in order
                 for f in dataclasses.fields(ExperimentConfig)}


def _did_you_mean(path: Sequence[str]) -> str:
    """`` (did you mean 'train.lr'?)`` for an unknown ``section.key`` (``path``): a close spelling of the section or
    of a key of it (case aside), else the same key in the other sections that have it (``head.anchors``:
    ``partition.anchors``; ``head.seed``: ``decoding.seed`` or ``train.seed``); else ``""``."""
    keys = _SECTION_KEYS
    if not path or len(path) > 2:
        return ""
    if path[0] not in keys:  # a misspelled section (moddel.name), or a key at the top of a file (its own message)
        close = difflib.get_close_matches(path[0], list(keys), n=1, cutoff=0.75)
        return f" (did you mean {'.'.join([close[0], *path[1:]])!r}?)" if close else ""
    if len(path) == 1:
        return ""
    lower = {k.lower(): k for k in keys[path[0]]}  # train.LR, train.Lr: lr
    close = difflib.get_close_matches(path[1].lower(), list(lower), n=1, cutoff=0.75)
    if close:
        return f" (did you mean '{path[0]}.{lower[close[0]]}'?)"
    others = [f"'{sec}.{path[1]}'" for sec in keys if path[1] in keys[sec]]  # each one: seed (decoding, train)
    return f" (did you mean {' or '.join(others)}?)" if others else ""


def _valid_keys(path: Sequence[str]) -> str:
    if not path or path[0] not in _SECTIONS:
        homes = [sec for sec, keys in _SECTION_KEYS.items() if len(path) == 1 and path[0] in keys]
        under = " or ".join(h + ":" for h in homes)
        where = f" ({path[0]} belongs in a section: indent it under {under})" if homes else ""
        return "sections: " + ", ".join(_SECTIONS) + where
    return f"valid keys of {path[0]}: " + ", ".join(_SECTION_KEYS[path[0]])


# lists of strings typed list[Any] in the schema (so that YAML's No -> False gets our own message, not OmegaConf's)
_STRING_LISTS = ("decoding.stop",)


def _list_field(path: Sequence[str]) -> bool:
    """Whether ``section.key`` (``path``) is a list in the schema, ``Optional[list]`` included (a null default holds
    no ListConfig to recognise it by)."""
    return _list_item_type(path) is not None


def _list_item_type(path: Sequence[str]) -> Any:
    """The item type of the list ``section.key`` (``path``) in the schema (``Any`` when unstated), ``None`` when the
    key is not a list."""
    if len(path) != 2 or path[0] not in _SECTIONS:
        return None
    cls = {f.name: f for f in dataclasses.fields(ExperimentConfig)}[path[0]].default_factory
    hint = typing.get_type_hints(cls).get(path[1])
    for t in (hint, *typing.get_args(hint)):
        if typing.get_origin(t) is list:
            return (typing.get_args(t) or (Any,))[0]
    return None


def _one_value(path: Sequence[str]) -> tuple[str, str] | None:
    """``(what, example)`` for the scalar key ``section.key`` (``path``), e.g. ``("a string", "mt_bench")``, for the
    error of a list or mapping given to it; ``None`` when the key is not a str/int/float/bool of the schema."""
    if len(path) != 2 or path[0] not in _SECTIONS or _list_field(path):
        return None
    cls = {f.name: f for f in dataclasses.fields(ExperimentConfig)}[path[0]].default_factory
    hint = typing.get_type_hints(cls).get(path[1])
    kinds = {bool: ("true or false", "true"), str: ("a string", "<text>"), int: ("an integer", "2"),
             float: ("a number", "0.5")}
    t = next((t for t in (hint, *typing.get_args(hint)) if t in kinds), None)
    if t is None:
        return None
    default = getattr(cls(), path[1])
    return kinds[t][0], kinds[t][1] if default is None or t is bool else str(default)


def load_config(path: str | os.PathLike | DictConfig | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Load ``path`` (YAML, or a file :func:`load_yaml` has read) over the defaults, then apply ``section.key=value``
    overrides (values parsed as YAML).

    Raises:
        ConfigError: missing file, a file that is not a YAML mapping of sections, unknown section/key (the message
            lists the valid ones), wrong value type, malformed override.
    """
    base = OmegaConf.structured(ExperimentConfig)
    try:
        if path is not None:
            base = OmegaConf.merge(base, path if isinstance(path, DictConfig) else load_yaml(Path(path)))
        for o in overrides:
            if "=" not in o or "." not in o.split("=", 1)[0]:
                raise ConfigError(f"override {o!r} must look like section.key=value (e.g. partition.num_stages=3)")
        for o in overrides:  # one at a time, so that an error names its override
            key, value = o.split("=", 1)
            try:
                parsed = OmegaConf.from_dotlist([o])
            except yaml.YAMLError as e:
                problem = str(e).splitlines()[0]
                raise ConfigError(f"override {o!r} is not valid YAML ({problem}); quote strings, e.g. "
                                  f"{key}='[\"text: with colon\"]'") from None
            try:
                current = OmegaConf.select(base, key, throw_on_missing=False)
            except OmegaConfBaseException:
                current = None
            new = OmegaConf.select(parsed, key)
            number = (isinstance(new, (int, float)) and not isinstance(new, bool)
                      and _list_item_type(key.split(".")) is not str and key not in _STRING_LISTS)
            example = value if number else f'"{value}"'  # a number stays a number ('[2]'), unless strings are asked
            what, item = "a list", _list_item_type(key.split("."))
            if item in (int, float) and not number:  # a number list's example, not a string list's
                what, example = ("a list of integers", 2) if item is int else ("a list of numbers", 0.5)
            takes_list = ConfigError(f"override {o!r}: {key} takes {what}; write it as a YAML list in quotes, e.g. "
                                     f"{key}='[{example}]'")
            if isinstance(current, ListConfig) and not isinstance(new, ListConfig):
                if not value.strip():  # `key=`: nothing to put in quotes
                    sample = {int: "[2]", float: "[0.5]"}.get(item, '["..."]')
                    raise ConfigError(f"override {o!r}: {key} has no value; give a YAML list in quotes, e.g. "
                                      f"{key}='{sample}' (or '[]')")
                raise takes_list
            if current is None and new is not None and not isinstance(new, ListConfig) and _list_field(key.split(".")):
                raise takes_list  # an optional list whose value is null (null itself is fine)
            base = OmegaConf.merge(base, parsed)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = getattr(e, "full_key", None) or str(e)
        path = str(key).split(".")
        raise ConfigError(f"unknown config key {key!r}{_did_you_mean(path)}; {_valid_keys(path)}") from None
    except OmegaConfBaseException as e:
        msg, key = str(e).splitlines()[0], getattr(e, "full_key", "?")
        if msg.startswith("Incompatible value 'None'") or msg.endswith("is not Optional"):  # `key=`, `key:` + nothing
            raise ConfigError(f"{key} has no value (an empty override or YAML entry reads as null); give one, e.g. "
                              f"{key}=<value>") from None
        one = _one_value(str(key).split("."))
        given = next((w for c, w in (("ListConfig", "a list"), ("DictConfig", "a mapping")) if c in msg), None)
        if one is not None and given is not None:  # OmegaConf's "Cannot convert 'ListConfig' to string: ..."
            raise ConfigError(f"{key} takes one value ({one[0]}), not {given}; give one, e.g. {key}={one[1]}") from None
        item = _list_item_type(str(key).split("."))
        if item is not None and "is not a ListConfig" in msg:  # a YAML file's `key: a` (or `key: a, b`) for a list
            sample = {int: "[2]", float: "[0.5]"}.get(item, "[a, b]")
            raise ConfigError(f"{key} takes a list, got one value; write a YAML list, e.g. {str(key).split('.')[-1]}: "
                              f"{sample} in the file ({key}='{sample}' on the command line)") from None
        raise ConfigError(f"bad config value: {msg} (key {key})") from None
    cfg: ExperimentConfig = OmegaConf.to_object(base)
    for section, name in (key.split(".") for key in PATH_KEYS):  # YAML files and key=~/x overrides reach us with
        value = getattr(getattr(cfg, section), name)  # their ~ unexpanded: expanded here as a shell would
        setattr(getattr(cfg, section), name, [os.path.expanduser(v) for v in value] if isinstance(value, list)
                else os.path.expanduser(value) if isinstance(value, str) else value)
    from spd_ds.config_checks import validate  # (it imports this module)

    validate(cfg)
    return cfg


def load_yaml(p: Path) -> DictConfig:
    """The experiment file ``p`` as an OmegaConf mapping (what :func:`load_config` merges over the defaults);
    ConfigError if it is missing, a folder, not UTF-8 (:func:`_utf8_text`), not YAML, or not a mapping of sections."""
    if not p.exists():
        raise ConfigError(f"config file {p} not found")
    if not p.is_file():
        raise ConfigError(f"config file {p} is not a file: give the path of a YAML experiment file "
                          "(e.g. launch/configs/smollm2_spd.yaml)")
    text = _utf8_text(p, f"config file {p}")
    try:
        loaded = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        quote = ", and quote a value that holds ': '" if "mapping values are not allowed" in problem else ""
        fix = "give each key once (merge the two)" if "duplicate key" in problem else f"check its indentation{quote}"
        raise ConfigError(f"config file {p} is not valid YAML{where}: {problem}; {fix}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {p} must be a mapping of sections (model:, partition:, head:, ...), "
                          f"got a {'list' if isinstance(loaded, ListConfig) else type(loaded).__name__}")
    for name in list(loaded.keys()):
        value = loaded[name]
        if value is None and name in _SECTIONS:  # a section whose keys are all commented out: its defaults
            del loaded[name]
        elif name in _SECTIONS and not isinstance(value, DictConfig):
            got = repr(OmegaConf.to_container(value) if isinstance(value, ListConfig) else value)
            raise ConfigError(f"config file {p}: section {name} must be a mapping of keys ({name}:, then indented "
                              f"key: value lines), got {got[:40]}; {_valid_keys([name])}")
    return loaded


def read_json_object(path: str | os.PathLike, what: str, fix: str) -> dict:
    """A JSON file that must hold one object (a DeepSpeed config), read with one-line errors and as DeepSpeed reads
    its config files: Hjson (``//`` comments and trailing commas allowed), a key given twice refused.

    Args:
        path: the file (it must exist: callers say what a missing one means); what: how the user named it, for the
            message (``--deepspeed_config``, ``deepspeed.config``); fix: what to do about a damaged file, likewise.
    Raises:
        ConfigError: the file is not valid JSON (or not UTF-8, or gives a key twice), or holds no object.
    """
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys as once  # as DeepSpeed reads it
    text = _utf8_text(Path(path), f"{what} {path}")
    try:  # a key given twice is a ValueError (json's own last-wins would drop the first silently)
        data = hjson.loads(text, object_pairs_hook=once)
    except (hjson.HjsonDecodeError, ValueError) as e:
        raise ConfigError(f"{what} {path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a JSON object, got {type(data).__name__}; {fix}")
    return data


def _utf8_text(p: Path, what: str) -> str:
    """The text of the config file ``p`` (a UTF-8 byte-order mark dropped); ``what`` names it in the message.

    Raises:
        ConfigError: it is not UTF-8 (UTF-16, as Windows Notepad saves files, or Latin-1, ...): one line saying to
            save it as UTF-8 (a UnicodeDecodeError traceback in every program).
    """
    data = p.read_bytes()
    try:
        text = data.decode("utf-8-sig")
        if "\x00" not in text:  # UTF-16 of ASCII text without a byte-order mark decodes, NULs between the letters
            return text
        why = ""
    except UnicodeDecodeError as e:
        why = f"{e.reason} at byte {e.start}"
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        why = "it is UTF-16, as Windows Notepad saves it"
    elif b"\x00" in data:
        why = "it holds NUL bytes, as UTF-16 text does"
    raise ConfigError(f"{what} is not UTF-8 text ({why}); save it as UTF-8")


def to_yaml(cfg: ExperimentConfig) -> str:
    """The resolved experiment as YAML (for logs and run directories)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
