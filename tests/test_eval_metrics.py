"""Metrics arithmetic: a hand-made trace, pooling, speedups, and the cycle counts of real decoder traces against
their closed forms (oracle alpha = 1: K = N + n - 2; every draft rejected: K = n (N - 1))."""

from __future__ import annotations

import pytest
import torch

from spd_ds.decoding.metrics import SPDMetrics, pooled_decode_tok_s
from spd_ds.decoding.reference import GenerationResult, SPDReferenceDecoder
from spd_ds.eval.report import metric_block
from tests.test_eval_random_weights import make_random_shape

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)


def trace() -> SPDMetrics:
    """n = 3: 10 tokens (prefill token included) in 12 cycles; 9 drafts verified, 6 accepted, 3 rollbacks."""
    return SPDMetrics(num_stages=3, num_new_tokens=10, num_cycles=12, num_drafts=9, num_accepted_tokens=6,
                      num_rollbacks=3, drafts_by_fill=[0, 3, 2, 4], accepted_by_fill=[0, 1, 2, 3], prefill_s=0.5,
                      decode_s=1.8, stage_forward_s=[0.3, 0.3, 0.6], head_s=0.24, verify_s=0.12, comm_s=0.06,
                      control_s=0.18)


def test_hand_made_trace():
    m = trace()
    assert m.draft_acceptance_rate == pytest.approx(6 / 9)
    assert m.tokens_per_cycle == pytest.approx(10 / 12)
    assert m.equivalent_accept_length == pytest.approx(3 * 10 / 12)
    assert m.decode_tok_s == pytest.approx(9 / 1.8)  # the prefill token is not a decode token
    by = m.acceptance_by_depth()
    assert [r["fill"] for r in by] == [1, 2, 3]
    assert [r["rate"] for r in by] == pytest.approx([1 / 3, 1.0, 3 / 4])
    split = m.cycle_time_split_ms()
    assert split["stage_forward"] == pytest.approx([25.0, 25.0, 50.0])
    assert (split["head"], split["verify"], split["comm"], split["control"], split["cycle"]) == pytest.approx(
        (20.0, 10.0, 5.0, 15.0, 150.0))
    empty = SPDMetrics(num_stages=2)
    assert empty.acceptance_by_depth()[0]["rate"] is None and empty.cycle_time_split_ms()["cycle"] == 0.0


def test_observations_fill_the_counters():
    """The hand-made trace, made by the observe_* calls every decoder uses (no decoder writes a counter itself)."""
    m = SPDMetrics(num_stages=3)
    m.observe_prefill(0.5)
    m.observe_cycle(11)
    m.observe_cycle()
    for fill, ok in [(1, True), (1, False), (1, False), (2, True), (2, True), (3, True), (3, True), (3, True),
                     (3, False)]:
        m.observe_verify(fill, ok)
    for _ in range(3):
        m.observe_rollback()
    for s, t in enumerate([0.3, 0.3, 0.6]):
        m.observe_time("stage_forward", t, stage=s)
    m.observe_time("head", 0.24)
    m.observe_time("verify", 0.12)
    m.observe_time("comm", 0.06)
    m.close(10, 1.8, split_stages=range(3))
    want = trace()
    for k in ("num_new_tokens", "num_cycles", "num_drafts", "num_accepted_tokens", "num_rollbacks", "drafts_by_fill",
              "accepted_by_fill", "prefill_s", "decode_s", "stage_forward_s", "head_s", "verify_s", "comm_s"):
        assert getattr(m, k) == pytest.approx(getattr(want, k)), k
    assert m.control_s == pytest.approx(1.8 - 0.24 - 0.12 - 0.06 - 1.2)
    m.close(10, 1.8, split_stages=[0])  # a process that timed stage 0 only: the others' time is not its own
    assert m.control_s == pytest.approx(1.8 - 0.24 - 0.12 - 0.06 - 0.3)
    ar = SPDMetrics()
    ar.close(5, 1.0)  # AR baselines: no split, control_s stays
    assert (ar.num_new_tokens, ar.decode_s, ar.control_s) == (5, 1.0, 0.0)
    with pytest.raises(ValueError, match="unknown time split"):
        m.observe_time("verify", 0.1, stage=0)
    with pytest.raises(ValueError, match="unknown time split"):
        m.observe_time("prefill", 0.1)


def test_pooling_sums_before_dividing():
    a = trace()
    b = SPDMetrics(num_stages=3, num_new_tokens=31, num_cycles=33, num_drafts=30, num_accepted_tokens=30,
                   drafts_by_fill=[0, 1, 0, 29], accepted_by_fill=[0, 1, 0, 29], decode_s=3.0,
                   stage_forward_s=[0.1, 0.1, 0.1])
    p = SPDMetrics.pooled([a, b])
    assert (p.num_new_tokens, p.num_cycles, p.num_drafts, p.num_accepted_tokens) == (41, 45, 39, 36)
    assert p.equivalent_accept_length == pytest.approx(3 * 41 / 45)
    assert pooled_decode_tok_s([a, b]) == pytest.approx((9 + 30) / 4.8)  # each prompt's prefill token excluded
    assert p.drafts_by_fill == [0, 4, 2, 33]
    assert SPDMetrics.pooled([], 4).num_stages == 4
    with pytest.raises(ValueError):
        SPDMetrics.pooled([a, SPDMetrics(num_stages=2)])
    blk = metric_block([a, b], True, 3, weight_bytes=10**9, devices=3, hbm_gbps=100.0)
    assert blk["num_prompts"] == 2 and blk["decode_tok_s"] == pytest.approx(39 / 4.8)
    assert blk["mean_decode_tok_s"] == pytest.approx((9 / 1.8 + 30 / 3.0) / 2)
    assert blk["achieved_gbps"] == pytest.approx(39 / 4.8)  # 1 GB per token
    assert blk["hbm_fraction"] == pytest.approx(39 / 4.8 / 300)
    ar = metric_block([SPDMetrics(num_new_tokens=5, num_cycles=4, decode_s=1.0)], False, 1)
    assert ar["equivalent_accept_length"] is None and ar["acceptance_by_depth"] is None and ar["decode_tok_s"] == 4


def test_metric_block_rates_need_drafts_and_cycles():
    """A drafting method's rates are None (not 0) where nothing was verified or no cycle ran; counts stay 0."""
    prefill_only = SPDMetrics(num_stages=2, num_new_tokens=1, prefill_s=0.1)
    b = metric_block([prefill_only, prefill_only], spd=True, num_stages=2)
    assert (b["num_drafts"], b["num_accepted_tokens"], b["num_cycles"]) == (0, 0, 0)
    assert b["draft_acceptance_rate"] is None and b["tokens_per_cycle"] is None
    assert b["equivalent_accept_length"] is None
    full = metric_block([trace()], spd=True, num_stages=3)
    assert full["draft_acceptance_rate"] == pytest.approx(6 / 9) and full["tokens_per_cycle"] == pytest.approx(10 / 12)
    no_accept = metric_block([SPDMetrics(num_stages=2, num_new_tokens=3, num_cycles=4, num_drafts=2, num_rollbacks=2)],
                             spd=True, num_stages=2)
    assert no_accept["draft_acceptance_rate"] == 0.0 and no_accept["equivalent_accept_length"] == 1.5  # measured 0


def test_summary_speedup_on_common_prompts(tmp_path):
    """speedup_vs_ar pools the SPD method over the prompts the baseline ran, not over all of them."""
    from spd_ds.config import load_config
    from spd_ds.eval.report import summarize
    from spd_ds.eval.runner import EvalPrompt, EvalRun, MethodRun
    from spd_ds.models.adapter import TargetArch
    from spd_ds.partition import StagePartition

    arch = TargetArch(make_random_shape(tmp_path))
    cfg = load_config(None, [f"model.name={arch.model_dir}", "eval.prompt_sets=[random]"])
    prompts = [EvalPrompt("random", str(i), [1, 2, 3]) for i in range(2)]

    def res(n, k, s):
        return GenerationResult([0] * n, "length", SPDMetrics(num_stages=2, num_new_tokens=n, num_cycles=k, decode_s=s))

    spd = MethodRun("spd", "spd", 2, "", results={0: res(11, 6, 1.0), 1: res(11, 6, 5.0)})
    ar = MethodRun("ar", "baseline", 1, "", results={0: GenerationResult([0] * 11, "length", SPDMetrics(
        num_new_tokens=11, num_cycles=10, decode_s=2.0))})
    run = EvalRun(cfg, "reference", arch, StagePartition.build(4, 2), prompts, {"spd": spd, "ar": ar})
    s = summarize(run, weight_bytes=1000)
    assert s["results"]["spd"]["overall"]["speedup_vs_ar"]["ar"] == pytest.approx((10 / 1.0) / (10 / 2.0))
    assert s["results"]["spd"]["overall"]["decode_tok_s"] == pytest.approx(20 / 6.0)
    assert s["results"]["ar"]["overall"]["speedup_vs_ar"] == {}


@pytest.mark.parametrize("n", [2, 3])
def test_real_traces_match_closed_forms(tmp_path, n):
    from spd_ds.decoding.ar import ARDecoder
    from spd_ds.decoding.drafters import OracleDrafter
    from spd_ds.models.adapter import Target, TargetArch
    from spd_ds.partition import StagePartition

    arch = TargetArch(make_random_shape(tmp_path, num_hidden_layers=6))
    target = Target(arch, StagePartition.build(6, n), torch.float32, "cpu")
    prompt, N = [4, 8, 15, 16, 23, 42], 20
    ref = list(prompt) + ARDecoder(target, eos_token_ids=[], max_len=128).generate(prompt, N + n).tokens
    for alpha, cycles, accepted in [(1.0, N + n - 2, N - 1), (0.0, n * (N - 1), 0)]:
        dec = SPDReferenceDecoder(target, OracleDrafter(ref, alpha, vocab_size=arch.vocab_size), eos_token_ids=[],
                                  max_len=128)
        m = dec.generate(prompt, N).metrics
        assert (m.num_new_tokens, m.num_cycles, m.num_drafts, m.num_accepted_tokens) == (N, cycles, N - 1, accepted)
        assert m.equivalent_accept_length == pytest.approx(n * N / cycles)
        assert sum(m.drafts_by_fill) == N - 1
        if alpha == 0.0:  # every rejection restarts the pipeline: every draft is made at fill 1
            assert m.drafts_by_fill[1] == N - 1
        else:  # full pipeline after the first n - 1 drafts
            assert m.accepted_by_fill[n] == N - 1 - (n - 1)
