"""scripts/train_report.py: the report line, the validation curve in training tokens, the measured point read from a
suite (c) benchmark.json, and the PNG of both (CPU, no model)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("train_report", ROOT / "scripts" / "train_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_dir(tmp_path: Path, name: str, world: int = 2) -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "config.yaml").write_text("data:\n  micro_batch_size: 4\n  max_seq_length: 512\n")
    (run / "train_summary.json").write_text(json.dumps({"steps": 300, "total_steps": 300, "finished": True,
                                                        "world_size": world, "teacher_pipe_degree": 1,
                                                        "tokens_per_s": 1000.0,
                                                        "partition": {"stage_layers": [3, 3]}}))
    recs = [{"step": 100, "loss": 3.0, "tokens_per_s": 900.0},
            {"step": 200, "loss": 2.0, "tokens_per_s": 1000.0, "val_pred_acceptance": 0.3, "val_best": True},
            {"step": 300, "loss": 1.5, "tokens_per_s": 1100.0, "val_pred_acceptance": 0.4, "val_best": True,
             "val_pred_acceptance_noloop": 0.33}]
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def _bench(tmp_path: Path, alpha: float) -> Path:
    p = tmp_path / "benchmark.json"
    p.write_text(json.dumps({"acceptance_headers": ["n", "method", "eq. accept len", "draft acc.", "tok/cycle"],
                             "acceptance": [[2, "ppsd", 1.1, 0.1, 0.5], [2, "spd", 1.3, alpha, 0.6]]}))
    return p


def test_curve_and_measured_point(tmp_path):
    tr = _load()
    run = _run_dir(tmp_path, "n2")
    assert tr.tokens_per_step(run) == 4 * 512 * 2
    assert tr.validation_curve(run) == [(200 * 4096, 0.3), (300 * 4096, 0.4)]
    assert tr.validation_curve(run, "val_pred_acceptance_noloop") == [(300 * 4096, 0.33)]  # logged at step 300 only
    assert tr.measured_acceptance(_bench(tmp_path, 0.37), 2) == pytest.approx(0.37)
    with pytest.raises(ValueError, match="no spd acceptance row for n = 3"):
        tr.measured_acceptance(_bench(tmp_path, 0.37), 3)
    assert tr.measured_acceptance(_bench(tmp_path, 0.37), 2, "ppsd") == pytest.approx(0.1)  # the PPSD head's row
    summ = json.loads((run / "train_summary.json").read_text())
    (run / "train_summary.json").write_text(json.dumps(dict(summ, teacher_pipe_degree=2)))
    assert tr.tokens_per_step(run) == 4 * 512  # 2 ranks, one pipeline of 2: one data-parallel rank
    with pytest.raises(FileNotFoundError, match="not a training run directory"):
        tr.tokens_per_step(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"acceptance_headers": ["n", "method", "eq. accept len", "draft acc."],
                               "acceptance": [[2, "ppsd", 1.1, 0.1]]}))
    with pytest.raises(ValueError, match="no spd acceptance row"):
        tr.measured_acceptance(bad, 2)


def test_warm_started_run_continues_the_token_axis(tmp_path):
    """A run started from a trained head records that head's steps (``init_steps``, lineage included); the curve and
    the measured points count them at the run's tokens per step."""
    from spd_ds.train.history import prior_steps

    tr = _load()
    run = _run_dir(tmp_path, "n2")
    assert tr.init_steps(run) == 0 and prior_steps(run) == 300
    summ = json.loads((run / "train_summary.json").read_text())
    (run / "train_summary.json").write_text(json.dumps(dict(summ, init_steps=1000)))
    assert prior_steps(run) == 1300  # a head started from this one counts both runs
    assert prior_steps(tmp_path) is None  # no summary: history unknown
    (run / "head").mkdir()
    (run / "best_head").mkdir()
    (run / "best_head" / "best.json").write_text(json.dumps({"step": 200}))
    assert prior_steps(run / "head") == 1300 and prior_steps(run / "best_head") == 1200  # a run's two heads
    (run / "best_head" / "best.json").write_text(json.dumps({"step": 200, "init_steps": 7}))
    assert prior_steps(run / "best_head") == 207  # a best head describes itself when copied alone
    (run / "best_head" / "best.json").write_text("{not json")
    assert prior_steps(run / "best_head") is None  # damaged metadata: unknown history, no error
    assert tr.validation_curve(run) == [(1200 * 4096, 0.3), (1300 * 4096, 0.4)]
    png = tmp_path / "acc.png"
    assert tr.main([str(run), "--png", str(png), "--measured", f"n2:300:{_bench(tmp_path, 0.35)}"]) == 0
    (run / "train_summary.json").write_text(json.dumps(dict(summ, init_steps=None, best={"step": 250})))
    assert prior_steps(run) is None  # the start head's history was unknown: so is this one's
    (run / "train_summary.json").write_text(json.dumps(dict(summ, best={"step": 250})))
    assert prior_steps(run) == 250  # a shipped folder (best head + its run's summary): the best step
    (run / "train_summary.json").write_text(json.dumps({"partition": {}}))
    assert prior_steps(run / "head") is None  # no step count


def test_png_and_bad_measured_name(tmp_path, capsys, monkeypatch):
    tr = _load()
    run = _run_dir(tmp_path, "n2")
    png = tmp_path / "acc.png"
    assert tr.main([str(run), "--png", str(png), "--measured", f"n2:300:{_bench(tmp_path, 0.35)}"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "n2: steps 300/300 finished=True" in capsys.readouterr().out
    drawn = []  # the PPSD row of the same file when the spec names it
    monkeypatch.setattr("spd_ds.eval.plots.plot_training_acceptance",
                        lambda curves, points, *a, **k: drawn.extend(points))
    assert tr.main([str(run), "--png", str(png), "--measured", f"n2:300:ppsd:{_bench(tmp_path, 0.35)}",
                    "--measured", f"n2:300:{_bench(tmp_path, 0.35)}"]) == 0
    assert [round(a, 2) for _, _, a in drawn] == [0.1, 0.35]
    for bad, why in (("n2:300:ppsd:", "expected RUN:STEP"), (f"n2:300:{tmp_path / 'none.json'}", "none.json"),
                     (f"n2:300:ppsd:{tmp_path / 'bad.json'}", "no ppsd acceptance row for n = 2")):
        (tmp_path / "bad.json").write_text(json.dumps({"acceptance_headers": ["n", "method", "draft acc."],
                                                      "acceptance": [[2, "spd", 0.3]]}))
        with pytest.raises(SystemExit) as e:  # a one-line usage error (exit 2), not a traceback
            tr.main([str(run), "--png", str(png), "--measured", bad])
        assert e.value.code == 2 and why in capsys.readouterr().err
    for bad in (f"n3:300:{_bench(tmp_path, 0.35)}", "n2:last:x.json", "n2"):
        with pytest.raises(SystemExit):
            tr.main([str(run), "--png", str(png), "--measured", bad])
        assert "expected RUN:STEP:[ppsd:]BENCHMARK_JSON with RUN one of n2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tr.main([str(run), "--measured", f"n2:300:{_bench(tmp_path, 0.35)}"])
    assert "--measured needs --png" in capsys.readouterr().err


def test_plot_draws_the_loop_free_curve_dashed_in_the_runs_colour(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from spd_ds.eval import plots

    figs = []
    monkeypatch.setattr(plots.plt, "close", lambda fig: figs.append(fig))
    curves = [("a", [(1e6, 0.3), (2e6, 0.4)]), ("b", [(1e6, 0.2)])]
    plots.plot_training_acceptance(curves, [("a", 2e6, 0.35)], tmp_path / "p.png",
                                   loop_free={"a": [(1e6, 0.09), (2e6, 0.33)], "b": []})
    lines = {ln.get_label(): ln for ln in figs[0].axes[0].get_lines()}
    assert set(lines) == {"a predicted (held-out)", "b predicted (held-out)", "a predicted, loop-free"}
    free = lines["a predicted, loop-free"]
    assert free.get_linestyle() == "--" and free.get_color() == lines["a predicted (held-out)"].get_color()
    assert list(free.get_ydata()) == [0.09, 0.33]
    # one legend entry per run in its colour, then what the line styles and the marker mean; the y range holds every
    # figure, the loop-free ones too, with room around it (0.09 - 0.05 -> 0.0; 0.4 + 0.05 -> 0.5)
    legend = figs[0].axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b", "predicted (held-out)", "predicted, loop-free",
                                                          "measured (decoder, T = 0)"]
    assert legend.legend_handles[0].get_color() == lines["a predicted (held-out)"].get_color()
    assert figs[0].axes[0].get_ylim() == pytest.approx((0.0, 0.5))
    plt.close(figs[0])


def test_plot_of_many_runs_gives_every_run_its_own_colour(tmp_path, monkeypatch):
    """Past the default cycle's 10 colours the runs take a 20-colour palette: no two curves share a colour."""
    import matplotlib.pyplot as plt

    from spd_ds.eval import plots

    figs = []
    monkeypatch.setattr(plots.plt, "close", lambda fig: figs.append(fig))
    for count in (3, 11):
        curves = [(f"r{i}", [(1e6, 0.3), (2e6, 0.3 + i / 100)]) for i in range(count)]
        plots.plot_training_acceptance(curves, [], tmp_path / f"p{count}.png")
        colours = [ln.get_color() for ln in figs[-1].axes[0].get_lines()]
        assert len(colours) == count and len(set(map(str, colours))) == count
        plt.close(figs[-1])


def test_value_labels_of_close_points_do_not_overlap():
    """Points at (nearly) the same tokens form a column: labels from the highest down, each at its point's height or
    ``gap`` below the label above; a point elsewhere keeps its own height."""
    from spd_ds.eval.plots import label_heights

    pts = [(59.0, 0.463), (52.4, 0.412), (59.0, 0.469), (59.1, 0.438), (59.0, 0.452), (59.0, 0.415)]
    h = label_heights(pts, near=1.0, gap=0.02)
    assert h[2] == 0.469 and h[0] == pytest.approx(0.449) and h[4] == pytest.approx(0.429)  # pushed down in turn
    assert h[3] == pytest.approx(0.409) and h[5] == pytest.approx(0.389) and h[1] == 0.412  # 52.4: its own column
    col = sorted(h[i] for i in (0, 2, 3, 4, 5))
    assert all(b - a >= 0.02 - 1e-12 for a, b in zip(col, col[1:]))
    assert label_heights([(1.0, 0.3), (5.0, 0.31)], near=1.0, gap=0.05) == [0.3, 0.31]  # far apart: unchanged
    assert label_heights([], near=1.0, gap=0.05) == []


def _chain_run(tmp_path: Path, name: str, init: int, vals: dict, best_step: int, steps: int | None = None,
               best: float | None = None) -> Path:
    run = tmp_path / name
    run.mkdir()
    kept = vals[best_step] if best is None else best  # the head kept (picked by another figure, e.g. loop-free L')
    (run / "train_summary.json").write_text(json.dumps({"steps": steps or max(vals), "init_steps": init,
                                                        "best": {"step": best_step, "val_pred_acceptance": kept}}))
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" +
                                                 json.dumps({"step": s, "val_pred_acceptance": v}) + "\n"
                                                 for s, v in sorted(vals.items())))
    return run


def test_convergence_over_a_chain_of_warm_started_runs(tmp_path, capsys):
    tr = _load()
    a = _chain_run(tmp_path, "a", 0, {100: 0.30, 200: 0.40, 300: 0.45, 400: 0.50}, 400)
    # warm-started from a's best (step 400): a dip at its first validation, then a climb; the head it keeps (0.54,
    # picked by another figure) is not its highest predicted acceptance (0.55)
    b = _chain_run(tmp_path, "b", 400, {100: 0.48, 200: 0.50, 300: 0.52, 400: 0.55, 500: 0.53}, 500, best=0.54)
    c = tr.convergence([a, b])
    assert c["total_steps"] == 900 and c["start_step"] == pytest.approx(720) and c["best_step"] == 900
    # step 720 lies between b's steps 300 (0.52) and 400 (0.55): 0.52 + 0.03 * 20 / 100
    assert c["best"] == 0.54 and c["value_at_start"] == pytest.approx(0.526)
    assert c["rise"] == pytest.approx(0.54 / 0.526 - 1)
    # within b alone the span starts at its step 400 (0.55)
    assert c["last_run_start_step"] == pytest.approx(800) and c["rise_last_run"] == pytest.approx(0.54 / 0.55 - 1)
    assert tr.main([str(a), f"second={b}", "--convergence"]) == 0  # named by the last run's label
    assert capsys.readouterr().out.startswith("second: best predicted acceptance 0.5400")
    assert tr.main([str(a), str(b), "--convergence"]) == 0
    # the span's low is its start (b's later validations, 0.55 and 0.53, lie above it)
    assert c["low_in_span"] == pytest.approx(0.526) and c["rise_from_low"] == pytest.approx(c["rise"])
    assert "rise over the last 20 % of all steps 2.66 % (from 0.5260 at step 720; 2.66 % from the span's low" \
        in capsys.readouterr().out
    # one run: both spans are the same; the start is interpolated in a's curve (step 320: 0.45 + 0.05 * 0.2)
    one = tr.convergence([a])
    assert one["value_at_start"] == pytest.approx(0.46) and one["rise"] == one["rise_last_run"]
    # a short last run: its span starts before its first validation, between the warm start's value (a's step 400,
    # 0.50) and that validation (0.40 at its step 100): 0.50 - 0.10 * 96 / 100
    short = _chain_run(tmp_path, "short", 400, {100: 0.40, 120: 0.42}, 120)
    cs = tr.convergence([a, short])
    assert cs["rise_last_run"] == pytest.approx(0.42 / 0.404 - 1)
    # the whole span (from step 416 of 520: 0.50 - 0.10 * 16 / 100) takes in the restart's dip (0.40 at step 500):
    # counted from its start the rise is negative, from the dip it is the climb out of it
    assert cs["value_at_start"] == pytest.approx(0.484) and cs["rise"] == pytest.approx(0.42 / 0.484 - 1)
    assert cs["low_in_span"] == pytest.approx(0.40) and cs["rise_from_low"] == pytest.approx(0.42 / 0.40 - 1)
    # warm-started from a's step 300 (its best then): a's step-400 validation is dropped; the start (step 400 of
    # 500) lies between a's step 300 (0.45) and the new run's first validation (step 450: 0.60)
    b2 = _chain_run(tmp_path, "b2", 300, {150: 0.60, 200: 0.62}, 200)
    assert tr.convergence([a, b2])["value_at_start"] == pytest.approx(0.45 + 0.15 * 100 / 150)


def test_convergence_refuses_what_it_cannot_order(tmp_path):
    tr = _load()
    a = _chain_run(tmp_path, "a", 0, {100: 0.30, 200: 0.40}, 200)
    b = _chain_run(tmp_path, "b", 200, {100: 0.45, 200: 0.50}, 200)
    with pytest.raises(ValueError, match="init_steps 0 is not within the 400 steps"):
        tr.convergence([b, a])  # out of order: a is a fresh run
    with pytest.raises(ValueError, match="fraction"):
        tr.convergence([a], fraction=1.0)
    (b / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "val_pred_acceptance": 0.4}) + "\n"
                                               for s in (100, 200, 100)))  # a resumed log, appended
    with pytest.raises(ValueError, match="do not ascend"):
        tr.convergence([a, b])
    (b / "train_log.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no validation logged"):
        tr.convergence([a, b])
    early = _chain_run(tmp_path, "early", 0, {20: 0.06}, 20)  # one validation, after the span's start (step 16)
    with pytest.raises(ValueError, match="no validation at or before step 16, where the last 20% of the steps begin"):
        tr.convergence([early])
    (a / "train_summary.json").write_text(json.dumps({"steps": 200, "init_steps": 0}))
    with pytest.raises(ValueError, match="no best head"):
        tr.convergence([a])
    with pytest.raises(SystemExit) as e:  # the command line: one line (argparse), exit status 2
        tr.main([str(a), "--convergence"])
    assert e.value.code == 2


def test_a_crash_cut_log_line_is_skipped_and_a_folder_without_a_run_is_refused(tmp_path, capsys):
    tr = _load()
    run = _run_dir(tmp_path, "r")
    with open(run / "train_log.jsonl", "a") as fh:
        fh.write('{"step": 400, "lo')  # the last line, cut short by a crash
    assert tr.report(run)["last"]["step"] == 300
    assert [s for s, _ in tr.validation_curve(run)] == [200 * 2 * 4 * 512, 300 * 2 * 4 * 512]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        tr.main([str(run), str(tmp_path / "empty"), str(tmp_path / "nosuchrun")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not a training run" in err and "empty" in err and "nosuchrun" in err


def test_labels_name_runs_whose_directories_share_a_name(tmp_path, capsys, monkeypatch):
    """Runs kept as ``<head>/<machine>_<session>/`` share their directory's name: ``LABEL=DIR`` names them in the
    plot, --measured and the report lines (without labels the plot refuses them: it labels by name)."""
    tr = _load()
    for h in ("z2l2", "a2l2"):
        (tmp_path / h).mkdir()
    a, b = (_run_dir(tmp_path / h, "h200_33") for h in ("z2l2", "a2l2"))
    png = tmp_path / "acc.png"
    with pytest.raises(SystemExit):
        tr.main([str(a), str(b), "--png", str(png)])
    assert "distinct names" in capsys.readouterr().err
    drawn = {}
    monkeypatch.setattr("spd_ds.eval.plots.plot_training_acceptance",
                        lambda curves, points, *a, **k: drawn.update(curves=[c for c, _ in curves], points=points))
    assert tr.main([f"z2l2={a}", f"a2l2={b}", "--png", str(png), "--measured",
                    f"a2l2:300:{_bench(tmp_path, 0.35)}"]) == 0
    assert drawn["curves"] == ["z2l2", "a2l2"] and [p[0] for p in drawn["points"]] == ["a2l2"]
    out = capsys.readouterr().out
    assert "z2l2: steps 300/300" in out and "a2l2: steps 300/300" in out


def test_bad_png_path_benchmark_file_or_unsaved_run_is_one_line(tmp_path, capsys):
    """What a user gets wrong with ``--png`` and ``--measured`` ends in one argparse line (exit status 2), not a
    traceback: a benchmark.json of another kind (suite (a): no acceptance table), a --png folder that cannot be made,
    a run that has not saved yet (no config.yaml: no token axis); a --png folder that is missing is made."""
    tr = _load()
    run = _run_dir(tmp_path, "n2")
    other = tmp_path / "suite_a.json"
    other.write_text(json.dumps({"speed_headers": ["n", "tok/s"], "speed": [[2, 10.0]]}))
    blocker = tmp_path / "afile"
    blocker.write_text("")
    unsaved = tmp_path / "live"
    unsaved.mkdir()
    (unsaved / "train_log.jsonl").write_text(json.dumps({"step": 10, "loss": 3.0, "tokens_per_s": 1.0,
                                                         "val_pred_acceptance": 0.2}) + "\n")
    cases = ((["--png", str(tmp_path / "a.png"), "--measured", f"n2:300:{other}"], "no suite (c) acceptance table"),
             (["--png", str(blocker / "sub" / "a.png")], "--png's folder"),
             (["--png", str(tmp_path / "a.png"), "--measured", "n2:x:b.json"], "STEP a whole number"))
    for extra, why in cases:
        with pytest.raises(SystemExit) as e:
            tr.main([str(run), *extra])
        assert e.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tr.main([str(unsaved), "--png", str(tmp_path / "a.png")])
    assert e.value.code == 2 and "config.yaml not found" in capsys.readouterr().err
    png = tmp_path / "new" / "folder" / "acc.png"
    assert tr.main([str(run), "--png", str(png)]) == 0 and png.stat().st_size > 10_000


def test_a_png_name_matplotlib_would_not_write_as_named_a_damaged_summary_and_convergence_with_png(tmp_path, capsys):
    """--png out.txt was a matplotlib ValueError traceback after the work, --png noext said "wrote noext" while
    matplotlib wrote noext.png, a damaged train_summary.json (not JSON, or a JSON list) was a traceback, and
    --convergence --png silently drew nothing: each is one argparse line (exit status 2) before any work."""
    tr = _load()
    run = _run_dir(tmp_path, "n2")
    cases = [([str(run), "--png", str(tmp_path / "out.txt")], "its suffix .txt is no image type matplotlib writes; "
                                                               "give a name ending in .png"),
             ([str(run), "--png", str(tmp_path / "noext")], "it has no suffix; give a name ending in .png"),
             ([str(run), "--convergence", "--png", str(tmp_path / "o.png")], "--convergence prints the convergence "
                                                                             "test alone, without a plot")]
    for text, what in (("{bad", "is not valid JSON (Expecting property name"), ("[1, 2]", "holds a JSON list")):
        damaged = tmp_path / f"damaged{len(cases)}"
        damaged.mkdir()
        (damaged / "train_summary.json").write_text(text)
        cases.append(([str(run), str(damaged)], f"{damaged / 'train_summary.json'} {what}"))
    for argv, said in cases:
        with pytest.raises(SystemExit) as e:
            tr.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err.strip().splitlines()[-1], err
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == []  # no plot of any name
    svg = tmp_path / "acc.svg"  # another type matplotlib writes, by its suffix
    assert tr.main([str(run), "--png", str(svg)]) == 0 and svg.read_text().lstrip().startswith("<?xml")
    assert f"wrote {svg}" in capsys.readouterr().out


def test_a_damaged_config_or_log_is_one_line_naming_the_file(tmp_path, capsys):
    """A damaged config.yaml (not YAML, not UTF-8, a YAML list, an empty file, a setting that is no whole number) or
    train_log.jsonl (a record without tokens_per_s, a step that is no number, a folder at its name) was a traceback
    (yaml's ScannerError, omegaconf's ConfigAttributeError, KeyError, TypeError, IsADirectoryError) or a line that
    did not name the file ('utf-8' codec can't decode...); each is now one argparse line (exit status 2) naming the
    file and what to change, like a damaged train_summary.json, before any work. config.yaml is read only for the
    plot's token axis; a log line that does not decode (cut by a crash, or not UTF-8) is still left out."""
    tr = _load()
    bench = _bench(tmp_path, 0.35)
    advice = "a damaged config: restore the run's settings in it or leave the run out"
    configs = {b"data: [unclosed\n  micro_batch_size: 4\n": "is not valid YAML (did not find expected ',' or ']' at "
                                                            "line 2, column 19)",
               b"data:\n  micro_batch_size: 4\xff\n  max_seq_length: 512\n": "is not UTF-8 text (byte 0xff at offset "
                                                                          "27)",
               b"- 1\n- 2\n": "gives no whole number > 0 for data.micro_batch_size (missing), data.max_seq_length "
                              "(missing)",
               b"": "gives no whole number > 0 for data.micro_batch_size (missing)",
               b"data:\n  micro_batch_size: four\n  max_seq_length: 512\n": "gives no whole number > 0 for "
                                                                          "data.micro_batch_size ('four')"}
    cases = []
    for i, (text, what) in enumerate(configs.items()):
        run = _run_dir(tmp_path, f"c{i}")
        (run / "config.yaml").write_bytes(text)
        assert tr.main([str(run)]) == 0  # the report line alone does not read it
        capsys.readouterr()
        for extra in (["--png", str(tmp_path / "a.png")], ["--png", str(tmp_path / "a.png"), "--measured",
                                                          f"c{i}:300:{bench}"]):
            cases.append(([str(run), *extra], f"{run / 'config.yaml'} {what}", advice))
    logs = {'{"step": 100, "loss": 3.0, "tokens_per_s": "fast"}\n': "holds a record of step 100 whose "
                                                                     "tokens_per_s is 'fast', not a number",
            '{"step": "x", "loss": 3.0, "tokens_per_s": 1.0}\n': "holds a record whose step is 'x', not a whole "
                                                                  "number",
            '{"step": 100, "val_pred_acceptance": "0.3"}\n': "holds a record of step 100 whose val_pred_acceptance "
                                                             "is '0.3', not a number",
            None: "cannot be read (Is a directory)"}
    for i, (text, what) in enumerate(logs.items()):
        run = _run_dir(tmp_path, f"l{i}")
        log = run / "train_log.jsonl"
        if text is None:
            log.unlink()
            log.mkdir()
        else:
            log.write_text(log.read_text() + text)
        why = "a damaged log: mend or delete that line, or leave the run out" if text else "or leave the run out"
        for extra in ([], ["--json"], ["--convergence"], ["--png", str(tmp_path / "a.png")]):
            cases.append(([str(run), *extra], f"{log} {what}", why))
    for argv, said, why in cases:
        with pytest.raises(SystemExit) as e:
            tr.main(argv)
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert e.value.code == 2 and "Traceback" not in err and said in last and last.endswith(why), (argv, err)
    assert not (tmp_path / "a.png").exists()
    run = _run_dir(tmp_path, "skipped")
    with open(run / "train_log.jsonl", "ab") as fh:
        fh.write(b'{"step": 400, "loss": 1.0, "tokens_per_s": \xff\xfe}\n{"step": 500, "lo')
    assert tr.main([str(run)]) == 0 and "skipped: steps 300/300 finished=True median 1,100 tok/s, loss 1.5" in \
        capsys.readouterr().out
    (run / "train_log.jsonl").write_text('{"step": 100, "loss": 3.0}\n')  # no rate (a KeyError): none reported
    assert tr.main([str(run)]) == 0 and "median ? tok/s, loss 3.0" in capsys.readouterr().out
