"""The speculation head in its training layout (the module the ZeRO-2 engine wraps).

From the teacher's anchor features ``feats [B, S, m, H]`` and a pipeline fill ``F`` it builds the rows of
:mod:`spd_ds.train.mask` — block ``d`` (depth ``d < F``) holds ``g_{f(d)}``, the last block holds the complete rows
``g_{m-1}`` — runs the tower under the structural mask and returns the head's draft-vocabulary logits of the
depth-0 rows at the loss positions.

Attention over the ``(F+1)·S`` rows runs one of two ways (``train.attention``), which compute the same function:

* ``dense``: the boolean :func:`~spd_ds.train.mask.structural_mask` ``[B, 1, (F+1)S, (F+1)S]`` through the target
  layer's own attention (SDPA): memory and work grow with the square of ``(F+1)·S``;
* ``flex``: PyTorch FlexAttention with :func:`~spd_ds.train.mask.structural_block_mask` (registered with
  transformers as the attention implementation :data:`FLEX_ATTENTION` for the head's layers while training): only
  tiles holding an allowed key are computed, about ``(F+1)·S²/2`` scores instead of ``((F+1)·S)²``. FlexAttention
  has no CPU backward, so ``auto`` means ``flex`` on CUDA and ``dense`` elsewhere (``dense`` after FlexAttention
  fails at the first forward, or when the run being resumed ran dense: :class:`HeadTrainModule`'s ``fallback``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from spd_ds.head import SpeculationHead
from spd_ds.train.mask import block_types, segment_positions, structural_block_mask, structural_mask

#: Name of the FlexAttention implementation registered with transformers' ``AttentionInterface``.
FLEX_ATTENTION = "spd_structural_flex"
ATTENTION_MODES = ("auto", "flex", "dense")
#: ``train.flex_compile``: how FlexAttention is compiled on CUDA. ``static``: one compile per shape (per pipeline
#: fill, and for validation); ``dynamic``: torch.compile's automatic dynamic shapes (a recompile on the second
#: shape, then one kernel for every fill) -- fewer compiles at start-up, speed to be measured against ``static``.
FLEX_COMPILE_MODES = {"static": False, "dynamic": None}
_compiled_flex = None
_flex_dynamic: bool | None = False


def set_flex_compile(mode: str, shapes: int = 8) -> None:
    """Choose how the CUDA FlexAttention path compiles (:data:`FLEX_COMPILE_MODES`); drops an earlier compile.

    One compiled function serves every FlexAttention call of a run (the head's, in training and validation, and the
    teacher's), so with ``static`` it holds one graph per shape and grad mode: ``2n + 1`` for a run of ``n`` stages
    (n training fills, n validation fills, the teacher). Past dynamo's recompile limit (8 by default) a call would fall
    back to unfused FlexAttention, which materialises the whole score matrix (tens of GB at n = 6); so the limit is
    raised to ``shapes`` when lower (never lowered).

    Args:
        mode: ``train.flex_compile``.
        shapes: graphs the run may need.
    Raises:
        ValueError: an unknown mode.
    """
    global _compiled_flex, _flex_dynamic
    if mode not in FLEX_COMPILE_MODES:
        raise ValueError(f"train.flex_compile must be one of {', '.join(FLEX_COMPILE_MODES)}, got {mode!r}")
    _flex_dynamic, _compiled_flex = FLEX_COMPILE_MODES[mode], None
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, int(shapes))


def structural_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: FlexAttention under a :class:`BlockMask` (``attention_mask``).

    Args:
        module: the attention module (unused).
        query: ``[B, h, R, d]``; key, value: ``[B, h_kv, R, d]`` (grouped-query heads allowed).
        attention_mask: a ``BlockMask`` (:func:`~spd_ds.train.mask.structural_block_mask` for the head,
            :func:`~spd_ds.train.mask.packed_causal_block_mask` for the teacher).
        scaling: softmax scale (default ``d ** -0.5``).

    Returns:
        ``(out [B, R, h, d], None)`` as transformers' attention functions return.

    Raises:
        ValueError: ``dropout > 0`` (the head trains without attention dropout).
    """
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if dropout:
        raise ValueError("attention dropout is not supported by the structural FlexAttention path")
    fn = flex_attention
    # eager callers get the compiled kernel; inside a compiled region (the teacher's compiled layers) dynamo captures
    # flex_attention itself and generates the kernel with the rest of the graph
    if query.device.type == "cuda" and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=_flex_dynamic)
        fn = _compiled_flex
    out = fn(query, key.to(query.dtype), value.to(query.dtype), block_mask=attention_mask, scale=scaling,
             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_flex_attention() -> None:
    """Register :func:`structural_flex_attention` with transformers as :data:`FLEX_ATTENTION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_ATTENTION, structural_flex_attention)


@contextlib.contextmanager
def _attention_implementation(config, name: str):
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old


def resolve_attention(mode: str, device: torch.device, ran: str | None = None) -> str:
    """``train.attention`` -> ``flex`` or ``dense`` (``auto``: flex on CUDA, dense elsewhere).

    Args:
        mode: ``train.attention``.
        device: the head's device.
        ran: the attention the run being resumed trained with (its ``run.json``; ``None``: a fresh run, or not
            recorded). ``auto`` keeps it where it can run (``dense`` anywhere, ``flex`` on CUDA), so that a run
            whose FlexAttention failed and fell back to ``dense`` goes on with ``dense`` where flex works.
    Raises:
        ValueError: unknown mode, or ``flex`` off CUDA (FlexAttention has no CPU backward).
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"train.attention must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode == "auto":
        if ran == "dense" or (ran == "flex" and device.type == "cuda"):
            return ran
        return "flex" if device.type == "cuda" else "dense"
    if mode == "flex" and device.type != "cuda":
        raise ValueError("train.attention=flex needs CUDA (FlexAttention has no CPU backward); use auto or dense")
    return mode


class HeadTrainModule(nn.Module):
    """Wraps a :class:`SpeculationHead` for training (``forward`` = the training layout; see module doc).

    Args:
        head: the head (trained in place).
        attention: ``flex`` or ``dense`` (:func:`resolve_attention`); :attr:`attention` is what runs, ``dense``
            after a fallback.
        fallback: what a failure of FlexAttention on the first forward does: ``False`` raises it; ``True``
            (``train.attention=auto`` on a fresh run) warns once and trains with the dense mask from then on; a
            str (``auto`` resuming a run that trained with flex: its numerics are the run's) raises ``ConfigError``
            with that text and the failure, in one line.
        autocast: the head's compute dtype under autocast (``None``: off).
    Raises:
        ValueError: ``attention`` other than flex or dense.
    """

    def __init__(self, head: SpeculationHead, attention: str = "dense", fallback: bool | str = False,
                 autocast: torch.dtype | None = None) -> None:
        super().__init__()
        if attention not in ("flex", "dense"):
            raise ValueError(f"attention must be flex or dense (resolve 'auto' with resolve_attention), "
                             f"got {attention!r}")
        self.head = head
        self.depth_to_type = head.partition.depth_to_type
        self.attention = attention
        self._fallback = fallback  # flex failed on first use (e.g. no Triton): warn once and train with dense
        self.autocast = autocast
        if attention == "flex":
            register_flex_attention()

    def forward(self, feats: torch.Tensor, segments: torch.Tensor, valid: torch.Tensor, fill: int,
                loss_index: torch.Tensor | None = None) -> torch.Tensor:
        """Head logits at the loss positions.

        Args:
            feats: ``[B, S, m, H]`` raw anchor hidden states from the teacher.
            segments: ``[B, S]`` int64 document ids (0 = padding).
            valid: ``[B, S]`` bool loss positions.
            fill: pipeline fill ``F`` in ``1..n``.
            loss_index: optional ``[N]`` int64 flat indices ``b·S + t`` of the loss positions (``valid``'s nonzeros,
                ascending), computed where ``valid`` was made: selecting with it needs no device-to-host sync.

        Returns:
            ``[N, V_d]`` fp32 logits, ``N = valid.sum()``, in row-major order of the positions (computed under
            ``torch.autocast(dtype=self.autocast)`` when set: the weights stay fp32, matrix products run in bf16).
        """
        if self.autocast is None:
            return self._forward(feats, segments, valid, fill, loss_index)
        with torch.autocast(feats.device.type, dtype=self.autocast):
            return self._forward(feats, segments, valid, fill, loss_index).float()

    def _forward(self, feats, segments, valid, fill, loss_index):
        head = self.head
        B, S, m, H = feats.shape
        types = block_types(fill, self.depth_to_type)
        wdtype = head.aggr[0].weight.dtype
        rows_of = {k: head.aggr[k](feats[:, :, : k + 1].reshape(B, S, (k + 1) * H).to(wdtype)) for k in set(types)}
        rows = torch.cat([rows_of[k] for k in types], dim=1)  # [B, (F+1)·S, H]
        positions = segment_positions(segments).repeat(1, len(types))
        if self.attention == "flex":
            try:
                with _attention_implementation(head.config, FLEX_ATTENTION):
                    h = head.tower(rows, positions, mask=structural_block_mask(segments, fill))
            except Exception as e:  # noqa: BLE001 - only with train.attention=auto, on the first forward
                if not self._fallback or isinstance(e, torch.cuda.OutOfMemoryError):
                    raise  # out of memory is not a FlexAttention failure: the dense path needs more
                if isinstance(self._fallback, str):
                    from spd_ds.config import ConfigError

                    why = str(e).splitlines()[0][:200] if str(e) else "no message"
                    raise ConfigError(f"{self._fallback} (FlexAttention failed: {type(e).__name__}: {why})") from None
                import warnings

                warnings.warn(f"train.attention=auto: FlexAttention failed ({type(e).__name__}: {str(e)[:200]}); "
                              "training with the dense structural mask instead")
                self.attention = "dense"
                h = head.tower(rows, positions, mask=structural_mask(segments, fill))
            self._fallback = False
        else:
            h = head.tower(rows, positions, mask=structural_mask(segments, fill))
        h0 = h[:, :S].reshape(B * S, -1)
        h0 = h0.index_select(0, loss_index) if loss_index is not None else h0[valid.reshape(-1).bool()]
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
