"""Regenerate assistant answers with the target itself (EAGLE's advice: train the drafter on the target's own text).

The head is used on the target's outputs; distilling it on human-written (or other models') answers trains it on
contexts it will never see. :func:`regenerate_records` answers the first user turn of each conversation with the
target (batched ``generate`` of transformers, greedy or sampled) and returns pre-tokenised records::

    {"input_ids": prompt ids + generated ids (up to and including EOS), "assistant_mask": 0 on the prompt, 1 after,
     "conv_id": the source conversation's id, when it has one (the held-out split keeps the two on one side)}

Only the first turn is regenerated (later turns would need the target's answers to earlier ones as context);
``launch/prepare_train_data.py regenerate`` writes them as a data file, and ``data.regenerate=true`` does it inside
``launch/train.py`` (every rank answers its share).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from spd_ds.train.chat import prompt_ids


def first_turn_prompt(messages: Sequence[dict]) -> list[dict] | None:
    """System messages before the first user turn plus that user turn; ``None`` without a user turn."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            return out
        if m["role"] != "system":
            return None
    return None


def regenerated_dir(out_dir, world: int, settings: dict, records: Sequence[dict]) -> Path:
    """The folder under ``<out_dir>/regenerated`` that holds ``data.regenerate``'s answers (one
    ``part-<rank>.jsonl.gz`` per rank, each answering records ``rank::world``) for these inputs: named by a blake2b
    digest of the world size, ``settings`` (the generation settings, target and chat template: JSON values) and
    ``records`` (every record's JSON). A rerun with the same inputs (a resume, or a rerun after a crash before the
    first checkpoint) finds the answers already written; other inputs, e.g. another world size, whose parts shard the
    records otherwise, get a folder of their own instead of reading parts that answer other records.

    Returns:
        ``Path(out_dir) / "regenerated" / <16 hex digits>``.
    """
    h = hashlib.blake2b(json.dumps({"world": int(world), **settings}, sort_keys=True, default=str).encode(),
                        digest_size=8)
    for r in records:
        h.update(json.dumps(r, sort_keys=True, default=str).encode())
    return Path(out_dir) / "regenerated" / h.hexdigest()


@torch.no_grad()
def regenerate_records(records: Sequence[dict], model_dir, tokenizer, *, max_new_tokens: int = 512,
                       temperature: float = 0.0, sample_fraction: float | None = None, batch_size: int = 64,
                       max_prompt_tokens: int = 1024, device=None, dtype: torch.dtype | None = None,
                       time_budget_s: float | None = None, seed: int = 0, eos_token_ids: Sequence[int] | None = None,
                       progress: bool = True) -> list[dict]:
    """Answer the first user turn of every conversation in ``records`` with the target.

    Args:
        records: normalised conversation records (``{"messages": [...]}``; others are skipped).
        model_dir: the target's HF directory.
        tokenizer: its tokenizer (with the chat template).
        max_new_tokens: longest answer.
        temperature: 0 = greedy, else sampling at this temperature (no top-k/top-p).
        sample_fraction: if given, this share of the prompts is sampled at ``temperature`` (or 1.0 when
            ``temperature`` is 0) and the rest answered greedily.
        batch_size: prompts per ``generate`` call (prompts are sorted by length, left-padded).
        max_prompt_tokens: longer prompts are skipped.
        device, dtype: where/how the target runs (default: CUDA + bf16 if available, else CPU + fp32).
        time_budget_s: stop starting new batches after this many seconds (answers so far are returned).
        eos_token_ids: ids that end an answer (default: the tokenizer's EOS).

    Returns:
        Pre-tokenised records in the order they were generated.
    """
    from spd_ds.builder import load_generation_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = load_generation_model(model_dir, dtype).to(device).eval()
    eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts, conv_ids = [], []  # conv_ids: the source's id, so that the held-out split keeps an answer with its
    for r in records:          # conversation (spd_ds.train.split)
        msgs = first_turn_prompt(r.get("messages") or [])
        if msgs is None:
            continue
        ids = prompt_ids(tokenizer, msgs)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
            conv_ids.append(r.get("conv_id", r.get("id")))
    prompts = [(ids, cid) for ids, cid in zip(prompts, conv_ids)]
    groups: list[tuple[float, list[list[int]]]] = []
    if sample_fraction is not None:
        k = int(round(len(prompts) * sample_fraction))
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(prompts), generator=g).tolist()
        groups.append((temperature or 1.0, [prompts[i] for i in perm[:k]]))
        groups.append((0.0, [prompts[i] for i in perm[k:]]))
    else:
        groups.append((temperature, prompts))
    total = sum(len(p) for _, p in groups)
    t0 = time.perf_counter()
    out: list[dict] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="regenerating", unit="conv")
    torch.manual_seed(seed)
    for temp, plist in groups:
        order = sorted(range(len(plist)), key=lambda i: -len(plist[i][0]))
        for b in range(0, len(order), batch_size):
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                break
            batch = [plist[i][0] for i in order[b:b + batch_size]]
            cids = [plist[i][1] for i in order[b:b + batch_size]]
            L = max(len(p) for p in batch)
            ids = torch.full((len(batch), L), pad, dtype=torch.long)
            att = torch.zeros(len(batch), L, dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, L - len(p):] = torch.tensor(p)
                att[i, L - len(p):] = 1
            kw = dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp > 0 else dict(do_sample=False)
            gen = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=pad, **kw)
            gen = gen[:, L:].tolist()
            for p, cid, g in zip(batch, cids, gen):
                answer = []
                for tok in g:
                    answer.append(tok)
                    if tok in eos:
                        break
                if answer:
                    rec = {"input_ids": list(p) + answer, "assistant_mask": [0] * len(p) + [1] * len(answer)}
                    out.append(rec if cid is None else {**rec, "conv_id": cid})
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    del model
    return out
