"""The benchmark suites of ``docs/benchmarks.md`` and their tables (driven by ``launch/benchmark.py``).

=== =====================================================================================================
a   SmolLM2-135M-Instruct (real weights), SPD n=2 (``--spd-head``, default the shipped n=2 head) against ``ar_graph``,
    ``hf_generate`` and ``ar`` on MT-Bench / HumanEval / GSM8K: acceptance and decode tok/s
b   a Qwen3-4B-shaped random-weight model, n=2, oracle drafts with alpha in {1, 0.8, 0.6}: speedup against the
    CUDA-graph AR, measured cycle time against the slowest stage's forward alone, achieved GB/s (needs a GPU; not in
    :func:`default_suites` on CPU)
c   CPU: equivalent accept length of SPD heads and PPSD heads on SmolLM2 for n = 2, 3, 5, 6
=== =====================================================================================================

Every suite is a list of ``section.key=value`` overrides on the default experiment, evaluated with
:func:`spd_ds.eval.runner.run_eval`; a suite's baselines run in the same process on the same device as its SPD
variants. Under ``deepspeed`` (``WORLD_SIZE > 1``) the SPD variants of suites a and b run through the pipeline
engine, all pipeline sessions first, then the baselines on rank 0 (so no stage rank waits on them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig

from spd_ds.builder import resolve_path
from spd_ds.cli_args import override_key
from spd_ds.config import DEFAULT_PROMPT_SETS, ConfigError, ExperimentConfig, load_config, load_yaml
from spd_ds.eval.regression import DEFAULT_HEAD_DIR
from spd_ds.eval.report import REPEAT_NGRAM
from spd_ds.head import SpeculationHead
from spd_ds.partition import StagePartition

log = logging.getLogger(__name__)

SUITES = ("a", "b", "c")
SHIPPED_HEAD_N2 = DEFAULT_HEAD_DIR  # suite a's default head
PROMPT_SETS = DEFAULT_PROMPT_SETS


@dataclasses.dataclass
class SuiteRun:
    """One evaluation of a suite: its label, config overrides and (after running) the :class:`EvalRun`."""

    suite: str
    label: str
    overrides: list[str]
    run: object = None
    summary: dict | None = None
    stage_forward_ms: list[float] | None = None
    head_note: str = ""


def _head_for(pattern: str | None, n: int, missing: str = "") -> str | None:
    """``pattern`` with ``{n}`` substituted (a relative path found as ``head.checkpoint`` finds it:
    :func:`spd_ds.builder.resolve_path`), if that directory holds a head checkpoint (else a warning that ends with
    ``missing``, what the run does without it)."""
    if not pattern:
        return None
    p = Path(resolve_path(pattern.format(n=n)))
    if (p / "head_config.json").is_file():
        return str(p)
    log.warning("no head checkpoint at %s (pattern %s, n=%d)%s", p, pattern, n, missing and f": {missing}")
    return None


def check_head_pattern(pattern: str | None, flag: str, stages: Sequence[int]) -> None:
    """Refuse a head path pattern (``--spd-head``, ``--ppsd-head``) that is malformed or names no head checkpoint for
    any of the ``stages`` the run asks it for (a typo would otherwise benchmark untrained heads); one that names some
    of them is fine (the others warn in :func:`_head_for`). A relative path is taken from the working directory,
    else from the repository, as ``head.checkpoint`` is (:func:`spd_ds.builder.resolve_path`).

    Raises:
        ConfigError: a placeholder other than ``{n}``, an unbalanced brace, or no ``head_config.json`` at any n.
    """
    if not pattern or not stages:
        return
    try:
        dirs = [Path(resolve_path(pattern.format(n=n))) for n in stages]
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{flag} {pattern!r}: a head pattern may hold only the placeholder {{n}}, the stage count "
                          f"(e.g. 'runs/heads/n{{n}}'), not {e}") from None
    if not any((d / "head_config.json").is_file() for d in dirs):
        where = ", ".join(dict.fromkeys(str(d) for d in dirs))
        raise ConfigError(f"{flag} {pattern!r} names no head checkpoint at n = {', '.join(map(str, stages))} (no "
                          f"head_config.json in {where}); check the path, or leave {flag} out")
    for n, d in zip(stages, dirs):  # a head is trained for one stage count: a fixed path serves only that n
        try:
            k = StagePartition.from_dict(SpeculationHead.read_config(d)["partition"]).num_stages
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no head at this n (warned later), or a damaged one (its loader says so)
        if k != n:
            left, found, right = str(d).rpartition(str(k))
            example = f" (e.g. '{left}{{n}}{right}')" if found else ""
            raise ConfigError(f"{flag} {str(d)!r} is a head for n = {k} stages but the run asks it for n = {n}; use "
                              f"--stages {k}, or a pattern with {{n}}{example}")


def suite_runs(suites: Sequence[str], *, cuda: bool, spd_head: str | None = None, ppsd_head: str | None = None,
               model_b: str = "random:qwen3-4b", alphas: Sequence[float] = (1.0, 0.8, 0.6),
               stages_c: Sequence[int] = (2, 3, 5, 6), num_prompts: int = 4, max_new_tokens: int = 128,
               baseline_prompts: int | None = 2, prompt_sets: Sequence[str] = PROMPT_SETS,
               extra: Sequence[str] = ()) -> list[SuiteRun]:
    """The evaluations of ``suites`` as override lists (``extra`` overrides go last, so they win).

    Args:
        cuda: GPU run (bf16, CUDA-graph baselines); else CPU fp32.
        spd_head, ppsd_head: head checkpoint path patterns with ``{n}`` (e.g. ``runs/smollm2-n{n}``); a missing
            directory means no PPSD row, and an untrained SPD head unless that n has a PPSD head (then the PPSD
            row alone). Suite a defaults to the shipped n=2 head.
        model_b: the random-weight shape of suite b (``random:smollm2-135m`` makes it CPU-sized).
        num_prompts: per prompt set; ``baseline_prompts``: per set for the baselines (``None`` = all).
        prompt_sets: the prompt sets of suites a and c (suite b uses random token prompts).

    Raises:
        ConfigError: a head pattern that is malformed or names no checkpoint (:func:`check_head_pattern`).
    """
    spd_stages = ([2] if "a" in suites else []) + (list(stages_c) if "c" in suites else [])
    check_head_pattern(spd_head, "--spd-head", spd_stages)
    check_head_pattern(ppsd_head, "--ppsd-head", list(stages_c) if "c" in suites else [])
    sets = "[" + ",".join(prompt_sets) + "]"
    dtype = "bfloat16" if cuda else "float32"
    common = [f"decoding.max_new_tokens={max_new_tokens}", "decoding.temperature=0", f"data.num_prompts={num_prompts}",
              "eval.plots=true"]
    if baseline_prompts is not None:
        common.append(f"eval.baseline_num_prompts={baseline_prompts}")
    out = []
    if "a" in suites:
        head = _head_for(spd_head or str(SHIPPED_HEAD_N2), 2, "SPD runs an untrained head")
        ov = ["model.name=smollm2-135m-instruct", f"model.dtype={dtype}", "partition.num_stages=2",
              f"eval.prompt_sets={sets}", "decoding.drafter=head", "eval.baselines=[ar_graph,hf_generate,ar]"]
        ov += [f"head.checkpoint={head or 'null'}"]  # null: untrained, not a --config file's head for another n
        out.append(SuiteRun("a", f"{_model_label(ov + list(extra))} {dtype} n=2", ov + common + list(extra),
                            head_note=head or "untrained head (no head checkpoint for n=2)"))
    if "b" in suites:
        ov = [f"model.name={model_b}", f"model.dtype={dtype}", "partition.num_stages=2", "eval.prompt_sets=[random]",
              "decoding.drafter=oracle", f"eval.oracle_alphas=[{','.join(f'{a:g}' for a in alphas)}]",
              "eval.baselines=[ar_graph,hf_generate,ar]"]
        out.append(SuiteRun("b", f"{_model_label(ov + list(extra))} {dtype} n=2", ov + common + list(extra),
                            head_note="oracle drafts"))
    if "c" in suites:
        for n in stages_c:
            ppsd = _head_for(ppsd_head, n, "no PPSD row")
            head = _head_for(spd_head, n, "no SPD row" if ppsd else "SPD runs an untrained head")
            ov = ["model.name=smollm2-135m-instruct", "model.dtype=float32", "model.device=cpu",
                  f"partition.num_stages={n}", f"eval.prompt_sets={sets}", "decoding.drafter=head",
                  "eval.baselines=[]", "eval.warmup_prompts=0"]
            ov += [f"head.checkpoint={head or 'null'}", f"eval.ppsd_checkpoint={ppsd or 'null'}"]  # as documented,
            # not a --config file's heads (trained for another n)
            ov += ["eval.spd=false"] if ppsd and not head else []  # a PPSD head alone: no untrained SPD row
            note = f"spd: {head or ('none' if ppsd else 'untrained')}; ppsd: {ppsd or 'none'}"
            out.append(SuiteRun("c", f"{_model_label(ov + list(extra))} fp32 cpu n={n}", ov + common + list(extra),
                                head_note=note))
    return out


def _model_label(overrides: Sequence[str]) -> str:
    """The model a suite run evaluates, as its label says it: the last ``model.name=`` override wins (``extra``
    goes last); the default SmolLM2 is ``smollm2``, a path its folder's name, ``random:<shape>`` the shape."""
    name = [o.split("=", 1)[1] for o in overrides if o.startswith("model.name=")][-1]
    return "smollm2" if name == "smollm2-135m-instruct" else Path(name.removeprefix("random:").rstrip("/")).name or name


def config_of(sr: SuiteRun, base_config: str | None = None) -> ExperimentConfig:
    """The experiment of a suite run (``base_config`` YAML under the suite's overrides)."""
    return load_config(base_config, sr.overrides)


def replaced_file_settings(base_config: str | None, runs: Sequence[SuiteRun], extra: Sequence[str] = (),
                           suite_cfgs: Sequence[ExperimentConfig] | None = None) -> list[str]:
    """The settings of the ``--config`` file that the suites' own overrides replace with another value, so that the
    benchmark can say it does not use them (the file lies under the suites' overrides; a command-line override, in
    ``extra``, is the user's own choice and not reported).

    Args:
        base_config: the YAML file (``None``: nothing to report). runs: the suite runs, their overrides made.
        extra: the command line's ``section.key=value`` overrides.
        suite_cfgs: each run's config as :func:`config_of` gives it, when the caller has them (``None``: made here).
    Returns:
        One ``key=file value (replaced by suite values)`` string per replaced setting, sorted by key. Raises what
        :func:`spd_ds.config.load_config` raises for the file (it has read it before). The file is read once.
    """
    if base_config is None:
        return []
    data = load_yaml(Path(base_config))  # the keys it sets, and (over the defaults) their values
    in_file = {f"{sec}.{k}" for sec, keys in data.items() if isinstance(keys, DictConfig) for k in keys}
    in_file -= {override_key(o) for o in extra}

    def same(a, b) -> bool:  # a path in the file and the suite's resolved one (head.checkpoint) are the same
        return a == b or (isinstance(a, str) and isinstance(b, str)
                          and os.path.realpath(resolve_path(a)) == os.path.realpath(resolve_path(b)))

    file_cfg, out = load_config(data), {}
    for k, sr in enumerate(runs):
        suite_cfg = load_config(data, sr.overrides) if suite_cfgs is None else suite_cfgs[k]  # = config_of(sr, ...)
        for key in sorted({override_key(o) for o in sr.overrides} & in_file):
            section, name = key.split(".")
            before, after = getattr(getattr(file_cfg, section), name), getattr(getattr(suite_cfg, section), name)
            if not same(before, after) and after not in out.setdefault((key, str(before)), []):
                out[(key, str(before))].append(after)
    return [f"{key}={before} (replaced by {', '.join(map(str, after))})" for (key, before), after in sorted(out.items())
            if after]


def timing_position(run) -> int:
    """Token position at which stage forwards are timed alone: mean prompt length + half the generation."""
    mean = sum(len(p.ids) for p in run.prompts) / len(run.prompts)
    return int(mean + run.cfg.decoding.max_new_tokens / 2)


def measure_stage_forwards(sr: SuiteRun, iters: int = 50) -> None:
    """Fill ``sr.stage_forward_ms`` from ``sr.run.target`` (each stage alone; CUDA graph on GPU)."""
    from spd_ds.eval.speed import stage_forward_ms

    if sr.run is None or sr.run.target is None:
        return
    pos = timing_position(sr.run)
    sr.stage_forward_ms = stage_forward_ms(sr.run.target, pos, iters=iters, max_len=pos + 64)


# ---------------------------------------------------------------------------------------------- tables
SPEED_HEADERS = ["suite", "config", "method", "tok/s", "x ar_graph", "x hf_generate", "eq. accept len",
                 "draft acc.", "cycle ms", "slowest stage fwd ms", "cycle / slowest"]
GPU_HEADERS = ["GB/s", "% HBM"]  # GPU runs only (against the GPU's named bandwidth, ``summary["bandwidth"]``)


def on_gpu(sr: SuiteRun) -> bool:
    """Whether a finished suite run measured a GPU (then its speed rows carry GB/s and % HBM)."""
    return bool(sr.summary) and sr.summary.get("bandwidth") is not None


def with_tp(runs: Sequence[SuiteRun]) -> bool:
    """Whether any finished speed suite measured the tensor-parallel AR baseline ``tp_ar`` (then the speed table has
    an ``x tp_ar`` column)."""
    return any(sr.summary and "tp_ar" in sr.summary["methods"] for sr in runs if sr.suite in ("a", "b"))


def speed_headers(runs: Sequence[SuiteRun]) -> list[str]:
    """Headers of the speed table: :data:`SPEED_HEADERS` (with ``x tp_ar`` after ``x hf_generate`` when
    :func:`with_tp`), plus :data:`GPU_HEADERS` when the runs measured a GPU."""
    gpu = any(on_gpu(sr) for sr in runs if sr.suite in ("a", "b"))
    heads = list(SPEED_HEADERS)
    if with_tp(runs):
        heads.insert(heads.index("x hf_generate") + 1, "x tp_ar")
    return heads + (GPU_HEADERS if gpu else [])
ACCEPT_HEADERS = ["n", "method", "eq. accept len", "draft acc.", "tok/cycle", "acceptance by fill 1..n",
                  f"repeated {REPEAT_NGRAM}-grams", "head"]


def speed_rows(sr: SuiteRun, tp: bool = False) -> list[list]:
    """Rows of the speed table (suites a, b): one per method; AR rows show ms per token in the cycle column; an
    ``x tp_ar`` column with ``tp`` (:func:`with_tp` of all the runs); GB/s and % HBM only for a GPU run
    (:func:`on_gpu`)."""
    s = sr.summary
    slow = max(sr.stage_forward_ms) if sr.stage_forward_ms else None
    rows = []
    for name, res in s["results"].items():
        b = res["overall"]
        spd = s["methods"][name]["kind"] == "spd"
        tok_s = b["decode_tok_s"]
        cycle = (b["cycle_time_split_ms"] or {}).get("cycle") if spd else (1e3 / tok_s if tok_s else None)
        rows.append([sr.suite, sr.label, name, tok_s, b["speedup_vs_ar"].get("ar_graph"),
                     b["speedup_vs_ar"].get("hf_generate")] + ([b["speedup_vs_ar"].get("tp_ar")] if tp else [])
                    + [b["equivalent_accept_length"],
                     b["draft_acceptance_rate"], cycle, slow if spd else None,
                     (cycle / slow) if spd and cycle and slow else None]
                    + ([b["achieved_gbps"], 100 * b["hbm_fraction"] if b["hbm_fraction"] is not None else None]
                       if on_gpu(sr) else []))
    return rows


def accept_rows(sr: SuiteRun) -> list[list]:
    """Rows of the acceptance table (suite c): one per SPD method (spd, ppsd), with the answers' repeated 9-gram
    share (:func:`~spd_ds.eval.report.repeated_ngram_share`: loops inflate acceptance)."""
    s = sr.summary
    rows = []
    for name, res in s["results"].items():
        if s["methods"][name]["kind"] != "spd":
            continue
        b = res["overall"]
        fills = " ".join("-" if r["rate"] is None else f"{r['rate']:.2f}" for r in b["acceptance_by_depth"])
        rows.append([s["partition"]["num_stages"], name, b["equivalent_accept_length"], b["draft_acceptance_rate"],
                     b["tokens_per_cycle"], fills, b.get("repeated_ngram_share"), s["methods"][name]["description"]])
    return rows


def render(runs: Sequence[SuiteRun]) -> str:
    """Markdown tables of finished suite runs (speed table for a/b, acceptance table for c) plus exactness lines."""
    from spd_ds.eval.report import bandwidth_line, exactness_lines, format_table

    parts = []
    speed = [r for sr in runs if sr.suite in ("a", "b") and sr.summary for r in speed_rows(sr, with_tp(runs))]
    if speed:
        parts.append(format_table(speed_headers(runs), speed) + "\n(tok/s over each method's prompts; the x columns "
                     "pooled over the prompts both methods ran: --baseline-prompts per set for the baselines)")
    acc = [r for sr in runs if sr.suite == "c" and sr.summary for r in accept_rows(sr)]
    if acc:
        parts.append(format_table(ACCEPT_HEADERS, acc))
    for sr in runs:
        if sr.summary:
            extra = [bandwidth_line(sr.summary)] if sr.suite in ("a", "b") else []
            parts.append(f"[{sr.suite}] {sr.label} ({sr.head_note}; engine {sr.summary['engine']}, "
                         f"device {sr.summary['device']}):\n  " + "\n  ".join(exactness_lines(sr.summary) + extra))
    return "\n\n".join(parts)


def default_suites(cuda: bool) -> list[str]:
    """The suites a plain ``launch/benchmark.py`` runs: all three with a GPU; a and c on CPU (suite b's 4B-shaped
    model needs a GPU)."""
    return list(SUITES) if cuda else ["a", "c"]


def is_cuda_run(device: str | None = None) -> bool:
    """Whether the suites run on GPU (``model.device`` auto and CUDA available)."""
    return torch.cuda.is_available() if device in (None, "auto") else device.startswith("cuda")


def earlier_results(out: str | Path, written: Sequence[str | Path]) -> list[str]:
    """Sub-folders of ``out`` that hold a ``summary.json`` this run did not write (a suite or ``n`` of an earlier
    run into the same ``--out``), by name; ``written`` = this run's ``eval.output_dir`` of every suite run."""
    mine = {Path(w).resolve() for w in written}
    return sorted(p.parent.name for p in Path(out).glob("*/summary.json") if p.parent.resolve() not in mine)
