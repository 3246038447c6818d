"""The lossless line on a real model: greedy SPD == HF ``generate`` greedy, SmolLM2-135M-Instruct, fp32 CPU."""

import pytest
import torch

from spd_ds.decoding.ar import ARDecoder
from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import Target
from spd_ds.partition import StagePartition

MAX_NEW = 24
EOS = [2]  # <|im_end|>

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir, smollm2_prompts):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS[0])
    outs = []
    with torch.no_grad():
        for p in smollm2_prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("n", [2, 3, 5])
def test_greedy_spd_matches_hf_generate(smollm2_arch, smollm2_prompts, hf_greedy, n):
    part = StagePartition.build(smollm2_arch.num_layers, n)
    target = Target(smollm2_arch, part, torch.float32, "cpu")
    torch.manual_seed(0)
    head = SpeculationHead(smollm2_arch, part, draft_token_ids=range(8192))  # small draft vocab: a cheap head
    ar = ARDecoder(target, eos_token_ids=EOS, max_len=512)
    accepted = rollbacks = 0
    for prompt, want in zip(smollm2_prompts, hf_greedy):
        ar_tokens = ar.generate(prompt, MAX_NEW).tokens
        assert ar_tokens == want, "our AR decoder on the stage code parts from HF generate"
        # untrained head: nearly every draft is rolled back
        dec = SPDReferenceDecoder(target, HeadDrafter(head, 512, torch.float32, "cpu"), eos_token_ids=EOS, max_len=512)
        assert dec.generate(prompt, MAX_NEW).tokens == want
        # perturbed head: the target's own next token for ~60% of positions, the head's draft otherwise
        drafter = OracleDrafter(list(prompt) + want, 0.6, base=HeadDrafter(head, 512, torch.float32, "cpu"), seed=n)
        res = SPDReferenceDecoder(target, drafter, eos_token_ids=EOS, max_len=512).generate(prompt, MAX_NEW)
        assert res.tokens == want
        accepted += res.metrics.num_accepted_tokens
        rollbacks += res.metrics.num_rollbacks
    assert accepted > 0 and rollbacks > 0  # both paths ran
