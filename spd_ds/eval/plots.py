"""PNG plots of an evaluation summary (matplotlib, headless ``Agg`` backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_acceptance_by_depth(summary: dict, path: str | Path) -> Path:
    """Grouped bars: draft acceptance rate per fill ``f = 1..n`` (tokens in flight when drafted; ``f = n`` is a full
    pipeline), one bar per SPD method, pooled over all prompts; bar labels give accepted/verified counts.

    Args:
        summary: a dict from :func:`spd_ds.eval.report.summarize`.
        path: output PNG.
    Returns:
        ``path``.
    """
    spd = [(name, r["overall"]["acceptance_by_depth"]) for name, r in summary["results"].items()
           if summary["methods"][name]["kind"] == "spd"]
    fig, ax = plt.subplots(figsize=(7, 4))
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
    ax.set_title(f"Acceptance by draft depth ({summary['model']['name'].split('/')[-1]}, "
                 f"n={summary['partition']['num_stages']})")
    if spd:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_cycle_time_split(summary: dict, path: str | Path) -> Path:
    """Stacked horizontal bars: mean milliseconds per SPD cycle split into stage forwards (one segment per stage),
    head, verify, communication and control; AR baselines appear as one segment, their milliseconds per decode
    token, for scale.

    Args:
        summary: a dict from :func:`spd_ds.eval.report.summarize`.
        path: output PNG.
    Returns:
        ``path``.
    """
    names, segs = [], []
    for name, r in summary["results"].items():
        b = r["overall"]
        if summary["methods"][name]["kind"] == "spd":
            s = b["cycle_time_split_ms"]
            parts = [(f"stage {i} forward", v) for i, v in enumerate(s["stage_forward"])]
            parts += [("head", s["head"]), ("verify", s["verify"]), ("comm", s["comm"]), ("control", s["control"])]
        else:
            tok_s = b["decode_tok_s"]
            parts = [("AR step", 1e3 / tok_s if tok_s else 0.0)]
        names.append(name)
        segs.append(parts)
    labels = []
    for parts in segs:
        labels += [lab for lab, _ in parts if lab not in labels]
    colors = {lab: plt.get_cmap("tab10")(k % 10) for k, lab in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(8, 0.6 * max(2, len(names)) + 1.2))
    seen = set()
    for y, parts in enumerate(segs):
        left = 0.0
        for lab, v in parts:
            ax.barh(y, v, left=left, color=colors[lab], label=lab if lab not in seen else None)
            seen.add(lab)
            left += v
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("ms per cycle (SPD) / per decode token (AR)")
    ax.set_title("Per-cycle time split")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
