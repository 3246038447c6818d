"""Storage of self-distilled answers: npz shards, training records from their chains, and the output directory
(resume, flushes, manifest)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from spd_ds.files import replaced_when_done
from spd_ds.train.selfdistill.config import (
    FINISH_EOS, FINISH_LENGTH, FORMAT, MANIFEST, SHARD_PREFIX, SelfDistillConfig, SelfDistillError,
)


# ---------------------------------------------------------------------------------------------------- storage
@dataclasses.dataclass
class Item:
    """A finished answer: its segment (``tokens[:prompt_len]`` = prompt/glue, the rest = answer)."""

    uid: str
    variant: int
    round: int
    tokens: np.ndarray  # [S] int64
    prompt_len: int
    finish: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.uid, self.variant, self.round)


def id_dtype_for(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocabulary <= 65535), else ``int32``."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.int32)


def write_shard(path: str | os.PathLike, items: Sequence[Item], id_dtype: np.dtype) -> dict:
    """Write ``items`` as one compressed ``.npz`` shard (whole or not there: :func:`spd_ds.files.replaced_when_done`,
    its temporary file removed on any error); returns its stats.

    Raises:
        SelfDistillError: a token id does not fit ``id_dtype``.
    """
    path = Path(path)
    ids = np.concatenate([it.tokens for it in items]) if items else np.zeros(0, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(id_dtype).max):
        raise SelfDistillError(f"token id {int(ids.max())} does not fit {id_dtype}; the vocabulary is larger than the "
                               "manifest says (regenerate into a new --out)")
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(it.tokens) for it in items])
    arrays = dict(
        format=np.array(FORMAT), ids=ids.astype(id_dtype), offsets=offsets,
        prompt_len=np.array([it.prompt_len for it in items], dtype=np.int32),
        uid=np.array([it.uid for it in items], dtype=np.str_),
        variant=np.array([it.variant for it in items], dtype=np.int16),
        round=np.array([it.round for it in items], dtype=np.int16),
        finish=np.array([it.finish for it in items], dtype=np.int8),
    )
    # a file object, not the temporary path: np.savez_compressed appends ".npz" to a name without it
    with replaced_when_done(path) as tmp, open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    return shard_stats(path.name, arrays, path.stat().st_size)


def shard_stats(name: str, arrays: dict, nbytes: int) -> dict:
    """Counts of one shard: items, tokens, assistant (answer) tokens, EOS-ended / cut answers, rounds, bytes."""
    seg = np.diff(arrays["offsets"])
    rounds, counts = np.unique(arrays["round"], return_counts=True)
    return {"file": name, "items": int(len(seg)), "tokens": int(seg.sum()),
            "assistant_tokens": int((seg - arrays["prompt_len"]).sum()),
            "eos": int((arrays["finish"] == FINISH_EOS).sum()), "cut": int((arrays["finish"] == FINISH_LENGTH).sum()),
            "rounds": {str(int(r)): int(c) for r, c in zip(rounds, counts)}, "bytes": int(nbytes)}


def read_shard(path: str | os.PathLike) -> dict:
    """Arrays of one shard (see the module docstring), ids widened to int64.

    Raises:
        SelfDistillError: not a self-distillation shard.
    """
    with np.load(path, allow_pickle=False) as z:
        if "format" not in z.files or str(z["format"]) != FORMAT:
            raise SelfDistillError(f"{path} is not a {FORMAT} shard; pass a directory written by "
                                   "`prepare_train_data.py selfdistill`")
        out = {k: z[k] for k in z.files}
    out["ids"] = out["ids"].astype(np.int64)
    return out


def read_items(path: str | os.PathLike) -> Iterator[Item]:
    """Items of one shard."""
    a = read_shard(path)
    off = a["offsets"]
    for i in range(len(off) - 1):
        yield Item(str(a["uid"][i]), int(a["variant"][i]), int(a["round"][i]), a["ids"][off[i]:off[i + 1]],
                   int(a["prompt_len"][i]), int(a["finish"][i]))


def shard_files(path: str | os.PathLike) -> list[Path]:
    """Shards of an output directory (sorted by name), or ``[path]`` for one shard file."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(q for q in p.glob(f"{SHARD_PREFIX}*.npz"))


def is_selfdistill_path(path: str | os.PathLike) -> bool:
    """True for a directory holding a self-distillation ``manifest.json`` or shards, or one ``.npz`` shard."""
    p = Path(path)
    if p.is_dir():
        return (p / MANIFEST).is_file() or any(p.glob(f"{SHARD_PREFIX}*.npz"))
    return p.is_file() and p.suffix == ".npz"


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The ``manifest.json`` of the self-distillation directory ``path``, or ``None`` when it has none, or one that
    does not decode or is not of this format (another program's file of that name)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def chains(items: Iterable[Item]) -> dict[tuple[str, int], list[Item]]:
    """Items grouped by ``(uid, variant)``, rounds 1..k in order (stops at the first missing round)."""
    by: dict[tuple[str, int], dict[int, Item]] = defaultdict(dict)
    for it in items:
        by[(it.uid, it.variant)][it.round] = it
    out = {}
    for key, rounds in by.items():
        chain, r = [], 1
        while r in rounds:
            chain.append(rounds[r])
            if rounds[r].finish != FINISH_EOS:
                break
            r += 1
        if chain:
            out[key] = chain
    return out


def chain_record(chain: Sequence[Item]) -> dict:
    """``{"input_ids", "assistant_mask", "conv_id", "variant", "rounds"}`` of one chain (lists of ints)."""
    ids = np.concatenate([it.tokens for it in chain])
    mask = np.zeros(len(ids), dtype=np.int8)
    t = 0
    for it in chain:
        mask[t + it.prompt_len: t + len(it.tokens)] = 1
        t += len(it.tokens)
    return {"input_ids": ids.tolist(), "assistant_mask": mask.tolist(), "conv_id": chain[0].uid,
            "variant": chain[0].variant, "rounds": len(chain)}


def iter_records(path: str | os.PathLike) -> Iterator[dict]:
    """Training records (:func:`chain_record`) of a self-distillation directory (or one shard), sorted by
    ``(conversation id, variant)``.

    Raises:
        SelfDistillError: no shard there.
    """
    files = shard_files(path)
    if not files:
        raise SelfDistillError(f"{path}: no {SHARD_PREFIX}*.npz shard; run `prepare_train_data.py selfdistill` first")
    items = [it for f in files for it in read_items(f)]
    ch = chains(items)
    for key in sorted(ch):
        yield chain_record(ch[key])


# ---------------------------------------------------------------------------------------------------- output directory
def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """Short id of the target's weights (:meth:`TargetArch.fingerprint`, else a hash of ``config.json``)."""
    from spd_ds.models.adapter import TargetArch, UnsupportedModelError

    try:
        return TargetArch(model_dir).fingerprint()
    except UnsupportedModelError:  # architectures the adapter does not split still generate (a damaged model raises)
        return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]


def _whole_directory(old: dict, new: dict) -> dict:
    """The manifest fields that describe every run's answers in the directory, not only the latest run's: a resume
    with more ``--samples`` or other ``--data`` adds variants and conversations to the ones already in the shards, so
    ``variants.samples`` is the largest of the runs' and ``source`` every run's sources (first seen first);
    ``num_conversations`` is the latest run's source count, recorded with its run (``runs[-1]``)."""
    out = {}
    if "variants" in new and isinstance(old.get("variants"), dict):
        out["variants"] = dict(new["variants"], samples=max(int(old["variants"].get("samples", 0)),
                                                            int(new["variants"]["samples"])))
    if "source" in new and isinstance(old.get("source"), list):
        out["source"] = old["source"] + [s for s in new["source"] if s not in old["source"]]
    return out


class _Store:
    """The output directory: existing items (resume), the buffer of new ones, shards and the manifest."""

    def __init__(self, out_dir: Path, manifest_base: dict, id_dtype: np.dtype, cfg: SelfDistillConfig, log) -> None:
        self.dir, self.cfg, self.log, self.id_dtype = out_dir, cfg, log, id_dtype
        out_dir.mkdir(parents=True, exist_ok=True)
        old = {}
        if (out_dir / MANIFEST).is_file():
            old = json.loads((out_dir / MANIFEST).read_text())
            for k in ("model_fingerprint", "sampling", "id_dtype", "chat_template"):
                if k in old and old[k] != manifest_base[k]:
                    raise SelfDistillError(
                        f"{out_dir} holds answers made with another {k} ({old[k]} vs {manifest_base[k]}); use the "
                        "same settings to resume (model, --temperature, --seed, --max-new-tokens, --greedy, "
                        "--chat-template), or a new --out")
        self.manifest = dict(manifest_base, runs=old.get("runs", []))
        self.manifest.update(_whole_directory(old, manifest_base))
        known = {s["file"]: s for s in old.get("shards", [])}
        self.shards: list[dict] = []
        self.items: dict[tuple[str, int, int], Item] = {}
        for f in shard_files(out_dir):
            its = list(read_items(f))
            for it in its:
                self.items[it.key] = it
            self.shards.append(known.get(f.name) or shard_stats(f.name, read_shard(f), f.stat().st_size))
        self.resumed = len(self.items)
        self.buffer: list[Item] = []
        self.buffer_bytes = 0
        self.last_flush = time.perf_counter()
        self.seq = 1 + max([int(m.group(1)) for s in self.shards if (m := re.search(r"-(\d+)\.npz$", s["file"]))]
                           + [0])

    def add(self, item: Item) -> None:
        self.items[item.key] = item
        self.buffer.append(item)
        self.buffer_bytes += len(item.tokens) * self.id_dtype.itemsize + 32 + 4 * len(item.uid)
        if self.buffer_bytes >= self.cfg.shard_bytes:
            self.flush()

    def maybe_flush(self) -> None:
        if self.buffer and time.perf_counter() - self.last_flush >= self.cfg.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.perf_counter()
        if not self.buffer:
            return
        rnd = min(it.round for it in self.buffer)
        name = f"{SHARD_PREFIX}r{rnd:02d}-{self.seq:05d}.npz"
        self.seq += 1
        stats = write_shard(self.dir / name, self.buffer, self.id_dtype)
        self.shards.append(stats)
        self.buffer, self.buffer_bytes = [], 0
        self.write_manifest()
        self.log(f"selfdistill: wrote {name}: {stats['items']} answers, {stats['tokens']} tokens, "
                 f"{stats['bytes'] / 1e6:.1f} MB")

    def write_manifest(self, run: dict | None = None) -> None:
        ch = chains(self.items.values())
        tot = {k: sum(s[k] for s in self.shards) for k in ("items", "tokens", "assistant_tokens", "eos", "cut",
                                                            "bytes")}
        rounds: dict[str, int] = defaultdict(int)
        for s in self.shards:
            for r, c in s["rounds"].items():
                rounds[r] += c
        counts = dict(tot, records=len(ch), record_tokens=int(sum(len(it.tokens) for c in ch.values() for it in c)),
                      conversations=len({k[0] for k in ch}),
                      answers_by_round=dict(sorted(rounds.items(), key=lambda x: int(x[0]))))
        m = dict(self.manifest, shards=self.shards, counts=counts)
        if run is not None:
            m["runs"] = m["runs"] + [run]
            self.manifest["runs"] = m["runs"]
        with replaced_when_done(self.dir / MANIFEST) as tmp:
            tmp.write_text(json.dumps(m, indent=1) + "\n")
