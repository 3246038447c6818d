"""The cheap checks of an experiment config that need no model (:func:`validate`, run by
:func:`spd_ds.config.load_config` on every config it returns); more happen where the model is known."""

from __future__ import annotations

import dataclasses
import math
import re

from spd_ds.config import DIST_BACKENDS, SDPA_BACKENDS, ConfigError, ExperimentConfig


def validate(cfg: ExperimentConfig) -> None:
    """Cheap checks that need no model (more happen when the model is known): the values' ranges and names, and
    ``data.chat_template`` (an existing UTF-8 file or Jinja text that is a chat template:
    :func:`spd_ds.train.chat.read_chat_template`). Raises ConfigError."""
    from spd_ds.models.adapter import resolve_dtype

    for section in dataclasses.fields(cfg):  # nan passes every range check below, inf most: neither is a setting
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}")

    try:
        resolve_dtype(cfg.model.dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.head.dtype is not None:
        try:
            resolve_dtype(cfg.head.dtype)
        except ValueError:
            raise ConfigError(f"head.dtype={cfg.head.dtype!r} is not one of float32, bfloat16, float16 (or null for "
                              "model.dtype)") from None
    from spd_ds.models.masks import check_stage_attention

    check_stage_attention(cfg.model.attn_implementation)  # sdpa | eager (training's sdpa alone: checked there)
    if cfg.head.num_layers < 1:
        raise ConfigError(f"head.num_layers (the tower's decoder layers, L_s) must be >= 1, got {cfg.head.num_layers}")
    if cfg.decoding.max_length < 2:
        raise ConfigError(f"decoding.max_length (KV positions per request) must be >= 2, got {cfg.decoding.max_length}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(cfg.model.device)):
        raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {cfg.model.device!r}")
    backends = cfg.model.sdpa_backends
    if backends is not None and (isinstance(backends, str) or not isinstance(backends, (list, tuple)) or not backends
            or any(b not in SDPA_BACKENDS for b in backends)):
        raise ConfigError(f"model.sdpa_backends must list some of {', '.join(SDPA_BACKENDS)} (e.g. model.sdpa_backends="
                          f"'[efficient, math]', or null for the device's default), got {backends!r}")
    if cfg.head.placement not in ("colocated", "dedicated"):
        raise ConfigError(f"head.placement must be 'colocated' or 'dedicated', got {cfg.head.placement!r}")
    if not str(cfg.train.output_dir).strip():  # Path("") is ".": the run would write into the working directory
        raise ConfigError("train.output_dir is empty; give the run's folder (e.g. train.output_dir=runs/heads/my_run)")
    backend = cfg.deepspeed.backend
    if backend is not None and not (str(backend).lower() in DIST_BACKENDS
                                    or re.fullmatch(r"\w+:\w+(,\w+:\w+)*", str(backend))):
        raise ConfigError(f"deepspeed.backend must be one of {', '.join(b for b in DIST_BACKENDS if b)}, a per-device "
                          f"map such as cpu:gloo,cuda:nccl, or null (nccl on GPU, gloo on CPU), got {backend!r}")
    if cfg.decoding.drafter not in ("head", "oracle"):
        raise ConfigError(f"decoding.drafter must be 'head' or 'oracle', got {cfg.decoding.drafter!r}")
    if cfg.partition.num_stages is not None and cfg.partition.num_stages < 1:
        raise ConfigError(f"partition.num_stages must be >= 1, got {cfg.partition.num_stages}")
    if cfg.decoding.max_new_tokens < 1:
        raise ConfigError(f"decoding.max_new_tokens must be >= 1, got {cfg.decoding.max_new_tokens}")
    stop = cfg.decoding.stop
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s
                                                                           for s in stop):
        raise ConfigError(f"decoding.stop must be a list of non-empty strings, quoted in YAML (e.g. "
                          f"decoding.stop='[\"User:\", \"No\"]'), got {stop!r}")
    from spd_ds.decoding.sampling import SamplingParams

    d = cfg.decoding
    try:
        SamplingParams(d.temperature, d.top_k, d.top_p, d.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.data.num_prompts is not None and cfg.data.num_prompts < 1:
        raise ConfigError(f"data.num_prompts must be >= 1 (or null for all), got {cfg.data.num_prompts}")
    if cfg.eval.hbm_gbps is not None and cfg.eval.hbm_gbps <= 0:
        raise ConfigError("eval.hbm_gbps must be > 0 (GB/s per GPU) or null for the GPU's own, "
                          f"got {cfg.eval.hbm_gbps}")
    if not 0.0 <= d.oracle_alpha <= 1.0:
        raise ConfigError(f"decoding.oracle_alpha must be in [0, 1], got {d.oracle_alpha}")
    bad = [a for a in cfg.eval.oracle_alphas or () if not 0.0 <= a <= 1.0]  # (nan fails it too)
    if bad:  # refused by the eval's runner too, but only once the model was fetched and its config read
        raise ConfigError(f"eval.oracle_alphas: each alpha must be in [0, 1], got {bad[0]} (e.g. "
                          "eval.oracle_alphas='[1, 0.8, 0.6]')")
    if not 0.0 <= cfg.data.held_out_fraction < 1.0:
        raise ConfigError(f"data.held_out_fraction must be in [0, 1), got {cfg.data.held_out_fraction}")
    if cfg.data.chat_template:  # every program, before its model or tokenizer loads (a bad one failed only then)
        from spd_ds.train.chat import ChatTemplateError, read_chat_template

        try:
            read_chat_template(cfg.data.chat_template)
        except ChatTemplateError as e:
            raise ConfigError(f"data.chat_template: {e}") from None
    for key in ("compile_teacher", "compile_loss"):
        mode = getattr(cfg.train, key)
        if mode not in (None, "auto"):
            from torch.compiler import list_backends

            if mode not in list_backends(exclude_tags=()):
                raise ConfigError(f"train.{key} must be auto, a torch.compile backend (inductor, or aot_eager to "
                                  f"debug) or null for eager, got {mode!r}")
    if cfg.train.teacher_attention not in ("auto", "sdpa", "flex"):
        raise ConfigError(f"train.teacher_attention must be auto, sdpa or flex, got {cfg.train.teacher_attention!r}")
    if cfg.train.teacher_attention == "flex" and not cfg.data.pack:
        raise ConfigError("train.teacher_attention=flex needs data.pack=true (unpacked rows change length every "
                          "micro-batch: a FlexAttention compile each); set train.teacher_attention=sdpa")
    if cfg.train.flex_compile not in ("static", "dynamic"):
        raise ConfigError(f"train.flex_compile must be static or dynamic, got {cfg.train.flex_compile!r}")
    if not 0.0 <= cfg.train.lr_stable_fraction < 1.0:
        raise ConfigError(f"train.lr_stable_fraction must be in [0, 1) (the share of the run before the decay), got "
                          f"{cfg.train.lr_stable_fraction}")
    if cfg.train.eval_every < 0:
        raise ConfigError(f"train.eval_every must be >= 0 (0 = no validation), got {cfg.train.eval_every}")
    if cfg.train.eval_batches is not None and cfg.train.eval_batches < 1:
        raise ConfigError(f"train.eval_batches must be >= 1 (or null for all), got {cfg.train.eval_batches}")
    try:
        resolve_dtype(cfg.train.save_dtype)
    except ValueError:
        raise ConfigError(f"train.save_dtype={cfg.train.save_dtype!r} is not one of float32, bfloat16, float16 (the "
                          "final head's weights)") from None
    if cfg.data.overflow not in ("truncate", "drop"):
        raise ConfigError(f"data.overflow must be truncate or drop, got {cfg.data.overflow!r}")
    for key, low, strict, nullable in _BOUNDS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None and nullable:
            continue
        if value is None or (value <= low if strict else value < low):
            bound = f"> {low:g}" if strict else f">= {low:g}"
            raise ConfigError(f"{key} must be {bound}{' (or null)' if nullable else ''}, got {value}")
    for key, seed in (("train.seed", cfg.train.seed), ("decoding.seed", cfg.decoding.seed)):
        if not 0 <= seed < 2**63:
            raise ConfigError(f"{key} must be in [0, 2^63), got {seed}")
    if not 0.01 <= cfg.train.kd_temperature <= 100:  # outside, the softened logits underflow or overflow the loss
        raise ConfigError(f"train.kd_temperature must be in [0.01, 100] (1 = the target's own distribution), got "
                          f"{cfg.train.kd_temperature}")
    lengths = cfg.eval.random_prompt_lengths
    if not lengths or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in lengths):
        raise ConfigError(f"eval.random_prompt_lengths must list prompt lengths >= 1 (tokens), e.g. "
                          f"eval.random_prompt_lengths='[128, 512]', got {list(lengths) if lengths else lengths!r}")
    if cfg.train.epochs == 0 and cfg.train.max_steps is None:
        raise ConfigError("train.epochs=0 (no epoch limit) needs train.max_steps; set either")
    if not 0.0 <= cfg.train.full_pipeline_prob <= 1.0:
        raise ConfigError(f"train.full_pipeline_prob (the probability of a full pipeline fill) must be in [0, 1], got "
                          f"{cfg.train.full_pipeline_prob}")


# Numeric settings with a lower bound: (key, bound, strict (> rather than >=), null allowed). What the loops divide
# by or count with; the other ranges (probabilities, fractions) are checked in validate() itself.
_BOUNDS = (
    ("train.lr", 0, False, False), ("train.weight_decay", 0, False, False), ("train.warmup_steps", 0, False, False),
    ("train.kd_temperature", 0, True, False), ("train.epochs", 0, False, False), ("train.max_steps", 1, False, True),
    ("train.save_every", 1, False, False), ("train.log_every", 1, False, False),
    ("train.keep_checkpoints", 0, False, False), ("train.max_time_s", 0, True, True),
    ("train.session_time_s", 0, False, True), ("train.loss_chunk", 1, False, False),
    ("train.prefetch", 0, False, False), ("train.profile_steps", 1, False, True),
    ("data.micro_batch_size", 1, False, False), ("data.max_conversations", 1, False, True),
    ("data.num_workers", 0, False, False), ("data.min_seq_length", 1, False, False),
    ("eval.baseline_num_prompts", 1, False, True), ("eval.warmup_prompts", 0, False, False),
    ("head.intermediate_size", 1, False, True), ("train.teacher_pipe_degree", 1, False, True),
    ("data.max_seq_length", 2, False, False), ("deepspeed.timeout_s", 0, True, False),
    # data.regenerate's (as launch/prepare_train_data.py regenerate refuses its flags): 0 or below failed after the
    # target loaded (batch size 0, no new token), regenerated nothing (a negative batch size, no prompt token) or was
    # greedy without a word (a negative temperature)
    ("data.regenerate_max_new_tokens", 1, False, False), ("data.regenerate_batch_size", 1, False, False),
    ("data.regenerate_max_prompt_tokens", 1, False, False), ("data.regenerate_temperature", 0, False, False),
)


__all__ = ["validate"]
