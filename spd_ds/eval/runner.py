"""Evaluation runner: SPD (its head, a PPSD head, oracle drafts) beside AR baselines, same prompts, same device, same
process; one :class:`EvalRun` holds every generation for :mod:`spd_ds.eval.report`.

Order of work (``run_eval``):

1. resolve the model (``random:<shape>`` -> a committed shape with seeded random weights and no tokenizer), the
   partition, the prompts (prompt sets with the chat template, or random token ids), the EOS ids, and shrink
   ``decoding.max_length`` to what the prompts need (static KV caches read less);
2. SPD variants: the single-process reference decoder (CPU or one GPU), or DeepSpeed's pipeline engine
   (:func:`spd_ds.pipe.runner.run_distributed_inference`) when launched with ``WORLD_SIZE > 1``;
3. AR baselines (:mod:`spd_ds.eval.baselines`) on the head rank's device, after the pipeline has shut down.

Every method first runs ``eval.warmup_prompts`` untimed prompts; every timed region starts and ends with
``torch.cuda.synchronize`` on GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import os
import time
from typing import Callable, Sequence

import torch

from spd_ds import builder
from spd_ds.cli_args import repeated
from spd_ds.config import ConfigError, ExperimentConfig
from spd_ds.decoding.cycle import GenerationResult
from spd_ds.eval.inputs import (EvalPrompt, check_prompt_lengths, check_same_stages, encode_eval_prompts,
                                fit_max_length, load_eval_records, ppsd_partition, resolve_model_name, target_view,
                                warn_unused_prompts)
from spd_ds.partition import StagePartition

log = logging.getLogger(__name__)

class EngineUnavailableError(RuntimeError):
    """The DeepSpeed pipeline engine (``spd_ds.pipe``) cannot be imported."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from spd_ds.decoding.cycle import PromptError
    from spd_ds.eval.prompts import PromptSetUnavailableError
    from spd_ds.head import HeadMismatchError
    from spd_ds.models.errors import ModelError
    from spd_ds.zoo import ModelUnavailableError

    errors = (ConfigError, PromptError, PromptSetUnavailableError, HeadMismatchError, ModelUnavailableError,
              ModelError, EngineUnavailableError, FileNotFoundError)
    try:  # the pipeline engine's own (wrong world size for the partition and placement)
        from spd_ds.pipe.topology import WorldSizeError

        errors += (WorldSizeError,)
    except ImportError:
        pass
    return errors


# errors that are the user's to fix: the CLIs print their one-line message (exit status 2) instead of a traceback
USER_ERRORS = _user_errors()


@dataclasses.dataclass
class MethodRun:
    """Generations of one method over the run's prompts.

    Attributes:
        name: ``spd``, ``ppsd``, ``spd_oracle_0.8``, ``hf_generate``, ``ar``, ``ar_graph``, ...
        kind: ``"spd"`` (a drafting decoder: acceptance metrics apply) or ``"baseline"`` (AR).
        num_stages: pipeline stages (1 for AR).
        description: one line (head checkpoint, oracle alpha, engine, ...).
        devices: devices the method runs on (for the bandwidth column).
        results: prompt index -> :class:`~spd_ds.decoding.cycle.GenerationResult`.
        wall_s: prompt index -> wall seconds of the whole ``generate`` call (synchronised), where measured.
        oracle_alpha: the oracle drafter's acceptance probability of an oracle variant (``spd_oracle_<alpha>``), else
            ``None``.
    """

    name: str
    kind: str
    num_stages: int
    description: str
    devices: int = 1
    results: dict[int, GenerationResult] = dataclasses.field(default_factory=dict)
    wall_s: dict[int, float] = dataclasses.field(default_factory=dict)
    oracle_alpha: float | None = None


@dataclasses.dataclass
class EvalRun:
    """Everything one evaluation produced (input of :func:`spd_ds.eval.report.summarize`).

    Attributes:
        cfg: the experiment as run (``model.name`` resolved, ``decoding.max_length`` fitted, EOS ids explicit).
        engine: ``"reference"`` or ``"deepspeed"``.
        arch, partition: the target and its split.
        prompts: the timed prompts (warm-up prompts excluded).
        methods: name -> :class:`MethodRun`, in run order (SPD variants first).
        tokenizer: the target's tokenizer, ``None`` for random-weight shapes.
        target: the single-process target on the head rank's device (``None`` if none was built).
        device: device of the single-process work (``"cpu"``, ``"cuda:0"``).
    """

    cfg: ExperimentConfig
    engine: str
    arch: object
    partition: StagePartition
    prompts: list[EvalPrompt]
    methods: dict[str, MethodRun]
    tokenizer: object = None
    target: object = None
    device: str = "cpu"

    def spd_methods(self) -> list[MethodRun]:
        """The drafting methods (SPD, PPSD, oracle variants), in run order."""
        return [m for m in self.methods.values() if m.kind == "spd"]

    def baselines(self) -> list[MethodRun]:
        """The AR baselines, in run order."""
        return [m for m in self.methods.values() if m.kind == "baseline"]


# ---------------------------------------------------------------------------------------------- comparison
def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where token lists ``a`` and ``b`` differ (a length difference counts at the
    shorter length); ``None`` when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------- timing helpers
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(gen: Callable[[list[int], int], GenerationResult], prompt: list[int], max_new: int,
                   device) -> tuple[GenerationResult, float]:
    """``gen(prompt, max_new)`` between two synchronisations; returns ``(result, wall seconds)``."""
    _sync(device)
    t = time.perf_counter()
    res = gen(prompt, max_new)
    _sync(device)
    return res, time.perf_counter() - t


class _Progress:
    """tqdm line on stderr: generations (prompts x methods) done, tokens so far, the current method and prompt."""

    def __init__(self, total: int, enabled: bool, desc: str = "eval") -> None:
        self.bar, self.tokens = None, 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="gen", dynamic_ncols=True)

    def step(self, label: str, tokens: int = 0) -> None:
        if self.bar is not None:
            self.tokens += tokens
            self.bar.set_postfix_str(f"{self.tokens} tokens, {label}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------- SPD variants
@dataclasses.dataclass
class _Variant:
    name: str
    description: str
    cfg: ExperimentConfig  # the config this variant runs with (head / partition / oracle alpha)
    alpha: float | None = None  # oracle variants


def spd_variants(cfg: ExperimentConfig, arch, alphas: Sequence[float] | None = None) -> list[_Variant]:
    """The drafting methods of a run: ``spd`` (the head of ``head.checkpoint``, untrained if none; not with
    ``eval.spd=false``) and ``ppsd`` (``eval.ppsd_checkpoint``), or with ``decoding.drafter=oracle`` one
    ``spd_oracle_<alpha>`` per alpha (``alphas``, default ``eval.oracle_alphas`` or ``[decoding.oracle_alpha]``).

    Raises:
        ConfigError: alpha outside [0, 1] or given twice, unreadable PPSD checkpoint, a PPSD head for other stages
            than the SPD head's, ``eval.spd=false`` without a PPSD head.
    """
    if cfg.decoding.drafter == "oracle":
        alphas = list(alphas if alphas is not None else (cfg.eval.oracle_alphas or [cfg.decoding.oracle_alpha]))
        out = []
        for a in alphas:
            if not 0.0 <= float(a) <= 1.0:
                raise ConfigError(f"eval.oracle_alphas: each alpha must be in [0, 1], got {a}")
            c = copy.deepcopy(cfg)
            c.decoding.oracle_alpha = float(a)
            out.append(_Variant(f"spd_oracle_{float(a):g}", f"oracle drafts, alpha={float(a):g}", c, float(a)))
        twice = repeated([v.name for v in out])
        if twice:  # one report row per name: the second run would replace the first's results
            raise ConfigError(f"oracle alphas {[float(a) for a in alphas]} give {twice[0]} twice; give each alpha once")
        if cfg.eval.ppsd_checkpoint:
            log.warning("eval.ppsd_checkpoint is ignored with decoding.drafter=oracle")
        if not cfg.eval.spd:
            log.warning("eval.spd=false is ignored with decoding.drafter=oracle (the oracle variants are SPD's)")
        return out
    if not cfg.eval.spd and not cfg.eval.ppsd_checkpoint:
        raise ConfigError("eval.spd=false leaves no head to evaluate: set eval.ppsd_checkpoint=DIR or eval.spd=true")
    if cfg.eval.oracle_alphas:
        log.warning("eval.oracle_alphas=%s is ignored with decoding.drafter=head (decoding.drafter=oracle sweeps them)",
                    list(cfg.eval.oracle_alphas))
    out = [_Variant("spd", f"head {cfg.head.checkpoint or 'untrained (no head.checkpoint)'}", cfg)] if cfg.eval.spd \
        else []
    if cfg.eval.ppsd_checkpoint:
        part = ppsd_partition(cfg.eval.ppsd_checkpoint, arch)
        if cfg.eval.spd:  # before the SPD row runs, not after it
            check_same_stages(part, builder.build_partition(cfg, arch))
        c = copy.deepcopy(cfg)
        c.head.checkpoint = cfg.eval.ppsd_checkpoint
        c.partition.num_stages, c.partition.stage_layers = part.num_stages, list(part.stage_layers)
        c.partition.anchors = list(part.anchors)
        out.append(_Variant("ppsd", f"PPSD head {cfg.eval.ppsd_checkpoint} (anchors {list(part.anchors)})", c))
    return out


# ---------------------------------------------------------------------------------------------- the run
def prepare(cfg: ExperimentConfig):
    """Resolve the model, build arch/partition/tokenizer/prompts and make EOS and ``max_length`` explicit.

    Returns:
        ``(cfg, arch, partition, tokenizer | None, prompts)``; the partition is the PPSD head's with ``eval.spd=false``
        (the stages that decode: ``max_length`` is fitted and the prompts checked for them).
    Raises:
        ConfigError and the prompt loaders' errors (an empty prompt set, a missing head folder, PPSD head folder
        or draft vocabulary: before the model is resolved); PromptError: a prompt too long for the context with its
        generation (before any weight loads).
    """
    from spd_ds.models.adapter import is_random_model_dir

    if cfg.decoding.stop:
        raise ConfigError("decoding.stop is for launch/infer.py and the Python API; eval and benchmark runs measure "
                          "fixed protocols without stop strings: remove decoding.stop "
                          f"(got {list(cfg.decoding.stop)!r})")
    warn_unused_prompts(cfg)
    cfg = resolve_model_name(cfg)
    # the prompt records first: an empty or missing set fails before any model is fetched or loaded
    sets = load_eval_records(cfg, tokenizer_free=is_random_model_dir(cfg.model.name))
    if cfg.decoding.drafter == "head":  # the heads' files too (every rank, before any collective)
        builder.check_head_inputs(cfg, ppsd=True)
    arch = builder.build_arch(cfg)
    part = builder.build_partition(cfg, arch)
    if not cfg.eval.spd and cfg.decoding.drafter != "oracle" and cfg.eval.ppsd_checkpoint:
        part = ppsd_partition(cfg.eval.ppsd_checkpoint, arch)  # the PPSD head alone: its stages decode (run_eval)
    random_weights = getattr(arch, "random_weights", False)
    # a folder without tokenizer files (random-weight shapes, a checkpoint saved without one) reads no text
    tok = builder.prompt_tokenizer(cfg, arch) if not random_weights and any(arch.model_dir.glob("tokenizer*")) else None
    if cfg.decoding.eos_token_ids is not None or not random_weights:  # given ids are checked against the vocabulary
        cfg.decoding.eos_token_ids = builder.eos_token_ids(cfg, arch, tok)
    else:
        cfg.decoding.eos_token_ids = []  # a random-weight shape: no EOS (fixed-length generations)
    if tok is None and any(recs is not None for _, recs in sets):
        load_eval_records(cfg, tokenizer_free=True)  # raises the one-line error for the first named set
    prompts = encode_eval_prompts(cfg, sets, tok, arch.vocab_size)
    if not prompts:
        raise ConfigError("no prompts: check eval.prompt_sets and data.num_prompts")
    cfg.decoding.max_length = min(cfg.decoding.max_length, arch.max_positions)  # as the pipeline engine caps it
    if cfg.eval.fit_max_length:
        cfg.decoding.max_length = fit_max_length(cfg, prompts, part.num_stages)
    check_prompt_lengths(cfg, prompts, part.num_stages, arch)  # before any weight loads (every rank alike)
    return cfg, arch, part, tok, prompts


def _warm(prompts: list[EvalPrompt], k: int) -> list[EvalPrompt]:
    return [prompts[i % len(prompts)] for i in range(max(0, k))]


def _requests(num_warm: int, num_prompts: int) -> list[int]:
    """Request index (sampling key, :mod:`spd_ds.decoding.sampling`) of each generation of ``warm + prompts``:
    prompt ``i`` is request ``i``; warm-up prompt ``j`` repeats prompt ``j % num_prompts`` and its request."""
    return [j % num_prompts for j in range(num_warm)] + list(range(num_prompts))


def _baseline_indices(cfg: ExperimentConfig, prompts: list[EvalPrompt]) -> list[int]:
    k = cfg.eval.baseline_num_prompts
    if k is None:
        return list(range(len(prompts)))
    seen: dict[str, int] = {}
    out = []
    for i, p in enumerate(prompts):
        if seen.get(p.prompt_set, 0) < k:
            out.append(i)
        seen[p.prompt_set] = seen.get(p.prompt_set, 0) + 1
    return out


def run_eval(cfg: ExperimentConfig, *, engine: str = "auto", oracle_alphas: Sequence[float] | None = None,
             progress: bool | None = None, baselines: bool = True) -> EvalRun | None:
    """Run SPD variants and baselines on the prompts of ``cfg`` (see the module docstring).

    Args:
        cfg: the experiment (``eval`` section: prompt sets, baselines, PPSD head, warm-up).
        engine: ``reference`` (single process), ``deepspeed`` (pipeline engine; call on every rank) or ``auto``
            (``deepspeed`` when ``WORLD_SIZE > 1``).
        oracle_alphas: with ``decoding.drafter=oracle``, one variant per alpha (default ``eval.oracle_alphas``).
        progress: tqdm bar (default ``eval.progress``; only on the head rank).
        baselines: run ``eval.baselines`` now; ``False`` leaves them to :func:`run_baselines` (e.g. after every
            pipeline session of a benchmark, so that no stage rank waits on the head rank's baselines).
    Returns:
        The :class:`EvalRun` on the head rank (rank 0), ``None`` on the other ranks.
    Raises:
        ConfigError, PromptError, PromptSetUnavailableError, the engine's errors; :class:`EngineUnavailableError`
        if ``deepspeed`` is asked for but the pipeline engine cannot be imported.
    """
    from spd_ds.eval.baselines import check_baseline_names

    from spd_ds.cli import chosen_engine

    engine = chosen_engine(engine)
    if engine not in ("reference", "deepspeed"):
        raise ConfigError(f"engine must be reference, deepspeed or auto, got {engine!r}")
    progress = cfg.eval.progress if progress is None else progress
    cfg, arch, part, tok, prompts = prepare(cfg)
    variants = spd_variants(cfg, arch, oracle_alphas)
    if not cfg.eval.spd and cfg.decoding.drafter != "oracle":  # the PPSD head alone (prepare took its partition)
        log.info("eval.spd=false: the run takes the PPSD head's partition, %d stages %s, anchors %s",
                 part.num_stages, list(part.stage_layers), list(part.anchors))
    check_baseline_names(cfg.eval.baselines)  # (the commands check it first: here for direct callers)
    from spd_ds.eval.tp_baseline import check_tp_request
    from spd_ds.pipe.topology import detect_world_size

    check_tp_request(cfg.eval.baselines, engine, detect_world_size(), arch)
    log.info("eval: %d prompts (%s), SPD variants %s, baselines %s, engine %s, max_length %d", len(prompts),
             ", ".join(sorted({p.prompt_set for p in prompts})), [v.name for v in variants], cfg.eval.baselines,
             engine, cfg.decoding.max_length)

    methods: dict[str, MethodRun] = {}
    if engine == "deepspeed":
        if not _run_distributed(cfg, arch, part, prompts, variants, methods, progress):
            return None
        run = EvalRun(cfg, engine, arch, part, prompts, methods, tok, None, str(_local_device(cfg)))
    else:
        device = builder.resolve_device(cfg.model.device)
        target = builder.build_target(cfg, arch, part, device)
        run = EvalRun(cfg, engine, arch, part, prompts, methods, tok, target, str(device))
        bar = _Progress(len(variants) * (len(prompts) + cfg.eval.warmup_prompts), progress, "spd")
        try:
            _run_reference(cfg, part, target, prompts, variants, methods, bar)
        finally:
            bar.close()
    if baselines:
        run_baselines(run, progress)
    return run


def run_baselines(run: EvalRun, progress: bool | None = None) -> EvalRun:
    """Measure ``eval.baselines`` of ``run`` on its prompts (the first ``eval.baseline_num_prompts`` of each set)
    on ``run.device`` with the run's ``model.sdpa_backends``, building ``run.target`` there if needed; adds them to
    ``run.methods`` and returns ``run``."""
    cfg = run.cfg
    single = _single_device_baselines(cfg)
    if not single:
        return run
    # this run's attention kernels, whatever build_arch ran last in the process (benchmark.py measures baselines
    # after all of its suites' SPD runs)
    builder.set_sdpa_backends(cfg.model.sdpa_backends, torch.device(run.device).type)
    if run.target is None:
        run.target = builder.build_target(cfg, run.arch, run.partition, torch.device(run.device))
    progress = cfg.eval.progress if progress is None else progress
    n = len(_baseline_indices(cfg, run.prompts)) + cfg.eval.warmup_prompts
    bar = _Progress(len(single) * n, progress, "baselines")
    try:
        _run_baselines(cfg, run.target, run.prompts, run.methods, bar)
    finally:
        bar.close()
    return run


def _local_device(cfg: ExperimentConfig) -> torch.device:
    dev = builder.resolve_device(cfg.model.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def _run_reference(cfg, part, target, prompts, variants, methods, bar) -> None:
    from spd_ds.decoding.drafters import oracle_reference
    from spd_ds.decoding.reference import SPDReferenceDecoder

    sampling = builder.sampling_params(cfg)
    eos, max_len, max_new = cfg.decoding.eos_token_ids, cfg.decoding.max_length, cfg.decoding.max_new_tokens
    device = target.device
    references: dict[tuple, list[int]] = {}  # oracle source: prompt + AR continuation (untimed)

    def reference_of(ids: list[int], request: int) -> list[int]:
        key = (request, tuple(ids))
        if key not in references:
            references[key] = oracle_reference(target, ids, max_new + part.num_stages, sampling.for_request(request),
                                               eos, max_len)
        return references[key]

    warm = _warm(prompts, cfg.eval.warmup_prompts)
    requests = _requests(len(warm), len(prompts))
    for v in variants:
        vt = target_view(target, builder.build_partition(v.cfg, target.arch))
        head = None
        if v.alpha is None:
            head = builder.build_head(v.cfg, target.arch, vt.partition)
        base = builder.build_drafter(v.cfg, head, target.arch, device) if head is not None else None
        dec = SPDReferenceDecoder(vt, base, sampling, eos, max_len)
        run = methods[v.name] = MethodRun(v.name, "spd", part.num_stages, v.description + ", reference decoder",
                                          oracle_alpha=v.alpha)
        for j, p in enumerate(warm + prompts):
            i = j - len(warm)
            dec.sampling = sampling.for_request(requests[j])
            if v.alpha is not None:
                dec.drafter = builder.build_drafter(v.cfg, None, target.arch, device,
                                                    reference=reference_of(p.ids, requests[j]))
            res, wall = timed_generate(dec.generate, p.ids, max_new, device)
            if i >= 0:
                run.results[i], run.wall_s[i] = res, wall
            bar.step(f"{v.name} {p.prompt_set}/{p.question_id}", len(res.tokens))
        del dec, head, base
        gc.collect()


def measure_baseline(base, run: MethodRun, prompts: list[EvalPrompt], indices: list[int], warm: list[EvalPrompt],
                     sampling, max_new: int, device, bar=None) -> MethodRun:
    """Time ``base.generate`` on ``prompts[i] for i in indices`` after the untimed ``warm`` prompts, filling ``run``.

    Sampling keys follow SPD's: timed prompt ``i`` is request ``i``, warm-up ``j`` repeats the key of
    ``indices[j % len(indices)]`` (set on ``base.sampling`` when the baseline has one). Every call is bracketed by
    device synchronisation (:func:`timed_generate`); ``run.wall_s`` is in seconds.

    Args:
        base: a baseline (``generate(prompt ids, max_new_tokens) -> GenerationResult``).
        run: the :class:`MethodRun` that receives ``results`` and ``wall_s``.
        prompts, indices, warm: the run's timed prompts, which of them, and the warm-up prompts.
        sampling: the run's :class:`~spd_ds.decoding.sampling.SamplingParams`.
        max_new: new tokens per prompt at most (the prefill token included); device: for synchronisation.
        bar: a progress line (``step(label, tokens)``), or ``None``.
    Returns:
        ``run``.
    """
    from spd_ds.decoding.sampling import SamplingParams

    def use_request(request: int) -> None:  # the prompt's sampling key, as SPD's (T > 0)
        if isinstance(getattr(base, "sampling", None), SamplingParams):
            base.sampling = sampling.for_request(request)

    for j, p in enumerate(warm):
        use_request(indices[j % len(indices)])
        res, _ = timed_generate(base.generate, p.ids, max_new, device)
        if bar is not None:
            bar.step(f"{run.name} warm-up", len(res.tokens))
    for i in indices:
        use_request(i)
        res, wall = timed_generate(base.generate, prompts[i].ids, max_new, device)
        run.results[i], run.wall_s[i] = res, wall
        if bar is not None:
            bar.step(f"{run.name} {prompts[i].prompt_set}/{prompts[i].question_id}", len(res.tokens))
    return run


def _single_device_baselines(cfg: ExperimentConfig) -> list[str]:
    """``eval.baselines`` without ``tp_ar``, which runs over every rank in :func:`_run_distributed`."""
    from spd_ds.eval.tp_baseline import NAME as TP_NAME

    return [b for b in cfg.eval.baselines if b != TP_NAME]


def _run_baselines(cfg, target, prompts, methods, bar) -> None:
    from spd_ds.eval.baselines import BaselineContext, build_baseline

    names = _single_device_baselines(cfg)
    if not names:
        return
    ctx = BaselineContext(target, builder.sampling_params(cfg), list(cfg.decoding.eos_token_ids),
                          cfg.decoding.max_length, cfg.model.attn_implementation)
    idx = _baseline_indices(cfg, prompts)
    warm = _warm([prompts[i] for i in idx], cfg.eval.warmup_prompts)
    for name in names:
        base = build_baseline(name, ctx)
        graphed = getattr(base, "graphed", None)
        desc = {"hf_generate": "transformers generate (dynamic cache, eager)",
                "ar": "ARDecoder on the stage code (eager)",
                "ar_graph": "static KV cache + CUDA graph per token" if graphed else
                            "static KV cache, eager (no CUDA graph on this device)"}.get(name, type(base).__name__)
        methods[name] = MethodRun(name, "baseline", 1, desc)
        measure_baseline(base, methods[name], prompts, idx, warm, ctx.sampling, cfg.decoding.max_new_tokens,
                         target.device, bar)
        del base
        gc.collect()
        if target.device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- distributed
def _import_engine():
    try:
        from spd_ds.pipe.runner import run_distributed_inference
    except ImportError as e:
        raise EngineUnavailableError(
            f"the DeepSpeed pipeline engine (spd_ds.pipe.runner.run_distributed_inference) is not available ({e}); "
            "run without the deepspeed launcher to use the reference decoder") from None
    return run_distributed_inference


def _oracle_factory(variants: list[_Variant], prompts: list[list[int]], arch):
    """One drafter factory serving several oracle alphas in one pipeline session: generation ``g`` (in call order)
    belongs to variant ``g // len(prompts)``; the AR reference of each prompt (and request) is computed once. The
    drafter itself is :func:`spd_ds.builder.build_drafter` with the variant's config (its ``decoding.oracle_alpha``)."""
    state = {"g": 0}
    refs: dict[int, list[int]] = {}

    def make(head, prompt, ar_reference):  # noqa: ARG001 - the oracle needs no head
        g = state["g"]
        state["g"] += 1
        v = variants[g // len(prompts)]
        if list(prompt) != list(prompts[g % len(prompts)]):
            raise RuntimeError("oracle drafter factory called out of order (the engine generated prompts in another "
                               "order than given)")
        key = g % len(prompts)  # same prompt, same request: same AR reference
        if key not in refs:
            refs[key] = list(ar_reference())
        return builder.build_drafter(v.cfg, None, arch, None, reference=refs[key])

    return make


def _run_distributed(cfg, arch, part, prompts, variants, methods, progress: bool = False) -> bool:
    """SPD variants through the pipeline engine (every rank; ``progress``: a tqdm line on the head rank). Returns
    whether this is the head rank."""
    import torch.distributed as dist

    run_distributed_inference = _import_engine()
    created = False
    if not dist.is_initialized():  # one process group for every session of this run
        from spd_ds.dist import init_process_group, init_timeout_s

        created = init_process_group(cfg.deepspeed.backend, init_timeout_s(cfg))
    head_rank = dist.get_rank() == 0
    warm = _warm(prompts, cfg.eval.warmup_prompts)
    ids = [p.ids for p in warm + prompts]
    max_new = cfg.decoding.max_new_tokens
    requests = _requests(len(warm), len(prompts))
    bar = _Progress(len(variants) * len(ids), progress and head_rank, "spd")
    devices = 1 if dist.get_world_size() == 1 else part.num_stages  # the devices the target's weights are read on
    try:
        oracle = [v for v in variants if v.alpha is not None]
        groups: list[tuple[list[_Variant], ExperimentConfig, object]] = []
        if len(oracle) > 1:  # one session for the whole alpha sweep
            groups.append((oracle, oracle[0].cfg, _oracle_factory(oracle, ids, arch)))
        else:
            groups += [([v], v.cfg, None) for v in oracle]
        groups += [([v], v.cfg, None) for v in variants if v.alpha is None]
        for vs, c, factory in groups:
            t = time.perf_counter()
            kw = {"drafter_factory": factory} if factory is not None else {}
            names = [v.name for v in vs]

            def step(kind, index, res, names=names):  # noqa: ARG001 - progress only
                if res is not None:
                    bar.step(names[index // len(ids)], len(res.tokens))

            out = run_distributed_inference(c, ids * len(vs), max_new, requests=requests * len(vs),
                                            on_generation=step, **kw)
            log.info("pipeline session for %s: %.1f s", names, time.perf_counter() - t)
            if out is None:
                continue
            for k, v in enumerate(vs):
                chunk = out[k * len(ids):(k + 1) * len(ids)][len(warm):]
                run = methods[v.name] = MethodRun(v.name, "spd", part.num_stages,
                                                  v.description + f", DeepSpeed pipeline ({c.head.placement} head)",
                                                  devices=devices, oracle_alpha=v.alpha)
                for i, res in enumerate(chunk):
                    run.results[i] = res
        from spd_ds.eval.tp_baseline import NAME as TP_NAME, run_tp_baseline

        if TP_NAME in cfg.eval.baselines:  # every rank, after the pipeline sessions
            t = time.perf_counter()
            idx = _baseline_indices(cfg, prompts)
            tp = run_tp_baseline(cfg, arch, prompts, idx, _warm([prompts[i] for i in idx], cfg.eval.warmup_prompts),
                                 head_rank, dist.get_world_size())
            log.info("%s over %d ranks: %.1f s", TP_NAME, dist.get_world_size(), time.perf_counter() - t)
            if tp is not None:
                methods[TP_NAME] = tp
    finally:
        bar.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return head_rank

