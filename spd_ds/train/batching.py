"""Training batches: tokenised examples -> packed micro-batches, sharded over data-parallel ranks.

Examples are packed first-fit-decreasing (within windows of the shuffled order) into rows of ``data.max_seq_length``
tokens; ``segments`` keeps documents apart, ``positions`` restart per document. With ``data.pack=false`` every row
holds one example and rows are grouped by length. The epoch plan is a pure function of ``(seed, epoch)``, so a resumed
run continues from a saved micro-batch index on the same plan.
"""

from __future__ import annotations

import ctypes
import dataclasses
import signal
import sys
from typing import Iterable, Sequence

import torch

from spd_ds.eval.report import REPEAT_NGRAM, repeat_flags
from spd_ds.train.data import DataError, TokenizedData


def pack_rows(lengths: Sequence[int], order: Sequence[int], capacity: int, window: int = 1024) -> list[list[int]]:
    """First-fit-decreasing packing of examples (in ``order``, window by window) into rows of ``capacity`` tokens.

    Returns:
        rows as lists of example indices; every example (``len <= capacity``) is placed exactly once.
    """
    rows: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: -lengths[i])
        free: list[int] = []
        mine: list[list[int]] = []
        for i in chunk:
            L = lengths[i]
            for r, f in enumerate(free):
                if f >= L:
                    free[r] -= L
                    mine[r].append(i)
                    break
            else:
                free.append(capacity - L)
                mine.append([i])
        rows.extend(mine)
    return rows


@dataclasses.dataclass
class EpochPlan:
    """Micro-batches of one epoch for one data-parallel rank: each is a list of rows, a row a list of examples."""

    epoch: int
    micro_batches: list[list[list[int]]]

    def __len__(self) -> int:
        return len(self.micro_batches)


def loop_positions(input_ids: torch.Tensor, valid: torch.Tensor, n: int = REPEAT_NGRAM) -> torch.Tensor:
    """Loss positions whose next token is part of a loop: it closes an ``n``-gram already seen earlier in the same
    answer (:func:`spd_ds.eval.report.repeat_flags`; the test behind the evaluation's ``repeated_ngram_share``). Used
    by the validation's loop-free figures and by ``data.skip_loops``.

    An answer is a maximal run of tokens ``j`` with ``valid[j-1]`` (assistant tokens of one document, as
    :meth:`BatchPlanner.collate` marks them: ``valid`` is never true across a document boundary, so no segment ids are
    needed): a new user turn or document starts a new answer.

    Args:
        input_ids: ``[B, S]`` int64; valid: ``[B, S]`` bool (``valid[t]``: position ``t`` predicts the assistant token
            ``t+1`` of the same document). Any device; the work is done on the host.
        n: n-gram length (>= 1).
    Returns:
        ``[B, S]`` bool on the host, ``True`` only where ``valid`` is.
    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"the n-gram length must be >= 1, got {n}")
    ids, v = input_ids.cpu().tolist(), valid.cpu().tolist()
    out = torch.zeros(valid.shape, dtype=torch.bool)
    for b, (row, vrow) in enumerate(zip(ids, v)):
        j, S = 1, len(row)
        while j < S:
            if not vrow[j - 1]:
                j += 1
                continue
            start = j
            while j < S and vrow[j - 1]:
                j += 1
            hits = [start - 1 + k for k, f in enumerate(repeat_flags(row[start:j], n)) if f]
            if hits:
                out[b, hits] = True
    return out


class BatchPlanner:
    """Deterministic per-epoch micro-batch plans, sharded over data-parallel ranks.

    Args:
        data: the tokenised examples.
        seq_len: row length ``S`` (tokens).
        rows_per_batch: rows per micro-batch ``B``.
        dp_rank, dp_world: this rank's data-parallel coordinate.
        seed: plan seed (``train.seed``).
        pack: pack several examples per row (else one per row, length-grouped, padded to the batch's longest).
        skip_loops: :meth:`collate` leaves the positions in loops out of ``valid`` (:func:`loop_positions`;
            ``data.skip_loops``): the tokens stay in the rows as context, the head is not trained to draft them.

    Every rank gets the same number of micro-batches per epoch (the tail that cannot be shared is dropped).
    """

    def __init__(self, data: TokenizedData, seq_len: int, rows_per_batch: int, dp_rank: int = 0, dp_world: int = 1,
                 seed: int = 0, pack: bool = True, skip_loops: bool = False) -> None:
        if rows_per_batch < 1:
            raise ValueError(f"data.micro_batch_size must be >= 1, got {rows_per_batch}")
        self.data, self.S, self.B = data, int(seq_len), int(rows_per_batch)
        self.dp_rank, self.dp_world, self.seed, self.pack = dp_rank, dp_world, seed, pack
        self.skip_loops = skip_loops
        self.lengths = [len(x) for x in data.input_ids]
        if max(self.lengths) > self.S:
            raise ValueError(f"an example has {max(self.lengths)} tokens > data.max_seq_length={self.S}")

    def plan(self, epoch: int) -> EpochPlan:
        """The micro-batches of ``epoch`` for this rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        if self.pack:
            rows = pack_rows(self.lengths, order, self.S)
            rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
            batches = [rows[i:i + self.B] for i in range(0, len(rows), self.B)]
        else:  # length grouping: sort within windows of 64 batches, then shuffle the batches
            win = 64 * self.B
            rows = []
            for w in range(0, len(order), win):
                rows += [[i] for i in sorted(order[w:w + win], key=lambda i: self.lengths[i])]
            batches = [rows[i:i + self.B] for i in range(0, len(rows), self.B)]
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        batches = [b for b in batches if len(b) == self.B]
        per_rank = len(batches) // self.dp_world
        if per_rank == 0:
            raise DataError(
                f"{len(self.lengths)} examples make {len(batches)} full micro-batches of {self.B} rows x {self.S} "
                f"tokens, fewer than the {self.dp_world} data-parallel ranks; use more data or a smaller "
                "data.micro_batch_size / data.max_seq_length"
            )
        mine = batches[self.dp_rank: per_rank * self.dp_world: self.dp_world]
        return EpochPlan(epoch, mine)

    def collate(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """Tensors of one micro-batch.

        Returns:
            ``input_ids [B, S']`` int64, ``segments [B, S']`` int64 (document id from 1, 0 = padding) and ``valid
            [B, S']`` bool (position ``t`` predicts an assistant token ``t+1`` of the same document); ``S' = S`` when
            packing, else the longest row of the batch.
        """
        S = self.S if self.pack else max(sum(self.lengths[i] for i in r) for r in rows)
        B = len(rows)
        ids = torch.zeros(B, S, dtype=torch.long)
        seg = torch.zeros(B, S, dtype=torch.long)
        valid = torch.zeros(B, S, dtype=torch.bool)
        for b, row in enumerate(rows):
            t = 0
            for d, i in enumerate(row, 1):
                x, m = self.data.input_ids[i], self.data.assistant_mask[i]
                L = len(x)
                ids[b, t:t + L] = torch.tensor(x)
                seg[b, t:t + L] = d
                if L > 1:
                    valid[b, t:t + L - 1] = torch.tensor(m[1:], dtype=torch.bool)
                t += L
        if self.skip_loops:
            valid &= ~loop_positions(ids, valid)
        return {"input_ids": ids, "segments": seg, "valid": valid}


def iterate(planner: BatchPlanner, start_epoch: int = 0, start_index: int = 0) -> Iterable[tuple[int, int, dict]]:
    """Yield ``(epoch, index, batch)`` forever from ``(start_epoch, start_index)`` on."""
    epoch, idx = start_epoch, start_index
    while True:
        plan = planner.plan(epoch)
        while idx < len(plan):
            yield epoch, idx, planner.collate(plan.micro_batches[idx])
            idx += 1
        epoch, idx = epoch + 1, 0


def batches_on_device(planner: BatchPlanner, epoch: int, index: int, prefetch: int) -> Iterable[tuple[int, int, dict]]:
    """``(epoch, index, batch)`` from :func:`iterate`, each batch with its ``loss_index``
    (:func:`~spd_ds.train.teacher.with_loss_index`), collated ``prefetch`` micro-batches ahead in a DataLoader worker
    process into pinned memory (``prefetch = 0``: in this process). The order is the plan's, so resume is exact.
    The worker ends with the training process (:func:`die_with_parent`)."""
    from spd_ds.train.teacher import with_loss_index

    def gen():
        for e, i, b in iterate(planner, epoch, index):
            yield e, i, with_loss_index(b)

    if prefetch <= 0:
        return gen()

    class _Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return gen()

    loader = torch.utils.data.DataLoader(_Stream(), batch_size=None, num_workers=1, prefetch_factor=prefetch,
                                         pin_memory=torch.cuda.is_available(), persistent_workers=False,
                                         worker_init_fn=die_with_parent)
    return iter(loader)


def die_with_parent(worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn``: on Linux the worker is killed (``SIGKILL``, ``prctl(PR_SET_PDEATHSIG)``) as
    soon as the process that started it dies, e.g. a rank killed by the launcher; PyTorch's own watchdog notices a
    dead parent only every 5 s, so a worker used to outlive its rank by seconds, holding its memory. A parent that
    dies before ``prctl`` runs is left to that watchdog. Elsewhere, or without libc's ``prctl``, nothing changes.

    Args:
        worker_id: the DataLoader's worker index (unused).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
