"""End to end: ``deepspeed --num_gpus 2 launch/train.py`` on CPU (gloo), ZeRO-2, a tiny random llama.

Slow tier (each launch starts two Python processes with torch, transformers and DeepSpeed; the very first DeepSpeed
launch on a machine also JIT-builds its CPU communication op, about 100 s once).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.test_train_data import make_chat_model, make_chats
from tests.test_pipe_worker import free_port

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600


def _experiment(tmp: Path, model: Path, data: Path, **train) -> Path:
    cfg = {
        "model": {"name": str(model), "dtype": "float32"},
        "partition": {"num_stages": 2},
        "head": {"num_layers": 1},
        "data": {"train_files": [str(data)], "max_seq_length": 128, "micro_batch_size": 2, "min_seq_length": 4,
                 "held_out_fraction": 0.05},
        "train": {"output_dir": str(tmp / "run"), "max_steps": 12, "lr": 3e-3, "warmup_steps": 2, "log_every": 1,
                  "save_every": 6, "progress": False, "eval_every": 4, **train},
    }
    path = tmp / "exp.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(config: Path, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
           str(free_port()), "launch/train.py", "--config", str(config), "--deepspeed_config",
           "ds_configs/zero2.json", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return proc


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir)}


VAL_KEYS = ("val_agreement_by_fill", "val_pred_acceptance", "val_pred_accept_length", "val_positions",
            "val_overlap_by_fill_sampled", "val_pred_acceptance_sampled")


def _validation(run_dir: Path) -> dict[int, tuple]:
    """Validation figures by step (the records that carry them)."""
    return {r["step"]: tuple(json.dumps(r[k]) for k in VAL_KEYS) for r in _records(run_dir) if "val_positions" in r}


def _stopped_at_step6(run_a_dir: Path, where: Path, model: Path, data: Path) -> tuple[Path, Path]:
    """A run directory under ``where`` holding run a's step-6 checkpoint as its latest (as if it had stopped
    there); returns the experiment file and the checkpoint directory."""
    where.mkdir()
    cfg = _experiment(where, model, data)
    ck = where / "run" / "checkpoints"
    ck.mkdir(parents=True)
    shutil.copytree(run_a_dir / "checkpoints" / "step6", ck / "step6")
    (ck / "latest").write_text("step6")
    return cfg, ck


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_run")
    model = make_chat_model(tmp)
    data = make_chats(tmp / "chats.jsonl", 200)
    return tmp, model, data


@pytest.fixture(scope="module")
def run_a(setup):
    tmp, model, data = setup
    (tmp / "a").mkdir()
    cfg = _experiment(tmp / "a", model, data)
    proc = _launch(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "a" / "run", proc


@pytest.mark.slow
def test_two_ranks_zero2_lower_the_loss_and_save_a_head(run_a, setup):
    run, proc = run_a
    losses = _losses(run)
    assert sorted(losses) == list(range(1, 13))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (10, 11, 12)) / 3
    assert last < 0.7 * first, losses
    rec = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])
    assert set(rec["agreement_by_fill"]) <= {"1", "2"} and rec["tokens_per_s"] > 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == ["step12", "step6"]
    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch

    head = SpeculationHead.load(run / "head", TargetArch(setup[1]))
    assert head.partition.num_stages == 2 and head.num_layers == 1
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 12 and summary["tokens_per_s"] > 0 and summary["world_size"] == 2
    # validation: every train.eval_every=4 steps on the held-out split, at every fill; the best head by predicted L'
    val = {r["step"]: r for r in _records(run) if "val_positions" in r}
    assert sorted(val) == [4, 8, 12]
    for r in val.values():
        assert set(r["val_agreement_by_fill"]) == {"1", "2"} and r["val_positions"] > 0
        a1, a2 = r["val_agreement_by_fill"]["1"], r["val_agreement_by_fill"]["2"]
        alpha = a1 / (1 + a1 - a2)  # n = 2 closed form
        assert r["val_pred_acceptance"] == pytest.approx(alpha)
        assert r["val_pred_accept_length"] == pytest.approx(2 / (1 + (1 - alpha)))
        o1, o2 = r["val_overlap_by_fill_sampled"]["1"], r["val_overlap_by_fill_sampled"]["2"]  # sampled drafts, T = 1
        assert 0 < o1 < 1 and 0 < o2 < 1 and r["val_sampling_temperature"] == 1.0
        assert (o1, o2) != (a1, a2)  # another table than the agreement
        assert r["val_pred_acceptance_sampled"] == pytest.approx(o1 / (1 + o1 - o2))
    best_step = max(sorted(val), key=lambda s: (val[s]["val_pred_accept_length"], -s))
    best = json.loads((run / "best_head" / "best.json").read_text())
    assert best["step"] == best_step == summary["best"]["step"]
    assert best["val_pred_accept_length"] == val[best_step]["val_pred_accept_length"]
    assert summary["last_validation"]["step"] == 12
    assert SpeculationHead.load(run / "best_head", TargetArch(setup[1])).partition.num_stages == 2
    assert "held-out examples" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_resume_continues_exactly(run_a, setup):
    tmp, model, data = setup
    run_a_dir, _ = run_a
    cfg, ck = _stopped_at_step6(run_a_dir, tmp / "b", model, data)
    fresh = _launch(cfg)  # a fresh start must not overwrite a run
    assert fresh.returncode == 2 and "--resume" in fresh.stderr
    # as after a crash at step 9: the log holds steps the checkpoint does not (they are logged again, once)
    lines = (run_a_dir / "train_log.jsonl").read_text().splitlines()
    (tmp / "b" / "run" / "train_log.jsonl").write_text("\n".join(lines[:9]) + "\n")
    # schedule settings changed on resume are ignored with a warning: the run keeps its checkpoint's (exactness below)
    proc = _launch(cfg, "--resume", "train.lr_stable_fraction=0.5", "train.lr=0.5", "train.warmup_steps=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "ignored on resume" in said and "train.lr=0.5 (the run keeps 0.003)" in said
    assert "train.warmup_steps=4 (the run keeps 2)" in said and "train.lr_stable_fraction=0.5 (the run keeps 0)" in said
    kept = yaml.safe_load((tmp / "b" / "run" / "config.yaml").read_text())["train"]  # what ran, not the overrides
    assert (kept["lr"], kept["warmup_steps"], kept["lr_stable_fraction"]) == (0.003, 2, 0.0), kept
    a, b = _losses(run_a_dir), _losses(tmp / "b" / "run")
    assert [r["step"] for r in _records(tmp / "b" / "run")] == list(range(1, 13))  # each step once
    assert [b[s] for s in range(1, 13)] == [a[s] for s in range(1, 13)]
    va, vb = _validation(run_a_dir), _validation(tmp / "b" / "run")
    assert sorted(vb) == [4, 8, 12] and all(vb[s] == va[s] for s in vb)  # validation figures too
    best_a = json.loads((run_a_dir / "train_summary.json").read_text())["best"]
    best_b = json.loads((tmp / "b" / "run" / "train_summary.json").read_text())["best"]
    assert {k: v for k, v in best_b.items() if k not in ("dir", "val_s")} == \
        {k: v for k, v in best_a.items() if k not in ("dir", "val_s")}
    sa = torch.load(run_a_dir / "checkpoints" / "step12" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    sb = torch.load(ck / "step12" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # the run's clock continues across the resume (train.max_time_s and the time-based decay count the whole run)
    t6 = torch.load(ck / "step6" / "mp_rank_00_model_states.pt", weights_only=False)["elapsed_s"]
    t12 = torch.load(ck / "step12" / "mp_rank_00_model_states.pt", weights_only=False)["elapsed_s"]
    summary = json.loads((tmp / "b" / "run" / "train_summary.json").read_text())
    assert 0 < t6 < t12 <= summary["elapsed_s"] and summary["steps"] == 12 and summary["resumed_at_step"] == 6
    # so do its tokens: the summary counts the whole run's (the checkpoint carries them), not the resumed part's
    whole = json.loads((run_a_dir / "train_summary.json").read_text())["tokens"]
    assert whole > 0 and summary["tokens"] == whole
    assert summary["tokens_per_s"] == pytest.approx(whole / summary["elapsed_s"])


@pytest.mark.slow
def test_resume_on_other_data_is_refused(run_a, setup):
    """A checkpoint records which data it was trained on; resuming it on other data stops in one line (exit 2)."""
    tmp, model, data = setup
    cfg, _ = _stopped_at_step6(run_a[0], tmp / "d", model, data)
    proc = _launch(cfg, "--resume", "data.max_conversations=120")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "was trained on other data" in proc.stderr and "data.train_files" in proc.stderr


@pytest.mark.slow
def test_resume_with_other_settings_is_refused(run_a, setup, tmp_path):
    """A checkpoint records the run's model, partition, head shape, world size and batch layout (run.json) and its
    schedule: a resume that changes them stops in one line (exit 2) before DeepSpeed loads anything, and so does an
    output folder that cannot be made."""
    tmp, model, data = setup
    cfg, _ = _stopped_at_step6(run_a[0], tmp / "e", model, data)
    proc = _launch(cfg, "--resume", "head.num_layers=2", "partition.stage_layers=[1,3]")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "was trained with other settings" in proc.stderr and "head.num_layers 1 (now 2)" in proc.stderr
    assert "partition" in proc.stderr and "Traceback" not in proc.stderr
    proc = _launch(cfg, "--resume", "train.max_steps=30")  # past the schedule's end: it would train at lr 0
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "schedule ends at step 12" in proc.stderr and "now ask for 30 steps" in proc.stderr
    # before the checkpoint's step: it trained nothing and wrote step 6's head as the final one, 'finished'
    proc = _launch(cfg, "--resume", "train.max_steps=4")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train.max_steps=4 is below the checkpoint's step 6, and a resume cannot go back" in proc.stderr
    run = cfg.parent / "run"
    assert not (run / "head").exists() and not (run / "train_summary.json").exists()
    (tmp_path / "afile").write_text("x")
    proc = _launch(cfg, f"train.output_dir={tmp_path / 'afile'}")
    assert proc.returncode == 2 and "train.output_dir" in proc.stderr and "cannot be created as a folder" in proc.stderr


@pytest.mark.slow
def test_resume_with_another_dtype_compute_or_validation_set_is_refused(run_a, setup):
    """model.dtype (the teacher's targets), train.autocast and the attention kernels (the numbers the run trains
    with) and train.eval_batches (the held-out figures the best head is picked on) are the run's: a resume that
    changes them stops in one line naming each (exit 2) before DeepSpeed loads anything; it used to go on.
    train.eval_batches is compared by the held-out micro-batches it resolves to: the tiny split has fewer than the
    run's 16, so null (all) evaluates the same ones and resumes (it used to be refused: "16 (now None)")."""
    tmp, model, data = setup
    cfg, _ = _stopped_at_step6(run_a[0], tmp / "k", model, data)
    proc = _launch(cfg, "--resume", "model.dtype=bfloat16", "train.autocast=bf16", "train.teacher_attention=flex",
                   "train.eval_batches=null")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "was trained with other settings" in line]
    assert said and all(part in said[0] for part in (
        "model.dtype float32 (now bfloat16)",
        "train.autocast (head compute dtype) off (now bfloat16)", "train.teacher_attention sdpa (now flex)",
        "Resume with the run's own settings")), said
    assert "train.eval_batches" not in said[0], said
    assert "resumed from" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    run_json = json.loads((run_a[0] / "checkpoints" / "step6" / "run.json").read_text())
    held_out = run_json["train.eval_batches"]["held_out"]
    assert run_json["train.eval_batches"] == {"setting": 16, "micro_batches": held_out, "held_out": held_out}
    assert 1 <= held_out < 16
    # every identity check passes (the schedule's, after loading, refuses the longer run: nothing is trained)
    proc = _launch(cfg, "--resume", "train.eval_batches=null", "train.max_steps=30")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "was trained with other settings" not in proc.stderr and "schedule ends at step 12" in proc.stderr


@pytest.mark.slow
def test_resume_of_a_missing_or_damaged_checkpoint_is_one_line(run_a, setup):
    """`latest` naming no checkpoint, or a checkpoint file cut short, is one line naming it and the checkpoint to
    resume instead (exit 2); DeepSpeed alone said `AssertionError` or a PytorchStreamReader error."""
    tmp, model, data = setup
    cfg, ck = _stopped_at_step6(run_a[0], tmp / "g", model, data)
    shutil.copytree(ck / "step6", ck / "step3")  # an earlier checkpoint to fall back on
    (ck / "latest").write_text("step9")
    proc = _launch(cfg, "--resume")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "names checkpoint 'step9', which cannot be resumed (no such folder)" in proc.stderr
    assert f"echo step6 > {ck / 'latest'}" in proc.stderr and "Traceback" not in proc.stderr
    (ck / "latest").write_text("step6")
    shard1 = next((ck / "step6").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))  # rank 1's ZeRO shard gone
    held = shard1.read_bytes()
    shard1.unlink()
    proc = _launch(cfg, "--resume")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("no optimizer state of rank 1 of 2") == 2, proc.stderr[-3000:]  # both ranks, one line
    assert "resumed from" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    shard1.write_bytes(held)
    optim = next((ck / "step6").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:1000])
    proc = _launch(cfg, "--resume")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"checkpoint {ck / 'step6'} is damaged" in proc.stderr and f"echo step3 > {ck / 'latest'}" in proc.stderr


@pytest.mark.slow
def test_session_time_limit_pauses_and_resume_finishes_exactly(run_a, setup):
    """train.session_time_s ends the invocation after its first step with a checkpoint (a cluster time limit), without
    ending the run; --resume then finishes it with run_a's losses step for step."""
    tmp, model, data = setup
    run_a_dir, _ = run_a
    (tmp / "s").mkdir()
    cfg = _experiment(tmp / "s", model, data, session_time_s=1e-6)
    proc = _launch(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp / "s" / "run"
    first = json.loads((run / "train_summary.json").read_text())
    assert first["steps"] == 1 and first["finished"] is False and first["total_steps"] == 12
    assert "continue with --resume" in proc.stdout + proc.stderr
    proc = _launch(cfg, "--resume", "train.session_time_s=null")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = json.loads((run / "train_summary.json").read_text())
    assert done["steps"] == 12 and done["finished"] is True and done["resumed_at_step"] == 1
    assert done["tokens"] == json.loads((run_a_dir / "train_summary.json").read_text())["tokens"]  # the run's
    a, s = _losses(run_a_dir), _losses(run)
    assert sorted(s) == list(range(1, 13)) and [s[k] for k in range(1, 13)] == [a[k] for k in range(1, 13)]


@pytest.mark.slow
def test_resume_of_a_finished_run_changes_nothing(run_a, setup):
    """--resume on a run that has taken its last step says so in one line and exits 0 before building anything,
    leaving every file as it was (it used to rewrite the heads and a summary with 0 tokens)."""
    tmp, model, data = setup
    (tmp / "f").mkdir()
    shutil.copytree(run_a[0], tmp / "f" / "run")
    cfg = _experiment(tmp / "f", model, data)
    run = tmp / "f" / "run"

    def files() -> dict:
        return {str(f.relative_to(run)): (f.read_bytes(), f.stat().st_mtime_ns) for f in run.rglob("*") if f.is_file()}

    before = files()
    proc = _launch(cfg, "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"run {run} already finished at step 12 of 12; nothing to do (its heads: {run / 'best_head'}, " \
        f"{run / 'head'})" in said and said.count("already finished") == 1  # rank 0 says it
    assert "spd_ds.train: target" not in said and "Traceback" not in said  # before the model is built
    assert files() == before


@pytest.mark.slow
def test_resume_restores_a_best_head_whose_replacement_was_cut_short(run_a, setup):
    """A crash while best_head/ was being replaced (renamed to best_head.old/, its successor half written in
    best_head.tmp/) used to leave the run without a best head; --resume puts the previous one back first, says so,
    and leaves no leftover."""
    tmp, model, data = setup
    (tmp / "r").mkdir()
    shutil.copytree(run_a[0], tmp / "r" / "run")
    run = tmp / "r" / "run"
    cfg = _experiment(tmp / "r", model, data)
    kept = {f.name: f.read_bytes() for f in (run / "best_head").iterdir()}
    (run / "best_head").rename(run / "best_head.old")
    (run / "best_head.tmp").mkdir()
    (run / "best_head.tmp" / "head.safetensors").write_bytes(b"cut short")
    proc = _launch(cfg, "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"restored {run / 'best_head'} from {run / 'best_head.old'}" in said and said.count("restored ") == 1
    assert f"(its heads: {run / 'best_head'}, {run / 'head'})" in said  # then the run is found finished, as it is
    assert {f.name: f.read_bytes() for f in (run / "best_head").iterdir()} == kept
    assert not (run / "best_head.old").exists() and not (run / "best_head.tmp").exists()


@pytest.mark.slow
def test_a_run_from_step_0_refuses_an_earlier_runs_results_and_replaces_a_stale_best_head(run_a, setup):
    """A fresh run (or --resume without a checkpoint) where an earlier run finished and its checkpoints were removed
    used to go on beside its train_summary.json and heads (a reader took them for the new run's, and with
    train.eval_every=0 its best_head/ stayed for good): it stops in one line, changing nothing, as a folder holding
    checkpoints does. A best_head/ alone (an attempt that crashed before its first checkpoint) is removed, saying so,
    unless head.checkpoint is in it."""
    tmp, model, data = setup
    (tmp / "o").mkdir()
    run = tmp / "o" / "run"
    shutil.copytree(run_a[0], run, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = _experiment(tmp / "o", model, data, max_steps=2, eval_every=0, save_every=100)

    def files() -> dict:
        return {str(f.relative_to(run)): f.read_bytes() for f in run.rglob("*") if f.is_file()}

    before = files()
    for extra in ((), ("--resume",)):
        proc = _launch(cfg, *extra)
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"{run} holds an earlier run's results (train_summary.json, head) and no checkpoint to resume; set " \
            "another train.output_dir" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert files() == before
    (run / "train_summary.json").unlink()
    shutil.rmtree(run / "head")  # what a crash before the first checkpoint leaves: a best head, a log, config.yaml
    proc = _launch(cfg, f"head.checkpoint={run / 'best_head'}")
    assert proc.returncode == 2 and f"head.checkpoint={run / 'best_head'} is in {run / 'best_head'}" in proc.stderr
    proc = _launch(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"removed {run / 'best_head'}: the best head of an earlier attempt" in proc.stdout + proc.stderr
    assert not (run / "best_head").exists() and (run / "head" / "head.safetensors").is_file()
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["best"] is None and sorted(_losses(run)) == [1, 2]


@pytest.mark.slow
def test_resume_with_other_draft_ids_of_the_same_size_is_refused(setup):
    """The checkpoint restores the head's draft ids while the teacher's targets come from head.draft_vocab: a resume
    with another vocabulary of the same size (it used to train on, silently wrong) stops in one line naming both,
    and leaves the run's config.yaml as it was."""
    tmp, model, data = setup
    (tmp / "v").mkdir()
    vocab = {}
    for name, ids in (("a", range(0, 96)), ("b", range(32, 128))):
        vocab[name] = tmp / "v" / f"{name}.json"
        vocab[name].write_text(json.dumps({"token_ids": list(ids), "draft_vocab_size": 96}))
    cfg = _experiment(tmp / "v", model, data, session_time_s=1e-6, eval_every=0)  # pauses after step 1
    proc = _launch(cfg, f"head.draft_vocab={vocab['a']}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = (tmp / "v" / "run" / "config.yaml").read_text()
    proc = _launch(cfg, "--resume", f"head.draft_vocab={vocab['b']}")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"was trained with other settings: head.draft_vocab {vocab['a']}, 96 ids blake2b:" in proc.stderr
    assert f"(now {vocab['b']}, 96 ids blake2b:" in proc.stderr and "Resume with the run's own settings" in proc.stderr
    assert "Traceback" not in proc.stderr and (tmp / "v" / "run" / "config.yaml").read_text() == config


@pytest.mark.slow
def test_warm_start_from_a_trained_head(run_a, setup):
    """head.checkpoint in training starts a new run from a trained head's weights (fresh optimizer and schedule): the
    way a head keeps training on a fresh machine. With lr 0 the saved head equals the loaded one bit for bit, and the
    first step's loss is the trained head's, far below a fresh head's. The steps behind the start head are recorded
    (``init_steps``) when the run begins and kept by its checkpoints, whatever happens to that head's files later."""
    tmp, model, data = setup
    run_a_dir, _ = run_a
    start = tmp / "w" / "start"  # run a's final head with its run summary, as a run directory holds them
    shutil.copytree(run_a_dir / "head", start / "head")
    shutil.copy(run_a_dir / "train_summary.json", start / "train_summary.json")
    cfg = _experiment(tmp / "w", model, data, max_steps=2, lr=0.0, eval_every=0, save_every=100,
                      session_time_s=1e-6)  # the first invocation pauses after step 1
    proc = _launch(cfg, f"head.checkpoint={start / 'head'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "starting from head.checkpoint" in out and "(12 earlier steps)" in out
    summary = json.loads((start / "train_summary.json").read_text())
    (start / "train_summary.json").write_text(json.dumps(dict(summary, steps=99)))  # changed after the run began
    proc = _launch(cfg, "--resume", f"head.checkpoint={start / 'head'}", "train.session_time_s=null")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from safetensors.torch import load_file

    a = load_file(run_a_dir / "head" / "head.safetensors")
    w = load_file(tmp / "w" / "run" / "head" / "head.safetensors")
    assert sorted(a) == sorted(w) and all(torch.equal(a[k], w[k]) for k in a)
    fresh, warm = _losses(run_a_dir), _losses(tmp / "w" / "run")
    assert sorted(warm) == [1, 2] and warm[1] < 0.8 * fresh[1], (warm, fresh)
    summary = json.loads((tmp / "w" / "run" / "train_summary.json").read_text())
    assert summary["init_from"] == str(start / "head") and summary["init_steps"] == 12  # run a's 12, from the start
    assert summary["steps"] == 2 and summary["resumed_at_step"] == 1


@pytest.mark.slow
def test_teacher_pipeline_degree_n(setup):
    tmp, model, data = setup
    (tmp / "c").mkdir()
    cfg = _experiment(tmp / "c", model, data, teacher_pipe_degree=2, max_steps=8, save_every=100,
                      compile_cache=str(tmp / "c" / "cc.bin"),  # no inductor kernels on CPU: loads, saves nothing
                      compile_teacher="aot_eager", compile_loss="aot_eager",  # each rank: its own stage's layers
                      # FlexAttention inside the compiled layers (train.teacher_attention=flex)
                      teacher_attention="flex")
    proc = _launch(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pipe=1, data=0" in proc.stdout + proc.stderr  # a real two-stage pipeline
    assert re.search(r"compiled: [1-9]\d* teacher decoder layers on this rank \(aot_eager\), loss \(aot_eager\)",
                     proc.stdout + proc.stderr)
    assert "teacher attention: flex" in proc.stdout + proc.stderr
    losses = _losses(tmp / "c" / "run")
    assert losses[8] < losses[1]


@pytest.mark.slow
def test_qwen3_5_teacher_lowers_the_loss(tmp_path):
    """launch/train.py with a hybrid Qwen3.5 teacher (linear-attention layers per packed document), as a two-stage
    teacher pipeline on two ranks: a few KD steps lower the loss and the head loads for that target."""
    model = make_chat_model(tmp_path, num_layers=8, model_type="qwen3_5_text")
    data = make_chats(tmp_path / "chats.jsonl", 200)
    cfg = _experiment(tmp_path, model, data, teacher_pipe_degree=2, max_steps=10, save_every=100)
    proc = _launch(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, 11))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (8, 9, 10)) / 3
    assert last < 0.8 * first, losses
    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch

    head = SpeculationHead.load(tmp_path / "run" / "head", TargetArch(model))
    assert type(head.layers[0]).__name__ == "Qwen3_5DecoderLayer" and head.partition.num_layers == 8


def test_bad_config_fails_fast_with_one_line(tmp_path):
    from spd_ds.commands import train as train_launcher

    assert train_launcher.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert train_launcher.main(["train.no_such_key=1"]) == 2


def test_a_warm_start_that_is_no_head_is_one_line(tmp_path):
    """head.checkpoint naming a training run's output_dir (not its head folder) is the user's to fix: one line that
    names the head folders meant, exit status 2 (it was a traceback)."""
    model = make_chat_model(tmp_path, 4)
    run = tmp_path / "earlier"
    (run / "best_head").mkdir(parents=True)
    (run / "best_head" / "head_config.json").write_text("{}")
    config = _experiment(tmp_path, model, make_chats(tmp_path / "chats.jsonl", 20))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               MASTER_PORT=str(free_port()))
    for head, said in ((run, f"did you mean {run / 'best_head'}?"),
                       (run / "best_head", "has no 'format_version'; was it written by launch/train.py?")):
        proc = subprocess.run([sys.executable, "launch/train.py", "--config", str(config), "--deepspeed_config",
                               "ds_configs/zero2.json", f"head.checkpoint={head}"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_rows_longer_than_the_targets_context_are_refused(tmp_path):
    """A document may fill a row: rows longer than the target's context (here a Mistral sliding window of 16, which
    caps it) are refused in one line before training (the teacher's full attention would differ from the window's)."""
    from tests.test_train_data import make_tokenizer
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path, "mistral", 4, sliding_window=16, vocab_size=128, eos_token_id=2, bos_token_id=1)
    make_tokenizer().save_pretrained(model)
    config = _experiment(tmp_path, model, make_chats(tmp_path / "chats.jsonl", 20))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "launch/train.py", "--config", str(config), "--deepspeed_config",
                           "ds_configs/zero2.json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("error: data.max_seq_length=128 exceeds the target's context of 16 positions (its sliding window); set "
            "data.max_seq_length <= 16") in proc.stderr, proc.stderr[-3000:]


FLEX_FAILS = """
import sys

import torch

from spd_ds.train import student

real = student.resolve_attention


def broken(*args, **kwargs):
    raise RuntimeError("no FlexAttention here")


student.resolve_attention = lambda mode, device, *ran: real(mode, torch.device("cuda"), *ran)  # auto as on CUDA
student.structural_block_mask = broken  # FlexAttention fails at its first forward
from spd_ds.commands.train import main

sys.exit(main(sys.argv[1:]))
"""


SUMMARY_CUT = """
import pathlib
import sys

real = pathlib.Path.write_text


def cut(self, text, *args, **kwargs):  # an interrupt (Ctrl-C, a job's time limit) halfway through the summary
    if "train_summary.json" in self.name:
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt
    return real(self, text, *args, **kwargs)


pathlib.Path.write_text = cut
from spd_ds.commands.train import main

sys.exit(main(sys.argv[1:]))
"""


def test_a_training_summary_cut_short_is_not_left_half_written(tmp_path):
    """train_summary.json was written in place: a run interrupted while writing it left half a summary (what
    train_report.py and a resume's check read) beside a finished head. It is written beside and renamed: the cut
    leaves none, and no temporary file. One process, the interrupt forced in the write."""
    config = _experiment(tmp_path, make_chat_model(tmp_path), make_chats(tmp_path / "chats.jsonl", 20), max_steps=2,
                         eval_every=0, save_every=100)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", SUMMARY_CUT, "--config", str(config), "--deepspeed_config",
                           "ds_configs/zero2.json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    run = tmp_path / "run"
    assert proc.returncode != 0 and (run / "head" / "head.safetensors").is_file(), proc.stderr[-3000:]
    assert not (run / "train_summary.json").exists(), (run / "train_summary.json").read_text()
    assert not [f.name for f in run.iterdir() if ".tmp" in f.name]


@pytest.mark.slow
def test_auto_attention_that_falls_back_records_dense(setup):
    """train.attention=auto resolves to flex on CUDA; when FlexAttention fails at the first forward the head trains
    with the dense mask. run.json (and so the resume's comparison), the log and train_summary.json record dense:
    run.json used to say flex. One process, FlexAttention's failure forced at the function level on CPU."""
    tmp, model, data = setup
    (tmp / "fb").mkdir()
    cfg = _experiment(tmp / "fb", model, data, max_steps=6, eval_every=3)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)

    def run(*extra):
        return subprocess.run([sys.executable, "-c", FLEX_FAILS, "--config", str(cfg), *extra], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)

    proc = run("train.session_time_s=0.001")  # paused after its first step, with a checkpoint
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp / "fb" / "run"
    assert json.loads((out / "checkpoints" / "step1" / "run.json").read_text())["train.attention"] == "dense"
    assert json.loads((out / "train_summary.json").read_text())["attention"] == "dense"
    assert "flex attention (auto: dense if it fails)" in proc.stderr
    assert "FlexAttention failed; training with dense attention" in proc.stderr
    # resumed with auto where flex would run: the run's dense is kept, not refused (the schedule's check, after the
    # checkpoint is loaded, then refuses the longer run: nothing is trained)
    proc = run("--resume", "train.max_steps=30")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dense attention (auto: the resumed run's)" in proc.stderr, proc.stderr[-3000:]
    assert "was trained with other settings" not in proc.stderr and "schedule ends at step 6" in proc.stderr



# (overrides or options, the error line's text; TMP is the test's folder) for the test below
EARLY_REFUSALS = [
    (["train.autocast=fp16"], "error: train.autocast must be auto, bf16 or off, got 'fp16'"),
    (["train.attention=flash"], "error: train.attention must be one of ('auto', 'flex', 'dense'), got 'flash'"),
    (["train.attention=flex"], "error: train.attention=flex needs CUDA (FlexAttention has no CPU backward)"),
    (["train.teacher_pipe_degree=3"], "error: train.teacher_pipe_degree=3 must be 1 or n=2 and divide the world "
                                      "size 1"),
    (["train.teacher_pipe_degree=2", "data.micro_batch_size=3", "WORLD_SIZE=2"],
     "error (rank 0 of 2): data.micro_batch_size=3 must be a multiple of train.teacher_pipe_degree=2"),
    (["data.chat_template=/no/such/template.jinja"], "error: data.chat_template: chat template "
                                                     "'/no/such/template.jinja' is neither a file nor Jinja text"),
    (["data.chat_template=TMP/bad.jsonl"], "error: data.chat_template: chat template file TMP/bad.jsonl holds no "
                                           "Jinja"),  # a data file given as the template
    (["data.train_files=[TMP/bad.jsonl]"], "error: TMP/bad.jsonl: not JSON lines nor a JSON array"),
    (["data.train_files=[TMP/none.jsonl]"], "error: data source 'TMP/none.jsonl' holds no usable conversation"),
    (["--deepspeed_config", "TMP/zero.json"], "error: the DeepSpeed config TMP/zero.json is refused by DeepSpeed "
                                              "(DeepSpeedZeroConfig.reduce_bucket_size: Input should be a valid "
                                              "integer"),
    (["--deepspeed_config", "TMP/apex.json"], "Apex AMP integration has been removed"),
    # what the target's config.json refuses (its geometry: no weight is read)
    (["data.max_seq_length=1000"], "error: data.max_seq_length=1000 exceeds the target's context of 512 positions; "
                                   "set data.max_seq_length <= 512"),
    (["head.tower_init_layer=9"], "error: head.tower_init_layer=9 is outside [-4, 4) for this 4-layer target"),
    (["partition.num_stages=9"], "error: partition.num_stages=9 exceeds the model's 4 decoder layers; use at most 4"),
    (["partition.stage_layers=[2,3]"], "error: partition.stage_layers=[2, 3] sums to 5, but the model has 4 decoder "
                                       "layers"),
    (["partition.anchors=[0,2,9]"], "error: partition.anchors must be <= num_layers=4, got [0, 2, 9]"),
    (["head.draft_vocab=TMP/vocab500.json"], "error: head.draft_vocab=TMP/vocab500.json holds ids in [0, 500], "
                                             "outside the target's vocabulary of 128 ids"),
    (["model.name=TMP/no_model"], "error: 'TMP/no_model' is neither a local model directory"),
    # a compile cache the run could not write at its end (its kernels were lost after training, "0 bytes saved")
    (["train.compile_cache=TMP"], "error: train.compile_cache TMP names a folder; give a file path inside it"),
    (["train.compile_cache=TMP/new/"], "error: train.compile_cache TMP/new/ names a folder; give a file path inside "
                                       "it"),
    (["train.compile_cache=TMP/bad.jsonl/cc.bin"], "error: train.compile_cache's folder TMP/bad.jsonl cannot be "
                                                   "created as a folder (a file stands at it or above it)"),
    (["train.compile_cache=TMP/caches/cc.bin"], None),  # its folder is made at the start (removed when refused)
    (["--resume"], None),  # no checkpoint in train.output_dir: starts fresh, and says so first
    (["train.teacher_pipe_degree=1", "data.micro_batch_size=3"], None),  # good settings of the same kinds
]


@pytest.mark.parametrize("extra,said", EARLY_REFUSALS, ids=[" ".join(c[0]) for c in EARLY_REFUSALS])
def test_bad_training_settings_fail_before_the_process_group(tmp_path, tiny_root, monkeypatch, capsys, extra, said):
    """Settings that training refused only once the process group was up and the target resolved and loaded (the
    train: values, a data file that does not parse or holds no conversation, a DeepSpeed config value DeepSpeed
    refuses at the head engine's initialize, a chat template that is no file; the partition, data.max_seq_length,
    head.tower_init_layer and head.draft_vocab's ids against the target's config.json, and a model that does not
    resolve) are one line, exit status 2, before the process group starts (here it cannot: starting it is an
    error). Only the tiny target's config.json and safetensors headers are read to get there. A
    ``--resume`` where train.output_dir holds no checkpoint starts fresh (a job script may pass it every time): the
    line that says so comes before anything loads, so that a mistyped output_dir can be stopped at once."""
    import spd_ds.dist
    from spd_ds.commands import train as train_launcher

    def no_group(*args, **kwargs):
        raise RuntimeError("the process group started")

    monkeypatch.setattr(spd_ds.dist, "init_process_group", no_group)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    config = _experiment(tmp_path, make_chat_model(tiny_root), make_chats(tmp_path / "chats.jsonl", 20))
    (tmp_path / "vocab500.json").write_text(json.dumps({"token_ids": [0, 5, 500]}))
    (tmp_path / "bad.jsonl").write_text('{"messages": [}\n')
    (tmp_path / "none.jsonl").write_text('{"foo": 1}\n')
    (tmp_path / "zero.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}}))
    (tmp_path / "apex.json").write_text(json.dumps({"amp": {"enabled": True}}))
    args = [a.replace("TMP", str(tmp_path)) for a in extra]
    for a in [a for a in args if a.startswith("WORLD_SIZE=")]:  # the launcher's (RANK unset reads as 0)
        monkeypatch.setenv("WORLD_SIZE", a.split("=")[1])
        args.remove(a)
    if said is None:  # gets as far as the process group
        with pytest.raises(RuntimeError, match="the process group started"):
            train_launcher.main(["--config", str(config), *args])
        assert not (tmp_path / "caches").exists()  # made for train.compile_cache, removed as the run stopped empty
        if "--resume" in args:
            assert (f"train.resume: no checkpoint under {tmp_path / 'run' / 'checkpoints'}; starting fresh"
                    in capsys.readouterr().err)
        return
    assert train_launcher.main(["--config", str(config), *args]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and said.replace("TMP", str(tmp_path)) in errors[0] and "Traceback" not in err, err
