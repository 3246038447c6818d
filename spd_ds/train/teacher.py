"""The frozen target as a DeepSpeed ``PipelineModule`` built from the run's :class:`StagePartition`.

One :class:`TeacherStage` per SPD stage (the stage's decoder layers, built from transformers' own layer classes
through :class:`~spd_ds.models.adapter.TargetArch`; stage 0 adds the embedding, the last stage the final norm and LM
head). ``PipelineModule(num_stages=pipe_degree, partition_method="uniform")`` then places them:

* ``pipe_degree = 1`` (the target fits one device): one pipeline stage holding all SPD stages; every rank is a
  data-parallel replica;
* ``pipe_degree = n``: pipeline stage ``s`` is SPD stage ``s`` (each rank materialises only its own layers).

Activations between stages: ``(hidden [B,S,H], segments [B,S], valid [B,S] int64, feats [B,S,m,H])``. The last stage
returns the features the head trains on and the distillation targets at the loss positions only::

    (feats [B,S,m,H], logits_draft [N,V_d] fp32, lse_full [N] fp32, argmax_full [N] int64)

``feats[..., k, :]`` is the raw (pre-final-norm) hidden state at anchor ``b_k`` — exactly what
``spd_ds.decoding.reference.prefill`` and the stage forwards give the head at inference. Documents packed into one
row attend only within themselves and restart their positions; linear-attention layers (Qwen3.5), whose state would
run on from one document into the next, see each document on its own from a zero state (the documents of a
micro-batch as one right-padded batch, :func:`~spd_ds.train.mask.document_gather`), as a prompt's prefill does.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from spd_ds.models.adapter import TargetArch
from spd_ds.partition import StagePartition
from spd_ds.train.loss import TeacherTargets
from spd_ds.train.mask import document_gather, packed_causal_block_mask, packed_causal_mask, segment_positions

#: ``train.teacher_attention`` values once resolved (:func:`teacher_attention`).
TEACHER_ATTENTION = ("sdpa", "flex")


class TeacherStage(nn.Module):
    """SPD stage ``stage`` of the frozen target, as one ``PipelineModule`` layer (see module doc).

    Args:
        arch: the target's :class:`TargetArch`.
        partition: the run's partition.
        stage: SPD stage index.
        dtype: compute dtype.
        draft_ids: ``[V_d]`` sorted target ids of the draft vocabulary (last stage only).
        temperature: distillation temperature (for ``lse_full``).
        logits_chunk: loss positions per LM-head chunk (bounds the ``[chunk, V]`` temporary).
        attention: the softmax-attention layers' attention (``train.teacher_attention`` resolved): ``sdpa`` under
            :func:`~spd_ds.train.mask.packed_causal_mask`, or ``flex``: FlexAttention under
            :func:`~spd_ds.train.mask.packed_causal_block_mask` (only tiles inside a document's causal triangle).

    Raises:
        ValueError: an unknown ``attention``.
    """

    def __init__(self, arch: TargetArch, partition: StagePartition, stage: int, dtype: torch.dtype,
                 draft_ids: Sequence[int], temperature: float = 1.0, logits_chunk: int = 4096,
                 attention: str = "sdpa") -> None:
        super().__init__()
        if attention not in TEACHER_ATTENTION:
            raise ValueError(f"teacher attention must be one of {TEACHER_ATTENTION}, got {attention!r}")
        self.attention = attention
        layer_config = None
        if attention == "flex":
            from spd_ds.train.student import FLEX_ATTENTION, register_flex_attention

            register_flex_attention()
            layer_config = copy.copy(arch.config)
            layer_config._attn_implementation = FLEX_ATTENTION
        self.arch, self.stage = arch, stage
        n, H, V = partition.num_stages, arch.hidden_size, arch.vocab_size
        self.first, self.last = stage == 0, stage == n - 1
        self.num_types = partition.num_types
        self.temperature, self.logits_chunk = float(temperature), int(logits_chunk)
        k_of = {a: k for k, a in enumerate(partition.anchors)}
        self.capture = {a - 1: k_of[a] for a in partition.stage_anchors(stage) if a >= 1}
        self.layer_ids = list(partition.stage_range(stage))
        self.embedding = nn.Embedding(V, H) if self.first else None
        self.layers = nn.ModuleList(arch.make_layer(i, None if arch.is_linear(i) else layer_config)
                                    for i in self.layer_ids)
        self.rotary = arch.make_rotary()
        self.norm = arch.make_norm() if self.last else None
        self.lm_head = nn.Linear(H, V, bias=False) if self.last else None
        with torch.no_grad():
            if self.first:
                arch.load_into(self.embedding, "model.embed_tokens.")
            for i, layer in zip(self.layer_ids, self.layers):
                arch.load_into(layer, f"model.layers.{i}.")
            if self.last:
                arch.load_into(self.norm, "model.norm.")
                arch.load_into(self.lm_head, "model.embed_tokens." if arch.tied_embeddings else "lm_head.")
        self.register_buffer("draft_ids", torch.as_tensor(list(draft_ids), dtype=torch.long), persistent=False)
        self._reduce = target_reductions
        self.to(dtype=dtype)
        self.rotary.inv_freq = self.rotary.inv_freq.float()
        self.eval().requires_grad_(False)

    def forward(self, inputs: tuple) -> tuple:
        """One SPD stage of the frozen target over packed rows (DeepSpeed pipeline stage).

        Args:
            inputs: first stage ``(ids [B, S] int64, segments [B, S] int64, valid [B, S], index [P] int64)``;
                later stages ``(hidden [B, S, H], segments, valid, feats [B, S, m, H], index)``; ``index`` holds the
                flat positions ``b·S + t`` of ``valid``'s nonzeros, ascending (made on the host with the batch, so
                selecting the loss positions needs no device-to-host sync).
        Returns:
            ``(hidden, segments, valid, feats, index)`` for the next stage; the last stage returns
            ``(feats [B, S, m, H], draft-vocabulary logits [P, V_d] fp32, logsumexp of the full-vocabulary
            logits / T [P] fp32, full-vocabulary argmax [P] int64)`` at the ``P`` loss positions.
            ``feats[..., k, :]`` is the raw hidden state at anchor ``b_k`` (pre-final-norm, as at inference).
        """
        if self.first:
            ids, segments, valid, index = inputs
            h = self.embedding(ids)
            feats = h.new_zeros(*h.shape[:2], self.num_types, h.shape[-1])
            feats[:, :, 0] = h
        else:
            h, segments, valid, feats, index = inputs
        pos = segment_positions(segments)
        mask = packed_causal_block_mask(segments) if self.attention == "flex" else packed_causal_mask(segments)
        pos_emb = self.rotary(h, pos)
        docs = document_gather(segments) if any(self.arch.is_linear(i) for i in self.layer_ids) else None
        for i, layer in zip(self.layer_ids, self.layers):
            if docs is not None and self.arch.is_linear(i):
                h = _per_document(layer, h, *docs)
            else:
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pos_emb)
            if isinstance(h, tuple):
                h = h[0]
            if i in self.capture:
                feats[:, :, self.capture[i]] = h
        if not self.last:
            return h, segments, valid, feats, index
        t = self.targets(h, valid, index)
        return feats, t.logits_draft, t.lse_full, t.argmax_full

    def compile_layers(self, backend: str = "inductor") -> int:
        """``torch.compile`` this stage's softmax-attention decoder layers in place (``nn.Module.compile``) so that
        their elementwise work (norms, rotary, activation, residuals) runs as fused kernels instead of one eager kernel
        each: an eager teacher step is launch-bound on a small target (docs/training.md, "Training throughput").
        The layers share one graph (parameters are graph inputs); linear-attention layers run per document at varying
        shapes and stay eager. Numerics follow the backend (``aot_eager``: the eager kernels; ``inductor``: fused,
        within rounding of eager). The last stage also compiles :func:`target_reductions` (one fused pass over each
        ``[chunk, V]`` LM-head output instead of a cast, a division and three reductions; dynamic in the number of
        positions).

        Args:
            backend: a ``torch.compile`` backend name (``torch.compiler.list_backends(exclude_tags=())``).

        Returns:
            the number of layers compiled (``nn.Module.compile`` is lazy: the compile, and any backend error, come
            with the first forward; ``config_checks.validate`` checks ``train.compile_teacher`` against the backends).
        """
        if self.last:
            self._reduce = torch.compile(target_reductions, backend=backend, dynamic=True)
        count = 0
        for i, layer in zip(self.layer_ids, self.layers):
            if not self.arch.is_linear(i):
                layer.compile(backend=backend)
                count += 1
        return count

    @torch.no_grad()
    def targets(self, hidden: torch.Tensor, valid: torch.Tensor, index: torch.Tensor | None = None) -> TeacherTargets:
        """Distillation targets at the loss positions (``valid`` nonzero, row-major), LM head in chunks.

        Args:
            hidden: ``[B, S, H]`` last-stage output (pre-final-norm). valid: ``[B, S]`` loss-position flags.
            index: optional ``[P]`` int64 flat indices of ``valid``'s nonzeros (then ``valid`` is not read).
        Returns:
            :class:`TeacherTargets` over the ``P`` loss positions: draft-vocabulary logits ``[P, V_d]`` fp32,
            logsumexp of the full-vocabulary logits / T ``[P]`` fp32, full-vocabulary argmax ``[P]`` int64.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])
        rows = flat.index_select(0, index) if index is not None else flat[valid.reshape(-1).bool()]
        ld, lse, am = [], [], []
        for c in range(0, rows.shape[0], self.logits_chunk):
            z = self.lm_head(self.norm(rows[c:c + self.logits_chunk]))
            for out, part in zip((ld, lse, am), self._reduce(z, self.draft_ids, self.temperature)):
                out.append(part)
        if not ld:
            Vd = self.draft_ids.numel()
            return TeacherTargets(rows.new_zeros(0, Vd, dtype=torch.float32), rows.new_zeros(0, dtype=torch.float32),
                                  torch.zeros(0, dtype=torch.long, device=rows.device))
        return TeacherTargets(torch.cat(ld), torch.cat(lse), torch.cat(am))


def target_reductions(z: torch.Tensor, draft_ids: torch.Tensor,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the loss needs from one chunk of the teacher's LM-head output (the fields of :class:`TeacherTargets`).

    Args:
        z: ``[P, V]`` full-vocabulary logits (any float dtype; reduced in fp32).
        draft_ids: ``[V_d]`` int64 target ids of the draft vocabulary.
        temperature: distillation temperature ``T > 0``.
    Returns:
        ``(z[:, draft_ids] [P, V_d] fp32, logsumexp(z / T) [P] fp32, argmax(z) [P] int64)``.
    """
    z = z.float()
    return z[:, draft_ids], torch.logsumexp(z / temperature, dim=-1), z.argmax(-1)


def _per_document(layer: nn.Module, h: torch.Tensor, gather: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A linear-attention decoder layer over each document of the packed rows ``h [B, S, H]`` separately (from a
    zero state; right padding cannot reach earlier positions of a causal layer). Padding positions pass unchanged."""
    B, S, H = h.shape
    flat = h.reshape(B * S, H)
    docs = torch.cat([flat, flat.new_zeros(1, H)])[gather]  # [D, Lmax, H]
    out = layer(docs, attention_mask=None, position_embeddings=None)
    if isinstance(out, tuple):
        out = out[0]
    res = flat.clone()
    res[gather[valid]] = out[valid]
    return res.view(B, S, H)


def compile_backend(mode: str | None, device: torch.device) -> str | None:
    """The ``torch.compile`` backend from ``train.compile_teacher`` (the teacher's decoder layers and target
    reductions) or ``train.compile_loss`` (:func:`~spd_ds.train.loss.kl_chunk`): one rule for both settings.

    ``"auto"`` (the default) is ``"inductor"`` on CUDA when Triton is installed (inductor's GPU kernels need it) — an
    eager teacher step on a small target is launch-bound: SmolLM2-135M, n = 2, one H200, 154k -> 203k training
    tokens/s in one bench run (docs/training.md, "Training throughput") — and eager (``None``) elsewhere, where
    compiling costs more start-up than it saves; any other value is returned as it is (``None`` = eager; backend
    names are checked by ``config_checks.validate``).

    Args:
        mode: ``"auto"``, a backend name or ``None``.
        device: the training device.
    Returns:
        the backend name, or ``None`` for eager.
    """
    if mode == "auto":
        return "inductor" if device.type == "cuda" and _has_triton() else None
    return mode


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def teacher_attention(mode: str, device: torch.device) -> str:
    """``train.teacher_attention`` -> ``sdpa`` or ``flex``. ``auto`` is ``sdpa`` on every device: on one H200
    (SmolLM2 n = 2, 8 x 2048-token packed rows, teacher and loss compiled) a training step ran at 239k tokens/s with
    cuDNN SDPA under the packed-causal boolean mask and at 134k with FlexAttention under the packed-causal block mask
    (docs/training.md, "Training throughput"); ``flex`` stays selectable.

    Args:
        mode: ``"auto"``, ``"sdpa"`` or ``"flex"``.
        device: the training device (unused by ``auto`` today; kept so that a device-specific choice needs no new
            signature).
    Returns:
        ``"sdpa"`` or ``"flex"`` (:data:`TEACHER_ATTENTION`).
    Raises:
        ValueError: an unknown mode.
    """
    if mode == "auto":
        return "sdpa"
    if mode not in TEACHER_ATTENTION:
        raise ValueError(f"train.teacher_attention must be auto, sdpa or flex, got {mode!r}")
    return mode


def build_teacher_module(arch: TargetArch, partition: StagePartition, dtype: torch.dtype, pipe_degree: int,
                         draft_ids: Sequence[int], temperature: float = 1.0, dynamic_shape: bool = False,
                         compile_backend: str | None = None, attention: str = "sdpa"):
    """The frozen target as a ``deepspeed.pipe.PipelineModule`` with ``pipe_degree`` pipeline stages; with
    ``compile_backend`` (``train.compile_teacher``) the decoder layers of this rank's stages are compiled
    (:meth:`TeacherStage.compile_layers`; their number in the module's ``compiled_layers``); ``attention``: the
    stages' attention (:class:`TeacherStage`).

    Raises:
        ValueError: ``pipe_degree`` is neither 1 nor ``n``.
        ModelFileError: a tensor of any stage missing from the checkpoint or of another shape, on every rank before
            the module's collectives (:meth:`TargetArch.check_weights`; with ``pipe_degree = n`` only the stage's own
            rank would load it).
    """
    from deepspeed.pipe import LayerSpec, PipelineModule

    n = partition.num_stages
    if pipe_degree not in (1, n):
        raise ValueError(f"train.teacher_pipe_degree must be 1 or partition.num_stages={n}, got {pipe_degree}")
    arch.check_weights()
    specs = [LayerSpec(TeacherStage, arch, partition, s, dtype, list(draft_ids), temperature, attention=attention)
             for s in range(n)]
    module = PipelineModule(layers=specs, num_stages=pipe_degree, partition_method="uniform",
                            dynamic_shape=dynamic_shape or pipe_degree > 1)
    module.compiled_layers = sum(stage.compile_layers(compile_backend) for stage in module.modules()
                                 if compile_backend and isinstance(stage, TeacherStage))
    return module


def with_loss_index(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` plus ``loss_index``: ``[P]`` int64 flat positions ``b·S + t`` of ``batch["valid"]``'s nonzeros.

    Call it where the batch is collated (on the host): the teacher and the head then select the loss positions by
    index, with no device-to-host synchronisation.
    """
    return {**batch, "loss_index": batch["valid"].reshape(-1).nonzero().flatten()}


class Teacher:
    """Runs the frozen target through a DeepSpeed ``PipelineEngine`` and hands every rank its share of the targets.

    With ``pipe_degree = n`` the last stage broadcasts features and targets over its pipeline group, and each rank
    of the pipeline keeps the rows ``r`` with ``r % n == stage`` — so the head trains on every GPU.

    Args:
        engine: the ``PipelineEngine`` from ``deepspeed.initialize(model=build_teacher_module(...))``.
        feat_dtype: dtype of ``feats`` (the teacher's compute dtype).
        num_types, hidden_size, draft_vocab_size: shapes for the receivers.
    """

    def __init__(self, engine, feat_dtype: torch.dtype, num_types: int, hidden_size: int,
                 draft_vocab_size: int) -> None:
        self.engine = engine
        self.feat_dtype, self.m, self.H, self.Vd = feat_dtype, num_types, hidden_size, draft_vocab_size
        self.degree = engine.num_stages
        self.stage = engine.stage_id
        # the pipeline engine's last stage copies the label to its device every micro-batch (`batch[1].to(device)`):
        # a host tensor there is a synchronous copy that waits for the whole queue; one already on the device is not
        self._label = torch.zeros(1, device=engine.device)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, TeacherTargets]:
        """Teacher forward on one micro-batch.

        Args:
            batch: ``input_ids``, ``segments``, ``valid`` (``[B, S]``, from :meth:`BatchPlanner.collate`).
        Returns:
            ``(my_batch, feats [B', S, m, H], targets at my loss positions)`` where ``my_batch`` is the share of rows
            this rank trains the head on (all rows for ``pipe_degree = 1``).
        """
        eng = self.engine
        dev = eng.device
        if "loss_index" not in batch:
            batch = with_loss_index(batch)
        ids, seg, valid, index = (batch[k].to(dev, non_blocking=True)
                                  for k in ("input_ids", "segments", "valid", "loss_index"))
        eng.total_loss = None  # eval_batch accumulates outputs into it otherwise
        inputs = (ids, seg, valid.long(), index)
        out = eng.eval_batch(iter([(inputs, self._label)]), compute_loss=False, reduce_output=None,
                             bcast_loss=False, num_micro_batches=1)
        if eng.is_last_stage():
            feats, ld, lse, am = out[0]
            eng.fwd_outputs = []
        else:
            B, S = ids.shape
            N = int(index.shape[0])
            feats = torch.empty(B, S, self.m, self.H, dtype=self.feat_dtype, device=dev)
            ld = torch.empty(N, self.Vd, dtype=torch.float32, device=dev)
            lse = torch.empty(N, dtype=torch.float32, device=dev)
            am = torch.empty(N, dtype=torch.long, device=dev)
        if self.degree > 1:
            import deepspeed.comm as dist

            src = eng.grid.stage_to_global(self.degree - 1)
            group = eng.grid.get_pipe_parallel_group()
            for t in (feats, ld, lse, am):
                dist.broadcast(t, src=src, group=group)
        targets = TeacherTargets(ld, lse, am)
        mine = {"input_ids": ids, "segments": seg, "valid": valid, "loss_index": index}
        if self.degree > 1:
            B = ids.shape[0]
            keep = torch.arange(B, device=dev) % self.degree == self.stage
            row_of_pos = torch.arange(B, device=dev)[:, None].expand_as(valid)[valid]
            targets = targets.select(keep[row_of_pos].nonzero().flatten())
            mine = {k: v[keep] for k, v in mine.items() if k != "loss_index"}
            mine["loss_index"] = mine["valid"].reshape(-1).nonzero().flatten()
            feats = feats[keep]
        return mine, feats, targets
