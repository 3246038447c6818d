"""Warpers, verification rules, and the T > 0 lossless property (chi-square against exact target probabilities)."""


import pytest
import torch
from scipy import stats

from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter, oracle_reference
from spd_ds.decoding.reference import SPDReferenceDecoder, prefill
from spd_ds.decoding.sampling import SamplingParams, keyed_uniform, logits_to_probs, sample_from_probs, warp_logits
from spd_ds.decoding.verify import verify_greedy, verify_sampling
from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model


def test_keyed_uniform_is_deterministic_and_uniform():
    u = [keyed_uniform(3, p, 2) for p in range(20000)]
    assert u == [keyed_uniform(3, p, 2) for p in range(20000)]
    assert u[:50] != [keyed_uniform(4, p, 2) for p in range(50)]
    assert stats.kstest(u, "uniform").pvalue > 1e-3


def test_warpers():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = logits_to_probs(logits, SamplingParams(1.0, top_p=0.7))  # softmax = .64 .24 ...: keep 2 tokens
    assert (p > 0).sum() == 2
    p = logits_to_probs(logits, SamplingParams(1.0, top_p=0.5))
    assert (p > 0).sum() == 1
    assert torch.isinf(warp_logits(logits, SamplingParams(0.5, top_k=1))[1:]).all()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=0.0)


def test_sample_from_probs_never_picks_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    got = {sample_from_probs(probs, u) for u in [0.0, 0.1, 0.4999, 0.5, 0.9, 0.999999999]}
    assert got == {1, 3}


def test_verify_rules():
    assert verify_greedy(torch.tensor([0.1, 2.0, 0.3]), 1) == (True, 1)
    assert verify_greedy(torch.tensor([0.1, 2.0, 0.3]), 2) == (False, 1)
    p, q = torch.tensor([0.2, 0.8, 0.0]), torch.tensor([0.5, 0.5, 0.0])
    assert verify_sampling(p, q, 1, 0.99, 0.0) == (True, 1)  # p >= q: always accepted
    assert verify_sampling(p, q, 0, 0.39, 0.0) == (True, 0)  # accept iff u <= 0.2/0.5
    assert verify_sampling(p, q, 0, 0.41, 0.0) == (False, 1)  # residual is all on token 1


def test_speculative_sampling_rule_is_exact():
    # the emitted-token distribution of one verification equals p, by exhaustive integration over u
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    q = torch.softmax(torch.randn(6) * 2, 0)
    out = torch.zeros(6, dtype=torch.float64)
    grid = 400
    for x in range(6):
        for i in range(grid):
            for j in range(grid // 8):
                ok, t = verify_sampling(p, q, x, (i + 0.5) / grid, (j + 0.5) / (grid // 8))
                out[t] += float(q[x]) / (grid * (grid // 8))
    torch.testing.assert_close(out, p.double(), atol=5e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind,vary,warp,attn,stages", [
    ("head", "seed", "T0.9-top5", "sdpa", 3), ("oracle_mix", "seed", "T0.9-top5", "sdpa", 3),
    ("head", "request", "T0.9-top5", "sdpa", 3), ("widened_head", "seed", "T0.9-top5", "sdpa", 3),
    ("head", "seed", "T1", "sdpa", 3), ("oracle_ar", "seed", "T1", "sdpa", 3), ("head", "seed", "T1", "eager", 3),
    ("head", "seed", "T1", "sdpa", 1)])
def test_spd_sampling_distribution_equals_target(tiny_root, drafter_kind, vary, warp, attn, stages):
    """Chi-square: joint distribution of the 2nd and 3rd new tokens under SPD (n = ``stages``: 3, and the one-stage
    pipeline, where each draft is verified one cycle after it is made) vs the target's exact one, over
    seeds, or over the requests of one run (one seed: the prompts of a run). ``widened_head``: a target-tied head
    made for 3 ids and widened to every id by ``set_draft_vocab``, as the shipped heads are. ``warp``: T = 0.9 with
    top-k 5 (the warpers on), or plain T = 1 (the benchmarks' sampled setting). ``oracle_ar``: the oracle drafter
    at alpha 1 on the reference the product makes (``oracle_reference``: the target's greedy continuation; a
    continuation sampled with the generation's own uniforms would propose the very token a rejection resamples, and
    this test fails). ``attn``: ``model.attn_implementation`` of the stages and the head's tower (eager takes an
    additive mask: ``spd_ds.models.masks``)."""
    V = 6
    arch = TargetArch(make_tiny_model(tiny_root, "llama", 3, seed=2, vocab_size=V), attn)
    part = StagePartition.build(3, stages)
    target = Target(arch, part, torch.float32, "cpu")
    torch.manual_seed(0)
    head = SpeculationHead(arch, part)
    if drafter_kind == "widened_head":
        head = SpeculationHead(arch, part, draft_token_ids=[0, 2, 4], lm_head_from_target=True)
        head.set_draft_vocab(None)
        assert head.draft_vocab_size == V
    with torch.no_grad():  # make the untrained head's q sharper, so acceptances and rejections both happen
        head.lm_head.weight.mul_(3.0)
    params = dict(temperature=0.9, top_k=5) if warp == "T0.9-top5" else dict(temperature=1.0)
    prompt = [1, 2]

    # exact joint law of (x1, x2, x3) by enumeration with the target itself
    caches = target.new_caches(16)

    def probs_after(seq):
        for c in caches:
            c.reset()
        logits, _ = prefill(target, caches, seq)
        return logits_to_probs(logits, SamplingParams(**params)).double()

    p1 = probs_after(prompt)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = probs_after(prompt + [a])
        for b in range(V):
            if p2[b] == 0:
                continue
            joint[b] += p1[a] * p2[b] * probs_after(prompt + [a, b])
    # joint[b, c] = P(x2 = b, x3 = c)

    counts = torch.zeros(V, V)
    draws = 1200
    base = HeadDrafter(head, 16, torch.float32, "cpu")
    decoder = SPDReferenceDecoder(target, base, max_len=16)
    for seed in range(draws):
        decoder.sampling = (SamplingParams(seed=seed, **params) if vary == "seed"
                            else SamplingParams(seed=3, request=seed, **params))
        if drafter_kind == "oracle_mix":  # deterministic proposals mixed with the head's sampled ones
            decoder.drafter = OracleDrafter(prompt + [seed % V] * 8, 0.5, base=base, seed=seed)
        elif drafter_kind == "oracle_ar":
            reference = oracle_reference(target, prompt, 3 + part.num_stages, decoder.sampling, [], 16)
            decoder.drafter = OracleDrafter(reference, 1.0, vocab_size=V, seed=seed)
        toks = decoder.generate(prompt, 3).tokens
        counts[toks[1], toks[2]] += 1
    exp = joint.flatten() * draws
    keep = exp >= 5
    obs = counts.flatten()[keep].double()
    e = exp[keep]
    e = e * obs.sum() / e.sum()
    chi2, pval = stats.chisquare(obs.numpy(), e.numpy())
    assert pval > 1e-3, (chi2, pval)
    # and the other direction: a biased decoder (always taking the draft) would fail this test
    assert (counts.flatten()[~keep].sum() / draws) < 0.05


def test_sampling_is_seed_deterministic(tiny_root):
    arch = TargetArch(make_tiny_model(tiny_root, "qwen3", 4))
    part = StagePartition.build(4, 2)
    target = Target(arch, part, torch.float32, "cpu")
    head = SpeculationHead(arch, part)
    sp = SamplingParams(1.0, top_p=0.9, seed=11)
    a = SPDReferenceDecoder(target, HeadDrafter(head, 64, torch.float32, "cpu"), sp, max_len=64).generate([1, 2, 3], 12)
    b = SPDReferenceDecoder(target, HeadDrafter(head, 64, torch.float32, "cpu"), sp, max_len=64).generate([1, 2, 3], 12)
    assert a.tokens == b.tokens


def test_requests_key_independent_uniforms():
    """Equal positions of different requests (prompts of one run) get different, independent uniforms."""
    seed = 5
    u0 = [keyed_uniform(seed, p, 2, request=0) for p in range(4000)]
    u1 = [keyed_uniform(seed, p, 2, request=1) for p in range(4000)]
    assert all(a != b for a, b in zip(u0, u1))
    assert stats.pearsonr(u0, u1)[0] < 0.05
    grid = [keyed_uniform(seed, 7, 3, request=r) for r in range(20000)]  # one position over many requests
    assert stats.kstest(grid, "uniform").pvalue > 1e-3
    sp = SamplingParams(1.0, seed=seed).for_request(1)
    assert sp.request == 1 and sp.seed == seed and sp.uniform(9, 2) == keyed_uniform(seed, 9, 2, 1)
    assert SamplingParams(1.0, seed=seed).uniform(9, 2) != sp.uniform(9, 2)


def test_two_equal_length_prompts_draw_different_uniforms(tiny_root, monkeypatch):
    """launch/infer.py's reference path at T > 0: two prompts of equal length are requests 0 and 1, so the same
    (position, decision) draws different uniforms for each, and each prompt's tokens equal a decoder keyed alone."""
    from spd_ds.builder import build_arch
    from spd_ds.commands import infer
    from spd_ds.config import load_config

    model = make_tiny_model(tiny_root, "qwen3", 4)
    cfg = load_config(None, [f"model.name={model}", "decoding.temperature=1.0", "decoding.seed=4",
                             "decoding.max_new_tokens=8", "decoding.max_length=64", "decoding.eos_token_ids=[]"])
    arch = build_arch(cfg)
    prompts = [[5, 6, 7], [9, 1, 4]]
    drawn: list[tuple[int, int, int, float]] = []
    original = SamplingParams.uniform

    def spy(self, position, stream):
        u = original(self, position, stream)
        drawn.append((self.request, position, stream, u))
        return u

    monkeypatch.setattr(SamplingParams, "uniform", spy)
    results, _ = infer.run_reference(cfg, arch, None, prompts)
    by_req = {r: {(p, s): u for q, p, s, u in drawn if q == r} for r in (0, 1)}
    common = set(by_req[0]) & set(by_req[1])
    assert common and all(by_req[0][k] != by_req[1][k] for k in common)
    part = StagePartition.build(4, 2)
    target = Target(arch, part, torch.float32, "cpu")
    for i, p in enumerate(prompts):
        torch.manual_seed(cfg.train.seed)  # the untrained head as builder.build_head makes it
        head = SpeculationHead(arch, part)
        dec = SPDReferenceDecoder(target, HeadDrafter(head, 64, torch.float32, "cpu"),
                                  SamplingParams(1.0, seed=4, request=i), max_len=64)
        assert dec.generate(p, 8).tokens == results[i].tokens
