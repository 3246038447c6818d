"""CUDA checks of the training fast path (skipped without CUDA; run on the GPU machine by scripts/gpu_train_bench.sh).

FlexAttention has no CPU backward, so the CPU suite checks only its forward (tests/test_train_layout.py); here the
compiled FlexAttention path's logits *and gradients* must equal the dense structural mask's, in fp32, at every fill.
"""

from __future__ import annotations

import pytest
import torch

from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import TargetArch
from spd_ds.partition import StagePartition
from spd_ds.train.student import HeadTrainModule
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention backward)")


@pytest.mark.parametrize("num_stages,flex_compile,seq_len", [(2, "static", 300), (4, "static", 300),
                                                         (4, "dynamic", 300), (2, "static", 384), (4, "static", 256)])
def test_flex_gradients_equal_dense_on_cuda(tmp_path, num_stages, flex_compile, seq_len):
    """seq_len 300: the block mask from create_block_mask; a multiple of the 128-row tile: from the segments' tiles."""
    from spd_ds.train.student import set_flex_compile

    set_flex_compile(flex_compile)
    try:
        _flex_equals_dense(tmp_path, num_stages, seq_len)
    finally:
        set_flex_compile("static")  # the default, for whatever runs next in this process


def test_fast_block_mask_lists_the_tiles_of_create_block_mask_on_cuda():
    """The tiles built from the segments equal create_block_mask's compiled ones at the training shape (B 8, S 2048)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from spd_ds.train.mask import structural_block_mask, structural_mask_mod

    torch.manual_seed(0)
    segments = torch.zeros(8, 2048, dtype=torch.long)
    for b in range(8):  # packed documents of random lengths, some rows ending in padding
        cuts = sorted(torch.randint(1, 2048, (b + 1,)).tolist())
        for d, (lo, hi) in enumerate(zip([0] + cuts, cuts + [2048 - 100 * (b % 2)])):
            segments[b, lo:hi] = d + 1
    segments = segments.cuda()
    for fill in range(1, 5):
        fast = structural_block_mask(segments, fill)
        R = (fill + 1) * 2048
        ref = create_block_mask(structural_mask_mod(segments, fill), 8, None, R, R, device="cuda", _compile=True)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            a, b = getattr(fast, name), getattr(ref, name)
            if "indices" in name:  # only the listed entries of each row are meant
                n = getattr(ref, name.replace("indices", "num_blocks"))
                keep = torch.arange(a.shape[-1], device="cuda") < n[..., None]
                a, b = a * keep, b * keep
            assert torch.equal(a, b), f"{name} fill {fill}"


def _flex_equals_dense(tmp_path, num_stages, seq_len):
    torch.manual_seed(0)
    arch = TargetArch(make_tiny_model(tmp_path, "llama", num_layers=8))
    part = StagePartition.build(8, num_stages=num_stages)
    head = SpeculationHead(arch, part, 2, list(range(arch.vocab_size))).cuda()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    B, S = 2, seq_len
    feats = torch.randn(B, S, part.num_types, arch.hidden_size, device="cuda")
    segments = torch.zeros(B, S, dtype=torch.long)
    segments[0, :120], segments[0, 120:S - 10] = 1, 2
    segments[1, :] = 1
    segments = segments.cuda()
    valid = (segments > 0) & (torch.rand(B, S, device="cuda") < 0.6)
    index = valid.reshape(-1).nonzero().flatten()
    for fill in range(1, num_stages + 1):
        grads = []
        for mode in ("dense", "flex"):
            head.zero_grad(set_to_none=True)
            out = HeadTrainModule(head, mode)(feats, segments, valid, fill, loss_index=index)
            (out.square().mean()).backward()
            grads.append((out.detach(), {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}))
        (o1, g1), (o2, g2) = grads
        torch.testing.assert_close(o2, o1, rtol=2e-4, atol=2e-4)
        assert g1.keys() == g2.keys()
        for k in g1:
            torch.testing.assert_close(g2[k], g1[k], rtol=2e-3, atol=2e-5, msg=lambda m: f"{k} fill {fill}: {m}")


def test_flex_teacher_equals_sdpa_teacher_on_cuda(tmp_path):
    """train.teacher_attention=flex with the layers compiled (as train.compile_teacher does on CUDA) gives the SDPA
    teacher's features and targets over packed rows (fp32, within the fused kernels' rounding) at the training row
    length."""
    from spd_ds.train.teacher import TeacherStage

    torch.manual_seed(0)
    arch = TargetArch(make_tiny_model(tmp_path, "llama", num_layers=8))
    part = StagePartition.build(8, num_stages=2)
    ids_ = list(range(0, arch.vocab_size, 2))
    sdpa = [TeacherStage(arch, part, s, torch.float32, ids_).cuda() for s in range(2)]
    flex = [TeacherStage(arch, part, s, torch.float32, ids_, attention="flex").cuda() for s in range(2)]
    for a, b in zip(sdpa, flex):
        b.load_state_dict(a.state_dict())
        b.compile_layers("inductor")
    B, S = 2, 256
    ids = torch.randint(3, arch.vocab_size, (B, S), device="cuda")
    seg = torch.zeros(B, S, dtype=torch.long)
    seg[0, :100], seg[0, 100:230], seg[1, :] = 1, 2, 1
    seg = seg.cuda()
    valid = (seg > 0) & (torch.rand(B, S, device="cuda") < 0.6)
    outs = []
    with torch.no_grad():
        for stages in (sdpa, flex):
            x = (ids, seg, valid.long(), valid.reshape(-1).nonzero().flatten())
            for st in stages:
                x = st(x)
            outs.append(x)
    for g, w in zip(outs[1][:3], outs[0][:3]):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
