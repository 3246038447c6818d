#!/usr/bin/env python
"""Head-training throughput, before and after, in one run: tokens/s per GPU by number of stages.

Each (code version, n, attention) cell is a short real training run (``launch/train.py`` under the DeepSpeed launcher,
one GPU, the same data, micro-batch and sequence length); its rate is the median ``tokens_per_s`` of the logged
intervals after the first ``--skip`` (which hold start-up and compilation). ``--old-root`` points to a checkout of an
earlier commit (e.g. ``git archive <commit> spd_ds launch ds_configs draft_vocab | tar -x -C .old``) for the
"before" column; the current checkout is "new". The new code's eager-teacher cells (``--attention``) run the teacher,
its attention (SDPA) and the loss eagerly; its compiled-teacher cells (``--compile-teacher``) run its defaults
otherwise (``train.compile_loss`` ``auto``: the loss compiled on CUDA; ``train.teacher_attention`` ``auto`` = SDPA),
one per ``--teacher-attention`` mode if given; "before" cells run the old checkout's defaults.

    python scripts/bench_train.py --data runs/train_data/bench.jsonl.gz --stages 2 4 --old-root .old --out $OUT/bench
    python scripts/bench_train.py --data ... --stages 2 4 --attention flex --compile-teacher inductor  # teacher A/B
    python scripts/bench_train.py --data D --stages 2 --attention --compile-teacher inductor \\
        --teacher-attention sdpa flex  # the teacher's attention, A/B

Prints a markdown table (and writes ``bench_train.json`` under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cell(root: Path, n: int, attention: str | None, args, out: Path, compile_teacher: str | None = None,
             profile: bool = False, teacher_attention: str | None = None) -> dict:
    """One short training run; returns its figures (or the error). ``profile``: a separate run with
    ``train.profile_steps`` (its operator table in ``<run dir>/profile.txt``), kept out of the table."""
    run_dir = out / (f"{'after' if root == REPO else 'before'}_n{n}_{attention or 'default'}"
                     + (f"_teacher_{compile_teacher}" if compile_teacher else "")
                     + (f"_{teacher_attention}" if teacher_attention else "") + ("_profile" if profile else ""))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
           str(29500 + (hash((str(root), n, attention, compile_teacher, teacher_attention)) % 500)),
           str(root / "launch" / "train.py"), "--config", str(root / "launch/configs/train_smollm2_n2.yaml"),
           "--deepspeed_config", str(root / "ds_configs/zero2.json"),
           f"model.name={args.model}", f"partition.num_stages={n}", f"data.train_files=[{args.data}]",
           "data.max_conversations=null", f"data.micro_batch_size={args.micro_batch}",
           f"data.max_seq_length={args.seq_len}", f"train.max_steps={args.steps}", "train.epochs=100",
           f"train.log_every={args.log_every}", "train.save_every=1000000", "train.progress=false",
           f"train.output_dir={run_dir}"]
    if compile_teacher:
        cmd.append(f"train.compile_teacher={compile_teacher}")
        if teacher_attention:
            cmd.append(f"train.teacher_attention={teacher_attention}")
    elif root == REPO:  # the new code's defaults (auto) compile the teacher and the loss on CUDA: the eager-teacher
        # cells say eager (and SDPA, auto's choice today, explicitly)
        cmd += ["train.compile_teacher=null", "train.compile_loss=null", "train.teacher_attention=sdpa"]
    if attention is not None:
        cmd.append(f"train.attention={attention}")
    if profile:
        cmd.append(f"train.profile_steps={args.profile_steps}")
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = 124, str(e.stdout or "")[-1500:] + str(e.stderr or "")[-1500:]
    label = ((attention or "its defaults") + (f", teacher compiled ({compile_teacher})" if compile_teacher else "")
             + (f", teacher attention {teacher_attention}" if teacher_attention else ""))
    cell = {"code": "after" if root == REPO else "before", "n": n, "attention": label, "rc": rc,
            "wall_s": round(time.perf_counter() - t0, 1)}
    log = run_dir / "train_log.jsonl"
    recs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rates = [r["tokens_per_s"] for r in recs[args.skip:]]
    if rates:
        cell["tokens_per_s"] = statistics.median(rates)
        cell["intervals"] = len(rates)
        cell["loss_last"] = recs[-1]["loss"]
    if rc != 0 or not rates:
        cell["error_tail"] = tail
    (out / f"{run_dir.name}.log").write_text(tail)
    if profile and rc != 124:  # the whole log: it names every host sync of the profiled steps (sync debug mode)
        (out / f"{run_dir.name}.full.log").write_text(proc.stdout + proc.stderr)
    return cell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="data.train_files entry (a conversations file)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--attention", nargs="*", default=["flex", "dense"],
                    help="attention modes of the new code's eager-teacher cells (none: compiled-teacher cells only)")
    ap.add_argument("--compile-teacher", nargs="*", default=[], metavar="BACKEND",
                    help="also a flex cell of the new code per backend with train.compile_teacher=BACKEND (inductor)")
    ap.add_argument("--teacher-attention", nargs="*", default=[None], metavar="MODE", choices=["sdpa", "flex"],
                    help="train.teacher_attention of the compiled-teacher cells, one cell per mode (sdpa, flex; "
                         "default: the code's own default; needs --compile-teacher); the profile run takes the first")
    ap.add_argument("--old-root", default=None, help="checkout of the earlier commit (the 'before' column)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--skip", type=int, default=1, help="logged intervals dropped from the median (warm-up)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the table's cells, one more run of the new code at the first n (the first "
                         "--attention, the first --compile-teacher backend if any) profiled over this many steps: "
                         "<out>/*_profile/ profile.txt, profile_cpu.txt, trace.json.gz")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per cell")
    ap.add_argument("--out", default="runs/bench_train")
    args = ap.parse_args(argv)
    if args.teacher_attention != [None] and not args.compile_teacher:
        ap.error("--teacher-attention applies to the compiled-teacher cells: give --compile-teacher too")
    args.data = str(Path(args.data).resolve()) if Path(args.data).exists() else args.data
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    for n in args.stages:
        if args.old_root:
            cells.append(run_cell(Path(args.old_root).resolve(), n, None, args, out))
            print(json.dumps(cells[-1])[:400], flush=True)
        for att in args.attention:
            cells.append(run_cell(REPO, n, att, args, out))
            print(json.dumps(cells[-1])[:400], flush=True)
            (out / "bench_train.json").write_text(json.dumps(cells, indent=2))
        for backend in args.compile_teacher:
            for tattn in args.teacher_attention or [None]:
                cells.append(run_cell(REPO, n, "flex", args, out, compile_teacher=backend, teacher_attention=tattn))
                print(json.dumps(cells[-1])[:400], flush=True)
                (out / "bench_train.json").write_text(json.dumps(cells, indent=2))
    if args.profile_steps:  # its own run: profiling slows the steps it covers, so its rate is not a table cell
        backend = args.compile_teacher[0] if args.compile_teacher else None
        attention = args.attention[0] if args.attention else "flex"
        tattn = args.teacher_attention[0] if backend and args.teacher_attention else None
        prof = run_cell(REPO, args.stages[0], attention, args, out, compile_teacher=backend, profile=True,
                        teacher_attention=tattn)
        print(json.dumps(prof)[:400], flush=True)
    print("\n| n | code | attention | tokens/s per GPU | x before | x eager teacher |\n|---|---|---|---|---|---|")

    def rate_of(n: int, code: str, attention: str | None = None):
        return next((b.get("tokens_per_s") for b in cells
                     if b["n"] == n and b["code"] == code and attention in (None, b["attention"])), None)

    for c in cells:
        rate, base = c.get("tokens_per_s"), rate_of(c["n"], "before")
        eager = rate_of(c["n"], "after", "flex") if "teacher compiled" in c["attention"] else None
        x = f"{rate / base:.2f}x" if (rate and base) else "-"
        xe = f"{rate / eager:.2f}x" if (rate and eager) else "-"
        shown = f"{rate:,.0f}" if rate else f"failed rc={c['rc']}"
        print(f"| {c['n']} | {c['code']} | {c['attention']} | {shown} | {x} | {xe} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
