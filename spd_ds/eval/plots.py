"""PNG plots of an evaluation summary (matplotlib, headless ``Agg`` backend).

Every plot states what it was measured on (:func:`run_caption`: model, prompts, tokens, n, temperature, device) and
keeps its legend off the bars. Times are compared per decode token, the unit in which SPD and AR can be compared.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

TIME_UNIT = "ms per decode token"


def run_caption(summary: dict) -> str:
    """One line for a plot: model and dtype, prompts per set, new tokens, n, temperature, device and engine.

    Args:
        summary: a dict from :func:`spd_ds.eval.report.summarize`.
    """
    m, d = summary["model"], summary["decoding"]
    sets = ", ".join(f"{name} x{s['num_prompts']}" for name, s in summary["prompt_sets"].items())
    temp = f"T={d['temperature']:g}" + (f" top_k={d['top_k']}" if d.get("top_k") else "") + (
        f" top_p={d['top_p']:g}" if d.get("top_p", 1.0) < 1.0 else "")
    return (f"{str(m['name']).split('/')[-1]} ({m['dtype']}); prompts: {sets}; up to {d['max_new_tokens']} new tokens "
            f"each; n={summary['partition']['num_stages']}; {temp}; device {summary['device']} "
            f"(engine {summary['engine']})")


def plot_acceptance_by_depth(summary: dict, path: str | Path) -> Path:
    """Grouped bars: draft acceptance rate per fill ``f = 1..n`` (tokens in flight when drafted; ``f = n`` is a full
    pipeline), one bar per SPD method, pooled over all prompts; bar labels give accepted/verified counts; the legend
    sits right of the axes, the caption below them (:func:`run_caption`).

    Args:
        summary: a dict from :func:`spd_ds.eval.report.summarize`.
        path: output PNG.
    Returns:
        ``path``.
    """
    spd = [(name, r["overall"]["acceptance_by_depth"]) for name, r in summary["results"].items()
           if summary["methods"][name]["kind"] == "spd"]
    fig, ax = plt.subplots(figsize=(9, 4.4))
    width = 0.8 / max(1, len(spd))
    for k, (name, rows) in enumerate(spd):
        xs = [r["fill"] + (k - (len(spd) - 1) / 2) * width for r in rows]
        ys = [r["rate"] or 0.0 for r in rows]
        bars = ax.bar(xs, ys, width, label=name)
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r['accepted']}/{r['drafts']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    fills = sorted({r["fill"] for _, rows in spd for r in rows})
    ax.set_xticks(fills)
    ax.set_xlabel("fill at drafting (tokens in flight; n = full pipeline)")
    ax.set_ylabel("draft acceptance rate")
    ax.set_ylim(0, 1.08)
    ax.set_title("Draft acceptance by depth (labels: accepted / verified drafts)")
    if spd:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _caption(fig, summary)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def cycle_time_split_data(summary: dict) -> list[dict]:
    """Per-token decode time of every method, split by phase, in :data:`TIME_UNIT`.

    AR: one segment, ``1000 / decode_tok_s``. SPD: its per-cycle split (stage forwards, head, verify, comm,
    control) times cycles per decode token, ``K / (N - prompts)``, so its segments add up to ``1000 / decode_tok_s``
    as well: the bar lengths compare the methods' speeds directly (shorter = faster).

    Args:
        summary: a dict from :func:`spd_ds.eval.report.summarize`.
    Returns:
        One ``{"name", "kind", "segments": [(label, ms)], "total_ms", "decode_tok_s"}`` per method, in run order
        (``decode_tok_s`` ``None`` and one segment of 0 ms where the method returned no decode token).
    """
    out = []
    for name, r in summary["results"].items():
        b = r["overall"]
        tok_s = b["decode_tok_s"]
        kind = summary["methods"][name]["kind"]
        decode_tokens = b["num_new_tokens"] - b["num_prompts"]  # the prefill token of each prompt is not decoded
        if kind == "spd" and b["cycle_time_split_ms"] and decode_tokens > 0:
            per_token = b["num_cycles"] / decode_tokens  # cycles per decode token
            s = b["cycle_time_split_ms"]
            parts = [(f"stage {i} forward", v * per_token) for i, v in enumerate(s["stage_forward"])]
            parts += [(lab, s[key] * per_token) for lab, key in
                      (("head", "head"), ("verify", "verify"), ("comm", "comm"), ("control", "control"))]
        else:
            parts = [("AR decode step" if kind != "spd" else "decode", 1e3 / tok_s if tok_s else 0.0)]
        out.append({"name": name, "kind": kind, "segments": parts, "total_ms": sum(v for _, v in parts),
                    "decode_tok_s": tok_s})
    return out


def cycle_time_split_figure(summary: dict):
    """The figure of :func:`plot_cycle_time_split` (a ``matplotlib.figure.Figure``; the caller closes it).

    Stacked horizontal bars, one per method, of :func:`cycle_time_split_data` in :data:`TIME_UNIT`; each bar ends in
    its total and tok/s; the legend sits right of the axes, the caption below them (:func:`run_caption`).
    """
    data = cycle_time_split_data(summary)
    labels: list[str] = []
    for row in data:
        labels += [lab for lab, _ in row["segments"] if lab not in labels]
    colors = {lab: plt.get_cmap("tab10")(k % 10) for k, lab in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(10, 0.6 * max(2, len(data)) + 1.8))
    seen = set()
    for y, row in enumerate(data):
        left = 0.0
        for lab, v in row["segments"]:
            ax.barh(y, v, left=left, color=colors[lab], label=lab if lab not in seen else None)
            seen.add(lab)
            left += v
        tok_s = "-" if row["decode_tok_s"] is None else f"{row['decode_tok_s']:.1f}"  # None: no decode token
        ax.annotate(f" {row['total_ms']:.2f} ms ({tok_s} tok/s)", (left, y), va="center", fontsize=7)
    ax.set_yticks(range(len(data)))
    ax.set_yticklabels([row["name"] for row in data])
    ax.invert_yaxis()
    ax.margins(x=0.25)  # room for the totals at the bar ends
    ax.set_xlabel(f"{TIME_UNIT} (shorter = faster; SPD's per-cycle split x cycles per decode token)")
    ax.set_title("Decode time per token, split by phase")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _caption(fig, summary)
    return fig


def plot_cycle_time_split(summary: dict, path: str | Path) -> Path:
    """Write :func:`cycle_time_split_figure` to ``path`` (PNG).

    Args:
        summary: a dict from :func:`spd_ds.eval.report.summarize`.
        path: output PNG.
    Returns:
        ``path``.
    """
    fig = cycle_time_split_figure(summary)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def label_heights(points: list[tuple[float, float]], near: float, gap: float) -> list[float]:
    """Heights for the value labels beside measured points, so that no two labels overlap: points less than
    ``near`` apart on x form a column whose labels, from the highest point down, sit at the point's own height or
    ``gap`` below the label above, whichever is lower.

    Args:
        points: ``(x, y)`` of each point (training tokens, acceptance), in any order.
        near: the x distance under which two points share a column (same units as x).
        gap: the smallest vertical distance between two labels of a column (same units as y).
    Returns:
        One label height per point, in the order of ``points``.
    """
    heights = [y for _, y in points]
    columns: list[list[int]] = []
    for i in sorted(range(len(points)), key=lambda i: points[i][0]):
        if columns and points[i][0] - points[columns[-1][0]][0] < near:
            columns[-1].append(i)
        else:
            columns.append([i])
    for col in columns:
        above = None
        for i in sorted(col, key=lambda i: -points[i][1]):
            heights[i] = above = points[i][1] if above is None else min(points[i][1], above - gap)
    return heights


def plot_training_acceptance(curves: list[tuple[str, list[tuple[float, float]]]],
                             measured: list[tuple[str, float, float]], path: str | Path, caption: str = "",
                             loop_free: dict[str, list[tuple[float, float]]] | None = None) -> Path:
    """Predicted T = 0 draft acceptance of each training run against training tokens (lines, from the held-out
    validation of ``spd_ds.train.validate``) with decoder-measured acceptance (markers, from suite (c)).

    Args:
        curves: ``(label, [(training tokens, predicted acceptance), ...])`` per run; tokens in units of 1 (plotted in
            millions).
        measured: ``(label, training tokens, measured draft acceptance)`` points; a label that matches a curve takes
            its colour; the values written beside points at (nearly) the same tokens stack (:func:`label_heights`).
        path: output PNG.
        caption: a line under the axes (what the measurements were taken on).
        loop_free: ``label -> [(training tokens, predicted acceptance outside loops), ...]``: dashed, in the colour
            of the label's curve (empty or missing for runs that predate the loop-free figures: nothing drawn).
    Returns:
        ``path``.
    """
    fig, ax = plt.subplots(figsize=(8, 4.4))
    colours = {}
    palette = plt.get_cmap("tab20").colors if len(curves) > 10 else None  # the default cycle repeats after 10 runs
    for i, (label, pts) in enumerate(curves):
        style = {"color": palette[i % len(palette)]} if palette else {}
        (line,) = ax.plot([t / 1e6 for t, _ in pts], [a for _, a in pts], label=f"{label} predicted (held-out)",
                          **style)
        colours[label] = line.get_color()
        free = (loop_free or {}).get(label)
        if free:
            ax.plot([t / 1e6 for t, _ in free], [a for _, a in free], linestyle="--", color=colours[label],
                    label=f"{label} predicted, loop-free")
    values = [a for pts in [p for _, p in curves] + list((loop_free or {}).values()) for _, a in pts]
    values += [a for *_, a in measured]
    ax.set_xlabel("training tokens (M, packed rows)")
    ax.set_ylabel("T = 0 draft acceptance")
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    ylo = max(0.0, math.floor(round((lo - 0.05) * 10, 6)) / 10)
    yhi = min(1.0, math.ceil(round((hi + 0.05) * 10, 6)) / 10)
    ax.set_ylim(ylo, yhi)
    ax.margins(x=0.08)  # room for the values beside the last markers
    xs = [t / 1e6 for _, pts in curves for t, _ in pts] + [t / 1e6 for _, t, _ in measured]
    span = (max(xs) - min(xs) if xs else 0.0) or 1.0  # the x range in M tokens (labels sit 1.2 % of it right)
    heights = label_heights([(t / 1e6, a) for _, t, a in measured], 0.03 * span, 0.04 * (yhi - ylo))
    for (label, tokens, alpha), y in zip(measured, heights):  # the value beside the marker, labels never overlapping
        ax.scatter([tokens / 1e6], [alpha], marker="o", s=40, zorder=3, color=colours.get(label),
                   label=f"{label} measured (decoder)")
        ax.text(tokens / 1e6 + 0.012 * span, y, f"{alpha:.3f}", fontsize=7, color=colours.get(label), va="center")
    ax.grid(alpha=0.3)
    # one legend entry per run (its colour); the line style and the marker say what was predicted or measured
    handles = [ln for ln in ax.get_lines() if ln.get_label().endswith("predicted (held-out)")]
    handles = [Line2D([], [], color=h.get_color(), label=h.get_label().removesuffix(" predicted (held-out)"))
               for h in handles]
    if curves:
        handles.append(Line2D([], [], color="0.3", label="predicted (held-out)"))
    if any((loop_free or {}).values()):
        handles.append(Line2D([], [], color="0.3", linestyle="--", label="predicted, loop-free"))
    if measured:
        handles.append(Line2D([], [], color="0.3", marker="o", linestyle="none", label="measured (decoder, T = 0)"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    if caption:
        fig.text(0.01, -0.01, caption, fontsize=7, ha="left", va="top", wrap=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def _caption(fig, summary: dict) -> None:
    fig.tight_layout()
    fig.text(0.01, -0.01, run_caption(summary), fontsize=7, ha="left", va="top", wrap=True)
