"""Training computes, numerically, what inference computes.

The reference decoder drafts with a :class:`HeadDrafter` (KV cache, rows at their pipeline depth); the training
path runs the teacher stages (``spd_ds.train.teacher``) over the finished sequence and the head in its training
layout (``spd_ds.train.student``) at the fill each draft was made with. Their draft logits agree (fp32, CPU) — for
a two-layer tower, a non-injective ``f`` and every fill — and packing two documents into one row changes nothing,
also for hybrid (Qwen3.5) targets, whose linear-attention layers see each packed document on its own.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from spd_ds.train import mask as mask_lib
from spd_ds.train.loss import kd_loss, position_weights
from spd_ds.train.student import FLEX_ATTENTION, HeadTrainModule
from spd_ds.train.teacher import TeacherStage
from tests.tiny_models import make_tiny_model


def teacher_forward(stages, ids, segments, valid):
    """The degree-1 PipelineModule's forward: the stages in turn."""
    x = (ids, segments, valid.long(), valid.reshape(-1).nonzero().flatten())
    for st in stages:
        x = st(x)
    return x


@pytest.fixture(scope="module", params=["llama", "qwen3_5_text", "qwen3_5_moe_text"])
def arch8(tmp_path_factory, request):
    return TargetArch(make_tiny_model(tmp_path_factory.mktemp("layout"), request.param, num_layers=8))


@pytest.mark.parametrize("stage_layers,anchors,num_layers", [
    ((4, 4), None, 2),
    ((2, 2, 2, 2), (0, 4, 8), 2),  # non-injective f = 0,0,1,1,2
    ((3, 3, 2), None, 1),
])
def test_training_logits_equal_inference_draft_logits(arch8, stage_layers, anchors, num_layers):
    torch.manual_seed(0)
    # linear attention: the teacher runs the chunked algorithm over the whole sequence, inference decodes token by
    # token with the recurrent one (the same maths in another order)
    tol = 1e-4 if arch8.hybrid else 2e-5
    part = StagePartition.build(8, stage_layers=stage_layers, anchors=anchors)
    n = part.num_stages
    draft_ids = sorted(set(range(0, arch8.vocab_size, 3)) | {2})
    head = SpeculationHead(arch8, part, num_layers, draft_ids)
    with torch.no_grad():  # a non-trivial head
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    target = Target(arch8, part, torch.float32, "cpu")
    prompt = [5, 9, 13, 4, 7, 11]
    ar = SPDReferenceDecoder(target, OracleDrafter([], 0.0, vocab_size=arch8.vocab_size), max_len=64)
    ar = ar.generate(prompt, 24)
    seq = prompt + ar.tokens
    # inference: every draft accepted (oracle), so every in-flight token is the final one; record logits per draft
    drafter = HeadDrafter(head, 64, torch.float32, "cpu")
    records, logits_seen = [], []
    orig_logits, orig_propose = head.logits, drafter.propose

    def logits_hook(h):
        out = orig_logits(h)
        logits_seen.append(out.clone())
        return out

    def propose(completed, inflight, types, start, sampling):
        d = orig_propose(completed, inflight, types, start, sampling)
        records.append((start + completed.shape[0] + inflight.shape[0] - 1, inflight.shape[0]))
        return d

    head.logits = logits_hook
    drafter.propose = propose
    out = SPDReferenceDecoder(target, OracleDrafter(seq, 1.0, base=drafter), max_len=64).generate(prompt, 24)
    head.logits = orig_logits
    assert out.tokens == ar.tokens
    assert {f for _, f in records} == set(range(1, n + 1))

    # training: teacher stages over the whole sequence, head in its layout at each fill
    stages = [TeacherStage(arch8, part, s, torch.float32, draft_ids) for s in range(n)]
    ids = torch.tensor([seq])
    seg = torch.ones_like(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    feats, ld, lse, am = teacher_forward(stages, ids, seg, valid)
    student = HeadTrainModule(head).eval()
    with torch.no_grad():
        by_fill = {F: student(feats, seg, valid, F) for F in range(1, n + 1)}
    checked = 0
    for (P, F), lg in zip(records, logits_seen):
        if P >= len(seq):  # drafted after the last returned token: its in-flight tokens are not in seq
            continue
        checked += 1
        torch.testing.assert_close(by_fill[F][P], lg, atol=tol, rtol=tol)
    assert checked >= len(ar.tokens) - n

    # teacher targets equal the target's own logits at those positions
    full = target.ends.logits(_hidden_last(target, seq))
    torch.testing.assert_close(ld, full[:, draft_ids], atol=1e-5, rtol=1e-5)
    assert torch.equal(am, full.argmax(-1))

    # packing: the same document after another one in the row gives the same logits
    other = [3, 8, 1, 1, 6]
    ids2 = torch.tensor([other + seq])
    seg2 = torch.tensor([[1] * len(other) + [2] * len(seq)])
    valid2 = torch.zeros_like(ids2, dtype=torch.bool)
    valid2[0, len(other):] = True
    feats2, ld2, *_ = teacher_forward(stages, ids2, seg2, valid2)
    # the packed row runs its kernels on other shapes (a longer masked row for softmax attention, two gathered
    # documents for linear attention): the same maths summed in another order; with transformers 5.24 the hybrid
    # model's logits differed by up to 1.5e-5 (3 of 990)
    ptol = 5e-5 if arch8.hybrid else 1e-5
    torch.testing.assert_close(ld2, ld, atol=ptol, rtol=ptol)
    with torch.no_grad():
        for F in range(1, n + 1):
            torch.testing.assert_close(student(feats2, seg2, valid2, F), by_fill[F], atol=2e-5, rtol=2e-5)


def _hidden_last(target, seq):
    h = target.ends.embed(torch.tensor([seq]))
    pos = torch.arange(len(seq))
    for st in target.stages:
        h, _ = st(h, pos, None)
    return h[0]


def test_every_trainable_parameter_gets_a_gradient_at_every_fill(arch8):
    part = StagePartition.build(8, stage_layers=(2, 2, 2, 2), anchors=(0, 4, 8))
    head = SpeculationHead(arch8, part, 1, list(range(40)))
    student = HeadTrainModule(head)
    stages = [TeacherStage(arch8, part, s, torch.float32, list(range(40))) for s in range(4)]
    ids = torch.randint(3, 90, (2, 12))
    seg = torch.ones_like(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    feats, ld, lse, am = teacher_forward(stages, ids, seg, valid)
    from spd_ds.train.loss import TeacherTargets

    t = TeacherTargets(ld, lse, am)
    for F in (1, 2, 4):
        student.zero_grad()
        loss = kd_loss(student(feats, seg, valid, F), t, position_weights(t, head.draft_ids, 1.0, "weight"))
        loss.backward()
        missing = [n for n, p in student.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, (F, missing)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 5, 8])
def test_flex_attention_equals_dense_mask(tmp_path_factory, model_type, num_stages):
    """The block-sparse FlexAttention layout computes what the dense structural mask computes (fp32, packed rows,
    padding, grouped-query heads, two tower layers), at every fill; the loss positions selected by index equal the
    boolean selection. (FlexAttention has no CPU backward: CUDA runs the gradient check, tests/test_train_gpu.py.)"""
    torch.manual_seed(num_stages)
    arch = TargetArch(make_tiny_model(tmp_path_factory.mktemp(f"flex{model_type}"), model_type, num_layers=8))
    part = StagePartition.build(8, num_stages=num_stages)
    head = SpeculationHead(arch, part, 2, sorted(set(range(0, arch.vocab_size, 2))))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    dense, flex = HeadTrainModule(head, "dense"), HeadTrainModule(head, "flex")
    B, S, m, H = 2, 19, part.num_types, arch.hidden_size
    feats = torch.randn(B, S, m, H)
    segments = torch.tensor([[1] * 7 + [2] * 9 + [0] * 3, [1] * 4 + [2] * 4 + [3] * 11])
    valid = (segments > 0) & (torch.rand(B, S) < 0.7)
    index = valid.reshape(-1).nonzero().flatten()
    with torch.no_grad():
        for fill in range(1, num_stages + 1):
            ref = dense(feats, segments, valid, fill)
            got = flex(feats, segments, valid, fill, loss_index=index)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert head.config._attn_implementation != "spd_structural_flex"  # restored after the forward


def test_autocast_applies_inside_the_module(arch8):
    """DeepSpeed's engine turns an outer torch.autocast off around its forward, so the head's bf16 autocast lives in
    HeadTrainModule: under an outer autocast(enabled=False) the module still computes in bf16 (close to fp32, not
    equal), and returns fp32 logits."""
    torch.manual_seed(0)
    part = StagePartition.build(8, num_stages=2)
    head = SpeculationHead(arch8, part, 1, list(range(arch8.vocab_size)))
    feats = torch.randn(2, 11, part.num_types, arch8.hidden_size)
    segments = torch.ones(2, 11, dtype=torch.long)
    valid = torch.ones(2, 11, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        ref = HeadTrainModule(head)(feats, segments, valid, 2)
        got = HeadTrainModule(head, autocast=torch.bfloat16)(feats, segments, valid, 2)
    assert got.dtype == torch.float32 and not torch.equal(got, ref)
    torch.testing.assert_close(got, ref, rtol=0.05, atol=0.05)


def test_compiled_teacher_equals_eager(arch8):
    """train.compile_teacher: the stages' softmax-attention layers compiled (linear-attention ones stay eager) give the
    eager teacher's features and targets over packed rows, bit for bit with aot_eager (the eager kernels), for every
    family; all layers share one graph, the LM head's reductions (:func:`target_reductions`) another."""
    _check_compiled_teacher(arch8, "aot_eager")


@pytest.mark.slow
def test_inductor_teacher_equals_eager_within_rounding(tmp_path):
    """The same with inductor's fused kernels (what train.compile_teacher=inductor runs), on a Llama: within rounding.
    Slow tier: a C++ compile on CPU (the families' wiring is the aot_eager test's)."""
    _check_compiled_teacher(TargetArch(make_tiny_model(tmp_path, "llama", num_layers=8)), "inductor")


def test_flex_teacher_equals_sdpa_teacher(arch8):
    """train.teacher_attention=flex: FlexAttention under the packed-causal block mask gives the SDPA teacher's features
    and targets over packed rows with padding (fp32, eager flex on CPU), for every family (linear-attention layers
    run per document either way); a block size dividing the row (tiles from the segments) and one that does not."""
    torch.manual_seed(0)
    part = StagePartition.build(8, stage_layers=(4, 4))
    draft_ids = list(range(0, arch8.vocab_size, 2))
    sdpa = [TeacherStage(arch8, part, s, torch.float32, draft_ids) for s in range(2)]
    flex = [TeacherStage(arch8, part, s, torch.float32, draft_ids, attention="flex") for s in range(2)]
    for a, b in zip(sdpa, flex):
        b.load_state_dict(a.state_dict())
    soft = [layer for st in flex for i, layer in zip(st.layer_ids, st.layers) if not arch8.is_linear(i)]
    assert soft and all(layer.self_attn.config._attn_implementation == FLEX_ATTENTION for layer in soft)
    ids = torch.randint(3, arch8.vocab_size, (2, 32))
    seg = torch.tensor([[1] * 10 + [2] * 17 + [3] * 5, [1] * 20 + [0] * 12])
    valid = (seg > 0) & torch.rand(2, 32).gt(0.3)
    with torch.no_grad():
        want = teacher_forward(sdpa, ids, seg, valid)
        for block in (16, 12):  # 16 divides S = 32: tiles from the segments; 12 does not: create_block_mask
            with mock.patch("spd_ds.train.teacher.packed_causal_block_mask",
                            functools.partial(mask_lib.packed_causal_block_mask, block_size=block)):
                got = teacher_forward(flex, ids, seg, valid)
            for g, w in zip(got[:3], want[:3]):  # fp32, another kernel's summation order
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            assert torch.equal(got[3], want[3])
        # the mask is what the layers attend under: one that lets every row see the whole row changes the features
        from torch.nn.attention.flex_attention import create_block_mask

        def see_all(segments):
            return create_block_mask(lambda b, h, q, k: q >= 0, 2, None, 32, 32, device="cpu", BLOCK_SIZE=16)

        with mock.patch("spd_ds.train.teacher.packed_causal_block_mask", see_all):
            assert not torch.allclose(teacher_forward(flex, ids, seg, valid)[0], want[0], atol=1e-3)
    with pytest.raises(ValueError, match="teacher attention must be one of"):
        TeacherStage(arch8, part, 0, torch.float32, draft_ids, attention="eager")


def _check_compiled_teacher(arch8, backend):
    torch.manual_seed(0)
    part = StagePartition.build(8, stage_layers=(4, 4))
    draft_ids = list(range(0, arch8.vocab_size, 2))
    eager = [TeacherStage(arch8, part, s, torch.float32, draft_ids) for s in range(2)]
    compiled = [TeacherStage(arch8, part, s, torch.float32, draft_ids) for s in range(2)]
    softmax_layers = sum(not arch8.is_linear(i) for i in range(8))
    assert sum(st.compile_layers(backend) for st in compiled) == softmax_layers > 0
    ids = torch.randint(3, arch8.vocab_size, (2, 24))
    seg = torch.tensor([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4])
    valid = (seg > 0) & torch.rand(2, 24).gt(0.3)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        want = teacher_forward(eager, ids, seg, valid)
        for _ in range(2):  # the second call runs the cached graph
            got = teacher_forward(compiled, ids, seg, valid)
            for g, w in zip(got[:3], want[:3]):
                if backend == "aot_eager":  # the eager kernels: bit for bit
                    assert torch.equal(g, w)
                else:
                    torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            assert torch.equal(got[3], want[3])  # argmax over random logits: no near-ties at this tolerance
    # compiled for real: all layers share one graph rather than one each, the target reductions have their own
    assert counters["stats"]["unique_graphs"] == 2


def test_a_flex_failure_under_auto_trains_dense_and_says_so(arch8, monkeypatch, tmp_path):
    """train.attention=auto on CUDA falls back to the dense mask when FlexAttention fails on the first forward (forced
    here on CPU at the function level): the module then reports dense (what the loop records in run.json; it used to
    record flex) and computes dense's logits. A resume with auto keeps what the run ran (dense where flex would work:
    no refusal, the same numerics), and a run that ran flex does not fall back (one line instead)."""
    from spd_ds.config import ConfigError
    from spd_ds.train import student as student_lib
    from spd_ds.train.resume import RUN_FILE, flex_kept_message, recorded_attention

    part = StagePartition.build(8, stage_layers=(2, 2, 2, 2), anchors=(0, 4, 8))
    head = SpeculationHead(arch8, part, 1, list(range(40)))
    ids = torch.randint(3, 90, (2, 12))
    seg, valid = torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)
    stages = [TeacherStage(arch8, part, s, torch.float32, list(range(40))) for s in range(4)]
    feats = teacher_forward(stages, ids, seg, valid)[0]
    with torch.no_grad():
        dense = HeadTrainModule(head, "dense")(feats, seg, valid, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("flex kernel failed\nsecond line")

    monkeypatch.setattr(student_lib, "structural_block_mask", broken)
    auto = HeadTrainModule(head, "flex", fallback=True)
    with pytest.warns(UserWarning, match="FlexAttention failed"), torch.no_grad():
        out = auto(feats, seg, valid, 2)
    assert auto.attention == "dense"
    torch.testing.assert_close(out, dense)
    kept = HeadTrainModule(head, "flex", fallback=flex_kept_message(tmp_path / "run" / "checkpoints"))
    with pytest.raises(ConfigError) as e, torch.no_grad():
        kept(feats, seg, valid, 2)
    assert "\n" not in str(e.value) and "trained with train.attention=flex (run.json), which fails here" in str(e.value)
    assert "(FlexAttention failed: RuntimeError: flex kernel failed)" in str(e.value)
    with pytest.raises(RuntimeError, match="flex kernel failed"), torch.no_grad():
        HeadTrainModule(head, "flex")(feats, seg, valid, 2)  # train.attention=flex: the error itself

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # resolve_attention reads the device type only
    resolve = student_lib.resolve_attention
    assert resolve("auto", cuda) == "flex" and resolve("auto", cpu) == "dense"
    assert resolve("auto", cuda, "dense") == "dense" and resolve("auto", cuda, "flex") == "flex"
    assert resolve("auto", cpu, "flex") == "dense"  # cannot run here: run_identity's check refuses the change
    assert resolve("dense", cuda, "flex") == "dense"  # an explicit setting is compared, not replaced
    ck = tmp_path / "run" / "checkpoints"
    assert recorded_attention(ck) is None
    (ck / "step6").mkdir(parents=True)
    (ck / "latest").write_text("step6")
    assert recorded_attention(ck) is None
    (ck / "step6" / RUN_FILE).write_text('{"train.attention": "dense"}')
    assert recorded_attention(ck) == "dense"
