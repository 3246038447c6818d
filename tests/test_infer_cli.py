"""The main job as a user runs it: launch/infer.py on SmolLM2 (one process, plain python and under deepspeed)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pipe_worker import deepspeed_cmd

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "launch" / "configs" / "smollm2_spd.yaml"


def run(cmd, timeout=600):
    # one intra-op thread, as for the suite's in-process tests (tests/conftest.py) and the other tests' launches: the
    # command runs beside the other pytest-xdist worker on two cores, where a second OpenMP thread only spins (a
    # one-process SmolLM2 run took twice as long with two threads as with one next to a busy core). Under the
    # deepspeed launcher each of the 2 ranks had one thread already (spd_ds.cli: cores // local ranks).
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "deepspeed"])
def test_infer_answers_match_ar_and_a_stop_string_ends_spd_and_ar_at_the_same_token(smollm2_dir, tmp_path, launcher):
    """One launch per launcher checks what were two tests (each paid its own SmolLM2 launch, the deepspeed one a
    2-rank DeepSpeed start): the answers against AR, and ``--stop Paris``.

    python: reference decoder, checked against the single-process AR decoder; deepspeed: 2 ranks (2 stages, gloo)
    through the pipeline engine, checked against AR through the same pipeline. Both with the shipped n=2 head.
    ``--stop Paris``: the answer that reaches it ends with the token completing it (finish ``stop``) and is printed
    without it; the others end by length (so the length path of a run with stop strings runs too); SPD and AR
    (through the same pipeline under DeepSpeed) stay identical. The third prompt keeps a second full 12-token answer
    beside the colours one (the stopped answer is compared only up to its stop)."""
    from transformers import AutoTokenizer

    args = ["launch/infer.py", "--config", str(CONFIG), "decoding.max_new_tokens=12", "--stop", "Paris",
            "--prompt", "What is the capital of France?", "--prompt", "Name three colours.",
            "--prompt", "Describe a sunny day in the park.", "--output", str(tmp_path / "out.jsonl"),
            "decoding.max_length=100000000"]  # capped at the model's 8,192 positions (it was allocated in one process)
    cmd = [sys.executable, *args] if launcher == "python" else [*deepspeed_cmd(2), *args]
    r = run(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    ar = "AR decoding" if launcher == "python" else "AR through the same pipeline"
    assert f"identical to {ar}: 3/3 prompts" in r.stdout and "identical to AR: yes" in r.stdout
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 3 and '"equivalent_accept_length"' in lines[0] and '"ar_decode_tok_s"' in lines[0]
    rows = [json.loads(x) for x in lines]
    assert [x["finish_reason"] for x in rows] == ["stop", "length", "length"]
    assert len(rows[0]["tokens"]) < 12 and len(rows[1]["tokens"]) == len(rows[2]["tokens"]) == 12
    # the model's answer is right: its tokens hold "Paris" (the stop string keeps it out of the printed answer)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "Paris" in tok.decode(rows[0]["tokens"], skip_special_tokens=True)
    answer = r.stdout.split("=== [prompt0] What is the capital of France?", 1)[1].split("\n--- ", 1)[0]
    assert "finish stop" in r.stdout and answer.strip() and "Paris" not in answer  # printed up to the stop string
    assert rows[0]["text"] == answer.strip("\n") and [x["question_id"] for x in rows] == ["prompt0", "prompt1",
                                                                                        "prompt2"]
    # the speed verdict from the same run, and what the acceptance metric means
    speed = next(x for x in r.stdout.splitlines() if x.startswith("speed: "))
    assert re.search(rf"SPD [0-9.]+ tok/s, AR [0-9.]+ tok/s \({ar}, same run.*\): SPD is [0-9.]+x AR", speed)
    assert "1.00 = no gain over AR" in r.stdout and "counts the prefill token" in r.stdout
    one_process_note = "in one process the 2 stages run one after another" in r.stdout
    assert one_process_note == (launcher == "python")
    assert "SPD" in r.stderr and "tokens" in r.stderr  # the progress line (tqdm, stderr)
    if launcher == "deepspeed":  # rank 0 logs; rank 1's lines would repeat it
        assert r.stderr.count("engine deepspeed: 2 rank(s)") == 1


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "deepspeed"])
def test_stream_prints_the_answers_as_they_come(smollm2_dir, launcher):
    """``--stream`` (one process, and under DeepSpeed on the head rank): each SPD answer is printed once, as verified
    (cut before a stop string), then the metrics; the answers stay identical to AR."""
    args = ["launch/infer.py", "--config", str(CONFIG), "decoding.max_new_tokens=12", "--stream",
            "--stop", "Paris", "--prompt", "What is the capital of France?", "--prompt", "Name three colours."]
    r = run([sys.executable, *args] if launcher == "python" else [*deepspeed_cmd(2), *args])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "=== [prompt0] What is the capital of France?\nThe capital of France is \n" in r.stdout
    assert r.stdout.count("=== [prompt0]") == 1 and "--- [prompt0] " in r.stdout  # streamed, then its metrics
    assert "Paris" not in r.stdout.split("=== [prompt0]", 1)[1] and "2/2 prompts" in r.stdout
    assert "generation/s" not in r.stderr  # no progress line while streaming


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["head", "oracle"])
def test_sampled_stop_is_the_same_in_the_engine_and_the_reference(smollm2_dir, tmp_path, drafter):
    """T > 0 with stop strings: the pipeline engine (2 gloo ranks) draws the reference decoder's tokens with the same
    keyed uniforms and ends each answer at the same token, for the same reason (a stop string ends at least one).
    ``oracle``: the oracle's greedy reference runs past the stop strings in both (the engine's once ended at the
    first comma of its greedy continuation, and the poem's answer parted from the reference decoder's at token 8)."""
    rows = {}
    extra = (["decoding.temperature=0.8", "--stop", ".", "--stop", "\n", "--prompt", "What is the capital of France?",
              "--prompt", "Name three colours."] if drafter == "head" else
             ["decoding.temperature=1.0", "decoding.drafter=oracle", "decoding.oracle_alpha=0.5", "--stop", ",",
              "--prompt", "What is 2+2?", "--prompt", "Write a short poem about the sea and the wind, in four lines."])
    for launcher in ("python", "deepspeed"):
        out = tmp_path / f"{launcher}.jsonl"
        args = ["launch/infer.py", "--config", str(CONFIG), "decoding.max_new_tokens=32", *extra, "--no-compare-ar",
                "--no-progress", "--output", str(out)]
        r = run([sys.executable, *args] if launcher == "python" else [*deepspeed_cmd(2), *args])
        assert r.returncode == 0, r.stderr[-3000:]
        rows[launcher] = [(x["tokens"], x["finish_reason"]) for x in map(json.loads, out.read_text().splitlines())]
    assert rows["deepspeed"] == rows["python"]
    assert "stop" in [f for _, f in rows["python"]]


@pytest.mark.slow
def test_bad_stop_list_under_the_launcher_is_one_line_on_every_rank(smollm2_dir):
    """A stop list that YAML reads as a nested list fails on every rank before any collective: one line each, exit 2."""
    r = run([*deepspeed_cmd(2), "launch/infer.py", "--config", str(CONFIG), "decoding.stop=[[a]]", "--prompt", "hi"])
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-3000:]
    assert "error (rank 0 of 2): decoding.stop must be a list of non-empty strings" in text
    assert "Traceback" not in text and "DistNetworkError" not in text


def test_unknown_key_is_a_one_line_error():
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "partition.stages=3"])
    assert r.returncode == 2
    assert ("unknown config key 'partition.stages' (did you mean 'partition.num_stages'?); valid keys of partition: "
            "num_stages") in r.stderr


def test_num_prompts_override_beside_prompt_is_a_one_line_error(tmp_path):
    """data.num_prompts=K on the command line beside --prompt was ignored without a word (every --prompt text ran):
    one line, exit 2, before the model is resolved (the model named here does not exist)."""
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", "--prompt", "ho",
             "data.num_prompts=1", f"model.name={tmp_path / 'no_model_here'}"])
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("error: override 'data.num_prompts=1' does not combine with --prompt: data.num_prompts counts the "
                    "records taken from data.prompts, which --prompt replaces (all 2 --prompt texts are answered); "
                    "leave out one of the two"), last
    assert "no_model_here" not in r.stderr


def test_num_prompts_of_the_config_file_beside_prompt_is_not_an_error():
    """The shipped config sets data.num_prompts: 3 for its prompt set; with --prompt the prompts are the texts given,
    every one, and the file's value is no error (the user did not set it beside --prompt)."""
    infer = _infer_module()
    from spd_ds.config import ConfigError, load_config

    args = infer.parse_args(["--config", str(CONFIG), "--prompt", "a", "--prompt", "b"])
    cfg = load_config(args.config, args.overrides)
    assert cfg.data.num_prompts == 3 and infer.load_prompt_texts(cfg, args) == [("prompt0", "a"), ("prompt1", "b")]
    args = infer.parse_args(["--config", str(CONFIG), "--prompt", "a", "data.num_prompts=null"])  # null too
    with pytest.raises(ConfigError, match=r"^override 'data.num_prompts=null' does not combine with --prompt"):
        infer.load_prompt_texts(load_config(args.config, args.overrides), args)
    args = infer.parse_args(["--config", str(CONFIG), "--prompt", "a", "data.prompts=gsm8k"])  # the set: likewise
    with pytest.raises(ConfigError, match=r"^override 'data.prompts=gsm8k' does not combine with --prompt: "
                                          r"data.prompts names the prompt set or file, which --prompt replaces"):
        infer.load_prompt_texts(load_config(args.config, args.overrides), args)


@pytest.mark.slow
def test_too_many_stages_is_a_clear_error(smollm2_dir):
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "partition.num_stages=31", "--prompt", "hi"])
    assert r.returncode == 2
    assert "partition.num_stages=31 exceeds the model's 30 decoder layers" in r.stderr


@pytest.mark.slow
def test_head_for_another_partition_is_refused(smollm2_dir):
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "partition.num_stages=3", "--prompt", "hi"])
    assert r.returncode == 2
    assert "was trained for partition" in r.stderr and "partition.num_stages=2" in r.stderr


def _infer_module():
    from spd_ds.commands import infer

    return infer


@pytest.mark.parametrize("prompts", ["empty_file", "blank_lines"])
def test_empty_prompt_set_is_an_error_before_the_model(tmp_path, prompts):
    """No prompt: one line, exit 2, and no model is touched (the model named here does not exist)."""
    f = tmp_path / "prompts.jsonl"
    f.write_text("" if prompts == "empty_file" else "\n\n")
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), f"data.prompts={f}",
             f"model.name={tmp_path / 'no_model_here'}"], timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()
    assert last[-1].startswith(f"error: data.prompts={f} holds no prompts") and "no_model_here" not in r.stderr


def test_speed_lines_explain_the_numbers():
    """The speed verdict: SPD's and AR's decode tok/s of the same run and their ratio; the accept length's meaning
    with and without the prefill token; in one process, why no speedup and which command gives one."""
    from spd_ds.config import load_config
    from spd_ds.decoding.metrics import SPDMetrics
    from spd_ds.decoding.reference import GenerationResult

    infer = _infer_module()
    cfg = load_config(CONFIG)
    # a head that accepts nothing at n = 2: one token per 2 cycles after the prefill token
    spd = [GenerationResult(list(range(15)), "length", SPDMetrics(2, num_new_tokens=15, num_cycles=28, decode_s=2.0))]
    ar = [GenerationResult(list(range(15)), "length", SPDMetrics(1, num_new_tokens=15, num_cycles=14, decode_s=1.0))]
    lines = infer.speed_lines(cfg, spd, ar, "AR decoding", one_process=True)
    assert lines[0].startswith("speed: SPD 7.0 tok/s, AR 14.0 tok/s (AR decoding, same run") and "0.50x AR" in lines[0]
    assert "= 1.00 over decode tokens" in lines[1] and "1.00 = no gain over AR" in lines[1]
    assert "equivalent_accept_length 1.07 counts the prefill token" in lines[1]
    assert "deepspeed --num_gpus 2 launch/infer.py" in lines[2] and "one after another" in lines[2]
    lines = infer.speed_lines(cfg, spd, None, one_process=False)
    assert "AR did not run (--no-compare-ar)" in lines[0] and len(lines) == 2
    # n = 1: no pipeline at all; the note said "the 1 stages run one after another" and pointed at --num_gpus 1
    one = [GenerationResult(list(range(15)), "length", SPDMetrics(1, num_new_tokens=15, num_cycles=14, decode_s=2.0))]
    lines = infer.speed_lines(cfg, one, ar, "AR decoding", one_process=True)
    assert lines[2] == ("note: with partition.num_stages=1 there is no pipeline (the whole model is one stage), so SPD "
                        "cannot beat AR on any machine; the speedup needs n >= 2 stages on one device each")
    # max_new_tokens=1 (or a stop at once): the prefill's token alone, no decode rate or acceptance to speak of
    first = [GenerationResult([7], "length", SPDMetrics(2, num_new_tokens=1, num_cycles=0))]
    lines = infer.speed_lines(cfg, first, first, "AR decoding")
    assert lines == ["speed: no decode tokens (every answer ended at its first token: decoding.max_new_tokens=1, or "
                     "EOS or a stop string at once), so there is no speed or acceptance to report"]


def test_one_new_token_totals_and_rows_say_null_not_zero(smollm2_dir, tmp_path, capsys):
    """decoding.max_new_tokens=1: no draft verified and no decode token, so the printed totals and the --output rows
    give the rates and tok/s as null, as eval's reports do (spd_ds.eval.report.rates, speeds); they said 0.0. The
    AR row's decode clock ran a few microseconds after its one token (as hf_generate's does): still no decode token."""
    from types import SimpleNamespace

    from spd_ds.builder import load_tokenizer
    from spd_ds.config import load_config
    from spd_ds.decoding.metrics import SPDMetrics
    from spd_ds.decoding.reference import GenerationResult

    infer = _infer_module()
    spd = [GenerationResult([7], "length", SPDMetrics(2, num_new_tokens=1, prefill_s=0.2))]
    ar = [GenerationResult([7], "length", SPDMetrics(1, num_new_tokens=1, prefill_s=0.1, decode_s=3e-7))]
    args = SimpleNamespace(output=str(tmp_path / "answers.jsonl"), stream=False)
    infer.report(load_config(CONFIG), load_tokenizer(smollm2_dir), [("q1", "Hi")], spd, args, ar)
    out = capsys.readouterr().out
    totals = json.loads(out.split("=== totals\n", 1)[1].split("\n}\n", 1)[0] + "}")
    row = json.loads((tmp_path / "answers.jsonl").read_text())
    nulls = ("draft_acceptance_rate", "tokens_per_cycle", "equivalent_accept_length", "decode_tok_s",
             "ar_decode_tok_s")
    assert {k: totals[k] for k in nulls + ("equivalent_accept_length_decode", "speedup_vs_ar")} == dict.fromkeys(
        nulls + ("equivalent_accept_length_decode", "speedup_vs_ar"))
    assert {k: row[k] for k in nulls} == dict.fromkeys(nulls)
    assert totals["num_new_tokens"] == 1 and totals["prefill_s"] == 0.2  # what there is, still given


def _damaged_head(tmp_path, damage: str) -> Path:
    import shutil

    head = tmp_path / "head"
    shutil.copytree(ROOT / "spd_ds" / "assets" / "heads" / "smollm2-135m-instruct-n2", head)
    f = head / "head.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3] if damage == "truncated" else data[:8] + b"\xff\x00garbage" + data[17:])
    return head


@pytest.mark.slow
def test_damaged_head_is_one_line_exit_2_on_every_rank(smollm2_dir, tmp_path):
    """Two ranks started as a launcher starts them (no launcher that kills the second when the first exits): each
    finds the truncated head.safetensors in its pre-collective check and prints one rank-tagged line, exit 2."""
    from tests.test_pipe_worker import free_port

    head = _damaged_head(tmp_path, "truncated")
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, "launch/infer.py", "--config", str(CONFIG),
                                       f"head.checkpoint={head}", "--prompt", "hi"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 2, err[-3000:]
        lines = [x for x in (out + err).splitlines() if "head.safetensors is damaged" in x]
        assert len(lines) == 1 and lines[0].startswith(f"error (rank {rank} of 2): head {head}")
        assert "Traceback" not in out + err


@pytest.mark.slow
def test_damaged_head_under_the_launcher(smollm2_dir, tmp_path):
    head = _damaged_head(tmp_path, "header")
    r = run([*deepspeed_cmd(2), "launch/infer.py", "--config", str(CONFIG), f"head.checkpoint={head}",
             "--prompt", "hi"])
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-3000:]
    assert "error (rank 0 of 2): head" in text and "head.safetensors is damaged" in text
    assert "Traceback" not in text and "SafetensorError" not in text


def test_progress_line_names_the_pass_and_counts_prompts(capsys):
    """With the AR check each prompt is generated twice: the bar counts 2 x prompts generations and its label says
    which pass runs and how many of its prompts are done."""
    from types import SimpleNamespace

    from spd_ds.commands.infer import _Progress

    bar = _Progress(num_prompts=3, passes=2, enabled=True)
    labels = []
    for kind in ("spd", "ar"):
        for i in range(3):
            bar(kind, i, None)
            labels.append(bar.bar.desc.rstrip(": "))
            bar(kind, i, SimpleNamespace(tokens=[1, 2]))
    assert labels[0] == "SPD 0/3 prompts" and labels[2] == "SPD 2/3 prompts" and labels[3] == "AR check 0/3 prompts"
    assert bar.bar.desc.rstrip(": ") == "AR check 3/3 prompts" and bar.bar.n == bar.bar.total == 6 and bar.tokens == 12
    bar.close()
    err = capsys.readouterr().err
    assert "12 tokens" in err
    states = [x.split("|")[0] + x.split("|")[1] for x in err.replace("\n", "\r").split("\r") if "|" in x]
    assert len(states) == len(set(states)), states  # no state drawn twice (a log file would hold each repeat)
    assert not _Progress(num_prompts=0, passes=2, enabled=True).enabled


def test_output_path_under_a_file_is_an_error_before_the_model(tmp_path):
    """``--output`` that cannot be written: one line, exit 2, before any model is resolved (none exists here)."""
    (tmp_path / "afile").write_text("")
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi",
             "--output", str(tmp_path / "afile" / "out.jsonl"), f"model.name={tmp_path / 'no_model_here'}"],
            timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --output's folder ") and "a file stands at it" in last
    assert "no_model_here" not in r.stderr
    # an existing writable file is fine (/dev/null here): the run goes on to the model, which does not exist
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", "--output", os.devnull,
             f"model.name={tmp_path / 'no_model_here'}"], timeout=300)
    assert r.returncode == 2 and "no_model_here" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_fifo_output_with_no_reader_is_an_error_before_the_model(tmp_path):
    """``--output`` a FIFO that nobody reads: one line, exit 2, before any model is resolved; it used to pass the
    check and hang for ever in the final open for writing, after the whole run."""
    fifo = tmp_path / "answers.fifo"
    os.mkfifo(fifo)
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", "--output", str(fifo),
             f"model.name={tmp_path / 'no_model_here'}"], timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (f"error: --output {fifo} is a FIFO with no reader; start the reader "
                                                 "first (or write to a regular file)")
    assert "no_model_here" not in r.stderr


@pytest.mark.slow
def test_bad_inputs_known_before_decoding_are_one_line_errors(smollm2_dir, tmp_path):
    """A prompt too long for the KV capacity fails before the target's weights load; a missing draft vocabulary and
    an EOS id outside the vocabulary name their keys."""
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi " * 60,
             "decoding.max_length=64", "decoding.max_new_tokens=8"], timeout=300)  # 8 + 2 fit: the prompt does not
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: [prompt0] prompt of ") and "exceeds the context of 64" in last
    assert "layers in" not in r.stderr  # the target was never built (its log line names its stages)
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi",
             f"head.draft_vocab={tmp_path / 'nope.json'}"], timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and f"head.draft_vocab={tmp_path / 'nope.json'} does not exist" in last, r.stderr[-2000:]
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi",
             "decoding.eos_token_ids=[2,999999]"], timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "decoding.eos_token_ids [999999] are outside the target's vocabulary of 49152" in last
    r = run([sys.executable, "launch/infer.py", "model.name=random:qwen3.5-tiny", "partition.num_stages=2",
             "head.checkpoint=null", "--prompt", "hello world"], timeout=300)  # a shape without a tokenizer
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "has no tokenizer" in last and "eval.prompt_sets=[random]" in last, r.stderr[-2000:]
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi",
             "model.attn_implementation=flash_attention_2"], timeout=300)  # was 140 lines: four tracebacks
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "error: model.attn_implementation must be one of sdpa, eager (spd-ds's stages pass an explicit mask over a "
        "static KV cache, which the other transformers backends do not take), got 'flash_attention_2'")


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["runner", "launcher"])
def test_every_rank_ends_when_the_deepspeed_command_or_its_launcher_is_killed(smollm2_dir, tmp_path, victim):
    """DeepSpeed's single-node runner forwards no signal: `kill <deepspeed pid>` used to leave the launcher and both
    ranks decoding. Each rank's launcher watch (spd_ds.launcher_watch.watch_launcher) now ends them: SIGTERM to the
    runner stops the launcher and its ranks; SIGKILL to the launcher makes each rank stop itself."""
    import contextlib
    import signal
    import time

    import psutil

    log = tmp_path / "out.txt"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [*deepspeed_cmd(2), "launch/infer.py", "--config", str(CONFIG), "decoding.max_new_tokens=4000",
           "decoding.max_length=4200", "--prompt", "Tell a very long story.", "--no-compare-ar"]
    with open(log, "w") as out:
        runner = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    tree = []
    try:
        deadline = time.time() + 300
        while "engine deepspeed:" not in log.read_text():  # logged after setup_process, which starts the watch
            assert runner.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        tree = psutil.Process(runner.pid).children(recursive=True)
        launcher = next(p for p in tree if "deepspeed.launcher.launch" in " ".join(p.cmdline()))
        ranks = launcher.children()
        assert len(ranks) == 2
        if victim == "runner":
            runner.send_signal(signal.SIGTERM)
            gone = [launcher, *ranks]
        else:
            launcher.kill()
            gone = ranks
        t0 = time.time()
        _, alive = psutil.wait_procs(gone, timeout=30)
        assert not alive, f"{victim} killed: still running after 30 s: {[p.pid for p in alive]}"
        assert time.time() - t0 < 15
        text = log.read_text()
        assert ("the deepspeed command" if victim == "runner" else "the DeepSpeed launcher") in text, text[-3000:]
    finally:  # nothing left behind, whatever failed
        for p in [*tree, runner]:
            with contextlib.suppress(psutil.Error, OSError):
                p.kill()
        runner.wait()


@pytest.mark.parametrize("extra,env,message", [
    (["--output", ""], {}, "error: --output is empty; give a file path"),
    (["--stop", ""], {}, "error: --stop '' is empty; give the text that ends an answer (a newline: --stop $'\\n' in "
                         "bash)"),
])
def test_options_that_would_be_ignored_are_refused_before_the_model(tmp_path, extra, env, message):
    """An empty --output wrote nothing without a word; an empty --stop was reported as decoding.stop."""
    cmd = [sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", *extra,
           f"model.name={tmp_path / 'no_model_here'}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == message, r.stderr[-2000:]


def test_prompt_ids_keep_their_type(tmp_path):
    """--output's question_id is the prompt file's own (MT-Bench's integer 81 was written as "81", null as "None")."""
    from types import SimpleNamespace

    from spd_ds.commands.infer import load_prompt_texts
    from spd_ds.config import load_config

    f = tmp_path / "p.jsonl"
    f.write_text('{"question_id": 81, "turns": ["a"]}\n{"question_id": "x7", "turns": ["b"]}\n')
    cfg = load_config(None, [f"data.prompts={f}"])
    assert load_prompt_texts(cfg, SimpleNamespace(prompt=None)) == [(81, "a"), ("x7", "b")]


def test_blank_prompt_is_refused_before_the_model(tmp_path):
    """An empty --prompt was answered (the chat template's markers alone); it is now one line, before any model."""
    cmd = [sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", "--prompt", "  ",
           f"model.name={tmp_path / 'no_model_here'}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --prompt number 2 is empty (") and "no_model_here" not in r.stderr, r.stderr[-2000:]


def test_engine_reference_under_a_launcher_decodes_on_rank_0_alone(tmp_path):
    """--engine reference under a launcher of 2 ran the whole job on both ranks, both printing every answer and
    writing the same --output; now the other ranks end at once (as launch/eval.py's do) and rank 0 decodes."""
    cmd = [sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", "--engine", "reference",
           f"model.name={tmp_path / 'no_model_here'}"]
    other = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"})
    assert other.returncode == 0 and "no_model_here" not in other.stderr, other.stderr[-2000:]
    head = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"})
    assert head.returncode == 2 and "no_model_here" in head.stderr.strip().splitlines()[-1], head.stderr[-2000:]


def test_data_chat_template_encodes_the_prompts_of_decoding(smollm2_dir, monkeypatch, sdpa_flags):
    """data.chat_template (the template a head trained under) is the prompts' template in decoding too; it was read
    by training alone. A file that is not a template is one line."""
    from spd_ds import builder
    from spd_ds.commands import infer
    from spd_ds.config import ConfigError, load_config

    cfg = load_config(str(CONFIG), ["data.chat_template='{{ \"Q: \" + messages[0][\"content\"] }}'"])
    tok = builder.prompt_tokenizer(cfg, smollm2_dir)
    assert builder.encode_prompt(tok, "hi") == tok("Q: hi")["input_ids"]
    assert builder.encode_prompt(builder.prompt_tokenizer(load_config(str(CONFIG)), smollm2_dir), "hi") != \
        tok("Q: hi")["input_ids"]  # the tokenizer's own template otherwise
    with pytest.raises(ConfigError, match=r"^data.chat_template: chat template 'nope.jinja' is neither a file"):
        builder.prompt_tokenizer(load_config(str(CONFIG), ["data.chat_template=nope.jinja"]), smollm2_dir)

    class Encoded(Exception):
        pass

    def encode(tok, text, chat_template=True):  # infer's prompts, before any model loads
        raise Encoded(tok.chat_template)

    monkeypatch.setattr(builder, "encode_prompt", encode)
    with pytest.raises(Encoded, match=r"Q: "):
        infer._main(["--config", str(CONFIG), "--prompt", "hi",
                     "data.chat_template='{{ \"Q: \" + messages[0][\"content\"] }}'"])


def test_a_refused_run_leaves_no_empty_output_folder(tmp_path):
    """--output's new folders are made before the model loads (so that a bad path fails at once); a run refused after
    that (here: the model does not exist) left them behind, empty. They are removed, as eval.output_dir's are."""
    out = tmp_path / "new" / "deeper" / "out.jsonl"
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", "--output", str(out),
             f"model.name={tmp_path / 'no_model_here'}"], timeout=300)
    assert r.returncode == 2 and "no_model_here" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a folder that existed before is kept
    r = run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "--prompt", "hi", "--output",
             str(tmp_path / "kept" / "out.jsonl"), f"model.name={tmp_path / 'no_model_here'}"], timeout=300)
    assert r.returncode == 2 and (tmp_path / "kept").is_dir()
