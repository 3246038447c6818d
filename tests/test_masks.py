"""spd_ds.models.masks: the stages' masks in each attention backend's form, and the backends the stages refuse."""

import pytest
import torch

from spd_ds.config import ConfigError
from spd_ds.models.masks import causal_mask, check_stage_attention, layer_mask


def test_sdpa_takes_the_boolean_mask_and_eager_an_additive_one():
    m = causal_mask(3, 2, "cpu")
    assert layer_mask(m, "sdpa", torch.float32) is m and layer_mask(None, "eager", torch.float32) is None
    for dtype in (torch.float32, torch.bfloat16):
        a = layer_mask(m, "eager", dtype)
        assert a.dtype == dtype and a.shape == m.shape
        assert a[m].eq(0).all() and a[~m].eq(torch.finfo(dtype).min).all()
        scores = torch.zeros(m.shape, dtype=dtype)
        probs = torch.softmax((scores + a).float(), -1)[0, 0]  # as eager attention uses it: no weight past a row
        want = torch.tensor([[1 / 3] * 3 + [0.0] * 2, [0.25] * 4 + [0.0], [0.2] * 5])
        torch.testing.assert_close(probs, want, atol=0, rtol=1e-6)


@pytest.mark.parametrize("name", ["flash_attention_2", "flex_attention", "kernels-community/flash-attn2"])
def test_backends_the_stage_masks_do_not_fit_are_one_line_errors(name):
    for ok in ("sdpa", "eager"):
        check_stage_attention(ok)
    check_stage_attention("sdpa", decoding=False)
    with pytest.raises(ConfigError) as e:
        check_stage_attention(name)
    assert str(e.value) == (f"model.attn_implementation must be one of sdpa, eager (spd-ds's stages pass an explicit "
                            "mask over a static KV cache, which the other transformers backends do not take), got "
                            f"{name!r}")  # the config check's own line (it calls this)
    with pytest.raises(ConfigError, match="must be one of sdpa, eager"):
        check_stage_attention(name, decoding=False)
    with pytest.raises(ConfigError, match=r"does not apply to training: the teacher's attention is "
                                          r"train.teacher_attention \(sdpa or flex\)"):
        check_stage_attention("eager", decoding=False)


def test_a_mask_in_another_form_passes_through():
    block = torch.zeros(1, 1, 2, 2)  # e.g. an additive mask already, or what a FlexAttention context passes
    assert layer_mask(block, "eager", torch.float32) is block
    flex = object()  # a FlexAttention BlockMask is no tensor (training's structural flex context passes one)
    assert layer_mask(flex, "spd_structural_flex", torch.float32) is flex
    assert layer_mask(flex, "eager", torch.float32) is flex
    m = causal_mask(2, 0, "cpu")
    assert layer_mask(m, "paged|eager", torch.float32).dtype == torch.float32
