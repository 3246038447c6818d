"""Autoregressive baselines measured in the same run, on the same device, as SPD (a small pluggable registry).

A baseline is anything with ``generate(prompt: list[int], max_new_tokens: int) -> GenerationResult`` whose
``metrics`` carry ``prefill_s``, ``decode_s`` and ``num_new_tokens`` (the prefill token included, as for SPD). The
registry maps a name to a factory ``f(ctx: BaselineContext) -> baseline``, or to a lazily imported ``"module:attr"``
string naming a class with the AR-decoder constructor ``cls(target, sampling, eos_token_ids, max_len)``:

=============== =========================================================================================
``hf_generate`` transformers' ``generate`` (dynamic cache, eager), the model loaded with
                ``AutoModelForCausalLM`` from the same directory in the same dtype; greedy, or sampling with the
                same warpers (temperature, top-k, top-p; its own random stream, so only the distribution matches)
``ar``          :class:`spd_ds.decoding.ar.ARDecoder`: AR on the same stage code (the exactness reference)
``ar_graph``    :class:`spd_ds.decoding.ar_graph.ARGraphDecoder`: static KV cache + one CUDA graph per token (the
                strongest single-device AR we run; eager static forward on CPU)
``tp_ar``       AR with DeepSpeed AutoTP tensor parallelism over every rank of a pipeline-engine run
                (:mod:`spd_ds.eval.tp_baseline`; measured by the runner on all ranks, never built here)
=============== =========================================================================================

:func:`register_baseline` adds or replaces an entry (e.g. a faster AR from ``spd_ds.models.graphs``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from typing import Callable, Protocol, Sequence, Union

import torch

from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.decoding.cycle import GenerationResult, check_prompt, eos_set
from spd_ds.decoding.sampling import SamplingParams, request_key
from spd_ds.models.adapter import Target

log = logging.getLogger(__name__)


class Baseline(Protocol):
    """What the evaluation needs from a baseline."""

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """AR continuation of ``prompt`` (token ids), at most ``max_new_tokens`` tokens (the prefill token included)."""


@dataclasses.dataclass
class BaselineContext:
    """Everything a baseline factory may use (all built once per run).

    Attributes:
        target: the whole target in this process (stages + ends) on ``device`` in ``dtype``.
        sampling: decoding distribution of the run.
        eos_token_ids: ids that end generation (may be empty: never stop early).
        max_len: KV capacity in positions.
        attn_implementation: transformers attention backend (``model.attn_implementation``).
    """

    target: Target
    sampling: SamplingParams
    eos_token_ids: list[int]
    max_len: int
    attn_implementation: str = "sdpa"

    @property
    def arch(self):
        """The target's :class:`~spd_ds.models.adapter.TargetArch`."""
        return self.target.arch

    @property
    def device(self) -> torch.device:
        """The target's device."""
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        """The target's compute dtype."""
        return self.target.dtype


BaselineFactory = Callable[[BaselineContext], Baseline]
BASELINES: dict[str, Union[str, BaselineFactory]] = {
    "hf_generate": "spd_ds.eval.baselines:HFGenerateBaseline",
    "ar": "spd_ds.decoding.ar:ARDecoder",
    "ar_graph": "spd_ds.decoding.ar_graph:ARGraphDecoder",
    "tp_ar": "spd_ds.eval.tp_baseline:unavailable",  # over every rank of the pipeline engine, not built here
}


def register_baseline(name: str, factory: Union[str, BaselineFactory]) -> None:
    """Add (or replace) baseline ``name``: a factory ``f(ctx) -> Baseline`` or a ``"module:Class"`` string for a class
    with the AR-decoder constructor ``cls(target, sampling, eos_token_ids, max_len)``."""
    BASELINES[name] = factory


def check_baseline_names(names: Sequence[str]) -> None:
    """Refuse an ``eval.baselines`` list that names a baseline not in :data:`BASELINES` (the message lists the known
    names) or one twice (one report row per name: the second run would replace the first's results). Needs no model
    or prompt: the eval and benchmark commands call it right after the config is read.

    Raises:
        ConfigError: one line naming the value and what to give instead.
    """
    from spd_ds.cli_args import repeated
    from spd_ds.config import ConfigError

    unknown = [b for b in names if b not in BASELINES]
    if unknown:
        raise ConfigError(f"unknown baseline(s) {unknown} in eval.baselines; known: {', '.join(BASELINES)}")
    twice = repeated(names)
    if twice:
        raise ConfigError(f"eval.baselines names {twice[0]} twice ({list(names)}); give each once")


def resolve_baseline(name: str) -> BaselineFactory:
    """The factory of baseline ``name`` (importing its module now).

    Raises:
        ValueError: unknown name (the message lists the known ones).
        ImportError: the registered module or attribute does not exist.
    """
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)} (eval.baselines)")
    entry = BASELINES[name]
    if not isinstance(entry, str):
        return entry
    mod, _, attr = entry.partition(":")
    obj = getattr(importlib.import_module(mod), attr)
    if isinstance(obj, type) and hasattr(obj, "from_context"):
        return obj.from_context
    if isinstance(obj, type):
        return lambda ctx: obj(ctx.target, ctx.sampling, ctx.eos_token_ids, ctx.max_len)
    return obj


def build_baseline(name: str, ctx: BaselineContext) -> Baseline:
    """Instantiate baseline ``name`` for this run (see :func:`resolve_baseline` for errors)."""
    return resolve_baseline(name)(ctx)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _FirstTokenClock:
    """A ``transformers`` ``StoppingCriteria`` that stops nothing: it records ``time.perf_counter()`` at its first
    call, which ``generate`` makes once the first new token exists (after the prefill), syncing the device first.
    Every call returns the same all-False ``[batch]`` bool tensor (made at the first call; ``generate`` combines it
    out of place), so the timed decode steps allocate and launch nothing for it."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.t, self._never = device, None, None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.t is None:
            _sync(self.device)
            self.t = time.perf_counter()
            self._never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self._never


class HFGenerateBaseline:
    """transformers ``generate`` on an ``AutoModelForCausalLM`` of the same model, dtype and device.

    A checkpoint directory is loaded with ``from_pretrained``; a random-weight shape (no checkpoint) is built with
    ``from_config`` and gets the target's own tensors, so both compute with identical weights.

    Both times come from the one ``generate`` call: ``prefill_s`` from its start to its first token (a
    ``StoppingCriteria`` hook, called after every new token, reads the clock once, after a
    ``torch.cuda.synchronize`` on GPU), ``decode_s`` from there to its end. (The reference project's method, a
    separately timed prompt forward subtracted from the ``generate`` time, subtracted a forward that computed every
    position's logits where ``generate`` computes the last one's, and could go negative on answers of a token or
    two.)

    Args:
        model: the HF causal LM (eval mode, on its device).
        sampling, eos_token_ids: as for the other decoders.
    """

    def __init__(self, model, sampling: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        from transformers import GenerationConfig

        self.model, self.sampling = model, sampling
        self.eos = sorted(eos_set(eos_token_ids))
        self.device = next(model.parameters()).device
        kw = dict(do_sample=False, temperature=None, top_k=None, top_p=None) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        # an explicit (possibly empty) EOS list: ``None`` would fall back to the model's generation config
        self.gen_kwargs = dict(kw, eos_token_id=list(self.eos), pad_token_id=self.eos[0] if self.eos else 0)
        self.generate_kwargs: dict = {}  # extra ``generate`` arguments (``tp_ar``: ``synced_gpus=True``)
        self._gc = GenerationConfig

    @classmethod
    def from_context(cls, ctx: BaselineContext) -> "HFGenerateBaseline":
        """Load the model for ``ctx`` (see the class docstring)."""
        from transformers import AutoModelForCausalLM

        arch = ctx.arch
        if getattr(arch, "random_weights", False):
            with torch.device(ctx.device):
                model = AutoModelForCausalLM.from_config(arch.config, dtype=ctx.dtype)
            copy_target_weights(model, ctx.target)
        else:
            model = AutoModelForCausalLM.from_pretrained(arch.model_dir, dtype=ctx.dtype,
                                                         attn_implementation=ctx.attn_implementation)
            model.to(ctx.device)
        model.eval().requires_grad_(False)
        return cls(model, ctx.sampling, ctx.eos_token_ids)

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """``generate`` of at most ``max_new_tokens`` tokens; the output is cut after the first EOS."""
        check_prompt(prompt, max_new_tokens, 1 << 30, 1)
        ids = torch.tensor([list(prompt)], device=self.device)
        mask = torch.ones_like(ids)
        metrics = SPDMetrics(num_stages=1)
        gc = self._gc(max_new_tokens=max_new_tokens, min_new_tokens=0, **self.gen_kwargs)
        if not self.sampling.greedy:  # its own generator, seeded per request (independent draws per prompt)
            torch.manual_seed(request_key(self.sampling.seed, self.sampling.request) & ((1 << 63) - 1))
        from transformers import StoppingCriteriaList

        clock = _FirstTokenClock(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, generation_config=gc,
                                  stopping_criteria=StoppingCriteriaList([clock]),
                                  **self.generate_kwargs)
        _sync(self.device)
        t_end = time.perf_counter()
        t_first = t_end if clock.t is None else clock.t
        metrics.observe_prefill(t_first - t0)
        tokens = out[0, ids.shape[1]:].tolist()
        for i, t in enumerate(tokens):
            if t in self.eos:
                tokens = tokens[: i + 1]
                break
        metrics.observe_cycle(max(len(tokens) - 1, 0))
        metrics.close(len(tokens), t_end - t_first)
        finish = "eos" if tokens and tokens[-1] in self.eos else "length"
        return GenerationResult(tokens, finish, metrics)


@torch.no_grad()
def copy_target_weights(model, target: Target) -> None:
    """Copy a :class:`~spd_ds.models.adapter.Target`'s tensors into the HF model of the same architecture (HF names:
    ``model.embed_tokens.weight``, ``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight``).

    Raises:
        KeyError: an HF parameter with no counterpart in the target.
    """
    src: dict[str, torch.Tensor] = {"model.embed_tokens.weight": target.ends.embedding.weight,
                                     "lm_head.weight": target.ends.lm_head.weight}
    src.update({f"model.norm.{k}": v for k, v in target.ends.norm.named_parameters()})
    for stage in target.stages:
        for i, layer in zip(stage.layer_ids, stage.layers):
            src.update({f"model.layers.{i}.{k}": v for k, v in layer.named_parameters()})
    for name, p in model.named_parameters():
        if name not in src:
            raise KeyError(f"HF parameter {name} has no counterpart in the target")
        p.copy_(src[name])
