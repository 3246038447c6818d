"""The target as a ``deepspeed.pipe.PipelineModule`` built from the :class:`~spd_ds.partition.StagePartition`.

The layer list is ``[HeadEnds, TargetStage 0, .., TargetStage n-1]``: one :class:`~deepspeed.pipe.LayerSpec` per
target stage (each a :class:`~spd_ds.models.adapter.TargetStage` over exactly ``partition.stage_range(s)``) after the
head's own part. DeepSpeed's partition methods balance counts or parameters and have no manual split, so
:class:`SPDPipelineModule` overrides ``_partition_layers`` with the plan's boundaries
(:meth:`~spd_ds.pipe.topology.PipePlan.layer_list_parts`). Each rank builds only the specs of its pipe stage, so a
stage process only ever loads its own layers.
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.utils import logger
from torch import nn

from spd_ds.config import ExperimentConfig
from spd_ds.models.adapter import TargetArch, TargetEnds, TargetStage
from spd_ds.pipe.topology import PipePlan


class HeadEnds(nn.Module):
    """Pipe stage 0's own modules: the target's embedding, final norm and LM head, and the speculation head.

    Args:
        cfg: the experiment (``head`` section: checkpoint or an untrained head seeded with ``train.seed``).
        arch: the target's :class:`~spd_ds.models.adapter.TargetArch`.
        partition: the run's partition.
        dtype, device: of the target's ends (the head is cast by its drafter).
        with_head: build the speculation head (skipped when the drafter does not use it).
    """

    def __init__(self, cfg: ExperimentConfig, arch: TargetArch, partition, dtype: torch.dtype, device,
                 with_head: bool = True) -> None:
        super().__init__()
        from spd_ds.builder import build_head

        self.ends = TargetEnds(arch, dtype, device)
        self.head = build_head(cfg, arch, partition).to(device) if with_head else None
        self.eval().requires_grad_(False)

    def forward(self, x):
        """Identity: the SPD engine calls ``ends`` and ``head`` directly; the sequential forward passes through."""
        return x


class SPDPipelineModule(PipelineModule):
    """``PipelineModule`` over the SPD plan: pipe stage 0 = head (+ local target stages), others one target stage.

    Args:
        cfg: the experiment.
        arch: the target's architecture (weights are read lazily per layer).
        plan: :class:`~spd_ds.pipe.topology.PipePlan` (partition, placement, world size).
        dtype: compute dtype of the target.
        device: this rank's device.
        with_head: build the speculation head on pipe stage 0.
    """

    def __init__(self, cfg: ExperimentConfig, arch: TargetArch, plan: PipePlan, dtype: torch.dtype, device,
                 with_head: bool = True) -> None:
        part = plan.partition
        specs = [LayerSpec(HeadEnds, cfg, arch, part, dtype, device, with_head)]
        specs += [LayerSpec(TargetStage, arch, list(part.stage_range(s)), dtype, device, capture=part.stage_anchors(s))
                  for s in range(part.num_stages)]
        self.spd_plan = plan
        self._spd_parts = plan.layer_list_parts()
        topo = PipeDataParallelTopology(num_pp=plan.world_size, num_dp=1)
        super().__init__(layers=specs, topology=topo, partition_method="spd-plan")
        self.eval().requires_grad_(False)
        pipe = self.stage_id
        for s, mod in self.target_stages.items():
            if mod.layer_ids != list(part.stage_range(s)):
                raise RuntimeError(f"pipe stage {pipe} built layers {mod.layer_ids} for target stage {s}")

    def _partition_layers(self, method: str = "spd-plan") -> None:
        """Pipe stage ``p`` owns layer-list items ``parts[p]:parts[p+1]`` of the plan (no balancing)."""
        self.parts = list(self._spd_parts)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if self.global_rank == 0:
            logger.info("SPD pipeline plan:\n" + self.spd_plan.describe())
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    # ---- this rank's pieces ----------------------------------------------------------------------------
    @property
    def head_ends(self) -> HeadEnds | None:
        """The head's modules (pipe stage 0 only)."""
        return self.forward_funcs[0] if self.stage_id == 0 else None

    @property
    def target_stages(self) -> dict[int, TargetStage]:
        """Target stage index -> the :class:`TargetStage` this rank built."""
        local = self.spd_plan.stages_on(self.stage_id)
        mods = [m for m in self.forward_funcs if isinstance(m, TargetStage)]
        return dict(zip(local, mods))
