"""The head-distillation loop: read this file top to bottom.

    deepspeed launch/train.py --config launch/configs/train_smollm2_n3.yaml --deepspeed_config ds_configs/zero2.json

Two DeepSpeed engines share the processes:

1. the **teacher**: the frozen target as a ``PipelineModule`` built from the run's :class:`StagePartition`
   (``spd_ds.train.teacher``), pipe degree 1 (every rank holds the whole target) or ``n``. It produces the raw anchor
   hidden states (the head's inputs) and the teacher logits (the targets);
2. the **student**: the speculation head in its training layout (``spd_ds.train.student``), trained by a ZeRO-2
   engine over all ranks (fp32 weights = master weights; bf16 autocast on GPU; torch AdamW, linear warmup/decay).
   DeepSpeed refuses ZeRO-2 inside a PipelineModule, hence the second engine.

Per micro-batch: teacher forward -> draw the pipeline fill ``F`` (full with probability ``train.full_pipeline_prob``,
else uniform in ``1..n-1``) -> head forward under the structural mask of ``F`` -> forward KL over the draft
vocabulary -> backward -> step (DeepSpeed applies gradient accumulation). Every ``train.save_every`` steps a
DeepSpeed checkpoint holds the head, optimizer, scheduler, RNG and data position, so ``train.resume=true``
continues exactly where a run stopped. The final head is written with :meth:`SpeculationHead.save`. Every
``train.eval_every`` steps the head is validated on held-out records (``spd_ds.train.validate``: agreement at every
fill -> predicted acceptance and equivalent accept length) and the best one kept in ``best_head/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from spd_ds.config import ConfigError, ExperimentConfig, to_yaml
from spd_ds.models.masks import check_stage_attention
from spd_ds.train.chat import EmptyMaskError, set_chat_template
from spd_ds.train.batching import BatchPlanner, batches_on_device
from spd_ds.train.ds_config import load_ds_config
from spd_ds.files import replaced_when_done
from spd_ds.train.data import check_selfdistill_target, check_sources, load_records, tokenize_records
from spd_ds.train.loss import kd_loss_chunked, position_weights, top1_agreement
from spd_ds.train.preflight import (check_autocast, check_pipe_degree, check_target_settings, check_train_settings,
                                   resume_note, training_device_type)
from spd_ds.train.profiling import start_profiler, write_profile
from spd_ds.train.mask import sample_fill
from spd_ds.train.split import split_held_out
from spd_ds.train.history import SUMMARY_FILE, prior_steps
from spd_ds.train.resume import (CHECKPOINTS, EVAL_BATCHES, check_fresh_output, check_max_steps, check_resume,
                                  check_resumed_data, check_resumed_schedule, damaged_checkpoint_advice, data_identity,
                                  eval_batches_identity, finished_message, finished_run, flex_kept_message,
                                  prune_checkpoints, recorded_attention, rng_state, run_identity, set_rng_state,
                                  stale_best_heads, truncate_log, write_run_file)
from spd_ds.train.validate import Validator, recover_best_head

LOG_FILE = "train_log.jsonl"


# ---------------------------------------------------------------------------------------------------- setup pieces
class WarmupLinear:
    """Learning-rate multiplier for ``LambdaLR``: linear warmup over ``warmup`` steps, then (after an optional stable
    phase at the full rate) linear decay to 0.

    Training ends after ``total`` steps or, with a time budget (``train.max_time_s``), when time runs out, whichever
    comes first; the loop keeps :attr:`time_fraction` (elapsed / budget) up to date, and the decay follows the larger
    of the step and the time fraction, so a time-bounded run still anneals. ``stable`` (``train.lr_stable_fraction``)
    is the share of that progress spent at the full rate before the decay starts (warmup-stable-decay; 0 = a plain
    linear decay).
    """

    def __init__(self, warmup: int, total: int, stable: float = 0.0) -> None:
        self.warmup, self.total, self.stable = int(warmup), int(total), float(stable)
        self.time_fraction = 0.0

    def __call__(self, step: int) -> float:
        """LR multiplier in ``[0, 1]`` for optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps,
        then 1 until the progress ``p = max(step fraction, time_fraction)`` reaches ``stable``, then
        ``(1 - p) / (1 - stable)`` down to 0."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        done = max((step - self.warmup) / max(1, self.total - self.warmup), self.time_fraction)
        if done < self.stable:
            return 1.0
        return max(0.0, (1.0 - done) / (1.0 - self.stable))


@dataclasses.dataclass
class Meter:
    """Sums over a logging interval, reduced across ranks before printing.

    Quantities that live on the device (loss, weights, agreements, all-zero-weight batches) are accumulated there, so
    the step needs no device-to-host read; counts the host knows (micro-batches, positions, tokens, empty
    micro-batches) stay Python numbers. :meth:`reduce` packs both into one fp64 all-reduce: one sync per log step.
    """

    loss: float | torch.Tensor = 0.0
    micro: int = 0
    weight: float | torch.Tensor = 0.0
    positions: int = 0
    tokens: int = 0
    agree: list[int] | torch.Tensor = dataclasses.field(default_factory=list)  # per fill F = 1..n (index F)
    count: list[int] = dataclasses.field(default_factory=list)
    empty: int = 0  # micro-batches without a loss position on this rank (raise on every rank at the log step)
    zero_weight: float | torch.Tensor = 0.0  # micro-batches whose loss weights sum to 0

    @classmethod
    def zeros(cls, num_stages: int, device) -> "Meter":
        """An empty interval for fills ``1..num_stages`` with device accumulators on ``device``."""
        z = torch.zeros((), dtype=torch.float64, device=device)
        return cls(loss=z.clone(), weight=z.clone(), zero_weight=z.clone(),
                   agree=torch.zeros(num_stages + 1, dtype=torch.float64, device=device), count=[0] * (num_stages + 1))

    def reduce(self, device) -> "Meter":
        """The sums over every rank (one fp64 all-reduce on ``device``); a collective: call it on all ranks."""
        import deepspeed.comm as dist

        k = len(self.count)
        host = torch.tensor([self.micro, self.positions, self.tokens, self.empty, *self.count], dtype=torch.float64)
        vals = torch.cat([torch.as_tensor(self.loss, dtype=torch.float64, device=device).reshape(1),
                          torch.as_tensor(self.weight, dtype=torch.float64, device=device).reshape(1),
                          torch.as_tensor(self.zero_weight, dtype=torch.float64, device=device).reshape(1),
                          torch.as_tensor(self.agree, dtype=torch.float64, device=device).reshape(k),
                          host.to(device)])
        dist.all_reduce(vals)
        v = vals.tolist()
        h = v[3 + k:]
        return Meter(loss=v[0], micro=int(h[0]), weight=v[1], positions=int(h[1]), tokens=int(h[2]),
                     agree=[int(round(x)) for x in v[3:3 + k]], count=[int(x) for x in h[4:4 + k]],
                     empty=int(h[3]), zero_weight=v[2])


def _autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """``train.autocast`` -> the head's compute dtype under autocast (``None`` = off)."""
    check_autocast(mode)
    use = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    return torch.bfloat16 if use else None


def auto_pipe_degree(model_dir: Path, num_stages: int, world: int, device: torch.device,
                     fraction: float = 0.6) -> int:
    """``train.teacher_pipe_degree`` when unset: 1 if the target's checkpoint fits in ``fraction`` of one device's
    memory (always on CPU), else ``n`` (each rank then holds one SPD stage), provided ``n`` divides the world size."""
    if device.type != "cuda":
        return 1
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    total = torch.cuda.get_device_properties(device).total_memory
    return num_stages if size > fraction * total and world % num_stages == 0 else 1


def _say(msg: str, rank: int) -> None:
    if rank == 0:
        print(f"spd_ds.train: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- the loop
def train(cfg: ExperimentConfig, ds_config="ds_configs/zero2.json", resume: bool | None = None) -> Path | None:
    """Distil a speculation head for ``cfg.model`` (see module doc). Call in every process of a DeepSpeed launch.

    Returns:
        The directory of the final head on the logging rank, ``None`` on the others.

    Raises:
        ConfigError: bad settings (one line, raised on every rank before any collective can hang).
        EmptyMaskError: the data (or a batch on any rank) has no position to learn from.
    """
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from spd_ds.builder import build_arch, build_head, check_head_inputs, eos_token_ids, load_tokenizer
    from spd_ds.cli import checks_outputs, ensure_output_dir, rank_and_world
    from spd_ds.compile_cache import load_compile_cache, save_compile_cache
    from spd_ds.models.adapter import resolve_dtype
    from spd_ds.dist import init_process_group, init_timeout_s
    from spd_ds.train.student import HeadTrainModule, WorldDataParallel, resolve_attention, set_flex_compile
    from spd_ds.train.teacher import Teacher, build_teacher_module, teacher_attention, compile_backend

    tc, dc = cfg.train, cfg.data
    resume = tc.resume if resume is None else resume
    check_train_settings(cfg, rank_and_world()[1], training_device_type())  # every rank, before anything loads

    out_dir = Path(tc.output_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    # checked on every rank before any collective
    if checks_outputs():
        ensure_output_dir(out_dir, "train.output_dir")
    if rank_and_world()[0] == 0 and (ckpt_dir / "latest").exists():  # (a run from step 0: stale_best_heads)
        restored = recover_best_head(out_dir)  # a crash while best_head/ was replaced: the previous one put back
        if restored:
            _say(restored, 0)
    ds_base = load_ds_config(ds_config, dc.micro_batch_size,  # the file's errors now, not after the model loads
                             lambda msg: _say(msg, rank_and_world()[0]))
    if not resume and (ckpt_dir / "latest").exists():
        raise ConfigError(f"{ckpt_dir} already holds a run; continue it with --resume (train.resume=true) or set "
                          "another train.output_dir")
    if not (ckpt_dir / "latest").exists():  # a run from step 0: no earlier run's results beside its own
        check_fresh_output(out_dir, cfg.head.checkpoint)
    if resume and (ckpt_dir / "latest").exists():  # a finished run: nothing to build, nothing written (every rank)
        done = finished_run(out_dir, ckpt_dir, tc.max_time_s)
        if done:
            _say(done, rank_and_world()[0])
            return out_dir / "head" if rank_and_world()[0] == 0 else None  # (the process group is not started yet)
        check_max_steps(ckpt_dir, tc.max_steps)  # the checkpoint's step, read now: one line before anything loads

    # 1. processes and devices
    check_sources(dc.train_files)  # a missing file is one line before any process group or model load
    check_head_inputs(cfg)  # so is a missing head.checkpoint or head.draft_vocab
    check_stage_attention(cfg.model.attn_implementation, decoding=False)  # the teacher's masks are sdpa's
    note = resume_note(resume, ckpt_dir)  # before anything loads: a mistyped train.output_dir can be stopped now
    if note:
        _say(note, rank_and_world()[0])
    # the records, read now: a malformed or unreadable data file is one line before any process group or model load
    records = load_records(dc.train_files, cfg.model.cache_dir, dc.max_conversations)
    # the target (its config.json: no weight is read yet) and the partition: what its geometry refuses is one line too
    arch = build_arch(cfg, decoding=False)  # training keeps torch's own attention kernels (model.sdpa_backends)
    part = check_target_settings(cfg, arch)  # partition, data.max_seq_length, head.tower_init_layer, draft ids
    init_process_group(cfg.deepspeed.backend, init_timeout_s(cfg))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        acc.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    n_cached = load_compile_cache(tc.compile_cache)  # before the first compile (FlexAttention, the teacher's kernels)
    if tc.compile_cache:
        _say(f"compile cache {tc.compile_cache}: {n_cached} artifacts loaded", rank)

    # 2. tokenizer and head (the partition above: the same for the teacher and the head)
    tokenizer = load_tokenizer(arch)
    set_chat_template(tokenizer, dc.chat_template)
    head = build_head(cfg, arch, part)  # seeded with train.seed: identical on every rank
    init_steps = 0  # optimizer steps the starting head had already taken (its own lineage included)
    if cfg.head.checkpoint:
        init_steps = prior_steps(cfg.head.checkpoint)
        _say(f"starting from head.checkpoint={cfg.head.checkpoint}"
             f" ({'unknown number of' if init_steps is None else init_steps} earlier steps)", rank)
    n = part.num_stages
    degree = tc.teacher_pipe_degree or auto_pipe_degree(arch.model_dir, n, world, device)
    check_pipe_degree(degree, n, world, dc.micro_batch_size)  # (a set one was checked before the process group)
    gas = int(ds_base["gradient_accumulation_steps"])
    ran = recorded_attention(ckpt_dir) if resume and tc.attention == "auto" else None  # auto keeps the run's
    try:  # the compute on this device (auto resolved): part of what a resume must keep
        attention = resolve_attention(tc.attention, device, ran)
        tattn = teacher_attention(tc.teacher_attention, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    autocast = _autocast_dtype(tc.autocast, device)
    identity = run_identity(cfg, arch, part, head, world, degree, gas, ds_base,
                            {"autocast": autocast, "attention": attention, "teacher_attention": tattn})
    if resume and (ckpt_dir / "latest").exists():  # every rank reads the same file: all raise together
        check_resume(ckpt_dir, identity)  # all but train.eval_batches, resolved once the held-out split is known
    check_selfdistill_target(dc.train_files, arch.fingerprint(), str(arch.model_dir))
    tdtype = resolve_dtype(cfg.model.dtype)
    _say(f"target {arch.model_dir} (L={arch.num_layers}), partition {part}, f(d)={part.depth_to_type}, "
         f"draft vocab {head.draft_vocab_size}, world {world}, teacher pipe degree {degree}, device {device}", rank)

    # 3. the teacher: a PipelineModule run by DeepSpeed's PipelineEngine (frozen, no optimizer)
    backend = compile_backend(tc.compile_teacher, device)
    tmod = build_teacher_module(arch, part, tdtype, degree, head.draft_ids.tolist(), tc.kd_temperature,
                                dynamic_shape=not dc.pack, compile_backend=backend, attention=tattn)
    loss_backend = compile_backend(tc.compile_loss, device)
    if backend or loss_backend:
        _say(f"compiled: {tmod.compiled_layers} teacher decoder layers on this rank ({backend}), loss ({loss_backend})",
             rank)
    _say(f"teacher attention: {tattn}", rank)
    teng, *_ = deepspeed.initialize(model=tmod, config={"train_micro_batch_size_per_gpu": dc.micro_batch_size,
                                                       "gradient_accumulation_steps": 1,
                                                       "steps_per_print": 1 << 30})
    teacher = Teacher(teng, tdtype, part.num_types, arch.hidden_size, head.draft_vocab_size)
    dp_rank, dp_world = teng.grid.get_data_parallel_id(), teng.grid.get_data_parallel_world_size()

    # 4. data: records (read in 1.) -> (regenerated) -> tokenised -> per-rank plan of packed micro-batches
    if dc.regenerate:
        records = _regenerate_shared(cfg, records, tokenizer, arch, out_dir, rank, world, device,
                                     eos_token_ids(cfg, arch, tokenizer))
    records, held_out = split_held_out(records, dc.held_out_fraction if tc.eval_every else 0.0, tc.seed)
    data = tokenize_records(records, tokenizer, dc.max_seq_length, dc.min_seq_length, dc.overflow, dc.num_workers)
    _say(f"data: {data.summary()}", rank)
    data_id = data_identity(data, len(held_out))  # counts and a digest of the examples: a resume checks them
    planner = BatchPlanner(data, dc.max_seq_length, dc.micro_batch_size, dp_rank, dp_world, tc.seed, dc.pack,
                           skip_loops=dc.skip_loops)
    validator = None
    if held_out:  # validation: agreement at every fill on held-out micro-batches -> predicted acceptance
        validator = Validator.build(held_out, tokenizer, cfg, n, dp_rank, dp_world, out_dir, rank == 0)
        _say(validator.describe(), rank)
    identity[EVAL_BATCHES] = eval_batches_identity(tc.eval_batches, validator.available if validator else 0)
    if resume and (ckpt_dir / "latest").exists():  # the held-out micro-batches evaluated: before DeepSpeed loads
        check_resume(ckpt_dir, identity)

    # 5. the student: ZeRO-2 engine over all ranks, torch AdamW (DeepSpeed's own Adam JIT-builds for minutes on CPU)
    ds_cfg = load_ds_config(ds_base, dc.micro_batch_size // degree)
    steps_per_epoch = len(planner.plan(0)) // gas
    total_steps = tc.epochs * steps_per_epoch
    if tc.max_steps is not None:
        total_steps = min(total_steps, tc.max_steps) if tc.epochs else tc.max_steps
    if total_steps < 1:
        raise ConfigError(f"no optimizer step to take: {len(planner.plan(0))} micro-batches per rank per epoch, "
                          f"gradient_accumulation_steps={gas}; use more data or smaller batches")
    try:
        set_flex_compile(tc.flex_compile, shapes=2 * n + 2)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # autocast goes inside the module: DeepSpeed's engine switches an outer torch.autocast off around its forward
    fallback = tc.attention == "auto" and (flex_kept_message(ckpt_dir) if ran == "flex" else True)
    student = HeadTrainModule(head, attention, fallback=fallback, autocast=autocast)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    schedule = WarmupLinear(tc.warmup_steps, total_steps, tc.lr_stable_fraction)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    engine, _, _, sched = deepspeed.initialize(model=student, optimizer=opt, lr_scheduler=sched, config=ds_cfg,
                                               mpu=WorldDataParallel())
    head.rotary.inv_freq = head.rotary.inv_freq.float()  # RoPE frequencies stay fp32 (as at inference)
    why = (" (auto: the resumed run's)" if ran else
           " (auto: dense if it fails)" if attention == "flex" and fallback is True else "")
    _say(f"{sum(p.numel() for p in params) / 1e6:.2f} M trainable head parameters; {steps_per_epoch} steps/epoch, "
         f"{total_steps} steps, {gas} micro-batches/step, {attention} attention{why}", rank)

    # 6. resume: head, optimizer, scheduler (DeepSpeed) + data position and RNG (client state)
    step, epoch, index, micro = 0, 0, 0, 0
    elapsed_before = 0.0  # training seconds of the earlier invocations of this run (resume)
    tokens_before = 0  # tokens they trained on (None: a checkpoint from before spd-ds counted them)
    if resume:
        if (ckpt_dir / "latest").exists():
            schedule.stable = 0.0  # what checkpoints from before train.lr_stable_fraction ran with
            try:  # restores the schedule's state (warmup, total, stable)
                _, cs = engine.load_checkpoint(str(ckpt_dir))
            except torch.OutOfMemoryError:  # not the checkpoint's fault
                raise
            except (RuntimeError, EOFError, OSError, AssertionError) as e:  # a file cut short or damaged on disk
                tag = (ckpt_dir / "latest").read_text().strip()
                raise ConfigError(f"checkpoint {ckpt_dir / tag} is damaged ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:160] if str(e) else 'no message'}); "
                                  f"{damaged_checkpoint_advice(ckpt_dir, tag)}") from None
            check_resumed_data(ckpt_dir, cs.get("data"), data_id)  # same on every rank: all raise together
            check_resumed_schedule(schedule, sched.base_lrs[0], opt.param_groups[0]["weight_decay"], tc,
                                   total_steps, lambda msg: _say(msg, rank), cs["step"])
            # config.yaml records what the run keeps from its checkpoint, not the overrides ignored above
            tc.lr, tc.weight_decay = float(sched.base_lrs[0]), float(opt.param_groups[0]["weight_decay"])
            tc.warmup_steps, tc.lr_stable_fraction = int(schedule.warmup), float(schedule.stable)
            step, epoch, index, micro = cs["step"], cs["epoch"], cs["index"], cs["micro"]
            init_steps = cs.get("init_steps", init_steps)  # as the run began (head.checkpoint may have changed since)
            elapsed_before, tokens_before = float(cs.get("elapsed_s", 0.0)), cs.get("tokens")
            set_rng_state(cs["rng"][rank] if rank < len(cs["rng"]) else cs["rng"][0])
            if validator is not None:
                validator.load_state(cs.get("validation"))
            done = finished_message(out_dir, step, total_steps, elapsed_before, tc.max_time_s)  # (a shorter run)
            if done:  # every rank reads the same summary: all return together, before heads, summary or config.yaml
                _say(done, rank)
                return out_dir / "head" if rank == 0 else None
            _say(f"resumed from {ckpt_dir} at step {step} (epoch {epoch}, micro-batch {index})", rank)

    if validator is not None:
        validator.init_steps = init_steps  # best_head/best.json carries the head's history
    # 7. logging (config.yaml after every resume check: a refused or finished resume leaves the run's as it was)
    is_logger = rank == 0
    if is_logger:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
    tb = _tensorboard(out_dir) if (tc.tensorboard and is_logger) else None
    bar = None
    if is_logger and tc.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=step, desc=f"head n={n}", unit="step", dynamic_ncols=True)
    log_path = out_dir / LOG_FILE
    if is_logger:  # a fresh run starts a fresh log; a resumed one drops what came after its checkpoint
        truncate_log(log_path, step)
    if is_logger and step == 0:  # and no best head of an earlier attempt (check_fresh_output refused the rest)
        for d in stale_best_heads(out_dir):
            shutil.rmtree(d)
            _say(f"removed {d}: the best head of an earlier attempt in this train.output_dir, which stopped before "
                 "its first checkpoint (this run validates anew)", rank)
    meter = Meter.zeros(n, device)
    # t_start: start of the whole run, earlier invocations included, so that train.max_time_s and the learning-rate
    # decay by time fraction count the run's total time across resumes (not each invocation's); t_run: this one
    t_run = t_log = time.perf_counter()
    t_start = t_run - elapsed_before
    tokens_total, stop, paused, first_step = 0, False, False, step
    profiler = start_profiler(tc.profile_steps, device) if (tc.profile_steps and is_logger) else None

    host_group = torch.distributed.new_group(backend="gloo")  # a collective: every rank, same point
    # 8. the loop (teacher pipe degree 1: no device-to-host read per step; counts come from the host batch, sums
    # stay on the device)
    head.train()
    batches = batches_on_device(planner, epoch, index, tc.prefetch)
    while step < total_steps and not stop:
        epoch, index, batch = next(batches)
        mine, feats, targets = teacher(batch)
        fill = sample_fill(n, tc.full_pipeline_prob, tc.seed, micro, rank)
        if tc.max_time_s:
            schedule.time_fraction = (time.perf_counter() - t_start) / tc.max_time_s
        npos = int(mine["loss_index"].shape[0])
        logits = engine(feats, mine["segments"], mine["valid"], fill, mine["loss_index"])
        if student.attention != identity["train.attention"]:  # auto: FlexAttention failed, the head runs dense
            identity["train.attention"] = student.attention  # what run.json records (and a resume keeps)
            _say("train.attention=auto: FlexAttention failed; training with dense attention (run.json says so)", rank)
        weights = position_weights(targets, head.draft_ids, tc.kd_temperature, tc.outside_vocab)
        if npos:
            loss = kd_loss_chunked(logits, targets, weights, tc.kd_temperature, tc.loss_chunk, loss_backend)
        else:  # no loss position on this rank: a zero step (all ranks raise together at the log step below)
            loss = logits.sum() * 0.0
            meter.empty += 1
        engine.backward(loss)
        engine.step()
        micro += 1
        # metrics, accumulated on the device
        agree = top1_agreement(logits.detach(), targets, head.draft_ids)
        wsum = weights.sum()
        meter.loss += loss.detach()
        meter.micro += 1
        meter.weight += wsum
        meter.zero_weight += (wsum <= 0).double() if npos else 0.0
        meter.positions += npos
        meter.tokens += int(batch["segments"][teacher.stage::teacher.degree].count_nonzero())  # host tensor: no sync
        meter.agree[fill] += agree.sum()
        meter.count[fill] += npos
        if profiler is not None:
            profiler.step()
        if micro % gas:
            continue
        step += 1
        if bar is not None:
            bar.update(1)
        if tc.max_time_s is not None or tc.session_time_s is not None:
            now = time.perf_counter()
            flags = torch.tensor([float(tc.max_time_s is not None and now - t_start > tc.max_time_s),
                                  float(tc.session_time_s is not None and now - t_run > tc.session_time_s)])
            # every rank stops at the same step; a host tensor over a gloo group: the GPU stream is not synchronised
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=host_group)
            stop = bool(flags.sum().item())
            paused = stop and not bool(flags[0].item()) and step < total_steps
        val = {}
        if validator is not None and validator.due(step, step == total_steps or (stop and not paused)):
            val = validator.run(engine.module, teacher, device, step, None)  # every rank; the module autocasts
            t_log += val["val_s"]  # tokens/s counts training time only
        # a log step also before every checkpoint, so that an empty micro-batch is an error before it can be saved
        if step % tc.log_every == 0 or step % tc.save_every == 0 or step == total_steps or stop or val:
            m = meter.reduce(device)
            if m.empty or m.zero_weight:  # every rank sees the same reduced counts: all raise together, no hang
                raise EmptyMaskError(f"{m.empty} micro-batch(es) without a loss position and {int(m.zero_weight)} "
                                     f"with all loss weights zero before step {step} (epoch {epoch}); check the "
                                     "assistant masks, data.max_seq_length and train.outside_vocab")
            now = time.perf_counter()
            tokens_total += m.tokens
            rec = {"step": step, "epoch": epoch, "loss": m.loss / max(m.micro, 1), "lr": sched.get_last_lr()[0],
                   "top1_agreement": sum(m.agree) / max(sum(m.count), 1),
                   "agreement_by_fill": {f: m.agree[f] / m.count[f] for f in range(1, n + 1) if m.count[f]},
                   "mean_weight": m.weight / max(m.positions, 1), "loss_positions": m.positions,
                   "tokens_per_s": m.tokens / max(now - t_log, 1e-9), "elapsed_s": now - t_start, **val}
            if is_logger:
                with open(log_path, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", agree=f"{rec['top1_agreement']:.3f}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}", **(validator.postfix() if validator else {}))
                if tb is not None:
                    for k in ("loss", "lr", "top1_agreement", "mean_weight", "tokens_per_s"):
                        tb.add_scalar(f"train/{k}", rec[k], step)
                    for f, a in rec["agreement_by_fill"].items():
                        tb.add_scalar(f"train/agreement_fill{f}", a, step)
                    for k in ("val_pred_acceptance", "val_pred_accept_length", "val_pred_acceptance_noloop",
                              "val_pred_accept_length_noloop", "val_pred_acceptance_sampled",
                              "val_pred_accept_length_sampled") if val else ():
                        if k in rec:
                            tb.add_scalar(f"val/{k[4:]}", rec[k], step)
            meter = Meter.zeros(n, device)
            t_log = now
        if step % tc.save_every == 0 or step == total_steps or stop:
            _save(engine, ckpt_dir, step, epoch, index + 1, micro, rank, world, tc.keep_checkpoints, device,
                  elapsed_s=time.perf_counter() - t_start,
                  extra={"data": data_id, "init_steps": init_steps,  # the run's tokens through this step:
                         "tokens": None if tokens_before is None else tokens_before + tokens_total,
                         **({"validation": validator.state()} if validator is not None else {})},
                  identity=identity)

    # 9. the final head
    del batches  # stops the prefetching worker now, not at interpreter exit
    torch.distributed.destroy_process_group(host_group)
    elapsed = time.perf_counter() - t_start  # the run's training time, earlier invocations included
    tokens = None if tokens_before is None else tokens_before + tokens_total  # the run's too
    if bar is not None:
        bar.close()
    if tb is not None:
        tb.close()
    if profiler is not None:
        _say(write_profile(profiler, out_dir), 0)
    final = None
    if is_logger:
        final = out_dir / "head"
        head.to(dtype=resolve_dtype(tc.save_dtype)).save(final)
        summary = {"steps": step, "total_steps": total_steps, "finished": not paused, "max_time_s": tc.max_time_s,
                   "elapsed_s": elapsed,
                   "tokens": tokens, "tokens_per_s": None if tokens is None else tokens / max(elapsed, 1e-9),
                   "world_size": world,
                   "resumed_at_step": first_step if first_step else None,
                   "init_from": cfg.head.checkpoint, "init_steps": init_steps,
                   "teacher_pipe_degree": degree, "attention": student.attention, "partition": part.to_dict(),
                   "head": str(final),
                   **(validator.summary() if validator is not None else {"best": None})}
        with replaced_when_done(out_dir / SUMMARY_FILE) as tmp:  # an interrupt leaves no half-written summary
            tmp.write_text(json.dumps(summary, indent=2))
        rate = "?" if tokens is None else f"{summary['tokens_per_s']:.0f}"  # steps, time, tokens: the whole run
        _say(f"done: {step} steps in {elapsed:.1f} s, {rate} tokens/s; head -> {final}", rank)
        if paused:
            _say(f"train.session_time_s={tc.session_time_s:g} reached at step {step}: checkpoint saved; continue "
                 "with --resume (the head above is the run's state so far)", rank)
        if tc.compile_cache:  # the ranks compile the same kernels: one writer
            _say(f"compile cache {tc.compile_cache}: {save_compile_cache(tc.compile_cache)} bytes saved", rank)
    dist.barrier()
    return final


# ---------------------------------------------------------------------------------------------------- helpers
def _save(engine, ckpt_dir: Path, step: int, epoch: int, next_index: int, micro: int, rank: int, world: int,
          keep: int, device, elapsed_s: float = 0.0, extra: dict | None = None, identity: dict | None = None) -> None:
    """DeepSpeed checkpoint ``step<N>`` with the data position, every rank's RNG state, the run's training time so
    far (``elapsed_s``, seconds) and ``extra`` client state (the validation's best so far), and ``identity``
    (:func:`~spd_ds.train.resume.run_identity`) in its :data:`~spd_ds.train.resume.RUN_FILE`, written before the
    checkpoint so that ``latest`` never names a checkpoint without it; keep the newest ``keep`` of the steps up to
    ``step`` and remove later steps' folders cut short by a kill (:func:`~spd_ds.train.resume.prune_checkpoints`).

    Raises:
        OSError: on every rank, before any enters DeepSpeed's save, when rank 0 cannot write the run file (a full
            disk, no permission); the newest earlier checkpoint stays ``latest``.
    """
    import deepspeed.comm as dist

    # run.json first (DeepSpeed writes `latest` last); its failure travels with the RNG states, so that every rank
    # stops before the save with the cause (inside it, the other ranks met only a lost peer or the collective timeout)
    failed = write_run_file(ckpt_dir / f"step{step}", identity) if rank == 0 and identity is not None else None
    gathered = [None] * world
    dist.all_gather_object(gathered, (rng_state(), failed))
    failed = next((f for _, f in gathered if f), None)
    if failed:
        raise OSError(f"checkpoint step{step} not saved: {failed}")
    client = {"step": step, "epoch": epoch, "index": next_index, "micro": micro, "rng": [r for r, _ in gathered],
              "elapsed_s": float(elapsed_s), **(extra or {})}
    engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", client_state=client)
    removed = prune_checkpoints(ckpt_dir, step, keep) if rank == 0 else []
    if removed:
        print(f"spd_ds.train: removed {', '.join(removed)} under {ckpt_dir} (saves cut short by a kill)", flush=True)
    dist.barrier()


def _regenerate_shared(cfg: ExperimentConfig, records, tokenizer, arch, out_dir: Path, rank: int, world: int, device,
                       eos: list[int]):
    """``data.regenerate``: every rank answers records ``rank::world`` with the target, unless a part of the same
    inputs is already written (:func:`~spd_ds.train.regenerate.regenerated_dir`); all ranks read all answers."""
    import deepspeed.comm as dist

    from spd_ds.models.adapter import resolve_dtype
    from spd_ds.train.data import iter_json_records, write_jsonl_gz
    from spd_ds.train.regenerate import regenerate_records, regenerated_dir

    dc = cfg.data
    part_dir = regenerated_dir(out_dir, world, {  # answers of other inputs (e.g. another world size) are not read
        "model": arch.fingerprint(), "dtype": cfg.model.dtype, "max_new_tokens": dc.regenerate_max_new_tokens,
        "temperature": dc.regenerate_temperature, "batch_size": dc.regenerate_batch_size, "seed": cfg.train.seed,
        "max_prompt_tokens": dc.regenerate_max_prompt_tokens, "eos": eos,
        "chat_template": getattr(tokenizer, "chat_template", None)}, records)
    mine = part_dir / f"part-{rank:03d}.jsonl.gz"
    if not mine.exists():
        recs = regenerate_records(records[rank::world], arch.model_dir, tokenizer,
                                  max_new_tokens=dc.regenerate_max_new_tokens, temperature=dc.regenerate_temperature,
                                  batch_size=dc.regenerate_batch_size,
                                  max_prompt_tokens=dc.regenerate_max_prompt_tokens,
                                  device=device, dtype=resolve_dtype(cfg.model.dtype), seed=cfg.train.seed + rank,
                                  eos_token_ids=eos, progress=rank == 0)
        write_jsonl_gz(recs, mine)  # whole or not there (written beside, renamed at the end)
    dist.barrier()
    out = []
    for r in range(world):
        out += list(iter_json_records(part_dir / f"part-{r:03d}.jsonl.gz"))
    if not out:
        raise EmptyMaskError("data.regenerate produced no answer (no conversation with a user turn?)")
    return out


def _tensorboard(out_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as e:  # noqa: BLE001 - optional dependency
        print(f"spd_ds.train: TensorBoard unavailable ({type(e).__name__}); logging to {LOG_FILE} only",
              file=sys.stderr)
        return None
    return SummaryWriter(str(out_dir / "tensorboard"))


__all__ = ["train", "load_ds_config", "WarmupLinear", "Meter"]
