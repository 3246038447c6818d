"""SPD metrics (the names docs/benchmarks.md uses), one dataclass filled by every decoder through its ``observe_*``
methods.

Decoders never bump a counter themselves (vLLM's ``SpecDecodingStats.observe_draft`` idea): a verification is
:meth:`SPDMetrics.observe_verify`, a rollback :meth:`SPDMetrics.observe_rollback`, a decode cycle
:meth:`SPDMetrics.observe_cycle`, a timed part :meth:`SPDMetrics.observe_time`, and the end of a generation
:meth:`SPDMetrics.close`, so the definitions below hold for every decoder by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass
class SPDMetrics:
    """Counters and timings of one generation (or a sum of several; ``+`` adds them).

    Definitions (``n`` = number of stages):

    * ``num_new_tokens`` N: verified tokens returned, **including** the token taken from the prefill logits.
    * ``num_cycles`` K: decode cycles (one stage forward per busy stage each).
    * ``num_drafts``: drafts verified; ``num_accepted_tokens``: drafts accepted.
    * ``draft_acceptance_rate`` = accepted / drafts verified.
    * ``tokens_per_cycle`` = N / K; ``equivalent_accept_length`` = n·N / K (the paper's L'_acc).
    * ``drafts_by_fill[f]`` / ``accepted_by_fill[f]``: drafts made when ``f`` tokens were in flight (f = 1..n;
      f = n is a full pipeline), i.e. acceptance by draft depth.
    * times in seconds: ``prefill_s``, ``decode_s`` and the per-cycle split ``stage_forward_s[s]``, ``head_s``,
      ``verify_s``, ``comm_s`` (distributed only), ``control_s`` (everything else in the loop).
    """

    num_stages: int = 1
    num_new_tokens: int = 0
    num_cycles: int = 0
    num_drafts: int = 0
    num_accepted_tokens: int = 0
    num_rollbacks: int = 0
    drafts_by_fill: list[int] = dataclasses.field(default_factory=list)
    accepted_by_fill: list[int] = dataclasses.field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stage_forward_s: list[float] = dataclasses.field(default_factory=list)
    head_s: float = 0.0
    verify_s: float = 0.0
    comm_s: float = 0.0
    control_s: float = 0.0

    def __post_init__(self) -> None:
        n = self.num_stages
        self.drafts_by_fill = self.drafts_by_fill or [0] * (n + 1)
        self.accepted_by_fill = self.accepted_by_fill or [0] * (n + 1)
        self.stage_forward_s = self.stage_forward_s or [0.0] * n

    # ------------------------------------------------------------------ observations (the only writers)
    def observe_prefill(self, seconds: float) -> None:
        """The prompt's forward (and the first token) took ``seconds``."""
        self.prefill_s = seconds

    def observe_cycle(self, cycles: int = 1) -> None:
        """``cycles`` more decode cycles (SPD: one forward per busy stage each; AR: decode steps)."""
        self.num_cycles += cycles

    def observe_verify(self, fill: int, accepted: bool) -> None:
        """One draft verified (paper §3.3): it was drafted with ``fill`` tokens in flight (1..n) and ``accepted`` or
        not.

        Raises:
            IndexError: ``fill`` beyond ``num_stages``.
        """
        self.num_drafts += 1
        self.drafts_by_fill[fill] += 1
        if accepted:
            self.num_accepted_tokens += 1
            self.accepted_by_fill[fill] += 1

    def observe_rollback(self) -> None:
        """One rollback after a rejected draft (the in-flight tokens flushed)."""
        self.num_rollbacks += 1

    def observe_time(self, part: str, seconds: float, stage: int | None = None) -> None:
        """Add ``seconds`` to one part of the cycle time split: ``part`` is ``"head"``, ``"verify"``, ``"comm"``, or
        ``"stage_forward"`` with the ``stage`` index.

        Raises:
            ValueError: an unknown ``part``, or ``stage`` given with another part (or missing with ``stage_forward``).
        """
        if part == "stage_forward" and stage is not None:
            self.stage_forward_s[stage] += seconds
        elif part in ("head", "verify", "comm") and stage is None:
            setattr(self, f"{part}_s", getattr(self, f"{part}_s") + seconds)
        else:
            raise ValueError(f"unknown time split part {part!r} (stage {stage})")

    def close(self, num_new_tokens: int, decode_s: float | None = None, *,
              split_stages: Iterable[int] | None = None) -> None:
        """End of a generation: ``num_new_tokens`` N returned (the prefill token included) after ``decode_s`` seconds
        of decode loop (``None``: no decode loop ran, it stays 0).

        Args:
            split_stages: the stages whose forward time this process measured itself; given, ``control_s`` becomes
                the decode time that head, verify, communication and those stage forwards leave unaccounted for
                (never negative). ``None`` leaves ``control_s`` as it is (AR baselines).
        """
        self.num_new_tokens = num_new_tokens
        if decode_s is not None:
            self.decode_s = decode_s
        if split_stages is not None:
            local = sum(self.stage_forward_s[s] for s in split_stages)
            self.control_s = max(0.0, self.decode_s - self.head_s - self.verify_s - self.comm_s - local)

    @property
    def draft_acceptance_rate(self) -> float:
        """accepted / verified drafts (0 without drafts)."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        """N / K (0 without cycles)."""
        return self.num_new_tokens / self.num_cycles if self.num_cycles else 0.0

    @property
    def equivalent_accept_length(self) -> float:
        """n · N / K, the paper's L'_acc."""
        return self.num_stages * self.tokens_per_cycle

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput: tokens after the prefill token per second of decode loop."""
        return max(self.num_new_tokens - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0

    def __add__(self, other: "SPDMetrics") -> "SPDMetrics":
        if other.num_stages != self.num_stages:
            raise ValueError("cannot add metrics of runs with different numbers of stages")
        out = SPDMetrics(num_stages=self.num_stages)
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "num_stages":
                continue
            setattr(out, f.name, [x + y for x, y in zip(a, b)] if isinstance(a, list) else a + b)
        return out

    def acceptance_by_depth(self) -> list[dict]:
        """Acceptance by draft depth: one ``{"fill", "drafts", "accepted", "rate"}`` per fill ``f = 1..n`` (``rate``
        is ``None`` where no draft was verified at that fill)."""
        return [
            {"fill": f, "drafts": d, "accepted": a, "rate": (a / d) if d else None}
            for f, (d, a) in enumerate(zip(self.drafts_by_fill, self.accepted_by_fill)) if f >= 1
        ]

    def cycle_time_split_ms(self) -> dict:
        """Mean per-cycle time split in milliseconds: ``stage_forward`` (list, one per stage), ``head``, ``verify``,
        ``comm``, ``control`` and ``cycle`` (= ``decode_s / num_cycles``); all zeros without cycles."""
        k = self.num_cycles
        ms = (lambda x: 1e3 * x / k) if k else (lambda x: 0.0)
        return {
            "stage_forward": [ms(x) for x in self.stage_forward_s],
            "head": ms(self.head_s), "verify": ms(self.verify_s), "comm": ms(self.comm_s),
            "control": ms(self.control_s), "cycle": ms(self.decode_s),
        }

    @classmethod
    def pooled(cls, items: "Iterable[SPDMetrics]", num_stages: int | None = None) -> "SPDMetrics":
        """Sum of several generations' metrics (pooled rates: ``ΣN / ΣK`` etc.); an empty input gives zeros with
        ``num_stages`` stages (default 1).

        Raises:
            ValueError: metrics of different numbers of stages.
        """
        items = list(items)
        out = cls(num_stages=num_stages or (items[0].num_stages if items else 1))
        for m in items:
            out = out + m
        return out

    def to_dict(self) -> dict:
        """Counters, timings and derived rates as a flat JSON-able dict."""
        d = dataclasses.asdict(self)
        d.update(
            draft_acceptance_rate=self.draft_acceptance_rate,
            tokens_per_cycle=self.tokens_per_cycle,
            equivalent_accept_length=self.equivalent_accept_length,
            decode_tok_s=self.decode_tok_s,
        )
        return d


def pooled_decode_tok_s(items: "Iterable[SPDMetrics]") -> float:
    """Decode throughput of several generations: ``Σ(N_i - 1) / Σ decode_s_i`` (each generation's prefill token is
    excluded; ``(ΣN - 1) / Σdecode_s`` of a summed :class:`SPDMetrics` would exclude only one). 0.0 without time."""
    items = list(items)
    t = sum(m.decode_s for m in items)
    return sum(max(m.num_new_tokens - 1, 0) for m in items) / t if t > 0 else 0.0


def pooled_decode_accept_length(items: "Iterable[SPDMetrics]") -> float:
    """Equivalent accept length over decode tokens only: ``n * Σ(N_i - 1) / ΣK_i`` (each generation's prefill token
    excluded, which :attr:`SPDMetrics.equivalent_accept_length` counts in ``N``). 1.0 = one token per ``n`` cycles,
    AR's rate (a head whose drafts are all rejected); ``n`` = every draft accepted. 0.0 without cycles.

    Raises:
        ValueError: metrics of different numbers of stages.
    """
    items = list(items)
    if len({m.num_stages for m in items}) > 1:
        raise ValueError("cannot pool metrics of runs with different numbers of stages")
    k = sum(m.num_cycles for m in items)
    return items[0].num_stages * sum(max(m.num_new_tokens - 1, 0) for m in items) / k if k else 0.0
