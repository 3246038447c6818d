"""The ``ar_graph`` baseline (static KV cache + CUDA graph; eager static forward on CPU) against ``ARDecoder``."""

from __future__ import annotations

import pytest
import torch

from spd_ds.decoding.ar import ARDecoder
from spd_ds.decoding.ar_graph import ARGraphDecoder
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from tests.test_eval_random_weights import make_random_shape

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)

PROMPT = [3, 9, 27, 81 % 96, 50, 11, 7]


@pytest.fixture(scope="module", params=["llama", "qwen3", "random:qwen3.5-tiny"])
def target(request, tmp_path_factory):
    shape = request.param
    arch = TargetArch(shape if shape.startswith("random:")
                      else make_random_shape(tmp_path_factory.mktemp("shapes"), shape))
    return Target(arch, StagePartition.build(arch.num_layers, 2), torch.float32, "cpu")


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.9, 20, 0.95, seed=5)], ids=["greedy", "T0.9"])
def test_same_tokens_as_ar_decoder(target, sampling):
    want = ARDecoder(target, sampling, [], 128).generate(PROMPT, 30)
    dec = ARGraphDecoder(target, sampling, [], 128, sync_every=7)
    assert not dec.graphed  # CPU: eager static forward
    for _ in range(2):  # reusable: the static caches need no reset between prompts
        got = dec.generate(PROMPT, 30)
        assert got.tokens == want.tokens
        assert got.metrics.num_new_tokens == 30 and got.finish_reason == "length"


def test_stops_at_eos_inside_a_chunk(target):
    free = ARDecoder(target, SamplingParams(), [], 128).generate(PROMPT, 30).tokens
    eos = free[9]
    want = ARDecoder(target, SamplingParams(), [eos], 128).generate(PROMPT, 30)
    got = ARGraphDecoder(target, SamplingParams(), [eos], 128, sync_every=4).generate(PROMPT, 30)
    assert got.tokens == want.tokens and got.finish_reason == "eos" == want.finish_reason
    assert got.metrics.num_cycles >= len(got.tokens) - 1  # replays after the EOS in its chunk are counted
    # the default on CPU reads every step (no graph launches ahead): no step after the EOS, as the eval's ar_graph
    dec = ARGraphDecoder(target, SamplingParams(), [eos], 128)
    assert dec.sync_every == 1 and dec.generate(PROMPT, 30).metrics.num_cycles == len(want.tokens) - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_cuda_default_reads_every_four_replays_and_stops_at_eos(tmp_path):
    """On CUDA, by default, ``ar_graph`` reads its tokens every 4 replays: the tokens equal the eager ARDecoder's up to
    an EOS inside a chunk, and the replays after it within that chunk are counted as cycles (whole chunks)."""
    arch = TargetArch(make_random_shape(tmp_path, "llama"))
    cuda = Target(arch, StagePartition.build(arch.num_layers, 2), torch.float32, "cuda")
    free = ARDecoder(cuda, SamplingParams(), [], 128).generate(PROMPT, 30).tokens
    eos = free[9]  # the 10th token (or an earlier one of the same id): inside a chunk of 4 replays
    want = ARDecoder(cuda, SamplingParams(), [eos], 128).generate(PROMPT, 30)
    dec = ARGraphDecoder(cuda, SamplingParams(), [eos], 128)
    got = dec.generate(PROMPT, 30)
    assert dec.graphed and dec.sync_every == 4
    assert got.tokens == want.tokens and got.finish_reason == "eos"
    steps = len(want.tokens) - 1  # decode steps after the prefill token, up to the EOS
    assert got.metrics.num_cycles == -(-steps // 4) * 4  # whole chunks: the replays after the EOS are counted


def test_refuses_graphs_on_cpu(target):
    with pytest.raises(ValueError, match="CUDA"):
        ARGraphDecoder(target, use_graph=True)


def test_given_caches_are_used_and_checked(target):
    from spd_ds.models.graphs import make_static_cache

    caches = [make_static_cache(s, 128) for s in target.stages]
    dec = ARGraphDecoder(target, SamplingParams(), [], 128, caches=caches)
    assert dec.caches == caches
    assert dec.generate(PROMPT, 12).tokens == ARDecoder(target, SamplingParams(), [], 128).generate(PROMPT, 12).tokens
    with pytest.raises(ValueError, match="one static cache per stage"):
        ARGraphDecoder(target, caches=caches[:1])
    with pytest.raises(ValueError, match="must be static with >= 128 positions"):
        ARGraphDecoder(target, SamplingParams(), [], 128, caches=[make_static_cache(s, 64) for s in target.stages])
