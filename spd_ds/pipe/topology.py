"""Where each piece of SPD lives in DeepSpeed's pipeline grid.

DeepSpeed's grid spans the whole world (pipe x data, here data = 1), so the speculation head must *be* a pipe stage:

* ``colocated`` (world ``n``): pipe stage 0 holds the head, embedding, final norm, LM head, verification **and**
  target stage 0; pipe stage ``s`` holds target stage ``s``. The head runs inside stage 0's process (on GPU on its
  own CUDA stream): NCCL refuses two ranks on one GPU.
* ``dedicated`` (world ``n + 1``): pipe stage 0 is a *driver* (head, embedding, final norm, LM head, verification);
  target stage ``s`` is pipe stage ``s + 1``.
* world 1 (either placement): one process holds everything (pipe degree 1, as in training); the cycle is then the
  reference decoder's, run through the DeepSpeed engine.

The pipe stage that holds the head is always pipe stage 0, called the *head rank*. Every other pipe stage is a
*stage rank* holding exactly one target stage.
"""

from __future__ import annotations

import dataclasses

from spd_ds.config import ConfigError
from spd_ds.launch_env import world_size
from spd_ds.partition import StagePartition

PLACEMENTS = ("colocated", "dedicated")


class WorldSizeError(ConfigError):
    """The launched world does not fit the partition and head placement (raised before any collective)."""


def detect_world_size() -> int:
    """World size from the launcher's environment, read before any process group exists
    (:func:`spd_ds.launch_env.world_size`: ``WORLD_SIZE`` of deepspeed / torchrun, then the MPI variables; 1 when none
    is set, a plain ``python`` run)."""
    return world_size()


def allowed_world_sizes(num_stages: int, placement: str) -> tuple[int, ...]:
    """World sizes that fit ``n`` target stages with the head placed as ``placement``: ``n`` (colocated) or ``n+1``
    (dedicated), and 1 (every stage in one process)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"head.placement must be one of {PLACEMENTS}, got {placement!r}")
    return tuple(sorted({1, num_stages if placement == "colocated" else num_stages + 1}))


@dataclasses.dataclass(frozen=True)
class PipePlan:
    """Mapping of target stages, head and messages onto the pipe stages of a world.

    Attributes:
        partition: the run's :class:`~spd_ds.partition.StagePartition` (``n`` target stages).
        placement: ``colocated`` or ``dedicated``.
        world_size: pipe degree ``P`` (the data-parallel degree is 1).
    """

    partition: StagePartition
    placement: str
    world_size: int

    @classmethod
    def build(cls, partition: StagePartition, placement: str, world_size: int) -> "PipePlan":
        """Check that ``world_size`` fits and return the plan.

        Raises:
            WorldSizeError: a one-line message naming the world sizes that fit and how to launch them (``--num_gpus``
                on one node; with a hostfile, whose slots make the world, the slot counts to give).
        """
        n = partition.num_stages
        ok = allowed_world_sizes(n, placement)
        if world_size not in ok:
            want = n if placement == "colocated" else n + 1
            other = "dedicated" if placement == "colocated" else "colocated"
            other_w = n + 1 if placement == "colocated" else n
            raise WorldSizeError(
                f"world size {world_size} does not fit partition.num_stages={n} with head.placement={placement}: "
                f"launch {want} processes (one node: deepspeed --num_gpus {want}; with --hostfile: slots= counts that "
                f"add up to {want} over its hosts) or 1 for a single-process run; "
                f"head.placement={other} needs {other_w}"
            )
        return cls(partition, placement, world_size)

    # ---- geometry ---------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """``n``, target stages."""
        return self.partition.num_stages

    @property
    def single_process(self) -> bool:
        """Whether one process holds the head and every stage (world size 1)."""
        return self.world_size == 1

    @property
    def stage_offset(self) -> int:
        """Pipe stage of target stage 0 (1 with a dedicated driver, else 0)."""
        return 1 if (self.placement == "dedicated" and not self.single_process) else 0

    def pipe_of(self, stage: int) -> int:
        """Pipe stage that runs target stage ``stage``."""
        return 0 if self.single_process else stage + self.stage_offset

    def stages_on(self, pipe: int) -> tuple[int, ...]:
        """Target stages held by pipe stage ``pipe`` (in order)."""
        return tuple(s for s in range(self.num_stages) if self.pipe_of(s) == pipe)

    @property
    def head_stages(self) -> tuple[int, ...]:
        """Target stages run inside the head's process."""
        return self.stages_on(0)

    @property
    def remote_stages(self) -> tuple[int, ...]:
        """Target stages on stage ranks (each alone on its rank)."""
        return tuple(s for s in range(self.num_stages) if self.pipe_of(s) != 0)

    @property
    def first_remote(self) -> int | None:
        """The first target stage not in the head's process (the head sends to it), or ``None``."""
        r = self.remote_stages
        return r[0] if r else None

    def upstream_pipe(self, stage: int) -> int:
        """Pipe stage that feeds target stage ``stage`` (the head rank for stage 0)."""
        return 0 if stage == 0 else self.pipe_of(stage - 1)

    def downstream_pipe(self, stage: int) -> int | None:
        """Pipe stage fed by target stage ``stage`` (``None`` for the last stage)."""
        return None if stage == self.num_stages - 1 else self.pipe_of(stage + 1)

    def up_rows(self, stage: int) -> tuple[int, ...]:
        """Hidden-state indices ``j`` a stage rank sends to the head for every token: its anchors (the embedding,
        anchor 0, is the head's own) and, for the last stage, ``L`` (its raw output; the head's verification input,
        sent once even when ``L`` is also an anchor)."""
        p, L = self.partition, self.partition.num_layers
        rows = {a for a in p.stage_anchors(stage) if a >= 1}
        if stage == self.num_stages - 1:
            rows.add(L)
        return tuple(sorted(rows))

    def layer_list_parts(self) -> list[int]:
        """Boundaries of :class:`~spd_ds.pipe.module.SPDPipelineModule`'s layer list over the pipe stages.

        The list is ``[HeadEnds, TargetStage 0, .., TargetStage n-1]``; pipe stage ``p`` owns items
        ``parts[p]:parts[p+1]``.
        """
        counts = [0] * self.world_size
        counts[0] += 1  # the head's ends
        for s in range(self.num_stages):
            counts[self.pipe_of(s)] += 1
        parts = [0]
        for c in counts:
            parts.append(parts[-1] + c)
        return parts

    def describe(self) -> str:
        """One line per pipe stage, e.g. for logs."""
        out = []
        for p in range(self.world_size):
            what = (["head (embedding, speculation head, final norm, LM head, verification)"] if p == 0 else [])
            what += [f"target stage {s} (layers {self.partition.stage_range(s).start}-"
                     f"{self.partition.stage_range(s).stop - 1})" for s in self.stages_on(p)]
            out.append(f"pipe stage {p}: " + " + ".join(what))
        return "\n".join(out)
