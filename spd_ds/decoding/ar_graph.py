"""The strongest autoregressive (AR) baseline we can run: static KV cache + one CUDA graph per decode token.

gpt-fast's recipe on our stage code: the caches are static buffers (:func:`spd_ds.models.graphs.make_static_cache`,
the same static-cache forward :func:`~spd_ds.models.graphs.static_stage_forward` that the pipeline engine's graphed
stages run), and the whole one-token step, embedding -> every stage -> final norm -> LM head (-> argmax at T = 0), is
captured once as a ``torch.cuda.CUDAGraph`` and replayed per token.

At T = 0 the graph also feeds its own output back: it writes the argmax into the next step's input token, advances
the position and records the token in a device buffer, so the host launches ``sync_every`` replays back to back and
reads the tokens (one synchronisation) only then, stopping at the first EOS; the replays after an EOS inside a chunk
are wasted work and are counted in the decode time. At T > 0 the graph stops at the logits and the host samples with
the same position-keyed uniforms as :class:`~spd_ds.decoding.ar.ARDecoder` (one synchronisation per token).

On CPU (or with ``use_graph=False``) the same static forward runs eagerly: that path is the one the tests check
against :class:`~spd_ds.decoding.ar.ARDecoder`.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from spd_ds.decoding.metrics import SPDMetrics
from spd_ds.decoding.cycle import GenerationResult, TokenOutput, check_prompt, eos_set, first_token
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.stopping import StopStrings
from spd_ds.models.adapter import Target
from spd_ds.models.graphs import capture_graph, make_static_cache, static_stage_forward


class ARGraphDecoder:
    """AR decoding of a whole :class:`~spd_ds.models.adapter.Target` over static caches, one CUDA graph per token.

    Args:
        target: the target (its stages are used in order, as one model; weights are shared, not copied).
        sampling: :class:`~spd_ds.decoding.sampling.SamplingParams` (fixed at construction: the graph differs).
        eos_token_ids: ids that end generation.
        max_len: KV capacity in positions (prompt + new tokens).
        use_graph: capture a CUDA graph; ``None`` = when the target is on a CUDA device.
        sync_every: T = 0 only: replays launched between two reads of the generated tokens (>= 1); ``None`` = 4 on a
            CUDA device (on one H100, SmolLM2 bf16: 4 and 1 decode at the same rate, 16 1 % and 64 8 % slower, the
            replays after an EOS counted; docs/benchmarks.md, ``scripts/diagnostics/ar_graph_sync.py``), 1 elsewhere
            (on CPU the host runs every step itself, so a chunk launches nothing ahead and only adds steps after an EOS
            to the decode time).
        warmup: eager runs on a side stream before the capture.
        caches: the static caches, one per stage (default: :func:`~spd_ds.models.graphs.make_static_cache` of each
            stage; a tensor-parallel shard passes caches of its own KV heads, :mod:`spd_ds.eval.tp_baseline`).
        stop_strings: end a generation once its text contains one of these
            (:class:`~spd_ds.decoding.stopping.StopStrings`; checked on the host as the tokens are read, so at T = 0
            the replays after it inside a chunk are wasted work, as after an EOS).

    Every rank of a tensor-parallel target builds and runs its own decoder in lockstep: the collectives inside the
    stages are captured with the rest (the capture tolerates other threads, e.g. NCCL's watchdog, querying events).

    Raises:
        ValueError: ``use_graph=True`` on a non-CUDA target, ``sync_every < 1``, or given caches that are not one
            static cache per stage of at least ``max_len`` positions (capped at the target's ``max_positions``).
    """

    def __init__(self, target: Target, sampling: SamplingParams = SamplingParams(),
                 eos_token_ids: int | Iterable[int] | None = None, max_len: int = 4096, *,
                 use_graph: bool | None = None, sync_every: int | None = None, warmup: int = 3,
                 caches: Sequence | None = None, stop_strings: StopStrings | None = None) -> None:
        self.target, self.sampling = target, sampling
        self.stop = stop_strings
        self.eos = eos_set(eos_token_ids)
        self.max_len = min(int(max_len), target.arch.max_positions)
        self.device = target.device
        cuda = self.device.type == "cuda"
        use_graph = cuda if use_graph is None else bool(use_graph)
        if use_graph and not cuda:
            raise ValueError(f"CUDA graphs need the target on a CUDA device, not {self.device}")
        sync_every = (4 if cuda else 1) if sync_every is None else sync_every
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.sync_every = int(sync_every)
        self.stages = list(target.stages)
        self.caches = [make_static_cache(s, self.max_len) for s in self.stages] if caches is None else list(caches)
        if len(self.caches) != len(self.stages):
            raise ValueError(f"need one static cache per stage ({len(self.stages)}), got {len(self.caches)}")
        if any(not c.static or c.max_len < self.max_len for c in self.caches):
            raise ValueError(f"the given caches must be static with >= {self.max_len} positions, got "
                             f"{[(c.static, c.max_len) for c in self.caches]}")
        # static inputs/outputs (fixed addresses)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # [1, 1] token fed at ``pos``
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)  # [1] its position
        self.out = torch.zeros(self.max_len + 1, dtype=torch.long, device=self.device)  # greedy: token by position
        self.logits: torch.Tensor | None = None  # [V] fp32 logits of the last step
        self.graph: torch.cuda.CUDAGraph | None = None
        if use_graph:
            self._capture(warmup)

    # ------------------------------------------------------------------ one step (capturable)
    def _step(self) -> torch.Tensor:
        """Embed ``tok`` at ``pos``, run every stage, return fp32 logits ``[V]``; at T = 0 also feed the argmax back
        (``tok`` <- argmax, ``pos`` += 1, ``out[pos]`` <- argmax)."""
        h = self.target.ends.embed(self.tok)
        h, _ = static_stage_forward(self.stages, self.caches, h, self.pos)
        logits = self.target.ends.logits(h[0, 0])
        if self.sampling.greedy:
            nxt = torch.argmax(logits).view(1)
            self.pos.add_(1)
            self.out.index_copy_(0, self.pos, nxt)
            self.tok.copy_(nxt.view(1, 1))
        return logits

    def _capture(self, warmup: int) -> None:
        def warm():  # writes garbage at low positions; every prefill rewrites them
            self.pos.zero_()
            self._step()

        self.graph, self.logits = capture_graph(self._step, self.device, warmup=warmup, warmup_step=warm,
                                                capture_error_mode="thread_local")
        self.pos.zero_()

    @property
    def graphed(self) -> bool:
        """Whether decode steps replay a captured CUDA graph."""
        return self.graph is not None

    def _replay(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._step()
        return self.logits

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        """Eager static-cache forward of the prompt (positions ``0..s0-1``); returns fp32 logits ``[V]`` of its last
        position."""
        s0 = len(prompt)
        ids = torch.tensor([list(prompt)], device=self.device)
        h = self.target.ends.embed(ids)
        h, _ = static_stage_forward(self.stages, self.caches, h, torch.arange(s0, device=self.device))
        return self.target.ends.logits(h[0, -1])

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """AR continuation of ``prompt`` (token ids); same contract as :class:`~spd_ds.decoding.ar.ARDecoder`.

        ``metrics.prefill_s`` and ``metrics.decode_s`` are wall seconds ending at a host synchronisation (a token
        read), ``num_cycles`` = decode steps replayed (greedy: may exceed ``N - 1`` by the replays after an EOS or a
        stop string).

        Raises:
            PromptError: empty or too long prompt.
        """
        arch = self.target.arch
        check_prompt(prompt, max_new_tokens, self.max_len, 1, arch.max_positions, arch.max_positions_source)
        metrics = SPDMetrics(num_stages=1)
        s0 = len(prompt)
        t0 = time.perf_counter()
        tok = first_token(self.prefill(prompt), self.sampling, s0)
        metrics.observe_prefill(time.perf_counter() - t0)
        out = TokenOutput(self.eos, max_new_tokens, self.stop)
        out.emit(tok)
        t1 = time.perf_counter()
        if self.sampling.greedy:
            self.tok.fill_(tok)
            self.pos.fill_(s0)
            while not out.finished:
                k = min(self.sync_every, max_new_tokens - len(out.tokens))
                for _ in range(k):
                    self._replay()
                metrics.observe_cycle(k)
                start = s0 + len(out.tokens)
                for t in self.out[start:start + k].tolist():  # the one host sync of the chunk
                    if out.emit(t):
                        break
        else:
            pos = s0
            while not out.finished:
                self.tok.fill_(tok)
                self.pos.fill_(pos)
                logits = self._replay()
                pos += 1
                tok = first_token(logits, self.sampling, pos)
                out.emit(tok)
                metrics.observe_cycle()
        return out.result(metrics, time.perf_counter() - t1)
