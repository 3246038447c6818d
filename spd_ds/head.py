"""SpeculationHead (the paper's PDM, v11 semantics; ``SPD_REFERENCE_NOTES.md`` §1).

Aggregation type ``k`` (paper §3.2 "multi-depth feature aggregation")::

    g_k(t) = W_k · concat(h_t^{(b_0)}, .., h_t^{(b_k)}),   W_k ∈ R^{H × (k+1)H}, no bias

over raw (pre-final-norm) hidden states ``h^{(j)}`` at the partition's anchors ``b``. A token at pipeline depth
``d`` is represented by ``g_{f(d)}``. The rows go through ``L_s`` decoder layers of the target's own architecture
(causal, KV cache, RoPE position = token position), then the target's final norm (a frozen copy) and an LM head
over the draft vocabulary ``D`` (rows initialised from the target's LM head).

Checkpoint: a directory with ``head.safetensors`` and ``head_config.json`` (format version, partition,
dimensions, draft vocabulary size, base-model fingerprint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from spd_ds.models.adapter import TargetArch, causal_mask, head_layer_config
from spd_ds.models.kv_cache import StageKVCache
from spd_ds.partition import StagePartition

HEAD_FORMAT_VERSION = 1
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"


class HeadMismatchError(ValueError):
    """A head checkpoint that does not belong to this base model / partition."""


class SpeculationHead(nn.Module):
    """Drafts the next token from multi-depth features of the in-flight tokens.

    Args:
        arch: the target's :class:`~spd_ds.models.adapter.TargetArch` (layer classes, dims, weights for init).
        partition: the :class:`~spd_ds.partition.StagePartition` whose anchors define ``g_0 .. g_{m-1}``.
        num_layers: ``L_s`` tower layers (>= 1).
        draft_token_ids: sorted unique target ids forming the draft vocabulary ``D`` (``None`` = full vocabulary).
        intermediate_size: MLP width of the tower (default: the target's; Qwen3.5-MoE targets, which have no dense
            width, ``moe_intermediate_size x num_experts_per_tok``). The tower layers are the target family's
            full-attention decoder layers (Qwen3.5: gated attention, partial RoPE) with a dense MLP, MoE targets too.
        init_from_target: copy the target's final norm and LM-head rows (set False when loading a checkpoint).

    Raises:
        ValueError: ``num_layers < 1`` or a bad draft vocabulary.
    """

    def __init__(
        self,
        arch: TargetArch,
        partition: StagePartition,
        num_layers: int = 1,
        draft_token_ids: Sequence[int] | None = None,
        intermediate_size: int | None = None,
        init_from_target: bool = True,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"head.num_layers must be >= 1, got {num_layers}")
        H, V = arch.hidden_size, arch.vocab_size
        self.arch, self.partition = arch, partition
        self.num_layers = int(num_layers)
        self.intermediate_size = intermediate_size
        if draft_token_ids is None:
            ids = torch.arange(V)
        else:
            ids = torch.as_tensor(list(draft_token_ids), dtype=torch.long)
            if ids.numel() == 0 or (ids[1:] <= ids[:-1]).any() or ids.min() < 0 or ids.max() >= V:
                raise ValueError(f"draft vocabulary must be sorted, unique ids in [0, {V}); check the draft-vocab file")
        self.register_buffer("draft_ids", ids, persistent=True)
        self.aggr = nn.ModuleList(nn.Linear((k + 1) * H, H, bias=False) for k in range(partition.num_types))
        for lin in self.aggr:
            nn.init.normal_(lin.weight, std=0.02)
        self.config = head_layer_config(arch, self.num_layers, intermediate_size)
        layer_cls = arch.head_layer_class(self.config)  # the target family's full-attention layer, dense MLP
        self.layers = nn.ModuleList(layer_cls(self.config, layer_idx=i) for i in range(self.num_layers))
        self.rotary = arch.make_rotary(self.config)
        self.norm = arch.make_norm()
        self.lm_head = nn.Linear(H, ids.numel(), bias=False)
        if init_from_target:
            with torch.no_grad():
                arch.load_into(self.norm, "model.norm.")
                name = "model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight"
                self.lm_head.weight.copy_(arch.load_tensor(name)[ids])
        self.norm.requires_grad_(False)  # the target's final norm stays frozen

    # ------------------------------------------------------------------ forward pieces
    @property
    def draft_vocab_size(self) -> int:
        """``V_d``, size of the draft vocabulary."""
        return int(self.draft_ids.numel())

    def aggregate(self, feats: torch.Tensor, types: Sequence[int]) -> torch.Tensor:
        """Rows ``g_{k_r}`` for ``R`` tokens.

        Args:
            feats: ``[R, m, H]`` hidden states at the anchors ``b_0..b_{m-1}`` (entries beyond ``k_r`` are ignored).
            types: ``R`` aggregation types ``k_r``.
        Returns:
            ``[R, H]`` in the head's dtype.
        """
        R, _, H = feats.shape
        out = feats.new_empty(R, H)
        types = [int(t) for t in types]
        for k in sorted(set(types)):
            idx = [r for r, t in enumerate(types) if t == k]  # host-side: no device round trip per cycle
            out[idx] = self.aggr[k](feats[idx, : k + 1].reshape(len(idx), (k + 1) * H))
        return out

    def aggregate_indexed(self, feats: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """Rows ``g_{k_r}`` with the types in a device tensor: no host decision, so it can be captured in a CUDA graph.

        Every type's projection is computed for every row and row ``r`` takes type ``types[r]``'s (``m`` times the
        work of :meth:`aggregate`, which only matters for long inputs: use :meth:`aggregate` for prompts).

        Args:
            feats: ``[R, m, H]`` anchor states (entries beyond ``k_r`` are ignored).
            types: int64 ``[R]`` on ``feats``' device, values in ``[0, m)`` (not checked).
        Returns:
            ``[R, H]`` in the head's dtype.
        """
        R, m, H = feats.shape
        proj = torch.stack([self.aggr[k](feats[:, : k + 1].reshape(R, (k + 1) * H)) for k in range(m)], 1)  # [R, m, H]
        return proj.gather(1, types.view(R, 1, 1).expand(R, 1, H)).squeeze(1)

    def tower(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        cache: StageKVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the ``L_s`` tower layers.

        Args:
            rows: ``[B, R, H]`` aggregated rows.
            positions: ``[R]`` or ``[B, R]`` int64 RoPE positions (token positions).
            cache: KV cache holding earlier committed rows (inference), or ``None`` (training).
            mask: optional attention mask ``[B, 1, R, R(+past)]`` (bool, True = attend); default causal.
        Returns:
            ``[B, R, H]`` tower output (before the final norm).
        """
        pos = positions if positions.dim() == 2 else positions[None]
        pos_emb = self.rotary(rows, pos)
        if mask is None:
            mask = causal_mask(rows.shape[1], cache.length if cache is not None else 0, rows.device)
        kw = {self.arch.cache_kwarg: cache}
        h = rows
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pos_emb, **kw)
            if isinstance(h, tuple):
                h = h[0]
        if cache is not None:
            cache.advance(rows.shape[1])
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[.., V_d]`` (fp32) from tower outputs ``[.., H]``."""
        return self.lm_head(self.norm(hidden)).float()

    def new_cache(self, max_len: int, dtype: torch.dtype, device) -> StageKVCache:
        """KV cache for the tower (full-attention layers only, whatever the target's layer types)."""
        return StageKVCache(range(self.num_layers), self.arch.num_kv_heads, self.arch.head_dim, max_len, dtype, device)

    # ------------------------------------------------------------------ checkpoint
    def save(self, path: str | os.PathLike) -> Path:
        """Write ``head.safetensors`` + ``head_config.json`` into directory ``path`` and return it."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        mask = torch.zeros(self.arch.vocab_size, dtype=torch.bool)  # sorted unique ids <=> a vocabulary mask
        mask[state.pop("draft_ids")] = True
        state["draft_mask"] = mask
        save_file(state, str(path / HEAD_WEIGHTS))
        meta = {
            "format_version": HEAD_FORMAT_VERSION,
            "semantics": "spd-v11",
            "partition": self.partition.to_dict(),
            "num_layers": self.num_layers,
            "hidden_size": self.arch.hidden_size,
            "vocab_size": self.arch.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "intermediate_size": self.intermediate_size,
            "base_model_type": self.arch.config.model_type,
            "base_model_fingerprint": self.arch.fingerprint(),
        }
        (path / HEAD_CONFIG).write_text(json.dumps(meta, indent=2))
        return path

    @classmethod
    def read_config(cls, path: str | os.PathLike) -> dict:
        """The JSON half of a checkpoint. Raises FileNotFoundError / HeadMismatchError (bad version)."""
        p = Path(path) / HEAD_CONFIG
        if not p.exists():
            raise FileNotFoundError(f"{p} not found: head.checkpoint must be a directory written by SpeculationHead.save")
        meta = json.loads(p.read_text())
        if meta.get("format_version") != HEAD_FORMAT_VERSION:
            raise HeadMismatchError(
                f"{path}: head format version {meta.get('format_version')} is not {HEAD_FORMAT_VERSION}; retrain or convert it"
            )
        return meta

    @classmethod
    def check_base_model(cls, path: str | os.PathLike, arch: TargetArch) -> dict:
        """Read the checkpoint's ``head_config.json`` (:meth:`read_config`) and check it was trained for ``arch``
        (fingerprint and hidden size); cheap, so every rank can run it before any collective. Returns the metadata.

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            HeadMismatchError: another base model, or another head format version.
        """
        meta = cls.read_config(path)
        saved_type, this_type = meta.get("base_model_type"), arch.config.model_type
        if saved_type is not None and saved_type != this_type:
            raise HeadMismatchError(
                f"head {path} was trained for a {saved_type} target but {arch.model_dir} is {this_type}; "
                f"use a head trained for {arch.model_dir}"
            )
        if meta["base_model_fingerprint"] != arch.fingerprint() or meta["hidden_size"] != arch.hidden_size:
            raise HeadMismatchError(
                f"head {path} was trained for another base model (fingerprint {meta['base_model_fingerprint']}, "
                f"this model {arch.fingerprint()}); use a head trained for {arch.model_dir}"
            )
        return meta

    @classmethod
    def load(cls, path: str | os.PathLike, arch: TargetArch, partition: StagePartition | None = None) -> "SpeculationHead":
        """Load a head saved by :meth:`save` for base model ``arch``.

        Args:
            partition: the partition the caller runs; must equal the checkpoint's (``None`` = take the checkpoint's).
        Raises:
            HeadMismatchError: other base model (fingerprint / dims) or other partition.
        """
        from safetensors.torch import load_file

        meta = cls.check_base_model(path, arch)
        saved = StagePartition.from_dict(meta["partition"])
        if partition is not None and partition != saved:
            raise HeadMismatchError(
                f"head {path} was trained for partition {saved} but the run uses {partition}; "
                "drop the partition overrides or train a head for this partition"
            )
        state = load_file(str(Path(path) / HEAD_WEIGHTS))
        if "draft_mask" in state:
            state["draft_ids"] = state.pop("draft_mask").nonzero().flatten()
        state["draft_ids"] = state["draft_ids"].long()
        head = cls(arch, saved, meta["num_layers"], state["draft_ids"].tolist(), meta.get("intermediate_size"),
                   init_from_target=False)
        head.load_state_dict(state)
        return head


def load_draft_vocab(path: str | os.PathLike) -> list[int]:
    """Token ids of a draft-vocabulary JSON (``token_ids``, ``draft_vocab_size``; reference-compatible format).

    Raises:
        ValueError: the length disagrees with ``draft_vocab_size`` or the ids are not sorted and unique.
    """
    data = json.loads(Path(path).read_text())
    ids = [int(x) for x in data["token_ids"]]
    if len(ids) != int(data.get("draft_vocab_size", len(ids))):
        raise ValueError(f"{path}: {len(ids)} token_ids but draft_vocab_size={data['draft_vocab_size']}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{path}: token_ids must be sorted ascending and unique")
    return ids
