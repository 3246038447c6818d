"""Process-group start, shared by every launcher (infer, eval, benchmark, train): ``torch.distributed`` through
``deepspeed.init_distributed``, a local rendezvous for a plain single-process run, and, on CPU, collectives without
DeepSpeed's shared-memory kernel. Knows nothing of pipelines, evaluation or training (they all import it from here)."""

from __future__ import annotations

import datetime
import os
import socket

import torch

from spd_ds.config import ConfigError, ExperimentConfig
from spd_ds.launch_env import launched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STARTUP_TIMEOUT_S = 600.0  # start-up collectives and group connections: ranks may reach them minutes apart


def startup_timeout_s(timeout_s: float) -> float:
    """Seconds a start-up collective or a gloo group's connection may wait: ``timeout_s``
    (``deepspeed.timeout_s``), at least :data:`STARTUP_TIMEOUT_S` (ranks may reach start-up minutes apart)."""
    return max(float(timeout_s), STARTUP_TIMEOUT_S)


def init_timeout_s(cfg: ExperimentConfig) -> float:
    """Timeout of the default process group, in seconds: start-up collectives (model loading may skew ranks by
    minutes) get :func:`startup_timeout_s`; SPD's own waits use ``deepspeed.timeout_s`` explicitly."""
    return startup_timeout_s(cfg.deepspeed.timeout_s)


def init_process_group(backend: str | None, timeout_s: float) -> bool:
    """Initialise ``torch.distributed`` through ``deepspeed.init_distributed`` (every spd-ds launcher goes through
    here: infer, eval, benchmark, train). A process group the caller started is wrapped by DeepSpeed, not replaced.

    A plain single-process run (no launcher variables) gets a local rendezvous on a free port. On the CPU
    accelerator the collectives are gloo's: DeepSpeed's shared-memory all-reduce kernel is not loaded
    (:func:`_without_cpu_shm_kernel`).

    Args:
        backend: ``deepspeed.backend`` (None = the accelerator's default: NCCL on GPU, gloo on CPU).
        timeout_s: timeout of the default process group in seconds.
    Returns:
        Whether this call initialised it.
    Raises:
        ConfigError: ``nccl`` without a visible CUDA device (raised on every rank before any collective); the
            rendezvous port (``MASTER_PORT``) taken by another process (on the rank that serves it).
    """
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if str(backend).lower() == "nccl" and not torch.cuda.is_available():  # every rank, before any collective; any case
        raise ConfigError("deepspeed.backend=nccl needs CUDA GPUs and none is visible; use deepspeed.backend=gloo "
                          "on CPU (or leave it unset)")
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_available() and dist.is_initialized() and ds_comm.is_initialized():
        return False
    if get_accelerator().device_name() == "cpu":
        _without_cpu_shm_kernel()
    if dist.is_available() and dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)  # wraps the caller's group
        created = False
    else:
        if not launched():  # python launch/infer.py ... --engine deepspeed
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        port = int(os.environ.get("MASTER_PORT", "29500"))  # MPI discovery would otherwise force 29500
        try:
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=True, verbose=False,
                                       distributed_port=port, timeout=timeout)
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            raise ConfigError(f"the rendezvous port {port} of {os.environ.get('MASTER_ADDR', 'this host')} is in "
                              "use (another run?); pass a free one to the launcher: deepspeed --master_port "
                              "<port> ...") from None
        created = True
    return created


def _without_cpu_shm_kernel() -> None:
    """Keep DeepSpeed's CPU shared-memory all-reduce kernel (``deepspeed_shm_comm``) out of this process, so that its
    collectives fall back to the process group's (gloo). DeepSpeed builds that kernel with ``torch.utils.cpp_extension``
    when it starts its communication backend, under a lock file in the extensions folder; a process killed while it
    holds the lock (a rank stopped at start-up, a Ctrl-C during the first build) left the file behind, and every later
    start on the machine waited for it forever, silently. The kernel also mapped a 69 MB ``/dev/shm`` workspace per
    rank that DeepSpeed never unlinks. On CPU (tests and development; the GPU path uses NCCL) it buys nothing
    measurable: the pipeline's traffic is point-to-point, and DeepSpeed's own fallback is the process group's
    all-reduce. DeepSpeed loads the kernel only where ``deepspeed.ops.__compatible_ops__`` marks the accelerator's
    ``ShareMemCommBuilder`` op compatible (``deepspeed.comm.torch.build_shm_op``); that mark is set False here, under
    the builder's own name, before the backend starts."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:  # None: this accelerator has no such kernel
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
