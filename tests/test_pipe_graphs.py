"""Static KV cache mode and GraphedStage (the GPU speed path's code, run eagerly on CPU; CUDA graphs on GPU)."""

import pytest
import torch

from spd_ds.models.adapter import Target, TargetArch, causal_mask
from spd_ds.models.graphs import GraphedStage, capture_graph, make_static_cache, static_stage_forward
from spd_ds.models.kv_cache import StageKVCache
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text"])
def target(tiny_root, request):
    """A full-attention target and a hybrid one (linear-attention states in position-indexed rings)."""
    arch = TargetArch(make_tiny_model(tiny_root, request.param, 6))
    return Target(arch, StagePartition.build(6, 2), torch.float32, "cpu")


def test_static_cache_writes_at_bound_positions_and_masks_the_rest():
    c = StageKVCache([0], num_kv_heads=1, head_dim=2, max_len=6, dtype=torch.float32, device="cpu", static=True)
    pos = torch.tensor([0, 1, 2])
    c.bind(pos)
    k, v = c.update(torch.ones(1, 1, 3, 2), 2 * torch.ones(1, 1, 3, 2), 0)
    assert k.shape == (1, 1, 6, 2) and k[0, 0, :3].eq(1).all() and k[0, 0, 3:].eq(0).all() and v[0, 0, 2].eq(2).all()
    m = c.attention_mask(pos)
    assert m.shape == (1, 1, 3, 6) and m[0, 0].tolist() == [[i <= r for i in range(6)] for r in range(3)]
    c.bind(torch.tensor([1]))  # a rollback: writing at position 1 hides everything after it
    c.update(5 * torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 0)
    assert (c.keys[0][0, 0, 1].eq(5).all()
            and c.attention_mask(torch.tensor([1]))[0, 0, 0].tolist() == [True, True] + [False] * 4)
    with pytest.raises(RuntimeError, match="static=True"):
        StageKVCache([0], 1, 2, 4, torch.float32, "cpu").bind(pos)


def run_eager(target, ids, caches):
    h = target.ends.embed(ids)
    pos = torch.arange(caches[0].length, caches[0].length + ids.shape[1], device=ids.device)
    for s, st in enumerate(target.stages):
        h, _ = st(h, pos, caches[s])
    return target.ends.logits(h[0, -1])


@torch.no_grad()
def test_static_stage_matches_eager_and_rolls_back_exactly(target):
    graphed = [GraphedStage(st, 64, use_graph=False) for st in target.stages]
    assert not graphed[0].graphed
    caches = target.new_caches(64)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    ref = run_eager(target, prompt, caches)
    h = target.ends.embed(prompt)
    for g in graphed:
        h, _ = g.prefill(h)
    torch.testing.assert_close(target.ends.logits(h[0, -1]), ref, atol=1e-4, rtol=1e-4)

    def step(tok, pos):
        h = target.ends.embed(torch.tensor([[tok]]))
        cap = {}
        for g in graphed:
            h, c = g.step(h, pos)
            cap.update(c)
        return target.ends.logits(h[0, 0]), {j: t.clone() for j, t in cap.items()}

    toks, outs = [int(ref.argmax())], []
    for pos in range(5, 12):  # greedy continuation: same tokens as the eager path
        lg, cap = step(toks[-1], pos)
        outs.append((lg, cap))
        e = run_eager(target, torch.tensor([[toks[-1]]]), caches)
        torch.testing.assert_close(lg, e, atol=1e-4, rtol=1e-4)
        assert int(lg.argmax()) == int(e.argmax())
        toks.append(int(lg.argmax()))
    assert set(outs[0][1]) == {3, 6}  # anchors of both stages (default anchors 0, 3, 6)
    # rollback to position 8 with another token, then replay the originals: bit-identical to the first pass
    step(7, 8)
    step(9, 9)
    for i, pos in enumerate(range(8, 12)):
        lg, cap = step(toks[pos - 5], pos)
        assert torch.equal(lg, outs[pos - 5][0]) and all(torch.equal(cap[j], outs[pos - 5][1][j]) for j in cap)


def test_graphs_need_cuda(target):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedStage(target.stages[0], 16, use_graph=True)


def test_make_static_cache(target):
    c = make_static_cache(target.stages[1], 32)
    assert c.static and getattr(c, "all_layer_ids", c.layer_ids) == [3, 4, 5] and c.keys[3].shape[2] == 32
    if target.arch.hybrid:  # layers 4, 5 are linear attention: rings of max_rollback + 1 states + the zero state
        assert c.layer_ids == [3] and c.linear_layer_ids == [4, 5]
        assert c.rec_ring[4].shape[0] == target.arch.max_rollback + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@torch.no_grad()
def test_cuda_graph_replay_equals_eager_static_forward(tiny_root, model_type):
    arch = TargetArch(make_tiny_model(tiny_root, model_type, 6))
    tgt = Target(arch, StagePartition.build(6, 2), torch.bfloat16, "cuda")
    g = GraphedStage(list(tgt.stages), 64, use_graph=True)  # both stages in one graph (AR-baseline style)
    e = GraphedStage(list(tgt.stages), 64, use_graph=False)
    h = tgt.ends.embed(torch.tensor([[3, 14, 15, 92, 65]], device="cuda"))
    a, _ = g.prefill(h)
    b, _ = e.prefill(h)
    assert torch.equal(a, b)
    tok = int(tgt.ends.logits(a[0, -1]).argmax())
    for pos in range(5, 15):
        x = tgt.ends.embed(torch.tensor([[tok]], device="cuda"))
        ya, ca = g.step(x, pos)
        yb, cb = e.step(x, torch.tensor([pos], device="cuda"))
        assert torch.equal(ya, yb) and all(torch.equal(ca[j], cb[j]) for j in ca)
        tok = int(tgt.ends.logits(ya[0, 0]).argmax())
    assert static_stage_forward is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
@torch.no_grad()
def test_capture_graph_warms_up_then_captures_once():
    """The one capture helper: ``warmup`` eager runs, one capture; the replay recomputes from the static input, on
    torch's capture stream or on a stream of the caller's own (the graphed head's way)."""
    dev = torch.device("cuda")
    x = torch.zeros(4, device=dev)
    own = torch.cuda.Stream(dev, priority=-1)
    for stream, mode in [(None, "global"), (own, "thread_local")]:
        calls = []

        def step():
            calls.append(torch.cuda.current_stream(dev))
            return x * 2 + 1

        graph, y = capture_graph(step, dev, warmup=2, stream=stream, capture_error_mode=mode)
        assert len(calls) == 3 and (stream is None or all(c == own for c in calls))
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full((4,), 7.0, device=dev))
        x.zero_()


def test_causal_mask_masks_single_rows_off_cpu_only():
    """One new row: no mask on CPU; on a GPU an all-True mask (the static-cache decoders always pass one, and an
    unmasked call would make transformers ask SDPA for grouped-query attention, i.e. another kernel)."""
    assert causal_mask(1, 7, "cpu") is None
    assert causal_mask(1, 7, "cpu", single_row_mask=True).tolist() == [[[[True] * 8]]]
    assert causal_mask(1, 7, "meta", single_row_mask=False) is None
    m = causal_mask(1, 7, "meta")  # any other device: a mask over the 7 cached positions and the new one
    assert m is not None and m.shape == (1, 1, 1, 8) and m.dtype == torch.bool
    assert causal_mask(3, 2, "cpu")[0, 0].tolist() == [[i <= r for i in range(5)] for r in range(2, 5)]


@torch.no_grad()
def test_the_single_row_mask_of_the_gpu_path_attends_like_no_mask(tiny_root, monkeypatch):
    """The GPU path's all-True mask for one new row is the same attention as no mask (checked on CPU, fp32, a
    grouped-query target, the target's stages; the speculation head's eager tower takes its mask from the same
    function): same greedy tokens, same logits to rounding (the masked call runs another kernel)."""
    import spd_ds.models.adapter as adapter

    arch = TargetArch(make_tiny_model(tiny_root, "llama", 6))
    assert arch.config.num_key_value_heads < arch.config.num_attention_heads
    tgt = Target(arch, StagePartition.build(6, 2), torch.float32, "cpu")
    prompt = torch.tensor([[3, 14, 15, 92, 65]])

    def greedy(steps=12):
        caches = tgt.new_caches(64)
        lg = run_eager(tgt, prompt, caches)
        out = [lg]
        for _ in range(steps):
            lg = run_eager(tgt, lg.argmax().view(1, 1), caches)
            out.append(lg)
        return out

    unmasked = greedy()
    orig = adapter.causal_mask
    forced = lambda q, past, device, single_row_mask=None: orig(q, past, device, single_row_mask=True)  # noqa: E731
    monkeypatch.setattr(adapter, "causal_mask", forced)
    masked = greedy()
    assert [int(x.argmax()) for x in masked] == [int(x.argmax()) for x in unmasked]
    for a, b in zip(masked, unmasked):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@torch.no_grad()
def test_eager_decoder_equals_static_cache_decoder_bitwise_on_cuda_under_the_default_kernels(tiny_root, model_type,
                                                                                            sdpa_flags):
    """The eager decoder (length-based cache: the reference decoder's and the eager AR's path) and the static-cache
    decoder of the CUDA graphs (a mask over the whole cache: ``ar_graph`` and the engine's graphed stages) give
    bit-identical logits in bf16 under the default ``model.sdpa_backends`` of CUDA, full-attention GQA targets (the
    hybrid ones keep their linear-attention states differently in the two caches). Under the former default
    (``[flash, efficient, math]``, the eager step unmasked) greedy SPD through the reference decoder parted from
    ``ar_graph`` on 3 of 4 MT-Bench prompts on an H200 (docs/benchmarks.md (a))."""
    from spd_ds.builder import set_sdpa_backends

    set_sdpa_backends(None, "cuda")
    arch = TargetArch(make_tiny_model(tiny_root, model_type, 6))
    assert arch.config.num_key_value_heads < arch.config.num_attention_heads  # grouped-query, as SmolLM2
    tgt = Target(arch, StagePartition.build(6, 2), torch.bfloat16, "cuda")
    graphed = GraphedStage(list(tgt.stages), 96, use_graph=True)
    caches = tgt.new_caches(96)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]], device="cuda")
    ref = run_eager(tgt, prompt, caches)
    h, _ = graphed.prefill(tgt.ends.embed(prompt))
    assert torch.equal(tgt.ends.logits(h[0, -1]), ref)
    tok = int(ref.argmax())
    for pos in range(prompt.shape[1], prompt.shape[1] + 48):
        y, _ = graphed.step(tgt.ends.embed(torch.tensor([[tok]], device="cuda")), pos)
        lg = tgt.ends.logits(y[0, 0])
        e = run_eager(tgt, torch.tensor([[tok]], device="cuda"), caches)
        assert torch.equal(lg, e), f"position {pos}: eager and static-cache logits differ"
        tok = int(lg.argmax())
