"""Draft vocabularies (build, file round trip, the committed SmolLM2 one) and heads saved with one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from spd_ds.decoding.drafters import HeadDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.head import SpeculationHead, load_draft_vocab
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from spd_ds.train.vocab import count_assistant_tokens, draft_vocab_record, select_draft_vocab, write_draft_vocab
from tests.test_train_data import make_chat_model, make_chats

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_VOCAB = REPO / "draft_vocab" / "smollm2-135m-instruct_sharegpt_16k.json"
REFERENCE_KEYS = {"tokenizer_name", "data_paths", "mask_assistant", "vocab_size", "draft_vocab_size", "token_ids",
                  "total_positions_counted", "topk_selected_token_count_sum", "topk_mass_ratio"}


def test_counts_selection_and_file_round_trip(tmp_path):
    counts = count_assistant_tokens([[5, 5, 7, 9, 2], [5, 1]], [[0, 1, 1, 1, 1], [1, 1]], 12)
    assert counts.tolist() == [0, 1, 1, 0, 0, 2, 0, 1, 0, 1, 0, 0]
    ids = select_draft_vocab(counts, 3, always=[2])
    assert ids == [1, 2, 5]  # 5 (2x), then ties by smaller id (1), EOS 2 forced
    rec = draft_vocab_record(counts, ids, "tiny", ["a.jsonl"], 12)
    assert rec["topk_selected_token_count_sum"] == 4 and rec["total_positions_counted"] == 6
    assert rec["topk_mass_ratio"] == pytest.approx(4 / 6)
    path = write_draft_vocab(rec, tmp_path / "v.json")
    assert set(json.loads(path.read_text())) == REFERENCE_KEYS
    assert load_draft_vocab(path) == ids
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 13)


def test_build_draft_vocab_launcher(tmp_path, capsys):
    from spd_ds.commands import build_draft_vocab

    model = make_chat_model(tmp_path)
    data = make_chats(tmp_path / "chats.jsonl", 50)
    out = tmp_path / "vocab.json"
    assert build_draft_vocab.main(["--model", str(model), "--data", str(data), "--size", "20", "--out", str(out),
                                   "--max-seq-length", "64"]) == 0
    err = capsys.readouterr().err  # the data line names this command's options, not the training config's keys
    assert "build_draft_vocab: 50 conversations" in err and "--max-seq-length 64" in err and "data." not in err
    rec = json.loads(out.read_text())
    assert set(rec) == REFERENCE_KEYS and rec["draft_vocab_size"] == 20 and rec["mask_assistant"] is True
    assert 2 in rec["token_ids"]  # <|im_end|>
    assert rec["token_ids"] == sorted(set(rec["token_ids"]))
    assert 0.5 < rec["topk_mass_ratio"] <= 1.0


def test_token_ids_outside_the_vocabulary_are_named_as_a_data_error(tmp_path, capsys):
    """Pre-tokenised data with an id outside the model's vocabulary was a ValueError traceback naming the largest id
    (with -3 it said "token id 5 outside"): it is a DataError (one line from build_draft_vocab) naming the id."""
    from spd_ds.commands import build_draft_vocab
    from spd_ds.train.data import DataError

    for bad, more in ((99, ""), (-3, ""), (12, " (and 1 more assistant token outside it)")):
        with pytest.raises(DataError, match=rf"^token id {bad} is outside the model's vocabulary of 12 ids \(0 to "
                                            rf"11\){re.escape(more)}: pre-tokenised data made with another tokenizer"):
            count_assistant_tokens([[5, 1], [1, 2, bad, 5, 40 if more else 5]], [[1, 1], [0, 1, 1, 1, 1]], 12)
    model = make_chat_model(tmp_path)
    data = tmp_path / "oor.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 99999, 5], "assistant_mask": [0, 1, 1, 1]}) + "\n")
    out = tmp_path / "v.json"
    assert build_draft_vocab.main(["--model", str(model), "--data", str(data), "--size", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: token id 99999 is outside the model's vocabulary of 128 "
                                                   "ids") and "Traceback" not in err and not out.exists(), err


def test_committed_smollm2_draft_vocab():
    if not SMOLLM2_VOCAB.exists():
        pytest.skip("draft_vocab/ not built yet")
    rec = json.loads(SMOLLM2_VOCAB.read_text())
    assert set(rec) == REFERENCE_KEYS
    ids = load_draft_vocab(SMOLLM2_VOCAB)
    assert len(ids) == rec["draft_vocab_size"] == 16384 and rec["vocab_size"] == 49152
    assert 2 in ids  # <|im_end|>, SmolLM2's EOS
    assert rec["topk_mass_ratio"] > 0.95


def test_committed_smollm2_draft_vocab_covers_single_characters(smollm2_dir):
    if not SMOLLM2_VOCAB.exists():
        pytest.skip("draft_vocab/ not built yet")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = set(load_draft_vocab(SMOLLM2_VOCAB))
    single = [tok.encode(c, add_special_tokens=False) for c in map(chr, range(32, 127))]
    assert all(len(t) == 1 and t[0] in ids for t in single)  # any ASCII text can be drafted character by character
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_head_with_draft_vocab_decodes_identically_after_reload(tmp_path, temperature):
    arch = TargetArch(make_chat_model(tmp_path, num_layers=4))
    part = StagePartition.build(4, num_stages=2)
    torch.manual_seed(1)
    ids = sorted(set(range(0, 128, 2)) | {2, 3})
    head = SpeculationHead(arch, part, 1, ids)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    head.save(tmp_path / "head")
    again = SpeculationHead.load(tmp_path / "head", arch, part)
    assert again.draft_ids.tolist() == ids
    target = Target(arch, part, torch.float32, "cpu")
    sampling = SamplingParams(temperature=temperature, seed=3)
    outs = []
    for h in (head, again):
        dec = SPDReferenceDecoder(target, HeadDrafter(h, 64, torch.float32, "cpu"), sampling, eos_token_ids=None,
                                  max_len=64)
        outs.append(dec.generate([1, 40, 50, 60, 2, 3], 30))
    assert outs[0].tokens == outs[1].tokens
    assert outs[0].metrics.num_accepted_tokens == outs[1].metrics.num_accepted_tokens
    assert outs[0].metrics.num_drafts > 0


def test_widened_head_decodes_exactly_as_ar(tmp_path):
    """The lossless line through ``set_draft_vocab``: a target-tied head made for a few ids, widened to every id,
    drafts tokens outside its old vocabulary, and greedy SPD still returns the AR decoder's tokens (rollbacks
    included); narrow and widened heads give the same tokens. (T > 0: the chi-square test of
    tests/test_sampling.py runs a widened head.)"""
    from spd_ds.decoding.ar import ARDecoder

    arch = TargetArch(make_chat_model(tmp_path, num_layers=4))
    part = StagePartition.build(4, num_stages=2)
    target = Target(arch, part, torch.float32, "cpu")
    prompt = [1, 40, 50, 60, 2, 3]
    want = ARDecoder(target, max_len=64).generate(prompt, 30).tokens
    torch.manual_seed(1)
    ids = list(range(0, 32))
    head = SpeculationHead(arch, part, 1, ids, lm_head_from_target=True)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    outs, drafted = [], []
    for widen in (False, True):
        if widen:
            head.set_draft_vocab(None)
        drafter = HeadDrafter(head, 64, torch.float32, "cpu")
        propose = drafter.propose

        def recording(*a, _propose=propose, **k):
            d = _propose(*a, **k)
            drafted.append((widen, d.token))
            return d

        drafter.propose = recording
        outs.append(SPDReferenceDecoder(target, drafter, SamplingParams(), max_len=64).generate(prompt, 30))
    assert outs[0].tokens == outs[1].tokens == want
    assert any(w and t not in ids for w, t in drafted)  # the widened head used ids outside its old vocabulary
    assert outs[1].metrics.num_rollbacks > 0 and outs[1].metrics.num_drafts > 0
