"""Point-to-point messages of the SPD pipeline: headers, payloads, timeouts.

Every message is a small **header** ``int64[5] = [kind, seq, pos, q, flags]`` on a gloo control group (CPU, so a
host can read it without waiting for its GPU) followed, for tokens, by a **payload** on a data group (gloo on CPU,
NCCL on GPU): ``[1, q, H]`` hidden states down the pipe, ``[q, rows, H]`` anchors (+ the final hidden state) up to the
head. Hidden states flow down on the grid's pipe-parallel group and anchors flow up on a second group, so no NCCL
communicator carries traffic both ways between one pair of ranks (two ops queued on one NCCL stream in opposite
directions can deadlock).

Sends never block: the sent tensors are kept until their work completes. Receives land in preallocated buffers.
Every host-side wait has a deadline (``deepspeed.timeout_s``): a peer that died closes its sockets (gloo reports it at
once), a peer that stalls runs into the deadline; either way :class:`PipeCommError` names both ranks.

``seq`` numbers every token the head injects (prefill or decode); stages keep it, so the head recognises messages of
tokens flushed by a rollback (``seq`` smaller than the one it waits for) and drops them.
"""

from __future__ import annotations

import collections
import datetime
import enum
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

HEADER_LEN = 5
STATS_LEN = 4  # END statistics of a stage: [decode forward seconds, decode forwards, receive-wait seconds, 0]
FLAG_ANCHORS = 1  # the head wants every anchor (SPD); without it only the last stage answers, with its output (AR)
FLAG_ABORT = 2  # on SHUTDOWN: the head stopped after an error (no acknowledgement; stages raise PipeAborted)


class Kind(enum.IntEnum):
    """Message kinds."""

    PREFILL = 1  # q prompt tokens at positions 0..q-1: the stage resets its cache first
    DECODE = 2  # one token at position ``pos`` (a smaller position than the cache holds means a rollback)
    END = 3  # end of one generation: stages report their stats to the head
    SHUTDOWN = 4  # stop serving (the last stage acknowledges to the head)
    WARMUP = 5  # connection check at start-up: forwarded through the pipe and answered by every stage


class Header(NamedTuple):
    """A message header (5 int64 on the gloo control group): message ``kind`` (:class:`Kind`), the token's sequence
    number ``seq`` and position ``pos``, ``q`` rows (or values, for statistics) in the payload, ``flags`` bits."""

    kind: int
    seq: int
    pos: int
    q: int
    flags: int


class PipeCommError(RuntimeError):
    """A peer rank died, stalled past ``deepspeed.timeout_s``, or broke the connection."""


class PipeAborted(RuntimeError):
    """Raised on stage ranks when the head rank stopped the run after an error of its own."""


MAX_HOST_PENDING = 16  # host (gloo) sends in flight per link before the oldest is waited for


class PipeProtocolError(RuntimeError):
    """A message arrived that the protocol does not allow (a bug, or ranks running different configs)."""


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


def peer_gone(e: BaseException) -> bool:
    """Whether the error of a collective or a send/receive says that the peer rank's process went away (gloo's and
    NCCL's wording)."""
    return any(s in str(e) for s in _PEER_GONE)


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, without gloo's source-location prefix and its generic advice."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if msg.startswith("[") and "] " in msg:  # drop gloo's source location prefix
        msg = msg.split("] ", 1)[1]
    return msg.split(". This is typically")[0]


class Link:
    """One direction of traffic between this rank and ``peer`` (header on ``ctrl``, payload on ``data``).

    Args:
        me, peer: global ranks.
        me_name, peer_name: for messages, e.g. ``"rank 1 (target stage 0)"``.
        data_group: process group of payloads (gloo or NCCL).
        ctrl_group: gloo process group of headers and statistics.
        timeout_s: deadline of every host-side wait.
        device: device of payloads.
    """

    def __init__(self, me: int, peer: int, me_name: str, peer_name: str, data_group, ctrl_group, timeout_s: float,
                 device: torch.device) -> None:
        self.me, self.peer, self.me_name, self.peer_name = me, peer, me_name, peer_name
        self.data_group, self.ctrl_group = data_group, ctrl_group
        self.timeout_s = float(timeout_s)
        self._td = datetime.timedelta(seconds=self.timeout_s)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._hdr_in = torch.zeros(HEADER_LEN, dtype=torch.long)
        # Sends not known to be complete, oldest first, with their tensors (kept alive until then). Host sends
        # (gloo) never report completion before wait(), so they are waited for once MAX_HOST_PENDING newer ones
        # exist; device sends (NCCL) complete in stream order and are dropped from the front once complete.
        self._pending_host: collections.deque = collections.deque()
        self._pending_dev: collections.deque = collections.deque()
        self.wait_s = 0.0  # host time spent blocked in receives

    # ---- errors and waits --------------------------------------------------------------------------
    def _fail(self, what: str, e: BaseException, timeout_s: float | None = None) -> PipeCommError:
        deadline = (f"deepspeed.timeout_s={self.timeout_s:g}s" if timeout_s is None
                    else f"{timeout_s:g}s between generations")
        return PipeCommError(
            f"{self.me_name}: {what} {self.peer_name} failed: {first_line(e)}; a rank died or stalled "
            f"(deadline {deadline})"
        )

    def _wait(self, work, what: str, device_side: bool = False, timeout_s: float | None = None) -> None:
        try:
            if device_side:
                work.wait()  # NCCL: makes the current stream wait, does not block the host
            else:
                work.wait(timeout=self._td if timeout_s is None else datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise self._fail(what, e, timeout_s) from None

    def host_wait(self, tensor_ready: "torch.cuda.Event", what: str) -> None:
        """Block the host until ``tensor_ready`` has completed, at most ``timeout_s`` (CUDA only)."""
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while not tensor_ready.query():
            spins += 1
            if spins > 200:
                time.sleep(5e-5)
            if time.monotonic() > deadline:
                raise PipeCommError(
                    f"{self.me_name}: no data from {self.peer_name} within deepspeed.timeout_s={self.timeout_s:g}s "
                    f"while waiting for {what}; a rank died or stalled"
                )

    # ---- sends (non-blocking) -----------------------------------------------------------------------
    def _prune(self) -> None:
        """Retire completed sends in O(1) amortised time (this runs for every message of every cycle).

        Sends to one peer complete in order. A gloo send's ``is_completed()`` stays False until ``wait()`` even after
        the peer has received it, and ``wait()`` blocks until the peer receives, so host sends are waited for only
        when ``MAX_HOST_PENDING`` newer ones exist: the lockstep schedule never runs that far ahead of a peer, so
        the wait returns at once (a peer that stalls ends it with the deadline).
        """
        while len(self._pending_host) > MAX_HOST_PENDING:
            work, _ = self._pending_host.popleft()
            self._wait(work, "sending to")
        while self._pending_dev and self._pending_dev[0][0].is_completed():
            self._pending_dev.popleft()

    def _track(self, work, tensor: torch.Tensor, device_side: bool) -> None:
        (self._pending_dev if device_side else self._pending_host).append((work, tensor))

    def send(self, kind: int, seq: int = 0, pos: int = 0, q: int = 0, flags: int = 0,
             payload: torch.Tensor | None = None) -> None:
        """Send a header (5 int64) and, if given, a contiguous payload (any shape/dtype, on the link's device); the
        tensors are kept alive until the send completes. Returns at once, unless more than ``MAX_HOST_PENDING`` host
        sends to this peer are still pending: then it first waits for the oldest (at most ``timeout_s`` seconds).

        Raises:
            PipeCommError: an earlier send to this peer failed, or the peer did not take a pending send in time.
        """
        self._prune()
        hdr = torch.tensor([int(kind), int(seq), int(pos), int(q), int(flags)], dtype=torch.long)
        try:
            self._track(dist.isend(hdr, self.peer, group=self.ctrl_group), hdr, False)
            if payload is not None:
                self._track(dist.isend(payload, self.peer, group=self.data_group), payload, self.cuda)
        except RuntimeError as e:
            raise self._fail("sending to", e) from None

    def send_stats(self, kind: int, stats: torch.Tensor, seq: int = 0) -> None:
        """Send a header and ``stats`` (any float CPU vector, sent as float64) on the control group; non-blocking as
        :meth:`send` (same bound on pending host sends, same errors)."""
        self._prune()
        hdr = torch.tensor([int(kind), int(seq), 0, int(stats.numel()), 0], dtype=torch.long)
        stats = stats.to(torch.float64).contiguous()
        try:
            self._track(dist.isend(hdr, self.peer, group=self.ctrl_group), hdr, False)
            self._track(dist.isend(stats, self.peer, group=self.ctrl_group), stats, False)
        except RuntimeError as e:
            raise self._fail("sending to", e) from None

    def flush(self) -> None:
        """Wait (with the deadline) until every host send to this peer has completed; device sends are ordered by
        the stream and only kept alive until they report completion."""
        while self._pending_host:
            work, _ = self._pending_host.popleft()
            self._wait(work, "sending to")
        while self._pending_dev and self._pending_dev[0][0].is_completed():
            self._pending_dev.popleft()

    # ---- receives (blocking, with deadline) ----------------------------------------------------------
    def recv_header(self, timeout_s: float | None = None) -> Header:
        """The next header from the peer (blocks the host up to ``timeout_s``, default the link's)."""
        t = time.perf_counter()
        try:
            work = dist.irecv(self._hdr_in, self.peer, group=self.ctrl_group)
        except RuntimeError as e:
            raise self._fail("receiving from", e) from None
        self._wait(work, "receiving from", timeout_s=timeout_s)
        self.wait_s += time.perf_counter() - t
        return Header(*(int(x) for x in self._hdr_in.tolist()))

    def recv_payload(self, out: torch.Tensor) -> torch.Tensor:
        """Receive the payload announced by the last header into ``out`` (contiguous, exact size) and return it.

        On CPU the host blocks until it has arrived; on CUDA the current stream waits for it (no host sync).
        """
        t = time.perf_counter()
        try:
            work = dist.irecv(out, self.peer, group=self.data_group)
        except RuntimeError as e:
            raise self._fail("receiving from", e) from None
        self._wait(work, "receiving from", device_side=self.cuda)
        self.wait_s += time.perf_counter() - t
        return out

    def recv_stats(self, n: int) -> torch.Tensor:
        """Receive a float64 vector of ``n`` values sent with :meth:`send_stats` (after its header)."""
        out = torch.zeros(n, dtype=torch.float64)
        try:
            work = dist.irecv(out, self.peer, group=self.ctrl_group)
        except RuntimeError as e:
            raise self._fail("receiving from", e) from None
        self._wait(work, "receiving from")
        return out


class FlatBuffer:
    """A preallocated flat receive buffer handing out contiguous views of any shape up to its capacity.

    Args:
        numel: capacity in elements; dtype, device: of the buffer.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device) -> None:
        self.data = torch.empty(int(numel), dtype=dtype, device=device)

    def view(self, *shape: int) -> torch.Tensor:
        """A contiguous view ``shape`` of the buffer's first elements.

        Raises:
            PipeProtocolError: the shape does not fit (a message larger than the run allows).
        """
        n = 1
        for x in shape:
            n *= x
        if n > self.data.numel():
            raise PipeProtocolError(f"message of shape {tuple(shape)} exceeds the receive buffer ({self.data.numel()})")
        return self.data[:n].view(*shape)
