"""Self-distilled training data at scale: the target answers every user turn of every conversation, in rounds.

EAGLE's advice, taken to the whole conversation: the head is used on the target's own text, so it is distilled on
the target's answers, including later turns whose context holds the target's *own* earlier answers.

**Rounds.** Round ``r`` answers user turn ``r`` of every conversation that has one. Its prompt is the token-level
continuation of round ``r-1``: ``prompt_r = prompt_{r-1} + answer_{r-1} (ending with the end-of-turn token the
target generated) + glue_r``, where ``glue_r`` is what the chat template renders between the end of that answer and
the generation prompt of turn ``r`` (for ChatML: ``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``).
Each *variant* of a conversation is its own chain: variant 0 is greedy (``greedy=1``), variants ``greedy..greedy +
samples - 1`` are samples at ``temperature``; a sampled chain's turn 2 sees that chain's turn-1 answer. A chain ends
at an answer cut by ``max_new_tokens`` (no end-of-turn: no later turn is asked), at a prompt longer than
``max_prompt_tokens``, or at a template that rewrites earlier turns (the prefix property fails).

**Generation** is transformers' own ``generate`` (left padding, prompts sorted by length, ``cache_implementation=
"static"`` so that on CUDA the decode step is compiled and CUDA-graphed by transformers, ``CompileConfig(dynamic=
True)``), with three small additions passed through its public hooks:

* :class:`StopWhenFewAlive` (a ``StoppingCriteria``) ends a call after ``chunk_new_tokens`` new tokens or once fewer
  than ``min_alive`` of its rows are still generating; the unfinished rows are *continued* in a later call (prompt +
  answer so far as the new prompt, prefilled again). A static batch otherwise decodes for its longest answer while
  most rows idle, and a static cache sized for the longest answer makes every step attend over it;
* :func:`gqa_decode_attention` (registered through ``AttentionInterface``, transformers' hook for custom attention)
  is SDPA that, for one query token, folds the query heads of each key/value head into the query length instead of
  copying keys and values per query head (``repeat_kv``): with left padding SDPA gets a mask, and transformers
  then materialises the repeated cache on every decode step (3x the cache for SmolLM2, the largest cost of a step);
* :class:`KeyedSampler` (a ``LogitsProcessor``) makes sampling a pure function of ``(seed, conversation, variant,
  round, answer position)``: one 32-bit uniform per row from an integer hash, inverted through the row's CDF
  (float64), the chosen token then taken by ``generate``'s greedy argmax. So greedy and sampled rows share a batch,
  a continuation draws exactly what an uninterrupted run would, and a resumed run redraws the same answers whatever
  the batch composition (up to floating-point differences between batch shapes). No top-k / top-p: the target's full
  distribution at ``temperature``.

**Storage** (:func:`write_shard`): ``np.savez_compressed`` shards ``shard-r<round>-<seq>.npz``, each at most
``shard_bytes`` (12 MB by default, uncompressed) so any shard can travel on its own, plus ``manifest.json``. A shard
holds finished answers ("items"), each as one *segment*: the tokens the item adds to its chain (round 1: the prompt;
later rounds: the glue) followed by the answer. Arrays (``N`` items, ``T`` tokens)::

    ids         [T]    uint16 (vocabulary <= 65535) or int32   token ids, segments back to back
    offsets     [N+1]  int64    segment i is ids[offsets[i]:offsets[i+1]]
    prompt_len  [N]    int32    tokens of segment i before its answer (assistant mask = 0), the rest is the answer
    uid         [N]    str      conversation id (the source's ``id``, else a hash of its first prompt)
    variant     [N]    int16    0 = greedy when greedy=1, else a sample
    round       [N]    int16    1 = first user turn
    finish      [N]    int8     0 = ended with an EOS id (kept, under the mask), 1 = cut at max_new_tokens

A training record (:func:`iter_records`) is a chain: the segments of rounds 1..k of one ``(uid, variant)``
concatenated, ``assistant_mask`` 1 on every answer token (the answer text and the end-of-turn token the target
generated, as :mod:`spd_ds.train.chat` marks conversations). ``data.train_files`` accepts the output directory.

**Resume**: items already in a shard are skipped, so a rerun with the same ``--out`` continues; a time budget stops
starting new ``generate`` calls, and finished answers are flushed to a shard at least every ``flush_every_s`` and on
exit (including SIGTERM from ``timeout``); in the last 10 % of the budget only answers already begun are continued;
answers still in flight at the end are redone by the next run.

**Held-out split**: :func:`spd_ds.train.split.split_held_out` (by a hash of the conversation id; see there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from transformers import LogitsProcessor, StoppingCriteria

from spd_ds.train.split import held_out_score

FORMAT = "spd-ds/selfdistill-v1"
MANIFEST = "manifest.json"
SHARD_PREFIX = "shard-"
FINISH_EOS, FINISH_LENGTH = 0, 1
_M32 = 0xFFFFFFFF
_ROLE = {"human": "user", "user": "user", "prompter": "user", "system": "system",
         "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "model": "assistant"}


class SelfDistillError(ValueError):
    """Self-distillation cannot go on as asked; the message says what to change."""


@dataclasses.dataclass
class SelfDistillConfig:
    """Settings of a self-distillation run.

    Content (must match on resume; see :meth:`content_key`): ``greedy``/``samples`` per conversation (variants),
    ``temperature``, ``seed``, ``max_new_tokens``. Scheduling (free to change between runs): the rest.

    Attributes:
        greedy: 1 = one greedy answer per turn (variant 0), 0 = none.
        samples: sampled answers per turn (variants ``greedy..greedy+samples-1``), at ``temperature``.
        temperature: sampling temperature (> 0), no top-k / top-p.
        seed: sampling seed (with the conversation id, variant, round and position it fixes every draw).
        max_new_tokens: longest answer (tokens, EOS included); longer answers are cut and end their chain.
        max_prompt_tokens: a turn whose prompt (context + new user turn) is longer is not asked.
        max_rounds: answer at most this many user turns per conversation (None = all).
        batch_size: rows per ``generate`` call (at most).
        max_batch_tokens: rows x static-cache length per call at most (long prompts get fewer rows).
        chunk_new_tokens: new tokens per call at most; unfinished rows are continued in a later call.
        min_alive: end a call once fewer than this share of its rows are still generating (0 = never).
        wave_conversations: conversations prepared (tokenised) and sorted by length together; waves run in a
            deterministic shuffled order so that a time budget keeps a sample of all lengths.
        cache: ``"static"`` (compiled + CUDA graphs by transformers on CUDA) or ``"dynamic"``.
        compile: let transformers compile the decode step (CUDA + static cache only; ``CompileConfig(dynamic=
            True)``: one compile for all batch and cache sizes, CUDA graphs recorded per size).
        attention: ``"gqa-decode"`` (:func:`gqa_decode_attention`) or transformers' ``"sdpa"``; used when
            :func:`run_selfdistill` loads the model.
        cache_quantum: the static cache holds the call's longest prompt rounded up to a power of two up to this,
            to a multiple of it above (0 = powers of two only), plus ``chunk_new_tokens``: few distinct shapes for
            the compiled step, little padding to attend over.
        time_budget_s: stop starting ``generate`` calls after this many seconds since the run started; in its
            last 10 % only answers already begun are continued (no new prompts, no new round).
        shard_bytes: flush finished answers into a shard once they hold this many (uncompressed) bytes.
        flush_every_s: ... or this many seconds after the last flush.
    """

    greedy: int = 1
    samples: int = 2
    temperature: float = 1.0
    seed: int = 0
    max_new_tokens: int = 768
    max_prompt_tokens: int = 2048
    max_rounds: int | None = None
    batch_size: int = 1024
    max_batch_tokens: int = 1024 * 1280
    chunk_new_tokens: int = 256
    min_alive: float = 0.25
    wave_conversations: int = 4096
    cache: str = "static"
    compile: bool = True
    attention: str = "gqa-decode"
    cache_quantum: int = 128
    time_budget_s: float | None = None
    shard_bytes: int = 12_000_000
    flush_every_s: float = 60.0

    def __post_init__(self) -> None:
        if self.greedy not in (0, 1):
            raise SelfDistillError(f"--greedy must be 0 or 1 (one greedy answer is deterministic), got {self.greedy}")
        if self.samples < 0 or self.greedy + self.samples == 0:
            raise SelfDistillError("ask for at least one answer per turn: --greedy 1 and/or --samples N (N >= 1)")
        if self.samples and not self.temperature > 0:
            raise SelfDistillError(f"--temperature must be > 0 for samples, got {self.temperature}")
        if self.max_new_tokens < 1 or self.chunk_new_tokens < 1 or self.batch_size < 1:
            raise SelfDistillError("--max-new-tokens, --chunk-new-tokens and --batch-size must be >= 1")
        if not 0.0 <= self.min_alive < 1.0:
            raise SelfDistillError(f"--min-alive must be in [0, 1), got {self.min_alive}")
        if self.attention not in ("gqa-decode", "sdpa"):
            raise SelfDistillError(f"--attention must be 'gqa-decode' or 'sdpa', got {self.attention!r}")
        if self.cache not in ("static", "dynamic"):
            raise SelfDistillError(f"--cache must be 'static' or 'dynamic', got {self.cache!r}")
        if self.shard_bytes > 15_000_000:
            raise SelfDistillError("--shard-bytes must be <= 15000000 (a shard has to travel as one file <= 16 MB)")

    @property
    def num_variants(self) -> int:
        """Answers per user turn (greedy + samples)."""
        return self.greedy + self.samples

    def temperature_of(self, variant: int) -> float:
        """0.0 for the greedy variant, else ``temperature``."""
        return 0.0 if variant < self.greedy else float(self.temperature)

    def content_key(self) -> dict:
        """Settings that determine the answers (a resumed run must use the same)."""
        return {"greedy": self.greedy, "temperature": float(self.temperature), "seed": self.seed,
                "max_new_tokens": self.max_new_tokens}


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
    """Write ``{"id", "rounds"}`` gzipped JSON lines (deterministic bytes); returns the count."""
    from spd_ds.train.data import write_jsonl_gz

    return write_jsonl_gz(({"id": c.uid, "rounds": c.rounds} for c in convs), path)


# ---------------------------------------------------------------------------------------------------- keyed sampling
def item_key(seed: int, uid: str, variant: int, round_: int) -> int:
    """64-bit key of one answer's random stream (a hash of seed, conversation id, variant and round)."""
    d = hashlib.blake2b(f"{seed}\x00{uid}\x00{variant}\x00{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2^32) (no int64 overflow: constants < 2^31)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def keyed_uniform(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), a pure function of ``(key, position)``, identical on every device.

    Args:
        keys: ``[B]`` int64, 64-bit keys (:func:`item_key`) as signed int64.
        positions: ``[B]`` int64 >= 0, the answer position of the token to draw.

    Returns:
        ``[B]`` float64 in (0, 1), resolution 2^-32.
    """
    lo, hi = keys & _M32, (keys >> 32) & _M32
    h = _mix32(_mix32(positions & _M32) ^ lo)
    h = _mix32(h ^ hi)
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def _signed64(k: int) -> int:
    return k - (1 << 64) if k >= (1 << 63) else k


class KeyedSampler(LogitsProcessor):
    """``LogitsProcessor`` that samples rows with ``temperature > 0`` from their own keyed random streams.

    For a sampled row the returned scores are 0 at the drawn token and -inf elsewhere, so ``generate``'s greedy
    argmax (``do_sample=False``) picks it; greedy rows (temperature 0) pass unchanged. The draw inverts the row's CDF
    ``cumsum(softmax(scores / T))`` (float64) at :func:`keyed_uniform` of (key, answer position): an exact sample of
    the target's distribution at ``T``, independent of the batch.

    Args:
        keys: ``[B]`` int64 row keys; temperatures: ``[B]`` float32 (0 = greedy); start_positions: ``[B]`` int64
            answer position of the call's first new token (tokens already generated in earlier calls);
        prompt_width: padded prompt width of the call (``input_ids.shape[1]`` before the first new token).
    """

    def __init__(self, keys: torch.Tensor, temperatures: torch.Tensor, start_positions: torch.Tensor,
                 prompt_width: int) -> None:
        self.keys, self.start, self.width = keys, start_positions, int(prompt_width)
        self.sampled = temperatures > 0
        self.inv_t = torch.where(self.sampled, 1.0 / temperatures.clamp_min(1e-6), torch.ones_like(temperatures))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        pos = self.start + (input_ids.shape[1] - self.width)
        u = keyed_uniform(self.keys, pos)  # [B]
        cdf = torch.softmax(scores.float() * self.inv_t[:, None], dim=-1).double().cumsum(-1)  # [B, V]
        tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).clamp_(max=scores.shape[-1] - 1)
        onehot = torch.full_like(scores, float("-inf")).scatter_(1, tok, 0.0)
        return torch.where(self.sampled[:, None], onehot, scores)


class StopWhenFewAlive(StoppingCriteria):
    """``StoppingCriteria``: a row stops at an EOS id or after its ``budget`` new tokens; the whole call stops once
    at most ``min_alive`` x rows are still generating (no host sync: tensor ops only).

    Args:
        eos_ids: ``[E]`` int64; budgets: ``[B]`` int64 new-token budget per row; prompt_width: padded prompt width;
        min_alive: share of rows (0 = run until every row stopped).
    """

    def __init__(self, eos_ids: torch.Tensor, budgets: torch.Tensor, prompt_width: int, min_alive: float) -> None:
        self.eos, self.budgets, self.width = eos_ids, budgets, int(prompt_width)
        self.floor = int(min_alive * budgets.numel())
        self.ended = torch.zeros(budgets.shape, dtype=torch.bool, device=budgets.device)

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        self.ended |= torch.isin(input_ids[:, -1], self.eos)
        done = self.ended | (self.budgets <= input_ids.shape[1] - self.width)
        few = (~done).sum() <= self.floor
        return done | few


# ---------------------------------------------------------------------------------------------------- attention
GQA_DECODE = "spd_gqa_decode_sdpa"


def gqa_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs):
    """transformers attention function: SDPA without ``repeat_kv`` for a single query token.

    Args:
        query: ``[B, H, q, D]``; key, value: ``[B, Hkv, L, D]`` (``H = Hkv * n_rep``); attention_mask: ``[B, 1, q,
            L]`` (bool or additive) or ``None``, as transformers' ``sdpa_mask`` makes it.

    Returns:
        ``([B, q, H, D], None)`` like ``sdpa_attention_forward``. For ``q == 1`` the query is viewed as ``[B, Hkv,
        n_rep, D]`` (query head ``h`` reads key/value head ``h // n_rep``, as ``repeat_kv`` pairs them) and the mask
        broadcasts over the ``n_rep`` rows; anything else (prefill, extras such as ``position_bias``) goes to
        transformers' own ``sdpa_attention_forward``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_rep = int(getattr(module, "num_key_value_groups", 1))
    if (query.shape[2] != 1 or n_rep == 1 or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or (attention_mask is not None and attention_mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    B, H, _, D = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, H // n_rep, n_rep, D), key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling)
    return out.reshape(B, H, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register_gqa_decode_attention() -> str:
    """Register :func:`gqa_decode_attention` (and transformers' SDPA mask for it); returns its
    ``attn_implementation`` name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(GQA_DECODE, gqa_decode_attention)
    AttentionMaskInterface.register(GQA_DECODE, sdpa_mask)
    return GQA_DECODE


# ---------------------------------------------------------------------------------------------------- generation
@dataclasses.dataclass
class Row:
    """One answer in progress: its context (prompt tokens) and the answer so far."""

    key: tuple[str, int, int]  # (uid, variant, round)
    prompt: np.ndarray  # [P] int64: everything before the answer (chain context + this round's glue)
    segment_prefix: int  # tokens of `prompt` that belong to this item's segment (round 1: all; later: the glue)
    temperature: float
    rng_key: int
    answer: list[int] = dataclasses.field(default_factory=list)
    calls: int = 0


@dataclasses.dataclass
class CallStats:
    """One ``generate`` call: rows, padded prompt width, static-cache length, decode steps, answer tokens, seconds."""

    rows: int
    width: int
    cache_len: int
    steps: int
    tokens: int
    seconds: float
    finished: int
    t_end: float = 0.0


def _bucket(n: int, quantum: int = 0) -> int:
    """Static-cache room for a prompt of ``n`` tokens: the next power of two >= n (at least 64), or above
    ``quantum`` the next multiple of ``quantum`` (so that calls share a few shapes)."""
    p2 = max(64, 1 << max(0, n - 1).bit_length())
    return p2 if quantum <= 0 or p2 <= quantum else -(-n // quantum) * quantum


class AnswerGenerator:
    """Batched answers with transformers' ``generate`` (see the module docstring).

    Args:
        model: a causal LM (eval mode) on its device; its ``generation_config`` is replaced by a neutral one so that
            no sampling default of the checkpoint applies.
        eos_ids: token ids that end an answer; pad_id: left-padding id.
        cfg: the run settings (``batch_size``, ``max_batch_tokens``, ``chunk_new_tokens``, ``min_alive``, ``cache``,
            ``compile``, ``max_new_tokens``).
    """

    def __init__(self, model, eos_ids: Sequence[int], pad_id: int, cfg: SelfDistillConfig) -> None:
        from transformers import GenerationConfig

        self.model, self.cfg = model, cfg
        self.eos_ids, self.pad_id = [int(e) for e in eos_ids], int(pad_id)
        self.device = next(model.parameters()).device
        self.eos_t = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        self.calls: list[CallStats] = []

    def rows_for(self, width: int, new_tokens: int) -> int:
        """Rows allowed in one call whose longest prompt has ``width`` tokens (a multiple of 64 when capped)."""
        cache_len = _bucket(width, self.cfg.cache_quantum) + new_tokens
        n = min(self.cfg.batch_size, max(1, self.cfg.max_batch_tokens // cache_len))
        return n if n == self.cfg.batch_size or n < 64 else n // 64 * 64

    def _generation_config(self, new_tokens: int, cache_len: int):
        from transformers import GenerationConfig

        kw = dict(max_new_tokens=new_tokens, do_sample=False, num_beams=1, eos_token_id=self.eos_ids,
                  pad_token_id=self.pad_id, use_cache=True, return_dict_in_generate=False)
        if self.cfg.cache == "static":
            kw.update(cache_implementation="static", max_cache_len=cache_len)
        if not self.cfg.compile:
            kw["disable_compile"] = True
        elif self.cfg.cache == "static" and self.device.type == "cuda":  # one compile for all batch / cache sizes
            from transformers import CompileConfig

            kw["compile_config"] = CompileConfig(dynamic=True)
        return GenerationConfig(**kw)

    @torch.no_grad()
    def step(self, rows: Sequence[Row]) -> list[bool]:
        """Advance ``rows`` by one ``generate`` call; extends each ``row.answer`` in place.

        Returns:
            per row, True if the answer is finished (ended with an EOS id, or ``max_new_tokens`` reached).
        """
        from transformers import LogitsProcessorList, StoppingCriteriaList

        cfg = self.cfg
        t0 = time.perf_counter()
        real = len(rows)
        if real == 1:  # a batch of one would make torch.compile specialise (and compile) once more: add a copy
            rows = [rows[0], rows[0]]
        B = len(rows)
        ctx = [np.concatenate([r.prompt, np.asarray(r.answer, dtype=np.int64)]) if r.answer else r.prompt
               for r in rows]
        width = max(len(c) for c in ctx)
        ids = np.full((B, width), self.pad_id, dtype=np.int64)
        att = np.zeros((B, width), dtype=np.int64)
        for i, c in enumerate(ctx):
            ids[i, width - len(c):] = c
            att[i, width - len(c):] = 1
        budgets = [min(cfg.chunk_new_tokens, cfg.max_new_tokens - len(r.answer)) for r in rows]
        new_tokens = max(budgets)
        cache_len = _bucket(width, cfg.cache_quantum) + cfg.chunk_new_tokens  # shape independent of the budgets
        dev = self.device
        procs = LogitsProcessorList()
        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
        if bool((temps > 0).any()):
            procs.append(KeyedSampler(torch.tensor([_signed64(r.rng_key) for r in rows], dtype=torch.long, device=dev),
                                      temps.to(dev), torch.tensor([len(r.answer) for r in rows], device=dev), width))
        stop = StoppingCriteriaList([StopWhenFewAlive(self.eos_t, torch.tensor(budgets, device=dev), width,
                                                      cfg.min_alive)])
        if cfg.cache == "static":  # size the static cache for this call, not the longest call so far
            self.model._previous_max_cache_length = -1
        out = self.model.generate(input_ids=torch.from_numpy(ids).to(dev), attention_mask=torch.from_numpy(att).to(dev),
                                  generation_config=self._generation_config(new_tokens, cache_len),
                                  logits_processor=procs, stopping_criteria=stop)
        new = out[:real, width:].cpu().numpy()
        finished, tokens = [], 0
        eos = set(self.eos_ids)
        for r, g, b in zip(rows[:real], new, budgets):
            g = g[:b].tolist()
            ended = False
            for j, t in enumerate(g):
                if t in eos:
                    g, ended = g[: j + 1], True
                    break
            r.answer.extend(g)
            r.calls += 1
            tokens += len(g)
            finished.append(ended or len(r.answer) >= cfg.max_new_tokens)
        t1 = time.perf_counter()
        self.calls.append(CallStats(real, width, cache_len, int(new.shape[1]), tokens, t1 - t0, sum(finished), t1))
        return finished


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
    """Write ``items`` as one compressed ``.npz`` shard (atomically: temp file + rename); returns its stats.

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
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    os.replace(tmp, path)
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


# ---------------------------------------------------------------------------------------------------- the run
def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """Short id of the target's weights (:meth:`TargetArch.fingerprint`, else a hash of ``config.json``)."""
    try:
        from spd_ds.models.adapter import TargetArch

        return TargetArch(model_dir).fingerprint()
    except Exception:  # noqa: BLE001 - architectures the adapter does not split still generate
        return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]


class _Store:
    """The output directory: existing items (resume), the buffer of new ones, shards and the manifest."""

    def __init__(self, out_dir: Path, manifest_base: dict, id_dtype: np.dtype, cfg: SelfDistillConfig, log) -> None:
        self.dir, self.cfg, self.log, self.id_dtype = out_dir, cfg, log, id_dtype
        out_dir.mkdir(parents=True, exist_ok=True)
        old = {}
        if (out_dir / MANIFEST).is_file():
            old = json.loads((out_dir / MANIFEST).read_text())
            for k in ("model_fingerprint", "sampling", "id_dtype"):
                if k in old and old[k] != manifest_base[k]:
                    raise SelfDistillError(
                        f"{out_dir} holds answers made with another {k} ({old[k]} vs {manifest_base[k]}); use the "
                        "same settings to resume, or a new --out")
        self.manifest = dict(manifest_base, runs=old.get("runs", []))
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
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(m, indent=1) + "\n")
        os.replace(tmp, self.dir / MANIFEST)


def run_selfdistill(convs: Sequence[PromptConversation], model_dir: str | os.PathLike, tokenizer,
                    out_dir: str | os.PathLike, cfg: SelfDistillConfig, *, model=None, device=None,
                    dtype: torch.dtype | None = None, eos_token_ids: Sequence[int] | None = None,
                    source: Sequence[str] = (), model_name: str | None = None, t_start: float | None = None,
                    log: Callable[[str], None] | None = None) -> dict:
    """Answer every round of ``convs`` with the target into shards under ``out_dir`` (resuming what is there).

    Args:
        convs: conversations (:func:`load_prompt_conversations`).
        model_dir: the target's HF directory (loaded unless ``model`` is given).
        tokenizer: its tokenizer, with the chat template.
        out_dir: output directory (shards + ``manifest.json``).
        cfg: settings (:class:`SelfDistillConfig`).
        model: an already loaded model (tests); device / dtype: default CUDA + bf16 when available, else CPU + fp32.
        eos_token_ids: ids that end an answer (default: the tokenizer's EOS plus the checkpoint's
            ``generation_config.eos_token_id``).
        source, model_name: recorded in the manifest.
        t_start: ``time.perf_counter()`` the time budget and the throughput count from (default: now).
        log: one-line progress messages (default: stderr).

    Returns:
        This run's summary (also appended to the manifest's ``runs``): answers and answer tokens generated now,
        ``wall_s`` (from ``t_start``, model loading and prompt encoding included), ``generate_s``, generated tokens/s
        over both, per-round counts, whether the time budget stopped it, and the manifest's totals.

    Raises:
        SelfDistillError: inconsistent settings (resume with other content settings, prompt + answer longer than the
            model's positions, an empty conversation list).
    """
    t_start = time.perf_counter() if t_start is None else t_start
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if not convs:
        raise SelfDistillError("no conversation to answer; check --data")
    out_dir = Path(out_dir)
    from transformers import AutoModelForCausalLM

    if model is None:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        attn = register_gqa_decode_attention() if cfg.attention == "gqa-decode" else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn)
        model = model.to(device).eval()
    eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if not eos_token_ids and gen_eos is not None:
        eos += [e for e in ([gen_eos] if isinstance(gen_eos, int) else gen_eos) if e not in eos]
    eos = [int(e) for e in eos if e is not None]
    if not eos:
        raise SelfDistillError("the tokenizer has no EOS token; pass eos_token_ids")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and cfg.max_prompt_tokens + cfg.max_new_tokens > max_pos:
        raise SelfDistillError(f"--max-prompt-tokens {cfg.max_prompt_tokens} + --max-new-tokens {cfg.max_new_tokens} "
                               f"> the model's {max_pos} positions; lower one of them")
    vocab = max(int(model.config.vocab_size), len(tokenizer))
    id_dtype = id_dtype_for(vocab)
    fp = model_fingerprint(model_dir)
    base = {"format": FORMAT, "model": model_name or str(model_dir), "model_fingerprint": fp,
            "vocab_size": vocab, "id_dtype": id_dtype.name, "eos_token_ids": eos,
            "sampling": cfg.content_key(), "variants": {"greedy": cfg.greedy, "samples": cfg.samples},
            "source": [str(s) for s in source], "num_conversations": len(convs),
            "max_prompt_tokens": cfg.max_prompt_tokens, "max_rounds": cfg.max_rounds,
            "assistant_mask": "answer tokens incl. the EOS id that ended them (the template's end-of-turn)",
            "split": "spd_ds.train.split.split_held_out(records, fraction, seed): by blake2b of conv_id"}
    store = _Store(out_dir, base, id_dtype, cfg, log)
    gen = AnswerGenerator(model, eos, pad, cfg)
    eot_text = {e: tokenizer.decode([e], skip_special_tokens=False) for e in eos}
    run = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": str(gen.device),
           "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__,
           "attention": getattr(model.config, "_attn_implementation", None),
           "settings": {k: v for k, v in dataclasses.asdict(cfg).items()}, "resumed_answers": store.resumed}
    per_round: dict[int, dict] = {}
    new_answers = new_tokens = 0
    stopped = False
    chains_stopped = defaultdict(int)

    def budget_left() -> bool:
        return cfg.time_budget_s is None or time.perf_counter() - t_start < cfg.time_budget_s

    def draining() -> bool:  # the last 10 % of the budget: finish answers in flight, start no new ones
        return cfg.time_budget_s is not None and time.perf_counter() - t_start >= 0.9 * cfg.time_budget_s

    def finish(row: Row) -> None:
        nonlocal new_answers, new_tokens
        seg = np.concatenate([row.prompt[len(row.prompt) - row.segment_prefix:],
                              np.asarray(row.answer, dtype=np.int64)])
        fin = FINISH_EOS if row.answer and row.answer[-1] in eot_text else FINISH_LENGTH
        store.add(Item(row.key[0], row.key[1], row.key[2], seg, row.segment_prefix, fin))
        pr = per_round.setdefault(row.key[2], {"answers": 0, "tokens": 0, "eos": 0, "calls": 0})
        pr["answers"] += 1
        pr["tokens"] += len(row.answer)
        pr["eos"] += fin == FINISH_EOS
        new_answers += 1
        new_tokens += len(row.answer)

    try:
        max_r = max(len(c.rounds) for c in convs)
        if cfg.max_rounds:
            max_r = min(max_r, cfg.max_rounds)
        for rnd in range(1, max_r + 1):
            if stopped:
                break
            todo = [c for c in convs if len(c.rounds) >= rnd]
            todo.sort(key=lambda c: held_out_score(c.uid, cfg.seed + 7919 * rnd))  # deterministic shuffle
            waves = iter(range(0, len(todo), cfg.wave_conversations))
            rows: list[Row] = []
            cont: list[Row] = []
            i = 0
            calls0 = len(gen.calls)
            while True:
                if not budget_left():
                    stopped = True
                    break
                fresh_ok = not draining()
                if fresh_ok and i >= len(rows):
                    w = next(waves, None)
                    if w is not None:  # tokenise the next wave
                        rows = _wave_rows(todo[w: w + cfg.wave_conversations], rnd, store.items, tokenizer, cfg,
                                          eot_text, chains_stopped)
                        rows.sort(key=lambda r: len(r.prompt))
                        i = 0
                        continue
                fresh_left = fresh_ok and i < len(rows)
                if cont and (len(cont) >= cfg.batch_size or not fresh_left):
                    cont.sort(key=lambda r: len(r.prompt) + len(r.answer))
                    batch = _take(cont, gen, cfg)
                    cont = cont[len(batch):]
                elif fresh_left:
                    batch = _take(rows[i:], gen, cfg)
                    i += len(batch)
                else:
                    break  # the round is done (or, near the budget, its continuations are)
                for r, d in zip(batch, gen.step(batch)):
                    if d:
                        finish(r)
                    else:
                        cont.append(r)
                _log_call(log, rnd, gen.calls[-1], len(rows) - i, len(cont), t_start, new_tokens)
                store.maybe_flush()
            if draining():
                stopped = True  # no new round near the end of the budget
            if rnd in per_round:
                per_round[rnd]["calls"] = len(gen.calls) - calls0
    finally:
        store.flush()
        wall = time.perf_counter() - t_start
        gen_s = sum(c.seconds for c in gen.calls)
        run.update({
            "wall_s": round(wall, 2), "generate_s": round(gen_s, 2), "answers": new_answers,
            "generated_tokens": new_tokens, "generated_tokens_per_s": round(new_tokens / max(wall, 1e-9), 1),
            "generated_tokens_per_generate_s": round(new_tokens / max(gen_s, 1e-9), 1),
            "calls": len(gen.calls), "rows_x_steps": int(sum(c.rows * c.steps for c in gen.calls)),
            "discarded_in_flight_tokens": None, "stopped_by_time_budget": stopped,
            "chains_stopped": dict(chains_stopped),
            "by_round": {str(k): v for k, v in sorted(per_round.items())},
        })
        if len(gen.calls) > 1:  # after the first call, which pays the compile
            later = gen.calls[1:]
            run["decode_tokens_per_s_after_first_call"] = round(
                sum(c.tokens for c in later) / max(later[-1].t_end - gen.calls[0].t_end, 1e-9), 1)
            run["first_call_s"] = round(gen.calls[0].seconds, 2)
        run["row_utilisation"] = round(sum(c.tokens for c in gen.calls) / max(run["rows_x_steps"], 1), 3)
        run["discarded_in_flight_tokens"] = int(sum(c.tokens for c in gen.calls) - new_tokens)
        store.write_manifest(run)
    run["totals"] = json.loads((out_dir / MANIFEST).read_text())["counts"]
    run["call_stats"] = gen.calls
    return run


def _take(rows: Sequence[Row], gen: AnswerGenerator, cfg: SelfDistillConfig) -> list[Row]:
    """The next batch from the front of ``rows`` (sorted ascending by context length): as many rows as fit."""
    n = 0
    for n in range(1, len(rows) + 1):
        r = rows[n - 1]
        width = len(r.prompt) + len(r.answer)
        if n > gen.rows_for(width, cfg.chunk_new_tokens):
            n -= 1
            break
    return list(rows[: max(n, 1)])


def _wave_rows(convs: Sequence[PromptConversation], rnd: int, done: dict, tokenizer, cfg: SelfDistillConfig,
               eot_text: dict, chains_stopped: dict) -> list[Row]:
    """Rows of round ``rnd`` for ``convs`` that are not done yet and whose chain reaches this round."""
    first, later = [], []  # (conv, variant) pairs
    for c in convs:
        for v in range(cfg.num_variants):
            if (c.uid, v, rnd) in done:
                continue
            (first if rnd == 1 else later).append((c, v))
    rows: list[Row] = []
    if first:
        texts = {}
        for c, _ in first:
            if c.uid not in texts:
                texts[c.uid] = _render(tokenizer, c.rounds[0], True)
        order = list(texts)
        enc = dict(zip(order, _encode_texts(tokenizer, [texts[u] for u in order])))
        for c, v in first:
            p = enc[c.uid]
            if len(p) > cfg.max_prompt_tokens:
                chains_stopped["prompt_too_long"] += 1
                continue
            rows.append(Row((c.uid, v, rnd), p, len(p), cfg.temperature_of(v), item_key(cfg.seed, c.uid, v, rnd)))
    if later:
        pend, glue_texts = [], []
        for c, v in later:
            prev = [done.get((c.uid, v, r)) for r in range(1, rnd)]
            if any(p is None for p in prev):
                continue  # the chain ended earlier (cut answer, long prompt) or is not there yet
            if prev[-1].finish != FINISH_EOS:
                chains_stopped["answer_cut"] += 1
                continue
            history = []
            for r, it in enumerate(prev):
                history += c.rounds[r]
                ans = it.tokens[it.prompt_len:]
                history.append({"role": "assistant", "content": tokenizer.decode(ans[:-1].tolist(),
                                                                                 skip_special_tokens=False)})
            glue = turn_glue(tokenizer, history, c.rounds[rnd - 1], eot_text.get(int(prev[-1].tokens[-1]), "\x00"))
            if glue is None:
                chains_stopped["template_not_prefix"] += 1
                continue
            pend.append((c, v, prev))
            glue_texts.append(glue)
        for (c, v, prev), g in zip(pend, _encode_texts(tokenizer, glue_texts)):
            ctx_len = sum(len(it.tokens) for it in prev) + len(g)
            if ctx_len > cfg.max_prompt_tokens:
                chains_stopped["prompt_too_long"] += 1
                continue
            prompt = np.concatenate([it.tokens for it in prev] + [g])
            rows.append(Row((c.uid, v, rnd), prompt, len(g), cfg.temperature_of(v), item_key(cfg.seed, c.uid, v, rnd)))
    return rows


def _log_call(log, rnd: int, c: CallStats, fresh_left: int, cont: int, t_start: float, total: int) -> None:
    wall = time.perf_counter() - t_start
    log(f"selfdistill: round {rnd} call rows={c.rows} width={c.width} cache={c.cache_len} steps={c.steps} "
        f"tokens={c.tokens} ({c.tokens / max(c.rows * c.steps, 1):.0%} of rows x steps) finished={c.finished} "
        f"in {c.seconds:.1f}s = {c.tokens / max(c.seconds, 1e-9):.0f} tok/s; wave left {fresh_left}, "
        f"continuing {cont}; run {total} tok / {wall:.0f}s = {total / max(wall, 1e-9):.0f} tok/s")


def throughput_table(run: dict) -> str:
    """A small text table of a run summary (by round, then totals)."""
    lines = ["round | answers | answer tokens | ended by EOS | generate calls",
             "---|---|---|---|---"]
    for r, v in run.get("by_round", {}).items():
        lines.append(f"{r} | {v['answers']} | {v['tokens']} | {v['eos'] / max(v['answers'], 1):.0%} | {v['calls']}")
    lines.append(f"all | {run['answers']} | {run['generated_tokens']} | | {run['calls']}")
    lines.append(f"generated tokens/s: {run['generated_tokens_per_s']:.0f} over {run['wall_s']:.0f} s wall "
                 f"(load, prompt encoding, compile included); {run['generated_tokens_per_generate_s']:.0f} inside "
                 f"generate ({run['generate_s']:.0f} s); after the first call (compile, "
                 f"{run.get('first_call_s', 0):.0f} s): {run.get('decode_tokens_per_s_after_first_call', 0):.0f} "
                 f"tok/s; row utilisation {run['row_utilisation']:.0%}; discarded "
                 f"in-flight tokens {run['discarded_in_flight_tokens']}; stopped by time budget: "
                 f"{run['stopped_by_time_budget']}")
    return "\n".join(lines)
