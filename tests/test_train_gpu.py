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


@pytest.mark.parametrize("num_stages,flex_compile", [(2, "static"), (4, "static"), (4, "dynamic")])
def test_flex_gradients_equal_dense_on_cuda(tmp_path, num_stages, flex_compile):
    from spd_ds.train.student import set_flex_compile

    set_flex_compile(flex_compile)
    try:
        _flex_equals_dense(tmp_path, num_stages)
    finally:
        set_flex_compile("static")  # the default, for whatever runs next in this process


def _flex_equals_dense(tmp_path, num_stages):
    torch.manual_seed(0)
    arch = TargetArch(make_tiny_model(tmp_path, "llama", num_layers=8))
    part = StagePartition.build(8, num_stages=num_stages)
    head = SpeculationHead(arch, part, 2, list(range(arch.vocab_size))).cuda()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    B, S = 2, 300  # S not a multiple of the 128-row tile
    feats = torch.randn(B, S, part.num_types, arch.hidden_size, device="cuda")
    segments = torch.zeros(B, S, dtype=torch.long)
    segments[0, :120], segments[0, 120:290] = 1, 2
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
