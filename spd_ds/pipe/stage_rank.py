"""The instructions of a stage rank (a pipe stage other than 0): one target stage, serving messages from upstream.

Per message (:class:`~spd_ds.pipe.schedule.StageServeSchedule`)::

    RecvHidden  StageForward  SendHidden  SendAnchors          (PREFILL / DECODE)
    RecvHidden  EndGeneration | Shutdown | Warmup              (control)

A stage needs no rollback message: a token's position tells it where to write (a position below its cache length
crops the cache first, :meth:`~spd_ds.pipe.stage_runner.StageRunner.decode`), so tokens flushed by a rollback drain
through the idle slots behind the replacement and the head drops their messages by sequence number. Stage ranks
never read the device on the host (headers come over gloo), so on GPU their launches run ahead of their kernels.
"""

from __future__ import annotations

import torch

from spd_ds.pipe.comm import FLAG_ABORT, FlatBuffer, Header, Kind, PipeAborted, PipeProtocolError
from spd_ds.pipe.links import PipeLinks
from spd_ds.pipe.stage_runner import StageRunner
from spd_ds.pipe.watchdog import Watchdog

IDLE_TIMEOUT_S = 3600.0  # how long stage ranks wait for the next generation (a dead head is noticed at once)


class StageRank:
    """One target stage on its own rank.

    Args:
        links: this rank's :class:`~spd_ds.pipe.links.PipeLinks`.
        stage: the target stage it holds.
        runner: that stage's :class:`~spd_ds.pipe.stage_runner.StageRunner`.
        max_len: KV capacity in positions (sizes the receive buffer).
        hidden_size, dtype, device: of the hidden states.
        watchdog: the rank's :class:`~spd_ds.pipe.watchdog.Watchdog` (idle between generations).
        timeout_s: deadline of every wait on a peer within a generation.
    """

    def __init__(self, links: PipeLinks, stage: int, runner: StageRunner, max_len: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, watchdog: Watchdog, timeout_s: float) -> None:
        self.links, self.stage, self.runner = links, stage, runner
        self.last = stage == links.n - 1
        self.H, self.dtype, self.device = hidden_size, dtype, device
        self.watchdog, self.timeout_s = watchdog, float(timeout_s)
        self.in_buffer = FlatBuffer(max_len * hidden_size, dtype, device)
        self.msg: Header | None = None  # the message being served
        self._in: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._captured: dict[int, torch.Tensor] = {}
        self._wait_mark = 0.0

    def recv_hidden(self) -> None:
        """RecvHidden: the next header from upstream and, for tokens, the hidden states into the receive buffer."""
        prev, link = self.msg, self.links.in_link
        if prev is None or prev.kind in (Kind.END, Kind.WARMUP):  # between generations the head may be busy
            self.watchdog.idle()  # elsewhere (e.g. an evaluation's baselines): wait up to IDLE_TIMEOUT_S
            hdr = link.recv_header(timeout_s=max(self.timeout_s, IDLE_TIMEOUT_S))
            self.watchdog.beat()
        else:
            hdr = link.recv_header()
        self.msg = hdr
        if hdr.kind in (Kind.PREFILL, Kind.DECODE, Kind.WARMUP):
            self._in = link.recv_payload(self.in_buffer.view(1, hdr.q, self.H))

    def stage_forward(self, stage: int) -> None:
        """StageForward: the prompt (PREFILL: the cache restarts) or one token at its position (DECODE)."""
        if self.msg.kind == Kind.PREFILL:
            self._out, self._captured = self.runner.prefill(self._in)
        else:
            self._out, self._captured = self.runner.decode(self._in, self.msg.pos)

    def send_hidden(self, stage: int) -> None:
        """SendHidden: the output downstream (static outputs are copied: the next replay overwrites them)."""
        if self.links.out_link is not None:
            msg = self.msg
            out = self._out.clone() if self.runner.static else self._out.contiguous()
            self.links.out_link.send(msg.kind, msg.seq, msg.pos, msg.q, msg.flags, out)

    def send_anchors(self, stage: int) -> None:
        """SendAnchors: this stage's rows for the head (``[q, rows, H]``; the last stage's output among them)."""
        msg = self.msg
        rows = self.links.rows(stage, msg.flags)
        if not rows:
            return
        parts = [self._out if (self.last and j == self.links.L) else self._captured[j] for j in rows]
        pack = torch.stack(parts, dim=2).view(msg.q, len(rows), self.H)  # [q, k, H], a fresh tensor
        self.links.head_link.send(msg.kind, msg.seq, msg.pos, msg.q, msg.flags, pack)

    def end_generation(self) -> None:
        """EndGeneration: report this stage's statistics to the head and pass END on."""
        fs, nf = self.runner.take_stats()
        total_wait = self.links.wait_s()
        wait, self._wait_mark = total_wait - self._wait_mark, total_wait
        self.links.head_link.send_stats(Kind.END, torch.tensor([fs, nf, wait, 0.0], dtype=torch.float64))
        if self.links.out_link is not None:
            self.links.out_link.send(Kind.END, self.msg.seq)

    def shutdown(self, abort: bool = False) -> None:
        """Shutdown: pass SHUTDOWN on (the last stage acknowledges to the head, unless the head aborted).

        Raises:
            PipeAborted: the head stopped the run after an error of its own.
        """
        msg, links = self.msg, self.links
        aborted = bool(msg.flags & FLAG_ABORT)
        if links.out_link is not None:
            links.out_link.send(Kind.SHUTDOWN, msg.seq, flags=msg.flags)
            links.out_link.flush()
        elif not aborted:
            links.head_link.send(Kind.SHUTDOWN, msg.seq)
        if aborted:
            raise PipeAborted(f"{links.in_link.me_name}: the head rank stopped the run after an error (see its log)")
        links.flush()

    def warmup(self) -> None:
        """Warmup: pass the WARMUP message on and answer the head.

        Raises:
            PipeProtocolError: the message served is not WARMUP (the first message must be).
        """
        if self.msg is None or self.msg.kind != Kind.WARMUP:
            raise PipeProtocolError(f"expected WARMUP first, got {self.msg}")
        zeros = torch.zeros(1, 1, self.H, dtype=self.dtype, device=self.device)
        if self.links.out_link is not None:
            self.links.out_link.send(Kind.WARMUP, 0, 0, 1, 0, zeros)
        self.links.head_link.send(Kind.WARMUP, 0, 0, 1, 0, zeros.clone())
