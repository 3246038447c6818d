"""``spd_ds.pipe.comm.Link`` between two gloo processes: in-order delivery, and send bookkeeping that stays bounded
(a gloo send never reports completion before ``wait()``, so a scan of every pending send would grow each cycle);
``spd_ds.dist.init_process_group`` with a process group the caller started, its backend check, and a start on CPU that
does not load DeepSpeed's shared-memory kernel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_pipe_worker import free_port


def _worker(rank: int, port: int, n: int, out) -> None:
    from spd_ds.pipe.comm import MAX_HOST_PENDING, Link

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        peer = 1 - rank
        link = Link(rank, peer, f"rank {rank}", f"rank {peer}", dist.group.WORLD, dist.group.WORLD, 30.0, "cpu")
        if rank == 0:
            most = 0
            for i in range(n):
                link.send(3, seq=i, pos=i, q=1, payload=torch.full((4,), float(i)))
                most = max(most, len(link._pending_host))
            link.flush()
            out.put(("sender", most, MAX_HOST_PENDING, len(link._pending_host)))
        else:
            got = []
            for _ in range(n):
                hdr = link.recv_header()
                x = link.recv_payload(torch.empty(4))
                got.append((hdr.seq, hdr.pos, float(x[0])))
            out.put(("receiver", got))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_two(target, *args, timeout: float = 180.0) -> list:
    """Run ``target(rank, port, *args, out)`` in two spawned processes; the two items they put on ``out``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=timeout) for _ in range(2)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_link_delivers_in_order_and_keeps_pending_sends_bounded():
    n = 200
    results = dict((r[0], r[1:]) for r in _run_two(_worker, n))
    (got,) = results["receiver"]
    assert got == [(i, i, float(i)) for i in range(n)]
    most, bound, left = results["sender"]
    assert most <= bound + 2 and left == 0  # header + payload per message, retired once 16 newer exist



def _init_worker(rank: int, port: int, out) -> None:
    """The caller started torch.distributed itself: init_process_group lets DeepSpeed wrap it (deepspeed.comm
    usable, as train() needs) and reports that it did not create it."""
    import deepspeed.comm as ds_comm

    from spd_ds.dist import init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        created = init_process_group(None, 60.0)
        again = init_process_group(None, 60.0)
        out.put((rank, created, again, ds_comm.is_initialized(), ds_comm.get_rank(), ds_comm.get_world_size(),
                 ds_comm.comm.cdb.shm_comm_op is None, port))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_init_process_group_wraps_a_group_the_caller_started():
    got = sorted(_run_two(_init_worker))
    # DeepSpeed's CPU shared-memory kernel stays unloaded (spd_ds.dist._without_cpu_shm_kernel), so no
    # /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> workspace (69 MB, never unlinked) is made
    assert [g[:-1] for g in got] == [(0, False, False, True, 0, 2, True), (1, False, False, True, 1, 2, True)]
    port = got[0][-1]
    left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    assert not left, left


def test_a_stale_extension_lock_does_not_hold_up_the_start(tmp_path):
    """A process killed while DeepSpeed JIT-built its CPU shared-memory kernel left ``<extensions>/deepspeed_shm_comm/
    lock`` behind, and every later start on the machine waited on it forever without a word (seen as a CI run that
    hung in ``FileBaton.wait``). The kernel is no longer loaded on CPU: a start with that lock present completes."""
    import subprocess
    import sys

    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").write_text("")
    code = ("import deepspeed.comm.comm as c\nfrom spd_ds.dist import init_process_group\n"
            "print(init_process_group('gloo', 30.0), c.cdb.shm_comm_op is None)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "True True", (r.stdout, r.stderr[-2000:])


def test_nccl_without_cuda_is_a_one_line_error_before_any_collective(monkeypatch):
    import torch.distributed as tdist

    from spd_ds.config import ConfigError
    from spd_ds.dist import init_process_group

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("nccl", "NCCL"):  # torch takes the name in any case
        with pytest.raises(ConfigError, match="deepspeed.backend=gloo"):
            init_process_group(name, 10.0)
    assert not tdist.is_initialized()


def test_a_busy_rendezvous_port_is_a_one_line_error_that_names_master_port():
    """Another process holds MASTER_PORT (another run on the machine): the rank that serves the rendezvous says so
    and how to choose another port (it was a 14-frame DistNetworkError traceback in a one-rank run)."""
    import socket
    import subprocess
    import sys

    code = ("from spd_ds.config import ConfigError\nfrom spd_ds.dist import init_process_group\n"
            "try:\n    init_process_group('gloo', 30.0)\nexcept ConfigError as e:\n    print(e)\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == (
        f"the rendezvous port {port} of 127.0.0.1 is in use (another run?); pass a free one to the launcher: "
        "deepspeed --master_port <port> ..."), (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_gloo_link_groups_connect_with_the_startup_timeout(monkeypatch, backend):
    """Gloo connects every pair of ranks when a group is made, within the group's timeout: with the groups made at
    deepspeed.timeout_s, deepspeed.timeout_s=0.3 failed every 2-rank CPU run at set-up ("Gloo connectFullMesh
    failed ... Connect timeout", exit 1) since the ranks reach PipeLinks a moment apart. The gloo groups get the
    start-up timeout (each wait passes deepspeed.timeout_s itself); an NCCL group keeps deepspeed.timeout_s."""
    import datetime

    from spd_ds.dist import STARTUP_TIMEOUT_S
    from spd_ds.partition import StagePartition
    from spd_ds.pipe import links as links_mod
    from spd_ds.pipe.topology import PipePlan

    made = []
    monkeypatch.setattr(links_mod.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(links_mod.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(links_mod.dist, "new_group", lambda **kw: made.append(kw) or f"group{len(made)}")
    monkeypatch.setattr(links_mod, "Link", lambda *a: a)
    plan = PipePlan.build(StagePartition.build(4, 2), "colocated", 2)
    links_mod.PipeLinks(plan, 1, 1, lambda p: p, lambda: "down", 0.3, torch.device("cpu"))
    startup, own = datetime.timedelta(seconds=STARTUP_TIMEOUT_S), datetime.timedelta(seconds=0.3)
    up, ctrl = made
    assert ctrl["backend"] == "gloo" and ctrl["timeout"] == startup
    assert up["timeout"] == (startup if backend == "gloo" else own)
