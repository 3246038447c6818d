"""Draft vocabularies: the ``K`` most frequent assistant tokens of a corpus (reference-compatible JSON).

A draft vocabulary ``D`` shrinks the head's LM head from ``V`` to ``K`` rows; the head can only draft tokens in
``D``. The file format is the reference SPD implementation's::

    {"tokenizer_name", "data_paths", "mask_assistant": true, "vocab_size", "draft_vocab_size",
     "token_ids": [sorted ascending, unique], "total_positions_counted", "topk_selected_token_count_sum",
     "topk_mass_ratio"}

``topk_mass_ratio`` is the share of counted assistant positions whose token is in ``D`` (an upper bound on greedy
acceptance from the vocabulary alone). End-of-turn / EOS ids are always included, whatever their count.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch


def count_assistant_tokens(input_ids: Iterable[Sequence[int]], assistant_mask: Iterable[Sequence[int]],
                           vocab_size: int) -> torch.Tensor:
    """Token frequencies ``[vocab_size]`` int64 over assistant positions (``assistant_mask == 1``).

    Raises:
        spd_ds.train.data.DataError: an assistant token id outside ``[0, vocab_size)`` (pre-tokenised data made with
            another tokenizer); the message names the first such id (it named the largest id, even a valid one).
    """
    chosen: list[int] = []
    for ids, mask in zip(input_ids, assistant_mask):
        chosen.extend(t for t, m in zip(ids, mask) if m)
    t = torch.tensor(chosen, dtype=torch.long)
    outside = (t < 0) | (t >= vocab_size)
    if bool(outside.any()):
        from spd_ds.train.data import DataError

        n = int(outside.sum())
        more = f" (and {n - 1} more assistant token{'s' if n > 2 else ''} outside it)" if n > 1 else ""
        raise DataError(f"token id {int(t[outside][0])} is outside the model's vocabulary of {vocab_size} ids (0 to "
                        f"{vocab_size - 1}){more}: pre-tokenised data made with another tokenizer? tokenise it with "
                        "this model's, or give the model it was made for")
    return torch.bincount(t, minlength=vocab_size)


def select_draft_vocab(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> list[int]:
    """The ``size`` most frequent ids (ties broken by the smaller id), with ``always`` forced in; sorted.

    Raises:
        ValueError: ``size`` < number of forced ids, or larger than the vocabulary.
    """
    V = counts.numel()
    forced = sorted({int(i) for i in always})
    if not (len(forced) <= size <= V):
        raise ValueError(f"draft vocab size {size} must be in [{len(forced)}, {V}]")
    # stable ordering: by count desc, then id asc
    order = sorted(range(V), key=lambda i: (-int(counts[i]), i))
    chosen = list(forced)
    have = set(forced)
    for i in order:
        if len(chosen) >= size:
            break
        if i not in have:
            chosen.append(i)
            have.add(i)
    return sorted(chosen)


def draft_vocab_record(counts: torch.Tensor, token_ids: Sequence[int], tokenizer_name: str,
                       data_paths: Sequence[str], vocab_size: int) -> dict:
    """The JSON record (reference-compatible field names and meaning)."""
    total = int(counts.sum())
    sel = int(counts[torch.as_tensor(list(token_ids), dtype=torch.long)].sum()) if token_ids else 0
    return {
        "tokenizer_name": tokenizer_name,
        "data_paths": list(data_paths),
        "mask_assistant": True,
        "vocab_size": int(vocab_size),
        "draft_vocab_size": len(token_ids),
        "token_ids": [int(i) for i in token_ids],
        "total_positions_counted": total,
        "topk_selected_token_count_sum": sel,
        "topk_mass_ratio": sel / total if total else 0.0,
    }


def write_draft_vocab(record: dict, path: str | os.PathLike) -> Path:
    """Write ``record`` as JSON (``token_ids`` on one line, the rest indented) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in record.items() if k != "token_ids"}
    text = json.dumps(head, indent=2)[:-2] + ',\n  "token_ids": ' + json.dumps(record["token_ids"]) + "\n}\n"
    json.loads(text)  # stays valid JSON
    path.write_text(text)
    return path
