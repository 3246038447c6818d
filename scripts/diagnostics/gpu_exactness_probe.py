#!/usr/bin/env python
"""Where do greedy SPD and the CUDA-graph AR part on GPU in bf16? A diagnostic for the open question of
docs/benchmarks.md (a): with the CUDA-graph speculation head, SPD and ``ar_graph`` parted at near-ties on 1-2 of 6
prompts, and in one run it was ``ar_graph`` that changed its token.

One process group, several pipeline sessions, then the single-GPU AR on rank 0, all on the same prompts with the
same ``decoding.max_length`` (static caches of one length everywhere):

* ``spd[<mode>]`` and ``pipe_ar[<mode>]``: SPD and AR through the same pipeline (same graphed stages) for each head
  mode (``eager``: HeadDrafter; ``graph``: GraphedHeadDrafter; ``graph2``: the same again, for run-to-run noise;
  ``graph_serial``: GraphedHeadDrafter on the default stream, ``head.overlap=false``: no concurrency with stage 0);
* ``ar_graph#0`` / ``#1``: :class:`~spd_ds.decoding.ar_graph.ARGraphDecoder` on rank 0's GPU, twice;
  ``ar_graph sync1``: the same reading the token after every replay (a race in its device-side feedback would show);
* ``ar_graph+head``: the same with a captured GraphedHeadDrafter alive on that GPU (idle);
  ``ar_graph+head replaying``: the same while that head's graph replays without pause on its own stream (a second
  thread), as beside stage 0.

With ``--single-gpu`` (one process, no process group) only the rank-0 part runs: ``ar_graph`` ``--ar-repeats``
times, ``sync1``, ``+head``, ``+head replaying`` and the eager AR (``ar_eager``: the same decoder, no graph), which
tells whether the single-GPU AR alone changes its tokens between runs. ``--sdpa-backend`` pins the attention kernel
(``torch``: all four backends, torch's own choice, as before ``model.sdpa_backends`` left cuDNN out) and
``--deterministic`` asks torch for deterministic algorithms, to find which kernel varies.

Writes ``tokens.json`` (every method's tokens per prompt) and ``divergence.md`` (first divergence of every method
from ``ar_graph#0`` and from ``pipe_ar[eager]``, with ``--single-gpu`` from ``ar_eager``) to ``--out`` and prints the
table.

Usage (GPU machine, repo root, ``export PYTHONPATH=$PWD`` as scripts/gpu_common.sh does)::

    deepspeed --num_gpus 2 scripts/diagnostics/gpu_exactness_probe.py --out $OUT/probe \
        [--eval-dir eval_data] [overrides]
    CUBLAS_WORKSPACE_CONFIG=:4096:8 deepspeed --num_gpus 2 scripts/diagnostics/gpu_exactness_probe.py --out $OUT/det
    deepspeed --num_gpus 2 scripts/diagnostics/gpu_exactness_probe.py --out $OUT/fp32 model.dtype=float32
    python scripts/diagnostics/gpu_exactness_probe.py --single-gpu --ar-repeats 4 --out $OUT/one   # one GPU
    python scripts/diagnostics/gpu_exactness_probe.py --single-gpu --sdpa-backend math --out $OUT/math
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import torch

from spd_ds import builder
from spd_ds.config import load_config
from spd_ds.eval.prompts import load_prompts

MODES = {"eager": ["head.cuda_graph=false"], "graph": ["head.cuda_graph=true"], "graph2": ["head.cuda_graph=true"],
         "graph_serial": ["head.cuda_graph=true", "head.overlap=false"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="launch/configs/smollm2_spd.yaml")
    ap.add_argument("--eval-dir", default="eval_data")
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"])
    ap.add_argument("--num-prompts", type=int, default=2, help="per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--out", required=True)
    ap.add_argument("--single-gpu", action="store_true",
                    help="one process: only the single-GPU AR runs (no pipeline sessions, no process group)")
    ap.add_argument("--ar-repeats", type=int, default=2, help="ar_graph runs (>= 1)")
    ap.add_argument("--sdpa-backend", choices=["torch", "math", "efficient", "cudnn"],
                    help="run every method with only this scaled-dot-product-attention backend (model.sdpa_backends="
                         "[X]; cudnn: [cudnn, math], math only where cuDNN cannot run a call; torch: all four, "
                         "torch's own choice, which picks cuDNN on an H200); default: model.sdpa_backends of the "
                         "config")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True) (set CUBLAS_WORKSPACE_CONFIG=:4096:8 too)")
    ap.add_argument("--no-reduced-precision", action="store_true",
                    help="cuBLAS bf16/fp16 GEMMs accumulate their split-K partial sums in fp32 "
                         "(torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction = False)")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"],
                    help="the GEMM library torch prefers (torch.backends.cuda.preferred_blas_library)")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher adds it
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.ar_repeats < 1:
        ap.error(f"--ar-repeats must be >= 1, got {args.ar_repeats}")
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.no_reduced_precision:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.sdpa_backend:  # an override, since every build_arch sets the process's SDPA flags from the config
        lists = {"torch": "flash,efficient,math,cudnn", "cudnn": "cudnn,math"}
        chosen = lists.get(args.sdpa_backend, args.sdpa_backend)
        args.overrides = [*args.overrides, f"model.sdpa_backends=[{chosen}]"]
    return probe(args)


def probe(args) -> None:
    """The probe proper (see the module docstring); ``args`` as :func:`main` parses them."""

    import torch.distributed as dist

    from spd_ds.decoding.ar_graph import ARGraphDecoder
    from spd_ds.eval.runner import first_divergence
    from spd_ds.dist import init_process_group, init_timeout_s
    from spd_ds.pipe.runner import run_distributed_inference

    base = ["model.dtype=bfloat16", "partition.num_stages=2", "decoding.temperature=0",
            f"decoding.max_new_tokens={args.max_new_tokens}", f"decoding.max_length={args.max_length}",
            *args.overrides]
    cfg = load_config(args.config, base)
    arch = builder.build_arch(cfg)
    tok = builder.load_tokenizer(arch)
    names, prompts = [], []
    for s in args.sets:
        for rec in load_prompts(s, args.num_prompts, args.eval_dir):
            names.append(f"{s}/{rec['question_id']}")
            prompts.append(builder.encode_prompt(tok, rec["turns"][0]))
    runs: dict[str, list[list[int]]] = {}
    if not args.single_gpu:
        init_process_group(cfg.deepspeed.backend, init_timeout_s(cfg))
    rank0 = args.single_gpu or dist.get_rank() == 0
    for mode, ov in MODES.items() if not args.single_gpu else ():
        out = run_distributed_inference(load_config(args.config, base + ov), prompts, with_ar=True)
        if rank0:
            spd, ar = out
            runs[f"spd[{mode}]"] = [r.tokens for r in spd]
            runs[f"pipe_ar[{mode}]"] = [r.tokens for r in ar]
        dist.barrier()
    if rank0:
        part = builder.build_partition(cfg, arch)
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        target = builder.build_target(cfg, arch, part, device)
        eos = builder.eos_token_ids(cfg, arch, tok)
        sampling = builder.sampling_params(cfg)
        for i in range(args.ar_repeats):
            dec = ARGraphDecoder(target, sampling, eos, cfg.decoding.max_length)
            runs[f"ar_graph#{i}"] = [dec.generate(p, cfg.decoding.max_new_tokens).tokens for p in prompts]
            del dec
        dec = ARGraphDecoder(target, sampling, eos, cfg.decoding.max_length, sync_every=1)
        runs["ar_graph sync1"] = [dec.generate(p, cfg.decoding.max_new_tokens).tokens for p in prompts]
        del dec
        head_cfg = load_config(args.config, base + ["head.cuda_graph=true"])  # the graphed head as the engine builds it
        alive = builder.build_head_drafter(head_cfg, builder.build_head(cfg, arch, part), cfg.decoding.max_length,
                                           target.device)
        dec = ARGraphDecoder(target, sampling, eos, cfg.decoding.max_length)
        runs["ar_graph+head"] = [dec.generate(p, cfg.decoding.max_new_tokens).tokens for p in prompts]
        assert getattr(alive, "graphed", False) == cuda
        if cuda:  # the head's graph replaying on its own stream all the while, as beside stage 0 in the engine
            stop = threading.Event()

            def spin() -> None:
                with torch.cuda.stream(alive.capture_stream):
                    while not stop.is_set():
                        alive.graph.replay()
                        alive.capture_stream.synchronize()

            spinner = threading.Thread(target=spin, daemon=True)
            spinner.start()
            try:
                runs["ar_graph+head replaying"] = [dec.generate(p, cfg.decoding.max_new_tokens).tokens
                                                   for p in prompts]
            finally:
                stop.set()
                spinner.join()
        del dec, alive
        if args.single_gpu:
            dec = ARGraphDecoder(target, sampling, eos, cfg.decoding.max_length, use_graph=False)
            runs["ar_eager"] = [dec.generate(p, cfg.decoding.max_new_tokens).tokens for p in prompts]
            del dec
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tokens.json").write_text(json.dumps({"prompts": names, "runs": runs}, indent=1))
        ref2 = "ar_eager" if args.single_gpu else "pipe_ar[eager]"
        how = "".join(f", {k}" for k, on in (("SDPA " + str(args.sdpa_backend), args.sdpa_backend),
                                              ("deterministic algorithms", args.deterministic),
                                              ("fp32 split-K reductions", args.no_reduced_precision),
                                              ("BLAS " + str(args.blas), args.blas)) if on)
        lines = [f"# exactness probe ({cfg.model.dtype}, max_length {cfg.decoding.max_length}, "
                 f"{cfg.decoding.max_new_tokens} new tokens{how})", "",
                 f"| method | vs ar_graph#0: identical | first divergences | vs {ref2}: identical | first "
                 "divergences |", "|---|---|---|---|---|"]
        for name, toks in runs.items():
            cells = []
            for ref in ("ar_graph#0", ref2):
                d = [first_divergence(t, r) for t, r in zip(toks, runs[ref])]
                cells += [f"{sum(x is None for x in d)}/{len(d)}",
                          ", ".join(f"{n}@{x}" for n, x in zip(names, d) if x is not None) or "-"]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        (out_dir / "divergence.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    if not args.single_gpu:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
