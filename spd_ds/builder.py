"""From an :class:`~spd_ds.config.ExperimentConfig` to live objects: model, partition, head, drafter, decoders.

Every entry point (``launch/infer.py``, ``launch/eval.py``, ``launch/train.py``, the DeepSpeed engine) builds
through these functions, so a run's pieces always come from the same partition and the same settings.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from spd_ds.cli import one_line
from spd_ds.config import ConfigError, ExperimentConfig
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.stopping import StopStrings
from spd_ds.head import HeadMismatchError, SpeculationHead, load_draft_vocab
from spd_ds.models.adapter import Target, TargetArch, head_layer_config, resolve_dtype
from spd_ds.models.errors import ModelFileError
from spd_ds.partition import PartitionError, StagePartition

log = logging.getLogger(__name__)


_REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_path(path: str | None) -> str | None:
    """A relative path from the config, taken from the working directory, else from the repository / install root
    (so ``spd_ds/assets/...`` and ``draft_vocab/...`` work from anywhere)."""
    if path is None or Path(path).is_absolute() or Path(path).exists():
        return path
    alt = _REPO_ROOT / path
    return str(alt) if alt.exists() else path


def resolve_device(name: str) -> torch.device:
    """``model.device`` -> ``torch.device``: ``auto`` = cuda if available else cpu.

    Raises:
        ConfigError: a CUDA device asked for where torch has none (a CPU build, or no GPU visible).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name} but torch {torch.__version__} sees no CUDA device here; use "
                          "model.device=cpu (or auto)")
    return torch.device(name)


def set_sdpa_backends(backends: Sequence[str] | None, device_type: str = "cuda") -> None:
    """Enable exactly ``backends`` (names of :data:`spd_ds.config.SDPA_BACKENDS`; ``None`` = the device's
    :data:`spd_ds.config.DEFAULT_SDPA_BACKENDS`) among torch's scaled-dot-product attention kernels, process-wide
    (``torch.backends.cuda.enable_{flash,mem_efficient,math,cudnn}_sdp``; the flags also steer the CPU kernel
    choice), so that SPD and the AR baselines of one process choose among the same
    kernels (``model.sdpa_backends``).

    Args:
        backends: backend names, or ``None`` for the device's default.
        device_type: ``cpu`` or ``cuda``, the device the decoding runs on (which backends can run every call).

    Raises:
        ConfigError: an unknown name, or a list that cannot run every attention call there (CPU needs ``math`` or
            ``flash``, CUDA ``math`` or ``efficient``).
    """
    from spd_ds.config import DEFAULT_SDPA_BACKENDS, SDPA_BACKENDS

    if backends is None:
        backends = DEFAULT_SDPA_BACKENDS["cpu" if device_type == "cpu" else "cuda"]
    unknown = [b for b in backends if b not in SDPA_BACKENDS]
    if unknown:
        raise ConfigError(f"model.sdpa_backends: unknown {unknown}; choose from {', '.join(SDPA_BACKENDS)}")
    need = ("math", "flash") if device_type == "cpu" else ("math", "efficient")
    if not set(need) & set(backends):
        raise ConfigError(f"model.sdpa_backends={list(backends)} cannot run every attention call on {device_type}; "
                          f"add {need[0]} or {need[1]} (e.g. model.sdpa_backends='[{', '.join([*backends, 'math'])}]')")
    cuda = torch.backends.cuda
    cuda.enable_flash_sdp("flash" in backends)
    cuda.enable_mem_efficient_sdp("efficient" in backends)
    cuda.enable_math_sdp("math" in backends)
    cuda.enable_cudnn_sdp("cudnn" in backends)


def model_dir(cfg: ExperimentConfig) -> Path:
    """Local HF directory of ``cfg.model.name`` (zoo name, local dir or hub id); see
    :func:`spd_ds.zoo.resolve_model`."""
    from spd_ds.zoo import resolve_model

    return resolve_model(cfg.model.name, cfg.model.cache_dir)


def build_arch(cfg: ExperimentConfig, *, decoding: bool = True) -> TargetArch:
    """The target's :class:`TargetArch` (config + layer classes + lazy weights). Its stage caches support rewinds of
    up to ``n - 1`` tokens for the configured ``n`` (the linear-attention snapshot rings of hybrid targets).

    With ``decoding`` (every decoding entry point; training passes False) it also restricts this process's SDPA
    kernels to ``model.sdpa_backends`` (:func:`set_sdpa_backends`), before any forward or CUDA-graph capture.

    Raises:
        ConfigError: a ``model.attn_implementation`` the stages cannot run
            (:func:`~spd_ds.models.masks.check_stage_attention`)."""
    from spd_ds.models.masks import check_stage_attention

    check_stage_attention(cfg.model.attn_implementation, decoding)
    if decoding:
        dev = str(cfg.model.device)
        cuda = dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())
        set_sdpa_backends(cfg.model.sdpa_backends, "cuda" if cuda else "cpu")
    n = configured_num_stages(cfg)
    return TargetArch(model_dir(cfg), cfg.model.attn_implementation, max_rollback=max(n - 1, 0))


def configured_num_stages(cfg: ExperimentConfig) -> int:
    """Pipeline stages the config asks for, before the model is known: ``len(partition.stage_layers)`` when given,
    else ``partition.num_stages`` (1 when null). :func:`build_partition` checks it against the model."""
    p = cfg.partition
    return len(p.stage_layers) if p.stage_layers else int(p.num_stages or 1)


def build_partition(cfg: ExperimentConfig, arch: TargetArch) -> StagePartition:
    """The run's partition (``partition.num_stages`` or ``stage_layers``, and ``anchors``); with a head checkpoint it
    must be the one the head was trained for.

    Raises:
        ConfigError: invalid partition, one that disagrees with the head checkpoint (a head of another target
            depth: the base-model check's message, which says to use a head trained for this target), or a
            ``head.checkpoint`` that is no head folder.
        HeadCheckpointError: a damaged ``head_config.json``.
    """
    p = cfg.partition
    cfg.head.checkpoint = resolve_path(cfg.head.checkpoint)
    cfg.head.draft_vocab = resolve_path(cfg.head.draft_vocab)
    try:
        part = StagePartition.build(arch.num_layers, p.num_stages if p.stage_layers is None else None,
                                    p.stage_layers, p.anchors)
    except PartitionError as e:
        raise ConfigError(str(e)) from None
    if p.stage_layers is not None and p.num_stages not in (None, len(p.stage_layers)):
        log.warning("partition.stage_layers gives %d stages; partition.num_stages=%s is ignored",
                    len(p.stage_layers), p.num_stages)
    if cfg.head.checkpoint:
        try:
            saved = StagePartition.from_dict(SpeculationHead.read_config(cfg.head.checkpoint)["partition"])
        except FileNotFoundError as e:  # a path that is no head folder: the user's to fix in every program
            raise ConfigError(str(e)) from None
        if saved != part and saved.num_layers != part.num_layers:  # a head of another target: no partition fits
            try:
                SpeculationHead.check_base_model(cfg.head.checkpoint, arch)
            except HeadMismatchError as e:
                raise ConfigError(str(e)) from None
        if saved != part:
            raise ConfigError(f"head.checkpoint {cfg.head.checkpoint} was trained for partition {saved}, but the "
                              f"config asks for {part}; set {' '.join(_partition_fix(p, saved))} or use another head")
    return part


def _partition_fix(p, saved: StagePartition) -> list[str]:
    """The fewest ``partition.*`` overrides that turn the settings ``p`` into the partition ``saved``, each one added
    only while the partition the settings then give still differs: ``num_stages``, then ``stage_layers``, then
    ``anchors`` (a changed stage count or split moves the default anchors, which the run's own partition does not
    show; ``stage_layers`` given wins over ``num_stages``)."""
    num_stages, stage_layers, anchors = p.num_stages, p.stage_layers, p.anchors

    def gives() -> StagePartition | None:
        try:
            return StagePartition.build(saved.num_layers, num_stages if stage_layers is None else None, stage_layers,
                                        anchors)
        except PartitionError:  # e.g. anchors that fit the old stage count only
            return None

    fix, now = [], gives()
    if now is None or now.num_stages != saved.num_stages:
        num_stages = saved.num_stages
        fix.append(f"partition.num_stages={num_stages}")
        now = gives()
    if now is None or now.stage_layers != saved.stage_layers:
        stage_layers = list(saved.stage_layers)
        fix.append(f"partition.stage_layers=[{','.join(map(str, stage_layers))}]")
        now = gives()
    if now != saved:
        fix.append(f"partition.anchors=[{','.join(map(str, saved.anchors))}]")
    return fix


FULL_VOCAB = "full"  # head.draft_vocab value: draft over the target's whole vocabulary


def draft_vocab_ids(draft_vocab: str, vocab_size: int | None = None) -> list[int] | None:
    """The ids of ``head.draft_vocab``: a draft-vocabulary JSON (:func:`~spd_ds.head.load_draft_vocab`), or ``None``
    for ``full`` (the whole vocabulary).

    Args:
        draft_vocab: the file's path, or ``full``.
        vocab_size: the target's vocabulary size; given, every id must lie in ``[0, vocab_size)``.
    Raises:
        ConfigError: the file is missing or unreadable, is not JSON with a non-empty integer ``token_ids`` list, its
            ids are not sorted and unique, or (``vocab_size`` given) an id lies outside the target's vocabulary, as in
            a file built for another model (the message names ``head.draft_vocab``).
    """
    if draft_vocab == FULL_VOCAB:
        return None
    if not Path(draft_vocab).exists():
        raise ConfigError(f"head.draft_vocab={draft_vocab} does not exist; give a draft-vocabulary JSON (draft_vocab/ "
                          "holds one, launch/build_draft_vocab.py writes one), head.draft_vocab=full (every id), or "
                          "leave it null (a loaded head's own ids, every id for a new head)")
    try:
        ids = load_draft_vocab(draft_vocab)
    except OSError as e:
        raise ConfigError(f"head.draft_vocab={draft_vocab}: cannot read it ({e.strerror or e}); give a "
                          f"draft-vocabulary JSON (e.g. draft_vocab/) or {FULL_VOCAB}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"head.draft_vocab={draft_vocab} is not JSON ({e}); give a draft-vocabulary JSON "
                          "(docs/training.md, section Draft vocabulary)") from None
    except KeyError as e:
        raise ConfigError(f"head.draft_vocab={draft_vocab} has no {e} list; a draft-vocabulary JSON holds token_ids "
                          "(docs/training.md, section Draft vocabulary)") from None
    except (ValueError, TypeError) as e:  # load_draft_vocab's messages name the file and what is wrong
        raise ConfigError(f"head.draft_vocab: {e}") from None
    if vocab_size is not None and not 0 <= ids[0] <= ids[-1] < vocab_size:  # sorted: the ends bound every id
        raise ConfigError(f"head.draft_vocab={draft_vocab} holds ids in [{ids[0]}, {ids[-1]}], outside the target's "
                          f"vocabulary of {vocab_size} ids (a file built for another model?); build one for this "
                          "model with launch/build_draft_vocab.py --model ..., or give head.draft_vocab=full")
    return ids


def check_head_inputs(cfg: ExperimentConfig, ppsd: bool = False) -> None:
    """The head files the config names, checked before any model is resolved or loaded and before any collective
    (every rank runs it; it reads a few small JSON files): ``head.checkpoint`` (and with ``ppsd``, the evaluations'
    ``eval.ppsd_checkpoint``) is a head folder whose ``head_config.json`` reads, ``head.draft_vocab`` is ``full`` or a
    draft-vocabulary JSON that reads. Resolves ``head.checkpoint`` and ``head.draft_vocab`` (and with ``ppsd``,
    ``eval.ppsd_checkpoint``) in ``cfg`` as :func:`build_partition` and :func:`build_head` do (from the working
    directory, else the repository).

    Raises:
        ConfigError: a head folder or draft vocabulary that is missing or unreadable (one line naming the key, the
            path and what to give instead; :func:`draft_vocab_ids`).
        HeadCheckpointError / HeadMismatchError: a damaged ``head_config.json`` or another head format version
            (:meth:`SpeculationHead.read_config`; for ``eval.ppsd_checkpoint`` a ConfigError naming it).
    """
    cfg.head.checkpoint = resolve_path(cfg.head.checkpoint)
    cfg.head.draft_vocab = resolve_path(cfg.head.draft_vocab)
    if cfg.head.checkpoint:
        try:
            SpeculationHead.read_config(cfg.head.checkpoint)
        except FileNotFoundError as e:  # a path that is no head folder
            raise ConfigError(str(e)) from None
    if cfg.head.draft_vocab:
        draft_vocab_ids(cfg.head.draft_vocab)
    if ppsd and cfg.eval.ppsd_checkpoint:
        cfg.eval.ppsd_checkpoint = resolve_path(cfg.eval.ppsd_checkpoint)
        try:
            SpeculationHead.read_config(cfg.eval.ppsd_checkpoint, "eval.ppsd_checkpoint")
        except FileNotFoundError as e:  # its message names the key, as spd_ds.eval.inputs.ppsd_partition's, later
            raise ConfigError(str(e)) from None
        except ValueError as e:
            raise ConfigError(f"eval.ppsd_checkpoint: {e}") from None


def build_head(cfg: ExperimentConfig, arch: TargetArch, partition: StagePartition) -> SpeculationHead:
    """Load ``head.checkpoint`` or make an untrained head (draft vocabulary from ``head.draft_vocab``; tower from
    target layer ``head.tower_init_layer`` when set). A loaded head keeps its own draft vocabulary unless
    ``head.draft_vocab`` is set: a head with ``lm_head_from_target`` then drafts over that one
    (:meth:`~spd_ds.head.SpeculationHead.set_draft_vocab`; ``full`` = every id), another head ignores it (warning).

    Raises:
        ConfigError: a bad ``head.draft_vocab`` (:func:`draft_vocab_ids`) or ``head.tower_init_layer`` (see
            :meth:`~spd_ds.head.SpeculationHead.init_tower_from_layer`). The checkpoint loader's errors.
    """
    cfg.head.checkpoint = resolve_path(cfg.head.checkpoint)
    cfg.head.draft_vocab = resolve_path(cfg.head.draft_vocab)
    if cfg.head.checkpoint:
        if cfg.head.tower_init_layer is not None:
            log.warning("head.tower_init_layer=%s ignored: head.checkpoint %s is loaded as it is",
                        cfg.head.tower_init_layer, cfg.head.checkpoint)
        head = SpeculationHead.load(cfg.head.checkpoint, arch, partition)
        _record_loaded_shape(cfg, head)
        if cfg.head.draft_vocab:  # a target-tied head drafts over the given vocabulary (set_draft_vocab)
            ids = draft_vocab_ids(cfg.head.draft_vocab, arch.vocab_size)
            if torch.equal(torch.arange(arch.vocab_size) if ids is None else torch.tensor(ids), head.draft_ids.cpu()):
                pass  # already its vocabulary
            elif head.lm_head_from_target:
                head.set_draft_vocab(ids)
                log.info("head %s drafts over head.draft_vocab=%s (%d ids)", cfg.head.checkpoint,
                         cfg.head.draft_vocab, head.draft_vocab_size)
            else:
                log.warning("head.draft_vocab=%s ignored: head %s stores its own LM head for its %d-id vocabulary",
                            cfg.head.draft_vocab, cfg.head.checkpoint, head.draft_vocab_size)
        return head
    ids = draft_vocab_ids(cfg.head.draft_vocab, arch.vocab_size) if cfg.head.draft_vocab else None
    torch.manual_seed(cfg.train.seed)
    head = SpeculationHead(arch, partition, cfg.head.num_layers, ids, cfg.head.intermediate_size,
                           lm_head_from_target=cfg.head.lm_head_from_target)
    if cfg.head.tower_init_layer is not None:
        copied = head.init_tower_from_layer(cfg.head.tower_init_layer)
        kept = [n for n, _ in head.layers[0].named_parameters() if n not in copied]
        log.info("head tower from target layer %s: %d tensors copied%s", cfg.head.tower_init_layer, len(copied),
                 f"; kept their initialisation: {', '.join(kept)}" if kept else "")
    return head


def _record_loaded_shape(cfg: ExperimentConfig, head: SpeculationHead) -> None:
    """A loaded head keeps its own shape: ``head.num_layers``, ``head.intermediate_size`` and
    ``head.lm_head_from_target`` (settings of new heads) take the checkpoint's values in ``cfg``, so that the config a
    run writes (training's ``config.yaml``) says what ran; a value set to something else than the default is named in
    a warning (it was dropped without a word, and a warm start's config.yaml said ``num_layers: 1`` for a two-layer
    head)."""
    default, hc = type(cfg.head)(), cfg.head
    width = head_layer_config(head.arch, 1).intermediate_size  # the target's MLP width (intermediate_size null)
    for key, own in (("num_layers", head.num_layers), ("intermediate_size", head.intermediate_size),
                     ("lm_head_from_target", head.lm_head_from_target)):
        given = getattr(hc, key)
        if given == own or (key == "intermediate_size" and (given or width) == (own or width)):
            continue
        if given != getattr(default, key):
            log.warning("head.%s=%s ignored: head.checkpoint %s has %s (a loaded head keeps its own shape)", key,
                        given, hc.checkpoint, f"{key}={own}" if own is not None else f"the target's width {width}")
        setattr(hc, key, own)


def sampling_params(cfg: ExperimentConfig, seed: int | None = None, request: int = 0) -> SamplingParams:
    """:class:`SamplingParams` from the ``decoding`` section for request ``request`` (the prompt's index in the run,
    part of every uniform's key: see :mod:`spd_ds.decoding.sampling`); ``seed`` overrides ``decoding.seed``."""
    d = cfg.decoding
    return SamplingParams(d.temperature, d.top_k, d.top_p, d.seed if seed is None else seed, int(request))


def eos_token_ids(cfg: ExperimentConfig, arch: TargetArch, tokenizer=None) -> list[int]:
    """EOS ids: ``decoding.eos_token_ids`` or the union of the model's generation config, config and tokenizer EOS.

    Raises:
        ConfigError: a ``decoding.eos_token_ids`` id outside the target's vocabulary.
        ModelFileError: a ``generation_config.json`` that cannot be read (:func:`generation_eos_ids`).
    """
    if cfg.decoding.eos_token_ids is not None:
        bad = [i for i in cfg.decoding.eos_token_ids if not 0 <= i < arch.vocab_size]
        if bad:
            raise ConfigError(f"decoding.eos_token_ids {bad} are outside the target's vocabulary of {arch.vocab_size} "
                              "ids; give ids from its tokenizer, or null for the model's own")
        return list(cfg.decoding.eos_token_ids)
    ids: set[int] = set(generation_eos_ids(arch.model_dir))
    sources = [getattr(arch.config, "eos_token_id", None)]
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        if s is None:
            continue
        ids.update([s] if isinstance(s, int) else s)
    return sorted(ids)


def stop_strings(cfg: ExperimentConfig, tokenizer) -> StopStrings | None:
    """The :class:`~spd_ds.decoding.stopping.StopStrings` of ``decoding.stop`` over ``tokenizer`` (``None`` when
    the list is empty).

    Raises:
        ConfigError: stop strings were given but the model has no tokenizer (random-weight shapes).
    """
    if not cfg.decoding.stop:
        return None
    if tokenizer is None:
        raise ConfigError(f"decoding.stop needs the model's tokenizer and {cfg.model.name} has none; remove "
                          "decoding.stop or use a model with a tokenizer")
    return StopStrings.from_tokenizer(list(cfg.decoding.stop), tokenizer)


def load_generation_model(model_dir: str | os.PathLike, dtype: torch.dtype, **kwargs):
    """The target as a transformers ``AutoModelForCausalLM`` for generating training data (regenerate,
    selfdistill), after the checks every command makes: its ``config.json`` and weights files
    (:class:`~spd_ds.models.adapter.TargetArch`; an architecture spd-ds does not split still generates), its
    ``generation_config.json``, and every weight present with its shape (transformers would initialise a missing one
    at random, and the data would be another model's answers).

    Args:
        model_dir: the local model folder; dtype: the weights' dtype; kwargs: more ``from_pretrained`` arguments.
    Returns:
        The model (on the CPU, in ``dtype``, not in eval mode).
    Raises:
        ModelFileError: a file that cannot be read, or weights missing or of other shapes than the config's.
    """
    from transformers import AutoModelForCausalLM

    from spd_ds.models.adapter import UnsupportedModelError

    try:
        TargetArch(model_dir)
    except UnsupportedModelError:
        pass
    generation_eos_ids(model_dir)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, output_loading_info=True,
                                                           **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ModelFileError(f"{model_dir} cannot be loaded by transformers ({type(e).__name__}: "
                             f"{one_line(e, 200)}); fix or re-download the model") from None
    bad = sorted(info.get("missing_keys") or []) + sorted(str(k) for k in info.get("mismatched_keys") or [])
    if bad:
        raise ModelFileError(f"{model_dir}: {len(bad)} weight(s) missing or of another shape than config.json says "
                             f"({', '.join(bad[:3])}); the weights and the config are of different models")
    return model


def generation_eos_ids(model_dir: str | os.PathLike) -> list[int]:
    """The ``eos_token_id`` ids of ``model_dir/generation_config.json`` (``[]`` without the file or the key).

    Raises:
        ModelFileError: the file is not a JSON object, or its ``eos_token_id`` is not an id or a list of ids.
    """
    gen = Path(model_dir) / "generation_config.json"
    if not gen.exists():
        return []
    try:
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids = [] if e is None else [e] if isinstance(e, int) else list(e)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"eos_token_id {e!r} is not an id or a list of ids")
    except (ValueError, TypeError, AttributeError, OSError) as err:
        raise ModelFileError(f"{gen} cannot be read ({one_line(err, 200)}); fix or delete it") from None
    return ids


def load_tokenizer(arch: TargetArch | str | os.PathLike):
    """The target's tokenizer, from its local directory (``arch`` or the directory itself).

    Its ``model_max_length`` is lifted: spd-ds checks lengths itself (``decoding.max_length`` for prompts plus new
    tokens, ``data.max_seq_length`` for training rows), so the tokenizer's limit would only print a misleading
    warning before our error, or for long training conversations that are cut into rows anyway.

    Raises:
        ConfigError: the directory holds no ``tokenizer*`` file (a random-weight shape): transformers would build an
            empty tokenizer that encodes every text to no token.
        ModelFileError: its tokenizer files cannot be loaded.
    """
    from transformers import AutoTokenizer

    model_dir = Path(getattr(arch, "model_dir", arch))
    if not any(model_dir.glob("tokenizer*")):
        raise ConfigError(f"the model in {model_dir} has no tokenizer (random-weight shapes have none), so it "
                          "cannot read text (prompts, training data): use a model with one; speed runs without "
                          "text take random token prompts (launch/eval.py eval.prompt_sets=[random], "
                          "launch/benchmark.py --suite b)")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many types for a damaged file
        fix = "install the package it names" if isinstance(e, ImportError) else \
            "fix or re-download its tokenizer files"
        raise ModelFileError(f"the tokenizer in {model_dir} cannot be loaded ({type(e).__name__}: "
                             f"{one_line(e, 200)}); {fix}") from None
    tok.model_max_length = int(1e30)
    return tok


def prompt_tokenizer(cfg: ExperimentConfig, arch: TargetArch | str | os.PathLike):
    """The tokenizer that decoding encodes prompts with: :func:`load_tokenizer`, with ``data.chat_template``
    installed when it is set (the template training renders its conversations with, so that a head trained under
    its own template drafts for prompts in that form; ``decoding.chat_template=false`` still encodes raw text).
    Templates with a thinking switch (Qwen3's ``enable_thinking``) keep their default here, while training renders
    with it off.

    Returns:
        The transformers tokenizer (its ``chat_template`` replaced when ``data.chat_template`` is set).
    Raises:
        ConfigError: ``data.chat_template`` is neither an existing file nor Jinja text; and :func:`load_tokenizer`'s.
    """
    tok = load_tokenizer(arch)
    if cfg.data.chat_template:
        from spd_ds.train.chat import ChatTemplateError, set_chat_template

        try:
            set_chat_template(tok, cfg.data.chat_template)
        except ChatTemplateError as e:
            raise ConfigError(f"data.chat_template: {e}") from None
    return tok


def encode_prompt(tokenizer, text: str | Sequence[dict], chat_template: bool = True) -> list[int]:
    """Token ids of a user prompt (a string, or a list of chat messages), with the chat template and the generation
    prompt when ``chat_template`` and the tokenizer has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)
    if not isinstance(text, str):
        raise ValueError("a list of messages needs a tokenizer with a chat template")
    return tokenizer(text)["input_ids"]


def build_target(cfg: ExperimentConfig, arch: TargetArch, partition: StagePartition, device=None) -> Target:
    """The whole target (all stages) in one process, for the reference decoder and the AR baseline."""
    device = device or resolve_device(cfg.model.device)
    return Target(arch, partition, resolve_dtype(cfg.model.dtype), device)


def build_drafter(cfg: ExperimentConfig, head: SpeculationHead | None, arch: TargetArch, device, reference=None):
    """The proposer: the head (``decoding.drafter=head``, see :func:`build_head_drafter`; ``None`` without a head) or
    the oracle (``oracle``, needs ``reference`` tokens)."""
    from spd_ds.decoding.drafters import OracleDrafter

    if cfg.decoding.drafter == "oracle":
        if reference is None:
            raise ConfigError("decoding.drafter=oracle needs a reference AR run (the caller passes its tokens)")
        return OracleDrafter(reference, cfg.decoding.oracle_alpha, None, arch.vocab_size, seed=cfg.decoding.seed + 7)
    return build_head_drafter(cfg, head, cfg.decoding.max_length, device) if head is not None else None


def head_cuda_graph(cfg: ExperimentConfig, device) -> bool:
    """Whether the head drafts through a CUDA graph: a CUDA device and ``head.cuda_graph`` (default true, see
    :class:`~spd_ds.config.HeadConfig`; independent of the stages' ``deepspeed.cuda_graphs``)."""
    return torch.device(device).type == "cuda" and cfg.head.cuda_graph is not False  # null = the default


def build_head_drafter(cfg: ExperimentConfig, head: SpeculationHead, max_len: int, device):
    """The head's drafter: :class:`~spd_ds.decoding.head_graph.GraphedHeadDrafter` when :func:`head_cuda_graph`,
    else the eager :class:`~spd_ds.decoding.drafters.HeadDrafter` (CPU; also when the capture fails: the
    ``RuntimeError`` is logged as a warning, not raised).

    Args:
        head: the speculation head (moved to ``device`` in ``head.dtype``, default ``model.dtype``).
        max_len: the head's KV capacity in positions (``decoding.max_length``).
        device: where the head runs.
    Returns:
        A :class:`~spd_ds.decoding.drafters.Drafter`.
    """
    from spd_ds.decoding.drafters import HeadDrafter

    dtype = resolve_dtype(cfg.head.dtype or cfg.model.dtype)
    if head_cuda_graph(cfg, device):
        from spd_ds.decoding.head_graph import GraphedHeadDrafter

        import logging

        log = logging.getLogger(__name__)
        try:
            drafter = GraphedHeadDrafter(head, max_len, dtype, device, use_graph=True)
        except RuntimeError as e:  # e.g. an attention backend that cannot be captured
            log.warning("speculation head: CUDA graph capture failed (%s); drafting eagerly", str(e).splitlines()[0])
        else:
            log.info("speculation head: one CUDA graph per cycle (%d rows)", drafter.rows)
            return drafter
    return HeadDrafter(head, max_len, dtype, device)
