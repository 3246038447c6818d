"""Multi-node launch path on one machine: ``deepspeed --hostfile`` with the openmpi launcher and mpi4py.

Needs ``apt-get install -y libopenmpi-dev openmpi-bin`` and ``pip install mpi4py`` (CI installs them); skipped
without them. The ranks learn rank/world/master from MPI (DeepSpeed's ``mpi_discovery``), exactly as on several
nodes; only the hostfile lists ``localhost``.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from tests.test_pipe_worker import free_port, launch, worker_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpirun") is None or shutil.which("ompi_info") is None
                       or importlib.util.find_spec("mpi4py") is None,
                       reason="needs openmpi (libopenmpi-dev openmpi-bin) and mpi4py"),
]


def test_hostfile_openmpi_launch_equals_reference(tmp_path, tiny_root):
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tiny_root, "qwen3", 6)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = ["deepspeed", "--hostfile", str(hostfile), "--launcher", "openmpi", "--no_ssh_check",
           "--master_addr", "127.0.0.1", "--force_multi",
           "--launcher_args=--allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo"]
    job = {"name": "mpi_colo2", "model": {"type": "qwen3", "layers": 6}, "prompts": [[3, 14, 15, 92, 65]],
           "max_new_tokens": 20, "drafter": "oracle_head", "alpha": 0.7,
           "overrides": ["partition.num_stages=2", "head.placement=colocated", "deepspeed.timeout_s=60"]}
    env = worker_env(MASTER_PORT=free_port())
    results, rc, log = launch(cmd, {"tiny_root": str(tiny_root), "jobs": [job]}, tmp_path, timeout=300, env=env)
    assert rc == 0, log[-4000:]
    assert "mpirun" in log  # really launched through MPI
    r = results["mpi_colo2"]
    assert r["spd"] == r["reference"] and r["metrics"][0]["num_accepted_tokens"] > 0
