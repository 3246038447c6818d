"""The evaluation runner and its reports on a tiny random-weight model: summary schema, per-prompt rows, plots,
exactness against every AR baseline, PPSD beside SPD, oracle sweeps, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from spd_ds.config import ConfigError, load_config
from spd_ds.eval.report import (check_summary_schema, per_prompt_rows, repeated_ngram_share, summarize,
                                write_reports)
from spd_ds.eval.inputs import random_prompt_ids
from spd_ds.eval.runner import first_divergence, run_eval
from tests.test_eval_random_weights import make_random_shape

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A tiny shape, an (untrained) SPD head for n=2 and a PPSD head (anchors (0, e_1)) saved as checkpoints."""
    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch
    from spd_ds.partition import StagePartition

    root = tmp_path_factory.mktemp("eval")
    shape = make_random_shape(root, "qwen3")
    arch = TargetArch(shape)
    torch.manual_seed(0)
    spd = SpeculationHead(arch, StagePartition.build(4, 2)).save(root / "spd-n2")
    ppsd = SpeculationHead(arch, StagePartition.build(4, 2, anchors=[0, 2])).save(root / "ppsd-n2")
    return shape, spd, ppsd


def overrides(shape, out, *extra):
    return [f"model.name={shape}", "eval.prompt_sets=[random]", "eval.random_prompt_lengths=[5,9]",
            "data.num_prompts=2", "decoding.max_new_tokens=12", f"eval.output_dir={out}", "eval.progress=false",
            *extra]


def test_summary_schema_ppsd_and_exactness(heads, tmp_path):
    shape, spd, ppsd = heads
    cfg = load_config(None, overrides(shape, tmp_path, f"head.checkpoint={spd}", f"eval.ppsd_checkpoint={ppsd}",
                                      "eval.baselines=[ar,ar_graph,hf_generate]"))
    run = run_eval(cfg, engine="reference")
    assert list(run.methods) == ["spd", "ppsd", "ar", "ar_graph", "hf_generate"]
    assert run.cfg.decoding.max_length == 64 and run.cfg.decoding.eos_token_ids == []  # fitted; random: no EOS
    summary = write_reports(run, tmp_path)
    assert check_summary_schema(summary) == []
    assert json.loads((tmp_path / "summary.json").read_text())["schema_version"] == 1
    assert (tmp_path / "acceptance_by_depth.png").stat().st_size > 1000
    assert (tmp_path / "cycle_time_split.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (tmp_path / "per_prompt.jsonl").read_text().splitlines()]
    assert len(rows) == 5 * 2 and {r["method"] for r in rows} == set(run.methods)
    assert all(r["num_new_tokens"] == 12 for r in rows)
    assert all(r["first_divergence"] == {"ar": None, "ar_graph": None, "hf_generate": None}
               for r in rows if r["kind"] == "spd")
    ex = summary["exactness"]
    assert ex["checked"] and all(r["identical"] == r["prompts"] == 2 for per in ex["by_method"].values()
                                 for r in per.values())
    spd_o = summary["results"]["spd"]["overall"]
    # every verification appends one token (accepted draft or replacement) after each prompt's prefill token
    assert spd_o["num_new_tokens"] == 24 == 2 + spd_o["num_drafts"]
    assert spd_o["num_drafts"] == spd_o["num_accepted_tokens"] + spd_o["num_rollbacks"]
    assert set(spd_o["speedup_vs_ar"]) == {"ar", "ar_graph", "hf_generate"}
    assert summary["results"]["ar"]["overall"]["draft_acceptance_rate"] is None
    assert summary["methods"]["ppsd"]["description"].startswith("PPSD head")
    assert set(summary["results"]["spd"]["by_set"]) == {"random"}
    assert summary["decoding"]["oracle_alphas"] is None  # no oracle method ran
    assert all(m["oracle_alpha"] is None for m in summary["methods"].values())
    assert "INCLUDING" in summary["definitions"]["num_new_tokens"]
    tokens = [r["tokens"] for r in rows if r["method"] == "spd"]
    assert spd_o["repeated_ngram_share"] == repeated_ngram_share(tokens) is not None
    write_reports(run, tmp_path, plots=False)  # a later run into the same folder: no plot of this one stays
    assert not (tmp_path / "acceptance_by_depth.png").exists() and not (tmp_path / "cycle_time_split.png").exists()
    assert check_summary_schema(json.loads((tmp_path / "summary.json").read_text())) == []


def test_ppsd_head_alone_equals_its_row_beside_spd(heads, tmp_path):
    """eval.spd=false: the PPSD row alone, the same tokens and acceptance as beside the SPD head, exact against AR."""
    shape, spd, ppsd = heads
    both = run_eval(load_config(None, overrides(shape, tmp_path / "both", f"head.checkpoint={spd}",
                                                f"eval.ppsd_checkpoint={ppsd}", "eval.baselines=[]",
                                                "eval.warmup_prompts=0")), engine="reference")
    alone = run_eval(load_config(None, overrides(shape, tmp_path / "alone", f"eval.ppsd_checkpoint={ppsd}",
                                                 "eval.spd=false", "eval.baselines=[ar]", "eval.warmup_prompts=0")),
                     engine="reference")
    assert list(alone.methods) == ["ppsd", "ar"]
    assert [r.tokens for r in alone.methods["ppsd"].results.values()] == \
        [r.tokens for r in both.methods["ppsd"].results.values()]
    s, b = summarize(alone), summarize(both)
    assert s["partition"]["anchors"] == [0, 2] and b["partition"]["anchors"] == [0, 2, 4]  # the PPSD head's own
    assert s["results"]["ppsd"]["overall"]["num_accepted_tokens"] == b["results"]["ppsd"]["overall"][
        "num_accepted_tokens"]
    assert all(r["identical"] == r["prompts"] == 2 for per in s["exactness"]["by_method"].values()
               for r in per.values())


def test_suite_c_runs_a_ppsd_head_alone_where_no_spd_head_is_given(tmp_path):
    from spd_ds.eval.benchmark import suite_runs

    for name in ("spd-n2", "ppsd-n2", "ppsd-n3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "head_config.json").write_text("{}")
    runs = suite_runs(["c"], cuda=False, spd_head=str(tmp_path / "spd-n{n}"), ppsd_head=str(tmp_path / "ppsd-n{n}"),
                      stages_c=(2, 3, 5))
    ov = {int(r.label.rsplit("=", 1)[1]): r.overrides for r in runs}
    val = {n: dict(x.split("=", 1) for x in o) for n, o in ov.items()}  # null: no head (not a --config file's)
    assert "null" not in (val[2]["head.checkpoint"], val[2]["eval.ppsd_checkpoint"]) and "eval.spd" not in val[2]
    assert val[3]["head.checkpoint"] == "null" != val[3]["eval.ppsd_checkpoint"] and val[3]["eval.spd"] == "false"
    assert val[5]["head.checkpoint"] == val[5]["eval.ppsd_checkpoint"] == "null" and "eval.spd" not in val[5]
    assert [r.label for r in runs] == ["smollm2 fp32 cpu n=2", "smollm2 fp32 cpu n=3", "smollm2 fp32 cpu n=5"]


def test_suite_labels_name_the_model_an_override_chose(tmp_path):
    from spd_ds.eval.benchmark import suite_runs

    runs = suite_runs(["a", "b", "c"], cuda=False, stages_c=(2,), model_b="random:smollm2-135m",
                      extra=[f"model.name={tmp_path / 'tiny-llama'}"])
    assert [r.label for r in runs] == ["tiny-llama float32 n=2", "tiny-llama float32 n=2", "tiny-llama fp32 cpu n=2"]
    assert suite_runs(["b"], cuda=True, model_b="random:qwen3-4b")[0].label == "qwen3-4b bfloat16 n=2"


def test_oracle_sweep_in_one_run(heads, tmp_path):
    shape, _, _ = heads
    cfg = load_config(None, overrides(shape, tmp_path, "decoding.drafter=oracle", "eval.oracle_alphas=[1,0.5]",
                                      "eval.baselines=[ar]", "eval.warmup_prompts=0"))
    run = run_eval(cfg, engine="reference")
    s = summarize(run)
    full = s["results"]["spd_oracle_1"]["overall"]
    assert full["draft_acceptance_rate"] == 1.0 and full["equivalent_accept_length"] == pytest.approx(2.0)
    half = s["results"]["spd_oracle_0.5"]["overall"]
    assert 0 < half["draft_acceptance_rate"] < 1
    assert all(r["identical"] == 2 for per in s["exactness"]["by_method"].values() for r in per.values())
    rows = per_prompt_rows(run)
    assert len(rows) == 3 * 2
    assert [r["draft_acceptance_rate"] for r in rows if r["method"] == "spd_oracle_1"] == [1.0, 1.0]
    assert all(r["draft_acceptance_rate"] is None and r["tokens_per_cycle"] is None
               for r in rows if r["method"] == "ar")
    # the summary names the alphas that ran, not the config's decoding.oracle_alpha (1.0 whatever the sweep was)
    assert s["decoding"]["oracle_alphas"] == [1.0, 0.5] and "oracle_alpha" not in s["decoding"]
    assert {m: d["oracle_alpha"] for m, d in s["methods"].items()} == {"spd_oracle_1": 1.0, "spd_oracle_0.5": 0.5,
                                                                       "ar": None}
    one = summarize(run_eval(load_config(None, overrides(
        shape, tmp_path, "decoding.drafter=oracle", "eval.oracle_alphas=[0.25]", "eval.baselines=[]",
        "eval.warmup_prompts=0", "data.num_prompts=1")), engine="reference"))
    assert one["decoding"]["oracle_alphas"] == [0.25] and one["methods"]["spd_oracle_0.25"]["oracle_alpha"] == 0.25


def test_sampling_skips_exactness_and_limits_baselines(heads, tmp_path):
    shape, _, _ = heads
    cfg = load_config(None, overrides(shape, tmp_path, "decoding.temperature=0.8", "eval.baselines=[ar]",
                                      "eval.baseline_num_prompts=1", "eval.plots=false"))
    s = summarize(run_eval(cfg, engine="reference"))
    assert not s["exactness"]["checked"] and "temperature" in s["exactness"]["reason"]
    assert s["methods"]["ar"]["num_prompts"] == 1 and s["methods"]["spd"]["num_prompts"] == 2


def test_check_exact_false_compares_nothing(heads, tmp_path):
    """eval.check_exact=false: no exactness block and no first_divergence in the per-prompt rows (they used to carry
    one at T = 0 although nothing was asked to be compared); the printed exactness line says why."""
    from spd_ds.eval.report import exactness_lines

    shape, _, _ = heads
    cfg = load_config(None, overrides(shape, tmp_path, "eval.check_exact=false", "eval.baselines=[ar]",
                                      "eval.warmup_prompts=0", "eval.plots=false"))
    run = run_eval(cfg, engine="reference")
    summary = write_reports(run, tmp_path)
    assert summary["exactness"] == {"checked": False, "reason": "eval.check_exact is false", "reference": "ar",
                                    "by_method": {}}
    rows = [json.loads(x) for x in (tmp_path / "per_prompt.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and not any("first_divergence" in r for r in rows)
    assert exactness_lines(summary) == ["exactness not checked: eval.check_exact is false"]
    run.cfg.eval.check_exact = True  # the same run, compared: every SPD row names its divergence from ar
    assert [r["first_divergence"] for r in per_prompt_rows(run) if r["kind"] == "spd"] == [{"ar": None}] * 2


def test_one_new_token_has_no_acceptance_figures(heads, tmp_path):
    """decoding.max_new_tokens=1: the prefill token alone, no draft verified and no cycle run, so acceptance is not
    applicable: null in summary.json and '-' in the printed table (it used to say 0, a head that accepts nothing)."""
    from spd_ds.eval.report import summary_table

    shape, spd, _ = heads
    cfg = load_config(None, overrides(shape, tmp_path, f"head.checkpoint={spd}", "decoding.max_new_tokens=1",
                                      "eval.baselines=[ar]", "eval.warmup_prompts=0", "eval.plots=false"))
    s = json.loads(json.dumps(summarize(run_eval(cfg, engine="reference"))))  # as summary.json holds it
    for b in [s["results"]["spd"]["overall"], *s["results"]["spd"]["by_set"].values()]:
        assert (b["num_new_tokens"], b["num_drafts"], b["num_cycles"]) == (2, 0, 0)
        assert b["draft_acceptance_rate"] is None and b["tokens_per_cycle"] is None
        assert b["equivalent_accept_length"] is None
    head, _, *rows = summary_table(s).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    spd_row = dict(zip(cols, (c.strip() for c in rows[0].strip("|").split("|"))))
    assert spd_row["method"] == "spd" and spd_row["devices"] == str(s["methods"]["spd"]["devices"])
    assert [spd_row[c] for c in ("eq. accept len", "draft acc.", "tok/cycle")] == ["-", "-", "-"]
    rates = ("draft_acceptance_rate", "tokens_per_cycle", "equivalent_accept_length")
    rows = per_prompt_rows(run_eval(cfg, engine="reference"))  # per_prompt.jsonl's rows say the same (they said 0.0)
    assert {r["kind"] for r in rows} == {"spd", "baseline"}
    assert all(r[k] is None for r in rows for k in rates), [[r[k] for k in rates] for r in rows]


def test_one_new_token_has_no_speed_figures(heads, tmp_path):
    """decoding.max_new_tokens=1: no decode token (tok/s counts decode tokens only, the prefill token excluded) and
    no decode cycle, so tok/s, cycle ms, GB/s and the x columns are not applicable: null in summary.json and
    per_prompt.jsonl, '-' in eval's and the benchmark's tables (they said 0), and the time plot still draws.
    hf_generate times a few microseconds after its one token: still no decode token, so still null."""
    from spd_ds.eval.benchmark import SuiteRun, render
    from spd_ds.eval.report import summary_table

    shape, spd, _ = heads
    cfg = load_config(None, overrides(shape, tmp_path, f"head.checkpoint={spd}", "decoding.max_new_tokens=1",
                                      "eval.baselines=[ar,hf_generate]", "eval.warmup_prompts=0"))
    run = run_eval(cfg, engine="reference")
    s = json.loads(json.dumps(write_reports(run, tmp_path / "out", plots=True)))  # as summary.json holds it
    assert (tmp_path / "out" / "cycle_time_split.png").stat().st_size > 0
    for name, res in s["results"].items():
        for b in [res["overall"], *res["by_set"].values()]:
            assert b["num_new_tokens"] == 2, name
            assert (b["decode_tok_s"], b["mean_decode_tok_s"], b["cycle_time_split_ms"]) == (None, None, None), name
            assert b["achieved_gbps"] is None and set(b["speedup_vs_ar"].values()) <= {None}, name
    assert set(s["results"]["spd"]["overall"]["speedup_vs_ar"]) == {"ar", "hf_generate"}
    head, _, *rows = summary_table(s).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    for row in rows:
        cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
        assert [cells[c] for c in ("tok/s", "x ar", "x hf_generate", "cycle ms")] == ["-"] * 4, row
    for r in per_prompt_rows(run):
        assert r["decode_tok_s"] is None and r.get("cycle_time_split_ms") is None, r
    bench = render([SuiteRun("a", "tiny n=2", [], summary=s)]).split("\n\n")[0].splitlines()
    cols = [c.strip() for c in bench[0].strip("|").split("|")]
    for row in bench[2:]:
        if row.startswith("|"):
            cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
            assert [cells[c] for c in ("tok/s", "x hf_generate", "cycle ms")] == ["-"] * 3, row


def test_clear_errors(heads, tmp_path):
    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch
    from spd_ds.partition import StagePartition

    shape, spd, _ = heads
    with pytest.raises(ConfigError, match="known: hf_generate"):
        run_eval(load_config(None, overrides(shape, tmp_path, "eval.baselines=[nope]")), engine="reference")
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        run_eval(load_config(None, overrides(shape, tmp_path, "eval.prompt_sets=[mt_bench]")), engine="reference")
    with pytest.raises(ConfigError, match="unknown random model shape"):
        run_eval(load_config(None, overrides("random:qwen9-1t", tmp_path)), engine="reference")
    odd = SpeculationHead(TargetArch(shape), StagePartition.build(4, stage_layers=[1, 3], anchors=[0, 1])).save(
        tmp_path / "ppsd-odd")
    with pytest.raises(ConfigError, match="eval.spd=false leaves no head"):
        run_eval(load_config(None, overrides(shape, tmp_path, "eval.spd=false")), engine="reference")
    with pytest.raises(ConfigError, match="PPSD head's stages"):
        run_eval(load_config(None, overrides(shape, tmp_path, f"head.checkpoint={spd}", f"eval.ppsd_checkpoint={odd}",
                                             "eval.baselines=[]")), engine="reference")


def test_repeated_ngram_share_counts_loops():
    assert repeated_ngram_share([[1, 2, 3, 4]], n=3) == 0.0  # 2 positions, nothing seen twice
    assert repeated_ngram_share([[1, 2, 1, 2, 1, 2]], n=3) == 0.5  # (1,2,1) (2,1,2) new, then both again
    assert repeated_ngram_share([[1, 2, 1, 2, 1, 2], [5, 6, 7, 8]], n=3) == 2 / 6  # pooled over positions
    assert repeated_ngram_share([[1, 2], []], n=3) is None  # no answer long enough
    assert repeated_ngram_share([[7] * 20]) == 11 / 12  # one 9-gram of 7s, then the same 11 times


def test_helpers():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    a = random_prompt_ids(3, [4, 7], 100, seed=1)
    assert [len(p) for p in a] == [4, 7, 4] and a == random_prompt_ids(3, [4, 7], 100, seed=1)
    assert a != random_prompt_ids(3, [4, 7], 100, seed=2)


def test_baseline_registry_is_pluggable(heads, tmp_path):
    from spd_ds.decoding.ar import ARDecoder
    from spd_ds.eval.baselines import BASELINES, register_baseline, resolve_baseline

    shape, _, _ = heads
    register_baseline("ar_again", lambda ctx: ARDecoder(ctx.target, ctx.sampling, ctx.eos_token_ids, ctx.max_len))
    register_baseline("ar_by_name", "spd_ds.decoding.ar:ARDecoder")
    try:
        run = run_eval(load_config(None, overrides(shape, tmp_path, "eval.baselines=[ar_again,ar_by_name]",
                                                   "eval.plots=false")), engine="reference")
        s = summarize(run)
        assert set(s["results"]["spd"]["overall"]["speedup_vs_ar"]) == {"ar_again", "ar_by_name"}
        assert s["exactness"]["checked"] is False  # only the known AR names count for exactness
    finally:
        BASELINES.pop("ar_again"), BASELINES.pop("ar_by_name")
    with pytest.raises(ValueError, match="unknown baseline"):
        resolve_baseline("ar_again")


def test_cycle_time_split_plot_compares_per_token(heads, tmp_path):
    """The plot's bars, read back from the figure, are ms per decode token for SPD and AR alike (each adds up to
    1000 / decode tok/s); the legend is outside the axes; the caption states prompts, tokens, n, T and device. A CPU
    run has no GB/s or % HBM."""
    import matplotlib.pyplot as plt

    from spd_ds.eval.plots import cycle_time_split_figure
    from spd_ds.eval.report import summary_table

    shape, spd, _ = heads
    cfg = load_config(None, overrides(shape, tmp_path, f"head.checkpoint={spd}", "eval.baselines=[ar]",
                                      "eval.warmup_prompts=0"))
    s = summarize(run_eval(cfg, engine="reference"))
    fig = cycle_time_split_figure(s)
    ax = fig.axes[0]
    widths = {}
    for patch in ax.patches:
        y = round(patch.get_y() + patch.get_height() / 2)
        widths[y] = widths.get(y, 0.0) + patch.get_width()
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == ["spd", "ar"]
    for y, name in enumerate(names):
        assert widths[y] == pytest.approx(1e3 / s["results"][name]["overall"]["decode_tok_s"], rel=1e-6)
    assert "ms per decode token" in ax.get_xlabel()
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().transformed(ax.transAxes.inverted()).x0 > 1.0  # right of the axes
    caption = fig.texts[-1].get_text()
    for word in ("prompts: random x2", "up to 12 new tokens", "n=2", "T=0", "device cpu"):
        assert word in caption
    plt.close(fig)
    assert s["bandwidth"] is None and s["results"]["spd"]["overall"]["achieved_gbps"] is None
    assert s["results"]["ar"]["overall"]["hbm_fraction"] is None
    assert "GB/s" not in summary_table(s) and "HBM" not in summary_table(s)


def test_bandwidth_only_against_a_named_gpu():
    from spd_ds.eval.report import bandwidth_line, summary_table
    from spd_ds.eval.speed import known_bandwidth

    assert known_bandwidth("NVIDIA H200")[0] == 4270.0 and known_bandwidth("NVIDIA GH200 480GB") is None
    assert known_bandwidth("NVIDIA A100-SXM4-80GB")[0] == 2039.0 and known_bandwidth("NVIDIA A10G")[0] == 600.0
    assert known_bandwidth("NVIDIA L40S")[0] == 864.0 and known_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3350.0
    block = {"decode_tok_s": 100.0, "speedup_vs_ar": {}, "equivalent_accept_length": None,
             "draft_acceptance_rate": None, "tokens_per_cycle": None, "cycle_time_split_ms": None,
             "achieved_gbps": 54.0, "hbm_fraction": 54.0 / 4270.0}
    gpu = {"device": "cuda:0", "bandwidth": {"device_name": "NVIDIA H200", "gbps": 4270.0, "source": "measured"},
           "methods": {"ar": {"kind": "baseline", "num_stages": 1}}, "results": {"ar": {"overall": block}}}
    table = summary_table(gpu)
    assert "| GB/s" in table and "% HBM" in table and "1.26" in table
    assert "NVIDIA H200's 4270 GB/s" in bandwidth_line(gpu)
    assert "GPU runs only" in bandwidth_line({"device": "cpu", "bandwidth": None})


def test_run_baselines_applies_its_own_runs_sdpa_backends(heads, tmp_path, sdpa_flags):
    # benchmark.py measures every suite's baselines after all SPD runs: another run's build_arch may have set other
    # SDPA flags in between, and the baselines must run with their own run's model.sdpa_backends
    from spd_ds.eval.runner import run_baselines

    shape, spd, _ = heads
    c = sdpa_flags
    cfg = load_config(None, overrides(shape, tmp_path, f"head.checkpoint={spd}", "eval.baselines=[ar]",
                                      "model.sdpa_backends=[flash, math]"))
    run = run_eval(cfg, engine="reference", baselines=False)
    assert list(run.methods) == ["spd"]
    c.enable_mem_efficient_sdp(True)  # as another suite's build_arch would leave them
    c.enable_cudnn_sdp(True)
    run_baselines(run)
    assert (c.flash_sdp_enabled(), c.mem_efficient_sdp_enabled(), c.math_sdp_enabled(),
            c.cudnn_sdp_enabled()) == (True, False, True, False)
    ar, sp = run.methods["ar"].results, run.methods["spd"].results
    assert ar and all(ar[i].tokens == sp[i].tokens for i in ar)


def test_benchmark_names_results_of_an_earlier_run_in_its_folder(tmp_path):
    """benchmark --out into a folder that holds another run's suites: those folders are named (benchmark.md and .json
    list this run's only)."""
    from spd_ds.eval.benchmark import earlier_results

    for tag in ("a", "c2", "c3"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "summary.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    assert earlier_results(tmp_path, [tmp_path / "a", str(tmp_path / "c2")]) == ["c3"]
    assert earlier_results(tmp_path, [tmp_path / t for t in ("a", "c2", "c3")]) == []
