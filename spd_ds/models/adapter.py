"""Architecture adapter: the target's pieces built from transformers' own modules, one pipeline stage at a time.

Nothing here re-implements the model: decoder layers, norms and rotary embeddings are instances of the classes
that transformers' ``AutoModelForCausalLM`` uses for the config (found on a meta-device skeleton), and weights are
read tensor by tensor from the checkpoint's safetensors, so a stage process only ever materialises its own layers.
This module knows nothing of DeepSpeed or of SPD's schedule (``spd_ds.pipe`` wraps it).

Supported families: ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mistral`` (full-attention layers), and the
hybrid Qwen3.5 family (``qwen3_5_text``, ``qwen3_5_moe_text``, and the text model inside a composite ``qwen3_5`` /
``qwen3_5_moe`` checkpoint): three of every four layers are Gated DeltaNet linear attention, whose conv and recurrent
states live in a :class:`~spd_ds.models.linear_cache.HybridStageCache` (snapshot rings: exact rollback by cropping).

Random weights of real shapes (systems benchmarks): ``TargetArch("random:qwen3-4b")``, or any directory holding
``config.json`` + ``random_weights.json`` and no ``*.safetensors``, generates its weights tensor by tensor
(:class:`~spd_ds.models.weights.RandomWeights`); the committed shapes live in ``spd_ds/models/shapes/``.
The weight sources (checkpoint, composite checkpoint, random) are in :mod:`spd_ds.models.weights`.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from spd_ds.cli import one_line
from spd_ds.models.errors import ModelFileError, UnsupportedModelError
from spd_ds.models.kv_cache import StageKVCache
from spd_ds.models.linear_cache import HybridStageCache, LinearStateShape
from spd_ds.models.masks import causal_mask, layer_mask
from spd_ds.models.weights import (
    RANDOM_PREFIX, PrefixedWeights, RandomWeights, SafetensorsIndex, is_random_model_dir, random_model_dir,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral",
                         "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
# text model types whose layers may be linear attention (Gated DeltaNet), and composite checkpoints holding one
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
COMPOSITE_MODEL_TYPES = {"qwen3_5": "model.language_model.", "qwen3_5_moe": "model.language_model."}
# MoE text model -> the dense model type of the same family (the speculation head's tower is dense)
DENSE_SIBLING = {"qwen3_5_moe_text": "qwen3_5_text"}
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
             "output_router_logits", "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
_FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # fused MoE expert parameters [E, ..] (per-expert in HF checkpoints)
DEFAULT_MAX_ROLLBACK = 7  # linear-attention rewind when the pipeline depth is not given (n <= 8)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a ``torch.dtype``) -> ``torch.dtype``; ValueError otherwise."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"model.dtype={name!r} is not one of float32, bfloat16, float16") from None


class TargetArch:
    """The target's config and its transformers module classes.

    Args:
        model_dir: local HF directory (``config.json`` + ``*.safetensors``), or ``random:<shape>``.
        attn_implementation: transformers attention backend for the layers (``sdpa`` or ``eager``:
            :mod:`spd_ds.models.masks`).
        max_rollback: hybrid targets only: the deepest rewind a stage cache must support (``n - 1`` for ``n``
            pipeline stages; :func:`spd_ds.builder.build_arch` passes the run's). It sizes the linear-attention snapshot
            rings of :meth:`new_cache` (``max_rollback + 1`` states per layer); ``None`` = ``DEFAULT_MAX_ROLLBACK``.

    For a composite checkpoint (``qwen3_5``: text model + vision tower) :attr:`config` is its ``text_config`` and
    only the language model's tensors are read (``model.language_model.*``, ``lm_head.weight``).

    Attributes:
        max_positions: the context in positions (int): ``max_position_embeddings``, or the sliding window when it is
            shorter (a Mistral-style window over every layer: exact full attention up to its length, and spd-ds goes
            no further). max_positions_source: the config.json key that sets it (``"sliding_window"`` or
            ``"max_position_embeddings"``).

    Raises:
        UnsupportedModelError: unsupported ``model_type``, sliding-window layers, or a Qwen3.5 checkpoint with a
            transformers too old to know it.
        ModelFileError: a ``config.json`` transformers cannot read, or safetensors that are missing or damaged.
    """

    def __init__(self, model_dir: str | os.PathLike, attn_implementation: str = "sdpa",
                 max_rollback: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if str(model_dir).startswith(RANDOM_PREFIX):  # ``random:<shape>``: a committed shape, seeded random weights
            model_dir = random_model_dir(str(model_dir))
        self.model_dir = Path(model_dir)
        top = _load_config(self.model_dir)
        if top.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {top.model_type!r} is not supported; spd-ds splits {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.composite = top.model_type in COMPOSITE_MODEL_TYPES
        cfg = top.text_config if self.composite else top
        layer_types = getattr(cfg, "layer_types", None) or []
        allowed = {"full_attention", "linear_attention"} if cfg.model_type in HYBRID_MODEL_TYPES else {"full_attention"}
        if any(t not in allowed for t in layer_types):
            raise UnsupportedModelError(
                f"{self.model_dir}: layers {sorted(set(layer_types))} found; only {' and '.join(sorted(allowed))} "
                "layers are supported (turn sliding windows off in config.json)"
            )
        cfg._attn_implementation = attn_implementation
        self.config = cfg
        # a window over every layer (Mistral's ``sliding_window``; the families with ``layer_types`` name theirs there,
        # refused above): the stages attend to the whole context, which equals the window's attention only while the
        # context fits the window, so the window caps :attr:`max_positions`
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.sliding_window = int(window) if window and not hasattr(cfg, "layer_types") else None
        positions = int(getattr(cfg, "max_position_embeddings", 1 << 20))
        windowed = self.sliding_window is not None and self.sliding_window < positions
        self.max_positions = self.sliding_window if windowed else positions
        self.max_positions_source = "sliding_window" if windowed else "max_position_embeddings"
        # a composite checkpoint ties (or not) as its top-level model does; a missing lm_head.weight always ties
        self._tie = bool(getattr(top, "tie_word_embeddings", False))
        self.max_rollback = DEFAULT_MAX_ROLLBACK if max_rollback is None else int(max_rollback)
        self._linear = frozenset(i for i, t in enumerate(layer_types) if t == "linear_attention")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(cfg)
        self.layer_cls = type(skeleton.model.layers[0])
        self.norm_cls = type(skeleton.model.norm)
        self.rotary_cls = type(skeleton.model.rotary_emb)
        params = inspect.signature(self.layer_cls.forward).parameters
        # transformers renamed ``past_key_values`` -> ``cache`` (5.2x); support both spellings.
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if is_random_model_dir(self.model_dir):
            self._weights = RandomWeights.from_skeleton(skeleton, self.model_dir, cfg)
        else:
            self._weights = SafetensorsIndex(self.model_dir)
            if self.composite:
                self._weights = PrefixedWeights(self._weights, "model.", COMPOSITE_MODEL_TYPES[top.model_type])

    # ---- geometry -----------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """``L``, decoder layers of the target."""
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """``H``, residual-stream width."""
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """``V``, target vocabulary size."""
        return int(self.config.vocab_size)

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer (GQA)."""
        return int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        """Per-head width of queries/keys/values."""
        hd = getattr(self.config, "head_dim", None)
        return int(hd) if hd else self.hidden_size // int(self.config.num_attention_heads)

    @property
    def random_weights(self) -> bool:
        """Whether the weights are generated (:class:`RandomWeights`) rather than read from a checkpoint."""
        return isinstance(self._weights, RandomWeights)

    @property
    def tied_embeddings(self) -> bool:
        """True when the LM head shares the embedding matrix (or the checkpoint has no ``lm_head.weight``)."""
        return self._tie or not self._weights.has("lm_head.weight")

    @property
    def hybrid(self) -> bool:
        """Whether some layers are linear attention (Qwen3.5): their state lives in :class:`HybridStageCache`."""
        return bool(self._linear)

    def is_linear(self, idx: int) -> bool:
        """Whether decoder layer ``idx`` is a linear-attention (Gated DeltaNet) layer."""
        return idx in self._linear

    @property
    def linear_state_shape(self) -> LinearStateShape | None:
        """Per-sequence state geometry of a linear-attention layer (``None`` for targets without any)."""
        return LinearStateShape.from_config(self.config) if self._linear else None

    # ---- module factories ----------------------------------------------------------------------------
    def make_layer(self, idx: int, config=None) -> nn.Module:
        """An HF decoder layer ``idx`` (random init; call :meth:`load_into` for weights)."""
        return self.layer_cls(config or self.config, layer_idx=idx)

    def make_norm(self) -> nn.Module:
        """The target's RMSNorm class over ``H`` (random init; load weights with :meth:`load_into`)."""
        return self.norm_cls(self.hidden_size, eps=self.config.rms_norm_eps)

    def make_rotary(self, config=None) -> nn.Module:
        """The target's rotary-embedding module (``forward(x, position_ids [B, q]) -> (cos, sin)``, fp32 inv_freq).

        Multimodal-RoPE text towers (Qwen3.5: position ids ``[3, B, q]`` for time/height/width) are wrapped in
        :class:`TextPositionRotary`, which repeats the text positions on the three axes, as transformers' text model
        does for text-only input.
        """
        rot = self.rotary_cls(config=config or self.config)
        return TextPositionRotary(rot) if self.config.model_type in HYBRID_MODEL_TYPES else rot

    def head_layer_class(self, config) -> type:
        """The decoder-layer class for the speculation head's tower config (the dense sibling for MoE targets)."""
        if config.model_type == self.config.model_type:
            return self.layer_cls
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return type(AutoModelForCausalLM.from_config(config).model.layers[0])

    def has_tensor(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor of this HF name (generated shapes: whether the model has it)."""
        return self._weights.has(name)

    def load_tensor(self, name: str) -> torch.Tensor:
        """One checkpoint tensor by its HF name (e.g. ``model.norm.weight``)."""
        return self._weights.get(name)

    def load_into(self, module: nn.Module, prefix: str) -> None:
        """Fill ``module``'s parameters from checkpoint tensors named ``prefix + <param name>`` (a fused MoE expert
        parameter the checkpoint lacks: from its per-expert tensors), each checked against its header first.

        Raises:
            ModelFileError: a parameter has no tensor in the checkpoint, or one of another shape.
        """
        with torch.no_grad():
            for name, p in module.named_parameters():
                self._check_shapes(self._stored_shapes(prefix + name, tuple(p.shape)))
                p.copy_(self._get_param(prefix + name, p.shape[0] if p.dim() == 3 else 0).to(p.dtype))

    def check_weights(self) -> None:
        """Check from the safetensors headers alone (no tensor data read) that the checkpoint holds every tensor the
        stages and ends load, of config.json's shape: each decoder layer's parameters as :meth:`make_layer` builds them
        (meta device; a fused MoE expert parameter the checkpoint lacks as its per-expert tensors), the final norm, the
        embedding and the LM head. Cheap, so every rank runs it before any collective and a damaged checkpoint fails
        everywhere with the line of the rank that loads the tensor. Random weights: nothing to check.

        Raises:
            ModelFileError: a tensor is missing or of another shape (the messages of :meth:`load_into`).
        """
        if self.random_weights:
            return
        want = {name: (self.vocab_size, self.hidden_size) for name in
                ["model.embed_tokens.weight"] + ([] if self.tied_embeddings else ["lm_head.weight"])}
        with torch.device("meta"):
            modules = [(f"model.layers.{i}.", self.make_layer(i)) for i in range(self.num_layers)]
            modules.append(("model.norm.", self.make_norm()))
        for prefix, module in modules:
            for name, p in module.named_parameters():
                want.update(self._stored_shapes(prefix + name, tuple(p.shape)))
        self._check_shapes(want)

    def _check_shapes(self, want: dict[str, tuple[int, ...]]) -> None:
        """ModelFileError for the first tensor of ``want`` (name -> shape by config.json) that the checkpoint lacks or
        holds in another shape (read from the file headers)."""
        for name, shape in want.items():
            stored = tuple(self._weights.shape(name))
            if stored != shape:
                raise ModelFileError(f"{self.model_dir}: tensor {name} has shape {stored} in the checkpoint but "
                                     f"{shape} by config.json; the weights and the config are of different models")

    def _stored_shapes(self, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors that parameter ``name`` of ``shape`` is read from, with their shapes: itself, or for
        a fused MoE expert parameter the checkpoint lacks, the per-expert tensors :meth:`_get_param` assembles."""
        base, _, kind = name.rpartition(".")
        if self._weights.has(name) or len(shape) != 3 or kind not in _FUSED_EXPERTS:
            return {name: shape}
        if kind == "gate_up_proj":  # [E, 2I, H] = per expert cat(gate_proj [I, H], up_proj [I, H])
            half = (shape[1] // 2, *shape[2:])
            return {f"{base}.{e}.{proj}.weight": half for e in range(shape[0]) for proj in ("gate_proj", "up_proj")}
        return {f"{base}.{e}.{kind}.weight": shape[1:] for e in range(shape[0])}

    def _get_param(self, name: str, num_experts: int) -> torch.Tensor:
        """A tensor by name; fused MoE expert tensors are assembled from per-expert HF checkpoint tensors."""
        base, _, kind = name.rpartition(".")  # ``...mlp.experts`` + ``gate_up_proj`` | ``down_proj``
        if self._weights.has(name) or not num_experts or kind not in _FUSED_EXPERTS:
            return self._weights.get(name)
        if kind == "gate_up_proj":
            parts = [torch.cat([self._weights.get(f"{base}.{e}.gate_proj.weight"),
                                self._weights.get(f"{base}.{e}.up_proj.weight")], 0) for e in range(num_experts)]
        else:
            parts = [self._weights.get(f"{base}.{e}.{kind}.weight") for e in range(num_experts)]
        return torch.stack(parts)

    def fingerprint(self) -> str:
        """A short id of the base model's weights (version :data:`FINGERPRINT_VERSION`), 16 hex digits.

        SHA-256 over the architecture numbers (model type, layers, hidden size, vocabulary, tied LM head), the rows
        :func:`fingerprint_rows` of the embedding and of the LM head (when untied), spread over the whole vocabulary
        with the first and the last row included, and the whole final norm, all as fp32 bytes. Reads
        ``2 * FINGERPRINT_ROWS`` rows and one vector, so every rank can afford it before any collective; a model that
        differs only in rows that are not sampled (and nowhere else that is hashed) is not told apart. Random-weight
        shapes hash their generator's identity instead of rows. Computed once per :class:`TargetArch`.
        """
        if getattr(self, "_fingerprint", None) is None:
            h = hashlib.sha256()
            c = self.config
            h.update(json.dumps([f"spd-fingerprint-v{FINGERPRINT_VERSION}", c.model_type, self.num_layers,
                                 self.hidden_size, self.vocab_size, self.tied_embeddings]).encode())
            if isinstance(self._weights, RandomWeights):  # the generator's identity instead of sampled rows
                h.update(self._weights.identity())
            else:
                idx = fingerprint_rows(self.vocab_size)
                names = ["model.embed_tokens.weight"] + ([] if self.tied_embeddings else ["lm_head.weight"])
                for name in names:
                    h.update(self._weights.rows(name, idx).to(torch.float32).contiguous().numpy().tobytes())
                h.update(self._weights.get("model.norm.weight").to(torch.float32).contiguous().numpy().tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def legacy_fingerprint(self) -> str:
        """The version-1 fingerprint (architecture numbers and the first 8 embedding rows only), which heads saved
        before :data:`FINGERPRINT_VERSION` 2 carry; it cannot tell models apart that differ from row 8 on."""
        h = hashlib.sha256()
        c = self.config
        h.update(json.dumps([c.model_type, self.num_layers, self.hidden_size, self.vocab_size]).encode())
        if isinstance(self._weights, RandomWeights):
            h.update(self._weights.identity())
        else:
            emb = self._weights.rows("model.embed_tokens.weight", list(range(8))).to(torch.float32).contiguous()
            h.update(emb.numpy().tobytes())
        return h.hexdigest()[:16]

    def new_cache(self, layer_ids: Iterable[int], max_len: int, dtype: torch.dtype, device, *, static: bool = False,
                  max_rollback: int | None = None) -> StageKVCache:
        """The cache of a stage over ``layer_ids``: a :class:`StageKVCache`, or for layers that include linear
        attention a :class:`~spd_ds.models.linear_cache.HybridStageCache` whose rings hold ``max_rollback + 1``
        states per linear layer (default :attr:`max_rollback`). ``crop(length)`` rolls both back exactly.

        Args:
            layer_ids: global decoder-layer indices of the stage.
            max_len: KV capacity in positions.
            dtype, device: of the buffers (the layers' compute dtype).
            static: static mode (CUDA graphs; see :mod:`spd_ds.models.graphs`).
            max_rollback: deepest rewind to support (``n - 1``).
        """
        ids = list(layer_ids)
        linear = [i for i in ids if self.is_linear(i)]
        if not linear:
            return StageKVCache(ids, self.num_kv_heads, self.head_dim, max_len, dtype, device, static=static)
        return HybridStageCache(ids, linear, self.num_kv_heads, self.head_dim, max_len, dtype, device,
                                shape=self.linear_state_shape, static=static,
                                max_rollback=self.max_rollback if max_rollback is None else max_rollback)


FINGERPRINT_VERSION = 2  # of TargetArch.fingerprint; head checkpoints record it (``fingerprint_version``)
FINGERPRINT_ROWS = 64  # rows of the embedding (and of an untied LM head) that the fingerprint hashes


def fingerprint_rows(num_rows: int, count: int = FINGERPRINT_ROWS) -> list[int]:
    """The row indices :meth:`TargetArch.fingerprint` hashes: ``count`` rows evenly spread over ``[0, num_rows)``,
    the first and the last included (all rows when there are fewer)."""
    if num_rows <= count:
        return list(range(num_rows))
    return sorted({round(i * (num_rows - 1) / (count - 1)) for i in range(count)})


def _load_config(model_dir: Path):
    """``AutoConfig`` of ``model_dir``.

    Raises:
        UnsupportedModelError: a ``model_type`` this transformers does not know (a Qwen3.5 checkpoint: the version
            needed; another: the supported types).
        ModelFileError: a ``config.json`` that cannot be read or parsed.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        p = Path(model_dir) / "config.json"
        try:
            mt = json.loads(p.read_text()).get("model_type", "") if p.is_file() else ""
        except (OSError, ValueError, AttributeError):
            mt = ""
        if isinstance(mt, str) and mt.startswith("qwen3_5"):
            import transformers

            raise UnsupportedModelError(f"{model_dir}: model_type {mt!r} needs transformers >= 5.2 "
                                        f"(installed {transformers.__version__})") from None
        if isinstance(mt, str) and mt and mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {mt!r} is not supported; spd-ds splits "
                                        f"{', '.join(SUPPORTED_MODEL_TYPES)}") from None
        raise ModelFileError(f"{p} cannot be read as a transformers config ({one_line(e, 300)}); "
                             "fix or re-download the model") from None


class TextPositionRotary(nn.Module):
    """A multimodal-RoPE rotary module (``position_ids [3, B, q]``) called with text positions ``[B, q]``.

    ``forward(x, position_ids [B, q]) -> (cos, sin)`` repeats the positions on the three mRoPE axes (text-only input,
    as transformers' text model does). ``inv_freq`` reads and writes the wrapped module's (fp32 RoPE frequencies).
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.inner.inv_freq

    def __setattr__(self, name: str, value) -> None:
        if name == "inv_freq":  # the wrapped module's buffer (nn.Module would register one of ours)
            self.inner.inv_freq = value
        else:
            super().__setattr__(name, value)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        """``x [B, q, *]`` (dtype/device only), ``position_ids [B, q]`` int64 -> ``(cos, sin)`` in ``x``'s dtype."""
        return self.inner(x, position_ids[None].expand(3, *position_ids.shape))


class TargetStage(nn.Module):
    """Decoder layers ``[lo, hi)`` of the target plus what a stage needs around them.

    Args:
        arch: the :class:`TargetArch`.
        layers: global layer indices of this stage (contiguous).
        dtype, device: compute dtype and device.
        capture: hidden-state indices ``j >= 1`` to record (anchors this stage produces).

    ``forward(hidden [1, q, H], positions [q] int64, cache)`` returns ``(hidden [1, q, H], {j: [1, q, H]})`` where
    the dict holds the raw (pre-final-norm) outputs of the captured layers.
    """

    def __init__(self, arch: TargetArch, layers: Sequence[int], dtype: torch.dtype, device,
                 capture: Iterable[int] = ()):
        super().__init__()
        self.arch = arch
        self.layer_ids = list(layers)
        self.layers = nn.ModuleList(arch.make_layer(i) for i in self.layer_ids)
        for i, layer in zip(self.layer_ids, self.layers):
            arch.load_into(layer, f"model.layers.{i}.")
        self.rotary = arch.make_rotary()
        self.capture = {j - 1: j for j in capture if j >= 1}
        self.to(device=device, dtype=dtype)
        self.rotary.to(device)  # inv_freq stays fp32
        self.rotary.inv_freq = self.rotary.inv_freq.float()
        self.eval().requires_grad_(False)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cache: StageKVCache | None):
        """Eager forward of ``q`` tokens through this stage's layers (length-based cache: the CPU exactness path).

        Args:
            hidden: ``[1, q, H]`` input (embeddings for stage 0), the stage's dtype.
            positions: int64 ``[q]`` token positions (RoPE), ``cache.length .. cache.length + q - 1``.
            cache: the stage's :class:`StageKVCache` or :class:`HybridStageCache` (advanced by ``q``), or ``None``
                (no cache: causal over ``q``, linear-attention layers from a zero state).
        Returns:
            ``(hidden [1, q, H], {j: [1, q, H]})``: the stage output and the raw outputs of the layers whose
            hidden-state index ``j`` is an aggregation anchor.
        """
        q = hidden.shape[1]
        past = cache.length if cache is not None else 0
        pos_emb = self.rotary(hidden, positions[None])
        mask = layer_mask(causal_mask(q, past, hidden.device), self.arch.config._attn_implementation, hidden.dtype)
        captured = {}
        kw = {self.arch.cache_kwarg: cache}
        for i, layer in zip(self.layer_ids, self.layers):
            m = None if self.arch.is_linear(i) else mask  # linear attention is causal by construction
            hidden = layer(hidden, attention_mask=m, position_ids=positions[None], position_embeddings=pos_emb, **kw)
            if isinstance(hidden, tuple):  # older transformers return (hidden,)
                hidden = hidden[0]
            if i in self.capture:
                captured[self.capture[i]] = hidden
        if cache is not None:
            cache.advance(q)
        return hidden, captured


class TargetEnds(nn.Module):
    """Embedding, final norm and LM head of the target (the parts around the stages).

    ``embed(ids [1, q] int64) -> [1, q, H]``; ``logits(h_raw [.., H]) -> fp32 [.., V]`` applies the final norm first.
    """

    def __init__(self, arch: TargetArch, dtype: torch.dtype, device, with_embedding: bool = True,
                 with_lm_head: bool = True):
        super().__init__()
        H, V = arch.hidden_size, arch.vocab_size
        self.embedding = nn.Embedding(V, H) if with_embedding else None
        self.norm = arch.make_norm() if with_lm_head else None
        self.lm_head = nn.Linear(H, V, bias=False) if with_lm_head else None
        with torch.no_grad():
            if self.embedding is not None:
                arch.load_into(self.embedding, "model.embed_tokens.")  # shapes checked: a one-line ModelFileError
            if self.lm_head is not None:
                arch.load_into(self.norm, "model.norm.")
                arch.load_into(self.lm_head, "model.embed_tokens." if arch.tied_embeddings else "lm_head.")
        self.to(device=device, dtype=dtype)
        self.eval().requires_grad_(False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``ids [1, q] int64 -> [1, q, H]`` in the compute dtype."""
        return self.embedding(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target logits: raw last-layer states ``[.., H]`` -> final norm -> LM head -> fp32 ``[.., V]``."""
        return self.lm_head(self.norm(hidden)).float()


class Target(nn.Module):
    """The whole target as ``n`` :class:`TargetStage` s plus :class:`TargetEnds` (single-process use).

    Args:
        arch: :class:`TargetArch`.
        partition: :class:`~spd_ds.partition.StagePartition` (its anchors decide what each stage captures).
        dtype, device: compute dtype/device.
    """

    def __init__(self, arch: TargetArch, partition, dtype: torch.dtype, device) -> None:
        super().__init__()
        if partition.num_layers != arch.num_layers:
            raise ValueError(
                f"partition has {partition.num_layers} layers but {arch.model_dir} has {arch.num_layers}"
            )
        self.arch, self.partition = arch, partition
        self.dtype, self.device = dtype, torch.device(device)
        self.ends = TargetEnds(arch, dtype, device)
        self.stages = nn.ModuleList(
            TargetStage(arch, partition.stage_range(s), dtype, device, capture=partition.stage_anchors(s))
            for s in range(partition.num_stages)
        )

    def new_caches(self, max_len: int) -> list[StageKVCache]:
        """One cache per stage (linear-attention layers: rings for rewinds up to ``n - 1`` tokens)."""
        rb = self.partition.num_stages - 1
        return [self.arch.new_cache(st.layer_ids, max_len, self.dtype, self.device, max_rollback=rb)
                for st in self.stages]


def head_layer_config(arch: TargetArch, num_layers: int, intermediate_size: int | None = None):
    """Config for the speculation head's tower: the target's, with ``num_layers`` dense full-attention layers.

    Hybrid (Qwen3.5) targets get their full (gated, partial-RoPE) attention layer; MoE targets a dense MLP: the
    MoE-only-layers switch for ``qwen3_moe``, the dense sibling config (``qwen3_5_text``) for ``qwen3_5_moe_text``,
    whose MLP width defaults to ``moe_intermediate_size x num_experts_per_tok`` (the routed experts a token uses).
    """
    cfg = copy.deepcopy(arch.config)
    sibling = DENSE_SIBLING.get(cfg.model_type)
    if sibling is not None:
        from transformers import AutoConfig

        d = {k: v for k, v in cfg.to_dict().items() if k not in _MOE_KEYS and k not in ("model_type", "architectures")}
        width = int(cfg.moe_intermediate_size) * int(cfg.num_experts_per_tok)
        cfg = AutoConfig.for_model(sibling, **{**d, "intermediate_size": width})
        cfg._attn_implementation = arch.config._attn_implementation
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * num_layers
    if hasattr(cfg, "mlp_only_layers"):  # MoE targets: the head tower is dense
        cfg.mlp_only_layers = list(range(num_layers))
    if intermediate_size:
        cfg.intermediate_size = intermediate_size
    return cfg
