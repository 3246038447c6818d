"""spd_ds.train.loss and the loop's small pieces: KD loss, outside-vocabulary weights, agreement, schedule."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from spd_ds.config import ConfigError
from spd_ds.train import ds_config as ds_config_module
from spd_ds.train.loop import WarmupLinear, load_ds_config
from spd_ds.train.loss import TeacherTargets, kd_loss, position_weights, top1_agreement


def _targets(z_full: torch.Tensor, draft_ids: torch.Tensor, T: float = 1.0) -> TeacherTargets:
    return TeacherTargets(z_full[:, draft_ids], torch.logsumexp(z_full / T, -1), z_full.argmax(-1))


def test_kd_loss_is_forward_kl_over_the_draft_vocab():
    torch.manual_seed(0)
    V, ids = 20, torch.tensor([0, 2, 3, 7, 11, 19])
    z = torch.randn(5, V) * 3
    s = torch.randn(5, ids.numel(), requires_grad=True)
    t = _targets(z, ids, 2.0)
    w = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0])
    loss = kd_loss(s, t, w, temperature=2.0)
    p = torch.softmax(z[:, ids] / 2.0, -1)
    q = torch.softmax(s / 2.0, -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(loss, 4.0 * (w * kl).sum() / w.sum(), atol=1e-6)
    loss.backward()
    assert s.grad.abs().sum() > 0 and s.grad[2].abs().sum() == 0  # zero weight: no gradient
    # the minimum is the teacher restricted to D
    assert kd_loss(z[:, ids] / 1.0, _targets(z, ids), torch.ones(5)).abs() < 1e-6
    assert loss.dtype == torch.float32
    with pytest.raises(ValueError):
        kd_loss(s, t, w, temperature=0.0)


def test_outside_vocab_policies_and_agreement():
    ids = torch.tensor([0, 1, 2])
    z = torch.tensor([[5.0, 0, 0, 0, 0, 0],    # argmax 0 in D
                      [0.0, 0, 0, 5, 0, 0]])   # argmax 3 outside D
    t = _targets(z, ids)
    w = position_weights(t, ids, 1.0, "weight")
    mass = torch.softmax(z, -1)[:, :3].sum(-1)
    assert torch.allclose(w, mass, atol=1e-6) and w[0] > 0.9 and w[1] < 0.05
    assert position_weights(t, ids, 1.0, "drop").tolist() == [1.0, 0.0]
    assert position_weights(t, ids, 1.0, "keep").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        position_weights(t, ids, 1.0, "nope")
    s = torch.tensor([[3.0, 0, 0], [0.0, 0, 3]])
    assert top1_agreement(s, t, ids).tolist() == [True, False]  # an argmax outside D is never matched


def test_lr_schedule_and_ds_config(tmp_path, monkeypatch):
    f = WarmupLinear(4, 20)
    assert [round(f(s), 3) for s in (0, 3, 4, 12, 20, 25)] == [0.25, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert math.isclose(WarmupLinear(0, 10)(0), 1.0)
    f.time_fraction = 0.75  # a time budget three quarters spent decays faster than the steps say
    assert math.isclose(f(12), 0.25)
    w = WarmupLinear(0, 100, stable=0.8)  # warmup-stable-decay: full rate for 80 % of the run, then linear to 0
    assert [round(w(s), 3) for s in (0, 50, 79, 80, 90, 100)] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    w.time_fraction = 0.95  # time decides when it is further along than the steps
    assert math.isclose(w(10), 0.25)
    from spd_ds.config import load_config

    with pytest.raises(ConfigError, match=r"train.lr_stable_fraction must be in \[0, 1\)"):
        load_config(None, ["train.lr_stable_fraction=1.0"])
    cfg = load_ds_config("ds_configs/zero2.json", 6)
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["train_micro_batch_size_per_gpu"] == 6
    with pytest.raises(ConfigError, match="optimizer"):
        load_ds_config({"optimizer": {"type": "AdamW"}}, 1)
    with pytest.raises(ConfigError, match="fp16"):
        load_ds_config({"fp16": {"enabled": True}}, 1)
    for stage, why in ((3, "ZeRO-3 would save empty head weights"), ("2", "give it as a JSON number"),
                       (True, "use ds_configs/zero2.json")):  # ZeRO-3 ran and wrote a head of empty weights
        with pytest.raises(ConfigError, match=f"zero_optimization.stage .* must be 0, 1 or 2, got .*; {why}"):
            load_ds_config({"zero_optimization": {"stage": stage}}, 1)
    # DeepSpeed ignores a top-level key it does not read: a misspelt one trained without ZeRO, without a word
    with pytest.raises(ConfigError, match="'zero_optimisation' in the DeepSpeed config is no key DeepSpeed reads "
                                          r"\(it would be ignored\); did you mean 'zero_optimization'\?"):
        load_ds_config({"zero_optimisation": {"stage": 2}}, 1)
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):
        load_ds_config({"gradient_clip": 1.0}, 1)
    said = []
    load_ds_config({"_comment": "ZeRO-2", "zero_optimization": {"stage": 2}}, 1, said.append)
    assert said == ["the DeepSpeed config has '_comment', which DeepSpeed does not read: ignored"]
    many = {"bfloat16": {"enabled": True}, "activation_checkpointing": {}, "flops_profiler": {"enabled": False},
            "tensorboard": {"enabled": False}, "wandb": {"enabled": False}, "csv_monitor": {"enabled": False},
            "comms_logger": {"enabled": False}, "zero_allow_untested_optimizer": True, "prescale_gradients": False,
            "wall_clock_breakdown": False, "memory_breakdown": False, "checkpoint": {}, "data_types": {},
            "compile": {}, "aio": {}, "autotuning": {"enabled": False}, "steps_per_print": 10, "pipeline": {},
            "data_efficiency": {}, "torch_autocast": {"enabled": False}, "dataloader_drop_last": False}
    said.clear()
    load_ds_config(many, 1, said.append)  # keys DeepSpeed reads, each looked for by its parser
    for path in ("ds_configs/zero2.json", "ds_configs/infer.json"):
        load_ds_config(path, 1, lambda msg: said.append(msg) if "does not read" in msg else None)
    assert said == []
    # DeepSpeed's legacy "zero_optimization": true is stage 1 (it was refused as no JSON object), passed on as given:
    # its legacy top-level keys (allgather_size) are DeepSpeed's to read
    legacy = load_ds_config({"zero_optimization": True, "allgather_size": 2e8}, 1, said.append)
    assert legacy["zero_optimization"] is True and said == []
    for misplaced, hint in (("stage", "move it there"), ("zero_stage", 'move it there as "stage"'),
                            ("offload_optimizer", "move it there"), ("stage3_max_live_parameters", "move it there")):
        with pytest.raises(ConfigError, match=f"'{misplaced}' belongs under zero_optimization .*; {hint}"):
            load_ds_config({misplaced: {"device": "cpu"} if misplaced.startswith("offload") else 2}, 1)
    load_ds_config({"sequence_parallel_size": 1, "data_parallel_size": 1}, 1, said.append)  # read by initialize
    assert said == []
    for key, fix in (("bf16", "true .bf16 mixed precision. or false"), ("fp16", "false .fp16 is not supported")):
        with pytest.raises(ConfigError, match=f'{key}.enabled "auto" .* a placeholder .*; give {fix}'):
            load_ds_config({key: {"enabled": "auto"}}, 1)  # bf16 "auto": DeepSpeed dropped it and trained in fp32
    # a DeepSpeed that copies the config before reading it records nothing: then nothing is refused or reported
    with monkeypatch.context() as m:
        m.setattr(ds_config_module, "_ReadKeys", lambda cfg, seen: dict(cfg))
        load_ds_config({"zero_optimisation": {"stage": 2}, "_comment": "x"}, 1, said.append)
    assert said == []
    dup = tmp_path / "dup.json"
    dup.write_text('{"zero_optimization": {"stage": 2}, "zero_optimization": {"stage": 0}}')
    with pytest.raises(ConfigError, match="not valid JSON .Duplicate keys .*zero_optimization"):
        load_ds_config(str(dup), 1)  # json's last-wins trained at stage 0 without a word
    assert load_ds_config({"zero_optimization": {"stage": 1}}, 1)["zero_optimization"]["stage"] == 1
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    # DeepSpeed raised ZeRORuntimeException (a traceback) after the model and data had loaded
    with pytest.raises(ConfigError, match='offload_optimizer .device .cpu.. .* "zero_force_ds_cpu_optimizer": false'):
        load_ds_config(offload, 1)
    assert load_ds_config({**offload, "zero_force_ds_cpu_optimizer": False}, 1)["zero_force_ds_cpu_optimizer"] is False
    load_ds_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}, 1)
    with pytest.raises(ConfigError, match="zero_optimization in the DeepSpeed config must be a JSON object, got 2"):
        load_ds_config({"zero_optimization": 2}, 1)
    with pytest.raises(ConfigError, match="not found"):
        load_ds_config(str(tmp_path / "none.json"), 1)
    monkeypatch.chdir(tmp_path)  # another directory: the default and a relative path are found in the repository
    assert load_ds_config(None, 6) == cfg == load_ds_config("ds_configs/zero2.json", 6)  # both said 'not found'
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2}')
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_ds_config(str(bad), 1)
    # DeepSpeed reads its config files as Hjson: a commented file (DeepSpeedExamples' annotated configs) was refused
    bad.write_text('{\n  // ZeRO-2 for the head\n  "zero_optimization": {"stage": 2,},\n  "gradient_clipping": 1e0,\n}')
    assert load_ds_config(str(bad), 1)["zero_optimization"] == {"stage": 2}
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        load_ds_config(str(bad), 1)
    bad.write_bytes('{"zero_optimization": {"stage": 2}}'.encode("utf-16"))  # Notepad's: a traceback-free line
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(it is UTF-16, as Windows Notepad saves it\); save it "
                                          "as UTF-8$"):
        load_ds_config(str(bad), 1)
    for gas in (0, -1, 1.5, "2"):
        with pytest.raises(ConfigError, match="gradient_accumulation_steps .* must be an integer >= 1"):
            load_ds_config({"gradient_accumulation_steps": gas}, 1)
    assert load_ds_config({"gradient_accumulation_steps": 3}, 1)["gradient_accumulation_steps"] == 3
    said = []  # a batch size the file sets is overridden by data.micro_batch_size: said, not silent
    ds = load_ds_config({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 4}, 2, said.append)
    assert "train_batch_size" not in ds and ds["train_micro_batch_size_per_gpu"] == 2
    assert said == ["the DeepSpeed config's train_batch_size=7 and train_micro_batch_size_per_gpu=4 are ignored: "
                    "spd-ds sets the batch from data.micro_batch_size (rows per micro-batch) and the config's "
                    "gradient_accumulation_steps; set those instead"]
    said.clear()
    load_ds_config("ds_configs/zero2.json", 2, said.append)
    assert said == []



def test_ds_config_values_deepspeed_refuses_are_one_line_before_any_engine(tmp_path):
    """A value DeepSpeed's own config parser refuses (a pydantic field, Apex AMP, a checkpoint setting) raised a
    traceback at the head engine's deepspeed.initialize, after the target, the teacher and the data had loaded; a
    gradient_clipping that is no number raised a TypeError at the first step. Now load_ds_config refuses them."""
    for bad in ("abc", -1.0, True, float("nan")):
        with pytest.raises(ConfigError, match="gradient_clipping in the DeepSpeed config must be a number >= 0"):
            load_ds_config({"gradient_clipping": bad}, 1)
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}}))
    with pytest.raises(ConfigError) as e:
        load_ds_config(str(path), 1)
    assert str(e.value) == (f"the DeepSpeed config {path} is refused by DeepSpeed (DeepSpeedZeroConfig."
                            "reduce_bucket_size: Input should be a valid integer, unable to parse string as an "
                            "integer (got 'lots')); fix the file or pass another --deepspeed_config (e.g. "
                            "ds_configs/zero2.json)")
    with pytest.raises(ConfigError, match=r"^the DeepSpeed config is refused by DeepSpeed \(Checkpoint config "
                                          "contains invalid tag_validation value of BOGUS"):
        load_ds_config({"checkpoint": {"tag_validation": "bogus"}}, 1)
    assert load_ds_config({"gradient_clipping": 0.5, "bf16": {"enabled": True}}, 1)["gradient_clipping"] == 0.5


def test_ds_config_deprecated_cpu_offload_and_a_non_object_fp16_are_one_line():
    """DeepSpeed reads the deprecated ``zero_optimization.cpu_offload: true`` as an offload_optimizer on the CPU: it
    passed the offload check and raised ZeRORuntimeException (a traceback) at the head engine's initialize, after the
    target, the teacher and the data had loaded. ``"fp16": null`` (or true) was an AttributeError traceback."""
    zero = {"zero_optimization": {"stage": 2, "cpu_offload": True}}
    with pytest.raises(ConfigError, match=r'^zero_optimization.cpu_offload \(device .cpu.\) .* '
                                          '"zero_force_ds_cpu_optimizer": false beside it'):
        load_ds_config(zero, 1)
    assert load_ds_config({**zero, "zero_force_ds_cpu_optimizer": False}, 1)["zero_optimization"]["cpu_offload"]
    load_ds_config({"zero_optimization": {"stage": 2, "cpu_offload": False}}, 1)
    for fp16 in (None, True):
        with pytest.raises(ConfigError, match="^fp16 in the DeepSpeed config must be a JSON object"):
            load_ds_config({"fp16": fp16}, 1)
    load_ds_config({"fp16": {"enabled": False}}, 1)

def test_resume_checks_the_run_identity_and_keeps_its_schedule(tmp_path):
    from types import SimpleNamespace

    from spd_ds.train.resume import RUN_FILE, check_resume, check_resumed_schedule, truncate_log

    ck = tmp_path / "run" / "checkpoints"
    (ck / "step6").mkdir(parents=True)
    (ck / "latest").write_text("step6")
    with pytest.raises(ConfigError, match="names checkpoint 'step6', which cannot be resumed .no mp_rank_00_model"):
        check_resume(ck, {"world size": 2})  # DeepSpeed's own files missing: one line before DeepSpeed asserts
    (ck / "step6" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (ck / "step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="no optimizer state of rank 1 of 2"):  # every rank's shard, run.json or not
        check_resume(ck, {"world size": 2})
    (ck / "step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    check_resume(ck, {"world size": 2})  # a checkpoint without the file (written before it existed): not checked
    saved = {"world size": 2, "partition": {"stage_layers": [2, 2]}, "head.num_layers": 1}
    (ck / "step6" / RUN_FILE).write_text(json.dumps(saved))
    check_resume(ck, dict(saved))
    with pytest.raises(ConfigError) as e:
        check_resume(ck, {**saved, "world size": 1, "head.num_layers": 2})
    msg = str(e.value)
    assert "world size 2 (now 1)" in msg and "head.num_layers 1 (now 2)" in msg and "partition" not in msg
    assert "\n" not in msg and "head.checkpoint=" in msg

    said = []
    tc = SimpleNamespace(lr=1e-3, warmup_steps=2, lr_stable_fraction=0.0, weight_decay=0.0)
    check_resumed_schedule(WarmupLinear(2, 12), 1e-3, 0.0, tc, 12, said.append)
    assert said == []  # the same settings: nothing to say
    check_resumed_schedule(WarmupLinear(2, 12), 1e-3, 0.0,
                           SimpleNamespace(**{**vars(tc), "lr": 0.5, "warmup_steps": 10}), 8, said.append)
    assert len(said) == 2 and "train.lr=0.5 (the run keeps 0.001); train.warmup_steps=10 (the run keeps 2)" in said[0]
    assert "ends at step 8, before its schedule's end at step 12" in said[1]
    with pytest.raises(ConfigError, match="schedule ends at step 12 .* now ask for 30 steps"):
        check_resumed_schedule(WarmupLinear(2, 12), 1e-3, 0.0, tc, 30, said.append)
    # a run asked to end before its checkpoint's step wrote that step's head as its final one, 'finished', after a
    # warning that it "now ends at step 8" (every rank reads the same step: all raise together)
    said.clear()
    with pytest.raises(ConfigError) as e:
        check_resumed_schedule(WarmupLinear(2, 12), 1e-3, 0.0, tc, 8, said.append, step=10)
    assert str(e.value) == ("the checkpoint is at step 10, past the 8 steps train.max_steps / train.epochs now ask "
                            "for, and a resume cannot go back: resume with the run's own settings (its schedule "
                            "ends at step 12), or name an earlier checkpoint in checkpoints/latest") and said == []
    check_resumed_schedule(WarmupLinear(2, 12), 1e-3, 0.0, tc, 10, said.append, step=10)  # ends where it stands

    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4, 3, 4)) + '{"step": 5, "lo')
    truncate_log(log, 2)  # a resume at step 2 drops what a crash logged after it
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    truncate_log(log, 0)  # a fresh run
    assert not log.exists()


_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
import spd_ds.files
from spd_ds.train.resume import truncate_log

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as one on a full disk does
resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))
try:
    truncate_log(Path(sys.argv[1]), 40)
except OSError as e:
    print("failed:", e.strerror)
"""


def test_a_resume_on_a_full_disk_keeps_the_training_log(tmp_path):
    """truncate_log rewrote train_log.jsonl in place: truncated first, so a write that failed (a full disk, here a
    file-size limit of 200 bytes on the resuming process) left it empty, the run's history lost. The kept records
    now replace it only once written whole."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    log = tmp_path / "train_log.jsonl"
    text = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 51))
    log.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(log)], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "failed: File too large" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert log.read_text() == text  # as it was
    assert [p.name for p in tmp_path.iterdir()] == ["train_log.jsonl"]  # no temporary file left


@pytest.mark.parametrize("temperature,chunk,backend", [(1.0, 7, None), (2.0, 64, None), (0.7, 1, None),
                                                       (1.0, 7, "aot_eager"), (2.0, 64, "aot_eager"),
                                                       pytest.param(0.7, 5, "inductor", marks=pytest.mark.slow)])
def test_chunked_kl_equals_kd_loss_value_and_gradient(temperature, chunk, backend):
    """The chunked loss with its gradient written in the forward pass equals autograd through :func:`kd_loss`
    (fp32), eager and compiled (``train.compile_loss``; aot_eager: the graph with the eager kernels, one graph for
    every chunk size; inductor, slow tier (a C++ compile on CPU): fused kernels, within rounding), and the gradient
    follows the incoming one (here 3x)."""
    from spd_ds.train.loss import TeacherTargets, kd_loss, kd_loss_chunked, position_weights

    torch.manual_seed(1)
    N, Vd, V = 23, 17, 40
    draft_ids = torch.arange(0, V, 2)[:Vd]
    full = torch.randn(N, V) * 3
    t = TeacherTargets(full[:, draft_ids], torch.logsumexp(full / temperature, -1), full.argmax(-1))
    w = position_weights(t, draft_ids, temperature, "weight")
    s1 = (torch.randn(N, Vd) * 2).requires_grad_(True)
    s2 = s1.detach().clone().requires_grad_(True)
    ref = kd_loss(s1, t, w, temperature)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    got = kd_loss_chunked(s2, t, w, temperature, chunk=chunk, compile_backend=backend)
    torch.testing.assert_close(got, ref, rtol=1e-5 if backend == "inductor" else 1e-6, atol=1e-6)
    (3.0 * ref).backward()
    (3.0 * got).backward()
    torch.testing.assert_close(s2.grad, s1.grad, rtol=1e-5, atol=1e-7)
    assert counters["stats"]["unique_graphs"] == (1 if backend else 0)  # full and last chunk share the graph


def test_flex_compile_setting():
    """``train.flex_compile``: validated in the config and by the setter (the CUDA equality test covers both modes)."""
    from spd_ds.config import load_config
    from spd_ds.train import student

    with pytest.raises(ConfigError, match="train.flex_compile must be static or dynamic"):
        load_config(None, ["train.flex_compile=fast"])
    with pytest.raises(ValueError, match="must be one of static, dynamic"):
        student.set_flex_compile("fast")
    student.set_flex_compile("dynamic")
    assert student._flex_dynamic is None and student._compiled_flex is None
    student.set_flex_compile("static")
    assert student._flex_dynamic is False
    # one compiled FlexAttention serves 2n + 1 shapes of a run (fills x grad mode, the teacher): the recompile limit
    # rises to what the run needs, and is never lowered
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.recompile_limit
    try:
        student.set_flex_compile("static", shapes=before + 6)
        assert dynamo_config.recompile_limit == before + 6
        student.set_flex_compile("static", shapes=2)
        assert dynamo_config.recompile_limit == before + 6
    finally:
        dynamo_config.recompile_limit = before
