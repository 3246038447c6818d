"""Worker program of the multi-process pipe tests (launched by ``deepspeed``/``torchrun``/``mpirun`` from
``tests/test_pipe_*.py``; it holds no tests itself).

``python tests/test_pipe_worker.py JOBS.json OUT.json``: every rank runs the jobs in order (all jobs of one launch
share the world size); the head rank writes, per job, the distributed SPD tokens and metrics, the distributed AR
tokens when asked, and the single-process reference decoder's and AR decoder's tokens computed in the same process
afterwards (same threads, same kernels). A job may inject a fault into one stage rank (kill or stall at its k-th
forward) to test failure handling.

Job fields: ``name``, ``model`` (tiny-model spec ``{"type", "layers"}`` or ``"smollm2"``), ``overrides``
(``section.key=value``), ``prompts``, ``max_new_tokens``, ``drafter`` (``config`` | ``oracle_head``: the oracle with
the head as base drafter, as in the reference tests), ``alpha``, ``eos_at`` (use the single-process AR token at this
index as EOS), ``ar`` (also run AR through the pipeline), ``reference`` (compute the reference decoder),
``fault`` (``{"rank", "after", "kind": "kill"|"stall"}``), ``device`` (``cpu``, default, fp32 | ``cuda``: bf16 on each
rank's GPU; set ``reference`` false then, the single-process decoders run on CPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # on PYTHONPATH of every worker (worker_env)

import torch  # noqa: E402

torch.set_num_threads(1)


def model_dir(spec, root: Path) -> str:
    if spec == "smollm2":
        from spd_ds.zoo import resolve_model

        return str(resolve_model("smollm2-135m-instruct"))
    if "path" in spec:  # a model folder the test made itself
        return spec["path"]
    from tests.tiny_models import make_tiny_model

    return str(make_tiny_model(root, spec.get("type", "qwen3"), spec.get("layers", 6), seed=spec.get("seed", 0)))


def single_process_ar(cfg, prompt, max_new):
    from spd_ds.builder import build_arch, build_partition, build_target, eos_token_ids, sampling_params
    from spd_ds.decoding.ar import ARDecoder

    arch = build_arch(cfg)
    target = build_target(cfg, arch, build_partition(cfg, arch), "cpu")
    dec = ARDecoder(target, sampling_params(cfg), eos_token_ids(cfg, arch), cfg.decoding.max_length)
    return dec.generate(prompt, max_new).tokens


def oracle_head_factory(cfg, alpha: float | None, static: bool = False):
    """Drafters for the engine: the head (``static``: GraphedHeadDrafter's static computation, eagerly; else
    HeadDrafter), under the oracle when ``alpha`` is not None."""
    from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter
    from spd_ds.decoding.head_graph import GraphedHeadDrafter
    from spd_ds.models.adapter import resolve_dtype

    def make(head, prompt, ar_reference):
        kind = GraphedHeadDrafter if static else HeadDrafter
        extra = {"use_graph": False} if static else {}
        base = kind(head, cfg.decoding.max_length, resolve_dtype(cfg.model.dtype), "cpu", **extra)
        if alpha is None:
            return base
        return OracleDrafter(ar_reference(), alpha, base=base, seed=cfg.decoding.seed + 11)

    return make


def reference_tokens(cfg, job, prompts, max_new):
    """The single-process reference decoder (and AR decoder) on the same config."""
    from spd_ds.builder import build_arch, build_drafter, build_head, build_partition, build_target, eos_token_ids, \
        sampling_params
    from spd_ds.decoding.ar import ARDecoder
    from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter, oracle_reference
    from spd_ds.decoding.reference import SPDReferenceDecoder

    arch = build_arch(cfg)
    part = build_partition(cfg, arch)
    target = build_target(cfg, arch, part, "cpu")
    head = build_head(cfg, arch, part)
    eos = eos_token_ids(cfg, arch)
    out = {"reference": [], "ar_single": [], "reference_metrics": []}
    ar_dec = ARDecoder(target, sampling_params(cfg), eos, cfg.decoding.max_length)
    for i, p in enumerate(prompts):  # prompt i is request i, as in the engine (its sampling key at T > 0)
        sampling = sampling_params(cfg, request=i)
        ar_dec.sampling = sampling
        ar = ar_dec.generate(p, max_new).tokens
        # an oracle's reference as the product makes it (greedy whatever the sampling: oracle_reference)
        oracle = job.get("drafter") == "oracle_head" or cfg.decoding.drafter == "oracle"
        reference = oracle_reference(target, p, max_new, sampling, eos, cfg.decoding.max_length) if oracle else None
        if job.get("drafter") == "oracle_head":
            base = HeadDrafter(head, cfg.decoding.max_length, torch.float32, "cpu")
            drafter = OracleDrafter(reference, job.get("alpha", 1.0), base=base, seed=cfg.decoding.seed + 11)
        elif cfg.decoding.drafter == "oracle":
            drafter = build_drafter(cfg, None, arch, "cpu", reference=reference)
        else:
            drafter = HeadDrafter(head, cfg.decoding.max_length, torch.float32, "cpu")
        res = SPDReferenceDecoder(target, drafter, sampling, eos, cfg.decoding.max_length).generate(p, max_new)
        out["reference"].append(res.tokens)
        out["reference_metrics"].append(
            {k: res.metrics.to_dict()[k] for k in ("num_cycles", "num_drafts", "num_accepted_tokens", "num_rollbacks")})
        out["ar_single"].append(ar)
    return out


def engine_info(engine) -> dict:
    mod = engine.module
    return {"class": type(engine).__name__, "bases": [c.__name__ for c in type(engine).__mro__],
            "module_class": type(mod).__name__, "module_bases": [c.__name__ for c in type(mod).__mro__],
            "parts": list(mod.parts), "local_layers": {str(s): st.layer_ids for s, st in mod.target_stages.items()},
            "instructions": sorted(c.__name__ for c in engine._INSTRUCTION_MAP)}


def install_fault(fault) -> None:
    """Kill or stall this rank at its ``after``-th stage forward (a test of failure handling)."""
    import signal

    from spd_ds.pipe.engine import SPDPipelineEngine

    original = SPDPipelineEngine._exec_stage_forward
    count = {"n": 0}

    def faulty(self, stage):
        count["n"] += 1
        if count["n"] == fault["after"]:
            print(f"SPD-FAULT t={time.time():.3f}", flush=True)
            if fault["kind"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10_000)
        return original(self, stage)

    SPDPipelineEngine._exec_stage_forward = faulty
    SPDPipelineEngine._INSTRUCTION_MAP = dict(SPDPipelineEngine._INSTRUCTION_MAP)
    from spd_ds.pipe import schedule as sch

    SPDPipelineEngine._INSTRUCTION_MAP[sch.StageForward] = faulty


def run_job(job, tiny_root: Path) -> dict | None:
    from spd_ds.config import load_config
    from spd_ds.pipe.runner import SPDSession

    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    device = job.get("device", "cpu")  # "cuda": every rank on its local GPU, NCCL, bf16 (no CPU reference then)
    overrides = [f"model.name={model_dir(job['model'], tiny_root)}",
                 "model.dtype=float32" if device == "cpu" else "model.dtype=bfloat16", f"model.device={device}",
                 "decoding.max_length=256"] + list(job.get("overrides", []))
    cfg = load_config(None, overrides)
    prompts, max_new = job["prompts"], job["max_new_tokens"]
    eos_index = None
    if "eos_at" in job:  # an EOS that is accepted while later drafts are still in flight: the first token at or
        ar = single_process_ar(cfg, prompts[0], max_new)  # after eos_at that did not occur before
        eos_index = next(i for i in range(job["eos_at"], len(ar)) if ar[i] not in ar[:i])
        vocab = json.loads((Path(cfg.model.name) / "config.json").read_text())["vocab_size"]
        unused = next(t for t in range(vocab - 1, -1, -1) if t not in ar)  # a second EOS id that never comes
        cfg.decoding.eos_token_ids = [ar[eos_index], unused]
    if job.get("fault") and job["fault"]["rank"] == rank:
        install_fault(job["fault"])
    static = job.get("head_drafter") == "static"
    factory = None
    if job.get("drafter") == "oracle_head":
        factory = oracle_head_factory(cfg, job.get("alpha", 1.0), static)
    elif static:
        factory = oracle_head_factory(cfg, None, static)
    t0 = time.time()
    session = SPDSession(cfg, factory, prompts, max_new)
    t_setup = time.time() - t0
    try:
        if not session.is_head:
            session.serve()
            session.close(destroy_process_group=False)
            return None
        res = {"name": job["name"], "spd": [], "metrics": [], "ar": [], "setup_s": t_setup, "eos_index": eos_index,
               "finish": [], "engine": engine_info(session.engine)}
        t1 = time.time()
        for i, p in enumerate(prompts):
            r = session.generate(p, max_new, request=i)
            res["spd"].append(r.tokens)
            res["finish"].append(r.finish_reason)
            res["metrics"].append(r.metrics.to_dict())
            if job.get("ar"):
                res["ar"].append(session.generate_ar(p, max_new, request=i).tokens)
        res["run_s"] = time.time() - t1
        session.shutdown()
        session.close(destroy_process_group=False)
    except BaseException:
        session.abort()
        session.close(destroy_process_group=False)
        raise
    if job.get("reference", True):
        res.update(reference_tokens(cfg, job, prompts, max_new))
    return res


# ---------------------------------------------------------------------------------------- launching (pytest side)
WORKER = Path(__file__).resolve()


def free_port() -> int:
    """A free TCP port for a rendezvous, below the kernel's ephemeral range (32768-60999 on Linux) so that no
    socket the system numbers itself (gloo's, another launcher's) can take it between this check and the bind, and
    from a block of its own for each pytest-xdist worker (gw0: 20000-22999, gw1: 23000-25999, ...)."""
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    lo = 20000 + 3000 * (index % 4)
    for port in random.Random().sample(range(lo, lo + 3000), 3000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}-{lo + 2999}")


def worker_env(**extra) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(cmd_prefix: list[str], jobs: dict, tmp: Path, timeout: float, env: dict | None = None):
    """Run the worker under a launcher (``cmd_prefix`` + worker + files); returns (results, returncode, log)."""
    import subprocess

    jobs_file, out_file, log_file = tmp / "jobs.json", tmp / "out.json", tmp / "log.txt"
    jobs_file.write_text(json.dumps(jobs))
    with open(log_file, "w") as log:
        proc = subprocess.run(cmd_prefix + [str(WORKER), str(jobs_file), str(out_file)], cwd=ROOT,
                              env=env or worker_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    results = json.loads(out_file.read_text())["results"] if out_file.exists() else []
    return {r["name"]: r for r in results}, proc.returncode, log_file.read_text()


def deepspeed_cmd(num_procs: int) -> list[str]:
    return ["deepspeed", "--num_gpus", str(num_procs), "--master_port", str(free_port())]


def spawn_start(world: int, jobs: dict, tmp: Path) -> list:
    """Start ``world`` worker processes directly: the environment a launcher sets, but no launcher that kills the
    others when one dies. Output goes to ``tmp/rank<r>.log``. Returns the ``Popen`` objects."""
    import subprocess

    jobs_file, out_file = tmp / "jobs.json", tmp / "out.json"
    jobs_file.write_text(json.dumps(jobs))
    port = free_port()
    procs = []
    for r in range(world):
        env = worker_env(RANK=r, WORLD_SIZE=world, LOCAL_RANK=r, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=port)
        with open(tmp / f"rank{r}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(jobs_file), str(out_file)], cwd=ROOT,
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def spawn_wait(procs: list, tmp: Path, timeout: float) -> list:
    """Wait for :func:`spawn_start`'s processes; [(returncode, output)] per rank (``None``: killed at ``timeout``)."""
    import subprocess

    t0 = time.time()
    out = []
    for r, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
        out.append((rc, (tmp / f"rank{r}.log").read_text()))
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    jobs = json.loads(Path(args[0]).read_text())
    out_path = Path(args[1])
    tiny_root = Path(jobs.get("tiny_root", "/tmp/spd_tiny"))
    results = []
    import torch.distributed as dist

    try:
        for job in jobs["jobs"]:
            r = run_job(job, tiny_root)
            if r is not None:
                results.append(r)
                out_path.write_text(json.dumps({"results": results}))
    except Exception as e:  # noqa: BLE001 - report the error line for the test, then fail
        # Every rank writes its own file, first: a launcher kills the other ranks as soon as one exits, so the
        # rank that raises first may be the only one whose error is on disk.
        out_path.with_suffix(f".rank{os.environ.get('RANK', '0')}.error").write_text(f"{type(e).__name__}: {e}")
        print(f"SPD-ERROR t={time.time():.3f}", flush=True)
        traceback.print_exc()
        sys.exit(3)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
