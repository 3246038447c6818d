"""SPD generation: answer prompts with Speculative Pipeline Decoding and print the answers, SPD metrics and SPD's speed
against autoregressive (AR) decoding measured in the same run.

One process (reference decoder, CPU or one GPU; the stages run one after another, so no speedup is expected)::

    python launch/infer.py --config launch/configs/smollm2_spd.yaml [section.key=value ...]

Through DeepSpeed's pipeline engine (n stage ranks, one device per stage; several nodes with ``--hostfile``)::

    deepspeed --num_gpus 2 launch/infer.py --config launch/configs/smollm2_spd.yaml

``section.key=value`` overrides may stand before or after the options. Every prompt is also decoded
autoregressively on the same stage code (through the same pipeline under DeepSpeed): its decode tok/s is printed
beside SPD's, and at temperature 0 the answers are checked token for token against it (``--no-compare-ar`` skips
AR). User errors (config, prompts, head, model) end the run with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path


from spd_ds.cli import (check_output_file, checks_outputs, chosen_engine, decoding_user_errors, experiment_parser,
                        rank_and_world, removed_if_left_empty, run_cli, setup_logging, setup_process)
from spd_ds.cli_args import override_key
from spd_ds.config import ConfigError, load_config
from spd_ds.config_checks import validate
from spd_ds.decoding.metrics import SPDMetrics, pooled_decode_accept_length, pooled_decode_tok_s
from spd_ds.pipe.topology import detect_world_size

log = logging.getLogger("spd_ds.infer")


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed command line (``argv``: default ``sys.argv[1:]``; ``--help`` documents every option)."""
    ap = experiment_parser(__doc__, overrides_help="section.key=value overrides, e.g. partition.num_stages=3",
                           engine_help="auto: DeepSpeed engine when launched with WORLD_SIZE > 1, else the reference "
                                       "decoder")
    ap.add_argument("--prompt", action="append", help="a prompt text (repeatable; each one is answered); default: "
                                                      "the first data.num_prompts records of data.prompts")
    ap.add_argument("--compare-ar", dest="compare_ar", action=argparse.BooleanOptionalAction, default=True,
                    help="also decode every prompt autoregressively on the same stage code: its tok/s beside SPD's "
                         "and, at T=0, a token-for-token check of SPD's answers")
    ap.add_argument("--stop", action="append", default=[], metavar="TEXT",
                    help="a stop string (repeatable; added to decoding.stop): an answer ends with the token that "
                         "completes it, and is printed without it (a newline: --stop $'\\n' in bash)")
    ap.add_argument("--stream", action="store_true",
                    help="print each SPD answer as its tokens are verified (in bursts: accepted drafts arrive "
                         "together); the progress line is off then")
    ap.add_argument("--output", help="write one JSON line per prompt here: question_id (as the prompt file has it; "
                                     "promptN for --prompt), text (the answer as printed), tokens (its new token "
                                     "ids), finish_reason, identical_to_ar, and the metrics of docs/benchmarks.md")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                    help="a progress line (prompts, tokens) on stderr while decoding")
    return ap.parse_args(argv)


def load_prompt_texts(cfg, args) -> list[tuple[str, str]]:
    """(id, text) pairs: ``--prompt`` values, else the first turn of each record of ``data.prompts``.

    ``data.prompts`` (the set or file) and ``data.num_prompts`` (how many of its records), which ``--prompt``
    replaces: either given on the command line (``args.overrides``) beside ``--prompt`` is refused rather than
    ignored; the ``--config`` file's values (the shipped configs set both) are not used with ``--prompt``.

    Raises:
        ConfigError: no prompt at all (an empty file or set), an empty or whitespace-only ``--prompt``, a
            ``data.prompts=...`` or ``data.num_prompts=...`` override beside ``--prompt``, or malformed records (an
            empty user turn included); raised before any model loads and before any collective.
        FileNotFoundError / PromptSetUnavailableError: ``data.prompts`` is neither a file nor an obtainable set.
    """
    if args.prompt:
        for o in args.overrides:
            what = {"data.num_prompts": "data.num_prompts counts the records taken from data.prompts",
                    "data.prompts": "data.prompts names the prompt set or file"}.get(override_key(o))
            if what:
                raise ConfigError(f"override {o!r} does not combine with --prompt: {what}, which --prompt replaces "
                                  f"(all {len(args.prompt)} --prompt texts are answered); leave out one of the two")
        for i, p in enumerate(args.prompt):  # a blank prompt would still be answered (after the template's markers)
            if not p.strip():
                raise ConfigError(f"--prompt number {i + 1} is empty ({p!r}); give the prompt's text or leave it out")
        return [(f"prompt{i}", p) for i, p in enumerate(args.prompt)]
    from spd_ds import builder
    from spd_ds.eval.prompts import load_prompts

    try:
        recs = load_prompts(cfg.data.prompts, cfg.data.num_prompts, builder.resolve_path(cfg.data.eval_dir))
    except ValueError as e:  # malformed records
        raise ConfigError(f"data.prompts={cfg.data.prompts}: {e}") from None
    if not recs:
        raise ConfigError(f"data.prompts={cfg.data.prompts} holds no prompts; give a jsonl file with records "
                          "(one {\"turns\": [\"...\"]} a line), a prompt-set name, or --prompt TEXT")
    return [(r["question_id"], r["turns"][0]) for r in recs]  # the id as the file has it (--output keeps it)


def main(argv=None) -> int:
    """Run the job (see the module docstring). Exit status 0; 2 after a user error (one line); under a launcher 1
    after any other error (one rank-tagged line, traceback in a log file; ``SPD_DEBUG=1`` prints it)."""
    return run_cli(_main, argv, user_errors=decoding_user_errors, prog="infer")


class _Progress:
    """tqdm line on stderr: generations done and tokens so far. With the AR check every prompt is generated twice
    (SPD, then AR), so the bar counts ``2 x prompts`` generations and its label says which pass runs and how far it
    is (``SPD 2/3 prompts``, then ``AR check 1/3 prompts``). It appears when the first generation starts (after model
    loading); while it is open, log records (ours and DeepSpeed's) are written above it."""

    def __init__(self, num_prompts: int, passes: int, enabled: bool) -> None:
        self.num_prompts, self.total = num_prompts, num_prompts * passes
        self.enabled = enabled and self.total > 0
        self.bar, self.tokens, self._redirect = None, 0, None
        self.done: dict[str, int] = {}

    def _label(self, kind: str) -> str:
        name = "SPD" if kind == "spd" else "AR check"
        return f"{name} {self.done.get(kind, 0)}/{self.num_prompts} prompts"

    def __call__(self, kind: str, index: int, result) -> None:
        """Progress callback: ``result`` is ``None`` when generation ``index`` starts, its result when done."""
        if self.enabled and self.bar is None:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm([logging.getLogger(), logging.getLogger("DeepSpeed")])
            self._redirect.__enter__()
            self.bar = tqdm(total=self.total, desc=self._label(kind), unit="generation", dynamic_ncols=True)
        if self.bar is None:
            return
        if result is None:  # a new pass shows its label at once; a new prompt of the same pass adds no line to a log
            if self.bar.desc.rstrip(": ") != self._label(kind):
                self.bar.set_description(self._label(kind))
            return
        self.tokens += len(result.tokens)
        self.done[kind] = self.done.get(kind, 0) + 1
        self.bar.set_description(self._label(kind), refresh=False)
        self.bar.set_postfix_str(f"{self.tokens} tokens", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
            self.bar = None


def answer_text(tok, tokens, finish_reason: str, stop) -> str:
    """An answer's text as printed (special tokens left out, no clean-up of spaces), cut before its stop string when
    one ended it (as vLLM returns it).

    Args:
        tok: the target's tokenizer. tokens: the answer's token ids (``list[int]``, the prefill token first).
        finish_reason: ``eos``, ``length`` or ``stop`` (``GenerationResult.finish_reason``).
        stop: the run's :class:`~spd_ds.decoding.stopping.StopStrings`, or None without ``decoding.stop``.
    Returns:
        The text (``str``). Raises nothing of its own (the tokenizer's errors propagate)."""
    text = tok.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return stop.truncate(text) if finish_reason == "stop" and stop is not None else text


class _Streamer:
    """``--stream``: prints each SPD answer on stdout as its tokens are verified.

    Detokenized incrementally (vLLM's way: the text of a few tokens before the new ones and of the new ones, so the
    cost per token does not grow with the answer), and only what is certain is printed: an incomplete character
    (``\ufffd``) and, with stop strings, the last ``len - 1`` characters that could still begin one wait for the next
    token; the answer's end prints the rest of :func:`answer_text`. The header is printed with the first token (a
    prompt refused before it prints nothing); :meth:`close` ends a line an error left open. The printing runs inside
    the decode loop, so a ``--stream`` run's SPD timings include it (microseconds per token).

    Args:
        tok: the target's tokenizer. prompts: ``(id, text)`` pairs. stop: the run's
            :class:`~spd_ds.decoding.stopping.StopStrings` or ``None``. out: the text stream (stdout).
    """

    def __init__(self, tok, prompts, stop, out=None) -> None:
        self.tok, self.prompts, self.stop, self.out = tok, prompts, stop, out or sys.stdout
        self.hold = max((len(s) for s in stop.strings), default=1) - 1 if stop is not None else 0
        self.index: int | None = None
        self.open = False  # header printed, answer line not ended
        self.tokens: list[int] = []  # the current answer's tokens so far
        self.text, self.printed = "", 0  # its text decoded so far, and how much of it is on stdout
        self.prefix, self.read = 0, 0  # token offsets: decoded context start, first token not yet in ``text``

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _write(self, upto: str, header: bool = False) -> None:
        if not (header or len(upto) > self.printed):
            return
        if not self.open:
            qid, text = self.prompts[self.index]
            self.out.write(f"\n=== [{qid}] {text[:200]}\n")
            self.open = True
        if len(upto) > self.printed:
            self.out.write(upto[self.printed:])
            self.printed = len(upto)
        self.out.flush()

    def start(self, index: int) -> None:
        self.index, self.open = index, False
        self.tokens, self.text, self.printed, self.prefix, self.read = [], "", 0, 0, 0

    def __call__(self, index: int, token: int) -> None:
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix:self.read])
        now = self._decode(self.tokens[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        certain = self.text
        if self.stop is not None:
            cut = self.stop.truncate(certain)
            certain = cut if len(cut) < len(certain) else certain[:max(0, len(certain) - self.hold)]
        self._write(certain)

    def end(self, result) -> None:
        text = answer_text(self.tok, self.tokens, result.finish_reason, self.stop)
        if not text.startswith(self.text[:self.printed]):  # a tokenizer that decodes differently in pieces
            self.printed = 0
            self.out.write("\n")
        self._write(text, header=True)
        self.close()

    def close(self) -> None:
        """End the current answer's line (after an error too)."""
        if self.open:
            self.out.write("\n")
            self.out.flush()
            self.open = False


def _main(argv=None) -> int:
    args = parse_args(argv)
    if args.output is None:
        return _run(args)
    with removed_if_left_empty(Path(args.output).absolute().parent):  # a refused run leaves no empty folders behind
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The job of :func:`main` once its arguments are parsed; returns the exit status."""
    from spd_ds import builder  # after the arguments: --help imports no torch
    from spd_ds.decoding.cycle import PromptError, check_prompt

    setup_logging()
    setup_process()
    cfg = load_config(args.config, args.overrides)
    if "" in args.stop:
        raise ConfigError("--stop '' is empty; give the text that ends an answer (a newline: --stop $'\\n' in bash)")
    if args.stop:
        cfg.decoding.stop = [*cfg.decoding.stop, *args.stop]
        validate(cfg)
    prompts = load_prompt_texts(cfg, args)  # before any model is fetched or loaded: an empty set fails here
    if args.output is not None and checks_outputs():  # which ranks: spd_ds.cli.checks_outputs
        check_output_file(args.output, "--output")
    world = detect_world_size()
    engine = chosen_engine(args.engine)
    if engine == "reference" and rank_and_world()[0] != 0:
        return 0  # --engine reference under a launcher: rank 0 alone decodes (as launch/eval.py does)

    if cfg.decoding.drafter == "head":  # on every rank, before the model is resolved and before any collective
        builder.check_head_inputs(cfg)
    arch = builder.build_arch(cfg)
    tok = builder.prompt_tokenizer(cfg, arch)
    ids = [builder.encode_prompt(tok, text, cfg.decoding.chat_template) for _, text in prompts]
    n = builder.configured_num_stages(cfg)
    max_len = min(cfg.decoding.max_length, arch.max_positions)
    cfg.decoding.max_length = max_len  # every decoder's KV capacity, capped at the model's context as the engine does
    for (qid, _), prompt in zip(prompts, ids):  # before the weights load, by the decoders' own rule (check_prompt)
        try:
            check_prompt(prompt, cfg.decoding.max_new_tokens, max_len, n, arch.max_positions, arch.max_positions_source)
        except PromptError as e:
            raise PromptError(f"[{qid}] {e}") from None
    head_rank = rank_and_world()[0] == 0
    if head_rank and cfg.decoding.drafter == "head" and not cfg.head.checkpoint:
        log.warning("no head.checkpoint: an untrained speculation head drafts, so almost no draft is accepted (the "
                    "answers are the target's all the same); launch/configs/smollm2_spd.yaml names the shipped head")
    bar = _Progress(len(ids), 2 if args.compare_ar else 1, args.progress and head_rank and not args.stream)
    streamer = _Streamer(tok, prompts, builder.stop_strings(cfg, tok)) if args.stream and head_rank else None

    def on_generation(kind, index, result):
        bar(kind, index, result)
        if streamer is not None and kind == "spd":
            if result is None:
                streamer.start(index)
            else:
                streamer.end(result)
    try:
        if engine == "deepspeed":
            from spd_ds.pipe.runner import run_distributed_inference

            if head_rank:
                log.info("engine deepspeed: %d rank(s), %d stages, head.placement=%s", world, n, cfg.head.placement)
            out = run_distributed_inference(cfg, ids, cfg.decoding.max_new_tokens, with_ar=args.compare_ar,
                                            on_generation=on_generation, on_token=streamer)
            if out is None:  # not the verifying rank
                return 0
            results, ar = out if args.compare_ar else (out, None)
            ar_name = "AR through the same pipeline"
        else:
            results, ar = run_reference(cfg, arch, tok, ids, args.compare_ar, on_generation, streamer)
            ar_name = "AR decoding"
    finally:
        bar.close()
        if streamer is not None:
            streamer.close()
    report(cfg, tok, prompts, results, args, ar, ar_name, one_process=(engine == "reference" or world == 1))
    return 0


def run_reference(cfg, arch, tok, ids, with_ar: bool = False, on_generation=None, on_token=None):
    """Generate every prompt with the single-process reference decoder, then (``with_ar``) with the AR decoder on the
    same target. Prompt ``i`` is request ``i`` of the run (its sampling key, ``spd_ds.decoding.sampling``).

    ``on_generation(kind, index, result)``: progress callback, ``kind`` ``spd`` or ``ar``, ``result`` ``None`` when a
    generation starts. ``on_token(index, token)``: streaming callback for each verified SPD token.

    Returns:
        ``(spd results, ar results or None)``, lists of :class:`~spd_ds.decoding.reference.GenerationResult`.
    """
    from spd_ds import builder
    from spd_ds.decoding.ar import ARDecoder
    from spd_ds.decoding.drafters import oracle_reference
    from spd_ds.decoding.reference import SPDReferenceDecoder

    part = builder.build_partition(cfg, arch)
    target = builder.build_target(cfg, arch, part)
    head = builder.build_head(cfg, arch, part)
    eos = builder.eos_token_ids(cfg, arch, tok)
    stop = builder.stop_strings(cfg, tok)
    log.info("target %s: %d layers in %d stages %s, anchors %s, device %s", arch.model_dir.name, arch.num_layers,
             part.num_stages, list(part.stage_layers), list(part.anchors), target.device)
    results = []
    oracle = cfg.decoding.drafter == "oracle"
    drafter = None if oracle else builder.build_drafter(cfg, head, arch, target.device)  # one head drafter (graph)
    for i, p in enumerate(ids):
        sampling = builder.sampling_params(cfg, request=i)
        if oracle:
            # no stop strings: drafts past them too
            reference = oracle_reference(target, p, cfg.decoding.max_new_tokens + part.num_stages, sampling, eos,
                                         cfg.decoding.max_length)
            drafter = builder.build_drafter(cfg, head, arch, target.device, reference)
        dec = SPDReferenceDecoder(target, drafter, sampling, eos, cfg.decoding.max_length, stop_strings=stop)
        if on_generation is not None:
            on_generation("spd", i, None)
        stream = None if on_token is None else functools.partial(on_token, i)
        results.append(dec.generate(p, cfg.decoding.max_new_tokens, on_token=stream))
        if on_generation is not None:
            on_generation("spd", i, results[-1])
    if not with_ar:
        return results, None
    ar_results = []
    ar = ARDecoder(target, builder.sampling_params(cfg), eos, cfg.decoding.max_length, stop_strings=stop)
    for i, p in enumerate(ids):
        ar.sampling = builder.sampling_params(cfg, request=i)
        if on_generation is not None:
            on_generation("ar", i, None)
        ar_results.append(ar.generate(p, cfg.decoding.max_new_tokens))
        if on_generation is not None:
            on_generation("ar", i, ar_results[-1])
    return results, ar_results


def speed_lines(cfg, results, ar_results=None, ar_name: str = "AR decoding", one_process: bool = True) -> list[str]:
    """The speed verdict: SPD's and AR's decode tok/s from the same run and their ratio, what the acceptance metric
    means, and (one process) why no speedup is expected there.

    Args:
        results: SPD's :class:`~spd_ds.decoding.reference.GenerationResult` per prompt.
        ar_results: AR's, same prompts and run (``None``: AR did not run).
        one_process: all stages ran in one process (the reference decoder, or a world of one rank).
    Returns:
        Lines to print; one line saying there is nothing to report when no answer had a decode cycle (every answer
        was its prefill's token alone).
    """
    metrics = [r.metrics for r in results]
    n = metrics[0].num_stages if metrics else cfg.partition.num_stages
    if not any(m.num_cycles for m in metrics):  # every answer ended at its prefill token: no rate, no acceptance
        return ["speed: no decode tokens (every answer ended at its first token: decoding.max_new_tokens=1, or EOS or "
                "a stop string at once), so there is no speed or acceptance to report"]
    spd = pooled_decode_tok_s(metrics)
    out = []
    if ar_results is not None:
        ar = pooled_decode_tok_s([r.metrics for r in ar_results])
        ratio = f"SPD is {spd / ar:.2f}x AR" if ar > 0 else "no AR time measured"
        out.append(f"speed: SPD {spd:.1f} tok/s, AR {ar:.1f} tok/s ({ar_name}, same run; decode tokens per second, "
                   f"the prefill token excluded): {ratio}")
    else:
        out.append(f"speed: SPD {spd:.1f} tok/s (decode tokens per second); AR did not run (--no-compare-ar), so "
                   "there is no speed comparison")
    decode_len = pooled_decode_accept_length(metrics)
    total_len = SPDMetrics.pooled(metrics).equivalent_accept_length
    out.append(f"meaning: equivalent accept length = n*N/K = {decode_len:.2f} over decode tokens (the prefill token "
               f"not counted): 1.00 = no gain over AR, {n} (= n) = every draft accepted. The totals' "
               f"equivalent_accept_length {total_len:.2f} counts the prefill token in N, which lifts even a head that "
               "accepts nothing above 1.00 on short answers.")
    if n == 1:  # no pipeline: nothing runs beside the head's draft, with one process or one GPU alike
        out.append("note: with partition.num_stages=1 there is no pipeline (the whole model is one stage), so SPD "
                   "cannot beat AR on any machine; the speedup needs n >= 2 stages on one device each")
    elif one_process:
        out.append(f"note: in one process the {n} stages run one after another, so SPD cannot beat AR here (expect "
                   f"< 1x); the speedup needs one device per stage: deepspeed --num_gpus {n} launch/infer.py "
                   "--config ... on a machine with GPUs (see README, docs/distributed.md).")
    return out


def report(cfg, tok, prompts, results, args, ar_results=None, ar_name="AR decoding", one_process=True) -> None:
    """Print answers, per-prompt metrics, the AR comparison (T = 0), the totals and the speed lines; write
    ``--output`` JSONL.

    ``ar_results``: AR generations of the same prompts in the same run (under DeepSpeed through the same pipeline),
    or ``None``. The totals and rows give rates and tok/s that do not apply (no draft verified, no decode token:
    ``decoding.max_new_tokens=1``) as null, by eval's rule (:func:`spd_ds.eval.report.rates`, ``speeds``).
    """
    from spd_ds import builder
    from spd_ds.eval.report import rates as report_rates, speeds

    greedy = cfg.decoding.temperature == 0
    ar_tokens = [r.tokens for r in ar_results] if ar_results is not None and greedy else None
    total = SPDMetrics.pooled([r.metrics for r in results])
    rows = []
    stop = builder.stop_strings(cfg, tok)
    for i, ((qid, text), res) in enumerate(zip(prompts, results)):
        m = res.metrics
        streamed = getattr(args, "stream", False)
        answer = answer_text(tok, res.tokens, res.finish_reason, stop)
        if streamed:  # the question and answer were printed as they came: one metrics line per prompt here
            head = f"\n--- [{qid}] " if i == 0 else f"--- [{qid}] "
        else:
            print(f"\n=== [{qid}] {text[:200]}")
            print(answer)
            head = "--- "
        same = None if ar_tokens is None else ar_tokens[i] == res.tokens
        rates = (f"in {m.num_cycles} cycles, draft acceptance {m.draft_acceptance_rate:.3f}, equivalent accept length "
                 f"{m.equivalent_accept_length:.2f}, {m.decode_tok_s:.1f} tok/s" if m.num_cycles else
                 "(the prefill's token alone: no decode cycle)")
        print(f"{head}{m.num_new_tokens} tokens {rates}, finish {res.finish_reason}"
              + ("" if same is None else f", identical to AR: {'yes' if same else 'NO'}"))
        # the rates and tok/s are None where not applicable (no draft verified, no decode token), as in eval's reports
        row = {"question_id": qid, "text": answer, "tokens": res.tokens, "finish_reason": res.finish_reason,
               "identical_to_ar": same, **m.to_dict(), **report_rates(m, True),
               "decode_tok_s": speeds([m], True)["decode_tok_s"]}
        if ar_results is not None:
            row["ar_decode_tok_s"] = speeds([ar_results[i].metrics], False)["decode_tok_s"]
        rows.append(row)
    print("\n=== totals")
    metrics = [r.metrics for r in results]
    totals = {k: v for k, v in total.to_dict().items() if not isinstance(v, list)}
    totals.update(report_rates(total, True))
    totals["decode_tok_s"] = speeds(metrics, True)["decode_tok_s"]  # prefill token excluded per prompt
    totals["equivalent_accept_length_decode"] = (pooled_decode_accept_length(metrics) if total.num_cycles
                                                 else None)
    if ar_results is not None:
        totals["ar_decode_tok_s"] = speeds([r.metrics for r in ar_results], False)["decode_tok_s"]
        totals["speedup_vs_ar"] = (totals["decode_tok_s"] / totals["ar_decode_tok_s"]
                                   if totals["decode_tok_s"] is not None and totals["ar_decode_tok_s"] else None)
    print(json.dumps(totals, indent=1))
    if ar_tokens is not None:
        n_same = sum(r["identical_to_ar"] for r in rows)
        print(f"identical to {ar_name}: {n_same}/{len(rows)} prompts")
    elif ar_results is not None:
        print(f"T={cfg.decoding.temperature:g} > 0: answers are samples (only distributions match AR's); AR ran for "
              "its speed")
    print()
    for line in speed_lines(cfg, results, ar_results, ar_name, one_process):
        print(line)
    if args.output is not None:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
