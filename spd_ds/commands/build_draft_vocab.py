"""Build a draft vocabulary: the top-K token ids by frequency over the assistant tokens of a corpus.

Examples::

    python launch/build_draft_vocab.py --model smollm2-135m-instruct --data sharegpt --size 16384 \\
        --out draft_vocab/smollm2-135m-instruct_sharegpt_16k.json
    python launch/build_draft_vocab.py --model /models/Qwen3-4B --data chats.jsonl --data more/ --size 32000 \\
        --out d.json

The output is the reference project's JSON format (token_ids, draft_vocab_size, vocab_size,
total_positions_counted, topk_selected_token_count_sum, topk_mass_ratio, tokenizer_name, data_paths,
mask_assistant); the model's EOS ids are always included. Use it with head.draft_vocab=<file>.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def main(argv: list[str] | None = None) -> int:
    """Count the assistant tokens of the corpus and write the draft vocabulary (module docstring). Exit status 0
    on success, 2 after a user error (one line: arguments, data, model, chat template, output path)."""
    from spd_ds.cli import data_user_errors, run_cli

    return run_cli(_main, argv, user_errors=data_user_errors, prog="build_draft_vocab")


def _main(argv: list[str] | None = None) -> int:
    from spd_ds.cli import add_version_argument, check_output_file, int_at_least

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_version_argument(ap)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="zoo name, local HF directory or hub id")
    ap.add_argument("--data", action="append", required=True,
                    help="data source (file, directory, 'sharegpt', hub id); repeatable")
    ap.add_argument("--size", type=int_at_least(1), default=16384,
                    help="draft vocabulary size K (default: %(default)s)")
    ap.add_argument("--out", required=True, help="output JSON path")
    ap.add_argument("--max-conversations", type=int_at_least(1), default=None,
                    help="use at most this many conversations")
    ap.add_argument("--max-seq-length", type=int_at_least(2), default=4096,
                    help="truncate conversations to this many tokens")
    ap.add_argument("--chat-template", default=None, help="Jinja template (file or string) replacing the tokenizer's")
    ap.add_argument("--num-workers", type=int_at_least(0), default=0, help="tokenising processes")
    ap.add_argument("--name", default=None, help="tokenizer_name recorded in the file (default: --model)")
    args = ap.parse_args(argv)
    check_output_file(args.out, "--out")  # before the corpus is read and tokenised
    from spd_ds.train.chat import read_chat_template

    read_chat_template(args.chat_template)  # before the model resolves and its tokenizer loads

    from spd_ds.builder import generation_eos_ids, load_tokenizer
    from spd_ds.config import ConfigError
    from spd_ds.train.chat import set_chat_template
    from spd_ds.train.data import check_selfdistill_target, load_records, tokenize_records
    from spd_ds.train.selfdistill import model_fingerprint
    from spd_ds.train.vocab import count_assistant_tokens, draft_vocab_record, select_draft_vocab, write_draft_vocab
    from spd_ds.zoo import resolve_model

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    set_chat_template(tok, args.chat_template)
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    V = max(int(cfg.get("vocab_size", 0)), len(tok))  # the model's vocabulary (recorded as the file's vocab_size)
    if args.size > V:  # before the corpus is read
        raise ConfigError(f"--size {args.size} is larger than the model's vocabulary of {V} ids; give at most {V}")
    check_selfdistill_target(args.data, model_fingerprint(model_dir), args.model)
    records = load_records(args.data, limit=args.max_conversations)
    data = tokenize_records(records, tok, args.max_seq_length, 1, "truncate", args.num_workers)
    # its own words, not TokenizedData.summary's: that one names the training config (data.max_seq_length, ...)
    print(f"build_draft_vocab: {len(data)} conversations, {data.num_tokens} tokens; left out "
          f"{data.dropped_no_assistant} without an assistant token within --max-seq-length {args.max_seq_length}, "
          f"cut {data.truncated} to it", file=sys.stderr)
    counts = count_assistant_tokens(data.input_ids, data.assistant_mask, V)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    eos |= set(generation_eos_ids(model_dir))
    try:
        ids = select_draft_vocab(counts, args.size, sorted(eos))
    except ValueError as e:  # fewer ids than the EOS ids that are always kept
        raise ConfigError(f"--size {args.size}: {e}") from None
    rec = draft_vocab_record(counts, ids, args.name or str(args.model), args.data, V)
    path = write_draft_vocab(rec, args.out)
    print(f"build_draft_vocab: {len(ids)} ids covering {rec['topk_mass_ratio']:.4f} of "
          f"{rec['total_positions_counted']} assistant tokens (EOS {sorted(eos)}) -> {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
