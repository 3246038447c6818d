"""GraphedHeadDrafter: the static-cache head computes what HeadDrafter computes (fp32 CPU, its eager static path), in
real SPD cycles (rollbacks, every fill, a non-injective f, a two-layer tower), keeps SPD lossless, draws the same
keyed samples at T > 0, and its CUDA graph replays the eager static path exactly (GPU only)."""

from __future__ import annotations

import pytest
import torch

from spd_ds.config import load_config
from spd_ds.decoding.ar import ARDecoder
from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter
from spd_ds.decoding.head_graph import GraphedHeadDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.models.kv_cache import CacheOverflowError
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model

PARTITIONS = [
    ((4, 4), None, 2),
    ((2, 2, 2, 2), (0, 4, 8), 2),  # non-injective f = 0,0,1,1,2
    ((3, 3, 2), None, 1),
]
PROMPT = [5, 9, 13, 4, 7, 11]
TOL = dict(atol=5e-5, rtol=5e-5)  # fp32 logits of size 10-40 by two summation orders (static vs eager; 1 or 2 threads)


@pytest.fixture(scope="module")
def arch8(tmp_path_factory):
    return TargetArch(make_tiny_model(tmp_path_factory.mktemp("head_graph"), "llama", num_layers=8))


def make_head(arch, stage_layers, anchors, num_layers, dtype=torch.float32, device="cpu"):
    part = StagePartition.build(arch.num_layers, stage_layers=stage_layers, anchors=anchors)
    torch.manual_seed(0)
    head = SpeculationHead(arch, part, num_layers, sorted(set(range(0, arch.vocab_size, 3)) | {2}))
    with torch.no_grad():  # a non-trivial head
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return part, head.to(device=device, dtype=dtype)


def reference_logits(head, drafter, *args):
    """``drafter.propose(*args)`` and the draft logits it computed (HeadDrafter calls ``head.logits`` once)."""
    seen, orig = [], head.logits
    head.logits = lambda h: seen.append(orig(h)) or seen[-1]
    try:
        draft = drafter.propose(*args)
    finally:
        del head.logits
    return draft, seen[-1]


class Twin:
    """A drafter that runs HeadDrafter and GraphedHeadDrafter side by side, checks each call, proposes HeadDrafter's."""

    def __init__(self, head, static, max_len=64):
        self.head, self.static, self.calls = head, static, []
        self.ref = HeadDrafter(head, max_len, torch.float32, "cpu")

    def start(self, feats):
        self.ref.start(feats)
        self.static.start(feats)

    def propose(self, completed, inflight, types, start, sampling):
        a, la = reference_logits(self.head, self.ref, completed, inflight, types, start, sampling)
        b = self.static.propose(completed, inflight, types, start, sampling)
        torch.testing.assert_close(self.static.last_logits, la, **TOL)
        assert a.token == b.token
        if a.q_draft is not None:
            torch.testing.assert_close(b.q_draft, a.q_draft, **TOL)
        self.calls.append((completed.shape[0], inflight.shape[0]))
        return a


def random_rows(R, types, m, H, gen):
    """``[R, m, H]`` anchors with the entries past each row's type zeroed (as the decoders build them)."""
    x = torch.randn(R, m, H, generator=gen)
    for r, k in enumerate(types):
        x[r, k + 1:] = 0
    return x


@pytest.mark.parametrize("stage_layers,anchors,num_layers", PARTITIONS)
def test_call_sequence_matches_head_drafter(arch8, stage_layers, anchors, num_layers):
    """Hand-made calls: every fill, completed rows 0..2, a window start that goes back (crop), more rows than a
    replay holds (eager fallback), greedy and sampled drafts."""
    part, head = make_head(arch8, stage_layers, anchors, num_layers)
    n, m, H, f = part.num_stages, part.num_types, arch8.hidden_size, part.depth_to_type
    ref = HeadDrafter(head, 64, torch.float32, "cpu")
    static = GraphedHeadDrafter(head, 64, torch.float32, "cpu", use_graph=False)
    assert static.rows == n + 1 and not static.graphed
    gen = torch.Generator().manual_seed(1)
    feats = random_rows(len(PROMPT), [m - 1] * len(PROMPT), m, H, gen)
    ref.start(feats)
    static.start(feats)
    start = len(PROMPT)
    hot = SamplingParams(0.8, top_k=20, seed=3)
    plan = [(0, 1), (0, min(2, n)), (1, n), (1, 1), ("back", 1), (0, n), (2, n), (1, n), (0, 1), (1, n)]
    for i, (rc, ri) in enumerate(plan):
        if rc == "back":  # a rollback of the committed window: HeadDrafter needs its cache cropped, the static one not
            start -= 3
            ref.cache.crop(start)
            rc = 1
        types = [f[d] for d in range(ri)][::-1]  # oldest (deepest) first
        comp = random_rows(rc, [m - 1] * rc, m, H, gen)
        inf = random_rows(ri, types, m, H, gen)
        sampling = hot if i % 3 == 2 else SamplingParams()
        a, la = reference_logits(head, ref, comp, inf, types, start, sampling)
        b = static.propose(comp, inf, types, start, sampling)
        torch.testing.assert_close(static.last_logits, la, **TOL)
        assert a.token == b.token, i
        assert (a.q_draft is None) == (b.q_draft is None)
        if a.q_draft is not None:
            torch.testing.assert_close(b.q_draft, a.q_draft, **TOL)
        start += rc
        assert static.length == ref.cache.length == start
    assert static.fallbacks == 1  # the (2, n) call


@pytest.mark.parametrize("stage_layers,anchors,num_layers", PARTITIONS)
def test_spd_cycles_match_and_stay_lossless(arch8, stage_layers, anchors, num_layers):
    part, head = make_head(arch8, stage_layers, anchors, num_layers)
    n = part.num_stages
    target = Target(arch8, part, torch.float32, "cpu")
    ar = ARDecoder(target, max_len=64).generate(PROMPT, 30)
    # the oracle's coin makes accepted drafts and rollbacks; the twin checks every head call on the way
    twin = Twin(head, GraphedHeadDrafter(head, 64, torch.float32, "cpu", use_graph=False))
    res = SPDReferenceDecoder(target, OracleDrafter(PROMPT + ar.tokens, 0.6, base=twin, seed=n), max_len=64)
    res = res.generate(PROMPT, 30)
    assert res.tokens == ar.tokens
    assert res.metrics.num_rollbacks > 0 and res.metrics.num_accepted_tokens > 0
    assert {ri for _, ri in twin.calls} == set(range(1, n + 1)) and {rc for rc, _ in twin.calls} == {0, 1}
    assert twin.static.fallbacks == 0
    # the static drafter alone, and behind the oracle with fewer rows per replay than full cycles need (fallbacks)
    d = GraphedHeadDrafter(head, 64, torch.float32, "cpu", use_graph=False)
    assert SPDReferenceDecoder(target, d, max_len=64).generate(PROMPT, 30).tokens == ar.tokens
    d = GraphedHeadDrafter(head, 64, torch.float32, "cpu", use_graph=False, max_rows=2)
    res = SPDReferenceDecoder(target, OracleDrafter(PROMPT + ar.tokens, 0.6, base=d, seed=n), max_len=64)
    assert res.generate(PROMPT, 30).tokens == ar.tokens and d.fallbacks > 0


@pytest.mark.parametrize("stage_layers,anchors,num_layers", PARTITIONS[1:])
def test_sampled_spd_draws_the_same_keyed_samples(arch8, stage_layers, anchors, num_layers):
    part, head = make_head(arch8, stage_layers, anchors, num_layers)
    target = Target(arch8, part, torch.float32, "cpu")
    for seed in range(3):
        sp = SamplingParams(0.9, top_p=0.95, seed=seed)
        twin = Twin(head, GraphedHeadDrafter(head, 64, torch.float32, "cpu", use_graph=False))
        a = SPDReferenceDecoder(target, twin, sp, max_len=64).generate(PROMPT, 20)
        b = SPDReferenceDecoder(target, GraphedHeadDrafter(head, 64, torch.float32, "cpu", use_graph=False), sp,
                                max_len=64).generate(PROMPT, 20)
        c = SPDReferenceDecoder(target, HeadDrafter(head, 64, torch.float32, "cpu"), sp, max_len=64)
        c = c.generate(PROMPT, 20)
        assert a.tokens == b.tokens == c.tokens and len(twin.calls) == a.metrics.num_cycles
        assert b.metrics.num_accepted_tokens == c.metrics.num_accepted_tokens


def test_clear_errors(arch8):
    part, head = make_head(arch8, (4, 4), None, 1)
    m, H = part.num_types, arch8.hidden_size
    d = GraphedHeadDrafter(head, 16, torch.float32, "cpu", use_graph=False)
    d.start(torch.randn(4, m, H))
    one = torch.randn(1, m, H)
    with pytest.raises(RuntimeError, match="holds 4 positions"):
        d.propose(one[:0], one, [0], 5, SamplingParams())
    with pytest.raises(ValueError, match="aggregation type"):
        d.propose(one[:0], one, [m], 4, SamplingParams())
    with pytest.raises(CacheOverflowError, match="max_length"):
        d.propose(one[:0], torch.randn(13, m, H), [0] * 13, 4, SamplingParams())
    with pytest.raises(CacheOverflowError):
        d.start(torch.randn(17, m, H))
    with pytest.raises(ValueError, match="max_rows"):
        GraphedHeadDrafter(head, 16, torch.float32, "cpu", use_graph=False, max_rows=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            GraphedHeadDrafter(head, 16, torch.float32, "cpu", use_graph=True)


def test_builder_picks_the_graphed_head_on_cuda_only(arch8):
    from spd_ds.builder import build_drafter, head_cuda_graph

    def cfg(*o):
        return load_config(None, list(o))

    assert head_cuda_graph(cfg(), "cuda") and not head_cuda_graph(cfg(), "cpu")  # the default on GPU only
    assert head_cuda_graph(cfg("head.cuda_graph=true"), "cuda")
    assert not head_cuda_graph(cfg("head.cuda_graph=true"), "cpu")
    assert head_cuda_graph(cfg("deepspeed.static_cache=false", "head.cuda_graph=true"), "cuda:1")
    assert not head_cuda_graph(cfg("head.cuda_graph=false"), "cuda")
    _, head = make_head(arch8, (4, 4), None, 1)
    c = cfg("model.dtype=float32", "decoding.max_length=64", "head.cuda_graph=true")
    assert type(build_drafter(c, head, arch8, "cpu")) is HeadDrafter  # CPU stays eager
    assert build_drafter(c, None, arch8, "cpu") is None


def test_failed_head_capture_falls_back_to_the_eager_head(arch8, monkeypatch, caplog):
    import spd_ds.builder as builder
    import spd_ds.decoding.head_graph as head_graph

    def no_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(builder, "head_cuda_graph", lambda cfg, device: True)  # as on a GPU
    monkeypatch.setattr(head_graph, "GraphedHeadDrafter", no_capture)
    _, head = make_head(arch8, (4, 4), None, 1)
    cfg = load_config(None, ["model.dtype=float32", "head.cuda_graph=true"])
    with caplog.at_level("WARNING", logger="spd_ds.builder"):
        drafter = builder.build_head_drafter(cfg, head, 64, "cpu")
    assert type(drafter) is HeadDrafter
    assert ("CUDA graph capture failed (operation not permitted when stream is capturing); drafting eagerly"
            in caplog.text)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
@torch.no_grad()
@pytest.mark.parametrize("stage_layers,anchors,num_layers", PARTITIONS[:2])
def test_cuda_graph_replay_equals_eager_static_path(arch8, stage_layers, anchors, num_layers):
    part, head = make_head(arch8, stage_layers, anchors, num_layers, torch.bfloat16, "cuda")
    n, m, H, f = part.num_stages, part.num_types, arch8.hidden_size, part.depth_to_type
    g = GraphedHeadDrafter(head, 64, torch.bfloat16, "cuda", use_graph=True)
    e = GraphedHeadDrafter(head, 64, torch.bfloat16, "cuda", use_graph=False)
    assert g.graphed and not e.graphed
    gen = torch.Generator().manual_seed(2)
    feats = random_rows(len(PROMPT), [m - 1] * len(PROMPT), m, H, gen).cuda()
    g.start(feats)
    e.start(feats)
    start = len(PROMPT)
    for i, (rc, ri) in enumerate([(0, 1), (0, n), (1, n), (1, 1), (0, n), (2, n), (1, n), (1, 2)]):
        types = [f[d] for d in range(ri)][::-1]
        comp = random_rows(rc, [m - 1] * rc, m, H, gen).cuda()
        inf = random_rows(ri, types, m, H, gen).cuda()
        sampling = SamplingParams(0.7, seed=5) if i % 2 else SamplingParams()
        a = g.propose(comp, inf, types, start, sampling)
        b = e.propose(comp, inf, types, start, sampling)
        assert torch.equal(g.last_logits, e.last_logits) and a.token == b.token, i
        if a.q_draft is not None:  # sampled calls: the same draft distribution
            assert torch.equal(a.q_draft, b.q_draft), i
        start += rc
    assert g.fallbacks == e.fallbacks == 1
    # in real cycles on the GPU: SPD with the graphed head equals AR on the same stage code
    target = Target(arch8, part, torch.bfloat16, "cuda")
    ar = ARDecoder(target, max_len=64).generate(PROMPT, 30)
    res = SPDReferenceDecoder(target, OracleDrafter(PROMPT + ar.tokens, 0.6, base=g, seed=1), max_len=64)
    assert res.generate(PROMPT, 30).tokens == ar.tokens


@pytest.mark.slow
def test_smollm2_twin_drafts_and_lossless(smollm2_arch, smollm2_prompts):
    """The real model (GQA, 30 layers, non-injective f at n = 5): same drafts call by call, SPD == AR."""
    part = StagePartition.build(smollm2_arch.num_layers, 5)
    target = Target(smollm2_arch, part, torch.float32, "cpu")
    torch.manual_seed(0)
    head = SpeculationHead(smollm2_arch, part, draft_token_ids=range(8192))
    ar = ARDecoder(target, eos_token_ids=[2], max_len=512)
    for prompt in smollm2_prompts[:2]:
        want = ar.generate(prompt, 24).tokens
        twin = Twin(head, GraphedHeadDrafter(head, 512, torch.float32, "cpu", use_graph=False), max_len=512)
        drafter = OracleDrafter(list(prompt) + want, 0.6, base=twin, seed=5)
        res = SPDReferenceDecoder(target, drafter, eos_token_ids=[2], max_len=512).generate(prompt, 24)
        assert res.tokens == want and res.metrics.num_rollbacks > 0 and max(ri for _, ri in twin.calls) == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
@torch.no_grad()
def test_head_graph_replayed_beside_a_stage_graph_leaves_the_stage_exact(smollm2_arch, smollm2_prompts):
    """The engine replays the head's graph on its own stream while stage 0's graph replays on the default stream.
    A graph keeps the cuBLAS workspace of the stream it was captured on, so the head must not be captured on the
    stage graphs' (shared, default) capture stream, and overlapping replays must leave stage 0's outputs bit-equal
    to a replay with nothing beside it (SmolLM2's real shapes, bf16). On 2 H200s the overlap loop also passed with
    the head captured on the shared stream (the race did not show in 64 steps); the stream assertion is what caught
    that version."""
    from spd_ds.models.graphs import GraphedStage

    part = StagePartition.build(smollm2_arch.num_layers, 2)
    target = Target(smollm2_arch, part, torch.bfloat16, "cuda")
    torch.manual_seed(0)
    head = SpeculationHead(smollm2_arch, part, draft_token_ids=range(8192))
    g = GraphedHeadDrafter(head, 256, torch.bfloat16, "cuda", use_graph=True)
    busy, calm = (GraphedStage(target.stages[0], 256) for _ in range(2))
    prompt = torch.tensor([smollm2_prompts[0]], device="cuda")
    x = target.ends.embed(prompt)
    busy.prefill(x)
    calm.prefill(x)
    g.start(torch.randn(prompt.shape[1], part.num_types, smollm2_arch.hidden_size, device="cuda",
                        dtype=torch.bfloat16))
    g.propose(torch.zeros(0, part.num_types, smollm2_arch.hidden_size, device="cuda"),
              torch.randn(part.num_stages, part.num_types, smollm2_arch.hidden_size, device="cuda"),
              list(range(part.num_stages))[::-1], prompt.shape[1], SamplingParams())
    side = torch.cuda.Stream()
    toks = torch.randint(0, smollm2_arch.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).cuda()
    for i in range(64):
        pos = prompt.shape[1] + i
        h = target.ends.embed(toks[i].view(1, 1))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(4):
                g.graph.replay()
        out, cap = busy.step(h, pos)  # overlaps the head's replays
        torch.cuda.current_stream().wait_stream(side)
        out, cap = out.clone(), {j: t.clone() for j, t in cap.items()}
        want, want_cap = calm.step(h, pos)
        assert torch.equal(out, want), f"stage 0 output perturbed at step {i}"
        assert all(torch.equal(cap[j], want_cap[j]) for j in cap), f"anchor states perturbed at step {i}"
    shared = torch.cuda.graph.default_capture_stream
    assert shared is not None and getattr(g, "capture_stream", shared) != shared
