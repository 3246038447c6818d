"""Speed yardsticks for the benchmark tables: bytes read per token, achieved bandwidth, one stage's forward alone.

At batch 1 a decode step reads every weight once, so ``bytes per token / HBM bandwidth`` is its floor (gpt-fast
reports achieved GB/s = bytes per token x tokens/s). The bytes counted are the decoder layers, the final norm and
the LM head; the embedding table is not counted (one row is read), except as the LM head when the two are tied.
Achieved GB/s and the fraction of the memory bandwidth are reported on GPUs only, against that GPU's own figure
(:func:`device_bandwidth`): a CPU run has no HBM to compare with.
"""

from __future__ import annotations

import re
import time
from typing import Sequence

import torch

# Memory bandwidth of known GPUs in GB/s (1e9 bytes/s): (regular expression on torch.cuda.get_device_name, GB/s,
# where the figure comes from); the first match wins. The H200's is the copy bandwidth measured on the project's
# machine (a device-to-device copy), the others are NVIDIA's datasheet peaks.
GPU_BANDWIDTH_GBPS: tuple[tuple[str, float, str], ...] = (
    (r"\bH200\b", 4270.0, "copy bandwidth measured on one H200 (device-to-device copy; datasheet 4800)"),
    (r"\bH100\b.*\bPCIe\b", 2000.0, "NVIDIA datasheet, H100 PCIe"),
    (r"\bH100\b.*\bNVL\b", 3900.0, "NVIDIA datasheet, H100 NVL"),
    (r"\bH100\b", 3350.0, "NVIDIA datasheet, H100 SXM"),
    (r"\bA100\b.*80GB.*PCIe", 1935.0, "NVIDIA datasheet, A100 80GB PCIe"),
    (r"\bA100\b.*80GB", 2039.0, "NVIDIA datasheet, A100 80GB SXM"),
    (r"\bA100\b", 1555.0, "NVIDIA datasheet, A100 40GB"),
    (r"\bL40S\b", 864.0, "NVIDIA datasheet, L40S"),
    (r"\bL4\b", 300.0, "NVIDIA datasheet, L4"),
    (r"\bA10G?\b", 600.0, "NVIDIA datasheet, A10"),
    (r"\bV100\b", 900.0, "NVIDIA datasheet, V100"),
)


def known_bandwidth(device_name: str) -> tuple[float, str] | None:
    """``(GB/s, source)`` of a GPU by its name (``torch.cuda.get_device_name``), or ``None`` if not in
    :data:`GPU_BANDWIDTH_GBPS`."""
    for pattern, gbps, source in GPU_BANDWIDTH_GBPS:
        if re.search(pattern, device_name):
            return gbps, source
    return None


def device_bandwidth(device: str, override_gbps: float | None = None) -> dict | None:
    """The memory bandwidth the % HBM column is measured against, for the device a run used.

    Args:
        device: the run's device (``"cpu"``, ``"cuda:0"``).
        override_gbps: ``eval.hbm_gbps`` (GB/s per device), or ``None`` for the GPU's figure from
            :data:`GPU_BANDWIDTH_GBPS`.
    Returns:
        ``None`` off GPU (no bandwidth column there), else ``{"device_name", "gbps", "source"}``; ``gbps`` is
        ``None`` for a GPU not in the table and no override.
    """
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    try:
        name = torch.cuda.get_device_name(torch.device(device))
    except (RuntimeError, AssertionError):
        name = "unknown GPU"
    if override_gbps:
        return {"device_name": name, "gbps": float(override_gbps), "source": "eval.hbm_gbps"}
    known = known_bandwidth(name)
    if known is None:
        return {"device_name": name, "gbps": None, "source": "not a known GPU: set eval.hbm_gbps"}
    return {"device_name": name, "gbps": known[0], "source": known[1]}


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
