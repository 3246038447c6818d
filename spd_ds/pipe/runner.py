"""Distributed SPD entry point: ``run_distributed_inference`` and the session it runs on.

Launch (every rank runs the same program)::

    deepspeed --num_gpus N launch/infer.py --config EXP.yaml          # one node (CPU: N gloo processes)
    deepspeed --hostfile hosts --launcher openmpi ... launch/infer.py   # several nodes (docs/distributed.md)

Order of work on every rank, chosen so that a bad configuration fails *before* any collective can hang:
architecture and partition (local files only) -> every stage's tensors against the config (safetensors headers, so
every rank prints a damaged checkpoint's own line) -> world size against the plan -> prompts against the context ->
DeepSpeed config -> ``deepspeed.init_distributed`` -> :class:`~spd_ds.pipe.module.SPDPipelineModule` (each rank
builds its own stages) -> ``deepspeed.initialize`` with :class:`~spd_ds.pipe.engine.SPDPipelineEngine` -> links
and a warm-up message through every link -> generations (head) / serving (stages) -> SHUTDOWN -> process groups
destroyed.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from spd_ds.builder import resolve_path
from spd_ds.config import ConfigError, ExperimentConfig, read_json_object
from spd_ds.decoding.drafters import Drafter
from spd_ds.decoding.cycle import GenerationResult, check_prompt
from spd_ds.dist import init_process_group, init_timeout_s
from spd_ds.pipe.comm import PipeCommError, first_line, peer_gone
from spd_ds.pipe.topology import PipePlan, WorldSizeError, detect_world_size

logger = logging.getLogger(__name__)

DEFAULT_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1 << 30,
    "wall_clock_breakdown": False,
}

# drafter_factory(head, prompt, ar_reference) -> Drafter; ``ar_reference()`` runs greedy AR through the pipeline
# (drafters.oracle_reference_sampling) and returns prompt + continuation (the oracle's source).
DrafterFactory = Callable[[object, list, Callable[[], list]], Drafter]


def load_ds_config(cfg: ExperimentConfig) -> dict:
    """The DeepSpeed JSON config: ``deepspeed.config``, else ``ds_configs/infer.json``, else built-in defaults (a
    relative path is looked for in the working directory, then in the repository: :func:`spd_ds.builder.resolve_path`).

    Raises:
        ConfigError: missing file, bad JSON, or fp16/bf16 enabled (the dtype is ``model.dtype``; DeepSpeed would cast
            every module, the head included).
    """
    path = cfg.deepspeed.config
    p = Path(resolve_path(path or "ds_configs/infer.json"))  # the working directory, else the repository
    if p.exists():
        ds = read_json_object(p, "deepspeed.config", "fix the file or set another deepspeed.config")
    elif path:
        raise ConfigError(f"deepspeed.config {path} not found")
    else:
        ds = dict(DEFAULT_DS_CONFIG)
    for key in ("fp16", "bf16", "bfloat16"):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") not in (False, "auto", None):
            raise ConfigError(f"{key} is enabled in the DeepSpeed config; set model.dtype instead (DeepSpeed would "
                              "cast the head and the target's ends too)")
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") == "auto":
            ds[key]["enabled"] = False
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds.setdefault("gradient_accumulation_steps", 1)
    ds.pop("train_batch_size", None)  # derived: micro * accumulation * data-parallel (1)
    return ds


def init_distributed(cfg: ExperimentConfig, plan: PipePlan) -> bool:
    """:func:`init_process_group` with the experiment's backend and :func:`init_timeout_s`, then check the world.

    Returns whether this call initialised the process group.

    Raises:
        WorldSizeError: the initialised world differs from the plan's (e.g. an MPI launch without its variables).
    """
    import torch.distributed as dist

    created = init_process_group(cfg.deepspeed.backend, init_timeout_s(cfg))
    world = dist.get_world_size()
    if world != plan.world_size:
        PipePlan.build(plan.partition, plan.placement, world)  # raises the same one-line error on every rank
        raise WorldSizeError(f"the launcher reported {plan.world_size} processes but {world} joined")
    return created


def _precheck_head(cfg: ExperimentConfig, arch) -> None:
    """The head checkpoint / draft vocabulary checks of ``SpeculationHead.load``, on every rank before any collective
    (only the head rank builds the head, after the process group exists).

    Raises:
        FileNotFoundError / HeadMismatchError / ValueError / ConfigError: as ``builder.build_head`` would on the head
            rank.
    """
    from spd_ds.builder import draft_vocab_ids
    from spd_ds.head import SpeculationHead

    if cfg.head.checkpoint:
        SpeculationHead.check_base_model(cfg.head.checkpoint, arch)
    if cfg.head.draft_vocab:
        draft_vocab_ids(cfg.head.draft_vocab, arch.vocab_size)


def _eos_with_tokenizer(cfg: ExperimentConfig, arch, default: list[int]) -> list[int]:
    """``builder.eos_token_ids`` with the model's tokenizer when it has one (random-weight shapes have none)."""
    from spd_ds.builder import eos_token_ids, load_tokenizer

    if cfg.decoding.eos_token_ids is not None or not any(arch.model_dir.glob("tokenizer*")):
        return default
    try:
        return eos_token_ids(cfg, arch, load_tokenizer(arch))
    except Exception as e:  # noqa: BLE001 - a broken tokenizer must not stop generation; config EOS still applies
        logger.warning("tokenizer of %s not loaded (%s); EOS from the model config only", arch.model_dir, e)
        return default


def _stop_strings(cfg: ExperimentConfig, arch):
    """``builder.stop_strings`` with the model's tokenizer (``None`` without ``decoding.stop``).

    Raises:
        ConfigError: stop strings but no tokenizer in the model directory, or one that does not load.
    """
    from spd_ds.builder import load_tokenizer, stop_strings

    if not cfg.decoding.stop:
        return None
    tok = None
    if any(arch.model_dir.glob("tokenizer*")):  # none: builder.stop_strings says so
        try:
            tok = load_tokenizer(arch)
        except Exception as e:  # noqa: BLE001 - any loader failure is the same user problem
            raise ConfigError(f"decoding.stop needs the model's tokenizer, which did not load from {arch.model_dir} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return stop_strings(cfg, tok)


class SPDSession:
    """One distributed SPD deployment: a DeepSpeed pipeline engine plus what the head rank needs to generate.

    Build it on every rank (collectively), then call :meth:`generate` on the head rank (``is_head``) and
    :meth:`serve` elsewhere, and finally :meth:`close` everywhere.

    Args:
        cfg: the experiment.
        drafter_factory: optional ``f(head, prompt, ar_reference) -> Drafter`` overriding ``decoding.drafter``
            (``ar_reference()`` runs AR through the pipeline and returns prompt + continuation).
        prompts: prompts to validate on every rank before any collective (optional).
        max_new_tokens: generation limit used for that validation.

    Raises:
        ConfigError / WorldSizeError / PromptError / ModelError: before ``torch.distributed`` is touched (a tensor of
            any stage missing from the checkpoint or of another shape: :meth:`TargetArch.check_weights`).
    """

    def __init__(self, cfg: ExperimentConfig, drafter_factory: DrafterFactory | None = None,
                 prompts: Sequence[Sequence[int]] | None = None, max_new_tokens: int | None = None) -> None:
        from spd_ds.builder import build_arch, build_partition, check_head_inputs, eos_token_ids, sampling_params
        from spd_ds.models.adapter import resolve_dtype

        self.cfg, self.drafter_factory = cfg, drafter_factory
        if cfg.head.placement not in ("colocated", "dedicated"):
            raise ConfigError(f"head.placement must be 'colocated' or 'dedicated', got {cfg.head.placement!r}")
        if cfg.deepspeed.timeout_s <= 0:
            raise ConfigError(f"deepspeed.timeout_s must be > 0, got {cfg.deepspeed.timeout_s}")
        if cfg.decoding.drafter == "head" or drafter_factory is not None:  # the head's files before the model's
            check_head_inputs(cfg)
        self.arch = build_arch(cfg)
        self.partition = build_partition(cfg, self.arch)
        self.arch.check_weights()  # every stage's tensors, on every rank: the loading rank's error line everywhere
        self.plan = PipePlan.build(self.partition, cfg.head.placement, detect_world_size())
        self.max_len = min(cfg.decoding.max_length, self.arch.max_positions)
        self.max_new_tokens = max_new_tokens or cfg.decoding.max_new_tokens
        for p in prompts or ():
            check_prompt(p, self.max_new_tokens, self.max_len, self.partition.num_stages, self.arch.max_positions,
                         self.arch.max_positions_source)
        self.stop = _stop_strings(cfg, self.arch)  # every rank, before any collective: a bad list fails everywhere
        if cfg.decoding.drafter == "head" or drafter_factory is not None:
            _precheck_head(cfg, self.arch)
        self.ds_config = load_ds_config(cfg)
        self.dtype = resolve_dtype(cfg.model.dtype)
        self.sampling = sampling_params(cfg)
        self.eos = eos_token_ids(cfg, self.arch)
        self._created_pg = init_distributed(cfg, self.plan)
        self.engine = None
        self._head_drafter = None
        try:
            self._build()
        except BaseException as e:
            self.close()
            if isinstance(e, RuntimeError) and peer_gone(e):  # in one of DeepSpeed's collectives: a peer failed
                raise PipeCommError(f"another rank failed while the pipeline was being built (its own error line "
                                    f"says why); here: {first_line(e)}") from None
            raise

    def _build(self) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from spd_ds.pipe.engine import SPDPipelineEngine
        from spd_ds.pipe.module import SPDPipelineModule

        cfg = self.cfg
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        acc = get_accelerator()
        device = torch.device(acc.device_name(local_rank))  # DeepSpeed's accelerator (DS_ACCELERATOR=cpu forces CPU)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with_head = cfg.decoding.drafter == "head" or self.drafter_factory is not None
        module = SPDPipelineModule(cfg, self.arch, self.plan, self.dtype, device, with_head=with_head)
        original = deepspeed.PipelineEngine
        deepspeed.PipelineEngine = SPDPipelineEngine  # deepspeed.initialize picks the engine class by this name
        try:
            self.engine, *_ = deepspeed.initialize(model=module, config=self.ds_config)
        finally:
            deepspeed.PipelineEngine = original
        if not isinstance(self.engine, SPDPipelineEngine):
            raise RuntimeError(f"deepspeed.initialize built {type(self.engine).__name__}, not SPDPipelineEngine")
        cuda = device.type == "cuda"
        static = cfg.deepspeed.static_cache if cfg.deepspeed.static_cache is not None else cuda
        stop = None
        if self.engine.stage_id == 0:  # the head decides EOS: same set as the single-process paths (tokenizer included)
            self.eos = _eos_with_tokenizer(cfg, self.arch, self.eos)
            stop = self.stop  # and where stop strings end a generation
        self.engine.setup_spd(self.plan, self.sampling, self.eos, self.max_len,
                              timeout_s=cfg.deepspeed.timeout_s, static_cache=bool(static),
                              cuda_graphs=bool(cfg.deepspeed.cuda_graphs and cuda and static),
                              head_overlap=bool(cfg.head.overlap), stop_strings=stop,
                              model_max=self.arch.max_positions, model_max_source=self.arch.max_positions_source)
        self.device = device

    # ------------------------------------------------------------------ roles
    @property
    def is_head(self) -> bool:
        """Whether this rank holds the head (pipe stage 0): it generates and gets the results."""
        return self.engine is not None and self.engine.is_head

    def _drafter_for(self, prompt: list[int], max_new_tokens: int) -> Drafter:
        from spd_ds.builder import build_drafter, build_head_drafter
        from spd_ds.decoding.drafters import oracle_reference_sampling

        head = self.engine.module.head_ends.head

        def ar_reference() -> list[int]:  # greedy whatever the generation's sampling (oracle_reference_sampling),
            sampling = oracle_reference_sampling(self.engine.sampling)  # past the stop strings (drafts go past them)
            return list(prompt) + self.engine.generate_ar(prompt, max_new_tokens, sampling, stop_strings=False).tokens

        if self.drafter_factory is not None:
            return self.drafter_factory(head, list(prompt), ar_reference)
        if self.cfg.decoding.drafter == "oracle":
            return build_drafter(self.cfg, None, self.arch, self.device, reference=ar_reference())
        if self._head_drafter is None:
            self._head_drafter = build_head_drafter(self.cfg, head, self.max_len, self.device)
        return self._head_drafter

    # ------------------------------------------------------------------ work
    def _use_request(self, request: int) -> None:
        """Key the engine's uniforms by ``request`` (the prompt's index in the run; ``spd_ds.decoding.sampling``)."""
        self.engine.sampling = self.sampling.for_request(request)

    def generate(self, prompt: Sequence[int], max_new_tokens: int | None = None, request: int = 0, *,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """SPD generation on the head rank (see :meth:`SPDPipelineEngine.generate`); ``request`` is the prompt's index
        in the run, part of the key of its uniforms at T > 0 (the reference decoder with the same seed and request
        draws the same tokens); ``on_token`` is called with each verified token as it is returned (streaming)."""
        max_new = max_new_tokens or self.max_new_tokens
        self._use_request(request)
        drafter = self._drafter_for(list(prompt), max_new)
        return self.engine.generate(prompt, max_new, drafter, on_token=on_token)

    def generate_ar(self, prompt: Sequence[int], max_new_tokens: int | None = None,
                    request: int = 0) -> GenerationResult:
        """AR generation through the same pipeline on the head rank (same stage code and kernels as :meth:`generate`;
        ``request`` as there).

        Returns:
            :class:`GenerationResult` (tokens after the prompt, the first from the prefill logits; AR metrics).
        Raises:
            RuntimeError: not the head rank. PromptError: empty or too long prompt. PipeCommError: a rank died or
            stalled.
        """
        self._use_request(request)
        return self.engine.generate_ar(prompt, max_new_tokens or self.max_new_tokens)

    def serve(self) -> None:
        """Stage ranks: serve until the head shuts the pipeline down."""
        self.engine.serve()

    def shutdown(self) -> None:
        """Head rank: stop the stage ranks (they return from :meth:`serve`)."""
        if self.engine is not None and self.is_head:
            self.engine.shutdown_pipeline()

    def abort(self) -> None:
        """Head rank after an error, best effort: stop the stage ranks without waiting for them."""
        if self.engine is not None and self.is_head:
            self.engine.abort_pipeline()

    def close(self, destroy_process_group: bool | None = None) -> None:
        """Destroy the process groups (default: if this session created them). The watchdog stays armed meanwhile,
        so a teardown blocked by a dead peer still ends the process."""
        import torch.distributed as dist

        wd = getattr(self.engine, "watchdog", None) if self.engine is not None else None
        if wd is not None:
            wd.beat()
        destroy = self._created_pg if destroy_process_group is None else destroy_process_group
        try:
            if destroy and dist.is_available() and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception as e:  # noqa: BLE001 - a broken group (dead peer) may refuse; nothing left to do
                    logger.warning("destroy_process_group failed: %s", e)
        finally:
            if self.engine is not None:
                self.engine.close_spd()


# on_generation(kind, index, result): called on the head rank when a generation starts (result None) and when it
# ends (its GenerationResult); kind "spd" or "ar"
GenerationCallback = Callable[[str, int, GenerationResult], None]


def run_distributed_inference(cfg: ExperimentConfig, prompt_token_lists: Sequence[Sequence[int]],
                              max_new_tokens: int | None = None, *,
                              drafter_factory: DrafterFactory | None = None, with_ar: bool = False,
                              requests: Sequence[int] | None = None, on_generation: GenerationCallback | None = None,
                              on_token: Callable[[int, int], None] | None = None
                              ) -> list[GenerationResult] | tuple[list[GenerationResult],
                                                                  list[GenerationResult]] | None:
    """Generate for every prompt with SPD through DeepSpeed's pipeline engine. Call it on every rank.

    Args:
        cfg: the experiment (``partition``, ``head.placement``, ``decoding``, ``deepspeed`` sections matter).
        prompt_token_lists: prompts as token ids (the same on every rank; only the head rank uses them).
        max_new_tokens: limit per prompt, the prefill token included (default ``decoding.max_new_tokens``).
        drafter_factory: see :class:`SPDSession`.
        with_ar: also decode every prompt autoregressively through the same pipeline (same stage code and kernels:
            the exactness reference on GPU, where eager single-process decoders can part at bf16 near-ties).
        requests: request index of each prompt (its sampling key with ``decoding.seed``; default ``0, 1, ...``).
        on_generation: progress callback ``f(kind, index, result)`` on the head rank (``kind``: ``spd`` or ``ar``;
            ``result`` ``None`` when the generation starts).
        on_token: streaming callback ``f(index, token)`` on the head rank, for each verified SPD token as it is
            returned (not for the AR pass).
    Returns:
        On the head rank (pipe stage 0, global rank 0) one :class:`GenerationResult` per prompt, or with ``with_ar``
        a pair ``(spd results, ar results)``; ``None`` elsewhere.
    Raises:
        WorldSizeError: the world does not fit the partition and placement (before any collective).
        ConfigError / PromptError: bad settings or prompts (before any collective).
        PipeCommError: a rank died or stalled longer than ``deepspeed.timeout_s`` (on every surviving rank).
        PipeAborted: on stage ranks, when the head stopped after an error of its own.
    """
    session = SPDSession(cfg, drafter_factory, prompt_token_lists, max_new_tokens)
    try:
        if session.is_head:
            try:
                reqs = list(range(len(prompt_token_lists))) if requests is None else list(requests)
                results, ar = [], [] if with_ar else None
                for i, p in enumerate(prompt_token_lists):
                    if on_generation is not None:
                        on_generation("spd", i, None)
                    stream = None if on_token is None else functools.partial(on_token, i)
                    results.append(session.generate(p, max_new_tokens, reqs[i], on_token=stream))
                    if on_generation is not None:
                        on_generation("spd", i, results[-1])
                for i, p in enumerate(prompt_token_lists if with_ar else ()):
                    if on_generation is not None:
                        on_generation("ar", i, None)
                    ar.append(session.generate_ar(p, max_new_tokens, reqs[i]))
                    if on_generation is not None:
                        on_generation("ar", i, ar[-1])
            except BaseException:
                session.abort()
                raise
            session.shutdown()
            return (results, ar) if with_ar else results
        session.serve()
        return None
    finally:
        session.close()
