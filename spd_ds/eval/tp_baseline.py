"""``tp_ar``: autoregressive decoding with tensor parallelism over every rank of the run, the strongest AR use of the
same devices SPD's pipeline runs on.

Every rank loads the whole target as a transformers ``AutoModelForCausalLM`` (a random-weight shape gets the tensors
of :func:`spd_ds.builder.build_target`, which are seeded and so equal on every rank), then DeepSpeed inference's
automatic tensor parallelism (``deepspeed.init_inference(tensor_parallel={"tp_size": world})``) shards its linear
layers over the ranks and inserts the all-reduces. Decoding runs the sharded decoder layers the way ``ar_graph`` runs
the whole target: :class:`~spd_ds.decoding.ar_graph.ARGraphDecoder` over static KV caches of this rank's KV heads
(:class:`TPShardTarget`), one CUDA graph per token on GPU (the all-reduces captured inside it), the same static
forward eagerly on CPU. If a rank cannot capture its graph, every rank falls back to transformers ``generate``
(dynamic cache, eager), timed as :class:`spd_ds.eval.baselines.HFGenerateBaseline` times it; the method's
description says which ran. All ranks decode the same prompt in lockstep; rank 0 keeps the results. The split
changes the order of the reductions, so in bf16 its tokens may part from ``ar`` at near-ties: it is a speed
baseline, its exactness is reported, not required.

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


def check_tp_request(baselines, engine: str, world: int, arch=None) -> None:
    """Refuse ``tp_ar`` where it cannot run, before any collective.

    Args:
        baselines: the run's ``eval.baselines`` names.
        engine: ``"reference"`` or ``"deepspeed"``; world: processes in the run.
        arch: the target's :class:`~spd_ds.models.adapter.TargetArch` (checked by :func:`tp_unsupported`).
    Raises:
        ConfigError: ``tp_ar`` asked for with the reference engine, a world of one process, or a target AutoTP cannot
            split.
    """
    if NAME not in baselines:
        return
    if engine != "deepspeed" or world < 2:
        raise ConfigError(f"eval.baselines has {NAME}, which needs the pipeline engine over >= 2 ranks (e.g. "
                          f"deepspeed --num_gpus 2 launch/eval.py ...); this run is engine {engine}, world {world}: "
                          f"drop {NAME} from eval.baselines")
    why = tp_unsupported(arch) if arch is not None else None
    if why:
        raise ConfigError(f"eval.baselines has {NAME}, but {why}: drop {NAME} from eval.baselines")


def tp_unsupported(arch) -> str | None:
    """Why DeepSpeed AutoTP cannot split this target, or ``None`` when it can.

    Hybrid targets (Qwen3.5) are refused: AutoTP shards the Gated DeltaNet input projections but not their per-head
    ``dt_bias`` / ``A_log``, so the sharded model fails in its first forward.
    """
    if arch.hybrid:
        return (f"DeepSpeed AutoTP cannot split {arch.config.model_type}'s linear-attention (Gated DeltaNet) layers "
                "(their per-head parameters stay whole)")
    return None


def build_tp_model(cfg, arch, device: torch.device, world: int):
    """The target as an HF causal LM, sharded over ``world`` ranks by DeepSpeed AutoTP (every rank calls this).

    The whole model is first built on ``device`` (a checkpoint with ``from_pretrained``; a random-weight shape with
    uninitialised ``from_config`` storage filled from :func:`spd_ds.builder.build_target`'s seeded tensors, which are
    equal on every rank), then AutoTP keeps this rank's slices.

    Args:
        cfg: the experiment (``model.dtype``, ``model.attn_implementation``).
        arch: the target's :class:`~spd_ds.models.adapter.TargetArch`.
        device: this rank's device.
        world: tensor-parallel degree (the process group's size).
    Returns:
        The sharded ``torch.nn.Module`` (eval mode, on ``device``), callable like the HF model (``generate`` too).
    """
    import contextlib

    import deepspeed
    from transformers import AutoModelForCausalLM

    from spd_ds.eval.baselines import copy_target_weights

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise, then overwrite
        no_init_weights = contextlib.nullcontext
    dtype = resolve_dtype(cfg.model.dtype)
    if arch.random_weights:  # seeded tensors of the stage code, identical on every rank
        target = builder.build_target(cfg, arch, builder.build_partition(cfg, arch), device)
        with torch.device(device), no_init_weights():
            model = AutoModelForCausalLM.from_config(arch.config, dtype=dtype,
                                                     attn_implementation=cfg.model.attn_implementation)
        copy_target_weights(model, target)
        del target
    else:
        model = AutoModelForCausalLM.from_pretrained(arch.model_dir, dtype=dtype,
                                                     attn_implementation=cfg.model.attn_implementation).to(device)
    model.eval().requires_grad_(False)
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=dtype,
                                      replace_with_kernel_inject=False)
    module = engine.module.to(device)
    gc.collect()
    return module


class _ShardStage(torch.nn.Module):
    """The sharded model's decoder layers as one stage for :func:`~spd_ds.models.graphs.static_stage_forward`
    (the attributes :class:`~spd_ds.models.adapter.TargetStage` offers it: ``arch``, ``layer_ids``, ``layers``,
    ``rotary``, ``capture``)."""

    def __init__(self, arch, layers, device) -> None:
        super().__init__()
        self.arch, self.layers = arch, layers
        self.layer_ids = list(range(len(layers)))
        self.rotary = arch.make_rotary().to(device)  # as TargetStage builds it (fp32 inv_freq)
        self.rotary.inv_freq = self.rotary.inv_freq.float()
        self.capture: dict[int, int] = {}


class _ShardEnds:
    """Embedding, final norm and LM head of the sharded model (``embed`` / ``logits`` of
    :class:`~spd_ds.models.adapter.TargetEnds`)."""

    def __init__(self, model) -> None:
        self.embedding, self.norm, self.lm_head = model.get_input_embeddings(), model.model.norm, model.lm_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [1, q] int64 -> [1, q, H]`` in the model's dtype."""
        return self.embedding(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw last-layer states ``[.., H]`` -> final norm -> LM head (its all-reduce when AutoTP split it) -> fp32
        ``[.., V]``."""
        h = self.norm(hidden)
        out = self.lm_head(h.reshape(1, -1, h.shape[-1]))  # AutoTP's sharded LM head wants [B, q, H]
        return out.reshape(*hidden.shape[:-1], out.shape[-1]).float()


class TPShardTarget:
    """This rank's shard of an AutoTP-split HF causal LM, seen as a one-stage target by
    :class:`~spd_ds.decoding.ar_graph.ARGraphDecoder` (``arch``, ``device``, ``stages``, ``ends``).

    Args:
        model: the module :func:`build_tp_model` returns (a ``*ForCausalLM`` whose ``model.layers`` hold the sharded
            linears and their all-reduces).
        arch: the target's :class:`~spd_ds.models.adapter.TargetArch`.
        device: this rank's device.

    Attributes:
        kv_heads: KV heads this rank holds (AutoTP splits them as evenly as it can: 3 over 2 ranks -> 2 and 1).

    Raises:
        ValueError: the model has linear-attention layers (AutoTP cannot split them: :func:`tp_unsupported`).
    """

    def __init__(self, model, arch, device) -> None:
        if arch.hybrid:
            raise ValueError(tp_unsupported(arch))
        self.arch, self.device = arch, torch.device(device)
        layers = model.model.layers
        self.stages = [_ShardStage(arch, layers, self.device)]
        self.ends = _ShardEnds(model)
        k = layers[0].self_attn.k_proj.weight
        self.kv_heads = k.shape[0] // arch.head_dim
        self.dtype = k.dtype

    def static_caches(self, max_len: int) -> list:
        """One static :class:`~spd_ds.models.kv_cache.StageKVCache` of this rank's KV heads, ``max_len`` positions."""
        from spd_ds.models.kv_cache import StageKVCache

        return [StageKVCache(self.stages[0].layer_ids, self.kv_heads, self.arch.head_dim, max_len, self.dtype,
                             self.device, static=True)]


def tp_graph_decoder(model, arch, cfg, device):
    """:class:`~spd_ds.decoding.ar_graph.ARGraphDecoder` over this rank's shard (:class:`TPShardTarget`): graphed on
    CUDA, the same static forward eagerly on CPU. Every rank calls it (the warm-up and capture run collectives).

    Args:
        model: this rank's shard (:func:`build_tp_model`); arch: the target's
            :class:`~spd_ds.models.adapter.TargetArch`.
        cfg: the experiment (``decoding.max_length``: KV positions; ``decoding.eos_token_ids``; sampling).
        device: this rank's device.
    Returns:
        The decoder (``generate(prompt ids, max_new_tokens) -> GenerationResult``; ``graphed`` says whether it
        replays a CUDA graph).
    Raises:
        RuntimeError: the capture failed (e.g. a collective that cannot be captured). ValueError: a hybrid target.
        AttributeError: a model without ``model.layers[i].self_attn.k_proj`` / ``model.norm`` / ``lm_head``.
    """
    from spd_ds.decoding.ar_graph import ARGraphDecoder

    shard = TPShardTarget(model, arch, device)
    log.info("%s: this rank holds %d of the %d KV heads", NAME, shard.kv_heads, arch.num_kv_heads)
    max_len = min(cfg.decoding.max_length, arch.max_positions)
    return ARGraphDecoder(shard, builder.sampling_params(cfg), list(cfg.decoding.eos_token_ids), max_len,
                          caches=shard.static_caches(max_len))


def _all_ok(ok: bool) -> bool:
    """Whether every rank reports ``ok`` (one all-reduce over the default group)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if ok else 0.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0.5)


def run_tp_baseline(cfg, arch, prompts, indices, warm, head_rank: bool, world: int):
    """Measure ``tp_ar`` on ``prompts[i] for i in indices`` after ``warm`` untimed prompts (every rank, same order).

    A rank whose model fails to build tells the others (one all-reduce), and every rank then skips ``tp_ar`` with a
    logged error, so the SPD results of the run are still written; decoding uses ``synced_gpus`` so that no rank leaves
    the decode loop before the others.

    Args:
        cfg: the experiment; arch: the target's architecture.
        prompts: the run's timed prompts (:class:`~spd_ds.eval.prompts.EvalPrompt`); indices: which to run.
        warm: warm-up prompts (untimed; warm-up ``j`` uses the sampling key of ``indices[j % len(indices)]``, a timed
            prompt ``i`` its own, ``i``, as SPD does).
        head_rank: whether this rank keeps the results; world: the process group's size.
    Returns:
        On the head rank a :class:`~spd_ds.eval.runner.MethodRun` (``devices = world``), else (and when skipped)
        ``None``.
    """
    from deepspeed.inference.engine import InferenceEngine

    from spd_ds.eval.baselines import HFGenerateBaseline
    from spd_ds.eval.runner import MethodRun, _local_device, measure_baseline

    device = _local_device(cfg)
    sampling = builder.sampling_params(cfg)
    model, err = None, None
    try:
        model = build_tp_model(cfg, arch, device, world)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before the next collective
        err = e
        log.error("%s: building the tensor-parallel model failed on this rank: %s", NAME, e)
    if not _all_ok(err is None):
        log.error("%s skipped on every rank: a rank could not build its shard (see its log)", NAME)
        InferenceEngine.inference_mp_group = None
        return None
    base, err = None, None
    try:
        base = tp_graph_decoder(model, arch, cfg, device)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before the next collective
        err = e
        log.error("%s: the static-cache decoder failed on this rank (%s); every rank falls back to transformers "
                  "generate", NAME, e)
    if _all_ok(err is None):
        how = ("static KV cache, one CUDA graph per token" if base.graphed else "static KV cache, eager")
    else:
        base = HFGenerateBaseline(model, sampling, list(cfg.decoding.eos_token_ids))
        base.generate_kwargs["synced_gpus"] = True  # ranks stop together
        how = "transformers generate, eager"
    moe = any(getattr(arch.config, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    run = MethodRun(NAME, "baseline", 1, f"DeepSpeed AutoTP over {world} ranks, {how}"
                    + ("; MoE experts are not split (every rank holds them all)" if moe else ""), devices=world)
    measure_baseline(base, run, prompts, indices, warm, sampling, cfg.decoding.max_new_tokens, device)
    del base, model
    InferenceEngine.inference_mp_group = None  # DeepSpeed caches the group on the class; ours may be destroyed next
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
