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


def test_greedy_spd_with_eager_attention_matches_hf_generate_eager(smollm2_dir, smollm2_prompts):
    """model.attn_implementation=eager (additive masks in the stages and the head's tower): greedy SPD equals HF
    ``generate`` with eager attention. A boolean mask once masked nothing there: SPD still equalled our AR, which
    runs the same stages, while both answered wrongly."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from spd_ds.models.adapter import TargetArch

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS[0])
    arch = TargetArch(smollm2_dir, "eager")
    part = StagePartition.build(arch.num_layers, 2)
    target = Target(arch, part, torch.float32, "cpu")
    torch.manual_seed(0)
    head = SpeculationHead(arch, part, num_layers=2, draft_token_ids=range(8192))  # its tower runs eager too
    assert head.config._attn_implementation == "eager"
    rows, positions = torch.randn(1, 6, arch.hidden_size), torch.arange(6)
    with torch.no_grad():
        eager = head.tower(rows, positions)
        head.config._attn_implementation = "sdpa"  # the layers read it at each forward
        torch.testing.assert_close(eager, head.tower(rows, positions), atol=1e-5, rtol=1e-5)
        head.config._attn_implementation = "eager"
    for prompt in smollm2_prompts[:2]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)[0, len(prompt):].tolist()
        drafter = OracleDrafter(list(prompt) + want, 0.6, base=HeadDrafter(head, 512, torch.float32, "cpu"), seed=1)
        res = SPDReferenceDecoder(target, drafter, eos_token_ids=EOS, max_len=512).generate(prompt, MAX_NEW)
        assert res.tokens == want and res.metrics.num_accepted_tokens > 0 and res.metrics.num_rollbacks > 0
