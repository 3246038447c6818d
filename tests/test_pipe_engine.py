"""Distributed SPD through DeepSpeed's pipeline engine equals the reference decoder (several gloo processes).

Each world size is one ``deepspeed --num_gpus N`` launch running several jobs (tests/test_pipe_worker.py); the
head rank also runs the single-process reference and AR decoders on the same config after the distributed run.
Matrix: n = 1, 2, 3 stages; co-located and dedicated head; T = 0 and T > 0; the untrained head (every draft
rejected: rollbacks) and the oracle over the head (accepts and rollbacks); an EOS accepted while drafts are in
flight; static KV caches (the GPU path, eager on CPU); SmolLM2-135M-Instruct; a one-process run. Hybrid Qwen3.5
targets (dense and MoE, linear-attention states rolled back by the stage caches) at n = 2, 3, 4 in both placements,
greedy (equal to transformers' ``generate``) and at T > 0 (equal to the reference decoder), eager and static caches.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.test_pipe_worker import deepspeed_cmd, free_port, launch, worker_env

pytestmark = pytest.mark.slow

TINY = {"type": "qwen3", "layers": 6}
P1, P2 = [3, 14, 15, 92, 65], [7, 8, 9]
T1 = ["decoding.temperature=0.35", "decoding.top_k=20", "decoding.top_p=0.95", "decoding.seed=5"]
# the oracle's drafts are the target's greedy tokens (drafters.oracle_reference): at a low temperature speculative
# sampling accepts many of them, so the accept path runs at T > 0 too (the coin's failures still roll back)
T_ORACLE = ["decoding.temperature=0.1", "decoding.top_k=20", "decoding.top_p=0.95", "decoding.seed=5"]


Q35 = {"type": "qwen3_5_text", "layers": 8}
Q35M = {"type": "qwen3_5_moe_text", "layers": 8}


def job(name, n, placement, prompts=(P1,), max_new=20, overrides=(), model=TINY, **kw):
    return dict(name=name, model=model, prompts=list(prompts), max_new_tokens=max_new,
                overrides=[f"partition.num_stages={n}", f"head.placement={placement}", "deepspeed.timeout_s=60",
                           *overrides], **kw)


def hybrid_jobs(specs):
    """Qwen3.5 jobs ``(name, n, placement, model, kind)``: kind ``greedy`` = oracle over the head at alpha 0.6 with AR
    through the pipe; ``T1`` = sampling; ``static`` = greedy on the static-cache path."""
    out = []
    for name, n, placement, model, kind in specs:
        if kind == "T1":
            out.append(job(name, n, placement, max_new=24, overrides=T1, drafter="oracle_head", alpha=0.8, model=model))
        else:
            ov = ["deepspeed.static_cache=true"] if kind == "static" else []
            out.append(job(name, n, placement, max_new=24, drafter="oracle_head", alpha=0.6, ar=True, model=model,
                           overrides=ov))
    return out


def hf_greedy(tiny_root, spec, prompt, max_new):
    """transformers' own greedy ``generate`` of the tiny model ``spec``."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(tiny_root, spec["type"], spec["layers"], seed=spec.get("seed", 0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0, len(prompt):].tolist()


def check_hybrid(res, tiny_root, names):
    """Greedy Qwen3.5 jobs equal the reference decoder, AR through the pipe and transformers' generate; sampled ones
    equal the reference decoder (same seed)."""
    for name in names:
        r = res[name]
        greedy = "T1" not in name
        check(r, accepts=greedy, greedy=greedy)  # T > 0: the oracle proposes greedy tokens, not always accepted
        if greedy:
            spec = Q35M if name.startswith("q35m") else Q35
            assert r["spd"][0] == hf_greedy(tiny_root, spec, P1, 24), name


def check(res, *, rollbacks=True, accepts=False, greedy=True, cycles=True):
    """SPD tokens and counters equal the reference decoder's; AR through the pipe equals the AR decoder's."""
    assert res["spd"] == res["reference"], res["name"]
    for m, ref in zip(res["metrics"], res["reference_metrics"]):
        assert {k: m[k] for k in ref} == ref, res["name"]
    if res["ar"]:
        assert res["ar"] == res["ar_single"], res["name"]
        if greedy:
            assert res["spd"] == res["ar"], res["name"]
    if rollbacks:
        assert sum(m["num_rollbacks"] for m in res["metrics"]) > 0, res["name"]
    if accepts:
        assert sum(m["num_accepted_tokens"] for m in res["metrics"]) > 0, res["name"]
    for m in res["metrics"]:
        assert len(m["stage_forward_s"]) == len(m["drafts_by_fill"]) - 1
        if cycles:
            assert m["decode_s"] > 0 and all(t > 0 for t in m["stage_forward_s"]) and m["decode_tok_s"] > 0


def run_world(tmp_path, tiny_root, world, jobs, timeout=600, cmd=None):
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tiny_root, "qwen3", 6)  # created here: ranks must not race to write them
    for j in jobs:
        if isinstance(j.get("model"), dict):
            make_tiny_model(tiny_root, j["model"]["type"], j["model"]["layers"], seed=j["model"].get("seed", 0))
    cmd = cmd or (deepspeed_cmd(world) if world > 1 else [sys.executable])
    results, rc, log = launch(cmd, {"tiny_root": str(tiny_root), "jobs": jobs}, tmp_path, timeout)
    assert rc == 0, log[-4000:]
    assert set(results) == {j["name"] for j in jobs}, log[-4000:]
    return results


# Qwen3.5 (dense Q35, MoE Q35M): n = 2, 3, 4 co-located, n = 2, 3 dedicated, greedy / T > 0 / static caches
HYBRID_W2 = [("q35_colo2", 2, "colocated", Q35, "greedy"), ("q35m_colo2", 2, "colocated", Q35M, "greedy"),
             ("q35_colo2_static", 2, "colocated", Q35, "static"), ("q35_colo2_T1", 2, "colocated", Q35, "T1")]
HYBRID_W3 = [("q35_colo3", 3, "colocated", Q35, "greedy"), ("q35m_colo3", 3, "colocated", Q35M, "greedy"),
             ("q35_ded2", 2, "dedicated", Q35, "greedy"), ("q35m_ded2", 2, "dedicated", Q35M, "greedy"),
             ("q35m_ded2_T1", 2, "dedicated", Q35M, "T1")]
HYBRID_W4 = [("q35_colo4", 4, "colocated", Q35, "greedy"), ("q35m_colo4", 4, "colocated", Q35M, "greedy"),
             ("q35m_ded3_static", 3, "dedicated", Q35M, "static"), ("q35_ded3_T1", 3, "dedicated", Q35, "T1")]


@pytest.fixture(scope="module")
def world2(tmp_path_factory, tiny_root):
    jobs = [
        job("colo2_head", 2, "colocated", prompts=(P1, P2), ar=True),
        job("colo2_oracle", 2, "colocated", drafter="oracle_head", alpha=0.7),
        job("colo2_T1", 2, "colocated", prompts=(P1, P2), max_new=24, overrides=T1, drafter="oracle_head", alpha=0.8,
            ar=True),  # two requests: the second's uniforms are keyed by request 1 in both decoders
        job("colo2_eos", 2, "colocated", prompts=(P2,), max_new=25, eos_at=8,
            overrides=["decoding.drafter=oracle", "decoding.oracle_alpha=1.0"]),
        job("colo2_static", 2, "colocated", drafter="oracle_head", alpha=0.6, ar=True,
            overrides=["deepspeed.static_cache=true", "head.overlap=false"]),
        job("colo2_eos_replacement", 2, "colocated", prompts=(P2,), max_new=25, eos_at=4,
            overrides=["decoding.drafter=oracle", "decoding.oracle_alpha=0.0"]),
        job("colo2_one_token", 2, "colocated", prompts=(P1, P2), max_new=1),
        job("ded1_oracle", 1, "dedicated", drafter="oracle_head", alpha=0.6, ar=True),
        job("colo2_static_head", 2, "colocated", prompts=(P1, P2), head_drafter="static", ar=True,
            overrides=["deepspeed.static_cache=true"]),
        job("colo2_static_head_oracle", 2, "colocated", drafter="oracle_head", alpha=0.6, head_drafter="static",
            ar=True),
        job("colo2_static_head_T1", 2, "colocated", max_new=24, overrides=T_ORACLE, drafter="oracle_head", alpha=0.8,
            head_drafter="static"),
        job("colo2_bf16_static", 2, "colocated", prompts=(P1, P2), max_new=48, ar=True, reference=False,
            overrides=["model.dtype=bfloat16", "deepspeed.static_cache=true"]),
        job("colo2_bf16_static_head", 2, "colocated", prompts=(P1, P2), max_new=48, ar=True, reference=False,
            head_drafter="static", overrides=["model.dtype=bfloat16", "deepspeed.static_cache=true"]),
        *hybrid_jobs(HYBRID_W2),
    ]
    # launched as README / docs/distributed.md document a localhost hostfile: ``deepspeed --hostfile hosts
    # --no_ssh_check --master_addr 127.0.0.1`` (no ssh probe); test_localhost_hostfile_with_the_documented_flags
    # checks it. It was a launch of its own (tests/test_cli.py); world3, world4 and the other launches keep the
    # ``--num_gpus`` form.
    port = free_port()
    tmp = tmp_path_factory.mktemp("w2")
    hosts = tmp / "hosts"
    hosts.write_text("localhost slots=2\n")
    res = run_world(tmp, tiny_root, 2, jobs,
                    cmd=["deepspeed", "--hostfile", str(hosts), "--no_ssh_check", "--master_addr", "127.0.0.1",
                         "--master_port", str(port)])
    res["_master_port"] = port
    res["_log"] = (tmp / "log.txt").read_text()
    return res


@pytest.fixture(scope="module")
def world3(tmp_path_factory, tiny_root, smollm2_prompts):
    jobs = [
        job("colo3_oracle", 3, "colocated", max_new=24, drafter="oracle_head", alpha=0.7),
        job("colo3_T1", 3, "colocated", max_new=24, overrides=T_ORACLE, drafter="oracle_head", alpha=0.8),
        job("colo3_eos", 3, "colocated", prompts=(P2,), max_new=25, eos_at=8,
            overrides=["decoding.drafter=oracle", "decoding.oracle_alpha=1.0"]),
        job("ded2_head", 2, "dedicated", prompts=(P1, P2), ar=True),
        job("ded2_oracle", 2, "dedicated", max_new=24, drafter="oracle_head", alpha=0.7, ar=True),
        job("ded2_T1", 2, "dedicated", max_new=24, overrides=T_ORACLE, drafter="oracle_head", alpha=0.8),
        dict(job("smol_ded2", 2, "dedicated", prompts=smollm2_prompts[:2], max_new=20, drafter="oracle_head",
                 alpha=0.8, ar=True, overrides=["decoding.max_length=128"]), model="smollm2"),
        dict(job("smol_colo3_T1", 3, "colocated", prompts=smollm2_prompts[4:5], max_new=12,
                 overrides=["decoding.max_length=160", *T1]), model="smollm2"),
        *hybrid_jobs(HYBRID_W3),
    ]
    return run_world(tmp_path_factory.mktemp("w3"), tiny_root, 3, jobs, timeout=900)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, tiny_root):
    jobs = [
        job("ded3_oracle", 3, "dedicated", max_new=24, drafter="oracle_head", alpha=0.7, ar=True),
        job("ded3_T1", 3, "dedicated", max_new=24, overrides=T1),
        *hybrid_jobs(HYBRID_W4),
    ]
    return run_world(tmp_path_factory.mktemp("w4"), tiny_root, 4, jobs)


# ---------------------------------------------------------------------------------------------------- n = 2 / 1
def test_colocated_n2_untrained_head_rollbacks(world2):
    check(world2["colo2_head"])


def test_colocated_n2_oracle_accepts_and_rollbacks(world2):
    check(world2["colo2_oracle"], accepts=True)


def test_colocated_n2_sampling(world2):
    check(world2["colo2_T1"], accepts=True, greedy=False)


def test_colocated_n2_eos_accepted_with_drafts_in_flight(world2):
    r = world2["colo2_eos"]
    check(r, rollbacks=False)
    first = r["eos_index"]
    assert r["finish"] == ["eos"] and r["spd"][0] == r["ar_single"][0][: first + 1]
    assert r["metrics"][0]["num_rollbacks"] == 0 and first + 1 < 25  # later drafts were in flight, not returned


def test_colocated_n2_eos_as_replacement(world2):
    r = world2["colo2_eos_replacement"]  # every draft is rejected: the EOS arrives as a replacement token
    check(r)
    m = r["metrics"][0]
    assert r["finish"] == ["eos"] and m["num_accepted_tokens"] == 0 and m["num_rollbacks"] == len(r["spd"][0]) - 1


def test_max_new_tokens_one(world2):
    r = world2["colo2_one_token"]  # only the prefill token: no decode cycle, then the next prompt
    check(r, rollbacks=False, cycles=False)
    assert [len(t) for t in r["spd"]] == [1, 1] and all(m["num_cycles"] == 0 for m in r["metrics"])


def test_engine_is_deepspeed_pipeline_engine(world2):
    info = world2["colo2_head"]["engine"]
    assert info["class"] == "SPDPipelineEngine" and "PipelineEngine" in info["bases"]
    assert info["module_class"] == "SPDPipelineModule" and "PipelineModule" in info["module_bases"]
    assert info["parts"] == [0, 2, 3] and info["local_layers"] == {"0": [0, 1, 2]}  # head + stage 0 on pipe stage 0
    assert {"StageForward", "Verify", "Rollback", "ForwardPass"} <= set(info["instructions"])


def test_localhost_hostfile_with_the_documented_flags(world2):
    """README / docs/distributed.md: ``deepspeed --hostfile hosts --no_ssh_check --master_addr 127.0.0.1`` runs a
    localhost hostfile without ssh (the launcher otherwise probes ssh for any hostfile): world2's launch is that
    command, and its jobs equal the reference decoder (here the untrained head's, as the test had it in
    tests/test_cli.py; every other world2 job too, in the tests above)."""
    r = world2["colo2_head"]
    assert r["spd"] == r["reference"] and len(r["spd"]) == 2
    # the launcher's own record of what it started (runner.py logs ``cmd = ... --world_info=<base64 json> ...``): the
    # two slots of the hostfile on localhost. Without the hostfile (and without --num_gpus) it would have counted this
    # host's accelerator devices (one CPU device here) and warned "Unable to find hostfile"
    log = world2["_log"]
    m = re.search(r"--world_info=([A-Za-z0-9_=-]+)", log)
    assert m, log[-3000:]
    assert json.loads(base64.urlsafe_b64decode(m.group(1))) == {"localhost": [0, 1]}
    assert "Unable to find hostfile" not in log


def test_no_shared_memory_workspace_left_behind(world2):
    # DeepSpeed's CPU shared-memory all-reduce maps /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    # (69 MB) per rank and never unlinks it; spd_ds.dist.init_process_group keeps that kernel out on CPU, or every run
    # would leak world x 69 MB
    left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{world2['_master_port']}_*"))
    assert not left, left


@pytest.mark.parametrize("name", ["colo2_bf16_static", "colo2_bf16_static_head"])
def test_bf16_static_path_equals_ar_through_the_pipeline(world2, name):
    # bf16 (the GPU dtype) on the static-cache path, rejected drafts of the untrained head at every cycle: the target's
    # arithmetic must not depend on the drafts, so SPD gives the tokens of AR through the same pipeline bit for bit
    r = world2[name]
    assert r["spd"] == r["ar"] and sum(m["num_rollbacks"] for m in r["metrics"]) > 0


@pytest.mark.parametrize("world", [
    pytest.param(1, marks=pytest.mark.skipif(torch.cuda.device_count() < 1,
                                             reason="needs a GPU (run on the GPU machine)")),
    pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                             reason="needs 2 GPUs (run on the GPU machine)")),
])
def test_cuda_engine_equals_ar_through_the_same_pipeline(tmp_path, tiny_root, world):
    """On 2 GPUs (NCCL, bf16, static caches and CUDA-graph stages by default), and on one (both stages' graphs and the
    head in one process, the head on its own stream): greedy SPD with the eager head, with the CUDA-graph head
    (overlapping stage 0 or after it), and with oracle drafts gives the tokens of AR through the same pipeline (same
    graphed stages, same kernels), with rollbacks. Random tiny weights put many near-ties in the way, so a target
    computation that depends on the drafts shows here."""
    jobs = [job(f"cuda_{name}", 2, "colocated", prompts=(P1, P2), max_new=64, ar=True, device="cuda",
                reference=False, overrides=ov)
            for name, ov in [("eager_head", ["head.cuda_graph=false"]), ("graph_head", ["head.cuda_graph=true"]),
                             ("graph_head_serial", ["head.cuda_graph=true", "head.overlap=false"]),
                             ("oracle", ["decoding.drafter=oracle", "decoding.oracle_alpha=0.6"])]]
    # at T > 0 the keyed draws make the run a function of the drafts: the graphed head beside stage 0 and after it
    # must draw the same tokens (distribution-exactness itself is the chi-square test of the CPU engine path)
    jobs += [job(f"cuda_{name}_T1", 2, "colocated", prompts=(P1, P2), max_new=48, device="cuda", reference=False,
                 overrides=[*ov, *T1]) for name, ov in [("graph_head", ["head.cuda_graph=true"]),
                                                        ("graph_head_serial", ["head.cuda_graph=true",
                                                                               "head.overlap=false"])]]
    res = run_world(tmp_path, tiny_root, world, jobs)
    for r in (res[j["name"]] for j in jobs if j.get("ar")):
        assert r["spd"] == r["ar"], r["name"]
        assert sum(m["num_rollbacks"] for m in r["metrics"]) > 0, r["name"]
    assert res["cuda_graph_head_T1"]["spd"] == res["cuda_graph_head_serial_T1"]["spd"]


def test_colocated_n2_static_cache(world2):
    check(world2["colo2_static"], accepts=True)


def test_graphed_head_static_path_in_the_engine(world2):
    # the engine drafting with GraphedHeadDrafter's static computation (the GPU head, run eagerly) makes the same
    # drafts, cycles and rollbacks as the reference decoder with the eager HeadDrafter, and stays exact
    check(world2["colo2_static_head"])
    check(world2["colo2_static_head_oracle"], accepts=True)
    check(world2["colo2_static_head_T1"], accepts=True, greedy=False)  # T > 0: the same keyed draws


def test_dedicated_n1(world2):
    check(world2["ded1_oracle"], accepts=True)


# ---------------------------------------------------------------------------------------------------- n = 3 / 2
def test_colocated_n3_oracle(world3):
    check(world3["colo3_oracle"], accepts=True)


def test_colocated_n3_sampling(world3):
    check(world3["colo3_T1"], accepts=True, greedy=False)


def test_colocated_n3_eos_accepted_with_drafts_in_flight(world3):
    r = world3["colo3_eos"]
    check(r, rollbacks=False)
    assert r["finish"] == ["eos"] and r["spd"][0] == r["ar_single"][0][: r["eos_index"] + 1]


def test_dedicated_n2_untrained_head(world3):
    check(world3["ded2_head"])


def test_dedicated_n2_oracle(world3):
    check(world3["ded2_oracle"], accepts=True)


def test_dedicated_n2_sampling(world3):
    check(world3["ded2_T1"], accepts=True, greedy=False)


def test_smollm2_dedicated_n2_greedy(world3):
    check(world3["smol_ded2"], accepts=True)


def test_smollm2_colocated_n3_sampling_head(world3):
    check(world3["smol_colo3_T1"], greedy=False)


# ---------------------------------------------------------------------------------------------------- n = 3, 4 ranks
def test_dedicated_n3_oracle(world4):
    check(world4["ded3_oracle"], accepts=True)


def test_dedicated_n3_sampling_head(world4):
    check(world4["ded3_T1"], greedy=False)


# ---------------------------------------------------------------------------------------------------- Qwen3.5
def test_qwen3_5_two_stages_colocated(world2, tiny_root):
    check_hybrid(world2, tiny_root, [j[0] for j in HYBRID_W2])


def test_qwen3_5_three_ranks(world3, tiny_root):
    check_hybrid(world3, tiny_root, [j[0] for j in HYBRID_W3])


def test_qwen3_5_four_ranks(world4, tiny_root):
    check_hybrid(world4, tiny_root, [j[0] for j in HYBRID_W4])


# ---------------------------------------------------------------------------------------------------- one process
def test_single_process_plain_python(tmp_path, tiny_root):
    """World 1 without a launcher (``python launch/infer.py --engine deepspeed``): every stage in the head's
    process, still a DeepSpeed PipelineEngine."""
    jobs = [job("w1_colo3", 3, "colocated", drafter="oracle_head", alpha=0.6, ar=True),
            job("w1_ded2", 2, "dedicated", overrides=T1)]
    res = run_world(tmp_path, tiny_root, 1, jobs)
    check(res["w1_colo3"], accepts=True)
    check(res["w1_ded2"], greedy=False)
    assert worker_env()["OMP_NUM_THREADS"] == "1"


def test_single_process_deepspeed_launch(tmp_path, tiny_root):
    """``deepspeed launch/infer.py`` with one process (n = 1 co-located, and n = 2 in one process)."""
    jobs = [job("ds1_colo1", 1, "colocated", drafter="oracle_head", alpha=0.6),
            job("ds1_colo2", 2, "colocated")]
    res = run_world(tmp_path, tiny_root, 1, jobs, cmd=deepspeed_cmd(1))
    check(res["ds1_colo1"], accepts=True)
    check(res["ds1_colo2"])
