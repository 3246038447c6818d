"""The files of a speculation-head checkpoint, checked before any weight is loaded.

A head checkpoint is a folder written by :meth:`spd_ds.head.SpeculationHead.save` (``launch/train.py`` writes one as
``<output_dir>/head`` and ``<output_dir>/best_head``) holding

- ``head_config.json``: format version, partition, dimensions, draft vocabulary size, base-model fingerprint;
- ``head.safetensors``: the floating-point weights (``aggr.k.weight``, the tower, ``norm.weight``, the LM head unless
  it is the target's own rows) and the draft vocabulary as a ``[vocab_size]`` bool ``draft_mask`` (older heads: an
  integer ``draft_ids`` list).

Every check here is cheap (a JSON file, a safetensors header, the draft vocabulary), so every rank runs them before
any collective, and each failure is one line naming the file, what is wrong and what to do:

- :func:`read_config`: the path (a file, a training run's folder, nothing), the JSON, its format version, each key
  and its type, the partition;
- :func:`expected_tensors`: the tensor names and shapes :meth:`~spd_ds.head.SpeculationHead.save` writes for a config;
- :func:`check_weights_file`: the weights file is readable and holds exactly those tensors, of those shapes, floating
  point (the draft vocabulary bool or integer), with a draft vocabulary of the configured size.

:mod:`spd_ds.head` re-exports the names (``HeadMismatchError``, ``HeadCheckpointError``, ``HEAD_CONFIG``, ...) and
wraps the functions as ``SpeculationHead.read_config`` etc.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

from spd_ds.cli import one_line
from spd_ds.partition import PartitionError, StagePartition

HEAD_FORMAT_VERSION = 1
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"
RUN_HEADS = ("best_head", "head")  # the head folders launch/train.py writes in its output_dir
REPLACED_SUFFIX = ".old"  # <head folder>.old: a run's best head while its successor is moved in (train.validate)


class HeadMismatchError(ValueError):
    """A head checkpoint that does not belong to this base model / partition."""


class HeadCheckpointError(HeadMismatchError):
    """A head checkpoint whose files cannot be read (a truncated or corrupted ``head.safetensors``, a bad JSON)."""


def draft_id_tensor(draft_token_ids: Sequence[int] | None, vocab_size: int) -> torch.Tensor:
    """``[V_d]`` int64 draft ids (``None`` = ``arange(vocab_size)``).

    Raises:
        ValueError: ids not sorted, not unique or outside ``[0, vocab_size)``.
    """
    if draft_token_ids is None:
        return torch.arange(vocab_size)
    ids = torch.as_tensor(list(draft_token_ids), dtype=torch.long)
    if ids.numel() == 0 or (ids[1:] <= ids[:-1]).any() or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"draft vocabulary must be sorted, unique ids in [0, {vocab_size}); "
                         "check the draft-vocab file")
    return ids


RETRAIN_HINT = "was it written by launch/train.py? retrain or restore it"
_HEAD_FOLDER = "{key} is a head folder, with head_config.json and head.safetensors, written by launch/train.py"


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_INT, _STR = ("an integer >= 1", _pos_int), ("a string", lambda v: isinstance(v, str))
_INTS = ("a list of integers >= 0", lambda v: isinstance(v, list) and all(
    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))
# head_config.json keys: (what is expected, its test), required ones first
_CONFIG_REQUIRED = {"partition": ("an object with num_layers, stage_layers and anchors", lambda v: isinstance(v, dict)),
                    "partition.num_layers": _INT, "partition.stage_layers": _INTS, "partition.anchors": _INTS,
                    "num_layers": _INT, "hidden_size": _INT, "vocab_size": _INT, "draft_vocab_size": _INT,
                    "base_model_fingerprint": _STR}
_CONFIG_OPTIONAL = {"intermediate_size": ("an integer >= 1 or null", lambda v: v is None or _pos_int(v)),
                    "lm_head_from_target": ("true or false", lambda v: isinstance(v, bool)),
                    "base_model_type": _STR, "fingerprint_version": _INT}


def _check_config_fields(p: Path, meta: dict) -> None:
    """Raise :class:`HeadCheckpointError` naming ``p`` and the first key of ``meta`` (``head_config.json``) that is
    missing (a required one) or of the wrong type, and what it should be."""
    for key, (want, ok) in {**_CONFIG_REQUIRED, **_CONFIG_OPTIONAL}.items():
        parent, _, leaf = key.rpartition(".")
        d = meta[parent] if parent else meta
        if leaf not in d and key in _CONFIG_REQUIRED:
            raise HeadCheckpointError(f"{p} has no {key!r} ({want}); {RETRAIN_HINT}")
        if leaf in d and not ok(d[leaf]):
            got = json.dumps(d[leaf])
            raise HeadCheckpointError(f"{p}: {key!r} is {got if len(got) <= 40 else got[:37] + '...'}, expected "
                                      f"{want}; {RETRAIN_HINT}")


def _run_heads(d: Path, levels: int = 3) -> tuple[Path, list[str]] | None:
    """The training output_dir at ``d`` or at most ``levels`` folders above it that holds head folders
    (``best_head/``, ``head/``), and those folders; ``None`` when there is none."""
    for base in [d, *d.parents][: levels + 1]:
        found = [str(base / s) for s in RUN_HEADS if (base / s / HEAD_CONFIG).is_file()]
        if found:
            return base, found
    return None


def _head_dir_hint(d: Path) -> str:
    """For a folder without ``head_config.json``: the heads of the training run it belongs to (the run's
    output_dir itself, or a folder at most three levels inside it, such as a DeepSpeed ``checkpoints/<step>``), if
    any."""
    hit = _run_heads(d)
    if hit is None:
        return f"{d} holds no head"
    base, found = hit
    if base == d:
        what = ""
    elif "checkpoints" in d.relative_to(base).parts or d.name == "checkpoints":
        what = f"{d} is a training checkpoint, not a head; "
    else:
        what = f"{d} is a folder of the training run {base}, not a head; "
    return f"{what}did you mean {' or '.join(found)}?"


def _file_message(f: Path, key: str) -> str:
    """Why file ``f`` given as ``key`` (``head.checkpoint``) is refused, and the head folder meant: the folder holding
    it when that is a head (or ``f`` is a ``head.safetensors``), else the head folders of the training run it lies
    in."""
    d, folder = f.parent, _HEAD_FOLDER.format(key=key)
    if (d / HEAD_CONFIG).is_file() or f.name == HEAD_WEIGHTS:
        return f"{key} {f} is a file; give the folder that holds it ({d})"
    if _run_heads(d) is not None:
        return f"{key} {f} is a file, not a head: {_head_dir_hint(d)} ({folder})"
    return f"{key} {f} is a file, not a head checkpoint; give a head folder ({folder})"


def read_config(path: str | os.PathLike, key: str = "head.checkpoint") -> dict:
    """The JSON half of a checkpoint, checked: every key :meth:`~spd_ds.head.SpeculationHead.save` writes that loading
    needs is there with its type (integers >= 1 for the sizes, a string fingerprint, a valid partition), so the rest
    of the code can index it. Cheap: every rank runs it before any collective.

    Args:
        path: the head folder (holding ``head_config.json`` and ``head.safetensors``).
        key: the setting that gave ``path``, named by the FileNotFoundError messages (``eval.ppsd_checkpoint``).
    Returns:
        The parsed ``head_config.json`` (a dict).
    Raises:
        FileNotFoundError: ``path`` is a file, does not exist or holds no ``head_config.json`` (the message names
            the run's ``best_head`` / ``head`` folders when ``path`` is a training output_dir, a checkpoint or another
            file or folder of a run; for a missing folder whose ``<name>.old`` (:data:`REPLACED_SUFFIX`) holds a
            head, that backup: a run stopped while replacing its ``best_head``).
        HeadCheckpointError: not a JSON object, a key missing or of the wrong type, a bad partition.
        HeadMismatchError: another head format version (a newer one: upgrade spd-ds; the message names this one).
    """
    d = Path(path)
    p = d / HEAD_CONFIG
    if d.is_file():
        raise FileNotFoundError(_file_message(d, key))
    if not d.exists():
        backup = d.with_name(d.name + REPLACED_SUFFIX)  # a best head being replaced (train.validate)
        if (backup / HEAD_CONFIG).is_file():
            raise FileNotFoundError(f"{key} {d} does not exist, but {backup} holds the head it replaced "
                                    "(the run stopped while replacing it); resume the run (--resume puts it back) or "
                                    f"give {backup}")
        raise FileNotFoundError(f"{key} {d} does not exist; give a head folder (head_config.json + head.safetensors) "
                                "written by launch/train.py")
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: {_head_dir_hint(d)} ({_HEAD_FOLDER.format(key=key)})")
    try:
        meta = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise HeadCheckpointError(f"head {path}: {HEAD_CONFIG} is damaged ({e}); copy the checkpoint again or "
                                  "re-save it") from None
    if not isinstance(meta, dict):
        raise HeadCheckpointError(f"head {path}: {HEAD_CONFIG} is not a JSON object; copy the checkpoint again")
    v = meta.get("format_version")
    if not isinstance(v, int) or isinstance(v, bool):
        got = "no 'format_version'" if v is None else f"'format_version' {json.dumps(v)[:40]}, not an integer"
        raise HeadCheckpointError(f"{p} has {got}; {RETRAIN_HINT}")
    if v > HEAD_FORMAT_VERSION:
        import spd_ds

        raise HeadMismatchError(f"{path}: head format version {v} was written by a newer spd-ds (this one, "
                                f"{spd_ds.__version__}, reads version {HEAD_FORMAT_VERSION}); upgrade spd-ds to "
                                "load it")
    if v != HEAD_FORMAT_VERSION:
        raise HeadMismatchError(f"{path}: head format version {v} is older than {HEAD_FORMAT_VERSION}; retrain or "
                                "convert it")
    _check_config_fields(p, meta)
    try:
        StagePartition.from_dict(meta["partition"])
    except PartitionError as e:
        raise HeadCheckpointError(f"{p}: bad 'partition' ({e}); {RETRAIN_HINT}") from None
    if meta["draft_vocab_size"] > meta["vocab_size"]:
        raise HeadCheckpointError(f"{p}: 'draft_vocab_size' {meta['draft_vocab_size']} exceeds 'vocab_size' "
                                  f"{meta['vocab_size']}; {RETRAIN_HINT}")
    return meta


def expected_tensors(meta: dict, arch=None, head_cls=None) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes :meth:`~spd_ds.head.SpeculationHead.save` writes for a head described by ``meta``
    (checked by :func:`read_config`): with ``arch`` (a :class:`~spd_ds.models.adapter.TargetArch`), every tensor
    (the head, of class ``head_cls``, default :class:`~spd_ds.head.SpeculationHead`, is built on the meta device: no
    memory, no weights read); without it, only those ``meta`` alone fixes (aggregation, LM head, draft mask). An LM
    head taken from the target (``lm_head_from_target``) is not stored; the draft vocabulary is a ``[vocab_size]``
    bool ``draft_mask``.

    Returns:
        ``{name: shape}``, e.g. ``aggr.k.weight: (H, (k + 1) H)``, ``lm_head.weight: (V_d, H)``.
    """
    H, Vd = meta["hidden_size"], meta["draft_vocab_size"]
    if arch is None:
        want = {f"aggr.{k}.weight": (H, (k + 1) * H) for k in range(len(meta["partition"]["anchors"]))}
    else:
        if head_cls is None:
            from spd_ds.head import SpeculationHead as head_cls
        with torch.device("meta"):
            head = head_cls(arch, StagePartition.from_dict(meta["partition"]), meta["num_layers"], None,
                            meta.get("intermediate_size"), init_from_target=False)
        want = {k: tuple(t.shape) for k, t in head.state_dict().items() if k != "draft_ids"}
        H = arch.hidden_size
    want["lm_head.weight"] = (Vd, H)
    if meta.get("lm_head_from_target"):
        del want["lm_head.weight"]
    want["draft_mask"] = (meta["vocab_size"],)
    return want


# safetensors' dtype names (the header's) -> torch's, for the messages
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
                "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_FLOAT = "floating point: float32, bfloat16 or float16"


def _dtype_problem(name: str, dtype: str) -> str | None:
    """``"<dtype> (expected <kind>)"`` when a stored tensor ``name`` of safetensors dtype ``dtype`` (``BF16``,
    ``I32``, ...) cannot be what :meth:`~spd_ds.head.SpeculationHead.save` writes: a bool ``draft_mask``, integer
    ``draft_ids`` (older heads), floating-point weights; ``None`` when it can."""
    if name == "draft_mask":
        ok, want = dtype == "BOOL", "bool"
    elif name == "draft_ids":
        ok, want = dtype[:1] in ("I", "U"), "an integer type"
    else:
        ok, want = dtype.startswith(("F", "BF")), _FLOAT
    return None if ok else f"{_DTYPE_NAMES.get(dtype, dtype.lower())} (expected {want})"


def _listed(names: list[str]) -> str:
    """``"a, b, c (+n more)"``: the first three of ``names``."""
    return f"{', '.join(names[:3])}{f' (+{len(names) - 3} more)' if len(names) > 3 else ''}"


def check_weights_file(path: str | os.PathLike, meta: dict, arch, head_cls=None) -> None:
    """Check that ``head.safetensors`` can be read and holds exactly the tensors (names and shapes) that ``meta``
    (the checkpoint's ``head_config.json``, from :func:`read_config`) and the target ``arch`` imply
    (:func:`expected_tensors`), that they have the dtypes :meth:`~spd_ds.head.SpeculationHead.save` writes
    (floating-point weights: float32, bfloat16, float16 or another floating type; a bool ``draft_mask``, or an older
    file's integer ``draft_ids``), and that the draft vocabulary selects ``draft_vocab_size`` ids. Reads the file's
    header and the draft vocabulary only (safetensors checks that the header is valid and that its tensors cover the
    file exactly, so truncation is found); cheap enough for every rank before any collective. Corruption inside the
    other tensors' bytes is not detectable without a checksum.

    Raises:
        FileNotFoundError: no ``head.safetensors``.
        HeadCheckpointError: truncated or corrupted file; tensors missing, unexpected, of other shapes or of other
            dtypes (the first few of each named); an empty or damaged draft vocabulary.
    """
    from safetensors import SafetensorError, safe_open

    f = Path(path) / HEAD_WEIGHTS
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: a head folder holds head_config.json and head.safetensors, "
                                "written by launch/train.py; copy the whole folder")
    want = expected_tensors(meta, arch, head_cls)
    try:
        with safe_open(str(f), framework="pt") as h:
            slices = {k: h.get_slice(k) for k in h.keys()}
            shapes = {k: tuple(s.get_shape()) for k, s in slices.items()}
            if "draft_mask" not in shapes and "draft_ids" in shapes:  # an older head: its ids
                del want["draft_mask"]
                want["draft_ids"] = (meta["draft_vocab_size"],)
            missing = [k for k in want if k not in shapes]
            extra = [k for k in shapes if k not in want]
            other = [f"{k} {list(shapes[k])} (expected {list(want[k])})" for k in want if k in shapes and
                     shapes[k] != want[k]]
            if missing or extra or other:
                bad = [f"{what} {_listed(names)}" for what, names in (("missing", missing), ("unexpected", extra),
                                                                      ("shape of", other)) if names]
                raise HeadCheckpointError(f"head {path}: {HEAD_WEIGHTS} does not match {HEAD_CONFIG}: "
                                          f"{'; '.join(bad)}; copy the checkpoint again or retrain it")
            dtypes = [f"{k} {p}" for k in want if (p := _dtype_problem(k, slices[k].get_dtype())) is not None]
            if dtypes:
                raise HeadCheckpointError(f"head {path}: {HEAD_WEIGHTS} holds tensors of the wrong dtype: "
                                          f"{_listed(dtypes)}; it was not written by launch/train.py: copy the "
                                          "checkpoint again or retrain it")
            name = "draft_mask" if "draft_mask" in want else "draft_ids"
            ids = h.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise HeadCheckpointError(
            f"head {path}: {HEAD_WEIGHTS} is damaged ({one_line(e)}); copy the checkpoint again or "
            "re-save it") from None
    n, V, problem = meta["draft_vocab_size"], meta["vocab_size"], None
    if name == "draft_mask":
        k = int(ids.count_nonzero())
        problem = None if k == n else "is empty (selects no token)" if k == 0 else f"selects {k} tokens"
    else:
        try:
            draft_id_tensor(ids.tolist(), V)
        except ValueError:
            problem = f"are not sorted unique ids in [0, {V})"
    if problem:
        raise HeadCheckpointError(f"head {path}: the head's {name} in {HEAD_WEIGHTS} {problem} but {HEAD_CONFIG} "
                                  f"says draft_vocab_size {n}: it is damaged; copy the checkpoint again or "
                                  "retrain it")
