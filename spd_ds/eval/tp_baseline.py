"""``tp_ar``: autoregressive decoding with tensor parallelism over every rank of the run, the strongest AR use of the
same devices SPD's pipeline runs on.

Every rank loads the whole target as a transformers ``AutoModelForCausalLM`` (a random-weight shape gets the tensors
of :func:`spd_ds.builder.build_target`, which are seeded and so equal on every rank), then DeepSpeed inference's
automatic tensor parallelism (``deepspeed.init_inference(tensor_parallel={"tp_size": world})``) shards its linear
layers over the ranks and inserts the all-reduces; decoding is transformers ``generate`` (dynamic cache, eager), timed
as :class:`spd_ds.eval.baselines.HFGenerateBaseline` times it. All ranks decode the same prompt in lockstep; rank 0
keeps the results. The split changes the order of the reductions, so in bf16 its tokens may part from ``ar`` at
near-ties: it is a speed baseline, its exactness is reported, not required.

It runs in :func:`spd_ds.eval.runner.run_eval` with the pipeline engine, after the pipeline sessions and before the
single-process baselines; asking for it in a single-process run is a :class:`~spd_ds.config.ConfigError`.
"""

from __future__ import annotations

import gc
import logging

import torch

from spd_ds import builder
from spd_ds.config import ConfigError
from spd_ds.models.adapter import resolve_dtype

log = logging.getLogger(__name__)

NAME = "tp_ar"


def check_tp_request(baselines, engine: str, world: int) -> None:
    """Refuse ``tp_ar`` where it cannot run, before any collective.

    Raises:
        ConfigError: ``tp_ar`` asked for with the reference engine or a world of one process.
    """
    if NAME in baselines and (engine != "deepspeed" or world < 2):
        raise ConfigError(f"eval.baselines has {NAME}, which needs the pipeline engine over >= 2 ranks (e.g. "
                          f"deepspeed --num_gpus 2 launch/eval.py ...); this run is engine {engine}, world {world}: "
                          f"drop {NAME} from eval.baselines")


def build_tp_model(cfg, arch, device: torch.device, world: int):
    """The target as an HF causal LM, sharded over ``world`` ranks by DeepSpeed AutoTP (every rank calls this).

    Args:
        cfg: the experiment (``model.dtype``, ``model.attn_implementation``).
        arch: the target's :class:`~spd_ds.models.adapter.TargetArch`.
        device: this rank's device.
        world: tensor-parallel degree (the process group's size).
    Returns:
        The sharded ``torch.nn.Module`` (eval mode, on ``device``), callable like the HF model (``generate`` too).
    """
    import deepspeed
    from transformers import AutoModelForCausalLM

    from spd_ds.eval.baselines import copy_target_weights

    dtype = resolve_dtype(cfg.model.dtype)
    if getattr(arch, "random_weights", False):  # seeded tensors of the stage code, identical on every rank
        part = builder.build_partition(cfg, arch)
        target = builder.build_target(cfg, arch, part, torch.device("cpu"))
        model = AutoModelForCausalLM.from_config(arch.config, dtype=dtype)
        copy_target_weights(model, target)
        del target
    else:
        model = AutoModelForCausalLM.from_pretrained(arch.model_dir, dtype=dtype,
                                                     attn_implementation=cfg.model.attn_implementation)
    model.eval().requires_grad_(False)
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=dtype,
                                      replace_with_kernel_inject=False)
    module = engine.module.to(device)
    gc.collect()
    return module


def run_tp_baseline(cfg, arch, prompts, indices, warm, head_rank: bool, world: int):
    """Measure ``tp_ar`` on ``prompts[i] for i in indices`` after ``warm`` untimed prompts (every rank, same order).

    Args:
        cfg: the experiment; arch: the target's architecture.
        prompts: the run's timed prompts (:class:`~spd_ds.eval.prompts.EvalPrompt`); indices: which to run.
        warm: warm-up prompts (untimed; warm-up ``j`` uses the sampling key of ``indices[j % len(indices)]``, a timed
            prompt ``i`` its own, ``i``, as SPD does).
        head_rank: whether this rank keeps the results; world: the process group's size.
    Returns:
        On the head rank a :class:`~spd_ds.eval.runner.MethodRun` (``devices = world``), else ``None``.
    """
    from spd_ds.eval.baselines import HFGenerateBaseline
    from spd_ds.eval.runner import MethodRun, _local_device, timed_generate

    device = _local_device(cfg)
    sampling = builder.sampling_params(cfg)
    model = build_tp_model(cfg, arch, device, world)
    base = HFGenerateBaseline(model, sampling, list(cfg.decoding.eos_token_ids))
    max_new = cfg.decoding.max_new_tokens
    run = MethodRun(NAME, "baseline", 1, f"transformers generate, DeepSpeed AutoTP over {world} ranks (eager)",
                    devices=world)
    for j, p in enumerate(warm):
        base.sampling = sampling.for_request(indices[j % len(indices)])
        timed_generate(base.generate, p.ids, max_new, device)
    for i in indices:
        base.sampling = sampling.for_request(i)
        res, wall = timed_generate(base.generate, prompts[i].ids, max_new, device)
        run.results[i], run.wall_s[i] = res, wall
    del base, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run if head_rank else None


def unavailable(ctx):
    """Registry entry of ``tp_ar``: it is never built by a single process (see :func:`check_tp_request`).

    Raises:
        ConfigError: always.
    """
    raise ConfigError(f"{NAME} runs over all ranks of the pipeline engine (deepspeed --num_gpus N ...), "
                      "not as a single-process baseline")
