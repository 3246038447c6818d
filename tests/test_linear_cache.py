"""HybridStageCache (spd_ds/models/linear_cache.py): transformers' Qwen3.5 layers on our per-stage cache.

* the cache contract: the installed transformers' layers touch only the names in ``CACHE_CONTRACT`` and compute, on
  our cache, what they compute on transformers' own cache (so a changed cache API fails here, not silently);
* a multi-token cached forward equals single-token steps (what prefill and verification rely on);
* rollback: after any crop, every linear layer's conv and recurrent state equals the state recomputed from scratch
  for the kept prefix, bit for bit in fp32 (eager mode; the static mode's rewinds are checked in test_pipe_graphs);
* the rings' memory and the errors of rewinds deeper than the ring.
"""

from __future__ import annotations

import sys

import pytest
import torch

from spd_ds.models.adapter import Target, TargetArch
from spd_ds.models.linear_cache import CACHE_CONTRACT, HybridStageCache, LinearStateShape, RollbackError
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model

L = 8
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text"]


@pytest.fixture(scope="module", params=FAMILIES)
def arch(tiny_root, request):
    return TargetArch(make_tiny_model(tiny_root, request.param, L))


def run(target, caches, tokens, start):
    """Tokens ``tokens`` at positions ``start..`` through every stage; fp32 logits ``[q, V]``."""
    h = target.ends.embed(torch.tensor([tokens]))
    pos = torch.arange(start, start + len(tokens))
    for s, st in enumerate(target.stages):
        h, _ = st(h, pos, caches[s])
    return target.ends.logits(h[0])


def fresh_states(target, tokens, prompt_len, max_len=64):
    """Caches after the prompt's prefill and single-token steps over ``tokens[prompt_len:]`` (from scratch)."""
    caches = target.new_caches(max_len)
    run(target, caches, tokens[:prompt_len], 0)
    for i in range(prompt_len, len(tokens)):
        run(target, caches, tokens[i:i + 1], i)
    return caches


def assert_same_states(caches, ref):
    for c, r in zip(caches, ref):
        assert c.length == r.length
        if not isinstance(c, HybridStageCache):
            continue
        for i in c.linear_layer_ids:
            (cc, cr), (rc, rr) = c.linear_state(i), r.linear_state(i)
            assert torch.equal(cc, rc) and torch.equal(cr, rr), (i, c.length)


class _StrictCache:
    """Hands transformers' layers only the contract's names (and records them); any other name fails the test."""

    def __init__(self, inner) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "seen", set())

    def __getattr__(self, name):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("transformers"):
            assert name in CACHE_CONTRACT, f"transformers reads cache.{name}, not in CACHE_CONTRACT ({caller})"
            self.seen.add(name)
        return getattr(self._inner, name)


@torch.no_grad()
def test_cache_contract_with_the_installed_transformers(arch):
    """Our cache under transformers' layers gives transformers' own cached forward (prefill, steps, a multi-token
    continuation), touching only the contract's names."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(arch.model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, arch.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    kw = arch.cache_kwarg
    out = hf(ids[:, :6], use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    ref = [out.logits[0]]
    for i in range(6, 10):
        ref.append(hf(ids[:, i:i + 1], **{kw: cache}, use_cache=True).logits[0])
    ref.append(hf(ids[:, 10:14], **{kw: cache}, use_cache=True).logits[0])
    ref = torch.cat(ref)

    target = Target(arch, StagePartition.build(L, 1), torch.float32, "cpu")
    strict = _StrictCache(target.new_caches(32)[0])
    mine = [run(target, [strict], ids[0, :6].tolist(), 0)]
    mine += [run(target, [strict], ids[0, i:i + 1].tolist(), i) for i in range(6, 10)]
    mine.append(run(target, [strict], ids[0, 10:14].tolist(), 10))
    mine = torch.cat(mine)
    if arch.config.model_type == "qwen3_5_text":
        assert torch.equal(mine, ref)  # the same kernels in the same order: bit for bit
    else:  # transformers' loaded MoE experts are laid out differently (grouped_mm rounding)
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
    assert {"update_conv_state", "update_recurrent_state", "update"} <= strict.seen


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@torch.no_grad()
def test_multi_token_cached_forward_equals_single_token_steps(arch, static):
    from spd_ds.models.graphs import static_stage_forward

    target = Target(arch, StagePartition.build(L, 2), torch.float32, "cpu")
    seq = torch.randint(0, arch.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    a, b = ([arch.new_cache(st.layer_ids, 32, torch.float32, "cpu", static=static) for st in target.stages]
            for _ in range(2))

    def fwd(caches, lo, hi):
        h = target.ends.embed(seq[None, lo:hi])
        if static:
            for c in caches:
                c.length = hi
            return target.ends.logits(static_stage_forward(target.stages, caches, h, torch.arange(lo, hi))[0][0])
        return run(target, caches, seq[lo:hi].tolist(), lo)

    fwd(a, 0, 5), fwd(b, 0, 5)
    multi = fwd(a, 5, 12)  # one forward of 7 tokens on a cache holding 5
    steps = torch.cat([fwd(b, i, i + 1) for i in range(5, 12)])
    torch.testing.assert_close(multi, steps, atol=5e-5, rtol=5e-5)  # chunked vs recurrent algorithm
    for ca, cb in zip(a, b):
        for i in ca.linear_layer_ids:
            for x, y in zip(ca.linear_state(i, 12), cb.linear_state(i, 12)):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
        for i in ca.layer_ids:  # KV of the full-attention layers
            torch.testing.assert_close(ca.keys[i][:, :, :12], cb.keys[i][:, :, :12], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n", [2, 4])
@torch.no_grad()
def test_rollback_restores_every_stage_state_bit_exactly(arch, n):
    """Random walk of steps and rollbacks (up to n - 1 tokens, the deepest SPD needs): after each, every stage's
    linear-attention states equal those recomputed from scratch for the kept prefix."""
    target = Target(arch, StagePartition.build(L, n), torch.float32, "cpu")
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, arch.vocab_size, (5,), generator=g).tolist()
    caches = target.new_caches(64)
    seq = list(prompt)
    run(target, caches, prompt, 0)
    rollbacks = 0
    for step in range(24):
        if len(seq) > len(prompt) + 1 and step % 3 == 2:
            back = int(torch.randint(1, n, (), generator=g)) if n > 1 else 0
            keep = max(len(prompt) + 1, len(seq) - back)
            for c in caches:
                c.crop(keep)
            del seq[keep:]
            rollbacks += 1
            assert_same_states(caches, fresh_states(target, seq, len(prompt)))
        tok = int(torch.randint(0, arch.vocab_size, (), generator=g))
        run(target, caches, [tok], len(seq))
        seq.append(tok)
    assert rollbacks >= 6
    assert_same_states(caches, fresh_states(target, seq, len(prompt)))


@torch.no_grad()
def test_rewinds_beyond_the_ring_are_refused(arch):
    target = Target(arch, StagePartition.build(L, 2), torch.float32, "cpu")  # rings of 2 states: rewind 1
    caches = target.new_caches(32)
    run(target, caches, [1, 2, 3, 4], 0)
    c = caches[0]
    assert isinstance(c, HybridStageCache) and c.slots == 2 and c.held_lengths() == [4]
    with pytest.raises(RollbackError, match="holds \\[4\\]"):
        c.crop(2)  # into the prefill: no state after 2 tokens was ever kept
    for i in range(4, 8):
        run(target, caches, [5], i)
    assert c.held_lengths() == [7, 8]
    c.crop(7)
    assert c.held_lengths() == [7]
    with pytest.raises(RollbackError, match="max_rollback >= 2"):
        c.crop(5)
    c.crop(0)  # a new sequence needs no state
    assert c.length == 0 and c.held_lengths() == []


def test_ring_memory_per_layer_and_per_n(arch):
    shape = arch.linear_state_shape
    assert shape == LinearStateShape.from_config(arch.config)
    per_slot = shape.slot_bytes(torch.float32)
    assert per_slot == shape.conv_dim * shape.conv_kernel * 4 + shape.value_heads * shape.key_dim * shape.value_dim * 4
    for n in (2, 3, 4):
        part = StagePartition.build(L, n)
        for s in range(n):
            layers = list(part.stage_range(s))
            c = arch.new_cache(layers, 16, torch.float32, "cpu", max_rollback=n - 1)
            linear = [i for i in layers if arch.is_linear(i)]
            got = c.state_bytes if isinstance(c, HybridStageCache) else 0
            assert got == len(linear) * n * per_slot  # n states per linear layer
            s_c = arch.new_cache(layers, 16, torch.float32, "cpu", max_rollback=n - 1, static=True)
            got = s_c.state_bytes if isinstance(s_c, HybridStageCache) else 0
            assert got == len(linear) * (n + 1) * per_slot  # + the zero state of position 0


def test_qwen3_5_4b_shape_ring_memory():
    """The documented figure: Qwen3.5-4B, bf16 conv windows, fp32 recurrent states."""
    arch = TargetArch("random:qwen3.5-4b")
    shape = arch.linear_state_shape
    assert (shape.conv_dim, shape.conv_kernel, shape.value_heads, shape.key_dim, shape.value_dim) == \
        (8192, 4, 32, 128, 128)
    assert shape.slot_bytes(torch.bfloat16) == 64 * 1024 + 2 * 1024 * 1024
    assert sum(arch.is_linear(i) for i in range(arch.num_layers)) == 24
