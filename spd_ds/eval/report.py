"""Reports of an evaluation: per-prompt JSONL, the summary JSON (the metrics of
:class:`~spd_ds.decoding.metrics.SPDMetrics`, per prompt set and pooled), text tables and the plots.

Summary schema (``schema_version`` 1)::

    {"schema_version", "created_utc", "engine", "device",
     "bandwidth": null off GPU | {"device_name", "gbps", "source"} (what "hbm_fraction" is measured against),
     "model": {"name", "dir", "random_weights", "model_type", "num_layers", "hidden_size", "vocab_size", "dtype",
               "weight_bytes_per_token"},
     "partition": {"num_layers", "stage_layers", "anchors", "num_stages"},
     "decoding": {"temperature", "top_k", "top_p", "seed", "max_new_tokens", "max_length", "drafter",
                  "oracle_alphas", "eos_token_ids"},
     "prompt_sets": {set: {"num_prompts", "mean_prompt_tokens"}},
     "definitions": {metric: text},
     "methods": {method: {"kind": "spd" | "baseline", "num_stages", "devices", "description", "num_prompts",
                          "oracle_alpha"}},
     "results": {method: {"overall": BLOCK, "by_set": {set: BLOCK}}},
     "exactness": {"checked", "reason", "reference", "by_method": {spd_method: {baseline: {"prompts", "identical",
                   "divergences": [{"prompt_set", "question_id", "index", "method_token", "baseline_token"}]}}}},
     "config": the resolved experiment}

    BLOCK = {"num_prompts", "num_new_tokens", "num_cycles", "num_drafts", "num_accepted_tokens", "num_rollbacks",
             "draft_acceptance_rate", "tokens_per_cycle", "equivalent_accept_length", "acceptance_by_depth",
             "prefill_s", "decode_s", "decode_tok_s", "mean_decode_tok_s", "cycle_time_split_ms", "achieved_gbps",
             "hbm_fraction", "speedup_vs_ar", "repeated_ngram_share" (added later: absent from older summaries)}

Draft metrics (``num_drafts`` ... ``acceptance_by_depth``) are ``None`` for AR baselines; for a drafting method
``draft_acceptance_rate`` is ``None`` where no draft was verified and ``tokens_per_cycle`` and
``equivalent_accept_length`` where no decode cycle ran (``decoding.max_new_tokens=1``: the prefill token alone). Without
a decode token (the same case, or EOS at once) the speeds are ``None`` too: ``decode_tok_s``, ``mean_decode_tok_s``,
``cycle_time_split_ms``, ``achieved_gbps``, ``hbm_fraction`` and ``speedup_vs_ar`` (:func:`speeds`). The tables print
``None`` as ``-``. Pooled means sums over prompts first (``ΣN / ΣK``, ``Σ(N-1) / Σdecode_s``), then
ratios.

``methods[m].oracle_alpha`` is the alpha an oracle method (``spd_oracle_<alpha>``) ran with, ``None`` for the others;
``decoding.oracle_alphas`` lists those alphas in run order (``None`` without oracle methods). Older summaries have
neither, but ``decoding.oracle_alpha``: the config's value (still in ``config``), which an ``eval.oracle_alphas``
sweep does not use.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from pathlib import Path
from typing import Iterable, Sequence

from spd_ds.decoding.metrics import SPDMetrics, pooled_decode_tok_s

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# token-producing AR baselines the SPD tokens are checked against
EXACT_BASELINES = ("ar", "ar_graph", "hf_generate", "tp_ar")

DEFINITIONS = {
    "num_new_tokens": "N: verified tokens returned per prompt, INCLUDING the token taken from the prefill logits",
    "num_cycles": "K: decode cycles (SPD: one forward per busy stage; AR: decode steps)",
    "num_drafts": "drafts verified",
    "num_accepted_tokens": "drafts accepted",
    "draft_acceptance_rate": "num_accepted_tokens / num_drafts",
    "tokens_per_cycle": "N / K (the reference project called this an 'acceptance rate'; we do not)",
    "equivalent_accept_length": "n * N / K (the paper's L'_acc), n = pipeline stages",
    "acceptance_by_depth": "per fill f = 1..n (tokens in flight when the draft was made; f = n: full pipeline): "
                           "drafts verified, accepted, rate",
    "prefill_s": "seconds from the prompt to the first token (summed over prompts)",
    "decode_s": "seconds of the decode loop after the first token (summed over prompts)",
    "decode_tok_s": "(N - 1) / decode_s, pooled over prompts (the prefill token is not a decode token)",
    "mean_decode_tok_s": "mean over prompts of each prompt's decode_tok_s",
    "cycle_time_split_ms": "mean milliseconds per cycle: stage_forward[s], head, verify, comm, control; cycle = "
                           "decode_s / K. Reference decoder on GPU: host timers without synchronisation, so GPU time "
                           "lands in the phase that waits (verify); the pipeline engine times stage forwards with "
                           "CUDA events",
    "achieved_gbps": "weight bytes per token x decode_tok_s / 1e9 (gpt-fast's achieved bandwidth); GPU runs only",
    "hbm_fraction": "achieved_gbps / (bandwidth.gbps x devices the method runs on): the GPU's memory bandwidth named "
                    "in 'bandwidth' (eval.hbm_gbps overrides it); GPU runs only",
    "speedup_vs_ar": "decode_tok_s of the method / decode_tok_s of each baseline, pooled over the prompts both ran",
}
REPEAT_NGRAM = 9  # n-gram length of repeated_ngram_share
DEFINITIONS["repeated_ngram_share"] = (
    f"share of the returned tokens that close a {REPEAT_NGRAM}-gram already seen earlier in the same answer (pooled; "
    f"past the first {REPEAT_NGRAM - 1} tokens): loops, which any drafter predicts easily, so acceptance on answers "
    "with a high share says little about the head")


# ---------------------------------------------------------------------------------------------- metric blocks
def rates(m: SPDMetrics, spd: bool) -> dict:
    """The ratios of ``m`` as the reports give them, ``None`` where not applicable: every one for a method that does
    not draft (``spd`` false: AR baselines), ``draft_acceptance_rate`` without a verified draft, ``tokens_per_cycle``
    and ``equivalent_accept_length`` without a decode cycle (``decoding.max_new_tokens=1``). One rule for the summary's
    blocks (:func:`metric_block`) and ``per_prompt.jsonl`` (:func:`per_prompt_rows`).

    Returns:
        ``{"draft_acceptance_rate", "tokens_per_cycle", "equivalent_accept_length"}``: floats (a fraction, tokens per
        cycle, tokens per n cycles) or ``None``.
    """
    return {"draft_acceptance_rate": m.draft_acceptance_rate if spd and m.num_drafts else None,
            "tokens_per_cycle": m.tokens_per_cycle if spd and m.num_cycles else None,
            "equivalent_accept_length": m.equivalent_accept_length if spd and m.num_cycles else None}


def speeds(items: Sequence[SPDMetrics], spd: bool) -> dict:
    """The speeds of some generations as the reports give them, ``None`` where not applicable: ``decode_tok_s`` and
    ``mean_decode_tok_s`` where no generation returned a token after its prefill token (``decoding.max_new_tokens=1``,
    or EOS at once: the rate counts decode tokens only, so it has nothing to measure), ``cycle_time_split_ms`` for a
    method that does not draft (``spd`` false) or without a decode cycle. Where :func:`rates` gives the ratios, this
    gives the speeds: one rule for the summary's blocks, ``per_prompt.jsonl`` and ``launch/infer.py``'s output.

    Args:
        items: per-prompt :class:`~spd_ds.decoding.metrics.SPDMetrics` (one for a single prompt).
        spd: whether the method drafts.
    Returns:
        ``{"decode_tok_s": Σ(N_i - 1) / Σdecode_s_i, "mean_decode_tok_s": the mean of the per-prompt rates of the
        prompts with decode tokens, "cycle_time_split_ms": dict of milliseconds per cycle}``, each value or ``None``.
    """
    items = list(items)
    decoded = [m for m in items if m.num_new_tokens > 1]
    per = [m.decode_tok_s for m in decoded if m.decode_s > 0]
    m = SPDMetrics.pooled(items)
    return {"decode_tok_s": pooled_decode_tok_s(items) if decoded else None,
            "mean_decode_tok_s": sum(per) / len(per) if per else None,
            "cycle_time_split_ms": m.cycle_time_split_ms() if spd and m.num_cycles else None}


def metric_block(items: Sequence[SPDMetrics], spd: bool, num_stages: int, weight_bytes: int | None = None,
                 devices: int = 1, hbm_gbps: float | None = None) -> dict:
    """Pooled metrics of one method over some prompts (a summary ``BLOCK``, without ``speedup_vs_ar``).

    Args:
        items: per-prompt :class:`~spd_ds.decoding.metrics.SPDMetrics`.
        spd: whether the method drafts (else the draft metrics are ``None``; the rates follow :func:`rates`, the
            speeds :func:`speeds`).
        num_stages: ``n`` of the method (1 for AR).
        weight_bytes: bytes read per AR token (for ``achieved_gbps``), ``None`` = not reported.
        devices, hbm_gbps: for ``hbm_fraction``.
    """
    m = SPDMetrics.pooled(items, num_stages)
    speed = speeds(items, spd)
    tok_s = speed["decode_tok_s"]
    gbps = weight_bytes * tok_s / 1e9 if weight_bytes and tok_s is not None else None
    block = {
        "num_prompts": len(items),
        "num_new_tokens": m.num_new_tokens,
        "num_cycles": m.num_cycles,
        "num_drafts": m.num_drafts if spd else None,
        "num_accepted_tokens": m.num_accepted_tokens if spd else None,
        "num_rollbacks": m.num_rollbacks if spd else None,
        **rates(m, spd),
        "acceptance_by_depth": m.acceptance_by_depth() if spd else None,
        "prefill_s": m.prefill_s,
        "decode_s": m.decode_s,
        **speed,
        "achieved_gbps": gbps,
        "hbm_fraction": gbps / (hbm_gbps * devices) if gbps is not None and hbm_gbps else None,
        "speedup_vs_ar": {},
    }
    return block


def repeat_flags(tokens: Sequence[int], n: int = REPEAT_NGRAM) -> list[bool]:
    """The loop test behind :func:`repeated_ngram_share` and the training's loop positions
    (:func:`spd_ds.train.batching.loop_positions`).

    Args:
        tokens: one answer's token ids.
        n: n-gram length (>= 1).
    Returns:
        one bool per token: ``True`` where it closes an ``n``-gram already seen earlier in the same answer (always
        ``False`` for the first ``n-1`` tokens).
    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"the n-gram length must be >= 1, got {n}")
    flags = [False] * len(tokens)
    seen = set()
    for i in range(n - 1, len(tokens)):
        gram = tuple(tokens[i - n + 1:i + 1])
        flags[i] = gram in seen
        seen.add(gram)
    return flags


def repeated_ngram_share(answers: Sequence[Sequence[int]], n: int = REPEAT_NGRAM) -> float | None:
    """Share of the tokens of ``answers`` (each a list of token ids) that close an ``n``-gram already seen earlier in
    the same answer, pooled over the answers' positions ``n-1 ..`` (``None`` when no answer has ``n`` tokens).

    A greedy small model often loops on long answers; loops are trivially drafted, so a draft acceptance measured on
    them overstates the head (``docs/benchmarks.md`` (c)). Reported beside acceptance in every summary block.
    """
    repeated = sum(sum(repeat_flags(toks, n)) for toks in answers)
    positions = sum(max(0, len(toks) - n + 1) for toks in answers)
    return repeated / positions if positions else None


def _pooled_tok_s(run, method, indices: Iterable[int]) -> float | None:
    return speeds([method.results[i].metrics for i in indices], False)["decode_tok_s"]


def summarize(run, weight_bytes: int | None = None) -> dict:
    """The summary dict of an :class:`~spd_ds.eval.runner.EvalRun` (schema in the module docstring).

    Args:
        run: the evaluation.
        weight_bytes: bytes per token for the bandwidth columns (default: computed from the architecture).
    """
    from spd_ds.eval.speed import device_bandwidth, weight_bytes_per_token
    from spd_ds.models.adapter import resolve_dtype

    cfg, part = run.cfg, run.partition
    dtype = resolve_dtype(cfg.model.dtype)
    if weight_bytes is None:
        weight_bytes = weight_bytes_per_token(run.arch, dtype)
    bandwidth = device_bandwidth(run.device, cfg.eval.hbm_gbps)  # None off GPU: no GB/s, no % HBM there
    gpu_bytes = weight_bytes if bandwidth is not None else None
    sets: dict[str, list[int]] = {}
    for i, p in enumerate(run.prompts):
        sets.setdefault(p.prompt_set, []).append(i)
    results, methods = {}, {}
    alphas = [m.oracle_alpha for m in run.methods.values() if m.oracle_alpha is not None]
    for name, mr in run.methods.items():
        spd = mr.kind == "spd"
        methods[name] = {"kind": mr.kind, "num_stages": mr.num_stages, "devices": mr.devices,
                         "description": mr.description, "num_prompts": len(mr.results),
                         "oracle_alpha": mr.oracle_alpha}
        scopes = {"overall": sorted(mr.results)}
        scopes.update({s: [i for i in idx if i in mr.results] for s, idx in sets.items()})
        blocks = {}
        for scope, idx in scopes.items():
            b = metric_block([mr.results[i].metrics for i in idx], spd, mr.num_stages, gpu_bytes, mr.devices,
                             bandwidth["gbps"] if bandwidth else None)
            b["repeated_ngram_share"] = repeated_ngram_share([mr.results[i].tokens for i in idx])
            if spd:
                for base in run.baselines():
                    common = [i for i in idx if i in base.results]
                    if not common:
                        continue
                    bt, mt = _pooled_tok_s(run, base, common), _pooled_tok_s(run, mr, common)
                    b["speedup_vs_ar"][base.name] = mt / bt if mt is not None and bt else None
            blocks[scope] = b
        results[name] = {"overall": blocks.pop("overall"), "by_set": blocks}
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "engine": run.engine,
        "device": run.device,
        "bandwidth": bandwidth,
        "model": {
            "name": cfg.model.name, "dir": str(run.arch.model_dir),
            "random_weights": bool(getattr(run.arch, "random_weights", False)),
            "model_type": run.arch.config.model_type, "num_layers": run.arch.num_layers,
            "hidden_size": run.arch.hidden_size, "vocab_size": run.arch.vocab_size, "dtype": cfg.model.dtype,
            "weight_bytes_per_token": weight_bytes,
        },
        "partition": {**part.to_dict(), "num_stages": part.num_stages},
        "decoding": {**{k: getattr(cfg.decoding, k) for k in ("temperature", "top_k", "top_p", "seed",
                                                              "max_new_tokens", "max_length", "drafter")},
                     "oracle_alphas": alphas or None, "eos_token_ids": cfg.decoding.eos_token_ids},
        "prompt_sets": {s: {"num_prompts": len(idx),
                            "mean_prompt_tokens": sum(len(run.prompts[i].ids) for i in idx) / len(idx)}
                        for s, idx in sets.items()},
        "definitions": dict(DEFINITIONS),
        "methods": methods,
        "results": results,
        "exactness": exactness(run),
        "config": dataclasses.asdict(cfg),
    }


def unchecked_reason(run) -> str | None:
    """Why SPD's tokens of ``run`` are not compared with the AR baselines' (``None``: they are): T > 0,
    ``eval.check_exact`` false, or no AR baseline of :data:`EXACT_BASELINES` ran. :func:`exactness` and
    :func:`per_prompt_rows` (``first_divergence``) both follow it."""
    if run.cfg.decoding.temperature != 0:
        return "temperature > 0: outputs are samples (only distributions match)"
    if not run.cfg.eval.check_exact:
        return "eval.check_exact is false"
    if not any(b.name in EXACT_BASELINES for b in run.baselines()):
        return "no AR baseline ran (eval.baselines)"
    return None


def exactness(run) -> dict:
    """SPD methods' tokens against every AR baseline's at T = 0: identical prompts and each first divergence.

    ``reference`` is ``ar`` (same stage code; on CPU fp32 it must match exactly). A divergence from ``hf_generate``
    (other kernels) or at bf16 can be a near-tie, and is reported, not hidden.
    """
    from spd_ds.eval.runner import first_divergence

    reason = unchecked_reason(run)
    if reason is not None:
        return {"checked": False, "reason": reason, "reference": "ar", "by_method": {}}
    bases = [b for b in run.baselines() if b.name in EXACT_BASELINES]
    out = {}
    for m in run.spd_methods():
        per = {}
        for b in bases:
            common = [i for i in sorted(m.results) if i in b.results]
            divs = []
            for i in common:
                a, r = m.results[i].tokens, b.results[i].tokens
                d = first_divergence(a, r)
                if d is not None:
                    p = run.prompts[i]
                    divs.append({"prompt_set": p.prompt_set, "question_id": p.question_id, "index": d,
                                 "method_token": a[d] if d < len(a) else None,
                                 "baseline_token": r[d] if d < len(r) else None})
            per[b.name] = {"prompts": len(common), "identical": len(common) - len(divs), "divergences": divs}
        out[m.name] = per
    return {"checked": True, "reason": None, "reference": "ar", "by_method": out}


# ---------------------------------------------------------------------------------------------- per prompt
def per_prompt_rows(run) -> list[dict]:
    """One JSON-able row per (method, prompt): ids, tokens, decoded text (with a tokenizer), metrics, wall time and,
    for SPD methods where exactness is checked (:func:`unchecked_reason` is ``None``: T = 0, ``eval.check_exact``, an
    AR baseline ran), ``first_divergence`` from each AR baseline that ran the prompt; otherwise no such key. The
    rates follow :func:`rates`, ``decode_tok_s`` and ``cycle_time_split_ms`` :func:`speeds`."""
    from spd_ds.eval.runner import first_divergence

    rows = []
    checked = unchecked_reason(run) is None
    bases = [b for b in run.baselines() if b.name in EXACT_BASELINES]
    for name, mr in run.methods.items():
        for i in sorted(mr.results):
            p, res = run.prompts[i], mr.results[i]
            row = {"method": name, "kind": mr.kind, "prompt_set": p.prompt_set, "question_id": p.question_id,
                   "prompt_tokens": len(p.ids), "tokens": res.tokens, "finish_reason": res.finish_reason,
                   "wall_s": mr.wall_s.get(i)}
            if run.tokenizer is not None:
                row["text"] = run.tokenizer.decode(res.tokens, skip_special_tokens=True)
            row.update(res.metrics.to_dict())
            row.update(rates(res.metrics, mr.kind == "spd"))  # None where not applicable, as in the summary
            speed = speeds([res.metrics], mr.kind == "spd")
            row["decode_tok_s"] = speed["decode_tok_s"]
            if mr.kind == "spd":
                row["acceptance_by_depth"] = res.metrics.acceptance_by_depth()
                row["cycle_time_split_ms"] = speed["cycle_time_split_ms"]
                if checked:
                    row["first_divergence"] = {b.name: first_divergence(res.tokens, b.results[i].tokens)
                                               for b in bases if i in b.results}
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- text tables
def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text (markdown) table; floats with 3 significant decimals, ``None`` as ``-``."""
    def cell(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    body = [[cell(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(r[k]) for r in body)) if body else len(h) for k, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in body])


def summary_table(summary: dict, scope: str = "overall") -> str:
    """Methods x headline metrics of a summary (``scope``: ``overall`` or a prompt-set name); ``devices`` is what a
    method runs on (the pipeline's stages, ``tp_ar``'s tensor-parallel degree, 1 for a one-process decoder)."""
    bases = [n for n, m in summary["methods"].items() if m["kind"] == "baseline"]
    bw = summary.get("bandwidth")  # a GPU run: GB/s, and % HBM against the GPU's named bandwidth
    cuda = bw is not None and str(summary.get("device", "")).startswith("cuda")
    hbm = cuda and bw.get("gbps") is not None
    headers = (["method", "stages", "devices", "tok/s"] + [f"x {b}" for b in bases]
               + ["eq. accept len", "draft acc.", "tok/cycle", "cycle ms"] + (["GB/s"] if cuda else [])
               + (["% HBM"] if hbm else []))
    rows = []
    for name, res in summary["results"].items():
        b = res["overall"] if scope == "overall" else res["by_set"].get(scope)
        if b is None:
            continue
        split = b["cycle_time_split_ms"] or {}
        method = summary["methods"][name]  # devices: tp_ar is one stage over several (its TP degree)
        rows.append([name, method["num_stages"], method.get("devices"), b["decode_tok_s"]]
                    + [b["speedup_vs_ar"].get(x) for x in bases]
                    + [b["equivalent_accept_length"], b["draft_acceptance_rate"], b["tokens_per_cycle"],
                       split.get("cycle")] + ([b["achieved_gbps"]] if cuda else [])
                    + ([100 * b["hbm_fraction"] if b["hbm_fraction"] is not None else None] if hbm else []))
    return format_table(headers, rows)


def bandwidth_line(summary: dict) -> str:
    """What the GB/s and % HBM columns mean for this run: the GPU and its bandwidth, or why there are none."""
    bw = summary.get("bandwidth")
    if bw is None:
        return f"GB/s and % HBM: not reported on {summary.get('device', 'this device')} (GPU runs only)"
    if bw.get("gbps") is None:
        return f"% HBM: not reported, {bw['device_name']} is not a known GPU (set eval.hbm_gbps)"
    return f"% HBM: achieved GB/s against the {bw['device_name']}'s {bw['gbps']:.0f} GB/s per device ({bw['source']})"


def exactness_lines(summary: dict) -> list[str]:
    """One line per (SPD method, AR baseline): identical prompts and the first divergences."""
    ex = summary["exactness"]
    if not ex["checked"]:
        return [f"exactness not checked: {ex['reason']}"]
    out = []
    for m, per in ex["by_method"].items():
        for b, r in per.items():
            line = f"{m} vs {b}: {r['identical']}/{r['prompts']} prompts identical"
            if r["divergences"]:
                line += "; first divergence " + ", ".join(f"{d['prompt_set']}/{d['question_id']}@{d['index']}"
                                                          for d in r["divergences"][:6])
                line += " ..." if len(r["divergences"]) > 6 else ""
            out.append(line)
    return out


# ---------------------------------------------------------------------------------------------- files
PLOT_FILES = ("acceptance_by_depth.png", "cycle_time_split.png")  # write_reports' plots, in this order


def write_reports(run, out_dir: str | Path, plots: bool | None = None, summary: dict | None = None) -> dict:
    """Write ``per_prompt.jsonl``, ``summary.json`` and (``eval.plots``) ``acceptance_by_depth.png`` and
    ``cycle_time_split.png`` into ``out_dir``; returns the summary. Plots of an earlier run in ``out_dir`` are
    removed first (this run may write none).

    Plots need matplotlib (``pip install -e .[eval]``); without it they are skipped with a warning.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in PLOT_FILES:  # an earlier run's plots must not sit beside this run's results
        (out / name).unlink(missing_ok=True)
    summary = summary or summarize(run)
    with open(out / "per_prompt.jsonl", "w") as f:
        for row in per_prompt_rows(run):
            f.write(json.dumps(row) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if run.cfg.eval.plots if plots is None else plots:
        try:
            from spd_ds.eval.plots import plot_acceptance_by_depth, plot_cycle_time_split
        except ImportError as e:
            log.warning("plots skipped: %s (pip install matplotlib)", e)
        else:
            plot_acceptance_by_depth(summary, out / PLOT_FILES[0])
            plot_cycle_time_split(summary, out / PLOT_FILES[1])
    return summary


def check_summary_schema(summary: dict) -> list[str]:
    """Schema problems of a summary dict (empty list = valid); used by the tests and by consumers."""
    problems = []
    top = ("schema_version", "engine", "model", "partition", "decoding", "prompt_sets", "definitions", "methods",
           "results", "exactness", "config")
    problems += [f"missing top-level key {k!r}" for k in top if k not in summary]
    block_keys = ("num_prompts", "num_new_tokens", "num_cycles", "num_drafts", "num_accepted_tokens",
                  "num_rollbacks", "draft_acceptance_rate", "tokens_per_cycle", "equivalent_accept_length",
                  "acceptance_by_depth", "prefill_s", "decode_s", "decode_tok_s", "mean_decode_tok_s",
                  "cycle_time_split_ms", "achieved_gbps", "hbm_fraction", "speedup_vs_ar")
    for name, res in summary.get("results", {}).items():
        if name not in summary.get("methods", {}):
            problems.append(f"results[{name!r}] has no methods entry")
        blocks = [("overall", res.get("overall"))] + list(res.get("by_set", {}).items())
        for scope, b in blocks:
            if b is None:
                problems.append(f"results[{name!r}] lacks {scope!r}")
                continue
            problems += [f"results[{name!r}][{scope!r}] lacks {k!r}" for k in block_keys if k not in b]
    return problems
