"""The speculation head in its training layout (the module the ZeRO-2 engine wraps).

From the teacher's anchor features ``feats [B, S, m, H]`` and a pipeline fill ``F`` it builds the rows of
:mod:`spd_ds.train.mask` — block ``d`` (depth ``d < F``) holds ``g_{f(d)}``, the last block holds the complete rows
``g_{m-1}`` — runs the tower under the structural mask and returns the head's draft-vocabulary logits of the
depth-0 rows at the loss positions.
"""

from __future__ import annotations

import torch
from torch import nn

from spd_ds.head import SpeculationHead
from spd_ds.train.mask import block_types, segment_positions, structural_mask


class HeadTrainModule(nn.Module):
    """Wraps a :class:`SpeculationHead` for training (``forward`` = the training layout; see module doc)."""

    def __init__(self, head: SpeculationHead) -> None:
        super().__init__()
        self.head = head
        self.depth_to_type = head.partition.depth_to_type

    def forward(self, feats: torch.Tensor, segments: torch.Tensor, valid: torch.Tensor, fill: int) -> torch.Tensor:
        """Head logits at the loss positions.

        Args:
            feats: ``[B, S, m, H]`` raw anchor hidden states from the teacher.
            segments: ``[B, S]`` int64 document ids (0 = padding).
            valid: ``[B, S]`` bool loss positions.
            fill: pipeline fill ``F`` in ``1..n``.

        Returns:
            ``[N, V_d]`` fp32 logits, ``N = valid.sum()``, in row-major order of the positions.
        """
        head = self.head
        B, S, m, H = feats.shape
        types = block_types(fill, self.depth_to_type)
        wdtype = head.aggr[0].weight.dtype
        rows_of = {k: head.aggr[k](feats[:, :, : k + 1].reshape(B, S, (k + 1) * H).to(wdtype)) for k in set(types)}
        rows = torch.cat([rows_of[k] for k in types], dim=1)  # [B, (F+1)·S, H]
        positions = segment_positions(segments).repeat(1, len(types))
        mask = structural_mask(segments, fill)
        h = head.tower(rows, positions, mask=mask)
        h0 = h[:, :S].reshape(B * S, -1)[valid.reshape(-1).bool()]
        logits = head.logits(h0)
        # Every trainable parameter takes part in every step (types unused at this fill get a zero gradient), so
        # all data-parallel ranks reduce the same gradient buckets whatever fill each one drew.
        unused = [k for k in range(m) if k not in rows_of]
        if unused:
            logits = logits + 0.0 * sum(head.aggr[k].weight.sum() for k in unused)
        return logits


class WorldDataParallel:
    """A minimal DeepSpeed ``mpu`` for the head's engine: data parallel over every rank, no model parallelism.

    The teacher's ``PipelineEngine`` registers its pipeline grid as DeepSpeed's global ``mpu``; with a pipe degree
    above 1 a second engine would otherwise take the pipeline for model parallelism. Construct it on every rank at
    the same point (it creates one single-rank process group per rank, a collective call).
    """

    def __init__(self) -> None:
        import torch.distributed as tdist

        self.rank, self.world = tdist.get_rank(), tdist.get_world_size()
        self._dp = tdist.group.WORLD
        self._mp = None
        for r in range(self.world):
            g = tdist.new_group([r])
            if r == self.rank:
                self._mp = g

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(range(self.world))

    def get_model_parallel_group(self):
        return self._mp

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_group(self):
        return self._mp
