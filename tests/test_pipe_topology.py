"""The SPD pipeline plan (topology mapping), world-size errors, DeepSpeed config checks; no processes."""

import json

import pytest

from spd_ds.config import ConfigError, load_config
from spd_ds.partition import StagePartition
from spd_ds.pipe.topology import PipePlan, WorldSizeError, allowed_world_sizes, detect_world_size


def part(n, L=6, anchors=None):
    return StagePartition.build(L, n, anchors=anchors)


def test_colocated_plan_puts_head_with_stage_0():
    plan = PipePlan.build(part(3), "colocated", 3)
    assert [plan.pipe_of(s) for s in range(3)] == [0, 1, 2]
    assert plan.head_stages == (0,) and plan.remote_stages == (1, 2) and plan.first_remote == 1
    assert plan.upstream_pipe(1) == 0 and plan.downstream_pipe(2) is None
    # layer list [HeadEnds, stage0, stage1, stage2]: pipe 0 owns the head and stage 0
    assert plan.layer_list_parts() == [0, 2, 3, 4]


def test_dedicated_plan_adds_a_driver_stage():
    plan = PipePlan.build(part(2), "dedicated", 3)
    assert [plan.pipe_of(s) for s in range(2)] == [1, 2]
    assert plan.head_stages == () and plan.remote_stages == (0, 1) and plan.first_remote == 0
    assert plan.upstream_pipe(0) == 0
    assert plan.layer_list_parts() == [0, 1, 2, 3]
    assert "driver" not in plan.describe() and plan.describe().count("pipe stage") == 3


@pytest.mark.parametrize("placement", ["colocated", "dedicated"])
def test_world_one_holds_everything(placement):
    plan = PipePlan.build(part(3), placement, 1)
    assert plan.head_stages == (0, 1, 2) and plan.remote_stages == () and plan.first_remote is None
    assert plan.layer_list_parts() == [0, 4]


def test_up_rows_send_anchors_and_the_last_output_once():
    p = part(3)  # anchors (0, 2, 4, 6): stage s produces anchor 2(s+1)
    plan = PipePlan.build(p, "dedicated", 4)
    assert [plan.up_rows(s) for s in range(3)] == [(2,), (4,), (6,)]  # L=6 is an anchor: sent once
    p = part(3, anchors=[0, 4])  # the last stage owns no anchor but still sends its output
    plan = PipePlan.build(p, "colocated", 3)
    assert [plan.up_rows(s) for s in range(3)] == [(), (4,), (6,)]


@pytest.mark.parametrize("placement,world", [("colocated", 2), ("colocated", 4), ("dedicated", 3), ("dedicated", 5)])
def test_wrong_world_size_names_the_fix(placement, world):
    with pytest.raises(WorldSizeError) as e:
        PipePlan.build(part(3), placement, world)
    msg = str(e.value)
    assert "\n" not in msg and f"world size {world}" in msg
    want = 3 if placement == "colocated" else 4
    # a hostfile launch takes its world from the slots= counts (the openmpi launcher refuses --num_gpus; with pdsh,
    # --num_gpus sets every host's slots): the hint said only "deepspeed --num_gpus N"
    assert (f"launch {want} processes (one node: deepspeed --num_gpus {want}; with --hostfile: slots= counts that add "
            f"up to {want} over its hosts) or 1 for a single-process run") in msg
    assert isinstance(e.value, ConfigError)


def test_allowed_world_sizes():
    assert allowed_world_sizes(2, "colocated") == (1, 2)
    assert allowed_world_sizes(2, "dedicated") == (1, 3)
    assert allowed_world_sizes(1, "colocated") == (1,)
    with pytest.raises(ConfigError):
        allowed_world_sizes(2, "elsewhere")


def test_detect_world_size(monkeypatch):
    for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    assert detect_world_size() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert detect_world_size() == 4
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert detect_world_size() == 3


def test_ds_config(tmp_path, monkeypatch):
    from spd_ds.pipe.runner import load_ds_config

    cfg = load_config(None, [])
    ds = load_ds_config(cfg)  # ds_configs/infer.json
    assert ds["train_micro_batch_size_per_gpu"] == 1 and "fp16" not in ds
    monkeypatch.chdir(tmp_path)  # another directory: a relative deepspeed.config is found in the repository
    named = load_config(None, ["deepspeed.config=ds_configs/infer.json"])
    assert load_ds_config(named) == ds and load_ds_config(cfg) == ds  # it said 'not found' for the named one
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "infer.json").write_text(json.dumps({"steps_per_print": 7}))
    assert load_ds_config(named)["steps_per_print"] == 7  # the working directory's file first
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"bf16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="set model.dtype instead"):
        load_ds_config(load_config(None, [f"deepspeed.config={bad}"]))
    with pytest.raises(ConfigError, match="not found"):
        load_ds_config(load_config(None, [f"deepspeed.config={tmp_path / 'missing.json'}"]))
    bad.write_text('{"steps_per_print": 10')
    with pytest.raises(ConfigError, match="deepspeed.config .* is not valid JSON .* set another deepspeed.config"):
        load_ds_config(load_config(None, [f"deepspeed.config={bad}"]))
    bad.write_text("[]")
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        load_ds_config(load_config(None, [f"deepspeed.config={bad}"]))


def test_session_checks_before_any_collective(tiny_root, monkeypatch):
    """World size and prompts are checked before torch.distributed is touched (a collective would hang here)."""
    import torch.distributed as dist

    from spd_ds.decoding.reference import PromptError
    from spd_ds.pipe.runner import SPDSession
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(tiny_root, "qwen3", 6)
    monkeypatch.setenv("WORLD_SIZE", "5")
    cfg = load_config(None, [f"model.name={path}", "partition.num_stages=2", "head.placement=dedicated"])
    with pytest.raises(WorldSizeError, match="world size 5 does not fit partition.num_stages=2"):
        SPDSession(cfg, prompts=[[1, 2, 3]])
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config(None, [f"model.name={path}", "partition.num_stages=2", "head.placement=dedicated",
                             "decoding.max_length=64"])
    with pytest.raises(PromptError, match="exceeds the context of 64 positions"):
        SPDSession(cfg, prompts=[list(range(60))], max_new_tokens=10)
    assert not (dist.is_available() and dist.is_initialized())


def test_head_rank_prompt_check_names_the_model_maximum():
    """The head rank checks each prompt it is given (also after the session was built) with the same message as the
    single-process decoders: at the target's own maximum context it does not say to raise decoding.max_length."""
    from types import SimpleNamespace

    from spd_ds.decoding.reference import PromptError
    from spd_ds.pipe.head_rank import HeadDriver

    def load(max_len, model_max):
        rank = SimpleNamespace(n=2, max_len=max_len, model_max=model_max, model_max_source="max_position_embeddings",
                               eos=frozenset({0}), stop=None)
        driver = HeadDriver(rank)
        driver.request(list(range(1, 61)), 10, None, driver.sampling)
        driver.load_prompt()

    with pytest.raises(PromptError, match="exceeds the model's maximum context of 64 positions") as e:
        load(64, 64)
    assert "decoding.max_length" not in str(e.value)
    with pytest.raises(PromptError, match="raise decoding.max_length"):
        load(64, 4096)


@pytest.mark.parametrize("head_model,target_model,match", [
    (("qwen3", 0), ("qwen3", 1), "trained for another base model"),
    (("qwen3_5_text", 0), ("qwen3", 0), "trained for a qwen3_5_text target but .* is qwen3;"),  # Qwen3.5 head, Qwen3
    (("qwen3", 0), ("qwen3_5_text", 0), "trained for a qwen3 target but .* is qwen3_5_text;"),  # and the reverse
])
def test_head_checkpoint_of_another_model_fails_before_any_collective(tiny_root, tmp_path, monkeypatch, head_model,
                                                                      target_model, match):
    import torch.distributed as dist

    from spd_ds.head import HeadMismatchError, SpeculationHead
    from spd_ds.models.adapter import TargetArch
    from spd_ds.pipe.runner import SPDSession
    from tests.tiny_models import make_tiny_model

    a = make_tiny_model(tiny_root, head_model[0], 6, seed=head_model[1])
    b = make_tiny_model(tiny_root, target_model[0], 6, seed=target_model[1])
    arch_a = TargetArch(a)
    SpeculationHead(arch_a, StagePartition.build(6, 2)).save(tmp_path / "head_a")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, [f"model.name={b}", "partition.num_stages=2", f"head.checkpoint={tmp_path / 'head_a'}"])
    with pytest.raises(HeadMismatchError, match=match) as e:
        SPDSession(cfg)
    assert "\n" not in str(e.value)  # one line
    assert not (dist.is_available() and dist.is_initialized())


@pytest.mark.parametrize("head_family,match", [
    ("llama", "trained for a llama target but .* is qwen3; use a head trained for"),
    ("qwen3", "trained for another base model"),
])
def test_head_of_a_target_of_another_depth_names_the_model_not_the_partition(tiny_root, tmp_path, monkeypatch,
                                                                             head_family, match):
    """A head whose target has another number of layers: no partition setting fits it, so the message is the
    base-model check's (it used to suggest partition.num_stages, which the config already had)."""
    import torch.distributed as dist

    from spd_ds.head import SpeculationHead
    from spd_ds.models.adapter import TargetArch
    from spd_ds.pipe.runner import SPDSession
    from tests.tiny_models import make_tiny_model

    a = make_tiny_model(tiny_root, head_family, 8)
    b = make_tiny_model(tiny_root, "qwen3", 6)
    SpeculationHead(TargetArch(a), StagePartition.build(8, 2)).save(tmp_path / "head_a")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, [f"model.name={b}", "partition.num_stages=2", f"head.checkpoint={tmp_path / 'head_a'}"])
    with pytest.raises(ConfigError, match=match) as e:
        SPDSession(cfg)
    assert "partition.num_stages" not in str(e.value) and "\n" not in str(e.value)
    assert not (dist.is_available() and dist.is_initialized())
