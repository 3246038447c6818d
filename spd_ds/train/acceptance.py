"""Predicted T = 0 acceptance of the reference decoder from the head's top-1 agreement by pipeline fill.

What is measured in training
----------------------------
``a_F`` (``F = 1..n``): on held-out text in the training layout (``spd_ds.train.student`` at fill ``F``), the share
of loss positions where the head's greedy draft equals the target's argmax (:func:`spd_ds.train.loss.top1_agreement`).
At T = 0 a draft made with ``F`` tokens in flight is accepted exactly when they agree, so ``a_F`` is the acceptance
of drafts made at fill ``F``.

The cycle (``spd_ds/decoding/reference.py``)
-------------------------------------------
Every cycle drafts once (with ``F`` = the tokens in flight) and verifies at most once, when the oldest in-flight token
leaves stage ``n-1``; each verification returns one token (the accepted draft, or the target's replacement). Follow
the *verified drafts* in order and note the fill ``X_i`` each was made at:

* ``X_1 = 1``: after prefill only the prefill token is in flight;
* after an **acceptance** of a draft made at fill ``F`` the next verified draft is the one made in the next cycle,
  with one more token in flight, up to a full pipeline: ``X_{i+1} = min(F + 1, n)``; it is verified **1 cycle**
  later;
* after a **rejection** the pipeline restarts from the replacement alone: ``X_{i+1} = 1``, verified **n cycles**
  later (the replacement goes through all ``n`` stages first). Prefill is the same: draft 1 is verified in cycle
  ``n``.

So a draft's cost in cycles is a function of its own fill: ``c(1) = n``, ``c(F) = 1`` for ``F >= 2`` (``n = 1``:
every draft costs 1). With ``D`` verified drafts the decoder returns ``N = D + 1`` tokens (the prefill token counts,
as in :class:`~spd_ds.decoding.metrics.SPDMetrics`) in ``K = Σ_i c(X_i)`` cycles; the equivalent accept length is
the paper's ``L'_acc = n·N/K`` (SPD paper, evaluation metrics: tokens per cycle times the number of stages).

The Markov chain
----------------
Taking drafts at fill ``F`` as accepted independently with probability ``a_F``, ``X`` is a Markov chain on
``{1..n}`` with ``P[F -> min(F+1, n)] = a_F`` and ``P[F -> 1] = 1 - a_F`` (both for ``n = 1``). Its stationary
distribution, with ``w_1 = 1``, ``w_F = a_1·…·a_{F-1}`` (``1 < F < n``), ``w_n = a_1·…·a_{n-1} / (1 - a_n)``::

    π_F = w_F / Σ_G w_G
    α   = Σ_F π_F a_F = 1 - π_1                        (every rejection, and only a rejection, leads to fill 1)
    N/K → 1 / Σ_F π_F c(F) = 1 / (1 + (n-1)(1-α))
    L'  = n / (1 + (n-1)(1-α))

For ``a_F`` all equal to ``a``: ``α = a``. ``n = 2``: ``α = a_1 / (1 + a_1 - a_2)``. Finite generations
(:func:`predict_acceptance` with ``num_new_tokens``) start at ``X_1 = 1`` and count the prefill token: their expected
counts are ``E[K] = Σ_{i=1}^{D} p_i·c`` and ``E[accepted] = Σ_i p_i·a`` with ``p_1 = δ_1``, ``p_{i+1} = p_i P``;
the prediction is then ``α = E[accepted]/D`` and ``L' = n·N/E[K]`` (ratios of expectations, pooled over
generations as :meth:`SPDMetrics.pooled` pools them).

Sampled drafts (T > 0): speculative sampling accepts a draft ``x ~ q`` with probability ``min(1, p(x)/q(x))``, so a
draft made at fill ``F`` is accepted with probability ``Σ_v min(p(v), q(v))`` given its context
(:func:`spd_ds.train.loss.draft_overlap`); fed the mean of that by fill as ``a_F``, the same chain predicts the draft
acceptance and ``L'`` of sampling at ``T`` (``val_pred_acceptance_sampled``), on the held-out text rather than on
text sampled at ``T``.

Where the prediction is exact and where not: on the target's own greedy continuation of a prompt, the training
layout's agreement at (position, fill) *is* the decoder's acceptance of the draft made there
(``tests/test_train_layout.py``), so :func:`replay_decoder` fed that table reproduces the decoder's counts; the
Markov formula adds only the independence assumption (acceptance is correlated along the text) and the finite sample
of positions. On text the target would not generate (e.g. human answers) agreement measures something else.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from spd_ds.decoding.metrics import SPDMetrics


@dataclasses.dataclass(frozen=True)
class AcceptancePrediction:
    """Predicted T = 0 acceptance of the reference decoder (see module doc).

    Attributes:
        num_stages: ``n``.
        agreement_by_fill: ``(a_1, .., a_n)``, probabilities.
        fill_share: ``(π_1, .., π_n)``: the share of verified drafts made at each fill (stationary, or the mean over
            the drafts of finite generations).
        draft_acceptance_rate: ``α`` (accepted / verified drafts), in ``[0, 1]``.
        tokens_per_cycle: ``N/K`` (tokens per decode cycle).
        equivalent_accept_length: ``L' = n·N/K`` (tokens), in ``[1, n]`` for the stationary prediction.
    """

    num_stages: int
    agreement_by_fill: tuple[float, ...]
    fill_share: tuple[float, ...]
    draft_acceptance_rate: float
    tokens_per_cycle: float
    equivalent_accept_length: float

    def to_dict(self) -> dict:
        """JSON-able dict; the by-fill tuples become ``{F: value}`` for ``F = 1..n``."""
        return {"num_stages": self.num_stages,
                "agreement_by_fill": {f: a for f, a in enumerate(self.agreement_by_fill, 1)},
                "fill_share": {f: p for f, p in enumerate(self.fill_share, 1)},
                "draft_acceptance_rate": self.draft_acceptance_rate, "tokens_per_cycle": self.tokens_per_cycle,
                "equivalent_accept_length": self.equivalent_accept_length}


def _check(agreement_by_fill: Sequence[float] | Mapping[int, float]) -> tuple[float, ...]:
    if isinstance(agreement_by_fill, Mapping):
        n = len(agreement_by_fill)
        try:
            a = tuple(float(agreement_by_fill[f]) for f in range(1, n + 1))
        except KeyError:
            raise ValueError(f"agreement by fill needs the keys 1..{n}, got {sorted(agreement_by_fill)}") from None
    else:
        a = tuple(float(x) for x in agreement_by_fill)
    if not a:
        raise ValueError("agreement by fill is empty: give a_F for F = 1..n (n >= 1)")
    bad = [x for x in a if not 0.0 <= x <= 1.0]
    if bad:
        raise ValueError(f"agreement by fill must lie in [0, 1], got {list(a)}")
    return a


def draft_cost(fill: int, num_stages: int) -> int:
    """Cycles from the previous verification (or prefill) to the verification of a draft made at ``fill``: ``n`` at
    fill 1 (the pipeline restarted), else 1."""
    return num_stages if fill == 1 else 1


def fill_transition(agreement_by_fill: Sequence[float] | Mapping[int, float]) -> list[list[float]]:
    """Transition matrix ``P`` (``n x n``, row/column ``F-1``) of the fill of successive verified drafts.

    Args:
        agreement_by_fill: ``a_1..a_n`` (a sequence, index 0 = fill 1, or a mapping ``{F: a_F}``).
    Raises:
        ValueError: empty, or a value outside ``[0, 1]``.
    """
    a = _check(agreement_by_fill)
    n = len(a)
    P = [[0.0] * n for _ in range(n)]
    for i, ai in enumerate(a):
        P[i][min(i + 1, n - 1)] += ai
        P[i][0] += 1.0 - ai
    return P


def stationary_fill_distribution(agreement_by_fill: Sequence[float] | Mapping[int, float]) -> list[float]:
    """Stationary ``π_1..π_n`` of :func:`fill_transition` (closed form of the module doc; ``a_n = 1`` with a
    reachable full pipeline gives ``π = e_n``, an unreachable fill gets 0).

    Raises:
        ValueError: as :func:`fill_transition`.
    """
    a = _check(agreement_by_fill)
    n = len(a)
    w = [1.0]
    for F in range(2, n + 1):
        w.append(w[-1] * a[F - 2])
    if w[-1] > 0.0:
        if a[-1] >= 1.0:  # the full pipeline is absorbing and reachable
            return [0.0] * (n - 1) + [1.0]
        w[-1] /= 1.0 - a[-1]
    total = sum(w)
    return [x / total for x in w]


def predict_acceptance(agreement_by_fill: Sequence[float] | Mapping[int, float],
                       num_new_tokens: int | Sequence[int] | None = None) -> AcceptancePrediction:
    """Predicted T = 0 draft acceptance and equivalent accept length of the reference decoder (module doc).

    Args:
        agreement_by_fill: ``a_1..a_n``, the head's top-1 agreement by fill (a sequence, index 0 = fill 1, or a
            mapping ``{F: a_F}`` with keys ``1..n``); ``n`` = its length.
        num_new_tokens: ``None`` = the stationary (long-generation) prediction; an int ``N`` or a list of them =
            the expected counts of generations of exactly those lengths (prefill token included, first draft at
            fill 1), pooled as ``ΣE[accepted]/ΣD`` and ``n·ΣN/ΣE[K]``.
    Returns:
        :class:`AcceptancePrediction`.
    Raises:
        ValueError: empty agreement, a value outside ``[0, 1]``, or a generation length below 1.
    """
    a = _check(agreement_by_fill)
    n = len(a)
    cost = [draft_cost(F, n) for F in range(1, n + 1)]
    if num_new_tokens is None:
        pi = stationary_fill_distribution(a)
        alpha = sum(p * x for p, x in zip(pi, a))
        tpc = 1.0 / sum(p * c for p, c in zip(pi, cost))
        return AcceptancePrediction(n, a, tuple(pi), alpha, tpc, n * tpc)
    lengths = [int(num_new_tokens)] if isinstance(num_new_tokens, int) else [int(x) for x in num_new_tokens]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"num_new_tokens must be >= 1 (the prefill token counts), got {num_new_tokens}")
    P = fill_transition(a)
    # visits[i][F]: probability that draft i (1-based) is made at fill F; summed over the drafts of every generation
    longest = max(lengths) - 1
    cum_visits = [[0.0] * n]  # cum_visits[d] = Σ_{i<=d} p_i
    p = [1.0] + [0.0] * (n - 1)
    for _ in range(longest):
        cum_visits.append([c + x for c, x in zip(cum_visits[-1], p)])
        p = [sum(p[i] * P[i][j] for i in range(n)) for j in range(n)]
    visits = [0.0] * n
    for N in lengths:
        visits = [v + x for v, x in zip(visits, cum_visits[N - 1])]
    drafts = sum(N - 1 for N in lengths)
    tokens = sum(lengths)
    cycles = sum(v * c for v, c in zip(visits, cost))
    accepted = sum(v * x for v, x in zip(visits, a))
    share = tuple(v / drafts for v in visits) if drafts else tuple(0.0 for _ in a)
    tpc = tokens / cycles if cycles else 0.0
    return AcceptancePrediction(n, a, share, accepted / drafts if drafts else 0.0, tpc, n * tpc)


def agreement_from_counts(agree: Sequence[float], count: Sequence[float], num_stages: int) -> list[float]:
    """``a_F = agree[F] / count[F]`` for ``F = 1..n`` (index 0 unused, as :class:`SPDMetrics`' by-fill lists).

    Raises:
        ValueError: a fill without any counted position.
    """
    empty = [F for F in range(1, num_stages + 1) if not count[F]]
    if empty:
        raise ValueError(f"no position counted at fill(s) {empty}: cannot estimate the agreement there")
    return [agree[F] / count[F] for F in range(1, num_stages + 1)]


def replay_decoder(accept: Callable[[int, int], bool], num_stages: int, num_new_tokens: int) -> SPDMetrics:
    """The reference decoder's cycle, step for step, with acceptance given by ``accept`` instead of a model.

    A transcription of :meth:`SPDReferenceDecoder.generate`'s pipeline bookkeeping (draft from the tokens in flight,
    stage forwards, the draft enters at depth 0, verification when the oldest leaves stage ``n-1``, restart from the
    replacement after a rejection) without tensors. Used to check the fill semantics of the module doc against the
    real decoder, and to simulate it (Monte Carlo) with random acceptances.

    Args:
        accept: ``accept(j, F) -> bool``: is the draft of generated token ``j`` (``j >= 1``; token 0 is the prefill
            token), made with ``F`` tokens in flight, accepted? At T = 0 on the target's greedy text that is the
            training layout's top-1 agreement at fill ``F`` of the row of token ``j - 1``.
        num_stages: ``n >= 1``.
        num_new_tokens: ``N >= 1`` tokens to return (the prefill token included; generation stops there, as at
            ``max_new_tokens`` or at the EOS the greedy text ends with).
    Returns:
        :class:`SPDMetrics` with ``num_new_tokens``, ``num_cycles``, ``num_drafts``, ``num_accepted_tokens``,
        ``num_rollbacks`` and the by-fill counts (no timings).
    Raises:
        ValueError: ``num_stages < 1`` or ``num_new_tokens < 1``.
    """
    n = int(num_stages)
    if n < 1 or num_new_tokens < 1:
        raise ValueError(f"need num_stages >= 1 and num_new_tokens >= 1, got {num_stages}, {num_new_tokens}")
    m = SPDMetrics(num_stages=n)
    out = 1
    pipeline = [[0, 0, 0]]  # in flight, oldest first: [token index j, depth, fill it was drafted at]
    while out < num_new_tokens:
        m.num_cycles += 1
        fill = len(pipeline)  # 1. draft from the tokens in flight
        for e in pipeline:  # 2. stage forwards
            e[1] += 1
        pipeline.append([pipeline[-1][0] + 1, 0, fill])  # 3. the draft enters at depth 0
        if pipeline[0][1] < n:  # 4. verify once the oldest has left the last stage
            continue
        j, _, f = pipeline[1]
        ok = bool(accept(j, f))
        m.num_drafts += 1
        m.drafts_by_fill[f] += 1
        pipeline.pop(0)
        if ok:
            m.num_accepted_tokens += 1
            m.accepted_by_fill[f] += 1
        else:
            m.num_rollbacks += 1
            pipeline = [[j, 0, 0]]  # restart from the replacement
        out += 1
    m.num_new_tokens = out
    return m


__all__ = ["AcceptancePrediction", "draft_cost", "fill_transition", "stationary_fill_distribution",
           "predict_acceptance", "agreement_from_counts", "replay_decoder"]
