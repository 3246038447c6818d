"""Speed yardsticks for the benchmark tables: bytes read per token, achieved bandwidth, one stage's forward alone.

At batch 1 a decode step reads every weight once, so ``bytes per token / HBM bandwidth`` is its floor (gpt-fast
reports achieved GB/s = bytes per token x tokens/s). The bytes counted are the decoder layers, the final norm and
the LM head; the embedding table is not counted (one row is read), except as the LM head when the two are tied.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch


def weight_bytes_per_token(arch, dtype: torch.dtype) -> int:
    """Bytes of weights one AR decode step reads (decoder layers + final norm + LM head) in ``dtype``.

    Args:
        arch: a :class:`~spd_ds.models.adapter.TargetArch`.
        dtype: compute dtype of the weights.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(arch.config)
    total = sum(p.numel() for p in skel.parameters())  # tied LM head counted once (as the embedding)
    if not arch.tied_embeddings:
        total -= skel.get_input_embeddings().weight.numel()
    return int(total) * torch.empty((), dtype=dtype).element_size()


def achieved_gbps(bytes_per_token: int, tok_s: float) -> float:
    """Achieved weight-read bandwidth in GB/s (1e9 bytes) at ``tok_s`` decode tokens per second."""
    return bytes_per_token * tok_s / 1e9


@torch.no_grad()
def stage_forward_ms(target, position: int, iters: int = 50, use_graph: bool | None = None,
                     max_len: int | None = None) -> list[float]:
    """Mean time of one single-token forward of each stage, alone (no pipeline), in milliseconds.

    Each stage runs over a static KV cache (:class:`spd_ds.models.graphs.GraphedStage`), replayed as a CUDA graph
    on GPU (``use_graph=None``: when the target is on CUDA) or eagerly on CPU, at token ``position`` (attention reads
    ``position + 1`` cache entries). GPU times come from CUDA events around ``iters`` back-to-back replays.

    Args:
        target: a :class:`~spd_ds.models.adapter.Target` (weights shared, not copied).
        position: token position of the timed forward (e.g. prompt length + half the generation).
        iters: timed forwards per stage (after 3 warm-up forwards).
        max_len: KV capacity of the temporary caches (default ``position + 64``).
    Returns:
        ``[n]`` milliseconds per forward, one per stage.
    """
    from spd_ds.models.graphs import GraphedStage

    cuda = target.device.type == "cuda"
    use_graph = cuda if use_graph is None else use_graph
    max_len = max_len or position + 64
    out = []
    for stage in target.stages:
        gs = GraphedStage(stage, max_len, use_graph=use_graph)
        h = torch.randn(1, 1, target.arch.hidden_size, dtype=target.dtype, device=target.device) * 0.1
        for _ in range(3):
            gs.step(h, position)
        if cuda:
            torch.cuda.synchronize(target.device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                gs.step(None, None)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                gs.step(None, None)
            out.append(1e3 * (time.perf_counter() - t) / iters)
        del gs
    return out


def slowest(values: Sequence[float]) -> float:
    """Largest value (0.0 for an empty list)."""
    return max(values) if values else 0.0
