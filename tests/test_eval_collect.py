"""spd_ds.eval.collect: the tables and facts the scripts/gpu_*.sh drivers write, from fabricated run outputs."""

import json

from spd_ds.eval import collect
from spd_ds.partition import StagePartition


def _summary(n, anchors, eq_len, by_set):
    overall = {"equivalent_accept_length": eq_len, "draft_acceptance_rate": 0.5, "tokens_per_cycle": 1.25,
               "acceptance_by_depth": [{"rate": 0.75}, {"rate": None}][:n], "num_prompts": 3, "num_new_tokens": 90}
    return {"results": {"spd": {"overall": overall, "by_set": {k: {"equivalent_accept_length": v}
                                                               for k, v in by_set.items()}}},
            "partition": {"anchors": anchors}, "device": "cpu"}


def test_suite_c_table(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    for variant, anchors, eq in (("spd", [0], 1.5), ("ppsd", [0, 15], 1.25)):
        d = work / "eval" / f"{variant}_n2"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(_summary(2, anchors, eq, {"mt_bench": eq, "humaneval": 2.0})))
    (work / "heads" / "spd_n2").mkdir(parents=True)
    (work / "heads" / "spd_n2" / "train_summary.json").write_text(json.dumps({"steps": 40}))
    out.mkdir()
    assert collect.main(["suite-c", str(work), str(out), "2", "3"]) == 0
    rows = json.loads((out / "suite_c.json").read_text())
    assert [(r["n"], r["head"], r["train_steps"], r["anchors"]) for r in rows] == [(2, "spd", 40, [0]),
                                                                                  (2, "ppsd", None, [0, 15])]
    assert rows[0]["acceptance_by_fill"] == [0.75, None] and rows[0]["eq_accept_len_by_set"]["humaneval"] == 2.0
    na = dict(rows[0], equivalent_accept_length=None, draft_acceptance_rate=None, tokens_per_cycle=None,
              eq_accept_len_by_set={"mt_bench": None})  # a run without drafts or cycles: null rates, '-' cells
    assert "| [0] | 40 | - | - | - | 0.75 - | - | nan | nan |" in collect.suite_c_markdown([na])
    md = (out / "suite_c.md").read_text().splitlines()
    assert md[2] == "| 2 | SPD | [0] | 40 | 1.500 | 0.500 | 1.250 | 0.75 - | 1.500 | 2.000 | nan |"
    assert md[3].startswith("| 2 | PPSD | [0, 15] | None | 1.250 |") and len(md) == 4


def test_pipe_bench_summary(tmp_path):
    d = tmp_path / "bench_oracle_a1"
    d.mkdir()
    summary = {"all_equal_to_pipeline_ar": True, "spd_decode_tok_s": 120.0, "ar_decode_tok_s": 80.0,
               "speedup_vs_pipeline_ar": 1.5, "equivalent_accept_length": 1.9, "stage_forward_s": [0.2, 0.1],
               "time_split_s": {"head_s": 0.05, "verify_s": 0.01, "comm_s": 0.02, "control_s": 0.0}}
    prompts = [{"spd": {"num_cycles": 60}, "first_divergence_vs_single_ar": None},
               {"spd": {"num_cycles": 40}, "first_divergence_vs_single_ar": 7}]
    (d / "pipe_bench.json").write_text(json.dumps({"summary": summary, "prompts": prompts}))
    (tmp_path / "infer_eager.log").write_text("noise\nidentical to AR decoding: 3/3 prompts\nspeed: 10 tok/s\n")
    (tmp_path / "infer_graphs.log").write_text("nothing\n")
    text = collect.pipe_bench_summary(tmp_path).splitlines()
    assert text[4] == ("| oracle_a1 | True | [None, 7] | 120.0 | 80.0 | 1.50 | 1.90 | "
                       "2.000 / 1.000 / 0.500 / 0.100 / 0.200 / 0.000 |")
    assert "`launch/infer.py` (eager): identical to AR decoding: 3/3 prompts; speed: 10 tok/s" in text
    assert "`launch/infer.py` (graphs): no AR comparison line (see log)" in text


def test_first_stage_layers(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    assert collect.first_stage_layers(str(tmp_path), 3) == StagePartition.build(30, 3).stage_layers[0]
    assert collect.main(["first-stage-layers", str(tmp_path), "2"]) == 0
    assert capsys.readouterr().out.strip() == str(StagePartition.build(30, 2).stage_layers[0])


def test_env_reports_missing_packages_first(monkeypatch, capsys):
    assert collect.missing_packages(("json", "no_such_package_xyz")) == ["no_such_package_xyz"]
    monkeypatch.setattr(collect, "missing_packages", lambda names=collect.REQUIRED_PACKAGES: ["nope"])
    assert collect.main(["env", "--deps"]) == 1
    assert "missing Python packages: ['nope']" in capsys.readouterr().err
    env = collect.environment()
    assert {"torch", "transformers", "deepspeed", "gpus", "git"} <= set(env) and "model_dir" not in env


def test_heads_report_with_quick_eval(tmp_path, smollm2_dir, capsys):
    import shutil
    from pathlib import Path

    work, out = tmp_path / "work", tmp_path / "out"
    run = work / "heads" / "smollm2_n2"
    shutil.copytree(Path(__file__).resolve().parents[1] / "spd_ds" / "assets" / "heads" / "smollm2-135m-instruct-n2",
                    run / "head")
    (run / "train_summary.json").write_text(json.dumps({"steps": 5, "partition": {"stage_layers": [15, 15]}}))
    (run / "train_log.jsonl").write_text("\n".join(json.dumps({"tokens_per_s": t}) for t in (1.0, 10.0, 20.0)))
    out.mkdir()
    report = collect.heads_report(str(smollm2_dir), work, out, [2, 3], run_quick_eval=True, max_new_tokens=4)
    assert json.loads((out / "report.json").read_text()) == report
    two = report["stages"]["2"]
    assert two["steps"] == 5 and two["mean_tokens_per_s"] == 15.0 and len(two["train_log"]) == 3
    q = two["quick_eval_T0"]
    assert q["prompts"] == len(collect.QUICK_EVAL_PROMPTS) + 5 and q["num_new_tokens"] == 4 * q["prompts"]
    assert q["equivalent_accept_length"] == 2 * q["num_new_tokens"] / q["num_cycles"]
    assert report["stages"]["3"] == {} and report["regenerated"] is False
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("n=2: ") and "train_log" not in lines[0] and lines[1] == "n=3: {}"


def test_scripts_call_known_commands():
    """Every ``spd_ds.eval.collect <command>`` in scripts/*.sh is one the module knows (``--help`` of each parses)."""
    import re
    from pathlib import Path

    import pytest

    used = set()
    for sh in (Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"):
        used |= set(re.findall(r"spd_ds\.eval\.collect (\S+)", sh.read_text()))
    assert used == {"env", "first-stage-layers", "suite-c", "pipe-bench", "heads-report"}
    for cmd in used:
        with pytest.raises(SystemExit) as e:
            collect.main([cmd, "--help"])
        assert e.value.code == 0
