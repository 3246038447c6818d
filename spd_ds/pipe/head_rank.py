"""The head rank's side of the pipeline (pipe stage 0): links, receive buffers and the instructions of every
generation kind.

:class:`HeadRank` moves tokens: it embeds them, runs the target stages held on this rank (target stage 0 when the head
is co-located), sends hidden states down, receives the remote stages' anchors and outputs, drains the pipe at the end
of a generation, and starts and stops the stage ranks. :class:`HeadDriver` is the part a generation kind shares: the
request, the decode clock and the end of a generation. What a generation *does* with the tokens lives in its driver:
SPD's cycle in :class:`~spd_ds.pipe.spd_head.SPDHead` (which drives :mod:`spd_ds.decoding.cycle`), autoregressive
decoding through the same pipeline in :class:`~spd_ds.pipe.ar_pipe.PipeAR`.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Sequence

import torch

from spd_ds.decoding.cycle import Anchors, GenerationResult, InFlight, TokenOutput, check_prompt
from spd_ds.decoding.drafters import Drafter
from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.stopping import StopStrings
from spd_ds.pipe.comm import FLAG_ABORT, FLAG_ANCHORS, FlatBuffer, Header, Kind, PipeProtocolError
from spd_ds.pipe.links import PipeLinks
from spd_ds.pipe.stage_runner import StageRunner


class HeadRank:
    """Transport of the head rank, shared by its generation drivers.

    Args:
        links: this rank's :class:`~spd_ds.pipe.links.PipeLinks`.
        runners: target stage -> :class:`~spd_ds.pipe.stage_runner.StageRunner` held on this rank.
        ends: the target's embedding, final norm and LM head (:class:`~spd_ds.models.adapter.TargetEnds`).
        eos: ids that end a generation.
        max_len: KV capacity in positions.
        hidden_size, dtype, device: of the hidden states on this rank.
        stop: stop strings (:class:`~spd_ds.decoding.stopping.StopStrings`) or ``None``; with ``eos`` and the limit,
            where every generation on this engine ends.
        model_max: the target's maximum context in positions (``None``: unknown), and model_max_source the
            config.json key that sets it (``"sliding_window"`` or ``"max_position_embeddings"``), for the prompt
            check's message.
    """

    def __init__(self, links: PipeLinks, runners: dict[int, StageRunner], ends, eos: frozenset[int], max_len: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, *, stop: StopStrings | None = None,
                 model_max: int | None = None, model_max_source: str = "max_position_embeddings") -> None:
        self.links, self.plan = links, links.plan
        self.n, self.L = links.n, links.L
        self.runners, self.ends = runners, ends
        self.eos, self.max_len, self.stop, self.model_max = eos, int(max_len), stop, model_max
        self.model_max_source = model_max_source
        self.H, self.dtype, self.device = hidden_size, dtype, device
        self.cuda = device.type == "cuda"
        self.next_seq = itertools.count(1).__next__  # numbers every message the head sends
        self._arrived = torch.cuda.Event() if self.cuda else None  # marks received rows for host waits
        self._token_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.up_buffers = {s: FlatBuffer(self.max_len * max(len(self.plan.up_rows(s)), 1) * hidden_size, dtype, device)
                           for s in links.up_links}

    # ------------------------------------------------------------------ tokens
    def embed(self, token: int) -> torch.Tensor:
        """``[1, 1, H]`` embedding of one token (on CUDA ``fill_`` passes the id as a kernel argument: no blocking
        host-to-device copy)."""
        if self.cuda:
            ids = self._token_ids.fill_(token)
        else:
            ids = torch.tensor([[token]], device=self.device)
        return self.ends.embed(ids)

    def ar_entry(self, pos: int, token: int) -> InFlight:
        """A verified token entering depth 0 without anchor rows (AR through the pipeline)."""
        h = self.embed(token)
        return InFlight(pos, token, h, None, self.next_seq(), verified=True)

    def forward_local(self, stage: int, e: InFlight, anchors: Anchors | None) -> None:
        """Target stage ``stage`` (held here) on token ``e``: its output becomes ``e.hidden`` and its captured states
        go to ``e.feats`` (when ``anchors`` is given)."""
        runner = self.runners[stage]
        out, captured = runner.decode(e.hidden, e.pos)
        if anchors is not None:
            anchors.store(e.feats, captured)
        e.hidden = out.clone() if runner.static else out

    def send_token(self, e: InFlight, flags: int) -> None:
        """``e.hidden`` down to the first remote stage (non-blocking)."""
        self.links.down_link.send(Kind.DECODE, e.seq, e.pos, 1, flags, e.hidden.contiguous())

    # ------------------------------------------------------------------ receiving
    def _recv_up(self, stage: int, seq: int, host_sync: bool = False) -> dict[int, torch.Tensor]:
        """The message of token ``seq`` from stage ``stage`` (dropping older, flushed tokens' messages).

        Returns ``{j: rows [q, H]}``; the rows live in the stage's receive buffer until the next receive from it.
        """
        link, buf = self.links.up_links[stage], self.up_buffers[stage]
        while True:
            hdr = link.recv_header()
            if hdr.kind not in (Kind.PREFILL, Kind.DECODE):
                raise PipeProtocolError(f"{link.me_name}: expected token {seq} from {link.peer_name}, got {hdr}")
            rows = self.links.rows(stage, hdr.flags)
            view = link.recv_payload(buf.view(hdr.q, len(rows), self.H))
            if hdr.seq == seq:
                break
            if hdr.seq > seq:
                raise PipeProtocolError(f"{link.me_name}: expected token {seq} from {link.peer_name}, got {hdr.seq}")
        if host_sync and self.cuda:
            self._arrived.record()  # one event for every host wait (each wait ends before the next record)
            link.host_wait(self._arrived, f"token {seq}")
        return {j: view[:, idx] for idx, j in enumerate(rows)}

    def receive(self, e: InFlight, stage: int, anchors: Anchors | None, host_sync: bool = False) -> None:
        """Remote stage ``stage``'s message of token ``e``: its anchors into ``e.feats``; after the last stage, its
        output becomes ``e.hidden`` (``[1, 1, H]``, a view of the receive buffer)."""
        rows = self._recv_up(stage, e.seq, host_sync)
        if anchors is not None:
            anchors.store(e.feats, rows)
        if stage == self.n - 1 and self.L in rows:
            e.hidden = rows[self.L].reshape(1, 1, -1)

    def _discard(self, stage: int, hdr: Header) -> None:
        """Drop the payload of a flushed token's message."""
        rows = self.links.rows(stage, hdr.flags)
        self.links.up_links[stage].recv_payload(self.up_buffers[stage].view(hdr.q, len(rows), self.H))

    # ------------------------------------------------------------------ a generation's ends
    def prefill(self, prompt: Sequence[int], anchors: Anchors | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt through every stage: local ones here, remote ones by message.

        Returns:
            ``(final [s0, H], feats)``: the last stage's output, and with ``anchors`` the prompt's anchor rows
            ``[s0, m, H]`` (``None`` without).
        """
        s0 = len(prompt)
        h = self.ends.embed(torch.tensor([list(prompt)], device=self.device))  # [1, s0, H]
        feats = anchors.rows(h[0]) if anchors is not None else None
        flags = FLAG_ANCHORS if anchors is not None else 0
        seq = self.next_seq()
        final = None
        for s in self.plan.head_stages:
            h, captured = self.runners[s].prefill(h)
            if anchors is not None:
                anchors.store(feats, captured)
        if self.plan.head_stages and self.plan.head_stages[-1] == self.n - 1:
            final = h[0]
        if self.links.down_link is not None:
            self.links.down_link.send(Kind.PREFILL, seq, 0, s0, flags, h.contiguous())
            for s in self.plan.remote_stages:
                if not self.links.rows(s, flags):
                    continue
                rows = self._recv_up(s, seq, host_sync=(s == self.n - 1))
                if anchors is not None:
                    anchors.store(feats, rows)
                if s == self.n - 1 and self.L in rows:
                    final = rows[self.L]
        return final, feats

    def end_generation(self, metrics: SPDMetrics) -> None:
        """END down the pipe; drain every remote stage's remaining messages up to its statistics, which go into
        ``metrics`` (forward seconds per stage), as do the local runners'."""
        for s, r in self.runners.items():
            metrics.observe_time("stage_forward", r.take_stats()[0], stage=s)
        if self.links.down_link is None:
            return
        self.links.down_link.send(Kind.END, self.next_seq())
        for s in self.plan.remote_stages:
            link = self.links.up_links[s]
            while True:
                hdr = link.recv_header()
                if hdr.kind in (Kind.PREFILL, Kind.DECODE):  # a flushed token's message
                    self._discard(s, hdr)
                elif hdr.kind == Kind.END:
                    metrics.observe_time("stage_forward", float(link.recv_stats(hdr.q)[0]), stage=s)
                    break
                else:
                    raise PipeProtocolError(f"{link.me_name}: unexpected {hdr} from {link.peer_name}")

    # ------------------------------------------------------------------ instructions outside generations
    def shutdown(self, abort: bool = False) -> None:
        """SHUTDOWN down the pipe; wait for the last stage's acknowledgement (``abort``: flag it, do not wait)."""
        links, last = self.links, self.n - 1
        links.down_link.send(Kind.SHUTDOWN, self.next_seq(), flags=FLAG_ABORT if abort else 0)
        if abort:
            links.down_link.flush()
            return
        while True:  # the last stage acknowledges once every stage has passed SHUTDOWN on
            hdr = links.up_links[last].recv_header()
            if hdr.kind == Kind.SHUTDOWN:
                break
            if hdr.kind in (Kind.PREFILL, Kind.DECODE):
                self._discard(last, hdr)
        links.flush()

    def warmup(self) -> None:
        """A WARMUP message down the pipe, answered by every remote stage."""
        zeros = torch.zeros(1, 1, self.H, dtype=self.dtype, device=self.device)
        self.links.down_link.send(Kind.WARMUP, 0, 0, 1, 0, zeros)
        for s in self.plan.remote_stages:
            link = self.links.up_links[s]
            hdr = link.recv_header()
            if hdr.kind != Kind.WARMUP:
                raise PipeProtocolError(f"{link.me_name}: expected WARMUP from {link.peer_name}, got {hdr}")
            link.recv_payload(self.up_buffers[s].view(1, 1, self.H))


class HeadDriver:
    """What every generation kind on the head rank shares: its request, metrics, verified tokens, decode clock, and
    the end of a generation. A subclass adds its instructions and its schedule.

    Args:
        rank: the :class:`HeadRank`.
    """

    def __init__(self, rank: HeadRank) -> None:
        self.rank = rank
        self.prompt: list[int] = []
        self.max_new = 0
        self.drafter: Drafter | None = None
        self.sampling = SamplingParams()
        self.metrics = SPDMetrics(num_stages=rank.n)
        self.out = TokenOutput(rank.eos, 1)
        self.on_token: Callable[[int], None] | None = None
        self.stop_strings = True
        self.result: GenerationResult | None = None
        self._t_decode: float | None = None
        self._wait0 = 0.0

    def request(self, prompt: Sequence[int], max_new_tokens: int, drafter: Drafter | None,
                sampling: SamplingParams, on_token: Callable[[int], None] | None = None,
                stop_strings: bool = True) -> None:
        """The next generation's prompt, limit (the prefill token included), drafter (``None`` for AR), sampling
        parameters (its distribution and the key of its uniforms), token callback (streaming; ``None``) and whether
        the rank's stop strings end it (``False``: EOS and the limit only)."""
        self.prompt, self.max_new, self.drafter, self.sampling = list(prompt), int(max_new_tokens), drafter, sampling
        self.on_token, self.stop_strings = on_token, stop_strings

    def load_prompt(self) -> None:
        """Instruction LoadPrompt: check the prompt (:class:`~spd_ds.decoding.cycle.PromptError` before any message)
        and start the generation's state."""
        check_prompt(self.prompt, self.max_new, self.rank.max_len, self.rank.n, self.rank.model_max,
                     self.rank.model_max_source)
        self.metrics = SPDMetrics(num_stages=self.rank.n)
        self.out = TokenOutput(self.rank.eos, self.max_new, self.rank.stop if self.stop_strings else None,
                               self.on_token)
        self.result, self._t_decode = None, None
        self._wait0 = self.rank.links.wait_s()

    @property
    def finished(self) -> bool:
        """Whether the generation stopped (EOS or length)."""
        return self.out.finished

    def start_decoding(self) -> None:
        """The prefill is over and the generation goes on: the decode clock and the communication-wait mark start."""
        self._t_decode = time.perf_counter()
        self._wait0 = self.rank.links.wait_s()

    def end_generation(self) -> None:
        """Instruction EndGeneration: stop the clock, collect every stage's forward time (draining the pipe), close the
        metrics and keep the :class:`~spd_ds.decoding.cycle.GenerationResult` in :attr:`result`."""
        decode_s = None
        if self._t_decode is not None:
            decode_s = time.perf_counter() - self._t_decode
            self.metrics.observe_time("comm", self.rank.links.wait_s() - self._wait0)
        self.rank.end_generation(self.metrics)
        self.result = self.out.result(self.metrics, decode_s, split_stages=self.rank.plan.head_stages)
