"""StagePartition: the single source of truth for how the target is split and what the head sees.

Notation (the SPD paper's):

* ``L`` decoder layers, ``n`` pipeline stages; stage ``s`` owns layers ``[starts[s], ends[s])``.
* Hidden-state index ``j``: ``j = 0`` is the token embedding, ``1 <= j <= L`` is the **raw (pre-final-norm)**
  output of decoder layer ``j - 1``.
* Pipeline depth ``d`` of an in-flight token = number of stages it has finished (0 = just embedded, n = complete).
  At depth ``d`` the hidden states ``j <= e_d`` are available, where ``e_d = ends[d - 1]`` (``e_0 = 0``).
* Aggregation anchors ``b_0 = 0 < b_1 < ... < b_{m-1} <= L``; aggregation type ``k`` concatenates
  ``h^{(b_0)} .. h^{(b_k)}`` and projects it with ``g_k``.
* Depth -> type map ``f(d) = max{k : b_k <= e_d}`` and its inverse ``mu(k) = min{d : f(d) = k}``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence


class PartitionError(ValueError):
    """A partition or anchor specification that cannot work; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class StagePartition:
    """How ``num_layers`` decoder layers are split into ``num_stages`` stages, and the head's anchors.

    Build it with :meth:`build`; the constructor validates everything and raises :class:`PartitionError`.

    Attributes:
        num_layers: ``L``, decoder layers of the target.
        stage_layers: layers per stage, length ``n``, each >= 1, summing to ``L``.
        anchors: hidden-state indices ``b_0 .. b_{m-1}`` (``b_0 = 0``, strictly increasing, ``<= L``,
            ``m <= n + 1``), every aggregation type reachable by some depth (no dead type).
    """

    num_layers: int
    stage_layers: tuple[int, ...]
    anchors: tuple[int, ...]

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        num_layers: int,
        num_stages: int | None = None,
        stage_layers: Sequence[int] | None = None,
        anchors: Sequence[int] | None = None,
    ) -> "StagePartition":
        """Make a partition: uniform over ``num_stages`` (remainder spread over the first stages) or explicit.

        Args:
            num_layers: ``L`` (>= 1).
            num_stages: ``n``; may be omitted when ``stage_layers`` is given.
            stage_layers: explicit layers per stage (overrides the uniform split).
            anchors: explicit anchors; ``None`` picks :meth:`default_anchors`.

        Raises:
            PartitionError: n < 1, n > L, stage sizes that do not sum to L, bad anchors.
        """
        if num_layers < 1:
            raise PartitionError(f"num_layers must be >= 1, got {num_layers}")
        if stage_layers is None:
            if num_stages is None:
                raise PartitionError("give partition.num_stages or partition.stage_layers")
            if num_stages < 1:
                raise PartitionError(f"partition.num_stages must be >= 1, got {num_stages}")
            if num_stages > num_layers:
                raise PartitionError(
                    f"partition.num_stages={num_stages} exceeds the model's {num_layers} decoder layers; "
                    f"use at most {num_layers} stages"
                )
            base, rem = divmod(num_layers, num_stages)
            stage_layers = [base + (1 if s < rem else 0) for s in range(num_stages)]
        else:
            stage_layers = [int(x) for x in stage_layers]
            if num_stages is not None and num_stages != len(stage_layers):
                raise PartitionError(
                    f"partition.num_stages={num_stages} but partition.stage_layers has {len(stage_layers)} entries; "
                    "make them agree (or drop num_stages)"
                )
        stage_layers = tuple(stage_layers)
        if anchors is None:
            anchors = cls.default_anchors(stage_layers)
        return cls(num_layers=num_layers, stage_layers=stage_layers, anchors=tuple(int(a) for a in anchors))

    def __post_init__(self) -> None:
        L, sl, b = self.num_layers, self.stage_layers, self.anchors
        n = len(sl)
        if n < 1:
            raise PartitionError("a partition needs at least one stage")
        if any(x < 1 for x in sl):
            raise PartitionError(f"every stage needs >= 1 layer, got partition.stage_layers={list(sl)}")
        if sum(sl) != L:
            raise PartitionError(
                f"partition.stage_layers={list(sl)} sums to {sum(sl)}, but the model has {L} decoder layers"
            )
        if len(b) == 0 or b[0] != 0:
            raise PartitionError(f"partition.anchors must start with 0 (the embedding), got {list(b)}")
        if any(y <= x for x, y in zip(b, b[1:])):
            raise PartitionError(f"partition.anchors must be strictly increasing, got {list(b)}")
        if b[-1] > L:
            raise PartitionError(f"partition.anchors must be <= num_layers={L}, got {list(b)}")
        if len(b) > n + 1:
            raise PartitionError(
                f"partition.anchors has {len(b)} entries but n={n} stages allow at most {n + 1} (one per depth 0..n)"
            )
        dead = [k for k in range(len(b)) if k not in set(self.depth_to_type)]
        if dead:
            ends = [0] + list(self.stage_ends)
            raise PartitionError(
                f"partition.anchors={list(b)}: aggregation type(s) {dead} are never used because no pipeline depth "
                f"reaches exactly those anchors; use anchors at stage boundaries {ends}"
            )

    @staticmethod
    def default_anchors(stage_layers: Sequence[int], max_types: int = 5) -> tuple[int, ...]:
        """Default anchors: stage boundaries, at most ``max_types`` of them, spread evenly over the depths.

        Anchors at stage boundaries make ``f`` hit every type (no dead type) for every ``n >= 1``:
        ``n <= max_types - 1`` gives ``b = (0, e_1, .., e_n)`` and ``f(d) = d``; larger ``n`` picks depths
        ``round(k n / (max_types - 1))``. The deepest anchor is ``L`` (the raw last-layer output).
        """
        n = len(stage_layers)
        ends = [0]
        for x in stage_layers:
            ends.append(ends[-1] + x)
        k_max = min(n, max_types - 1)
        depths = sorted({round(k * n / k_max) for k in range(k_max + 1)})
        return tuple(ends[d] for d in depths)

    # ------------------------------------------------------------------ derived quantities
    @property
    def num_stages(self) -> int:
        """``n``."""
        return len(self.stage_layers)

    @property
    def num_types(self) -> int:
        """``m``, number of aggregation types (= number of anchors)."""
        return len(self.anchors)

    @property
    def stage_starts(self) -> tuple[int, ...]:
        """First layer index of each stage."""
        out, acc = [], 0
        for x in self.stage_layers:
            out.append(acc)
            acc += x
        return tuple(out)

    @property
    def stage_ends(self) -> tuple[int, ...]:
        """One past the last layer index of each stage (``e_1 .. e_n``)."""
        return tuple(s + x for s, x in zip(self.stage_starts, self.stage_layers))

    def stage_range(self, stage: int) -> range:
        """Layer indices of ``stage``."""
        return range(self.stage_starts[stage], self.stage_ends[stage])

    def available(self, depth: int) -> int:
        """Deepest hidden-state index available at pipeline ``depth`` (``e_d``; 0 at depth 0)."""
        return 0 if depth == 0 else self.stage_ends[depth - 1]

    @property
    def depth_to_type(self) -> tuple[int, ...]:
        """``f(d)`` for ``d = 0..n``: the deepest aggregation type whose anchors are all available."""
        out = []
        for d in range(self.num_stages + 1):
            a = self.available(d)
            out.append(max(k for k, b in enumerate(self.anchors) if b <= a))
        return tuple(out)

    @property
    def type_min_depth(self) -> tuple[int, ...]:
        """``mu(k) = min{d : f(d) = k}`` for every type ``k``."""
        f = self.depth_to_type
        return tuple(f.index(k) for k in range(self.num_types))

    def anchor_owner(self, anchor: int) -> int:
        """Stage that produces hidden-state index ``anchor`` (0 -> stage 0's embedding; j -> stage of layer j-1)."""
        if anchor == 0:
            return 0
        for s, (lo, hi) in enumerate(zip(self.stage_starts, self.stage_ends)):
            if lo <= anchor - 1 < hi:
                return s
        raise PartitionError(f"anchor {anchor} is outside 0..{self.num_layers}")

    def stage_anchors(self, stage: int) -> tuple[int, ...]:
        """Anchors produced by ``stage`` (sorted)."""
        return tuple(a for a in self.anchors if self.anchor_owner(a) == stage)

    def layer_anchors(self) -> dict[int, int]:
        """Map decoder-layer index -> anchor index ``j`` for anchors ``j >= 1`` (layer ``j-1`` outputs ``h^{(j)}``)."""
        return {a - 1: a for a in self.anchors if a >= 1}

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        """JSON-able form, stored in head checkpoints."""
        return {"num_layers": self.num_layers, "stage_layers": list(self.stage_layers), "anchors": list(self.anchors)}

    @classmethod
    def from_dict(cls, d: dict) -> "StagePartition":
        """Inverse of :meth:`to_dict` (validates)."""
        return cls(num_layers=int(d["num_layers"]), stage_layers=tuple(d["stage_layers"]), anchors=tuple(d["anchors"]))

    def __str__(self) -> str:
        return json.dumps(self.to_dict())
