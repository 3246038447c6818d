"""The train / held-out split, one for every kind of training data (conversations, pre-tokenised records,
self-distilled answers).

A record is held out iff ``held_out_score(conversation_key(record), seed) < fraction``: every record of one
conversation (its variants, rounds, ShareGPT parts, and the original conversation when it carries the same id) falls
on the same side, so a held-out greedy answer cannot leak into training through its sampled twin. The split depends
only on the records' keys and ``seed`` (not on order, count, rank, world size or machine): every rank and every resume
holds out the same records, the split is stable when data are added, and the two sides are disjoint.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Sequence

from spd_ds.train.data import DataError


def conversation_key(rec: dict) -> str:
    """The key that :func:`split_held_out` hashes: the conversation id (``conv_id`` / ``id``, a ShareGPT part suffix
    ``_<n>`` removed so that the parts of one long conversation stay together), else the first prompt (messages
    before the first assistant turn, or token ids before the first assistant token), else (no first prompt) the whole
    record (canonical JSON)."""
    cid = rec.get("conv_id", rec.get("id"))
    if isinstance(cid, (str, int)) and str(cid):
        return re.sub(r"_\d+$", "", str(cid))
    if "messages" in rec:
        first = []
        for m in rec["messages"]:
            if m.get("role") == "assistant":
                break
            first.append([m.get("role"), m.get("content")])
        if first:
            return "m" + json.dumps(first)
    else:
        ids, mask = rec.get("input_ids") or [], rec.get("assistant_mask") or []
        n = next((i for i, m in enumerate(mask) if m), len(ids))
        if n:
            return "t" + ",".join(str(int(x)) for x in ids[:n])
    return "r" + json.dumps(rec, sort_keys=True, ensure_ascii=False)


def held_out_score(key: str, seed: int = 0) -> float:
    """A deterministic uniform in [0, 1) of ``(seed, key)`` (blake2b)."""
    d = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") / 2.0 ** 64


def split_held_out(records: Sequence[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Deterministic train / held-out split by conversation (see the module docstring).

    About ``fraction`` of the conversations are held out (e.g. 0.02); at least one conversation (the one with the
    lowest score) when ``fraction > 0``.

    Args:
        records: normalised records (``spd_ds.train.data.load_records`` output: conversations or pre-tokenised,
            ideally with ``conv_id``; self-distilled records carry it).
        fraction: ``data.held_out_fraction`` in ``[0, 1)``; 0 = nothing held out.
        seed: split seed (``train.seed``).

    Returns:
        ``(train, held_out)``, each in input order.

    Raises:
        DataError: ``fraction`` outside ``[0, 1)``, or a split that leaves no training record (a ``ValueError``).
    """
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"data.held_out_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0 or not records:
        return list(records), []
    scores = [held_out_score(conversation_key(r), seed) for r in records]
    out = [s < fraction for s in scores]
    if not any(out):
        lowest = min(scores)
        out = [s == lowest for s in scores]
    train = [r for r, o in zip(records, out) if not o]
    if not train:
        raise DataError(f"data.held_out_fraction={fraction} holds out all {len(records)} records; lower it or add "
                         "data")
    return train, [r for r, o in zip(records, out) if o]


__all__ = ["conversation_key", "held_out_score", "split_held_out"]
