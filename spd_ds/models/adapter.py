"""Architecture adapter: the target's pieces built from transformers' own modules, one pipeline stage at a time.

Nothing here re-implements the model: decoder layers, norms and rotary embeddings are instances of the classes
that transformers' ``AutoModelForCausalLM`` uses for the config (found on a meta-device skeleton), and weights are
read tensor by tensor from the checkpoint's safetensors, so a stage process only ever materialises its own layers.
This module knows nothing of DeepSpeed or of SPD's schedule (``spd_ds.pipe`` wraps it).

Supported families: ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mistral`` (full-attention layers only).

Random weights of real shapes (systems benchmarks): ``TargetArch("random:qwen3-4b")``, or any directory holding
``config.json`` + ``random_weights.json`` and no ``*.safetensors``, generates its weights tensor by tensor
(:class:`RandomWeights`); the committed shapes live in ``spd_ds/models/shapes/``.
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

from spd_ds.models.kv_cache import StageKVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one spd-ds can split into stages."""


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
        model_dir: local HF directory (``config.json`` + ``*.safetensors``).
        attn_implementation: transformers attention backend for the layers (``sdpa``, ``eager``, ``flash_attention_2``).

    Raises:
        UnsupportedModelError: unsupported ``model_type`` or sliding-window layers.
    """

    def __init__(self, model_dir: str | os.PathLike, attn_implementation: str = "sdpa") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if str(model_dir).startswith(RANDOM_PREFIX):  # ``random:<shape>``: a committed shape, seeded random weights
            model_dir = random_model_dir(str(model_dir))
        self.model_dir = Path(model_dir)
        cfg = AutoConfig.from_pretrained(self.model_dir)
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {cfg.model_type!r} is not supported; spd-ds splits {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"{self.model_dir}: layers {sorted(set(layer_types))} found; only full-attention layers are supported "
                "(turn sliding windows off in config.json)"
            )
        cfg._attn_implementation = attn_implementation
        self.config = cfg
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
            self._weights = _SafetensorsIndex(self.model_dir)

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
    def max_positions(self) -> int:
        """Context length in positions (``max_position_embeddings``)."""
        return int(getattr(self.config, "max_position_embeddings", 1 << 20))

    @property
    def random_weights(self) -> bool:
        """Whether the weights are generated (:class:`RandomWeights`) rather than read from a checkpoint."""
        return isinstance(self._weights, RandomWeights)

    @property
    def tied_embeddings(self) -> bool:
        """True when the LM head shares the embedding matrix (or the checkpoint has no ``lm_head.weight``)."""
        return bool(getattr(self.config, "tie_word_embeddings", False)) or not self._weights.has("lm_head.weight")

    # ---- module factories ----------------------------------------------------------------------------
    def make_layer(self, idx: int, config=None) -> nn.Module:
        """An HF decoder layer ``idx`` (random init; call :meth:`load_into` for weights)."""
        return self.layer_cls(config or self.config, layer_idx=idx)

    def make_norm(self) -> nn.Module:
        """The target's RMSNorm class over ``H`` (random init; load weights with :meth:`load_into`)."""
        return self.norm_cls(self.hidden_size, eps=self.config.rms_norm_eps)

    def make_rotary(self, config=None) -> nn.Module:
        """The target's rotary-embedding module (``forward(x, position_ids [B, q]) -> (cos, sin)``, fp32 inv_freq)."""
        return self.rotary_cls(config=config or self.config)

    def load_tensor(self, name: str) -> torch.Tensor:
        """One checkpoint tensor by its HF name (e.g. ``model.norm.weight``)."""
        return self._weights.get(name)

    def load_into(self, module: nn.Module, prefix: str) -> None:
        """Fill ``module``'s parameters from checkpoint tensors named ``prefix + <param name>``.

        Raises:
            KeyError: a parameter has no tensor in the checkpoint.
        """
        with torch.no_grad():
            for name, p in module.named_parameters():
                t = self._get_param(prefix + name, p.shape[0] if p.dim() == 3 else 0)
                if t.shape != p.shape:
                    raise ValueError(f"{prefix + name}: checkpoint shape {tuple(t.shape)} != module {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    def _get_param(self, name: str, num_experts: int) -> torch.Tensor:
        """A tensor by name; fused MoE expert tensors are assembled from per-expert HF checkpoint tensors."""
        if self._weights.has(name) or not num_experts:
            return self._weights.get(name)
        base, kind = name.rsplit(".", 1)  # ``...mlp.experts`` + ``gate_up_proj`` | ``down_proj``
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

    def new_cache(self, layer_ids: Iterable[int], max_len: int, dtype: torch.dtype, device) -> StageKVCache:
        """A :class:`StageKVCache` for the given layers of this architecture."""
        return StageKVCache(layer_ids, self.num_kv_heads, self.head_dim, max_len, dtype, device)


FINGERPRINT_VERSION = 2  # of TargetArch.fingerprint; head checkpoints record it (``fingerprint_version``)
FINGERPRINT_ROWS = 64  # rows of the embedding (and of an untied LM head) that the fingerprint hashes


def fingerprint_rows(num_rows: int, count: int = FINGERPRINT_ROWS) -> list[int]:
    """The row indices :meth:`TargetArch.fingerprint` hashes: ``count`` rows evenly spread over ``[0, num_rows)``,
    the first and the last included (all rows when there are fewer)."""
    if num_rows <= count:
        return list(range(num_rows))
    return sorted({round(i * (num_rows - 1) / (count - 1)) for i in range(count)})


class _SafetensorsIndex:
    """Lazy name -> tensor access over one or several ``*.safetensors`` files."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}; save the model with save_pretrained first")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in the checkpoint") from None

    def rows(self, name: str, idx: Sequence[int]) -> torch.Tensor:
        """Rows ``idx`` of the 2-D tensor ``name``, read one by one (not the whole tensor)."""
        try:
            sl = self._where[name].get_slice(name)
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in the checkpoint") from None
        return torch.cat([sl[i:i + 1] for i in idx])


# ---- random weights of real shapes (systems benchmarks; no checkpoint, no tokenizer) ----------------------------
RANDOM_PREFIX = "random:"
RANDOM_WEIGHTS_FILE = "random_weights.json"
SHAPES_DIR = Path(__file__).resolve().parent / "shapes"


def random_shapes() -> list[str]:
    """Names of the committed shape configs (``spd_ds/models/shapes/<name>/config.json``)."""
    return sorted(p.parent.name for p in SHAPES_DIR.glob(f"*/{RANDOM_WEIGHTS_FILE}"))


def random_model_dir(name: str) -> Path:
    """Directory of a committed random-weight shape: ``"random:qwen3-4b"`` (or ``"qwen3-4b"``) -> ``shapes/qwen3-4b``.

    Raises:
        ValueError: unknown shape (the message lists the known ones).
    """
    key = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    d = SHAPES_DIR / key.strip().lower()
    if not (d / RANDOM_WEIGHTS_FILE).is_file():
        known = ", ".join(RANDOM_PREFIX + n for n in random_shapes())
        raise ValueError(f"unknown random model shape {key!r}; known: {known}")
    return d


def is_random_model_dir(path: str | os.PathLike) -> bool:
    """A directory with ``config.json`` and ``random_weights.json`` but no ``*.safetensors`` (weights are generated)."""
    p = Path(path)
    return (p / RANDOM_WEIGHTS_FILE).is_file() and not any(p.glob("*.safetensors"))


class RandomWeights:
    """Seeded random weights of a real architecture, generated tensor by tensor on request (same interface as the
    safetensors index: :meth:`has`, :meth:`get`).

    Every tensor comes from its own CPU ``torch.Generator`` seeded by ``sha256(seed, name)``, so its values depend only
    on ``(seed, std, name, shape)``: a stage process generates only its own layers and still gets the same weights as
    any other process. Values: ``normal(0, std)`` (``std`` defaults to the config's ``initializer_range``, else
    0.02) in fp32; parameters whose name contains ``norm`` are ones; biases are zeros.

    Args:
        shapes: HF parameter name -> shape (from a meta-device skeleton of the model).
        seed: generator seed.
        std: standard deviation of the weight matrices.
    """

    GENERATOR = "torch-cpu-normal-per-tensor-v1"

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0, std: float = 0.02) -> None:
        self.shapes, self.seed, self.std = dict(shapes), int(seed), float(std)

    @classmethod
    def from_skeleton(cls, skeleton: nn.Module, model_dir: Path, config) -> "RandomWeights":
        """Names/shapes of ``skeleton``'s (deduplicated, so tied weights appear once) parameters; seed and std from
        ``model_dir/random_weights.json`` (``{"seed": int, "std": float | null}``)."""
        spec = json.loads((Path(model_dir) / RANDOM_WEIGHTS_FILE).read_text())
        std = spec.get("std") or getattr(config, "initializer_range", None) or 0.02
        shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
        return cls(shapes, int(spec.get("seed", 0)), float(std))

    def has(self, name: str) -> bool:
        """Whether ``name`` is a parameter of the architecture (a tied LM head is not)."""
        return name in self.shapes

    def get(self, name: str) -> torch.Tensor:
        """The fp32 tensor ``name`` (generated now; a few hundred MB/s on one CPU core).

        Raises:
            KeyError: not a parameter of this architecture.
        """
        if name not in self.shapes:
            raise KeyError(f"tensor {name!r} is not a parameter of this random-weight model")
        shape = self.shapes[name]
        leaf = name.rsplit(".", 2)
        if "norm" in name:
            return torch.ones(shape)
        if leaf[-1] == "bias":
            return torch.zeros(shape)
        key = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
        return torch.empty(shape).normal_(0.0, self.std, generator=g)

    def rows(self, name: str, idx: Sequence[int]) -> torch.Tensor:
        """Rows ``idx`` of tensor ``name`` (the whole tensor is generated)."""
        return self.get(name)[list(idx)]

    def identity(self) -> bytes:
        """What the weights are a function of (for :meth:`TargetArch.fingerprint`)."""
        return json.dumps([self.GENERATOR, self.seed, self.std, sorted(self.shapes.items())]).encode()


def causal_mask(q: int, past: int, device) -> torch.Tensor | None:
    """Boolean attention mask ``[1, 1, q, past + q]`` (True = attend) for ``q`` new rows after ``past`` cached ones.

    Returns ``None`` for ``q == 1`` (a single row attends to everything before it).
    """
    if q == 1:
        return None
    k = torch.arange(past + q, device=device)
    rows = torch.arange(q, device=device)[:, None] + past
    return (k[None, :] <= rows)[None, None]


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

    def __init__(self, arch: TargetArch, layers: Sequence[int], dtype: torch.dtype, device, capture: Iterable[int] = ()):
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
            cache: the stage's :class:`StageKVCache` (advanced by ``q``), or ``None`` (no cache: causal over ``q``).
        Returns:
            ``(hidden [1, q, H], {j: [1, q, H]})``: the stage output and the raw outputs of the layers whose
            hidden-state index ``j`` is an aggregation anchor.
        """
        q = hidden.shape[1]
        past = cache.length if cache is not None else 0
        pos_emb = self.rotary(hidden, positions[None])
        mask = causal_mask(q, past, hidden.device)
        captured = {}
        kw = {self.arch.cache_kwarg: cache}
        for i, layer in zip(self.layer_ids, self.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=positions[None], position_embeddings=pos_emb, **kw)
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

    def __init__(self, arch: TargetArch, dtype: torch.dtype, device, with_embedding: bool = True, with_lm_head: bool = True):
        super().__init__()
        H, V = arch.hidden_size, arch.vocab_size
        self.embedding = nn.Embedding(V, H) if with_embedding else None
        self.norm = arch.make_norm() if with_lm_head else None
        self.lm_head = nn.Linear(H, V, bias=False) if with_lm_head else None
        with torch.no_grad():
            if self.embedding is not None:
                self.embedding.weight.copy_(arch.load_tensor("model.embed_tokens.weight"))
            if self.lm_head is not None:
                arch.load_into(self.norm, "model.norm.")
                name = "model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight"
                self.lm_head.weight.copy_(arch.load_tensor(name))
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
        """One KV cache per stage."""
        return [self.arch.new_cache(st.layer_ids, max_len, self.dtype, self.device) for st in self.stages]


def head_layer_config(arch: TargetArch, num_layers: int, intermediate_size: int | None = None):
    """Config for the speculation head's tower: the target's, with ``num_layers`` dense full-attention layers."""
    cfg = copy.deepcopy(arch.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * num_layers
    if hasattr(cfg, "mlp_only_layers"):  # MoE targets: the head tower is dense
        cfg.mlp_only_layers = list(range(num_layers))
    if intermediate_size:
        cfg.intermediate_size = intermediate_size
    return cfg
