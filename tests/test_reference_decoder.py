"""The reference decoder on tiny random models: exactness against AR, rollback, EOS, lengths, bad prompts."""

import pytest
import torch

from spd_ds.decoding.ar import ARDecoder
from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter
from spd_ds.decoding.reference import PromptError, SPDReferenceDecoder
from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model

L = 6


@pytest.fixture(scope="module")
def arch(tiny_root):
    return TargetArch(make_tiny_model(tiny_root, "qwen3", L))


def build(arch, n, anchors=None):
    part = StagePartition.build(L, n, anchors=anchors)
    target = Target(arch, part, torch.float32, "cpu")
    torch.manual_seed(n)
    head = SpeculationHead(arch, part, num_layers=1)
    return target, head


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9, 1.0])
def test_greedy_spd_equals_ar(arch, n, alpha):
    target, head = build(arch, n)
    prompt = [3, 14, 15, 92, 65]
    ar = ARDecoder(target).generate(prompt, 30)
    drafter = OracleDrafter(prompt + ar.tokens, alpha, base=HeadDrafter(head, 256, torch.float32, "cpu"), seed=n)
    res = SPDReferenceDecoder(target, drafter, max_len=256).generate(prompt, 30)
    assert res.tokens == ar.tokens and res.finish_reason == "length"
    m = res.metrics
    assert m.num_new_tokens == 30 and m.num_drafts == 29  # every returned token after the first was a verification
    assert m.num_accepted_tokens + m.num_rollbacks == m.num_drafts
    assert sum(m.drafts_by_fill) == m.num_drafts and sum(m.accepted_by_fill) == m.num_accepted_tokens
    if alpha == 1.0:  # all drafts accepted: one verification per cycle after the pipeline fills
        assert m.num_rollbacks == 0 and m.num_cycles == 29 + (n - 1)
    if alpha == 0.0 and n > 1:
        assert m.num_accepted_tokens <= 2  # the untrained head rarely matches


def test_untrained_head_only(arch):
    target, head = build(arch, 3)
    prompt = [1]  # a one-token prompt is fine (the reference needs s0 >= n-1)
    ar = ARDecoder(target).generate(prompt, 20)
    res = SPDReferenceDecoder(target, HeadDrafter(head, 128, torch.float32, "cpu"), max_len=128).generate(prompt, 20)
    assert res.tokens == ar.tokens


@pytest.mark.parametrize("n", [2, 3, 5])
def test_eos_accepted_while_drafts_in_flight(arch, n):
    target, head = build(arch, n)
    prompt = [7, 8, 9]
    ar = ARDecoder(target).generate(prompt, 25).tokens
    eos = ar[12]  # pretend the 13th token is EOS
    first = ar.index(eos)
    drafter = OracleDrafter(prompt + ar, 1.0, vocab_size=arch.vocab_size)
    res = SPDReferenceDecoder(target, drafter, eos_token_ids=[eos, 10**6], max_len=128).generate(prompt, 25)
    assert res.tokens == ar[: first + 1] and res.finish_reason == "eos"
    # drafts past the EOS were in the pipeline and were not returned
    assert res.metrics.num_new_tokens == first + 1
    assert ARDecoder(target, eos_token_ids=[eos]).generate(prompt, 25).tokens == res.tokens


def test_eos_as_replacement_and_as_first_token(arch):
    target, head = build(arch, 3)
    prompt = [7, 8, 9]
    ar = ARDecoder(target).generate(prompt, 10).tokens
    wrong = OracleDrafter(prompt + ar, 0.0, vocab_size=arch.vocab_size)  # every draft rejected
    res = SPDReferenceDecoder(target, wrong, eos_token_ids=[ar[4]], max_len=64).generate(prompt, 10)
    assert res.tokens == ar[: ar.index(ar[4]) + 1] and res.finish_reason == "eos"
    res = SPDReferenceDecoder(target, wrong, eos_token_ids=[ar[0]], max_len=64).generate(prompt, 10)
    assert res.tokens == [ar[0]] and res.finish_reason == "eos"


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_max_new_tokens_exact(arch, max_new):
    target, head = build(arch, 3)
    prompt = [4, 5]
    ar = ARDecoder(target).generate(prompt, 10).tokens
    res = SPDReferenceDecoder(target, OracleDrafter([4, 5] + ar, 1.0, vocab_size=96),
                              max_len=64).generate(prompt, max_new)
    assert res.tokens == ar[:max_new]


@pytest.mark.parametrize("n", [2, 4])
def test_oracle_reference_fits_a_context_the_generation_fills_exactly(arch, n):
    """``decoding.max_length`` = prompt + max_new_tokens + n (the least SPD takes): the oracle's reference AR, which
    would make max_new + n tokens, is cut to the positions it has, and the generation still equals AR."""
    from spd_ds.decoding.drafters import oracle_reference
    from spd_ds.decoding.sampling import SamplingParams

    target, head = build(arch, n)
    prompt, max_new = [3, 14, 15, 92, 65], 12
    max_len = len(prompt) + max_new + n
    want = ARDecoder(target, max_len=max_len).generate(prompt, max_new).tokens
    reference = oracle_reference(target, prompt, max_new + n, SamplingParams(), [], max_len)
    assert reference[:len(prompt) + max_new] == prompt + want and len(reference) == max_len - 1
    drafter = OracleDrafter(reference, 1.0, vocab_size=arch.vocab_size)
    res = SPDReferenceDecoder(target, drafter, max_len=max_len).generate(prompt, max_new)
    assert res.tokens == want and res.metrics.num_rollbacks == 0


def test_non_injective_anchor_map(arch):
    # n=6 with 3 anchors: several depths share an aggregation type
    target, head = build(arch, 6, anchors=[0, 3, 6])
    assert target.partition.depth_to_type == (0, 0, 0, 1, 1, 1, 2)
    prompt = [11, 12, 13]
    ar = ARDecoder(target).generate(prompt, 20)
    drafter = OracleDrafter(prompt + ar.tokens, 0.6, base=HeadDrafter(head, 128, torch.float32, "cpu"))
    assert SPDReferenceDecoder(target, drafter, max_len=128).generate(prompt, 20).tokens == ar.tokens


def test_bad_prompts(arch):
    target, head = build(arch, 2)
    dec = SPDReferenceDecoder(target, HeadDrafter(head, 64, torch.float32, "cpu"), max_len=64)
    with pytest.raises(PromptError, match="empty"):
        dec.generate([], 5)
    with pytest.raises(PromptError, match="exceeds the context of 64 positions"):
        dec.generate(list(range(60)), 5)
    with pytest.raises(PromptError, match="max_new_tokens"):
        dec.generate([1], 0)
    from spd_ds.decoding.cycle import check_prompt

    # a context the model's maximum sets (decoding.max_length was capped to it): raising max_length is no advice
    with pytest.raises(PromptError, match="exceeds the model's maximum context of 64 positions") as e:
        check_prompt(list(range(60)), 5, 64, 2, model_max=64)
    assert "decoding.max_length" not in str(e.value)
    with pytest.raises(PromptError, match="raise decoding.max_length"):
        check_prompt(list(range(60)), 5, 64, 2, model_max=8192)


# ---------------------------------------------------------------------------------------------------- Qwen3.5
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_5"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_hybrid_greedy_spd_equals_hf_generate_and_rollbacks_are_exact(tiny_root, family, n):
    """Qwen3.5 targets (dense, MoE, the text model of a composite checkpoint): greedy SPD with oracle drafts at
    alpha = 0.6 gives transformers' greedy ``generate`` token for token, and after every rollback each stage's
    linear-attention states equal those recomputed from scratch for the kept prefix (bit for bit, fp32)."""
    from transformers import AutoModelForCausalLM

    from spd_ds.models.linear_cache import HybridStageCache
    from tests.test_linear_cache import assert_same_states, fresh_states

    path = make_tiny_model(tiny_root, family, 8)
    arch = TargetArch(path)
    part = StagePartition.build(8, n)
    target = Target(arch, part, torch.float32, "cpu")
    torch.manual_seed(n)
    head = SpeculationHead(arch, part, num_layers=1)
    prompt = [3, 14, 15, 92, 65]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    drafter = OracleDrafter(prompt + want, 0.6, base=HeadDrafter(head, 256, torch.float32, "cpu"), seed=n)
    dec = SPDReferenceDecoder(target, drafter, max_len=256)
    assert any(isinstance(c, HybridStageCache) for c in dec.caches)
    checked = []

    def checking_crop(cache, crop):
        def wrapped(length):
            crop(length)
            if cache is dec.caches[-1]:  # every stage has been cropped: compare all of them
                assert_same_states(dec.caches, fresh_states(target, (prompt + want)[:length], len(prompt), 256))
                checked.append(length)
        return wrapped

    for c in dec.caches:
        c.crop = checking_crop(c, c.crop)
    res = dec.generate(prompt, 30)
    assert res.tokens == want
    assert res.metrics.num_rollbacks == len(checked) >= 3 and res.metrics.num_accepted_tokens >= 3
