#!/usr/bin/env python
"""The target's own answers of an eval run, as pre-tokenised training records (prompt + answer ids, loss on the
answer).

Reads the ``per_prompt.jsonl`` files of ``launch/benchmark.py`` / ``launch/eval.py`` runs (their generated
``tokens``; SPD's output is the target's own greedy answer at T = 0 and a sample of the target's distribution at
T > 0) and re-encodes each prompt the way the run did (the first user turn through the chat template of the run's
config: :func:`spd_ds.eval.inputs.load_eval_prompts`). Each line written is ``{"input_ids": [...],
"assistant_mask": [...], "conv_id": "<set>/<question_id>/<file index>"}``: the prompt's ids (mask 0) followed by the
answer's (mask 1), what ``validate_heads.py --all-records`` scores, so that a head's predicted acceptance can be set
beside the acceptance the decoder measured on the same text.

Usage (repo root; the overrides as the eval run had them)::

    python scripts/diagnostics/answers_to_records.py docs/eval_logs/ev24_x3l2_T1/c3/per_prompt.jsonl \\
        --out runs/answers/x3l2_T1.jsonl --set data.eval_dir=runs/eval_sets --set data.num_prompts=10 \\
        --set "eval.prompt_sets=[mt_bench,humaneval,gsm8k]"

Raises (exit status 2, one line): a missing file; a line that is not a per-prompt record; a record whose prompt is
not among the re-encoded prompts, or whose re-encoded prompt length differs from the run's ``prompt_tokens`` (another
chat template or prompt set than the run's).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    """Write the records (see the module doc) and return 0; 2 with a one-line error on stderr for a missing file, a
    line that is not a per-prompt record, or a prompt the config does not encode as the run did."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("per_prompt", nargs="+", help="per_prompt.jsonl files of eval runs")
    ap.add_argument("--out", required=True, help="jsonl file to write")
    ap.add_argument("--method", default="spd", help="the method whose answers are taken (default spd)")
    ap.add_argument("--config", default=None, help="the eval run's base YAML (default: the built-in defaults)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of the eval run's config (repeatable)")
    args = ap.parse_args(argv)

    from spd_ds.builder import build_arch, prompt_tokenizer
    from spd_ds.config import load_config
    from spd_ds.eval.inputs import load_eval_prompts

    cfg = load_config(args.config, args.overrides)
    arch = build_arch(cfg)
    prompts = {(p.prompt_set, p.question_id): p.ids for p in load_eval_prompts(cfg, prompt_tokenizer(cfg, arch),
                                                                               arch.vocab_size)}
    for path in args.per_prompt:  # before anything is written
        if not Path(path).is_file():
            print(f"error: {path}: no such file; give the per_prompt.jsonl of an eval run (<out>/c<n>/)",
                  file=sys.stderr)
            return 2
    out, n = Path(args.out), 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i, path in enumerate(args.per_prompt):
            lines = Path(path).read_text().splitlines()
            for k, line in enumerate(lines, 1):
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    r = None
                if not isinstance(r, dict):
                    print(f"error: {path}:{k}: not a JSON object: not a per-prompt record of launch/eval.py or "
                          "launch/benchmark.py", file=sys.stderr)
                    return 2
                missing = [key for key in ("method", "prompt_set", "question_id", "tokens", "prompt_tokens")
                           if key not in r]
                if missing:
                    print(f"error: {path}:{k}: no {', '.join(missing)}: not a per-prompt record of launch/eval.py or "
                          "launch/benchmark.py", file=sys.stderr)
                    return 2
                if r["method"] != args.method:
                    continue
                key = (r["prompt_set"], str(r["question_id"]))
                ids = prompts.get(key)
                if ids is None:
                    print(f"error: {path}: prompt {key} is not among the config's prompts; pass the eval run's "
                          "data.eval_dir, data.num_prompts and eval.prompt_sets", file=sys.stderr)
                    return 2
                if len(ids) != r["prompt_tokens"]:
                    print(f"error: {path}: prompt {key} encodes to {len(ids)} tokens, the run had "
                          f"{r['prompt_tokens']}; pass the run's config (decoding.chat_template)", file=sys.stderr)
                    return 2
                ids = list(ids)
                mask = [0] * len(ids) + [1] * len(r["tokens"])
                f.write(json.dumps({"input_ids": ids + r["tokens"], "assistant_mask": mask,
                                    "conv_id": f"{key[0]}/{key[1]}/{i}"}) + "\n")
                n += 1
    print(f"{n} records -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
