"""What the launcher tells a process through its environment: its rank, the world size and the processes on its node.

Read before any process group exists (world-size checks, one-line errors tagged with the rank, the engine ``auto``
picks), so every reader sees the same launcher variables: deepspeed and torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_SIZE`` / ``LOCAL_WORLD_SIZE``), Open MPI (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI (``PMI_*``,
``MPI_LOCALNRANKS``), MVAPICH2 (``MV2_COMM_WORLD_*``) and Slurm's tasks per node. Each reader takes the first variable
of its list that holds a whole number; without a launcher a process is rank 0 of a world of 1.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

RANK_ENVS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
WORLD_SIZE_ENVS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
LOCAL_SIZE_ENVS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "SLURM_NTASKS_PER_NODE")


def _first_int(env: Mapping[str, str], keys: Sequence[str], default: int, least: int) -> int:
    """The first of ``keys`` in ``env`` holding a whole number ``>= least``; ``default`` when none does."""
    for key in keys:
        try:
            value = int(env.get(key, ""))
        except ValueError:  # unset, empty, or not a number (e.g. Slurm's "2(x3)" per-node counts)
            continue
        if value >= least:
            return value
    return default


def launched(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher set a rank variable (:data:`RANK_ENVS`), i.e. the process is one of a launched world."""
    env = os.environ if environ is None else environ
    return any(env.get(key) for key in RANK_ENVS)


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """Processes in the launched world (:data:`WORLD_SIZE_ENVS`); 1 without a launcher (a plain ``python`` run)."""
    return _first_int(os.environ if environ is None else environ, WORLD_SIZE_ENVS, 1, 1)


def rank_and_world(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world size)`` from the launcher's variables (:data:`RANK_ENVS`, :data:`WORLD_SIZE_ENVS`); ``(0, 1)``
    without a launcher."""
    env = os.environ if environ is None else environ
    return _first_int(env, RANK_ENVS, 0, 0), world_size(env)


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Processes the launcher started on this node (:data:`LOCAL_SIZE_ENVS`: ``LOCAL_SIZE`` of deepspeed,
    ``LOCAL_WORLD_SIZE`` of torchrun, the MPI and Slurm equivalents); 1 without a launcher."""
    return _first_int(os.environ if environ is None else environ, LOCAL_SIZE_ENVS, 1, 1)
