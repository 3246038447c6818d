#!/usr/bin/env python
"""Which attention kernel does torch pick for the target's decode step on this GPU, and does it give the same bits
every time? A diagnostic for the bf16 near-tie divergences of docs/benchmarks.md (a): the one-GPU exactness check
found four captures of the same CUDA-graph AR parting from one another under the default SDPA backend and never
with the math or the memory-efficient backend pinned.

For each backend (``default`` = torch's own choice, then each one pinned with ``torch.nn.attention.sdpa_kernel``)
and each shape (a decode step: one query against a static KV cache of ``--max-length`` slots with a boolean mask
of the filled ones; a prefill: ``--prefill`` queries, causal mask), it prints the CUDA kernels the call launched
(torch profiler), then how many of ``--repeats`` calls on fresh copies of the same inputs returned other bits than
the first: alone, with a second stream running GEMMs beside it (as the speculation head runs beside stage 0), and
replayed from a CUDA graph. The same for a bf16 linear layer of the target's MLP shape. Shapes: SmolLM2-135M's
attention (9 heads, head dim 64; K/V repeated to the query heads as transformers' SDPA path does for a mask).

Usage (GPU machine, repo root)::

    python scripts/diagnostics/sdpa_probe.py [--repeats 200] [--max-length 384] [--out $OUT/sdpa.md]

Writes the table (markdown) to ``--out`` when given. Needs CUDA; exits 2 without it.
"""

from __future__ import annotations

import argparse
import sys
import threading

import torch
import torch.nn.functional as F


def kernels(fn) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (torch profiler), in launch order, deduplicated."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in names:
            names.append(e.name)
    return names


def variation(fn, inputs, repeats: int, load: bool) -> int:
    """How many of ``repeats`` calls of ``fn`` on fresh copies of ``inputs`` differ bitwise from the first call;
    with ``load`` a second thread keeps a side stream busy with bf16 GEMMs meanwhile."""
    ref = fn(*[x.clone() for x in inputs])
    stop = threading.Event()
    if load:
        side = torch.cuda.Stream()
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

        def spin():
            with torch.cuda.stream(side):
                while not stop.is_set():
                    for _ in range(8):
                        a @ a
                    side.synchronize()

        t = threading.Thread(target=spin, daemon=True)
        t.start()
    bad = 0
    for _ in range(repeats):
        out = fn(*[x.clone() for x in inputs])
        bad += int(not torch.equal(out, ref))
    if load:
        stop.set()
        t.join()
    torch.cuda.synchronize()
    return bad


def graph_variation(fn, inputs, repeats: int) -> str:
    """``"bad/total"``: how many of the ``total`` replays of ``fn`` captured in a CUDA graph (static inputs) differ
    bitwise from an eager call on the same inputs, over ``repeats // 20 + 1`` separate captures of 20 replays each."""
    eager = fn(*inputs)
    bad = 0
    for _ in range(repeats // 20 + 1):
        static = [x.clone() for x in inputs]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*static)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(*static)
        for _ in range(20):
            g.replay()
            torch.cuda.synchronize()
            bad += int(not torch.equal(out, eager))
    return f"{bad}/{(repeats // 20 + 1) * 20}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=384, help="static KV cache slots (decoding.max_length)")
    ap.add_argument("--fill", type=int, default=200, help="filled cache slots at the decode step")
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens of the prefill shape")
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_probe.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dev, dt, heads, hd, L = "cuda", torch.bfloat16, 9, 64, args.max_length
    k = torch.randn(1, heads, L, hd, device=dev, dtype=dt)
    v = torch.randn(1, heads, L, hd, device=dev, dtype=dt)
    q1 = torch.randn(1, heads, 1, hd, device=dev, dtype=dt)
    m1 = torch.zeros(1, 1, 1, L, device=dev, dtype=torch.bool)
    m1[..., : args.fill] = True
    P = args.prefill
    qp = torch.randn(1, heads, P, hd, device=dev, dtype=dt)
    mp = torch.ones(P, L, device=dev, dtype=torch.bool).tril()[None, None]
    shapes = {"decode (1 query, mask)": (q1, k, v, m1), f"prefill ({P} queries, causal mask)": (qp, k, v, mp)}
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH}
    lines = [f"# SDPA on {torch.cuda.get_device_name()} (torch {torch.__version__}, bf16, {args.repeats} calls)", "",
             "| shape | backend | kernels | differ alone | differ beside GEMMs | differ in CUDA graphs |",
             "|---|---|---|---|---|---|"]
    for sname, inputs in shapes.items():
        for bname, be in backends.items():
            def fn(q, k, v, m, be=be):
                if be is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            try:
                names = kernels(lambda: fn(*inputs))
            except RuntimeError as e:
                lines.append(f"| {sname} | {bname} | unavailable: {str(e).splitlines()[0][:80]} | | | |")
                continue
            short = ", ".join(n[:60] for n in names[:4])
            row = [variation(fn, inputs, args.repeats, False), variation(fn, inputs, args.repeats, True),
                   graph_variation(fn, inputs, args.repeats)]
            lines.append(f"| {sname} | {bname} | {short} | {row[0]}/{args.repeats} | {row[1]}/{args.repeats} "
                         f"| {row[2]} |")
            print(lines[-1], flush=True)
    x = torch.randn(1, 576, device=dev, dtype=dt)
    w = torch.randn(1536, 576, device=dev, dtype=dt)
    lin = lambda x, w: F.linear(x, w)  # noqa: E731
    names = kernels(lambda: lin(x, w))
    row = [variation(lin, (x, w), args.repeats, False), variation(lin, (x, w), args.repeats, True),
           graph_variation(lin, (x, w), args.repeats)]
    lines.append(f"| linear 576->1536, 1 row | cuBLAS | {', '.join(n[:60] for n in names[:2])} | "
                 f"{row[0]}/{args.repeats} | {row[1]}/{args.repeats} | {row[2]} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
