"""Sampling warpers and keyed randomness shared by every decoding path.

Randomness is keyed by ``(seed, request, position, stream)`` instead of drawn from a stateful generator, so the
reference decoder, the DeepSpeed engine and the AR baselines consume exactly the same uniforms for the same event
whatever order they run in. Each output position's decision uses its own fresh uniforms, which keeps speculative
sampling exact (the uniforms of position ``t`` are independent of everything that decided positions ``< t``).

Keying: ``seed`` is ``decoding.seed``, one per run; ``request`` is the prompt's index in the run (0, 1, 2, ... in the
order the prompts are given; the launchers and the evaluation pass it through :meth:`SamplingParams.for_request`),
so prompts of equal length get independent uniforms; ``position`` is the token position the decision is for;
``stream`` names the decision (draft sample, accept coin, target sample, oracle coin). The uniform is
``splitmix64`` applied along ``seed -> request -> position -> stream`` (:func:`keyed_uniform`). The same seed and
request give the same tokens in every decoder whose logits agree to the bit (on CPU torch's attention rounds
differently with the number of threads: a draw near a bound of the cumulative distribution can then pick the next
token, from the same distribution).
"""

from __future__ import annotations

import dataclasses

import torch

STREAM_DRAFT = 1  # sampling the draft token at a position
STREAM_ACCEPT = 2  # the accept/reject coin of the verification at a position
STREAM_TARGET = 3  # sampling from the target (residual after a rejection, prefill token, AR decoding)
STREAM_ORACLE = 4  # the oracle drafter's acceptance coin

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_key(seed: int, request: int = 0) -> int:
    """The 64-bit key of request ``request`` (a prompt's index in the run) under run seed ``seed``."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (request & _MASK64))


def keyed_uniform(seed: int, position: int, stream: int, request: int = 0) -> float:
    """A uniform float in ``[0, 1)`` that depends only on ``(seed, request, position, stream)`` (53-bit resolution).

    Args:
        seed: the run's seed (``decoding.seed``), any int (taken modulo 2**64).
        position: token position of the decision.
        stream: which decision (``STREAM_*``).
        request: the prompt's index in the run (0 for a single generation).
    """
    x = _splitmix64(_splitmix64(request_key(seed, request) ^ (position & _MASK64)) ^ stream)
    return (x >> 11) * (1.0 / (1 << 53))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding distribution: ``temperature == 0`` is greedy; otherwise ``softmax(top_p(top_k(logits / T)))``.

    Attributes:
        temperature: T >= 0.
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus mass in (0, 1] (1 = off).
        seed: the run's seed, first part of the key of every uniform.
        request: index of the generation's prompt in the run, second part of the key (see the module docstring).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    request: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"decoding.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"decoding.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"decoding.top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True at temperature 0 (argmax decoding, exact-match verification)."""
        return self.temperature == 0.0

    def for_request(self, request: int) -> "SamplingParams":
        """The same distribution and seed for request ``request`` (a prompt's index in the run)."""
        return dataclasses.replace(self, request=int(request))

    def uniform(self, position: int, stream: int) -> float:
        """This generation's uniform for ``(position, stream)``: :func:`keyed_uniform` of ``(seed, request)``."""
        return keyed_uniform(self.seed, position, stream, self.request)


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p on fp32 logits ``[..., V]``; filtered entries become ``-inf``."""
    x = logits.float() / params.temperature
    V = x.shape[-1]
    if params.top_k and params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= params.top_p  # keep the smallest prefix reaching p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped distribution ``[..., V]`` in fp32 (requires ``temperature > 0``)."""
    return torch.softmax(warp_logits(logits, params), dim=-1)


def sample_from_probs(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of ``probs [V]`` (fp32, non-negative, any positive sum) with uniform ``u``; never picks a
    zero-probability token."""
    cdf = probs.float().cumsum(0)
    idx = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True).item())
    if idx >= probs.shape[0] or probs[idx] <= 0:
        idx = int((probs > 0).nonzero().max().item()) if idx >= probs.shape[0] else idx
        while probs[idx] <= 0:
            idx -= 1
    return idx
