"""Self-distillation settings: :class:`SelfDistillConfig`, :class:`SelfDistillError` and the format constants."""

from __future__ import annotations

import dataclasses

FORMAT = "spd-ds/selfdistill-v1"
MANIFEST = "manifest.json"
SHARD_PREFIX = "shard-"
FINISH_EOS, FINISH_LENGTH = 0, 1


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
