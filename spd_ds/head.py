"""SpeculationHead (the paper's PDM, with the reference implementation's v11 semantics).

Aggregation type ``k`` (paper §3.2 "multi-depth feature aggregation")::

    g_k(t) = W_k · concat(h_t^{(b_0)}, .., h_t^{(b_k)}),   W_k ∈ R^{H × (k+1)H}, no bias

over raw (pre-final-norm) hidden states ``h^{(j)}`` at the partition's anchors ``b``. A token at pipeline depth
``d`` is represented by ``g_{f(d)}``. The rows go through ``L_s`` decoder layers of the target's own architecture
(causal, KV cache, RoPE position = token position), then the target's final norm (a frozen copy) and an LM head
over the draft vocabulary ``D`` (rows initialised from the target's LM head).

Checkpoint: a directory with ``head.safetensors`` and ``head_config.json`` (format version, partition,
dimensions, draft vocabulary size, base-model fingerprint and its version). Heads saved before fingerprint version 2
(:meth:`~spd_ds.models.adapter.TargetArch.legacy_fingerprint`) still load, with a warning to re-save them. The files
are checked before any weight loads by :mod:`spd_ds.head_files` (its names are importable from here too).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from spd_ds import head_files
from spd_ds.cli import one_line
from spd_ds.config import ConfigError
from spd_ds.head_files import (HEAD_CONFIG, HEAD_FORMAT_VERSION, HEAD_WEIGHTS, RETRAIN_HINT, HeadCheckpointError,
                               HeadMismatchError, draft_id_tensor)
from spd_ds.models.adapter import FINGERPRINT_VERSION, TargetArch, head_layer_config
from spd_ds.models.masks import causal_mask, layer_mask
from spd_ds.models.kv_cache import StageKVCache
from spd_ds.partition import StagePartition

log = logging.getLogger(__name__)
_warned_legacy: set[str] = set()  # checkpoints already warned about (once per process)


def _file_mode() -> int:
    """The mode a new file gets under the process's umask (``0o666 & ~umask``)."""
    try:  # Linux: read without changing it (os.umask sets the process-wide mask, which other threads may use)
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)  # read by setting it, and put back at once
        os.umask(umask)
    return 0o666 & ~umask


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
        lm_head_from_target: the LM head is the target's own rows at the draft ids, frozen and not stored in
            checkpoints (they are read from the target on load): a smaller file and fewer trainable parameters.

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
        lm_head_from_target: bool = False,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"head.num_layers must be >= 1, got {num_layers}")
        H, V = arch.hidden_size, arch.vocab_size
        self.arch, self.partition = arch, partition
        self.num_layers = int(num_layers)
        self.intermediate_size = intermediate_size
        ids = draft_id_tensor(draft_token_ids, V)
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
        self.lm_head_from_target = bool(lm_head_from_target)
        with torch.no_grad():
            if init_from_target:
                arch.load_into(self.norm, "model.norm.")
            if init_from_target or self.lm_head_from_target:
                self.lm_head.weight.copy_(self._target_lm_rows(ids))
        self.norm.requires_grad_(False)  # the target's final norm stays frozen
        self.lm_head.requires_grad_(not self.lm_head_from_target)

    def _target_lm_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), H]`` rows of the target's LM head (its embedding when tied) at target ids ``ids``."""
        name = "model.embed_tokens.weight" if self.arch.tied_embeddings else "lm_head.weight"
        return self.arch.load_tensor(name)[ids]

    @torch.no_grad()
    def set_draft_vocab(self, draft_token_ids: Sequence[int] | None) -> None:
        """Draft over another vocabulary (``None`` = the target's whole vocabulary): for a head whose LM head is the
        target's own rows (``lm_head_from_target``), the new vocabulary's rows are read from the target and the rest
        of the head is unchanged, so an id in both vocabularies keeps its logit. A head distilled over a draft
        vocabulary (the KL of training is over it, to save compute) can so draft every token at inference: the
        shipped 16k-vocabulary SmolLM2 heads accept 0.008 (n = 2) and 0.014 (n = 3) more of their drafts with the
        whole vocabulary (docs/training.md, "Draft vocabulary").

        Replaces ``self.lm_head`` (``[V_d', H]``, the old one's dtype and device, frozen) and ``draft_ids``
        (``[V_d']`` int64): call it before anything holds them (an optimizer, a drafter, a CUDA-graph head).
        Reads the target's whole embedding / LM-head matrix from its checkpoint once per call.

        Args:
            draft_token_ids: sorted unique target ids in ``[0, vocab_size)``, or ``None`` for all of them.
        Raises:
            ValueError: a head that stores its own LM head (rows outside its vocabulary were never trained), or ids
                that are not sorted, unique and in ``[0, vocab_size)``.
        """
        if not self.lm_head_from_target:
            raise ValueError("only a head with lm_head_from_target=true can change its draft vocabulary: this head's "
                             "LM head was trained for its own vocabulary; "
                             "train a head with head.lm_head_from_target=true")
        ids = draft_id_tensor(draft_token_ids, self.arch.vocab_size)
        w = self.lm_head.weight
        lm_head = nn.Linear(w.shape[1], ids.numel(), bias=False, device=w.device, dtype=w.dtype)
        lm_head.weight.copy_(self._target_lm_rows(ids))
        self.lm_head = lm_head.requires_grad_(False)
        self.draft_ids = ids.to(self.draft_ids.device)

    @torch.no_grad()
    def init_tower_from_layer(self, layer: int) -> list[str]:
        """Start every tower layer from the target's decoder layer ``layer`` instead of random weights (what EAGLE-3
        and SpecForge trainers do): each tower parameter whose HF name exists in that layer with the same shape is
        copied; the rest (a dense MLP beside a MoE layer, say) keeps its initialisation.

        Args:
            layer: a target layer index; negative counts from the end (-1 = the last layer).
        Returns:
            The parameter names copied (per tower layer, e.g. ``self_attn.q_proj.weight``).
        Raises:
            ConfigError: ``layer`` outside ``[-L, L)``, a linear-attention layer (Qwen3.5: the tower is full
                attention), or no parameter matching.
        """
        k = tower_init_index(layer, self.arch)
        copied = []
        for name, p in self.layers[0].named_parameters():
            src = f"model.layers.{k}.{name}"
            if self.arch.has_tensor(src):
                t = self.arch.load_tensor(src)
                if t.shape == p.shape:
                    copied.append(name)
                    for tower in self.layers:
                        tower.get_parameter(name).copy_(t.to(p.dtype))
        if not copied:
            raise ConfigError(f"head.tower_init_layer={layer}: no tower parameter matches target layer {k}")
        return copied

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
            mask: optional attention mask ``[B, 1, R, R(+past)]`` (bool, True = attend; or the form of the
                layers' attention backend, e.g. a FlexAttention block mask); default causal.
        Returns:
            ``[B, R, H]`` tower output (before the final norm).
        """
        pos = positions if positions.dim() == 2 else positions[None]
        pos_emb = self.rotary(rows, pos)
        if mask is None:
            mask = causal_mask(rows.shape[1], cache.length if cache is not None else 0, rows.device)
        mask = layer_mask(mask, self.config._attn_implementation, rows.dtype)  # eager: additive
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
    def save(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write ``head.safetensors`` + ``head_config.json`` into directory ``path`` and return it.

        ``dtype``: store floating-point tensors in this dtype (the module itself is left as it is; ``None`` = as they
        are), e.g. a best-so-far head saved in bf16 in the middle of training. Both files get the mode of a new file
        under the umask (``0o666 & ~umask``: readable by others with the usual 022), so heads can be shared.
        """
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
                 .contiguous() for k, v in self.state_dict().items()}
        if self.lm_head_from_target:
            del state["lm_head.weight"]  # the target's own rows: read back from the target on load
        mask = torch.zeros(self.arch.vocab_size, dtype=torch.bool)  # sorted unique ids <=> a vocabulary mask
        mask[state.pop("draft_ids")] = True
        state["draft_mask"] = mask
        save_file(state, str(path / HEAD_WEIGHTS))  # safetensors creates it 0600
        meta = {
            "format_version": HEAD_FORMAT_VERSION,
            "semantics": "spd-v11",
            "partition": self.partition.to_dict(),
            "num_layers": self.num_layers,
            "hidden_size": self.arch.hidden_size,
            "vocab_size": self.arch.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "intermediate_size": self.intermediate_size,
            "lm_head_from_target": self.lm_head_from_target,
            "base_model_type": self.arch.config.model_type,
            "base_model_fingerprint": self.arch.fingerprint(),
            "fingerprint_version": FINGERPRINT_VERSION,
        }
        (path / HEAD_CONFIG).write_text(json.dumps(meta, indent=2))
        mode = _file_mode()
        for name in (HEAD_WEIGHTS, HEAD_CONFIG):
            try:
                os.chmod(path / name, mode)
            except OSError:  # a file system without modes (vfat, some FUSE/NFS): the head is saved all the same
                log.debug("could not set the mode of %s", path / name)
        return path

    @classmethod
    def read_config(cls, path: str | os.PathLike, key: str = "head.checkpoint") -> dict:
        """The checked ``head_config.json`` of the head folder ``path``, given as setting ``key``
        (:func:`spd_ds.head_files.read_config`: its errors, one line each)."""
        return head_files.read_config(path, key)

    @classmethod
    def expected_tensors(cls, meta: dict, arch: TargetArch | None = None) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` that :meth:`save` writes for a head of config ``meta``
        (:func:`spd_ds.head_files.expected_tensors`; every tensor with ``arch``, those ``meta`` fixes without)."""
        return head_files.expected_tensors(meta, arch, cls)

    @classmethod
    def check_weights_file(cls, path: str | os.PathLike, meta: dict, arch: TargetArch) -> None:
        """Check ``head.safetensors`` against ``meta`` and ``arch``: readable, the tensors' names, shapes and dtypes,
        the draft vocabulary (:func:`spd_ds.head_files.check_weights_file`: its errors, one line each)."""
        head_files.check_weights_file(path, meta, arch, cls)

    @classmethod
    def check_base_model(cls, path: str | os.PathLike, arch: TargetArch) -> dict:
        """Read the checkpoint's ``head_config.json`` (:meth:`read_config`), check that it was trained for ``arch``
        (model type, fingerprint and hidden size) and that its ``head.safetensors`` is readable and holds the tensors
        a head of that config for ``arch`` has (:meth:`check_weights_file`). Cheap (a header, the draft mask and a
        few hundred target rows), so every rank runs it before any collective. Returns the metadata.

        A checkpoint saved before fingerprint version 2 is checked against
        :meth:`~spd_ds.models.adapter.TargetArch.legacy_fingerprint` and loads with a warning (once per process) to
        re-save it.

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            HeadCheckpointError: a damaged or inconsistent file (one line saying which).
            HeadMismatchError: another base model, or another head format version.
        """
        meta = cls.read_config(path)
        saved_type, this_type = meta.get("base_model_type"), arch.config.model_type
        if saved_type is not None and saved_type != this_type:
            raise HeadMismatchError(
                f"head {path} was trained for a {saved_type} target but {arch.model_dir} is {this_type}; "
                f"use a head trained for {arch.model_dir}"
            )
        legacy = meta.get("fingerprint_version", 1) < FINGERPRINT_VERSION
        mine = arch.legacy_fingerprint() if legacy else arch.fingerprint()
        if meta["base_model_fingerprint"] != mine:
            raise HeadMismatchError(
                f"head {path} was trained for another base model (fingerprint {meta['base_model_fingerprint']}, "
                f"this model {mine}); use a head trained for {arch.model_dir}"
            )
        for key, mine in (("hidden_size", arch.hidden_size), ("vocab_size", arch.vocab_size)):
            if meta[key] != mine:
                raise HeadCheckpointError(f"head {path}: {HEAD_CONFIG} says {key} {meta[key]} but {arch.model_dir} "
                                          f"has {mine}; {RETRAIN_HINT}")
        cls.check_weights_file(path, meta, arch)
        if legacy and str(path) not in _warned_legacy:
            _warned_legacy.add(str(path))
            log.warning("head %s carries a version-1 base-model fingerprint (architecture and the first 8 embedding "
                        "rows only); it matches this model, but re-save the head (SpeculationHead.load(...).save(...)) "
                        "to record the full fingerprint", path)
        return meta

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        arch: TargetArch,
        partition: StagePartition | None = None,
    ) -> "SpeculationHead":
        """Load a head saved by :meth:`save` for base model ``arch`` (after :meth:`check_base_model`).

        Args:
            path: the head folder; arch: the target; partition: the partition the caller runs; must equal the
                checkpoint's (``None`` = take the checkpoint's).
        Returns:
            The head on the CPU, its parameters in torch's default dtype (the stored values, converted: cast it
            with ``.to``), ``draft_ids`` int64 ``[V_d]``.
        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            HeadMismatchError: other base model (fingerprint / dims), head format version or partition.
            HeadCheckpointError: damaged or inconsistent files (see :meth:`check_base_model`).
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        meta = cls.check_base_model(path, arch)
        saved = StagePartition.from_dict(meta["partition"])
        if partition is not None and partition != saved:
            raise HeadMismatchError(
                f"head {path} was trained for partition {saved} but the run uses {partition}; "
                "drop the partition overrides or train a head for this partition"
            )
        try:
            state = load_file(str(Path(path) / HEAD_WEIGHTS))
        except (SafetensorError, OSError) as e:  # changed since check_base_model read its header
            raise HeadCheckpointError(f"head {path}: {HEAD_WEIGHTS} is damaged ({one_line(e)}); copy the "
                                      "checkpoint again or re-save it") from None
        if "draft_mask" in state:
            state["draft_ids"] = state.pop("draft_mask").nonzero().flatten()
        state["draft_ids"] = state["draft_ids"].long()
        from_target = bool(meta.get("lm_head_from_target", False))
        head = cls(arch, saved, meta["num_layers"], state["draft_ids"].tolist(), meta.get("intermediate_size"),
                   init_from_target=False, lm_head_from_target=from_target)
        if from_target:
            state["lm_head.weight"] = head.lm_head.weight.detach().clone()
        head.load_state_dict(state)
        return head


def tower_init_index(layer: int, arch: TargetArch) -> int:
    """The target layer index (``0..L-1``) that ``head.tower_init_layer=layer`` names; needs only the target's config
    (training checks it before the process group starts: :func:`spd_ds.train.preflight.check_target_settings`).

    Raises:
        ConfigError: ``layer`` outside ``[-L, L)``, or a linear-attention layer (Qwen3.5: the tower is full attention).
    """
    L = arch.num_layers
    if not -L <= int(layer) < L:
        raise ConfigError(f"head.tower_init_layer={layer} is outside [-{L}, {L}) for this {L}-layer target")
    k = int(layer) % L
    if arch.is_linear(k):
        full = [i for i in range(L) if not arch.is_linear(i)]
        raise ConfigError(f"head.tower_init_layer={layer}: target layer {k} is linear attention; the tower is full "
                          f"attention: pick one of {full[-4:]} (e.g. {full[-1] - L})")
    return k


def load_draft_vocab(path: str | os.PathLike) -> list[int]:
    """Token ids of a draft-vocabulary JSON (``token_ids``, ``draft_vocab_size``; reference-compatible format).

    Raises:
        OSError: the file cannot be read. json.JSONDecodeError: it is not JSON. KeyError: no ``token_ids``.
        ValueError: ``token_ids`` is not a non-empty list of integers, its length disagrees with
            ``draft_vocab_size``, or the ids are not sorted and unique (one line naming the file).
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is a JSON {type(data).__name__}, not an object with token_ids")
    raw = data["token_ids"]
    if not isinstance(raw, list) or not raw or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise ValueError(f"{path}: token_ids must be a non-empty list of integer token ids")
    ids = [int(x) for x in raw]
    if len(ids) != int(data.get("draft_vocab_size", len(ids))):
        raise ValueError(f"{path}: {len(ids)} token_ids but draft_vocab_size={data['draft_vocab_size']}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{path}: token_ids must be sorted ascending and unique")
    return ids
