"""Answer generation: keyed sampling, the stopping criterion, the gqa-decode attention and
:class:`AnswerGenerator` (transformers' ``generate`` in chunks)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Sequence

import numpy as np
import torch
from transformers import LogitsProcessor, StoppingCriteria

from spd_ds.train.selfdistill.config import SelfDistillConfig

_M32 = 0xFFFFFFFF


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

    Out of device memory (a GPU shared with other jobs, a long-prompt prefill): a call that raises
    ``torch.OutOfMemoryError`` lowers ``token_cap`` (rows x static-cache length of any later call, at first
    ``max_batch_tokens``) to half of the failed call's (rows rounded up) and is run again as calls under the new cap;
    ``oom_splits`` counts the failed calls. The cap is in tokens, so a long-prompt failure leaves room for more rows of
    shorter prompts; it does not grow back. The answers are those of a run with smaller calls (sampling is keyed by
    answer position, not batch row; greedy answers may differ at floating-point near-ties between batch shapes, as with
    any re-batching). A single row that does not fit raises.
    """

    def __init__(self, model, eos_ids: Sequence[int], pad_id: int, cfg: SelfDistillConfig) -> None:
        from transformers import GenerationConfig

        self.model, self.cfg = model, cfg
        self.eos_ids, self.pad_id = [int(e) for e in eos_ids], int(pad_id)
        self.device = next(model.parameters()).device
        self.eos_t = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        self.calls: list[CallStats] = []
        self.token_cap, self.oom_splits = int(cfg.max_batch_tokens), 0

    def rows_for(self, width: int, new_tokens: int) -> int:
        """Rows allowed in one call whose longest prompt has ``width`` tokens: ``batch_size``, or as many as
        ``max_batch_tokens`` (or the lower ``token_cap`` after an out-of-memory error) allow, rounded down to a
        multiple of 64 from 64 rows up."""
        cache_len = _bucket(width, self.cfg.cache_quantum) + new_tokens
        n = min(self.cfg.batch_size, max(1, min(self.cfg.max_batch_tokens, self.token_cap) // cache_len))
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
    def step(self, rows: Sequence[Row], pad_single: bool = True) -> list[bool]:
        """Advance ``rows`` by one ``generate`` call; extends each ``row.answer`` in place.

        Args:
            rows: the rows of the call.
            pad_single: a single row runs as a batch of two (itself twice), so that torch.compile does not specialise
                on a batch of one; off for a row retried alone after an out-of-memory error.

        Returns:
            per row, True if the answer is finished (ended with an EOS id, or ``max_new_tokens`` reached).

        Raises:
            torch.OutOfMemoryError: one row alone does not fit in device memory (larger calls are split instead).
        """
        from transformers import LogitsProcessorList, StoppingCriteriaList

        cfg = self.cfg
        t0 = time.perf_counter()
        given = list(rows)
        real = len(rows)
        if real == 1 and pad_single:  # a batch of one would make torch.compile specialise (compile) once more
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
        try:
            out = self.model.generate(input_ids=torch.from_numpy(ids).to(dev),
                                      attention_mask=torch.from_numpy(att).to(dev),
                                      generation_config=self._generation_config(new_tokens, cache_len),
                                      logits_processor=procs, stopping_criteria=stop)
        except torch.OutOfMemoryError:
            if real == 1 and not pad_single:
                raise
            out = None  # split outside the handler, so that the failed call's tensors are freed first
        if out is None:
            del procs, stop
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            half = -(-real // 2)  # 3 rows -> 2 + 1; a padded single row -> itself alone
            self.token_cap = min(self.token_cap, half * cache_len)
            self.oom_splits += 1
            finished, i = [], 0
            while i < real:  # chunks under the cap as it stands (a chunk that fails again lowers it further)
                n = min(real - i, max(1, min(half, self.rows_for(width, cfg.chunk_new_tokens))))
                finished += self.step(given[i:i + n], pad_single=False)
                i += n
            return finished
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
