"""Where the target's weights come from, tensor by tensor: a checkpoint's safetensors (:class:`SafetensorsIndex`), a
composite checkpoint's language model under the text model's names (:class:`PrefixedWeights`), or seeded random
weights of a real architecture (:class:`RandomWeights`, for systems benchmarks; shapes in ``spd_ds/models/shapes/``).

Each source answers ``has(name)``, ``get(name)``, ``rows(name, idx)`` and ``shape(name)``;
:class:`spd_ds.models.adapter.TargetArch` picks one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from spd_ds.cli import one_line
from spd_ds.models.errors import ModelFileError


# ---- checkpoints ------------------------------------------------------------------------------------------------
class SafetensorsIndex:
    """Lazy name -> tensor access over one or several ``*.safetensors`` files: the shards that
    ``model.safetensors.index.json`` names when the folder has one (other files, e.g. Mistral's
    ``consolidated.safetensors``, are not read), else every ``*.safetensors``.

    Raises:
        ModelFileError: no safetensors, a shard the index names is missing, or a file is damaged.
    """

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ModelFileError(f"{index} cannot be read ({type(e).__name__}: {e}); re-download the "
                                     "model") from None
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise ModelFileError(f"{model_dir} lacks {len(missing)} of the {len(shards)} weight shards its "
                                     f"model.safetensors.index.json names ({', '.join(missing[:3])}); finish or redo "
                                     "the download")
            files = [model_dir / s for s in shards]
        if not files:
            if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
                raise ModelFileError(f"{model_dir} holds PyTorch .bin/.pt weights and no *.safetensors; convert them "
                                     "(load the model with transformers and save_pretrained(dir, "
                                     "safe_serialization=True))")
            raise ModelFileError(f"no *.safetensors in {model_dir}; save the model with save_pretrained first")
        self._handles = []
        for f in files:
            try:
                self._handles.append(safe_open(str(f), framework="pt"))
            except Exception as e:  # noqa: BLE001 - safetensors' own error type: a damaged or truncated file
                raise ModelFileError(f"{f} is not a readable safetensors file ({one_line(e, 200)}); "
                                     "re-save or re-download the model") from None
        self._where = {k: h for h in self._handles for k in h.keys()}
        self.model_dir = model_dir

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)
        except KeyError:
            raise self._missing(name) from None

    def rows(self, name: str, idx: Sequence[int]) -> torch.Tensor:
        """Rows ``idx`` of the 2-D tensor ``name``, read one by one (not the whole tensor)."""
        try:
            sl = self._where[name].get_slice(name)
        except KeyError:
            raise self._missing(name) from None
        return torch.cat([sl[i:i + 1] for i in idx])

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` from its file's header (no tensor data is read).

        Raises:
            ModelFileError: no tensor of that name in the checkpoint.
        """
        try:
            return tuple(self._where[name].get_slice(name).get_shape())
        except KeyError:
            raise self._missing(name) from None

    def _missing(self, name: str) -> ModelFileError:
        return ModelFileError(f"tensor {name!r} is not in the checkpoint of {self.model_dir}; the weights and "
                              "config.json are of different models, or a file is missing")


class PrefixedWeights:
    """A composite checkpoint's language model seen under the text model's names (``model.X`` is read from
    ``model.language_model.X`` when the checkpoint has no ``model.X``; ``lm_head.weight`` as is)."""

    def __init__(self, inner, prefix: str, stored_prefix: str) -> None:
        self._inner, self._prefix, self._stored = inner, prefix, stored_prefix

    def _name(self, name: str) -> str:
        if not self._inner.has(name) and name.startswith(self._prefix):
            return self._stored + name[len(self._prefix):]
        return name

    def has(self, name: str) -> bool:
        return self._inner.has(self._name(name))

    def get(self, name: str) -> torch.Tensor:
        return self._inner.get(self._name(name))

    def rows(self, name: str, idx: Sequence[int]) -> torch.Tensor:
        return self._inner.rows(self._name(name), idx)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._inner.shape(self._name(name))


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
    0.02) in fp32; parameters whose name contains ``norm`` are their class's identity value (ones, or zeros for
    zero-centred norms that scale by ``1 + weight``, as Qwen3.5's); biases are zeros.

    Args:
        shapes: HF parameter name -> shape (from a meta-device skeleton of the model).
        seed: generator seed.
        std: standard deviation of the weight matrices.
        zero_norms: names of norm weights whose identity value is zero.
    """

    GENERATOR = "torch-cpu-normal-per-tensor-v1"

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0, std: float = 0.02,
                 zero_norms: Iterable[str] = ()) -> None:
        self.shapes, self.seed, self.std = dict(shapes), int(seed), float(std)
        self.zero_norms = frozenset(zero_norms)

    @classmethod
    def from_skeleton(cls, skeleton: nn.Module, model_dir: Path, config) -> "RandomWeights":
        """Names/shapes of ``skeleton``'s (deduplicated, so tied weights appear once) parameters; seed and std from
        ``model_dir/random_weights.json`` (``{"seed": int, "std": float | null}``)."""
        spec = json.loads((Path(model_dir) / RANDOM_WEIGHTS_FILE).read_text())
        std = spec.get("std") or getattr(config, "initializer_range", None) or 0.02
        shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
        return cls(shapes, int(spec.get("seed", 0)), float(std), _zero_centred_norms(skeleton, shapes))

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
        if name in self.zero_norms:
            return torch.zeros(shape)
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

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (nothing is generated). Raises KeyError as :meth:`get` does."""
        if name not in self.shapes:
            raise KeyError(f"tensor {name!r} is not a parameter of this random-weight model")
        return self.shapes[name]

    def identity(self) -> bytes:
        """What the weights are a function of (for :meth:`TargetArch.fingerprint`)."""
        ident = [self.GENERATOR, self.seed, self.std, sorted(self.shapes.items())]
        if self.zero_norms:  # only hybrid shapes have them: the other shapes keep their fingerprints
            ident.append(sorted(self.zero_norms))
        return json.dumps(ident).encode()


def _zero_centred_norms(skeleton: nn.Module, shapes: dict) -> list[str]:
    """Names of the norm weights in ``shapes`` whose module class initialises them to zeros (``(1 + w) x`` norms),
    found by building one small instance of each norm class on the CPU."""
    init_zero: dict[type, bool] = {}
    out = []
    for mname, mod in skeleton.named_modules():
        name = f"{mname}.weight" if mname else "weight"
        if "norm" not in name or name not in shapes or not isinstance(getattr(mod, "weight", None), nn.Parameter):
            continue
        kind = type(mod)
        if kind not in init_zero:
            try:
                with torch.device("cpu"):
                    probe = kind(4)
                init_zero[kind] = bool(torch.all(probe.weight == 0))
            except Exception:  # noqa: BLE001 - a norm class with another constructor: keep the ones default
                init_zero[kind] = False
        if init_zero[kind]:
            out.append(name)
    return out
