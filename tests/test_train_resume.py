"""spd_ds.train.resume without a launch: the draft-vocabulary digest a resume compares, and the test that finds a run
with nothing left to do (the end-to-end runs are in tests/test_train_run.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spd_ds.config import ConfigError
from spd_ds.train.resume import (DRAFT_VOCAB, RUN_FILE, check_resume, checkpoint_progress, draft_vocab_digest,
                                 finished_message, finished_run)


def _checkpoint(run: Path, step: int, total: int, elapsed_s: float, identity: dict | None = None) -> Path:
    """A run directory whose newest checkpoint ``step<step>`` holds DeepSpeed's file names, the loop's client state
    and a schedule ending at ``total``; returns its ``checkpoints`` folder."""
    ck = run / "checkpoints"
    where = ck / f"step{step}"
    where.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(3)}, "step": step, "elapsed_s": elapsed_s,
                "lr_scheduler": {"lr_lambdas": [{"warmup": 2, "total": total, "stable": 0.0, "time_fraction": 0.0}]}},
               where / "mp_rank_00_model_states.pt")
    (where / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    if identity is not None:
        (where / RUN_FILE).write_text(json.dumps(identity))
    (ck / "latest").write_text(f"step{step}")
    return ck


def _identity(ids, source: str, **more) -> dict:
    ids = torch.as_tensor(ids)
    return {"head.num_layers": 1, "head (draft vocabulary size)": int(ids.numel()),
            DRAFT_VOCAB: {"blake2b": draft_vocab_digest(ids), "size": int(ids.numel()), "from": source}, **more}


def test_the_draft_vocabulary_digest_is_of_the_ids():
    a, b = torch.arange(0, 96), torch.arange(32, 128)
    assert draft_vocab_digest(a) == draft_vocab_digest(a.clone()) == draft_vocab_digest(a.flip(0))
    assert draft_vocab_digest(a) != draft_vocab_digest(b)  # same size, other ids
    assert draft_vocab_digest(torch.arange(128)) == draft_vocab_digest(torch.arange(128, dtype=torch.int32))
    assert draft_vocab_digest(a).startswith("blake2b:") and len(draft_vocab_digest(a)) == len("blake2b:") + 32


def test_a_resume_with_other_draft_ids_of_the_same_size_is_refused(tmp_path):
    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0, _identity(range(0, 96), "/v/a.json"))
    with pytest.raises(ConfigError) as e:
        check_resume(ck, _identity(range(32, 128), "/v/b.json"))
    msg = str(e.value)
    assert "\n" not in msg and "was trained with other settings: head.draft_vocab /v/a.json, 96 ids blake2b:" in msg
    assert "(now /v/b.json, 96 ids blake2b:" in msg and "draft vocabulary size" not in msg
    assert "Resume with the run's own settings" in msg and "head.checkpoint=" in msg
    check_resume(ck, _identity(range(0, 96), "/elsewhere/a_copy.json"))  # the same ids from another file: resumes


def test_a_run_file_from_before_the_digest_compares_the_size_only(tmp_path):
    old = _identity(range(0, 96), "/v/a.json")
    del old[DRAFT_VOCAB]
    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0, old)
    check_resume(ck, _identity(range(32, 128), "/v/b.json"))  # as before: cannot tell
    with pytest.raises(ConfigError, match=r"head \(draft vocabulary size\) 96 \(now 64\)"):
        check_resume(ck, _identity(range(64), "/v/c.json"))


def test_a_checkpoint_missing_one_ranks_optimizer_shard_is_refused_on_every_rank(tmp_path):
    # world 2: rank 1's ZeRO shard is gone. Every rank reads the same folder, so all name it before DeepSpeed loads
    # (rank 0 used to report a resume while rank 1 failed inside DeepSpeed)
    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0, _identity(range(96), "/v/a.json", **{"world size": 2}))
    _checkpoint(tmp_path / "run", 5, 12, 1.0)
    (ck / "latest").write_text("step6")
    with pytest.raises(ConfigError) as e:
        check_resume(ck, _identity(range(96), "/v/a.json", **{"world size": 2}))
    msg = str(e.value)
    assert "\n" not in msg and "names checkpoint 'step6', which cannot be resumed" in msg
    assert "no optimizer state of rank 1 of 2" in msg and "echo step5 >" in msg
    (ck / "step6" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x")  # the bf16 optimizer's name
    check_resume(ck, _identity(range(96), "/v/a.json", **{"world size": 2}))


def _summary(run: Path, **kw) -> None:
    (run / "train_summary.json").write_text(json.dumps({"steps": 12, "total_steps": 12, "finished": True, **kw}))


def test_a_finished_run_is_found_from_its_checkpoint_and_summary(tmp_path):
    run = tmp_path / "run"
    ck = _checkpoint(run, 12, 12, 30.0)
    assert checkpoint_progress(ck) == (12, 12, 30.0)
    assert finished_run(run, ck, None) is None  # no summary: a crash before the final files; the resume writes them
    _summary(run)
    (run / "head").mkdir()
    (run / "best_head").mkdir()
    msg = finished_run(run, ck, None)
    assert msg == (f"run {run} already finished at step 12 of 12; nothing to do (its heads: {run / 'best_head'}, "
                   f"{run / 'head'}). To train further, start a new train.output_dir with "
                   "head.checkpoint=<its head or best_head>")
    _summary(run, steps=6)  # written before the newest checkpoint: its files are not from it
    assert finished_run(run, ck, None) is None
    _summary(run, finished=False)
    assert finished_run(run, ck, None) is None


def test_a_run_whose_time_is_spent_is_finished_unless_the_budget_is_raised(tmp_path):
    run = tmp_path / "run"
    ck = _checkpoint(run, 5, 12, 61.0)
    _summary(run, steps=5)
    assert finished_run(run, ck, None) is None  # no time limit now: steps 6..12 remain
    assert finished_run(run, ck, 120.0) is None  # raised: the run goes on
    msg = finished_run(run, ck, 60.0)
    assert "already finished at step 5, its train.max_time_s=60 spent (61 s trained; raise it" in msg
    assert finished_message(run, 5, 5, 61.0, None).startswith(f"run {run} already finished at step 5 of 5")
    # the summary records the budget the run stopped by: rank 0's saved time may lie just under it (another rank's
    # clock, which started earlier, stopped the run); the same budget is spent, a larger one goes on
    ck = _checkpoint(tmp_path / "run2", 5, 12, 59.8)
    run = tmp_path / "run2"
    _summary(run, steps=5, max_time_s=60.0)
    assert finished_run(run, ck, 60.0) is not None and finished_run(run, ck, 50.0) is not None
    assert finished_run(run, ck, 60.5) is None and finished_run(run, ck, None) is None
    _summary(run, steps=5, max_time_s=None)  # it ran without one and was stopped by none: not finished by time
    assert finished_run(run, ck, 60.0) is None


def test_an_unreadable_checkpoint_is_left_to_the_resume(tmp_path):
    run = tmp_path / "run"
    ck = _checkpoint(run, 12, 12, 1.0)
    _summary(run)
    (ck / "step12" / "mp_rank_00_model_states.pt").write_bytes(b"cut short")
    assert checkpoint_progress(ck) is None and finished_run(run, ck, None) is None
    (ck / "latest").write_text("step99")
    assert checkpoint_progress(ck) is None


def test_a_resume_with_another_seed_or_objective_is_refused(tmp_path):
    """The seed shuffles the epoch plan and draws the fills, and the objective is the loss: a resume with others
    used to go on silently, training the rest of the run on another data order or loss than the run's."""
    from types import SimpleNamespace

    from spd_ds.config import load_config
    from spd_ds.train.resume import run_identity

    arch = SimpleNamespace(fingerprint=lambda: "sha:target")
    part = SimpleNamespace(to_dict=lambda: {"stage_layers": [2, 2]})
    ids = torch.arange(96)
    head = SimpleNamespace(num_layers=1, draft_vocab_size=96, draft_ids=ids, lm_head_from_target=False)

    def identity(*overrides: str) -> dict:
        return run_identity(load_config(None, list(overrides)), arch, part, head, 1, 1, 1)

    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0, identity())
    check_resume(ck, identity())
    check_resume(ck, identity("train.lr=0.5", "train.eval_every=7"))  # the schedule's are warned of after loading
    for override, said in (("train.seed=7", "train.seed 42 (now 7)"),
                           ("train.kd_temperature=2.0", "train.kd_temperature 1.0 (now 2.0)"),
                           ("train.full_pipeline_prob=1.0", "train.full_pipeline_prob 0.5 (now 1.0)"),
                           ("train.outside_vocab=drop", "train.outside_vocab weight (now drop)")):
        with pytest.raises(ConfigError) as e:
            check_resume(ck, identity(override))
        assert f"was trained with other settings: {said}. Resume with the run's own settings" in str(e.value)
        assert "\n" not in str(e.value)


def test_a_resume_with_another_zero_stage_or_bf16_switch_is_refused(tmp_path):
    """The DeepSpeed config's ZeRO stage and bf16 switch decide the optimizer checkpoint's layout: a resume with
    another bf16 switch was reported as a damaged checkpoint (a missing bf16_ optimizer file; the advice, to resume
    the checkpoint before, failed the same way), ZeRO-2 to 0 as an AttributeError traceback."""
    from types import SimpleNamespace

    from spd_ds.config import load_config
    from spd_ds.train.ds_config import load_ds_config
    from spd_ds.train.resume import run_identity

    arch = SimpleNamespace(fingerprint=lambda: "sha:target")
    part = SimpleNamespace(to_dict=lambda: {"stage_layers": [2, 2]})
    head = SimpleNamespace(num_layers=1, draft_vocab_size=96, draft_ids=torch.arange(96), lm_head_from_target=False)

    def identity(ds: dict) -> dict:
        return run_identity(load_config(None, []), arch, part, head, 1, 1, 1, load_ds_config(ds, 2))

    zero2 = {"zero_optimization": {"stage": 2}}
    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0, identity(zero2))
    check_resume(ck, identity({**zero2, "gradient_clipping": 0.5}))
    for ds, said in (({**zero2, "bf16": {"enabled": True}}, "--deepspeed_config bf16.enabled False (now True)"),
                     ({}, "--deepspeed_config zero_optimization.stage 2 (now 0)")):
        with pytest.raises(ConfigError) as e:
            check_resume(ck, identity(ds))
        assert f"was trained with other settings: {said}. Resume with the run's own settings" in str(e.value)


def test_a_resume_with_another_dtype_compute_or_validation_set_is_refused(tmp_path):
    """The teacher's dtype makes the targets, autocast and the attention kernels the head's and the teacher's
    numbers, and train.eval_batches the held-out micro-batches whose figures pick the best head (the checkpoint's
    best was picked on its run's): a resume with others used to go on silently."""
    from types import SimpleNamespace

    from spd_ds.config import load_config
    from spd_ds.train.resume import AUTOCAST, run_identity

    arch = SimpleNamespace(fingerprint=lambda: "sha:target")
    part = SimpleNamespace(to_dict=lambda: {"stage_layers": [2, 2]})
    head = SimpleNamespace(num_layers=1, draft_vocab_size=96, draft_ids=torch.arange(96), lm_head_from_target=False)

    def identity(*overrides: str, autocast=None, attention="dense", teacher="sdpa") -> dict:
        compute = {"autocast": autocast, "attention": attention, "teacher_attention": teacher}
        return run_identity(load_config(None, list(overrides)), arch, part, head, 1, 1, 1, None, compute, held_out=20)

    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0, identity())
    check_resume(ck, identity("model.dtype=fp32", "train.eval_every=7"))  # the same dtype by its other name
    for new, said in ((identity("model.dtype=bfloat16"), "model.dtype float32 (now bfloat16)"),
                      (identity(autocast=torch.bfloat16), f"{AUTOCAST} off (now bfloat16)"),
                      (identity(attention="flex"), "train.attention dense (now flex)"),
                      (identity(teacher="flex"), "train.teacher_attention sdpa (now flex)"),
                      (identity("train.eval_batches=4"),
                       "train.eval_batches 16 held-out micro-batches, set to 16 (now 4, set to 4)"),
                      (identity("train.eval_batches=null"),  # all 20 of the split
                       "train.eval_batches 16 held-out micro-batches, set to 16 (now 20, set to null)")):
        with pytest.raises(ConfigError) as e:
            check_resume(ck, new)
        assert f"was trained with other settings: {said}. Resume with the run's own settings" in str(e.value)
        assert "\n" not in str(e.value)
    old = identity()  # a run.json written before these keys: not compared
    for key in ("model.dtype", "train.eval_batches", AUTOCAST, "train.attention", "train.teacher_attention"):
        del old[key]
    ck = _checkpoint(tmp_path / "older", 6, 12, 1.0, old)
    check_resume(ck, identity("model.dtype=bfloat16", "train.eval_batches=4", autocast=torch.bfloat16))


def test_a_resume_compares_the_held_out_micro_batches_evaluated_not_the_setting(tmp_path):
    """train.eval_batches caps the held-out micro-batches a validation runs (the first ones of the split's fixed list):
    null (all) and 16 on a split of 16 micro-batches or fewer evaluate on the same ones, and a resume used to be
    refused between them ("train.eval_batches None (now 16)") though the best head was picked on that same set. A
    run.json written before the resolved number was recorded holds the raw setting: it is resolved on this
    invocation's split (the run's, when the resume goes on: its data is compared once the checkpoint is loaded)."""
    from spd_ds.train.resume import EVAL_BATCHES, eval_batches_identity

    def new(setting, held_out) -> dict:
        return _identity(range(96), "/v/a.json", **{EVAL_BATCHES: eval_batches_identity(setting, held_out)})

    assert eval_batches_identity(None, 12) == {"setting": None, "micro_batches": 12, "held_out": 12}
    assert eval_batches_identity(16, 12)["micro_batches"] == 12 and eval_batches_identity(4, 12)["micro_batches"] == 4
    assert eval_batches_identity(16, 0)["micro_batches"] == 0  # no validation (train.eval_every=0)
    assert eval_batches_identity(16, None) == {"setting": 16}  # the split not known yet
    for saved in (None, 16, {"setting": None, "micro_batches": 12, "held_out": 12}):  # old raw values, and resolved
        ck = _checkpoint(tmp_path / f"run_{saved is None}_{isinstance(saved, dict)}", 6, 12, 1.0,
                         _identity(range(96), "/v/a.json", **{EVAL_BATCHES: saved}))
        for setting in (None, 12, 16, 99):  # all resolve to the split's 12 micro-batches
            check_resume(ck, new(setting, 12))
        check_resume(ck, new(4, None))  # not compared before the split is known (the loop checks again after)
        with pytest.raises(ConfigError) as e:
            check_resume(ck, new(4, 12))
        msg = str(e.value)
        was = "null" if saved is None or isinstance(saved, dict) else "16"
        assert f"other settings: train.eval_batches 12 held-out micro-batches, set to {was} (now 4, set to 4). " \
               "Resume with the run's own settings" in msg and "\n" not in msg
    ck = _checkpoint(tmp_path / "raw_null_on_a_larger_split", 6, 12, 1.0,
                     _identity(range(96), "/v/a.json", **{EVAL_BATCHES: None}))
    with pytest.raises(ConfigError, match=r"train.eval_batches 20 held-out micro-batches, set to null \(now 16, set "
                                          r"to 16\)"):
        check_resume(ck, new(16, 20))  # the split has 20: null evaluated all 20, 16 would evaluate 16
    ck = _checkpoint(tmp_path / "same_setting", 6, 12, 1.0,
                     _identity(range(96), "/v/a.json", **{EVAL_BATCHES: eval_batches_identity(None, 12)}))
    check_resume(ck, new(None, 14))  # another split: other data, refused by the data check after the load
    check_resume(ck, new(4, 14))  # (in its own words: "was trained on other data"), not here


def test_a_run_from_step_0_refuses_an_earlier_runs_results(tmp_path):
    """train_summary.json or head/ without a checkpoint: an earlier run's results (refused, as checkpoints are without
    --resume); best_head/ alone (and an unfinished replacement's .old/.tmp): an earlier attempt's, to be replaced."""
    from spd_ds.train.resume import check_fresh_output, stale_best_heads

    run = tmp_path / "run"
    check_fresh_output(run, None)  # no folder yet
    assert stale_best_heads(run) == []
    for name in ("best_head", "best_head.old", "best_head.tmp"):
        (run / name).mkdir(parents=True)
    check_fresh_output(run, str(tmp_path / "elsewhere"))
    assert stale_best_heads(run) == [run / "best_head", run / "best_head.old", run / "best_head.tmp"]
    for start in (run / "best_head", run / "best_head.old" / "x"):
        with pytest.raises(ConfigError, match=r"is in .*best_head.*, the best head of an earlier attempt"):
            check_fresh_output(run, str(start))
    (run / "head").mkdir()
    _summary(run)
    with pytest.raises(ConfigError) as e:
        check_fresh_output(run, None)
    assert str(e.value) == (f"{run} holds an earlier run's results (train_summary.json, head) and no checkpoint to "
                            "resume; set another train.output_dir (head.checkpoint=<its head or best_head> "
                            "warm-starts from it), or remove them to train there anew")


def test_checkpoints_without_latest_are_not_pruned_by_a_run_from_step_0(tmp_path):
    """Whole checkpoints whose `latest` is gone (removed by hand, or lost): the run started from step 0 ('--resume:
    no checkpoint; starting fresh') and pruned them as it saved its own, and removed best_head/. Now refused in one
    line with the echo that resumes the newest whole one. A folder a kill cut short in the first save (no model
    file, or a rank's optimizer shard missing) is no checkpoint: the run starts from step 0 as before."""
    from spd_ds.train.resume import RUN_FILE, check_fresh_output, whole_checkpoints

    run = tmp_path / "run"
    ck = run / "checkpoints"

    def save(step, ranks, model=True, world=2):
        d = ck / f"step{step}"
        d.mkdir(parents=True)
        (d / RUN_FILE).write_text(json.dumps({"world size": world}))
        if model:
            (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
        for r in ranks:
            (d / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"x")

    save(4, [0], model=False)  # cut short before the model file
    save(8, [0])  # one of two ranks' optimizer shards
    (ck / "step.bak").mkdir()
    assert whole_checkpoints(ck) == []
    check_fresh_output(run, None)  # a kill in the first save: the run starts from step 0
    save(2, [0, 1])
    save(12, [0, 1])
    assert whole_checkpoints(ck) == ["step12", "step2"]
    with pytest.raises(ConfigError) as e:
        check_fresh_output(run, None)
    assert str(e.value) == (f"{ck} holds checkpoints (step12, step2) but no `latest` naming one; to continue the "
                            f"newest, `echo step12 > {ck / 'latest'}` and resume (--resume); to train anew, remove "
                            "them or set another train.output_dir")


def test_a_resume_on_other_data_of_the_same_size_is_refused():
    """A checkpoint recorded its data by counts alone (examples, tokens, held-out records): another data set of the
    same size (one token id changed, or an answer's assistant mask) resumed without a word. The digest of the
    examples tells them apart; a checkpoint written before it still compares the counts."""
    from spd_ds.train.data import TokenizedData
    from spd_ds.train.resume import check_resumed_data, data_identity

    run = TokenizedData([[1, 2, 3, 4], [5, 6]], [[0, 0, 1, 1], [0, 1]])
    other_ids = TokenizedData([[1, 2, 3, 9], [5, 6]], [[0, 0, 1, 1], [0, 1]])
    other_mask = TokenizedData([[1, 2, 3, 4], [5, 6]], [[0, 1, 1, 1], [0, 1]])
    regrouped = TokenizedData([[1, 2, 3], [4, 5, 6]], [[0, 0, 1], [1, 0, 1]])  # the same tokens, split elsewhere
    saved = data_identity(run, 1)
    assert saved["examples"] == 2 and saved["tokens"] == 6 and saved["held_out"] == 1
    check_resumed_data(Path("ck"), saved, data_identity(run, 1))  # the run's own data
    check_resumed_data(Path("ck"), None, data_identity(other_ids, 1))  # nothing recorded: nothing to compare
    for other in (other_ids, other_mask, regrouped):
        now = data_identity(other, 1)
        assert {k: now[k] for k in ("examples", "tokens", "held_out")} == {"examples": 2, "tokens": 6, "held_out": 1}
        with pytest.raises(ConfigError, match=r"^ck was trained on other data .*resume with the run's "
                                              r"data.train_files"):
            check_resumed_data(Path("ck"), saved, now)
        counts_only = {k: v for k, v in saved.items() if k != "blake2b"}  # a checkpoint from before the digest
        check_resumed_data(Path("ck"), counts_only, now)
    with pytest.raises(ConfigError, match="other data"):
        check_resumed_data(Path("ck"), saved, data_identity(run, 2))


def test_a_damaged_run_file_is_one_line_naming_the_checkpoint(tmp_path):
    """A run.json cut short (a kill while it was written) or holding no object was a JSONDecodeError /
    AttributeError traceback from every rank's resume; now the checkpoint is named, with the one before."""
    identity = _identity(range(96), "/v/a.json")
    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0, identity)
    _checkpoint(tmp_path / "run", 3, 12, 1.0, identity)  # an earlier checkpoint (latest now names step3)
    (ck / "latest").write_text("step6")
    for damage in (json.dumps(identity)[:40], "[1, 2]", b"\xff\xfe{"):
        where = ck / "step6" / RUN_FILE
        where.write_bytes(damage) if isinstance(damage, bytes) else where.write_text(damage)
        with pytest.raises(ConfigError) as e:
            check_resume(ck, identity)
        msg = str(e.value)
        assert "\n" not in msg and f"names checkpoint 'step6', whose {RUN_FILE} cannot be read" in msg, msg
        assert "echo step3 >" in msg, msg


_SAVE_ON_ONE_RANK = """
import json, os, sys
from pathlib import Path
import torch, deepspeed
from spd_ds.train import loop

ckpt, port, identity, steps, keep, kill, stage = sys.argv[1:]
rank, world = int(os.environ.setdefault("RANK", "0")), int(os.environ.setdefault("WORLD_SIZE", "1"))
os.environ.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
deepspeed.init_distributed("gloo")
model = torch.nn.Linear(4, 4)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                  config={"train_batch_size": world, "zero_optimization": {"stage": int(stage)}})
saved = engine.save_checkpoint
def killed(*args, **kw):  # the kill comes just after DeepSpeed wrote the checkpoint and its `latest`
    saved(*args, **kw)
    raise KeyboardInterrupt
if kill == "1":
    engine.save_checkpoint = killed
try:
    for step in json.loads(steps):
        loop._save(engine, Path(ckpt), step, 0, 1, 1, rank, world, int(keep), "cpu", identity=json.loads(identity))
except KeyboardInterrupt:
    print("killed")
"""


def _save_on_one_rank(ck: Path, identity: dict, steps: list[int], keep: int = 2, kill: bool = False,
                      stage: int = 2) -> str:
    """The training loop's ``_save`` of ``steps`` under ``ck`` with a real DeepSpeed engine (ZeRO ``stage``, one gloo
    rank, a subprocess); ``kill``: a KeyboardInterrupt right after DeepSpeed's save returns. Returns its stdout."""
    import os
    import subprocess
    import sys

    from tests.test_pipe_worker import free_port

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SAVE_ON_ONE_RANK, str(ck), str(free_port()), json.dumps(identity),
                           json.dumps(steps), str(keep), str(int(kill)), str(stage)],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_a_run_file_rank_0_cannot_write_stops_every_rank_before_deepspeeds_save(tmp_path):
    """Rank 0 writes run.json before DeepSpeed's save; when that failed (a full disk, no permission) rank 0 raised
    while the other ranks were already inside DeepSpeed's save, which they left by a lost connection (gloo) or the
    collective timeout, never saying why. The failure now travels with the RNG states: both ranks of a real two-rank
    gloo engine stop before the save with the same line, and no ``latest`` names the step. The write is made to fail
    by a folder in its place."""
    import os
    import subprocess
    import sys

    from tests.test_pipe_worker import free_port

    ck = tmp_path / "run" / "checkpoints"
    identity = _identity(range(96), "/v/a.json")
    (ck / "step6" / RUN_FILE).mkdir(parents=True)  # os.replace onto a folder: IsADirectoryError on rank 0
    repo = Path(__file__).resolve().parents[1]
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-c", _SAVE_ON_ONE_RANK, str(ck), port, json.dumps(identity), "[6]", "2", "0", "2"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", OMP_NUM_THREADS="1",
                 PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))) for r in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, f"rank {r} went on"
        assert f"OSError: checkpoint step6 not saved: cannot write {ck / 'step6' / RUN_FILE} (" in err, err[-3000:]
    assert not (ck / "latest").exists()
    assert not list((ck / "step6").glob("mp_rank_*"))  # DeepSpeed never began the save


def test_a_kill_just_after_a_checkpoint_is_saved_keeps_its_run_file(tmp_path):
    """run.json was written after DeepSpeed's save_checkpoint, which writes ``latest`` last: a kill in between left
    a latest checkpoint without it, which a resume takes for one from before run.json existed and resumes with any
    settings unchecked (another seed, loss or data order without a word). It is written before now. A real DeepSpeed
    engine (one gloo rank) saves; the kill is simulated right after its save returns."""
    ck = tmp_path / "run" / "checkpoints"
    identity = _identity(range(96), "/v/a.json", **{"train.seed": 1})
    assert "killed" in _save_on_one_rank(ck, identity, [6], kill=True)
    assert (ck / "latest").read_text().strip() == "step6"
    assert json.loads((ck / "step6" / RUN_FILE).read_text()) == identity
    assert not list((ck / "step6").glob(".*tmp*"))  # written whole, no temporary file left
    check_resume(ck, identity)
    with pytest.raises(ConfigError, match=r"was trained with other settings: train.seed 1 \(now 2\)"):
        check_resume(ck, {**identity, "train.seed": 2})


def test_max_steps_below_the_checkpoints_step_is_refused_before_anything_is_built(tmp_path):
    """A resume with train.max_steps below its checkpoint's step was refused only once the target, the data and the
    engines were built (the check needed the restored schedule); the step is now read from the checkpoint's client
    state before anything loads (the slow tier's test_resume_with_other_settings_is_refused runs it through the
    launcher). train.epochs needs the data: left to the later check."""
    from spd_ds.train.resume import check_max_steps

    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0)
    with pytest.raises(ConfigError, match=r"^train.max_steps=4 is below the checkpoint's step 6, and a resume "
                                          r"cannot go back: .*schedule ends at step 12\)"):
        check_max_steps(ck, 4)
    for fine in (6, 7, None):
        check_max_steps(ck, fine)


def test_the_train_loop_checks_max_steps_before_it_reads_the_data(tmp_path):
    """The early check is the loop's, not only a function's: a resume with train.max_steps below the checkpoint's step
    stops on it before the training files are looked at (without the call: the missing file's error instead)."""
    from spd_ds.config import load_config
    from spd_ds.train import loop

    run = tmp_path / "run"
    _checkpoint(run, 6, 12, 1.0)
    cfg = load_config(None, [f"train.output_dir={run}", "train.max_steps=4",
                             f"data.train_files=[{tmp_path / 'missing.jsonl'}]"])
    with pytest.raises(ConfigError, match=r"^train.max_steps=4 is below the checkpoint's step 6, and a resume "):
        loop.train(cfg, str(Path(__file__).resolve().parents[1] / "ds_configs" / "zero2.json"), resume=True)


def test_an_earlier_attempts_later_checkpoint_does_not_crowd_out_the_one_just_saved(tmp_path):
    """A kill while step 12 was being saved leaves a step12 folder cut short (``latest`` still names step6). The
    resumed run pauses at step 9 (train.session_time_s, train.max_time_s) and saves step9: with
    train.keep_checkpoints=1 the pruning counted the stale step12 as the newest and removed step9, the checkpoint
    ``latest`` had just been set to, and the next resume found nothing to resume (the work since step 6 lost)."""
    ck = tmp_path / "run" / "checkpoints"
    identity = _identity(range(96), "/v/a.json")
    _save_on_one_rank(ck, identity, [6, 15], keep=0)
    (ck / "latest").write_text("step6")  # step15 whole: a kill after its files, before `latest`
    (ck / "step12").mkdir()  # what the kill mid-save left
    (ck / "step12" / "mp_rank_00_model_states.pt").write_bytes(b"cut sh")
    (ck / "step.bak").mkdir()  # a user's copy: not a step, not counted (int('.bak') was a ValueError)
    out = _save_on_one_rank(ck, identity, [9], keep=1)
    assert (ck / "latest").read_text().strip() == "step9"
    check_resume(ck, identity)  # step9 is whole (model and optimizer files): resumable
    # step6 pruned; step12, cut short, removed (nothing resumes it, and a run ending before step 12 left it for good);
    # step15 holds a whole checkpoint: neither counted nor removed
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["step.bak", "step15", "step9"]
    assert f"spd_ds.train: removed step12 under {ck} (saves cut short by a kill)" in out, out


def test_pruning_keeps_what_it_cannot_judge_and_reports_only_what_it_removed(tmp_path, monkeypatch):
    """prune_checkpoints with keep=0 keeps every earlier step; a later cut-short folder behind a link is not
    followed (rmtree refuses links: it was reported "removed" at every save), and one it cannot read is kept without
    raising (rank 0 raising there left the other ranks at the save's barrier until the collective timeout)."""
    from spd_ds.train import resume

    ck = tmp_path / "checkpoints"
    for name in ("step3", "step6", "step9", "step12", "step15"):
        (ck / name).mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (ck / "step18").symlink_to(tmp_path / "elsewhere")
    real = resume._missing

    def missing(where):
        if where.name == "step15":
            raise PermissionError(13, "Permission denied", str(where))
        return real(where)

    monkeypatch.setattr(resume, "_missing", missing)
    assert resume.prune_checkpoints(ck, 9, keep=0) == ["step12"]
    assert sorted(p.name for p in ck.iterdir()) == ["step15", "step18", "step3", "step6", "step9"]
    assert (tmp_path / "elsewhere").is_dir()
    assert resume.prune_checkpoints(ck, 9, keep=2) == []
    assert sorted(p.name for p in ck.iterdir()) == ["step15", "step18", "step6", "step9"]


def test_the_checkpoint_offered_instead_of_a_damaged_one_is_an_earlier_whole_one(tmp_path):
    """The advice named the highest-numbered other folder: after a kill mid-save that was the later step's folder it
    left, cut short (``latest`` naming the one before), or an empty one; it names an earlier folder holding the
    model file now, or says to start anew."""
    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0)
    _checkpoint(tmp_path / "run", 3, 12, 1.0)
    (ck / "step12").mkdir()  # a save of step 12 cut short
    (ck / "step4").mkdir()  # nothing in it
    (ck / "latest").write_text("step6")
    (ck / "step6" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ConfigError) as e:
        check_resume(ck, {})
    msg = str(e.value)
    assert "names checkpoint 'step6', which cannot be resumed (no mp_rank_00_model_states.pt)" in msg, msg
    assert f"resume the one before (`echo step3 > {ck / 'latest'}`; it holds step3)" in msg, msg
    shutil.rmtree(ck / "step3")
    with pytest.raises(ConfigError, match=r"cannot be resumed \(no mp_rank_00_model_states.pt\); start a new "):
        check_resume(ck, {})


def test_an_empty_latest_names_the_newest_whole_checkpoint(tmp_path):
    """DeepSpeed writes ``latest`` by emptying it, then writing the tag: a kill in between left an empty file, which
    the resume reported as "names checkpoint '', which cannot be resumed (no mp_rank_00_model_states.pt)". It says the
    file is empty now, and names the newest whole checkpoint (the one that save had just finished)."""
    ck = _checkpoint(tmp_path / "run", 6, 12, 1.0)
    _checkpoint(tmp_path / "run", 12, 12, 1.0)
    (ck / "step18").mkdir()  # a later save cut short, for good measure: the model file written, no optimizer state
    (ck / "step18" / "mp_rank_00_model_states.pt").write_bytes(b"x")  # (it was named: following it failed again)
    (ck / "latest").write_text("")
    with pytest.raises(ConfigError) as e:
        check_resume(ck, {})
    assert str(e.value) == (f"{ck / 'latest'} is empty (a checkpoint save was cut short while writing it); resume "
                            f"the newest whole one (`echo step12 > {ck / 'latest'}`; it holds step12, step6), or "
                            "start a new train.output_dir")


def test_a_zero_stage_0_checkpoint_is_whole_without_optimizer_shards(tmp_path):
    """At ZeRO stage 0 DeepSpeed keeps the optimizer's state in mp_rank_00_model_states.pt and writes no
    *optim_states.pt: every stage-0 resume was refused ('no optimizer state'), and a stage-0 run's checkpoints without
    `latest` were not taken for whole ones (a run from step 0 pruned them). Its run.json records the stage, so a
    ZeRO-2 save cut short after the model file still reads as cut short. A real DeepSpeed engine (one gloo rank)
    saves at stage 0."""
    from spd_ds.train.resume import DS_STAGE, check_fresh_output, whole_checkpoints

    ck = tmp_path / "run" / "checkpoints"
    identity = _identity(range(96), "/v/a.json", **{DS_STAGE: 0, "world size": 1})
    _save_on_one_rank(ck, identity, [3, 6], stage=0)
    assert not list(ck.rglob("*optim_states.pt"))
    check_resume(ck, identity)
    (ck / "latest").unlink()
    assert whole_checkpoints(ck) == ["step6", "step3"]
    with pytest.raises(ConfigError, match=r"holds checkpoints \(step6, step3\) but no `latest`"):
        check_fresh_output(ck.parent, None)
    stage2 = ck / "step9"  # a ZeRO-2 save cut short after the model file
    stage2.mkdir()
    (stage2 / RUN_FILE).write_text(json.dumps({**identity, DS_STAGE: 2}))
    (stage2 / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert whole_checkpoints(ck) == ["step6", "step3"]
    (ck / "latest").write_text("step9")
    with pytest.raises(ConfigError, match=r"'step9', which cannot be resumed \(no optimizer state .*echo step6 >"):
        check_resume(ck, {**identity, DS_STAGE: 2})
