"""The self-distillation run: rounds of waves of ``generate`` calls over all conversations, under a time budget."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from spd_ds.train.selfdistill.config import (
    FINISH_EOS, FINISH_LENGTH, FORMAT, MANIFEST, SelfDistillConfig, SelfDistillError,
)
from spd_ds.train.selfdistill.generation import AnswerGenerator, CallStats, Row, item_key, register_gqa_decode_attention
from spd_ds.train.selfdistill.prompts import PromptConversation, _encode_texts, _render, turn_glue
from spd_ds.train.selfdistill.storage import Item, _Store, id_dtype_for, model_fingerprint
from spd_ds.train.split import held_out_score


def run_selfdistill(convs: Sequence[PromptConversation], model_dir: str | os.PathLike, tokenizer,
                    out_dir: str | os.PathLike, cfg: SelfDistillConfig, *, model=None, device=None,
                    dtype: torch.dtype | None = None, eos_token_ids: Sequence[int] | None = None,
                    source: Sequence[str] = (), model_name: str | None = None, t_start: float | None = None,
                    log: Callable[[str], None] | None = None) -> dict:
    """Answer every round of ``convs`` with the target into shards under ``out_dir`` (resuming what is there).

    Args:
        convs: conversations (:func:`load_prompt_conversations`).
        model_dir: the target's HF directory (loaded unless ``model`` is given).
        tokenizer: its tokenizer, with the chat template.
        out_dir: output directory (shards + ``manifest.json``).
        cfg: settings (:class:`SelfDistillConfig`).
        model: an already loaded model (tests); device / dtype: default CUDA + bf16 when available, else CPU + fp32.
        eos_token_ids: ids that end an answer (default: the tokenizer's EOS plus the checkpoint's
            ``generation_config.eos_token_id``).
        source, model_name: recorded in the manifest.
        t_start: ``time.perf_counter()`` the time budget and the throughput count from (default: now).
        log: one-line progress messages (default: stderr).

    Returns:
        This run's summary (also appended to the manifest's ``runs``): answers and answer tokens generated now,
        ``wall_s`` (from ``t_start``, model loading and prompt encoding included), ``generate_s``, generated tokens/s
        over both, per-round counts, whether the time budget stopped it, and the manifest's totals.

    Raises:
        SelfDistillError: inconsistent settings (resume with other content settings, prompt + answer longer than the
            model's positions, an empty conversation list).
    """
    t_start = time.perf_counter() if t_start is None else t_start
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if not convs:
        raise SelfDistillError("no conversation to answer; check --data")
    out_dir = Path(out_dir)
    if model is None:
        from spd_ds.builder import load_generation_model

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        attn = register_gqa_decode_attention() if cfg.attention == "gqa-decode" else "sdpa"
        model = load_generation_model(model_dir, dtype, attn_implementation=attn).to(device).eval()
    eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if not eos_token_ids and gen_eos is not None:
        eos += [e for e in ([gen_eos] if isinstance(gen_eos, int) else gen_eos) if e not in eos]
    eos = [int(e) for e in eos if e is not None]
    if not eos:
        raise SelfDistillError("the tokenizer has no EOS token; pass eos_token_ids")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and cfg.max_prompt_tokens + cfg.max_new_tokens > max_pos:
        raise SelfDistillError(f"--max-prompt-tokens {cfg.max_prompt_tokens} + --max-new-tokens {cfg.max_new_tokens} "
                               f"> the model's {max_pos} positions; lower one of them")
    vocab = max(int(model.config.vocab_size), len(tokenizer))
    id_dtype = id_dtype_for(vocab)
    fp = model_fingerprint(model_dir)
    base = {"format": FORMAT, "model": model_name or str(model_dir), "model_fingerprint": fp,
            "vocab_size": vocab, "id_dtype": id_dtype.name, "eos_token_ids": eos,
            "sampling": cfg.content_key(), "variants": {"greedy": cfg.greedy, "samples": cfg.samples},
            # the template the prompts were rendered with (a resume under another one would mix two renderings)
            "chat_template": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16],
            "source": [str(s) for s in source], "num_conversations": len(convs),
            "max_prompt_tokens": cfg.max_prompt_tokens, "max_rounds": cfg.max_rounds,
            "assistant_mask": "answer tokens incl. the EOS id that ended them (the template's end-of-turn)",
            "split": "spd_ds.train.split.split_held_out(records, fraction, seed): by blake2b of conv_id"}
    store = _Store(out_dir, base, id_dtype, cfg, log)
    gen = AnswerGenerator(model, eos, pad, cfg)
    eot_text = {e: tokenizer.decode([e], skip_special_tokens=False) for e in eos}
    run = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": str(gen.device),
           "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__,
           "attention": getattr(model.config, "_attn_implementation", None),
           "settings": {k: v for k, v in dataclasses.asdict(cfg).items()}, "resumed_answers": store.resumed,
           # this run's own sources (the manifest's "source" lists every run's: storage._whole_directory)
           "source": base["source"], "num_conversations": base["num_conversations"]}
    per_round: dict[int, dict] = {}
    new_answers = new_tokens = 0
    stopped = False
    chains_stopped = defaultdict(int)

    def budget_left() -> bool:
        return cfg.time_budget_s is None or time.perf_counter() - t_start < cfg.time_budget_s

    def draining() -> bool:  # the last 10 % of the budget: finish answers in flight, start no new ones
        return cfg.time_budget_s is not None and time.perf_counter() - t_start >= 0.9 * cfg.time_budget_s

    def finish(row: Row) -> None:
        nonlocal new_answers, new_tokens
        seg = np.concatenate([row.prompt[len(row.prompt) - row.segment_prefix:],
                              np.asarray(row.answer, dtype=np.int64)])
        fin = FINISH_EOS if row.answer and row.answer[-1] in eot_text else FINISH_LENGTH
        store.add(Item(row.key[0], row.key[1], row.key[2], seg, row.segment_prefix, fin))
        pr = per_round.setdefault(row.key[2], {"answers": 0, "tokens": 0, "eos": 0, "calls": 0})
        pr["answers"] += 1
        pr["tokens"] += len(row.answer)
        pr["eos"] += fin == FINISH_EOS
        new_answers += 1
        new_tokens += len(row.answer)

    try:
        max_r = max(len(c.rounds) for c in convs)
        if cfg.max_rounds:
            max_r = min(max_r, cfg.max_rounds)
        for rnd in range(1, max_r + 1):
            if stopped:
                break
            todo = [c for c in convs if len(c.rounds) >= rnd]
            todo.sort(key=lambda c: held_out_score(c.uid, cfg.seed + 7919 * rnd))  # deterministic shuffle
            waves = iter(range(0, len(todo), cfg.wave_conversations))
            rows: list[Row] = []
            cont: list[Row] = []
            i = 0
            calls0 = len(gen.calls)
            while True:
                if not budget_left():
                    stopped = True
                    break
                fresh_ok = not draining()
                if fresh_ok and i >= len(rows):
                    w = next(waves, None)
                    if w is not None:  # tokenise the next wave
                        rows = _wave_rows(todo[w: w + cfg.wave_conversations], rnd, store.items, tokenizer, cfg,
                                          eot_text, chains_stopped)
                        rows.sort(key=lambda r: len(r.prompt))
                        i = 0
                        continue
                fresh_left = fresh_ok and i < len(rows)
                if cont and (len(cont) >= cfg.batch_size or not fresh_left):
                    cont.sort(key=lambda r: len(r.prompt) + len(r.answer))
                    batch = _take(cont, gen, cfg)
                    cont = cont[len(batch):]
                elif fresh_left:
                    batch = _take(rows[i:], gen, cfg)
                    i += len(batch)
                else:
                    break  # the round is done (or, near the budget, its continuations are)
                ooms = gen.oom_splits
                for r, d in zip(batch, gen.step(batch)):
                    if d:
                        finish(r)
                    else:
                        cont.append(r)
                if gen.oom_splits > ooms:
                    log(f"selfdistill: out of device memory {gen.oom_splits - ooms}x in a call of {len(batch)} rows: "
                        f"run as smaller calls; later calls hold at most {gen.token_cap:,} rows x cache tokens")
                _log_call(log, rnd, gen.calls[-1], len(rows) - i, len(cont), t_start, new_tokens)
                store.maybe_flush()
            if draining():
                stopped = True  # no new round near the end of the budget
            if rnd in per_round:
                per_round[rnd]["calls"] = len(gen.calls) - calls0
    finally:
        store.flush()
        wall = time.perf_counter() - t_start
        gen_s = sum(c.seconds for c in gen.calls)
        run.update({
            "wall_s": round(wall, 2), "generate_s": round(gen_s, 2), "answers": new_answers,
            "generated_tokens": new_tokens, "generated_tokens_per_s": round(new_tokens / max(wall, 1e-9), 1),
            "generated_tokens_per_generate_s": round(new_tokens / max(gen_s, 1e-9), 1),
            "calls": len(gen.calls), "rows_x_steps": int(sum(c.rows * c.steps for c in gen.calls)),
            "discarded_in_flight_tokens": None, "stopped_by_time_budget": stopped,
            "chains_stopped": dict(chains_stopped), "oom_splits": gen.oom_splits,
            "token_cap": gen.token_cap,
            "by_round": {str(k): v for k, v in sorted(per_round.items())},
        })
        if len(gen.calls) > 1:  # after the first call, which pays the compile
            later = gen.calls[1:]
            run["decode_tokens_per_s_after_first_call"] = round(
                sum(c.tokens for c in later) / max(later[-1].t_end - gen.calls[0].t_end, 1e-9), 1)
            run["first_call_s"] = round(gen.calls[0].seconds, 2)
        run["row_utilisation"] = round(sum(c.tokens for c in gen.calls) / max(run["rows_x_steps"], 1), 3)
        run["discarded_in_flight_tokens"] = int(sum(c.tokens for c in gen.calls) - new_tokens)
        store.write_manifest(run)
    run["totals"] = json.loads((out_dir / MANIFEST).read_text())["counts"]
    run["call_stats"] = gen.calls
    return run


def _take(rows: Sequence[Row], gen: AnswerGenerator, cfg: SelfDistillConfig) -> list[Row]:
    """The next batch from the front of ``rows`` (sorted ascending by context length): as many rows as fit."""
    n = 0
    for n in range(1, len(rows) + 1):
        r = rows[n - 1]
        width = len(r.prompt) + len(r.answer)
        if n > gen.rows_for(width, cfg.chunk_new_tokens):
            n -= 1
            break
    return list(rows[: max(n, 1)])


def _wave_rows(convs: Sequence[PromptConversation], rnd: int, done: dict, tokenizer, cfg: SelfDistillConfig,
               eot_text: dict, chains_stopped: dict) -> list[Row]:
    """Rows of round ``rnd`` for ``convs`` that are not done yet and whose chain reaches this round."""
    first, later = [], []  # (conv, variant) pairs
    for c in convs:
        for v in range(cfg.num_variants):
            if (c.uid, v, rnd) in done:
                continue
            (first if rnd == 1 else later).append((c, v))
    rows: list[Row] = []
    if first:
        texts = {}
        for c, _ in first:
            if c.uid not in texts:
                texts[c.uid] = _render(tokenizer, c.rounds[0], True)
        order = list(texts)
        enc = dict(zip(order, _encode_texts(tokenizer, [texts[u] for u in order])))
        for c, v in first:
            p = enc[c.uid]
            if len(p) > cfg.max_prompt_tokens:
                chains_stopped["prompt_too_long"] += 1
                continue
            rows.append(Row((c.uid, v, rnd), p, len(p), cfg.temperature_of(v), item_key(cfg.seed, c.uid, v, rnd)))
    if later:
        pend, glue_texts = [], []
        for c, v in later:
            prev = [done.get((c.uid, v, r)) for r in range(1, rnd)]
            if any(p is None for p in prev):
                continue  # the chain ended earlier (cut answer, long prompt) or is not there yet
            if prev[-1].finish != FINISH_EOS:
                chains_stopped["answer_cut"] += 1
                continue
            history = []
            for r, it in enumerate(prev):
                history += c.rounds[r]
                ans = it.tokens[it.prompt_len:]
                history.append({"role": "assistant", "content": tokenizer.decode(ans[:-1].tolist(),
                                                                                 skip_special_tokens=False)})
            glue = turn_glue(tokenizer, history, c.rounds[rnd - 1], eot_text.get(int(prev[-1].tokens[-1]), "\x00"))
            if glue is None:
                chains_stopped["template_not_prefix"] += 1
                continue
            pend.append((c, v, prev))
            glue_texts.append(glue)
        for (c, v, prev), g in zip(pend, _encode_texts(tokenizer, glue_texts)):
            ctx_len = sum(len(it.tokens) for it in prev) + len(g)
            if ctx_len > cfg.max_prompt_tokens:
                chains_stopped["prompt_too_long"] += 1
                continue
            prompt = np.concatenate([it.tokens for it in prev] + [g])
            rows.append(Row((c.uid, v, rnd), prompt, len(g), cfg.temperature_of(v), item_key(cfg.seed, c.uid, v, rnd)))
    return rows


def _log_call(log, rnd: int, c: CallStats, fresh_left: int, cont: int, t_start: float, total: int) -> None:
    wall = time.perf_counter() - t_start
    log(f"selfdistill: round {rnd} call rows={c.rows} width={c.width} cache={c.cache_len} steps={c.steps} "
        f"tokens={c.tokens} ({c.tokens / max(c.rows * c.steps, 1):.0%} of rows x steps) finished={c.finished} "
        f"in {c.seconds:.1f}s = {c.tokens / max(c.seconds, 1e-9):.0f} tok/s; wave left {fresh_left}, "
        f"continuing {cont}; run {total} tok / {wall:.0f}s = {total / max(wall, 1e-9):.0f} tok/s")


def throughput_table(run: dict) -> str:
    """A small text table of a run summary (by round, then totals)."""
    lines = ["round | answers | answer tokens | ended by EOS | generate calls",
             "---|---|---|---|---"]
    for r, v in run.get("by_round", {}).items():
        lines.append(f"{r} | {v['answers']} | {v['tokens']} | {v['eos'] / max(v['answers'], 1):.0%} | {v['calls']}")
    lines.append(f"all | {run['answers']} | {run['generated_tokens']} | | {run['calls']}")
    lines.append(f"generated tokens/s: {run['generated_tokens_per_s']:.0f} over {run['wall_s']:.0f} s wall "
                 f"(load, prompt encoding, compile included); {run['generated_tokens_per_generate_s']:.0f} inside "
                 f"generate ({run['generate_s']:.0f} s); after the first call (compile, "
                 f"{run.get('first_call_s', 0):.0f} s): {run.get('decode_tokens_per_s_after_first_call', 0):.0f} "
                 f"tok/s; row utilisation {run['row_utilisation']:.0%}; discarded "
                 f"in-flight tokens {run['discarded_in_flight_tokens']}; stopped by time budget: "
                 f"{run['stopped_by_time_budget']}")
    return "\n".join(lines)
