"""Predicted acceptance from agreement by fill (spd_ds.train.acceptance) and the held-out evaluation
(spd_ds.train.validate): the formula by hand and by Monte Carlo, the cycle replay against the real reference decoder,
and the prediction against the decoder's measured acceptance on the same text (a tiny trained head; the shipped
SmolLM2 head).

Tolerance of "prediction vs decoder" (the same greedy text, fp32 CPU): the decoder uses each position at exactly one
fill and its drafts follow the fill chain, while ``a_F`` averages every position at every fill; the Markov chain
assumes acceptances independent, and acceptance is correlated along the text. Both are finite-sample effects of the
``D`` verified drafts, so the allowance is two binomial standard errors, ``2·sqrt(α(1-α)/D)`` on the draft
acceptance and that times ``dL'/dα = n(n-1)/(1+(n-1)(1-α))²`` on the equivalent accept length. Boundary effects
(the first draft of a generation is made at fill 1, the prefill token is free) are not part of the allowance: the
finite-horizon prediction (``num_new_tokens``) counts them exactly; the stationary one is allowed their size on top.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.eval.report import repeated_ngram_share
from spd_ds.train.acceptance import (
    fill_transition, predict_acceptance, replay_decoder, stationary_fill_distribution,
)
from spd_ds.train.batching import loop_positions
from spd_ds.train.split import split_held_out
from spd_ds.train.validate import agreement_table, evaluate, held_out_batches
from tests.tiny_models import make_tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


def layout_rows(prompts, gens):
    """One training row per prompt + its generated continuation: ``ids, segments, valid`` ``[B, S]``, the loss
    positions being those whose next token the decoder drafted (generated tokens 1.., not the prefill token)."""
    seqs = [p + g for p, g in zip(prompts, gens)]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    seg = torch.zeros_like(ids)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        ids[b, :len(s)], seg[b, :len(s)], valid[b, len(p):len(s) - 1] = torch.tensor(s), 1, True
    return ids, seg, valid  # tiny models: one intra-op thread (tests/conftest.py)


def closed_form_length(alpha: float, n: int) -> float:
    return n / (1 + (n - 1) * (1 - alpha))


# ---------------------------------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("a", [0.0, 0.31, 0.6, 0.95])
def test_equal_agreement_gives_the_issue_formula(n, a):
    p = predict_acceptance([a] * n)
    assert p.draft_acceptance_rate == pytest.approx(a, abs=1e-12)
    assert p.equivalent_accept_length == pytest.approx(closed_form_length(a, n), abs=1e-12)
    assert p.tokens_per_cycle == pytest.approx(p.equivalent_accept_length / n)


def test_closed_forms_n1_n2_n3():
    # n = 1: every draft is verified in the cycle it is made: L' = 1 whatever the acceptance
    p = predict_acceptance([0.4])
    assert (p.draft_acceptance_rate, p.equivalent_accept_length, p.fill_share) == (pytest.approx(0.4), 1.0, (1.0,))
    # n = 2: π = (1 - a2, a1) / (1 + a1 - a2), α = a1 / (1 + a1 - a2), L' = 2 / (2 - α)
    a1, a2 = 0.3, 0.5
    p = predict_acceptance({1: a1, 2: a2})
    assert p.fill_share == pytest.approx(((1 - a2) / (1 + a1 - a2), a1 / (1 + a1 - a2)))
    assert p.draft_acceptance_rate == pytest.approx(a1 / (1 + a1 - a2))
    assert p.equivalent_accept_length == pytest.approx(2 / (2 - a1 / (1 + a1 - a2)))
    # n = 3, a = 1/2 everywhere: w = (1, 1/2, (1/4)/(1/2)) -> π = (1/2, 1/4, 1/4), α = 1/2, L' = 3/2
    p = predict_acceptance([0.5, 0.5, 0.5])
    assert p.fill_share == pytest.approx((0.5, 0.25, 0.25)) and p.equivalent_accept_length == pytest.approx(1.5)
    # by hand, n = 3, a = (0.2, 0.5, 0.7): w = (1, 0.2, 0.1/0.3), Σw = 23/15
    p = predict_acceptance([0.2, 0.5, 0.7])
    assert p.fill_share == pytest.approx((15 / 23, 3 / 23, 5 / 23))
    assert p.draft_acceptance_rate == pytest.approx(8 / 23)
    assert p.equivalent_accept_length == pytest.approx(closed_form_length(8 / 23, 3))


@pytest.mark.parametrize("a", [[0.3, 0.5], [0.2, 0.5, 0.7], [0.9, 0.1, 0.5, 0.99], [0.0, 1.0], [1.0, 1.0, 0.2]])
def test_stationary_distribution_is_stationary_and_alpha_is_one_minus_pi1(a):
    pi = stationary_fill_distribution(a)
    P = fill_transition(a)
    n = len(a)
    assert sum(pi) == pytest.approx(1.0)
    assert [sum(pi[i] * P[i][j] for i in range(n)) for j in range(n)] == pytest.approx(pi)
    assert predict_acceptance(a).draft_acceptance_rate == pytest.approx(1 - pi[0])


def test_edge_cases():
    assert predict_acceptance([1.0, 1.0, 1.0]).equivalent_accept_length == 3.0  # absorbing full pipeline
    assert predict_acceptance([0.0, 0.0]).equivalent_accept_length == 1.0  # every draft rejected: 1 token / n cycles
    assert predict_acceptance([0.0, 1.0]).fill_share == (1.0, 0.0)  # a full pipeline is never reached


def test_finite_horizon_by_hand():
    a1, a2 = 0.3, 0.6
    # N = 2: one draft, made at fill 1, verified in cycle n: 2 tokens in n cycles, whatever it gave
    p = predict_acceptance([a1, a2], 2)
    assert (p.draft_acceptance_rate, p.tokens_per_cycle, p.equivalent_accept_length) == (pytest.approx(a1), 1.0, 2.0)
    # N = 3: draft 2 is at fill 2 (cost 1) after an acceptance, else at fill 1 (cost 2)
    p = predict_acceptance([a1, a2], 3)
    assert p.draft_acceptance_rate == pytest.approx((a1 + a1 * a2 + (1 - a1) * a1) / 2)
    assert p.equivalent_accept_length == pytest.approx(2 * 3 / (2 + a1 * 1 + (1 - a1) * 2))
    # pooled over lengths = sums of expectations; long generations tend to the stationary prediction
    p = predict_acceptance([a1, a2], [2, 3])
    assert p.draft_acceptance_rate == pytest.approx((a1 + a1 + a1 * a2 + (1 - a1) * a1) / 3)
    long = predict_acceptance([0.2, 0.5, 0.7], 100_000)
    assert long.equivalent_accept_length == pytest.approx(predict_acceptance([0.2, 0.5, 0.7])
                                                          .equivalent_accept_length, abs=1e-4)
    assert predict_acceptance([0.5], 1).tokens_per_cycle == 0.0  # only the prefill token: no cycle


def test_bad_inputs_fail_with_one_line():
    for bad, args in (([], ()), ([1.2], ()), ({1: 0.2, 3: 0.4}, ()), ([0.3], (0,))):
        with pytest.raises(ValueError) as e:
            predict_acceptance(bad, *args)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("a", [[0.3], [0.3, 0.5], [0.2, 0.5, 0.7], [0.6] * 4, [0.9, 0.1, 0.5, 0.8, 0.4]])
def test_monte_carlo_of_the_cycle_matches_the_prediction(a):
    """replay_decoder transcribes the decoder's cycle (checked against the real decoder below); driven by independent
    coins with probability a_F it must reproduce the Markov prediction, finite horizon and stationary."""
    n, rng = len(a), random.Random(len(a))
    for N, runs in ((40, 400), (4000, 4)):
        m = SPDMetrics.pooled([replay_decoder(lambda j, F: rng.random() < a[F - 1], n, N) for _ in range(runs)])
        p = predict_acceptance(a, [N] * runs)
        se = math.sqrt(p.draft_acceptance_rate * (1 - p.draft_acceptance_rate) / m.num_drafts)
        assert abs(m.draft_acceptance_rate - p.draft_acceptance_rate) < 4 * se + 1e-9, (N, m, p)
        assert abs(m.equivalent_accept_length - p.equivalent_accept_length) < 4 * se * n + 1e-9, (N, m, p)
        share = [d / m.num_drafts for d in m.drafts_by_fill[1:]]
        assert share == pytest.approx(p.fill_share, abs=6 * math.sqrt(0.25 / m.num_drafts))
    assert p.equivalent_accept_length == pytest.approx(predict_acceptance(a).equivalent_accept_length, abs=0.01)


# ---------------------------------------------------------------------------------------------------- the decoder
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama split into n = 3 stages, its fp32 CPU target and six prompts with their greedy text."""
    from spd_ds.decoding.ar import ARDecoder
    from spd_ds.models.adapter import Target, TargetArch
    from spd_ds.partition import StagePartition

    torch.set_num_threads(1)
    arch = TargetArch(make_tiny_model(tmp_path_factory.mktemp("acc"), "llama", num_layers=6))
    part = StagePartition.build(6, 3)
    target = Target(arch, part, torch.float32, "cpu")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 96) for _ in range(rng.randint(4, 10))] for _ in range(6)]
    ar = ARDecoder(target, max_len=256)
    return arch, part, target, prompts, [ar.generate(p, 48).tokens for p in prompts]


def test_replay_reproduces_the_reference_decoder(tiny):
    """The fill semantics of spd_ds.train.acceptance are the decoder's: with an oracle drafter whose acceptance is a
    known coin per position, replay_decoder gives the decoder's counts exactly (cycles, drafts and accepts by fill),
    and the prediction with a_F = alpha matches the decoder's measured acceptance."""
    from spd_ds.decoding.drafters import OracleDrafter
    from spd_ds.decoding.reference import SPDReferenceDecoder
    from spd_ds.decoding.sampling import STREAM_ORACLE, keyed_uniform

    arch, part, target, prompts, gens = tiny
    alpha, seed, n = 0.6, 11, part.num_stages
    runs, replays = [], []
    for prompt, gen in zip(prompts, gens):
        oracle = OracleDrafter(prompt + gen, alpha, vocab_size=arch.vocab_size, seed=seed)
        res = SPDReferenceDecoder(target, oracle, max_len=256).generate(prompt, len(gen))
        assert res.tokens == gen
        s0 = len(prompt)
        rep = replay_decoder(lambda j, F: keyed_uniform(seed, s0 + j, STREAM_ORACLE) < alpha, n, len(gen))
        for key in ("num_new_tokens", "num_cycles", "num_drafts", "num_accepted_tokens", "num_rollbacks",
                    "drafts_by_fill", "accepted_by_fill"):
            assert getattr(rep, key) == getattr(res.metrics, key), key
        runs.append(res.metrics)
        replays.append(rep)
    m = SPDMetrics.pooled(runs)
    assert all(m.drafts_by_fill[1:])  # every fill occurred
    p = predict_acceptance([alpha] * n, [len(g) for g in gens])
    tol_a, tol_l = _tolerance(p.draft_acceptance_rate, m.num_drafts, n)
    assert abs(m.draft_acceptance_rate - p.draft_acceptance_rate) <= tol_a
    assert abs(m.equivalent_accept_length - p.equivalent_accept_length) <= tol_l


def _tolerance(alpha: float, drafts: int, n: int) -> tuple[float, float]:
    """(on α, on L'): two binomial standard errors of α over ``drafts`` verified drafts, and that times dL'/dα."""
    tol = 2 * math.sqrt(alpha * (1 - alpha) / drafts)
    return tol, tol * n * (n - 1) / (1 + (n - 1) * (1 - alpha)) ** 2


def compare_with_decoder(arch, target, head, prompts, max_new_tokens, eos=None):
    """Decode ``prompts`` with the head (reference decoder, T = 0), then measure the head's agreement by fill on the
    returned text with the training path (teacher stages + HeadTrainModule + top1_agreement, through
    spd_ds.train.validate.evaluate) at the positions the decoder drafted, and predict.

    Returns:
        ``(measured SPDMetrics, evaluate's dict, finite-horizon prediction, stationary prediction, replayed
        SPDMetrics)``.
    """
    from spd_ds.decoding.drafters import HeadDrafter
    from spd_ds.decoding.reference import SPDReferenceDecoder
    from spd_ds.train.loss import TeacherTargets
    from spd_ds.train.student import HeadTrainModule
    from spd_ds.train.teacher import TeacherStage

    part, n = head.partition, head.partition.num_stages
    head = head.float()
    gens, runs = [], []
    for prompt in prompts:
        dec = SPDReferenceDecoder(target, HeadDrafter(head, 512, torch.float32, "cpu"), eos_token_ids=eos, max_len=512)
        res = dec.generate(prompt, max_new_tokens)
        gens.append(res.tokens)
        runs.append(res.metrics)
    measured = SPDMetrics.pooled(runs, n)

    # the text in the training layout: one row per prompt + its continuation; loss positions = the rows whose next
    # token the decoder drafted (generated tokens 1.., not the prefill token)
    ids, seg, valid = layout_rows(prompts, gens)
    batch = {"input_ids": ids, "segments": seg, "valid": valid}
    stages = [TeacherStage(arch, part, s, torch.float32, head.draft_ids.tolist()) for s in range(n)]
    x = (ids, seg, valid.long(), valid.reshape(-1).nonzero().flatten())
    with torch.no_grad():
        for st in stages:
            x = st(x)
    feats, targets = x[0], TeacherTargets(*x[1:])
    assert targets.argmax_full.tolist() == [t for g in gens for t in g[1:]], "the text is not the target's greedy text"
    student = HeadTrainModule(head)
    val = evaluate(student, lambda b: (b, feats, targets), [(batch, True)], n, head.draft_ids, "cpu", reduce=False)
    assert val["val_positions"] == measured.num_drafts

    # the same table, position by position, replayed through the decoder's cycle
    table = agreement_table(student, feats, seg, valid, targets, head.draft_ids, n)
    # the loop-free figures are the same agreement over the positions outside loops
    keep = ~loop_positions(ids, valid)[valid]
    assert val["val_loop_share"] == pytest.approx(1 - keep.double().mean().item(), abs=1e-12)
    assert keep.any()  # an answer's first n-1 tokens are never in a loop
    free = predict_acceptance(table[:, keep].double().mean(1).tolist())
    assert val["val_pred_acceptance_noloop"] == pytest.approx(free.draft_acceptance_rate, abs=1e-12)
    assert val["val_pred_accept_length_noloop"] == pytest.approx(free.equivalent_accept_length, abs=1e-12)
    replays, off = [], 0
    for g in gens:
        replays.append(replay_decoder(lambda j, F, off=off: bool(table[F - 1, off + j - 1]), n, len(g)))
        off += len(g) - 1
    a = [val["val_agreement_by_fill"][F] for F in range(1, n + 1)]
    return (measured, val, predict_acceptance(a, [len(g) for g in gens]), predict_acceptance(a),
            SPDMetrics.pooled(replays, n))


def check_prediction(measured, val, finite, stationary, replayed):
    n = measured.num_stages
    # 1. the decoder's acceptance is the training layout's agreement at the fills the cycle visits
    assert replayed.drafts_by_fill == measured.drafts_by_fill and replayed.accepted_by_fill == measured.accepted_by_fill
    assert replayed.num_cycles == measured.num_cycles
    # 2. the Markov prediction from the agreement by fill, within the finite-sample allowance (module doc)
    tol_a, tol_l = _tolerance(finite.draft_acceptance_rate, measured.num_drafts, n)
    assert val["val_pred_acceptance"] == stationary.draft_acceptance_rate
    assert abs(measured.draft_acceptance_rate - finite.draft_acceptance_rate) <= tol_a, (measured, finite)
    assert abs(measured.equivalent_accept_length - finite.equivalent_accept_length) <= tol_l, (measured, finite)
    boundary = abs(finite.equivalent_accept_length - stationary.equivalent_accept_length)
    assert abs(measured.equivalent_accept_length - stationary.equivalent_accept_length) <= tol_l + boundary
    assert abs(measured.draft_acceptance_rate - stationary.draft_acceptance_rate) <= tol_a + abs(
        finite.draft_acceptance_rate - stationary.draft_acceptance_rate)


def test_prediction_matches_the_decoder_tiny_trained_head(tiny):
    """A head distilled for a few steps on the tiny target's greedy text (acceptance around 0.4 there, every fill
    visited): the prediction from its agreement by fill matches the reference decoder on that text."""
    from spd_ds.head import SpeculationHead
    from spd_ds.train.loss import TeacherTargets, kd_loss, position_weights
    from spd_ds.train.student import HeadTrainModule
    from spd_ds.train.teacher import TeacherStage

    arch, part, target, prompts, gens = tiny
    n = part.num_stages
    torch.manual_seed(0)
    head = SpeculationHead(arch, part, 1)
    ids, seg, valid = layout_rows(prompts, gens)
    x = (ids, seg, valid.long(), valid.reshape(-1).nonzero().flatten())
    with torch.no_grad():
        for st in [TeacherStage(arch, part, s, torch.float32, head.draft_ids.tolist()) for s in range(n)]:
            x = st(x)
    feats, t = x[0], TeacherTargets(*x[1:])
    student = HeadTrainModule(head)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for it in range(30):
        loss = kd_loss(student(feats, seg, valid, 1 + it % n), t, position_weights(t, head.draft_ids, 1.0, "weight"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    measured, val, finite, stationary, replayed = compare_with_decoder(arch, target, head.eval(), prompts, 48)
    assert 0.2 < measured.draft_acceptance_rate < 0.8 and all(measured.drafts_by_fill[1:])
    check_prediction(measured, val, finite, stationary, replayed)


@pytest.mark.slow
def test_prediction_matches_the_decoder_smollm2_shipped_head(smollm2_dir, smollm2_prompts):
    """The shipped SmolLM2 n = 2 head (loaded through spd_ds.builder), five demo prompts, 64 new tokens, fp32 CPU.

    About 30 s of CPU time on one thread (the reference decoder's ~450 cycles), more wall time on a busy machine:
    hence the slow tier. Recorded for the two-layer head shipped 2026-12-02 (18,957 steps, drafting over the whole
    vocabulary): a = (0.548, 0.514), measured α 0.537 / L' 1.382 over 259 drafts, predicted 0.530 / 1.377 (finite
    horizon), stationary 0.530 / 1.360
    (no loops in these 64-token answers: the loop-free figures are the same).
    """
    from spd_ds.builder import build_arch, build_head, build_partition, build_target
    from spd_ds.config import load_config
    from spd_ds.eval.regression import DEFAULT_HEAD_DIR

    cfg = load_config(None, [f"model.name={smollm2_dir}", "model.dtype=float32", "model.device=cpu",
                             f"head.checkpoint={DEFAULT_HEAD_DIR}"])
    arch = build_arch(cfg)
    part = build_partition(cfg, arch)
    head, target = build_head(cfg, arch, part), build_target(cfg, arch, part)
    measured, val, finite, stationary, replayed = compare_with_decoder(arch, target, head, smollm2_prompts, 64,
                                                                       eos=[2])
    assert measured.num_drafts > 200
    check_prediction(measured, val, finite, stationary, replayed)


# ---------------------------------------------------------------------------------------------------- loops
def test_loop_positions_by_hand():
    """Loss positions whose next token closes an n-gram already seen in the same answer; a new turn or document is a
    new answer; nothing outside ``valid``; the share over a packed row equals repeated_ngram_share of its answers; a
    bad n-gram length is refused."""
    # row: doc 1 = [prompt 1 2 | answer 5 6 5 6 5 | user 1 | answer 5 6 5], doc 2 = [prompt 9 | answer 7 8 7 8 7 8]
    doc1 = [1, 2, 5, 6, 5, 6, 5, 1, 5, 6, 5]
    mask1 = [0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1]
    doc2 = [9, 7, 8, 7, 8, 7, 8]
    mask2 = [0, 1, 1, 1, 1, 1, 1]
    ids = torch.tensor([doc1 + doc2 + [0, 0]])
    valid = torch.zeros_like(ids, dtype=torch.bool)  # as collate marks it: never across the document boundary
    for off, m in ((0, mask1), (len(doc1), mask2)):
        valid[0, off:off + len(m) - 1] = torch.tensor(m[1:], dtype=torch.bool)
    loop = loop_positions(ids, valid, n=2)
    # bigram (5, 6) closes at doc1[5]: position 4; (6, 5) at doc1[6]: position 5; the second answer starts afresh
    # (5 6 5: (6, 5) is new there); doc 2: (7, 8) closes again at doc2[4], then every bigram repeats: off+3..off+5
    off = len(doc1)
    assert torch.nonzero(loop[0]).flatten().tolist() == [4, 5, off + 3, off + 4, off + 5]
    assert not (loop & ~valid).any()
    answers = [[5, 6, 5, 6, 5], [5, 6, 5], [7, 8, 7, 8, 7, 8]]
    flagged = int(loop.sum())
    assert flagged / sum(len(a) - 1 for a in answers) == repeated_ngram_share(answers, 2)
    assert not loop_positions(ids, valid, n=9).any()  # no answer has a repeated 9-gram
    with pytest.raises(ValueError, match="n-gram length"):
        loop_positions(ids, valid, n=0)
    with pytest.raises(ValueError, match="n-gram length"):
        repeated_ngram_share(answers, 0)


class _ScriptedHead(torch.nn.Module):
    """A stand-in for HeadTrainModule: drafts the teacher's token ``nxt`` where ``right``, the next id elsewhere."""

    def __init__(self, nxt: torch.Tensor, right: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.nxt, self.right, self.vocab = nxt, right, vocab

    def forward(self, feats, segments, valid, fill):
        drafted = torch.where(self.right, self.nxt, (self.nxt + 1) % self.vocab)
        return torch.nn.functional.one_hot(drafted, self.vocab).float()  # [P, V] logits at the loss positions


def test_evaluate_loop_free_figures_by_hand():
    """evaluate's loop-free figures count exactly the positions outside loops: a head right in every loop and at
    every other position outside them has loop-free agreement 1/2, overall (loops + half the rest) / all."""
    from spd_ds.train.loss import TeacherTargets

    answer = [5, 6, 7, 8] * 3 + [9, 10, 11, 12, 13, 14, 15, 16]
    ids = torch.tensor([[1, 2] + answer])
    seg = torch.ones_like(ids)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[0, 1:-1] = True  # the loss positions predict answer tokens 1..
    loop = loop_positions(ids, valid, n=4)[valid]
    assert loop.tolist() == [False] * 7 + [True] * 5 + [False] * 8  # "5 6 7 8" again, then every 4-gram repeats
    P, V = len(loop), 32
    nxt = ids[0, 2:]
    free = (~loop).nonzero().flatten()
    right = loop.clone()
    right[free[::2]] = True
    targets = TeacherTargets(torch.zeros(P, V), torch.zeros(P), nxt)
    batch = {"input_ids": ids, "segments": seg, "valid": valid}
    head = _ScriptedHead(nxt, right, V)

    val = evaluate(head, lambda b: (b, None, targets), [(batch, True)], 2, torch.arange(V), "cpu", reduce=False,
                   loop_ngram=4)
    half = len(free[::2]) / len(free)
    assert val["val_loop_share"] == 5 / P
    assert val["val_agreement_by_fill_noloop"] == {1: half, 2: half}
    assert val["val_agreement_by_fill"] == {1: (5 + len(free[::2])) / P, 2: (5 + len(free[::2])) / P}
    assert val["val_pred_acceptance_noloop"] == pytest.approx(half, abs=1e-12)  # equal a_F: α = a
    plain = evaluate(head, lambda b: (b, None, targets), [(batch, True)], 2, torch.arange(V), "cpu", reduce=False,
                     loop_ngram=None)
    assert "val_loop_share" not in plain and "val_pred_acceptance_noloop" not in plain
    assert plain["val_pred_acceptance"] == val["val_pred_acceptance"]


def _teacher_targets(z: torch.Tensor, draft_ids: torch.Tensor, temperature: float):
    """TeacherTargets as the teacher builds them from full-vocabulary logits ``z`` ``[N, V]``."""
    from spd_ds.train.loss import TeacherTargets

    return TeacherTargets(z[:, draft_ids], torch.logsumexp(z / temperature, dim=-1), z.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draft_overlap_is_the_acceptance_rate_of_verify_sampling(temperature):
    """Σ min(p_T, q_T) is the probability that the decoders' own verification (verify_sampling) accepts a draft sampled
    from the head over a draft vocabulary smaller than the target's: checked by Monte Carlo, 4 standard errors."""
    from spd_ds.decoding.verify import verify_sampling
    from spd_ds.train.loss import draft_overlap

    g = torch.Generator().manual_seed(3)
    V, draft_ids = 12, torch.tensor([0, 2, 3, 5, 7, 8, 10, 11])
    z = torch.randn(4, V, generator=g) * 2
    s = z[:, draft_ids] + torch.randn(4, len(draft_ids), generator=g)  # a head close to the teacher, not equal
    overlap = draft_overlap(s, _teacher_targets(z, draft_ids, temperature), temperature)
    rng = random.Random(0)
    trials = 20_000
    for t in range(4):
        p = torch.softmax(z[t] / temperature, -1)
        q = torch.zeros(V)
        q[draft_ids] = torch.softmax(s[t] / temperature, -1)
        drafts = torch.multinomial(q, trials, replacement=True, generator=g).tolist()
        rate = sum(verify_sampling(p, q, x, rng.random(), rng.random())[0] for x in drafts) / trials
        expect = float(torch.minimum(p, q).sum())
        assert float(overlap[t]) == pytest.approx(expect, abs=1e-6)
        assert abs(rate - expect) < 4 * math.sqrt(expect * (1 - expect) / trials), (t, rate, expect)


def test_draft_overlap_limits():
    """A head equal to the teacher over the whole vocabulary accepts every sampled draft; over a draft vocabulary it
    accepts the teacher's mass inside it; at a low temperature the overlap is the top-1 agreement."""
    from spd_ds.train.loss import draft_overlap, top1_agreement

    g = torch.Generator().manual_seed(5)
    z = torch.randn(64, 10, generator=g) * 3
    full = torch.arange(10)
    assert torch.allclose(draft_overlap(z, _teacher_targets(z, full, 1.0)), torch.ones(64), atol=1e-6)
    sub = torch.tensor([1, 4, 6])
    t = _teacher_targets(z, sub, 1.0)
    mass = torch.softmax(z, -1)[:, sub].sum(-1)  # q = p renormalised on D: min(p, q) = p there
    assert torch.allclose(draft_overlap(z[:, sub], t), mass, atol=1e-6)

    def spaced():  # logits 0.5 apart: no near-ties at T = 0.01
        return torch.stack([torch.randperm(10, generator=g) for _ in range(64)]).float() * 0.5

    z, s = spaced(), spaced()
    cold = draft_overlap(s, _teacher_targets(z, full, 0.01), 0.01)
    agree = top1_agreement(s, _teacher_targets(z, full, 0.01), full)
    assert 0 < int(agree.sum()) < 64
    assert torch.allclose(cold, agree.float(), atol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        draft_overlap(s, t, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_evaluate_sampled_figures_by_hand(temperature):
    """evaluate's sampled figures are the mean draft_overlap by fill at the given temperature, overall and outside
    loops, fed to the same prediction as the T = 0 agreement; temperature=None leaves them out."""
    from spd_ds.train.loss import draft_overlap

    answer = [5, 6, 7, 8] * 3 + [9, 10, 11, 12, 13, 14, 15, 16]
    ids = torch.tensor([[1, 2] + answer])
    seg = torch.ones_like(ids)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[0, 1:-1] = True
    keep = ~loop_positions(ids, valid, n=4)[valid]
    P, V = int(valid.sum()), 32
    g = torch.Generator().manual_seed(7)
    z = torch.randn(P, V, generator=g) * 2
    targets = _teacher_targets(z, torch.arange(V), temperature)

    class Head(torch.nn.Module):  # another draft distribution at every fill
        def forward(self, feats, segments, valid, fill):
            return z + fill * torch.randn(P, V, generator=torch.Generator().manual_seed(fill))

    head = Head()
    batch = {"input_ids": ids, "segments": seg, "valid": valid}
    val = evaluate(head, lambda b: (b, None, targets), [(batch, True)], 2, torch.arange(V), "cpu", reduce=False,
                   loop_ngram=4, temperature=temperature)
    want = {F: draft_overlap(head(None, None, None, F), targets, temperature) for F in (1, 2)}
    assert val["val_sampling_temperature"] == temperature
    assert 0 < int(keep.sum()) < P
    for F in (1, 2):
        assert val["val_overlap_by_fill_sampled"][F] == pytest.approx(float(want[F].double().mean()), abs=1e-6)
        assert val["val_overlap_by_fill_sampled_noloop"][F] == pytest.approx(
            float(want[F][keep].double().mean()), abs=1e-6)
    pred = predict_acceptance([val["val_overlap_by_fill_sampled"][F] for F in (1, 2)])
    assert val["val_pred_acceptance_sampled"] == pytest.approx(pred.draft_acceptance_rate, abs=1e-12)
    assert val["val_pred_accept_length_sampled"] == pytest.approx(pred.equivalent_accept_length, abs=1e-12)
    assert 0 < val["val_pred_acceptance_sampled"] < 1
    greedy = evaluate(head, lambda b: (b, None, targets), [(batch, True)], 2, torch.arange(V), "cpu", reduce=False,
                      loop_ngram=4)  # the default: no sampled figures
    assert not any("sampled" in k for k in greedy)
    assert greedy["val_pred_acceptance"] == val["val_pred_acceptance"]


def test_best_head_is_picked_by_the_loop_free_prediction(tmp_path, monkeypatch):
    """A head better in loops but worse outside them is not the new best (it would be by the overall figure), except
    against a best restored from a checkpoint that predates the loop-free figures."""
    import functools

    import spd_ds.train.validate as validate
    from spd_ds.train.loss import TeacherTargets

    monkeypatch.setattr(validate, "evaluate", functools.partial(evaluate, reduce=False))  # one process, no group
    answer = [5, 6, 7, 8, 9, 10, 11, 12, 13] * 3 + list(range(20, 32))
    ids = torch.tensor([[1, 2] + answer])
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[0, 1:-1] = True
    batch = {"input_ids": ids, "segments": torch.ones_like(ids), "valid": valid}
    loop = loop_positions(ids, valid)[valid]
    P, V, nxt = len(loop), 64, ids[0, 2:]
    targets = TeacherTargets(torch.zeros(P, V), torch.zeros(P), nxt)
    free = (~loop).nonzero().flatten()
    a_right = torch.zeros(P, dtype=torch.bool)
    a_right[free[:len(free) * 2 // 3]] = True  # outside loops 2/3, in loops nothing
    b_right = loop.clone()
    b_right[free[:len(free) // 2]] = True  # in loops everything, outside loops 1/2

    class Planner:
        def collate(self, rows):
            return batch

    def head(right):
        h = _ScriptedHead(nxt, right, V)
        h.head = type("H", (), {"draft_ids": torch.arange(V)})()
        return h

    v = validate.Validator(Planner(), [([[0]], True)], 2, 1, tmp_path, is_logger=False)
    teacher = lambda b: (b, None, targets)  # noqa: E731
    first = v.run(head(a_right), teacher, "cpu", step=1)
    second = v.run(head(b_right), teacher, "cpu", step=2)
    assert first["val_best"] and not second["val_best"]
    assert second["val_pred_accept_length"] > first["val_pred_accept_length"]  # better overall, worse loop-free
    assert second["val_pred_accept_length_noloop"] < first["val_pred_accept_length_noloop"]
    assert v.best["step"] == 1
    old = {k: x for k, x in v.best.items() if "noloop" not in k and k != "val_loop_share"}
    v.load_state({"best": old, "last": old})  # a checkpoint written before the loop-free figures
    assert v.run(head(b_right), teacher, "cpu", step=3)["val_best"] and v.best["step"] == 3


def test_validator_collates_and_finds_loops_once_with_the_same_figures(tmp_path, monkeypatch):
    """The held-out micro-batches are fixed: the Validator collates them and runs the (host) loop test once, at its
    first run; later runs give exactly the figures of an uncached evaluation."""
    import functools

    import spd_ds.train.validate as validate
    from spd_ds.train.loss import TeacherTargets

    monkeypatch.setattr(validate, "evaluate", functools.partial(evaluate, reduce=False))  # one process, no group
    calls = {"collate": 0, "loops": 0}

    def counted_loops(*args, **kwargs):
        calls["loops"] += 1
        return loop_positions(*args, **kwargs)

    monkeypatch.setattr(validate, "loop_positions", counted_loops)
    answer = [5, 6, 7, 8, 9, 10, 11, 12, 13] * 3 + list(range(20, 32))
    ids = torch.tensor([[1, 2] + answer])
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[0, 1:-1] = True
    batch = {"input_ids": ids, "segments": torch.ones_like(ids), "valid": valid}
    P, V, nxt = int(valid.sum()), 64, ids[0, 2:]
    targets = TeacherTargets(torch.zeros(P, V), torch.zeros(P), nxt)
    right = torch.arange(P) % 3 != 0

    class Planner:
        def collate(self, rows):
            calls["collate"] += 1
            return dict(batch)

    h = _ScriptedHead(nxt, right, V)
    h.head = type("H", (), {"draft_ids": torch.arange(V)})()
    v = validate.Validator(Planner(), [([[0]], True), ([[0]], True)], 2, 1, tmp_path, is_logger=False)
    teacher = lambda b: (b, None, targets)  # noqa: E731
    runs = [v.run(h, teacher, "cpu", step=s) for s in (1, 2, 3)]
    assert calls == {"collate": 2, "loops": 2}  # two micro-batches, once each over three runs
    plain = evaluate(h, teacher, [(batch, True), (batch, True)], 2, torch.arange(V), "cpu", reduce=False,
                     temperature=1.0)  # the Validator's: train.kd_temperature's default
    for r in runs:
        assert {k: x for k, x in r.items() if k not in ("val_s", "val_best")} == \
            {k: x for k, x in plain.items() if k != "val_s"}
    assert runs[0]["val_positions"] == 2 * P and 0 < runs[0]["val_loop_share"] < 1


# ---------------------------------------------------------------------------------------------------- the split
def test_held_out_split_is_deterministic_by_content():
    recs = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(2000)]
    train, held = split_held_out(recs, 0.02, seed=42)
    assert len(train) + len(held) == 2000 and 20 <= len(held) <= 65
    assert split_held_out(list(reversed(recs)), 0.02, 42)[1] == list(reversed(held))  # order-free, by content
    assert split_held_out(recs, 0.02, 43)[1] != held  # the seed matters
    assert split_held_out(recs, 0.0, 42) == (recs, [])
    assert len(split_held_out(recs[:3], 0.001, 42)[1]) == 1  # at least one record when the fraction is > 0
    with pytest.raises(ValueError):
        split_held_out(recs[:1], 0.5, 42)


def test_held_out_batches_give_every_rank_the_same_count():
    lengths = [30, 50, 20, 90, 10, 60, 70]
    all_rows = []
    for world in (1, 2, 3, 5):
        per = [held_out_batches(lengths, 100, 2, True, r, world) for r in range(world)]
        assert len({len(p) for p in per}) == 1
        counted = [rows for p in per for rows, c in p if c]
        examples = sorted(i for rows in counted for row in rows for i in row)
        assert examples == list(range(len(lengths)))  # every example exactly once over the counted batches
        assert all(len(rows) == 2 for p in per for rows, _ in p)  # padded with empty rows
        all_rows.append(sorted(map(str, counted)))
    assert all(r == all_rows[0] for r in all_rows)  # the same batches whatever the world size
    assert len([1 for rows, c in held_out_batches(lengths, 100, 2, True, 0, 1, max_batches=1) if c]) == 1


def test_best_head_is_saved_in_the_save_dtype_without_touching_the_module(tiny, tmp_path):
    from spd_ds.head import SpeculationHead

    arch, part, *_ = tiny
    head = SpeculationHead(arch, part, 1)
    head.save(tmp_path / "bf16", dtype=torch.bfloat16)
    assert next(head.parameters()).dtype == torch.float32
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "bf16" / "head.safetensors"))
    assert stored["aggr.0.weight"].dtype == torch.bfloat16 and stored["draft_mask"].dtype == torch.bool
    assert torch.equal(stored["aggr.0.weight"], head.state_dict()["aggr.0.weight"].bfloat16())
    assert torch.equal(SpeculationHead.load(tmp_path / "bf16", arch).draft_ids, head.draft_ids)


def test_a_crash_while_the_best_head_is_replaced_leaves_it_recoverable(tmp_path, monkeypatch):
    """best_head/ used to be removed before its successor was renamed into place: a crash between the two left the run
    without a best head. Now the previous one waits as best_head.old/ until the new one is in place; the crash state
    (best_head/ missing, best_head.old/ and a best_head.tmp/) is put back by recover_best_head (train does it at its
    start, so --resume restores it) and reading it names the backup."""
    from pathlib import Path

    import spd_ds.train.validate as validate
    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch
    from spd_ds.partition import StagePartition

    arch = TargetArch(make_tiny_model(tmp_path, "llama", num_layers=4))
    part = StagePartition.build(4, 2)
    torch.manual_seed(0)
    first = SpeculationHead(arch, part, 1)
    torch.manual_seed(1)
    second = SpeculationHead(arch, part, 1)
    run = tmp_path / "run"
    v = validate.Validator(None, [], 2, 1, run, is_logger=True)
    v.best = {"step": 4}
    v._save_best(first)
    best, backup, tmp = run / "best_head", run / "best_head.old", run / "best_head.tmp"
    rename = Path.rename

    def crash_before_the_new_head_is_in_place(self, target):
        if self.name == "best_head.tmp" and Path(target).name == "best_head":
            raise OSError("killed")
        return rename(self, target)

    v.best = {"step": 8}
    with monkeypatch.context() as m:
        m.setattr(Path, "rename", crash_before_the_new_head_is_in_place)
        with pytest.raises(OSError, match="killed"):
            v._save_best(second)
    assert not best.exists() and (tmp / "head.safetensors").is_file()  # the crash state
    assert json.loads((backup / "best.json").read_text())["step"] == 4  # the previous best is kept under a name
    with pytest.raises(FileNotFoundError) as e:
        SpeculationHead.read_config(best)
    assert f"{backup} holds the head it replaced" in str(e.value) and "--resume puts it back" in str(e.value)

    said = validate.recover_best_head(run)
    assert said.startswith(f"restored {best} from {backup}") and "\n" not in said
    assert sorted(p.name for p in run.iterdir()) == ["best_head"]  # no backup or half-written head left over
    assert json.loads((best / "best.json").read_text())["step"] == 4
    restored = SpeculationHead.load(best, arch).state_dict()
    assert all(torch.equal(t, restored[k]) for k, t in first.state_dict().items())
    assert validate.recover_best_head(run) is None  # in place: nothing to do

    v._save_best(second)  # the next replacement goes through and leaves the new head alone
    assert sorted(p.name for p in run.iterdir()) == ["best_head"]
    assert json.loads((best / "best.json").read_text())["step"] == 8
    restored = SpeculationHead.load(best, arch).state_dict()
    assert all(torch.equal(t, restored[k]) for k, t in second.state_dict().items())
    shutil.copytree(best, backup)  # a crash after the new head was in place: the backup is a leftover
    assert validate.recover_best_head(run) is None and sorted(p.name for p in run.iterdir()) == ["best_head"]
