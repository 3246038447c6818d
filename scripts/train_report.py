#!/usr/bin/env python
"""One line per training run: steps, tokens/s, the last logged loss and agreement by fill, and the validation figures
(predicted draft acceptance and equivalent accept length, best step) when the run logged them; optionally a PNG of the
predicted acceptance against training tokens with decoder-measured points (suite (c) ``benchmark.json`` files).

    python scripts/train_report.py runs/heads/smollm2_n2 [more runs] [--name label] [--json]
    python scripts/train_report.py runs/heads/n2 runs/heads/n3 --png docs/img/acceptance.png \\
        --measured n2:3400:runs/ev_n2/benchmark.json --measured n3:3400:runs/ev_n3/benchmark.json
    python scripts/train_report.py runs/heads/s3 runs/heads/p3 --png docs/img/n3.png \\
        --measured s3:3600:runs/ev_n3/benchmark.json --measured p3:3200:ppsd:runs/ev_n3/benchmark.json
    python scripts/train_report.py docs/train_logs/{s3l2,w3l2,x3l2} --convergence   # one head's runs, in order
    python scripts/train_report.py z2l2=docs/train_logs/z2l2/h200_33 --png out.png --measured z2l2:3600:b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spd_ds.cli import one_line
from spd_ds.train.history import read_train_log


def read_summary(run: Path) -> dict:
    """The run's ``train_summary.json``.

    Raises:
        FileNotFoundError: the run has none. ValueError: it is not valid JSON or holds no JSON object (a damaged
            file); the message names the file.
    """
    path = run / "train_summary.json"
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:  # json's decode errors, and bytes that are not UTF-8
        raise ValueError(f"{path} is not valid JSON ({e}); a damaged summary: write it again or leave the run "
                         "out") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not the object launch/train.py writes; a "
                         "damaged summary: write it again or leave the run out")
    return data


NUMBERS = ("tokens_per_s", "val_pred_acceptance", "val_pred_acceptance_noloop")  # figures the report computes with


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_log(run: Path) -> list[dict]:
    """The records of the run's ``train_log.jsonl`` (:func:`spd_ds.train.history.read_train_log`: a line that does
    not decode, the last one cut short by a crash say, is left out; ``[]`` when the run has no log), checked for what
    the report computes with: a whole-number ``step`` in every record, and a number (or null, or nothing) for
    ``tokens_per_s`` and the predicted acceptance (:data:`NUMBERS`).

    Raises:
        ValueError: the file cannot be read (a folder, no permission), or a record has no whole-number step or a
            figure of :data:`NUMBERS` that is no number; one line naming the file (and the record's step).
    """
    path = run / "train_log.jsonl"
    try:
        recs = read_train_log(path)
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}); give a run whose train_log.jsonl is a readable "
                         "file, or leave the run out") from None
    for r in recs:
        step = r.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            why = f"a record whose step is {step!r}, not a whole number" if "step" in r else "a record without a step"
        elif any(r.get(k) is not None and not _is_number(r[k]) for k in NUMBERS):
            k = next(k for k in NUMBERS if r.get(k) is not None and not _is_number(r[k]))
            why = f"a record of step {step} whose {k} is {r[k]!r}, not a number"
        else:
            continue
        raise ValueError(f"{path} holds {why}; a damaged log: mend or delete that line, or leave the run out")
    return recs


def read_data_settings(run: Path) -> tuple[int, int]:
    """``data.micro_batch_size`` and ``data.max_seq_length`` of the run's ``config.yaml`` (what launch/train.py
    wrote there).

    Raises:
        FileNotFoundError: the run has no ``config.yaml`` (a run that never saved).
        ValueError: the file cannot be read, is not UTF-8 or not YAML, or lacks either setting as a whole number
            > 0 (a damaged file); one line naming the file.
    """
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = run / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a training run directory (or one that never saved)")
    advice = "a damaged config: restore the run's settings in it or leave the run out"
    keys = ("data.micro_batch_size", "data.max_seq_length")
    try:
        cfg = OmegaConf.load(path)
        values = [OmegaConf.select(cfg, k) for k in keys] if isinstance(cfg, DictConfig) else [None, None]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         f"{advice}") from None
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
        raise ValueError(f"{path} is not valid YAML ({e.problem or e.context}{where}); {advice}") from None
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ValueError(f"{path} cannot be read as the run's settings ({one_line(e, 200)}); {advice}") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}); {advice}") from None
    bad = [f"{k} ({'missing' if v is None else repr(v)})" for k, v in zip(keys, values)
           if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ValueError(f"{path} gives no whole number > 0 for {', '.join(bad)}; {advice}")
    return values[0], values[1]


def report(run: Path) -> dict:
    """Figures of one run directory (``train_log.jsonl``, ``train_summary.json``).

    Raises:
        ValueError: a damaged ``train_summary.json`` (:func:`read_summary`) or ``train_log.jsonl`` (:func:`read_log`).
    """
    out: dict = {"run": str(run)}
    summ = run / "train_summary.json"
    if summ.exists():
        s = read_summary(run)
        out.update({k: s.get(k) for k in ("steps", "total_steps", "finished", "elapsed_s", "tokens_per_s", "best")})
    recs = read_log(run)
    train = [r for r in recs if "loss" in r]
    if train:
        last = train[-1]
        out["last"] = {k: last.get(k) for k in ("step", "loss", "top1_agreement", "agreement_by_fill", "lr")}
        rates = [r["tokens_per_s"] for r in train[1:] if r.get("tokens_per_s") is not None] or \
            [r["tokens_per_s"] for r in train[:1] if r.get("tokens_per_s") is not None]
        if rates:
            out["median_tokens_per_s"] = sorted(rates)[len(rates) // 2]
    vals = [r for r in recs if any(k.startswith("val_") for k in r)]
    if vals:
        out["val_last"] = {k: v for k, v in vals[-1].items() if k.startswith("val_") or k == "step"}
    return out


def tokens_per_step(run: Path) -> int:
    """Token slots per optimizer step of a run: micro-batch rows x row length x data-parallel ranks (world size /
    ``train.teacher_pipe_degree``), from ``config.yaml`` and ``train_summary.json`` of the run directory (packed
    rows, so padding is counted; gradient accumulation 1, as in ``ds_configs/``).

    Raises:
        FileNotFoundError: the run has no ``config.yaml`` or no ``train_summary.json`` yet.
        ValueError: either file is damaged (:func:`read_data_settings`, :func:`read_summary`).
    """
    for f in ("config.yaml", "train_summary.json"):
        if not (run / f).exists():
            raise FileNotFoundError(f"{run / f} not found: not a training run directory (or one that never saved)")
    micro_batch_size, max_seq_length = read_data_settings(run)
    summ = read_summary(run)
    dp = int(summ.get("world_size", 1)) // max(1, int(summ.get("teacher_pipe_degree", 1)))
    return micro_batch_size * max_seq_length * max(1, dp)


def init_steps(run: Path) -> int:
    """Steps the run's starting head had taken (``train_summary.json``'s ``init_steps``; 0 for a fresh head or an
    unknown history): the token axis counts them at this run's tokens per step.

    Raises:
        FileNotFoundError: no ``train_summary.json`` in ``run``. ValueError: the summary is not a JSON object.
    """
    return int(read_summary(run).get("init_steps") or 0)


def validation_curve(run: Path, key: str = "val_pred_acceptance") -> list[tuple[float, float]]:
    """``(training tokens, predicted T = 0 draft acceptance)`` at every validation of the run (``train_log.jsonl``)
    that logged ``key`` (``val_pred_acceptance_noloop``: outside loops; runs before that figure have none); a run
    started from a trained head (``head.checkpoint``) counts that head's steps too (:func:`init_steps`).

    Raises:
        FileNotFoundError, ValueError: as :func:`tokens_per_step`; ValueError: a damaged log (:func:`read_log`).
    """
    per, base = tokens_per_step(run), init_steps(run)
    recs = read_log(run)
    return [((base + r["step"]) * per, r[key]) for r in recs if r.get(key) is not None]


def _at(curve: list[tuple[int, float]], step: float) -> float:
    """``curve`` (ascending steps) linearly interpolated at ``step`` (clamped to its ends: ``numpy.interp``)."""
    import numpy as np

    return float(np.interp(step, [s for s, _ in curve], [v for _, v in curve]))


def convergence(runs: list[Path], fraction: float = 0.2, key: str = "val_pred_acceptance") -> dict:
    """The convergence test of docs/training.md for one head trained over ``runs`` (in order, each warm-started from
    a head of the one before: ``init_steps``): how much the predicted draft acceptance rose over the last
    ``fraction`` of all steps, and over the last ``fraction`` of the last run alone.

    The rise is the last run's best head (``train_summary.json``'s ``best[key]``, the head the run kept, whichever
    figure picked it) against the validation curve linearly interpolated where that span begins: ``best / value - 1``.
    Steps count the whole history (a run's step ``s`` is ``init_steps + s``); a run warm-started from an earlier step
    of the run before (its best head) drops that run's validations after the step it started from.

    The rise depends on where the span begins against a warm restart's dip (the first validations after a warm start
    fall below the head it started from): ``low_in_span`` is the lowest value of the curve over the span (its
    interpolated start included) and ``rise_from_low`` the rise counted from it (never below ``rise``): when a dip lies
    inside the span, the climb out of it.

    Returns:
        ``{"total_steps", "start_step", "value_at_start", "best", "best_step", "rise", "low_in_span", "rise_from_low",
        "last_run_start_step", "last_run_value_at_start", "rise_last_run"}``; rises as fractions (0.01 = 1 %).
    Raises:
        ValueError: no run; ``fraction`` outside (0, 1); a run without validations of ``key`` or whose logged steps
            do not ascend (a resumed log: pass the run directory's final log); a later run whose ``init_steps`` is not
            within the run before (0 < init_steps <= the steps before it: runs out of order, or a fresh run); no best
            head in the last run's summary; no validation at or before the start of a span (nothing to compare with).
    """
    if not runs or not 0.0 < fraction < 1.0:
        raise ValueError(f"convergence needs at least one run and 0 < fraction < 1 (got {len(runs)} runs, {fraction})")
    points: list[tuple[int, float]] = []
    end = 0  # steps of the history so far
    for i, run in enumerate(runs):
        base = init_steps(run)
        if i and not 0 < base <= end:
            raise ValueError(f"{run}: init_steps {base} is not within the {end} steps of the runs before it; give "
                             "one head's runs in training order, each warm-started from the one before")
        recs = read_log(run)
        pts = [(base + r["step"], r[key]) for r in recs if r.get(key) is not None]
        if not pts:
            raise ValueError(f"{run}: no validation logged {key}; train with train.eval_every > 0")
        if any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
            raise ValueError(f"{run}: the validation steps of train_log.jsonl do not ascend")
        points = [p for p in points if p[0] <= base] + pts  # the head it started from saw nothing later
        end = base + int(read_summary(run)["steps"])
    last = runs[-1]
    summ = read_summary(last)
    best = summ.get("best") or {}
    if best.get(key) is None or best.get("step") is None:
        raise ValueError(f"{last}: train_summary.json has no best head with {key} and its step")
    base, steps = init_steps(last), int(summ["steps"])
    total = base + steps
    start = total * (1.0 - fraction)
    local = [(s - base, v) for s, v in points if s >= base]
    last_start = steps * (1.0 - fraction)
    whole = f"{len(runs)} runs' history" if len(runs) > 1 else str(last)
    for curve, at, where in ((points, start, whole), (local, last_start, f"{last} (its own steps)")):
        if not any(s <= at for s, _ in curve):  # the curve would be extrapolated flat from a later validation
            raise ValueError(f"{where}: no validation at or before step {at:,.0f}, where the last {fraction:.0%} of "
                             "the steps begin, so the rise over them cannot be read; validate more often "
                             "(train.eval_every) or train longer")
    v_all, v_last = _at(points, start), _at(local, last_start)
    low = min([v_all] + [v for s, v in points if s > start])
    return {"total_steps": total, "start_step": start, "value_at_start": v_all, "best": best[key],
            "best_step": base + int(best["step"]), "rise": best[key] / v_all - 1.0,
            "low_in_span": low, "rise_from_low": best[key] / low - 1.0,
            "last_run_start_step": base + last_start, "last_run_value_at_start": v_last,
            "rise_last_run": best[key] / v_last - 1.0}


METHODS = ("spd", "ppsd")  # the head rows of a suite (c) benchmark.json


def measured_acceptance(bench_json: Path, num_stages: int, method: str = "spd") -> float:
    """The draft acceptance rate of ``method``'s head (``spd`` or ``ppsd``: suite (c) measures both heads of one n in
    one run) at ``num_stages`` in a suite (c) ``benchmark.json``.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not JSON, has no suite (c) acceptance table (``acceptance_headers`` with a ``draft
            acc.`` column, ``acceptance`` rows), or has no ``method`` acceptance row for that n.
    """
    d = json.loads(bench_json.read_text())
    try:
        col = d["acceptance_headers"].index("draft acc.")
        rows = [(row[1], int(row[0]), float(row[col])) for row in d["acceptance"]]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise ValueError(f"{bench_json} holds no suite (c) acceptance table (acceptance_headers with a 'draft "
                         "acc.' column, acceptance rows); pass the benchmark.json of launch/benchmark.py --suite c"
                         ) from None
    for name, n, acc in rows:
        if name == method and n == num_stages:
            return acc
    raise ValueError(f"{bench_json}: no {method} acceptance row for n = {num_stages}; pass a suite (c) "
                     f"benchmark.json that measured this head")


def num_stages(run: Path) -> int:
    """Pipeline stages of a run (``train_summary.json``'s partition)."""
    return len(read_summary(run)["partition"]["stage_layers"])


def _check_png(ap: argparse.ArgumentParser, png: Path) -> None:
    """Refuse (``ap.error``, one line) a ``--png`` name matplotlib would not write as named: a suffix it has no writer
    for (a ValueError after the work), or none (it wrote ``name.png`` while the report said ``name``); and a missing
    matplotlib."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        ap.error("--png needs matplotlib: pip install -e .[eval]")
    types = FigureCanvasBase.get_supported_filetypes()
    suffix = png.suffix.lower().removeprefix(".")
    if suffix not in types:
        what = f"its suffix .{suffix} is no image type matplotlib writes" if suffix else "it has no suffix"
        ap.error(f"--png {png}: {what}; give a name ending in .png (or .{', .'.join(sorted(set(types) - {'png'}))})")


def main(argv=None) -> int:
    """Print the report line of every run (``--json``: its dict); with ``--png`` also write the plot (its folder is
    made if missing). Exit status 0; 2 (argparse, one line) for a bad run folder, a damaged ``train_summary.json``,
    ``train_log.jsonl`` or (with ``--png``) ``config.yaml``, a bad ``--measured`` or ``--png`` (a folder that cannot
    be made, a suffix matplotlib does not write), or ``--png`` with ``--convergence``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]RUN",
                    help="a training run's directory; LABEL= names it in the plot, --measured and the report lines "
                         "(default: the directory's name)")
    ap.add_argument("--name", default=None, help="label printed before the figures")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a line")
    ap.add_argument("--png", type=Path, help="write the predicted-acceptance curves (and --measured points) here: a "
                                             "name ending in .png (or .svg, .pdf: the type is the suffix's)")
    ap.add_argument("--measured", action="append", default=[], metavar="RUN:STEP:[ppsd:]BENCHMARK_JSON",
                    help="a decoder-measured point: run directory name, the step its head was saved at, and the suite "
                         "(c) benchmark.json that measured it; 'ppsd:' before the file reads the PPSD head's row "
                         "(default: SPD's) (repeatable)")
    ap.add_argument("--caption", default="", help="line under the plot")
    ap.add_argument("--convergence", action="store_true",
                    help="treat the runs as one head's history, in order, and print how much its predicted acceptance "
                         "rose over the last 20 %% of all steps and of the last run (target: < 1 %%)")
    args = ap.parse_args(argv)
    labels = [r.split("=", 1)[0] if "=" in r and "/" not in r.split("=", 1)[0] else None for r in args.runs]
    args.runs = [Path(r.split("=", 1)[1]) if lab else Path(r) for r, lab in zip(args.runs, labels)]
    names = {i: lab or run.name for i, (run, lab) in enumerate(zip(args.runs, labels))}
    missing = [str(r) for r in args.runs
               if not ((r / "train_log.jsonl").exists() or (r / "train_summary.json").exists())]
    if missing:
        ap.error(f"not a training run (no train_log.jsonl or train_summary.json): {', '.join(missing)}")
    if args.convergence and (args.png or args.measured):  # it prints the test alone: a plot asked for was not drawn
        ap.error("--convergence prints the convergence test alone, without a plot; leave out --png and --measured, "
                 "or draw the plot in a run without --convergence")
    if args.png:  # before any work: matplotlib writes by the name's suffix (and adds .png to a name without one)
        _check_png(ap, args.png)
    for run in args.runs:  # a damaged summary, log or config, before any work: one line naming it (was a traceback)
        try:
            if (run / "train_summary.json").exists():
                read_summary(run)
            read_log(run)
            if args.png and (run / "config.yaml").exists():  # only the plot's token axis reads it
                read_data_settings(run)
        except (OSError, ValueError) as e:
            ap.error(str(e))
    if args.convergence:
        try:
            c = convergence(args.runs)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--convergence: {e}")
        if args.json:
            print(json.dumps(c))
        else:
            print(f"{args.name or names[len(args.runs) - 1]}: best predicted acceptance {c['best']:.4f} (step "
                  f"{c['best_step']:,} of {c['total_steps']:,}); rise over the last 20 % of all steps "
                  f"{100 * c['rise']:.2f} % (from {c['value_at_start']:.4f} at step {c['start_step']:,.0f}; "
                  f"{100 * c['rise_from_low']:.2f} % from the span's low {c['low_in_span']:.4f}), over "
                  f"the last 20 % of the last run {100 * c['rise_last_run']:.2f} % (from "
                  f"{c['last_run_value_at_start']:.4f} at step {c['last_run_start_step']:,.0f}); "
                  f"{'converged' if c['rise'] < 0.01 else 'not converged'} by the < 1 % criterion")
        return 0
    if args.measured and not args.png:
        ap.error("--measured needs --png")
    if args.png:
        from spd_ds.cli import check_output_file
        from spd_ds.config import ConfigError
        from spd_ds.eval.plots import plot_training_acceptance

        by_name = {names[i]: run for i, run in enumerate(args.runs)}
        if len(by_name) != len(args.runs):
            ap.error("runs must have distinct names (the plot labels them by directory name or LABEL=)")
        points = []
        for m in args.measured:
            name, step, path = (m.split(":", 2) + ["", ""])[:3]
            method, sep, rest = path.partition(":")
            method, path = (method, rest) if method in METHODS and sep else ("spd", path)
            if name not in by_name or not step.isdigit() or not path:
                ap.error(f"--measured {m}: expected RUN:STEP:[ppsd:]BENCHMARK_JSON with RUN one of "
                         f"{', '.join(by_name)} and STEP a whole number of steps")
            run = by_name[name]
            try:
                acc = measured_acceptance(Path(path), num_stages(run), method)
                points.append((name, (init_steps(run) + int(step)) * tokens_per_step(run), acc))
            except (OSError, ValueError, KeyError) as e:
                ap.error(f"--measured {m}: {e}")
        try:  # a run that never saved (no config.yaml) has no token axis
            curves = [(name, validation_curve(run)) for name, run in by_name.items()]
            loop_free = {name: validation_curve(run, "val_pred_acceptance_noloop") for name, run in by_name.items()}
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--png: {e}")
        try:  # a new folder is made; one that cannot be made or written fails in one line, not in matplotlib
            check_output_file(str(args.png), "--png")
        except ConfigError as e:
            ap.error(str(e))
        plot_training_acceptance(curves, points, args.png, caption=args.caption, loop_free=loop_free)
        print(f"wrote {args.png}")
    for i, run in enumerate(args.runs):
        r = report(run)
        if args.json:
            print(json.dumps(r))
            continue
        last = r.get("last", {})
        rate = r.get("median_tokens_per_s")  # none logged: '?', not a measured 0
        print(f"{args.name or names[i]}: steps {r.get('steps')}/{r.get('total_steps')} finished={r.get('finished')} "
              f"median {'?' if rate is None else f'{rate:,.0f}'} tok/s, loss {last.get('loss')}, "
              f"agree {last.get('top1_agreement')} by fill {last.get('agreement_by_fill')}; "
              f"val {r.get('val_last')}; best {r.get('best')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
