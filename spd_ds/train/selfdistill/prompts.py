"""The prompts of self-distillation: conversations as rounds of user turns, and the chat-template glue between
rounds."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterable, Sequence

import numpy as np

_ROLE = {"human": "user", "user": "user", "prompter": "user", "system": "system",
         "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "model": "assistant"}


# ---------------------------------------------------------------------------------------------------- prompts
@dataclasses.dataclass
class PromptConversation:
    """The prompt side of one conversation: ``rounds[r-1]`` = the system/user messages answered by round ``r``."""

    uid: str
    rounds: list[list[dict]]


def conversation_rounds(rec: dict) -> PromptConversation | None:
    """One source record -> its user turns grouped into rounds (assistant turns dropped); ``None`` if no user turn.

    Accepts ``{"rounds": [[{role, content}, ...], ...]}`` (what :func:`write_prompts` writes) or any conversation
    record (``messages`` / ShareGPT ``conversations``): consecutive system/user messages form one round, closed by an
    assistant message or the end. Empty messages are dropped. The id is the record's ``id`` (or ``conv_id``), else a
    hash of the first round's text.
    """
    if isinstance(rec.get("rounds"), list):
        rounds = [[{"role": m["role"], "content": m["content"]} for m in r] for r in rec["rounds"] if r]
    else:
        turns = rec.get("messages")
        if turns is None:
            turns = rec.get("conversations")
        if not isinstance(turns, list):
            return None
        rounds, cur = [], []
        for t in turns:
            if not isinstance(t, dict):
                return None
            role = _ROLE.get(str(t.get("role", t.get("from"))).lower())
            content = t.get("content", t.get("value"))
            if role is None or not isinstance(content, str) or not content.strip():
                continue
            if role == "assistant":
                if any(m["role"] == "user" for m in cur):
                    rounds.append(cur)
                    cur = []
                continue
            cur.append({"role": role, "content": content})
        if any(m["role"] == "user" for m in cur):
            rounds.append(cur)
    rounds = [r for r in rounds if any(m["role"] == "user" for m in r)]
    if not rounds:
        return None
    uid = rec.get("id", rec.get("conv_id"))
    if not isinstance(uid, (str, int)) or str(uid) == "":
        uid = "h" + hashlib.blake2b(json.dumps(rounds[0], sort_keys=True).encode(), digest_size=8).hexdigest()
    return PromptConversation(str(uid), rounds)


def load_prompt_conversations(sources: Sequence[str], cache_dir: str | None = None,
                              limit: int | None = None) -> list[PromptConversation]:
    """Conversations of ``sources`` (as ``data.train_files``: files, directories, ``sharegpt``) as prompts.

    Duplicate ids keep the first occurrence.

    Raises:
        spd_ds.train.data.DataError: a source cannot be read or holds no conversation with a user turn.
    """
    from spd_ds.train.data import DataError, _raw_records

    out: list[PromptConversation] = []
    seen: set[str] = set()
    for src in sources:
        n = 0
        for rec in _raw_records(str(src), cache_dir):
            c = conversation_rounds(dict(rec))
            if c is None or c.uid in seen:
                continue
            seen.add(c.uid)
            out.append(c)
            n += 1
            if limit is not None and len(out) >= limit:
                return out
        if n == 0:
            raise DataError(f"source {src!r} holds no conversation with a user turn")
    return out


def write_prompts(convs: Iterable[PromptConversation], path: str | os.PathLike) -> int:
    """Write ``{"id", "rounds"}`` JSON lines (deterministic bytes), gzipped when ``path`` ends in ``.gz``
    (:func:`spd_ds.train.data.write_jsonl`); returns the count."""
    from spd_ds.train.data import write_jsonl

    return write_jsonl(({"id": c.uid, "rounds": c.rounds} for c in convs), path)



# ---------------------------------------------------------------------------------------------------- chat glue
def _render(tokenizer, messages, generation_prompt: bool) -> str:
    from spd_ds.train.chat import _render as render

    return render(tokenizer, messages, generation_prompt)


def turn_glue(tokenizer, history: Sequence[dict], new_turn: Sequence[dict], eot_text: str) -> str | None:
    """Text the chat template puts between the end of the last answer in ``history`` and the next answer.

    Args:
        history: messages up to and including the last assistant answer (its text without the end-of-turn token).
        new_turn: the system/user messages of the next round.
        eot_text: the text of the end-of-turn token the answer ended with (e.g. ``"<|im_end|>"``).

    Returns:
        ``render(history + new_turn, generation prompt)`` after ``render(history).rstrip()``; ``None`` when the
        template breaks the prefix property or does not end the answer with ``eot_text`` (the chain stops there).
    """
    a = _render(tokenizer, history, False)
    b = _render(tokenizer, list(history) + list(new_turn), True)
    end = len(a.rstrip())
    if not a[:end].endswith(eot_text) or not b.startswith(a[:end]):
        return None
    return b[end:]


def _encode_texts(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    if not texts:
        return []
    enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [np.asarray(e, dtype=np.int64) for e in enc]
