"""The head engine's DeepSpeed config (``--deepspeed_config``): read, checked and completed before any process group
or model is built (used by :func:`spd_ds.train.loop.train`)."""

from __future__ import annotations

import difflib
from pathlib import Path

from spd_ds.builder import resolve_path
from spd_ds.config import ConfigError, read_json_object


def load_ds_config(path_or_dict, micro_batch_rows: int, warn=None) -> dict:
    """The head engine's DeepSpeed config, with ``train_micro_batch_size_per_gpu`` set to our rows per micro-batch
    (``data.micro_batch_size``, divided among the teacher's pipeline stages) and ``train_batch_size`` left to
    DeepSpeed (micro-batch x accumulation x ranks); a file that sets either is told so through ``warn(message)``.
    ``path_or_dict``: the config itself, or its file (default ``ds_configs/zero2.json``; a relative path is looked for
    in the working directory, then in the repository: :func:`spd_ds.builder.resolve_path`). DeepSpeed's legacy
    ``"zero_optimization": true`` is checked as ZeRO stage 1, which DeepSpeed reads it as, and passed on as given.

    Raises:
        ConfigError: a missing file or one that is not a JSON object (or gives a key twice), an
            ``optimizer``/``scheduler`` section (spd-ds passes its own), fp16, ``bf16``/``fp16`` enabled ``"auto"``
            (Hugging Face's placeholder, which DeepSpeed drops), ``zero_optimization.stage`` other than 0, 1 or 2
            (ZeRO-3 partitions the head's weights, and the head written from them would be empty),
            ``zero_optimization.offload_optimizer``
            (or the deprecated ``"cpu_offload": true``) without ``"zero_force_ds_cpu_optimizer": false`` (DeepSpeed
            refuses to offload a client optimizer, after the model and data are loaded), an ``fp16`` that is no
            JSON object, ``gradient_accumulation_steps`` below 1, a ``gradient_clipping`` that is no number >= 0,
            any value DeepSpeed's own config parser refuses (:func:`check_with_deepspeed`: it would otherwise
            raise at the head engine's ``deepspeed.initialize``, after the target, the teacher engine and the data
            are loaded), and a top-level key DeepSpeed ignores that is a ZeRO setting or a near miss of a key.
    """
    where = ""  # the file, in messages
    if isinstance(path_or_dict, dict):
        cfg = dict(path_or_dict)
    else:
        p = Path(resolve_path(str(path_or_dict or "ds_configs/zero2.json")))  # cwd, else the repository
        if not p.exists():
            raise ConfigError(f"DeepSpeed config {p} not found; pass --deepspeed_config ds_configs/zero2.json")
        cfg = read_json_object(p, "DeepSpeed config", "fix the file or pass another --deepspeed_config")
        where = f" {p}"
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise ConfigError(f"remove the '{key}' section from the DeepSpeed config: spd-ds passes a torch AdamW "
                              "and a warmup/linear schedule (set train.lr / train.warmup_steps)")
    fp16 = cfg.get("fp16", {})
    if not isinstance(fp16, dict):  # (null or true: an AttributeError traceback here)
        raise ConfigError(f'fp16 in the DeepSpeed config must be a JSON object such as {{"enabled": false}}, got '
                          f"{fp16!r}; fp16 is not supported for head training (use bf16)")
    for key in ("bf16", "bfloat16", "fp16"):  # Hugging Face's Trainer fills "auto" in; DeepSpeed alone drops it
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") == "auto":  # (bf16 "auto" trained in fp32)
            give = ("false (fp16 is not supported for head training; use bf16)" if key == "fp16" else
                    "true (bf16 mixed precision) or false")
            raise ConfigError(f'{key}.enabled "auto" in the DeepSpeed config{where} is a placeholder that only '
                              f"Hugging Face's Trainer fills in; give {give}")
    if fp16.get("enabled"):
        raise ConfigError("fp16 is not supported for head training; use bf16 (or train.autocast=bf16)")
    zero = cfg.get("zero_optimization") or {}
    if isinstance(zero, bool):  # DeepSpeed's legacy form (false is {} above): true is ZeRO stage 1, with top-level
        zero = {"stage": 1}  # keys of its own (allgather_size): passed to DeepSpeed as given
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization in the DeepSpeed config must be a JSON object, got {zero!r}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2):  # ZeRO-3 partitions the weights the head is saved from
        why = ("ZeRO-3 would save empty head weights; use ds_configs/zero2.json" if stage == 3 else
               'give it as a JSON number, e.g. "stage": 2' if str(stage).strip() in ("0", "1", "2") else
               "use ds_configs/zero2.json")
        raise ConfigError(f"zero_optimization.stage in the DeepSpeed config must be 0, 1 or 2, got {stage!r}; {why}")
    offload = zero.get("offload_optimizer") or {}
    device = offload.get("device", "none") if isinstance(offload, dict) else offload
    if device not in (None, "none") and cfg.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise _offload_error(device, "offload_optimizer")
    ignored = [f"{k}={cfg[k]}" for k in ("train_batch_size", "train_micro_batch_size_per_gpu") if k in cfg]
    if ignored and warn is not None:
        warn(f"the DeepSpeed config's {' and '.join(ignored)} {'are' if len(ignored) > 1 else 'is'} ignored: spd-ds "
             "sets the batch from data.micro_batch_size (rows per micro-batch) and the config's "
             "gradient_accumulation_steps; set those instead")
    cfg.pop("train_batch_size", None)
    cfg["train_micro_batch_size_per_gpu"] = int(micro_batch_rows)
    gas = cfg.setdefault("gradient_accumulation_steps", 1)
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ConfigError(f"gradient_accumulation_steps in the DeepSpeed config must be an integer >= 1, got {gas!r}")
    clip = cfg.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:  # (nan too) a str: TypeError
        raise ConfigError(f"gradient_clipping in the DeepSpeed config must be a number >= 0 (0 = no clipping), "
                          f"got {clip!r}")
    cfg.setdefault("steps_per_print", 1 << 30)
    parsed = check_with_deepspeed(cfg, where, warn)
    offload = parsed.zero_config.offload_optimizer  # as DeepSpeed reads it: the deprecated "cpu_offload": true too
    device = getattr(offload, "device", None)
    device = str(getattr(device, "value", device))  # an enum member or its value, as the model keeps it
    if device in ("cpu", "nvme") and parsed.zero_force_ds_cpu_optimizer:  # its engine's test for the client AdamW
        raise _offload_error(device, "cpu_offload" if zero.get("cpu_offload") else "offload_optimizer")
    return cfg


def _offload_error(device: str, key: str) -> ConfigError:
    return ConfigError(f"zero_optimization.{key} (device {device!r}) in the DeepSpeed config needs "
                       '"zero_force_ds_cpu_optimizer": false beside it (spd-ds passes a torch AdamW, which '
                       f"DeepSpeed otherwise refuses to offload); add it, or remove {key}")


# Top-level keys DeepSpeed reads outside its config parser: the sequence- and data-parallel mesh
# (deepspeed.initialize) when a process group exists
_READ_ELSEWHERE = frozenset({"sequence_parallel_size", "data_parallel_size"})


class _ReadKeys(dict):
    """A config whose top-level reads are recorded in ``seen`` (``[]``, ``get``, ``in``, ``in .keys()``): the keys
    DeepSpeed's parser looked for, present or not."""

    def __init__(self, cfg: dict, seen: set):
        super().__init__(cfg)
        self.seen = seen

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        return _ReadKeysView(self)


class _ReadKeysView:
    def __init__(self, d: _ReadKeys):
        self.d = d

    def __contains__(self, key):
        return key in self.d  # recorded

    def __iter__(self):
        return iter(dict.keys(self.d))

    def __len__(self):
        return len(self.d)


def check_with_deepspeed(cfg: dict, where: str = "", warn=None):
    """Parse the completed head-engine config with DeepSpeed's own ``DeepSpeedConfig`` (no process group needed;
    its section models check types and allowed values), so that a value it refuses is one line before any process
    group or model load instead of a traceback from the head engine's ``deepspeed.initialize``. ``where``: the
    file's path with a leading space (or empty), for the message. Returns DeepSpeed's parsed ``DeepSpeedConfig``.

    DeepSpeed ignores a top-level key it does not read, so a misspelt one (``zero_optimisation``) silently trained
    without ZeRO. The keys its parser looks for are recorded while it parses; a key it never looked for is refused
    when it is a ZeRO setting (it belongs under ``zero_optimization``) or close to one it did (a misspelling), else
    reported through ``warn(message)`` as ignored.

    Raises:
        ConfigError: one line naming what DeepSpeed refused, and the fix (the file or ``--deepspeed_config``); a
            top-level key DeepSpeed does not read that belongs under ``zero_optimization``, or that is close to one
            it reads (named in the message).
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    from spd_ds.cli import one_line

    seen: set = set()
    try:
        parsed = DeepSpeedConfig(_ReadKeys(cfg, seen))
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, DeepSpeedConfigError, AssertionError, ...
        errors = getattr(e, "errors", None)  # pydantic: one line per field, without its multi-line layout
        if callable(errors):
            try:
                why = "; ".join(f"{e.title}.{'.'.join(map(str, x['loc']))}: {x['msg']} (got {x.get('input')!r})"
                                for x in errors())
            except Exception:  # noqa: BLE001 - the message alone then
                why = one_line(e, 300)
        else:
            why = one_line(e, 300)
        raise ConfigError(f"the DeepSpeed config{where} is refused by DeepSpeed ({why}); fix the file or pass another "
                          "--deepspeed_config (e.g. ds_configs/zero2.json)") from None
    if "train_micro_batch_size_per_gpu" not in seen:  # every parse reads it: this DeepSpeed copied the dict first,
        return parsed  # so what it read is unknown (a later version): nothing is refused or reported
    unread = [key for key in cfg if key not in seen and key not in _READ_ELSEWHERE]
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero_keys = {a for name, f in DeepSpeedZeroConfig.model_fields.items() for a in (name, f.alias) if a}
    for key in unread:
        if key in zero_keys or key == "zero_stage":  # a ZeRO setting a level too high: trained without it
            as_stage = ' as "stage"' if key == "zero_stage" else ""
            raise ConfigError(f"{key!r} belongs under zero_optimization in the DeepSpeed config{where} (at the top "
                              f"level DeepSpeed ignores it); move it there{as_stage}")
        close = difflib.get_close_matches(key, sorted(k for k in seen if isinstance(k, str)), n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"{key!r} in the DeepSpeed config{where} is no key DeepSpeed reads (it would be "
                              f"ignored); did you mean {close[0]!r}?")
    if unread and warn is not None:
        warn(f"the DeepSpeed config{where} has {', '.join(map(repr, unread))}, which DeepSpeed does not read: ignored")
    return parsed


__all__ = ["load_ds_config", "check_with_deepspeed"]
