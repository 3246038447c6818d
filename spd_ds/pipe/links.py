"""This rank's links to its peers in the SPD pipeline (built collectively by every rank at set-up).

Hidden states flow down on the DeepSpeed grid's pipe-parallel group, anchors flow up to the head on a group of their
own, headers travel on a gloo group (see :mod:`spd_ds.pipe.comm`). The head rank (pipe stage 0) has one link down
(to the first remote target stage) and one link up from every remote stage; a stage rank has a link from upstream, one
downstream (none on the last stage) and one up to the head.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from spd_ds.dist import startup_timeout_s
from spd_ds.pipe.comm import FLAG_ANCHORS, Link
from spd_ds.pipe.topology import PipePlan


def rank_name(plan: PipePlan, pipe: int, global_rank: int) -> str:
    """How messages name pipe stage ``pipe``: ``"rank R (head, target stage 0)"``."""
    what = ["head"] if pipe == 0 else []
    what += [f"target stage {s}" for s in plan.stages_on(pipe)]
    return f"rank {global_rank} ({', '.join(what)})"


class PipeLinks:
    """The :class:`~spd_ds.pipe.comm.Link` s of pipe stage ``pipe`` (none in a one-process world).

    Args:
        plan: the run's :class:`~spd_ds.pipe.topology.PipePlan`.
        pipe: this rank's pipe stage (0 = the head rank).
        me: this rank's global rank.
        rank_of: pipe stage -> global rank (DeepSpeed's grid).
        down_group: ``() -> process group`` of hidden states down the pipe (the grid's pipe-parallel group; only
            called when there is more than one rank).
        timeout_s: deadline of every wait on a peer.
        device: device of the payloads.

    Attributes:
        down_link, up_links: the head's link to the first remote stage and stage -> link from each remote stage.
        in_link, out_link, head_link: a stage rank's links from upstream, downstream (``None`` on the last stage) and
            up to the head.
    """

    def __init__(self, plan: PipePlan, pipe: int, me: int, rank_of: Callable[[int], int], down_group: Callable,
                 timeout_s: float, device: torch.device) -> None:
        self.plan, self.pipe, self.rank_of = plan, pipe, rank_of
        self.L, self.n = plan.partition.num_layers, plan.num_stages
        self.down_link: Link | None = None
        self.up_links: dict[int, Link] = {}
        self.in_link = self.out_link = self.head_link = None
        if plan.world_size == 1:
            return
        ranks = list(range(dist.get_world_size()))
        td = datetime.timedelta(seconds=timeout_s)
        # gloo connects every pair of ranks when a group is made, within the group's timeout: ranks reach this point
        # up to seconds apart (rank 0 builds the head), so a gloo group gets the start-up timeout (a small
        # deepspeed.timeout_s failed here with "Gloo connectFullMesh failed ... Connect timeout"); every wait of SPD's
        # on these groups passes its own deadline (spd_ds.pipe.comm.Link). NCCL groups keep timeout_s.
        connect = datetime.timedelta(seconds=startup_timeout_s(timeout_s))
        down = down_group()  # hidden states flow down on the grid's pipe group
        gloo_up = "nccl" not in str(dist.get_backend()).lower()
        up = dist.new_group(ranks=ranks, timeout=connect if gloo_up else td)  # anchors flow up on their own group
        ctrl = dist.new_group(ranks=ranks, backend="gloo", timeout=connect)  # (every rank creates both)
        mine = self.name_of(pipe)

        def link(peer: int, data_group) -> Link:
            return Link(me, rank_of(peer), mine, self.name_of(peer), data_group, ctrl, timeout_s, device)

        if pipe == 0:
            self.down_link = link(plan.pipe_of(plan.first_remote), down)
            self.up_links = {s: link(plan.pipe_of(s), up) for s in plan.remote_stages}
        else:
            (s,) = plan.stages_on(pipe)
            self.in_link = link(plan.upstream_pipe(s), down)
            nxt = plan.downstream_pipe(s)
            self.out_link = link(nxt, down) if nxt is not None else None
            self.head_link = link(0, up)

    def name_of(self, pipe: int) -> str:
        """:func:`rank_name` of pipe stage ``pipe``."""
        return rank_name(self.plan, pipe, self.rank_of(pipe))

    def rows(self, stage: int, flags: int) -> tuple[int, ...]:
        """Hidden-state indices ``j`` that target stage ``stage`` sends the head for a message with ``flags``: every
        up row with ``FLAG_ANCHORS`` (SPD), else only the last stage's output ``L`` (AR)."""
        if flags & FLAG_ANCHORS:
            return self.plan.up_rows(stage)
        return (self.L,) if stage == self.n - 1 else ()

    def all(self) -> list[Link]:
        """Every link of this rank."""
        return [x for x in [self.down_link, self.in_link, self.out_link, self.head_link, *self.up_links.values()] if x]

    def wait_s(self) -> float:
        """Host seconds this rank has spent blocked in receives, over all its links."""
        return sum(x.wait_s for x in self.all())

    def flush(self) -> None:
        """Wait for every send of this rank to complete."""
        for x in self.all():
            x.flush()
