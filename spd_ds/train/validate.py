"""Validation while training: a held-out split, the head's agreement at every fill, the predicted acceptance, the best
head.

Every ``train.eval_every`` optimizer steps (and at the end of the run) the loop calls :meth:`Validator.run`: the
teacher runs over a fixed set of held-out micro-batches (``train.eval_batches`` of them, shared round-robin over the
data-parallel ranks), the head runs in its training layout at **every** fill ``F = 1..n`` (no grad), and the top-1
agreement by fill ``a_F`` (:func:`spd_ds.train.loss.top1_agreement`: what T = 0 acceptance of a draft made at fill
``F`` measures) becomes the predicted T = 0 draft acceptance ``α`` and equivalent accept length
``L' = n/(1+(n-1)(1-α))`` of the reference decoder (:mod:`spd_ds.train.acceptance`). The figures go to
``train_log.jsonl`` (``val_agreement_by_fill``, ``val_pred_acceptance``, ``val_pred_accept_length``,
``val_positions``, ``val_s``, and the same figures outside loops: ``val_loop_share``, ``..._noloop``; and for
drafts sampled at ``train.kd_temperature``: the mean acceptance probability by fill ``Σ min(p_T, q_T)``
(``val_overlap_by_fill_sampled``) and the predicted figures from it, ``..._sampled`` and ``..._sampled_noloop``) and
the progress bar; the head with the best loop-free predicted ``L'`` so far is written to
``<output_dir>/best_head/`` (:meth:`SpeculationHead.save` + ``best.json``: the step, its figures and ``init_steps``,
the steps of the head the run started from).

The held-out split (:func:`spd_ds.train.split.split_held_out`, by conversation) is a pure function of each record's
conversation key and ``train.seed``, so every rank, every resume and every world size holds out the same records.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from spd_ds.eval.report import REPEAT_NGRAM
from spd_ds.head_files import REPLACED_SUFFIX
from spd_ds.train.acceptance import agreement_from_counts, predict_acceptance
from spd_ds.train.chat import EmptyMaskError
from spd_ds.train.batching import loop_positions
from spd_ds.train.loss import TeacherTargets, draft_overlap, top1_agreement
from spd_ds.train.teacher import with_loss_index

BEST_DIR = "best_head"
BEST_FILE = "best.json"
BEST_TMP = BEST_DIR + ".tmp"  # the next best head while it is written
BEST_BACKUP = BEST_DIR + REPLACED_SUFFIX  # the best head being replaced, until its successor is in place
BEST_KEY = "val_pred_accept_length_noloop"  # what picks the best head: L' outside loops (tracks the benchmark's)


def held_out_plan(lengths: Sequence[int], seq_len: int, rows_per_batch: int,
                  pack: bool) -> list[list[list[int]]]:
    """Every held-out micro-batch of the split, in order (the same list on every rank, resume and world size).

    Examples are packed first-fit-decreasing in their order (``pack``; else one per row, sorted by length) into
    rows of ``seq_len`` tokens, ``rows_per_batch`` rows per micro-batch (the last one padded with empty rows).

    Returns:
        ``[rows]`` per micro-batch, ``rows`` listing example indices per row (``BatchPlanner.collate``'s input).
    Raises:
        ValueError: no example.
    """
    from spd_ds.train.batching import pack_rows

    if not lengths:
        raise ValueError("the held-out split has no example to evaluate on")
    order = list(range(len(lengths)))
    rows = pack_rows(lengths, order, seq_len) if pack else [[i] for i in sorted(order, key=lambda i: lengths[i])]
    batches = [rows[i:i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]
    batches[-1] = batches[-1] + [[] for _ in range(rows_per_batch - len(batches[-1]))]
    return batches


def eval_batches_used(max_batches: int | None, available: int) -> int:
    """The held-out micro-batches a validation runs over all ranks: ``train.eval_batches`` (``max_batches``;
    ``None`` = all) capped by the ``available`` micro-batches of the split (:func:`held_out_plan`; 0 without one)."""
    return available if max_batches is None else min(int(max_batches), available)


def held_out_batches(lengths: Sequence[int], seq_len: int, rows_per_batch: int, pack: bool, dp_rank: int,
                     dp_world: int, max_batches: int | None = None,
                     plan: list[list[list[int]]] | None = None) -> list[tuple[list[list[int]], bool]]:
    """This rank's held-out micro-batches: the same fixed list at every evaluation.

    The first ``max_batches`` (``None`` = all) micro-batches of :func:`held_out_plan` are dealt round-robin to the
    data-parallel ranks. Ranks left with fewer get repeats of the first micro-batch flagged ``False`` (run, not
    counted): the teacher's pipeline engine holds a barrier per forward, so every rank must run the same number.

    Args:
        plan: :func:`held_out_plan` of these arguments when the caller has it (``None``: made here).
    Returns:
        ``[(rows, counted)]`` where ``rows`` lists example indices per row (``BatchPlanner.collate``'s input).
    Raises:
        ValueError: no example, or ``max_batches < 1``.
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"train.eval_batches must be >= 1 (or null for all), got {max_batches}")
    batches = held_out_plan(lengths, seq_len, rows_per_batch, pack) if plan is None else plan
    batches = batches[:eval_batches_used(max_batches, len(batches))]
    mine = [(b, True) for b in batches[dp_rank::dp_world]]
    per_rank = math.ceil(len(batches) / dp_world)
    return mine + [(batches[0], False)] * (per_rank - len(mine))


def recover_best_head(out_dir: str | Path) -> str | None:
    """Put a run's best head back in place after a crash while it was being replaced.

    :meth:`Validator._save_best` writes the new head to ``best_head.tmp/``, renames ``best_head/`` to
    ``best_head.old/``, renames ``best_head.tmp/`` to ``best_head/`` and removes ``best_head.old/``: whenever
    ``best_head/`` is missing between two of those steps, ``best_head.old/`` holds the previous best (the one the run's
    newest checkpoint knows, since that replacement came after it). This restores it, and removes what the crash left
    over: a ``best_head.old/`` beside a ``best_head/`` (the replacement had finished), a ``best_head.tmp/``
    (written in part, or never moved into place; a resumed run writes it again when that head is again the best).

    Args:
        out_dir: the run's ``train.output_dir``.
    Returns:
        A line saying what was restored, or ``None`` when ``best_head/`` was in place (or never written).
    Raises:
        OSError: the file system refused a rename or removal.
    """
    out = Path(out_dir)
    best, backup, tmp = out / BEST_DIR, out / BEST_BACKUP, out / BEST_TMP
    said = None
    if backup.is_dir() and not best.exists():
        backup.rename(best)
        said = (f"restored {best} from {backup} (the run stopped while replacing its best head: the previous best "
                "is back in place)")
    shutil.rmtree(backup, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return said


# ---------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def fill_tables(student: torch.nn.Module, feats: torch.Tensor, segments: torch.Tensor, valid: torch.Tensor,
                targets: TeacherTargets, draft_ids: torch.Tensor, num_stages: int, temperature: float | None = None,
                autocast=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's T = 0 agreement and, with ``temperature``, its sampled-draft acceptance probability at every fill.

    Args:
        student: the head in its training layout (:class:`~spd_ds.train.student.HeadTrainModule`).
        feats: ``[B, S, m, H]`` raw anchor states; segments ``[B, S]`` int64; valid ``[B, S]`` bool (from the
            teacher).
        targets: the teacher's targets at the ``P`` loss positions.
        draft_ids: ``[V_d]`` int64 target ids of the draft vocabulary.
        num_stages: ``n``.
        temperature: the sampling temperature of the second table (the teacher's ``lse_full`` must be at it);
            ``None``: no second table.
        autocast: context manager for the head's compute (``None`` = none).
    Returns:
        ``(agree, overlap)``: ``agree`` ``[n, P]`` bool, row ``F-1`` = the head's greedy draft at fill ``F`` equals
        the teacher's argmax (:func:`~spd_ds.train.loss.top1_agreement`); ``overlap`` ``[n, P]`` fp32 in [0, 1],
        the probability that speculative sampling at ``temperature`` accepts the head's sampled draft
        (:func:`~spd_ds.train.loss.draft_overlap`), or ``None``.
    Raises:
        ValueError: ``temperature <= 0``.
    """
    agree, overlap = [], []
    for F in range(1, num_stages + 1):
        with autocast if autocast is not None else contextlib.nullcontext():
            logits = student(feats, segments, valid, F)
        agree.append(top1_agreement(logits.float(), targets, draft_ids))
        if temperature is not None:
            overlap.append(draft_overlap(logits, targets, temperature))
    if not agree:
        return torch.zeros(0, 0, dtype=torch.bool), None
    return torch.stack(agree), (torch.stack(overlap) if overlap else None)


def agreement_table(student: torch.nn.Module, feats: torch.Tensor, segments: torch.Tensor, valid: torch.Tensor,
                    targets: TeacherTargets, draft_ids: torch.Tensor, num_stages: int,
                    autocast=None) -> torch.Tensor:
    """Top-1 agreement of the head with the teacher at every fill: ``[n, P]`` bool (:func:`fill_tables`' first
    table)."""
    return fill_tables(student, feats, segments, valid, targets, draft_ids, num_stages, None, autocast)[0]


@torch.no_grad()
def evaluate(student: torch.nn.Module, teacher: Callable, batches: Iterable[tuple[dict, bool]], num_stages: int,
             draft_ids: torch.Tensor, device, autocast=None, reduce: bool = True,
             loop_ngram: int | None = REPEAT_NGRAM, loop_cache: dict | None = None,
             temperature: float | None = None) -> dict:
    """Agreement by fill on held-out micro-batches and the predicted acceptance (see module doc), over every loss
    position and over the positions outside loops (:func:`loop_positions`); with ``temperature``, the same for
    sampled drafts.

    Args:
        student: :class:`~spd_ds.train.student.HeadTrainModule` (its weights on this rank are complete: ZeRO-2
            partitions gradients and optimizer states, not parameters); put in eval mode for the call.
        teacher: ``teacher(batch) -> (my_batch, feats, targets)`` (:class:`~spd_ds.train.teacher.Teacher`).
        batches: ``(batch, counted)`` pairs (``input_ids``/``segments``/``valid``, as ``BatchPlanner.collate``);
            uncounted ones are run (collectives stay aligned) and ignored.
        num_stages: ``n``.
        draft_ids: ``[V_d]`` int64.
        device: where the counts are reduced.
        autocast: context manager for the head's compute, as in training (``None`` = none).
        reduce: sum the counts over all ranks (one fp64 ``all_reduce``: a collective, every rank must call);
            ``False`` for a single process without ``torch.distributed``.
        loop_ngram: n-gram length of the loop test (``None``: no loop-free figures).
        loop_cache: ``{batch ordinal i: (keep, n_keep)}``, ``keep`` ``[P_i]`` bool on the head's device (the loss
            positions of micro-batch ``i`` outside loops), ``n_keep`` its count (int); filled on the first call and
            kept by the caller across calls over the same ``batches`` in the same order (the loop test runs on the
            host, once per micro-batch, not once per call); ``None``: no cache.
        temperature: the sampling temperature of the ``_sampled`` figures; it must be the one the teacher's
            ``lse_full`` is at (``train.kd_temperature``); ``None``: no sampled figures.
    Returns:
        ``{"val_agreement_by_fill": {F: a_F}, "val_pred_acceptance": α, "val_pred_accept_length": L',
        "val_positions": positions counted per fill, "val_s": seconds}``; α, a_F in [0, 1], L' in tokens. With
        ``loop_ngram``, also ``val_loop_share`` (share of the positions in loops) and the same three figures over the
        positions outside loops, suffixed ``_noloop`` (an answer's first ``loop_ngram - 1`` tokens are never in a
        loop, so there are always some). Greedy answers of a small target loop (74 % of the tokens of SmolLM2-135M's
        self-distilled greedy answers of up to 768 tokens) and a head drafts loops almost perfectly, so the overall
        figures overstate acceptance on answers that loop less (``docs/training.md``). With ``temperature``, also
        ``val_sampling_temperature`` and the figures of sampled drafts: ``val_overlap_by_fill_sampled`` (the mean
        acceptance probability of a draft sampled at fill ``F``, ``Σ min(p_T, q_T)``:
        :func:`~spd_ds.train.loss.draft_overlap`),
        ``val_pred_acceptance_sampled`` and ``val_pred_accept_length_sampled`` (the same Markov chain fed those
        probabilities; ``_noloop`` too). They are on the held-out text, not on text sampled at ``T``.
    Raises:
        EmptyMaskError: no held-out position was counted (on every rank at once when ``reduce``).
        ValueError: ``temperature <= 0``.
    """
    t0 = time.perf_counter()
    n = num_stages
    was_training = student.training
    student.eval()
    # host counts: agree, positions; loop-free agree, positions; positions in loops; overlap; loop-free overlap
    counts = torch.zeros(6 * n + 1, dtype=torch.float64)
    sums = None  # [4n] float64 on the head's device: agree, loop-free agree, overlap, loop-free overlap (read once)
    try:
        for i, (batch, counted) in enumerate(batches):
            mine, feats, targets = teacher(batch)
            table, overlap = fill_tables(student, feats, mine["segments"], mine["valid"], targets, draft_ids, n,
                                         temperature, autocast)
            if counted:
                if sums is None:
                    sums = torch.zeros(4 * n, dtype=torch.float64, device=table.device)
                sums[:n] += table.sum(1)
                if overlap is not None:
                    sums[2 * n:3 * n] += overlap.sum(1)
                counts[n:2 * n] += table.shape[1]
                if loop_ngram is not None:
                    cached = loop_cache.get(i) if loop_cache is not None else None
                    if cached is None:  # the loop test on the host; the mask goes to the device once
                        keep = ~loop_positions(mine["input_ids"], mine["valid"], loop_ngram)[mine["valid"].cpu()]
                        cached = (keep.to(table.device), int(keep.sum()))
                        if loop_cache is not None:
                            loop_cache[i] = cached
                    keep, nkeep = cached
                    sums[n:2 * n] += (table & keep).sum(1)  # a mask product, not indexing: no host sync
                    if overlap is not None:
                        sums[3 * n:] += (overlap * keep).sum(1)
                    counts[3 * n:4 * n] += nkeep
                    counts[4 * n] += keep.shape[0] - nkeep
    finally:
        student.train(was_training)
    if sums is not None:
        h = sums.cpu()
        counts[:n] += h[:n]
        counts[2 * n:3 * n] += h[n:2 * n]
        counts[4 * n + 1:] += h[2 * n:]
    if reduce:
        import deepspeed.comm as dist

        c = counts.to(device)
        dist.all_reduce(c)
        counts = c.cpu()
    c = counts.tolist()
    if not c[n]:
        raise EmptyMaskError("the held-out micro-batches have no loss position: raise data.held_out_fraction or "
                             "train.eval_batches")

    def figures(hits: list[float], count: list[float], suffix: str, name: str = "agreement") -> dict:
        a = agreement_from_counts([0.0] + hits, [0.0] + count, n)
        pred = predict_acceptance(a)
        return {f"val_{name}_by_fill{suffix}": {F: a[F - 1] for F in range(1, n + 1)},
                f"val_pred_acceptance{suffix}": pred.draft_acceptance_rate,
                f"val_pred_accept_length{suffix}": pred.equivalent_accept_length}

    out = figures(c[:n], c[n:2 * n], "")
    out["val_positions"] = int(c[n])
    if loop_ngram is not None:
        out["val_loop_share"] = c[4 * n] / c[n]
        out.update(figures(c[2 * n:3 * n], c[3 * n:4 * n], "_noloop"))
    if temperature is not None:
        out["val_sampling_temperature"] = float(temperature)
        out.update(figures(c[4 * n + 1:5 * n + 1], c[n:2 * n], "_sampled", "overlap"))
        if loop_ngram is not None:
            out.update(figures(c[5 * n + 1:], c[3 * n:4 * n], "_sampled_noloop", "overlap"))
    out["val_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------------- in the loop
class Validator:
    """Held-out evaluation every ``eval_every`` steps and the best head by predicted equivalent accept length outside
    loops (``BEST_KEY``; the overall one when a resumed run's best predates the loop-free figures).

    Args:
        planner: a :class:`~spd_ds.train.batching.BatchPlanner` over the held-out examples (only its ``collate`` and
            ``lengths`` are used).
        batches: this rank's :func:`held_out_batches`.
        num_stages: ``n``.
        eval_every: evaluate when ``step % eval_every == 0`` (and at the end of the run).
        out_dir: the run directory (``best_head/`` goes there, written by the logging rank).
        is_logger: this rank writes the best head.
        save_dtype: dtype of the saved best head (``train.save_dtype``).
        temperature: the sampling temperature of the ``_sampled`` figures (``train.kd_temperature``: the teacher's
            ``lse_full`` is at it).

    Attributes set by :meth:`build` (``None`` otherwise), for the resume's
    :func:`~spd_ds.train.resume.eval_batches_identity`: ``available``, the held-out micro-batches of the split over
    all ranks (:func:`held_out_plan`), and ``used``, those a validation runs (:func:`eval_batches_used`: what
    ``train.eval_batches`` resolves to).
    """

    def __init__(self, planner, batches: list[tuple[list[list[int]], bool]], num_stages: int, eval_every: int,
                 out_dir: Path, is_logger: bool, save_dtype: torch.dtype = torch.float32,
                 temperature: float = 1.0) -> None:
        self.planner, self.batches, self.n, self.eval_every = planner, batches, num_stages, int(eval_every)
        self.available: int | None = None
        self.used: int | None = None
        self.temperature = float(temperature)
        self.best_dir = Path(out_dir) / BEST_DIR
        self.is_logger, self.save_dtype = is_logger, save_dtype
        self.best: dict | None = None
        self.last: dict | None = None
        self.init_steps: int | None = 0  # steps the starting head had taken (written to best.json; None = unknown)
        self._collated: list | None = None  # this rank's held-out micro-batches, collated at the first run
        self._loops: dict = {}  # evaluate's loop_cache over them

    @classmethod
    def build(cls, records: Sequence[dict], tokenizer, cfg, num_stages: int, dp_rank: int, dp_world: int,
              out_dir: Path, is_logger: bool) -> "Validator":
        """Tokenise the held-out ``records`` as the training data is and plan this rank's micro-batches.

        Raises:
            EmptyMaskError: no held-out record has an assistant token (one line; on every rank: the data is the same).
        """
        from spd_ds.models.adapter import resolve_dtype
        from spd_ds.train.batching import BatchPlanner
        from spd_ds.train.data import tokenize_records

        dc, tc = cfg.data, cfg.train
        try:
            data = tokenize_records(records, tokenizer, dc.max_seq_length, dc.min_seq_length, dc.overflow, 0)
        except EmptyMaskError:
            raise EmptyMaskError(f"the {len(records)} held-out records (data.held_out_fraction="
                                 f"{dc.held_out_fraction}) have no assistant token to evaluate on; raise the "
                                 "fraction or set train.eval_every=0") from None
        planner = BatchPlanner(data, dc.max_seq_length, dc.micro_batch_size, 0, 1, tc.seed, dc.pack)
        plan = held_out_plan(planner.lengths, dc.max_seq_length, dc.micro_batch_size, dc.pack)
        batches = held_out_batches(planner.lengths, dc.max_seq_length, dc.micro_batch_size, dc.pack, dp_rank,
                                   dp_world, tc.eval_batches, plan)
        v = cls(planner, batches, num_stages, tc.eval_every, out_dir, is_logger, resolve_dtype(tc.save_dtype),
                tc.kd_temperature)
        v.available, v.used = len(plan), eval_batches_used(tc.eval_batches, len(plan))
        return v

    def describe(self) -> str:
        """One line for the run's log."""
        d = self.planner.data
        total = "" if self.used is None else f"{self.used} of the split's {self.available} micro-batches, "
        return (f"validation: {len(d)} held-out examples, {d.num_loss_positions} loss positions, {total}"
                f"{sum(c for _, c in self.batches)} micro-batches on this rank, every {self.eval_every} steps")

    def due(self, step: int, final: bool) -> bool:
        """Evaluate at this step? (every ``eval_every`` steps, and at the run's last step ``final``)."""
        return self.eval_every > 0 and (step % self.eval_every == 0 or final)

    def run(self, student, teacher, device, step: int, autocast=None) -> dict:
        """Evaluate (a collective: every rank), keep the best head (logging rank) and return the figures.

        Returns:
            :func:`evaluate`'s dict plus ``val_best`` (True when this step's head became the best).
        """
        head = student.head
        if self._collated is None:  # the held-out micro-batches are fixed: collated once, loop masks found once
            pin = torch.cuda.is_available()  # pinned: the teacher's copies to the device are then asynchronous
            self._collated = []
            for rows, counted in self.batches:
                batch = with_loss_index(self.planner.collate(rows))
                self._collated.append(({k: v.pin_memory() if pin else v for k, v in batch.items()}, counted))
        val = evaluate(student, teacher, self._collated, self.n, head.draft_ids, device, autocast,
                       loop_cache=self._loops, temperature=self.temperature)
        key = BEST_KEY if BEST_KEY in val and self.best is not None and BEST_KEY in self.best else \
            "val_pred_accept_length"  # a best from a checkpoint written before the loop-free figures: overall L'
        val["val_best"] = self.best is None or val[key] > self.best[key]
        self.last = {"step": step, **{k: v for k, v in val.items() if k != "val_best"}}
        if val["val_best"]:
            self.best = dict(self.last)
            if self.is_logger:
                self._save_best(head)
        return val

    def _save_best(self, head) -> None:
        """Write ``head`` as the run's ``best_head/`` without a moment when neither the old nor the new one is on
        disk under a known name (:func:`recover_best_head` puts the old one back after a crash)."""
        out = self.best_dir.parent
        recover_best_head(out)
        tmp, backup = out / BEST_TMP, out / BEST_BACKUP
        head.save(tmp, dtype=self.save_dtype)
        (tmp / BEST_FILE).write_text(json.dumps({**self.best, "init_steps": self.init_steps}, indent=1))
        if self.best_dir.exists():
            self.best_dir.rename(backup)
        tmp.rename(self.best_dir)
        shutil.rmtree(backup, ignore_errors=True)

    def postfix(self) -> dict:
        """Progress-bar fields of the last evaluation (empty before the first)."""
        if self.last is None:
            return {}
        fields = {"val_acc": f"{self.last['val_pred_acceptance']:.3f}",
                  "val_L": f"{self.last['val_pred_accept_length']:.3f}"}
        if self.last.get("val_pred_acceptance_noloop") is not None:
            fields["val_acc_noloop"] = f"{self.last['val_pred_acceptance_noloop']:.3f}"
        if self.last.get("val_pred_acceptance_sampled") is not None:
            fields["val_acc_sampled"] = f"{self.last['val_pred_acceptance_sampled']:.3f}"
        return fields

    def state(self) -> dict:
        """What a checkpoint keeps (the best so far), so that a resumed run picks the same best head."""
        return {"best": self.best, "last": self.last}

    def load_state(self, state: dict | None) -> None:
        """Restore :meth:`state` (``None``: a checkpoint written without validation)."""
        if state:
            self.best, self.last = state.get("best") or None, state.get("last") or None

    def summary(self) -> dict:
        """``train_summary.json`` fields: the best evaluation (``step`` and figures, ``dir``) and the last one."""
        best = dict(self.best, dir=str(self.best_dir)) if self.best else None
        return {"best": best, "last_validation": self.last}


__all__ = ["BEST_DIR", "BEST_FILE", "BEST_KEY", "BEST_TMP", "BEST_BACKUP", "recover_best_head", "held_out_plan",
           "eval_batches_used", "held_out_batches",
           "fill_tables", "agreement_table", "evaluate", "Validator"]
