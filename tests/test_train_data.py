"""spd_ds.train.data / batching / chat: sources, ShareGPT parsing, chat templates and assistant masks, packing, batches.

Also home of :func:`make_chat_model`, the tiny random llama with a character-level tokenizer and a ChatML template
that the other ``test_train_*`` files train on.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import torch

from spd_ds.train.chat import (
    ChatTemplateError, EmptyMaskError, encode_conversation, has_generation_markers, set_chat_template,
)
from spd_ds.train.batching import BatchPlanner, loop_positions, pack_rows
from spd_ds.train.data import (
    DataError, TokenizedData, check_sources, iter_json_records, load_records, normalize_record, tokenize_records,
    write_jsonl_gz,
)
from tests.tiny_models import make_tiny_model

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
                 "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                 "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = "the cat dog sat on a mat and ran to see big red sun why how is it ok yes no".split()


def make_tokenizer(template: str = CHATML):
    """Character-level fast tokenizer (99 ids: <unk>, <|im_start|>, <|im_end|>, newline, printable ASCII)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>"] + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = template
    return tok


def make_chat_model(root: Path, num_layers: int = 4, template: str = CHATML, model_type: str = "llama") -> Path:
    """A tiny random ``model_type`` (default llama; vocab 128, EOS = <|im_end|> = 2) with the character tokenizer
    saved beside it."""
    d = make_tiny_model(Path(root), model_type, num_layers=num_layers, vocab_size=128, eos_token_id=2, bos_token_id=1)
    if not (d / "tokenizer.json").exists():
        make_tokenizer(template).save_pretrained(d)
    return d


def make_chats(path: Path, n: int = 200, seed: int = 0, sharegpt: bool = False) -> Path:
    """``n`` random one- or two-turn chats as JSON lines (``messages``, or ShareGPT ``conversations``)."""
    rng = random.Random(seed)
    recs = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns.append(("user", " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))))
            turns.append(("assistant", " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))))
        if sharegpt:
            recs.append({"id": str(len(recs)), "conversations": [
                {"from": {"user": "human", "assistant": "gpt"}[r], "value": c} for r, c in turns]})
        else:
            recs.append({"messages": [{"role": r, "content": c} for r, c in turns]})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# ---------------------------------------------------------------------------------------------------- reading
def test_a_data_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """A data file without read permission (or otherwise unopenable) was a PermissionError traceback; now a
    DataError naming it (simulated: tests often run as root, who reads every file)."""
    from spd_ds import files as files_mod
    from spd_ds.train import data as data_mod

    f = make_chats(tmp_path / "chats.jsonl", 3)

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    for mod in (data_mod, files_mod):  # the modules' open, before the builtin (files.is_gzip opens it first)
        monkeypatch.setattr(mod, "open", refused, raising=False)
    with pytest.raises(DataError, match=f"^data file {f} cannot be read \\(PermissionError: Permission denied\\); "
                                        "make it readable or leave it out of data.train_files$"):
        load_records([str(f)])


def test_cut_off_json_array_is_read_record_by_record(tmp_path):
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(5)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.index('"q3"') + 2]  # cut inside the 4th record
    p = tmp_path / "cut.json"
    p.write_text(cut)
    got = list(iter_json_records(p))
    assert [r["id"] for r in got] == ["0", "1", "2"]
    pz = tmp_path / "cut.json.gz"
    pz.write_bytes(gzip.compress(cut.encode()))
    assert [r["id"] for r in iter_json_records(pz)] == ["0", "1", "2"]
    pl = tmp_path / "x.jsonl"
    pl.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    assert len(list(iter_json_records(pl))) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        list(iter_json_records(bad))
    # a complete array with a damaged record in the middle is an error, not a cut-off end (nothing dropped silently)
    mid = tmp_path / "mid.json"
    mid.write_text(text.replace('"value": "a2"', "'value': 'a2'"))
    with pytest.raises(DataError, match="mid.json: a record of its JSON array does not decode"):
        list(iter_json_records(mid))
    # gzip is read by its bytes, whatever the name; text that is not UTF-8 is a one-line error
    named_plain = tmp_path / "plain.jsonl"
    named_plain.write_bytes(gzip.compress(pl.read_bytes()))
    assert len(list(iter_json_records(named_plain))) == 5
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"a": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="latin.jsonl is not UTF-8 text"):
        list(iter_json_records(latin))


def test_a_chat_template_is_a_file_or_jinja_text(tmp_path):
    from spd_ds.train.chat import ChatTemplateError, set_chat_template

    tok = make_tokenizer()
    with pytest.raises(ChatTemplateError, match="neither a file nor Jinja text"):
        set_chat_template(tok, str(tmp_path / "chatml_typo.jinja"))  # a mistyped path must not become the template
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    set_chat_template(tok, str(f))
    assert tok.chat_template == f.read_text()
    set_chat_template(tok, "{{ messages[0]['content'] }}")
    assert tok.chat_template == "{{ messages[0]['content'] }}"


def test_a_chat_template_must_be_utf8_jinja_that_renders_the_messages_and_parses(tmp_path, capsys):
    """A file that is no chat template (a CSV) became the template (every prompt the same tokens); broken Jinja failed
    with a jinja2 traceback once the model had loaded, a non-UTF-8 file with a UnicodeDecodeError traceback. Each is
    one ChatTemplateError line, and the data programs give it before the model resolves (here it does not exist)."""
    from spd_ds.commands import build_draft_vocab, prepare_train_data
    from spd_ds.train.chat import read_chat_template
    from spd_ds.zoo import _SMOLLM2_CHAT_TEMPLATE

    csv = tmp_path / "prompts.csv"
    csv.write_text("id,prompt\n1,hello\n")
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("{{ messages[0]['content'] }} caf\u00e9".encode("latin-1"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    bad = [(str(csv), f"chat template file {csv} holds no Jinja"),
           (str(latin), f"chat template file {latin} is not UTF-8 text (unexpected end of data at byte 32); save it "
                        "as UTF-8"),
           (str(broken), f"chat template file {broken} is not valid Jinja (line 2: unexpected '}}')"),
           ("{{ 'Q: ' }}", "never reads 'messages', so every prompt would render the same"),
           ("{% for m in messages %}{{ m }}", "is not valid Jinja (line 1: Unexpected end of template")]
    for template, message in bad:
        with pytest.raises(ChatTemplateError) as e:
            read_chat_template(template)
        assert message in str(e.value) and "\n" not in str(e.value), (template, str(e.value))
    # what transformers renders: generation tags (over lines too), loop controls, filters it alone defines
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{%- generation\n-%}{{ m['content'] | tojson }}"
              "{% endgeneration %}{% else %}{% continue %}{% endif %}{% endfor %}")
    plus = marked.replace("{%- generation\n-%}", "{%+ generation +%}").replace("{% endgeneration %}",
                                                                           "{%+ endgeneration -%}")
    for good in (CHATML, CHATML_MARKED, _SMOLLM2_CHAT_TEMPLATE, marked, plus):  # + (no lstrip/trim) too
        assert read_chat_template(good) == good
    assert has_generation_markers(type("Tok", (), {"chat_template": plus})())
    bom = tmp_path / "bom.jinja"
    bom.write_bytes(b"\xef\xbb\xbf" + CHATML.encode())  # UTF-8 with a BOM (Notepad): the BOM is no template text
    assert read_chat_template(str(bom)) == CHATML
    out = tmp_path / "v.json"
    for mod, argv in ((build_draft_vocab, ["--data", str(csv), "--out", str(out)]),
                      (prepare_train_data, ["regenerate", "--data", str(csv), "--out", str(out)]),
                      (prepare_train_data, ["selfdistill", "--data", str(csv), "--out", str(tmp_path / "sd")])):
        assert mod.main([*argv, "--model", str(tmp_path / "no_model"), "--chat-template", str(broken)]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith(f"error: chat template file {broken} is not valid Jinja"), err
    assert not out.exists() and not (tmp_path / "sd").exists()


def test_prepare_train_data_and_draft_vocab_cli_errors_are_one_line(tmp_path, capsys):
    """The data programs end a user error with one line and exit status 2, before reading the corpus, and leave no
    empty output folder behind; export keeps conv_id when it clips (the held-out split keys on it)."""
    from spd_ds.commands import build_draft_vocab, prepare_train_data

    model = make_chat_model(tmp_path)
    data = make_chats(tmp_path / "chats.jsonl", 20)
    (tmp_path / "afile").write_text("x")
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    (sd_dir / "manifest.json").write_text("{}")
    cases = [
        (build_draft_vocab,
         ["--model", str(model), "--data", str(data), "--size", "0", "--out", str(tmp_path / "v.json")],
         "--size: must be >= 1"),
        (build_draft_vocab, ["--model", str(model), "--data", str(data), "--size", "5000",
                             "--out", str(tmp_path / "v.json")], "--size 5000 is larger than the model's vocabulary"),
        (build_draft_vocab, ["--model", str(model), "--data", str(data), "--out", str(tmp_path)],
         "names a folder; give a file path inside it"),
        (build_draft_vocab, ["--model", str(model), "--data", str(tmp_path / "none.jsonl"), "--size", "20", "--out",
                             str(tmp_path / "v.json")], "not found"),
        (build_draft_vocab, ["--model", str(model), "--data", str(sd_dir), "--size", "20", "--out",
                             str(tmp_path / "v.json")], str(sd_dir)),  # a self-distillation folder without shards
        (prepare_train_data, ["export", "--data", str(data), "--limit", "0", "--out", str(tmp_path / "e.jsonl.gz")],
         "--limit: must be >= 1"),
        (prepare_train_data, ["export", "--data", str(data), "--out", str(tmp_path / "afile" / "e.jsonl.gz")],
         "cannot be created as a folder"),
        (prepare_train_data, ["regenerate", "--model", str(model), "--data", str(data), "--sample-fraction", "-0.4",
                              "--out", str(tmp_path / "r.jsonl.gz")],
         "argument --sample-fraction: must be >= 0 and <= 1, got -0.4"),
    ]
    for mod, argv, message in cases:
        try:
            code = mod.main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    for argv in (["export", "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "new" / "sub" / "e.gz")],
                 ["selfdistill", "--model", str(model), "--data", str(tmp_path / "none.jsonl"),
                  "--out", str(tmp_path / "new" / "sd")]):  # refused after the output folder was made
        assert prepare_train_data.main(argv) == 2 and "not found" in capsys.readouterr().err, argv
        assert not (tmp_path / "new").exists(), argv  # no empty folder left behind
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": "q" * 30}, {"from": "gpt", "value": "a" * 30},
        {"from": "human", "value": "more"}, {"from": "gpt", "value": "b"}]}) + "\n" for i in range(3)))
    out = tmp_path / "clipped.jsonl.gz"
    assert prepare_train_data.main(["export", "--data", str(ids), "--max-chars", "62", "--out", str(out)]) == 0
    got = list(iter_json_records(out))
    assert [r["conv_id"] for r in got] == ["c0", "c1", "c2"] and all(len(r["messages"]) == 2 for r in got)
    assert out.read_bytes()[:2] == b"\x1f\x8b"  # gzip, as its name says
    plain = tmp_path / "clipped.jsonl"  # a name without .gz: plain JSON lines (it was gzip under a .jsonl name)
    assert prepare_train_data.main(["export", "--data", str(ids), "--max-chars", "62", "--out", str(plain)]) == 0
    assert [json.loads(line) for line in plain.read_text().splitlines()] == got


def test_normalize_sharegpt_and_messages():
    r = normalize_record({"conversations": [{"from": "gpt", "value": "hi first"}, {"from": "human", "value": "Q"},
                                            {"from": "gpt", "value": "A"}, {"from": "human", "value": "  "}]})
    assert r == {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    assert normalize_record({"messages": [{"role": "user", "content": "only a question"}]}) is None
    assert normalize_record({"text": "no chat"}) is None
    pre = normalize_record({"input_ids": [5, 6, 7], "assistant_mask": [0, 1, 1]})
    assert pre == {"input_ids": [5, 6, 7], "assistant_mask": [0, 1, 1]}
    assert normalize_record({"input_ids": [5, 6], "assistant_mask": [1, 0]}) is None  # nothing to predict


def test_load_records_sources(tmp_path):
    make_chats(tmp_path / "a.jsonl", 10)
    (tmp_path / "sub").mkdir()
    make_chats(tmp_path / "sub" / "b.jsonl", 7, sharegpt=True)
    write_jsonl_gz([{"input_ids": [1, 2, 3], "assistant_mask": [0, 1, 1]}], tmp_path / "sub" / "c.jsonl.gz")
    assert len(load_records([str(tmp_path / "a.jsonl")])) == 10
    assert len(load_records([str(tmp_path / "sub")])) == 8
    assert len(load_records([str(tmp_path / "a.jsonl"), str(tmp_path / "sub")], limit=12)) == 12
    with pytest.raises(DataError, match="not found"):
        load_records(["no_such_file.jsonl"])
    with pytest.raises(DataError, match="empty"):
        load_records([])


def test_parquet_source(tmp_path):
    import datasets

    recs = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4)]
    datasets.Dataset.from_list(recs).to_parquet(str(tmp_path / "d.parquet"))
    got = load_records([str(tmp_path / "d.parquet")])
    assert [r["messages"][1]["content"] for r in got] == ["a0", "a1", "a2", "a3"]


def test_sharegpt_6k_format(tmp_path):
    """The form of the team's ShareGPT export (``{"id", "messages": [{role, content}]}`` lines, gzip), written here:
    the tests read nothing outside the checkout."""
    p = tmp_path / "sharegpt_6k.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        for i in range(30):
            msgs = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
            msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    recs = load_records([str(p)], limit=20)
    assert len(recs) == 20 and all(m["role"] in ("user", "assistant", "system") for r in recs for m in r["messages"])


def test_summary_explains_what_was_dropped():
    from spd_ds.train.data import TokenizedData

    line = TokenizedData([[1, 2]], [[0, 1]], dropped_no_assistant=3, max_length=512).summary()
    assert "dropped 3 conversations without assistant tokens (no answer token to learn within the first " \
           "data.max_seq_length=512 tokens" in line and "a larger data.max_seq_length keeps" in line
    assert "(no answer token" not in TokenizedData([[1, 2]], [[0, 1]]).summary()


# ---------------------------------------------------------------------------------------------------- chat masks
CONVS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello you"}],
    [{"role": "system", "content": "be nice"}, {"role": "user", "content": "a b"},
     {"role": "assistant", "content": "c"},
     {"role": "user", "content": "d"}, {"role": "assistant", "content": "e f g"}],
]


@pytest.mark.parametrize("conv", CONVS)
def test_prefix_diff_mask_equals_generation_marker_mask(conv):
    plain, marked = make_tokenizer(CHATML), make_tokenizer(CHATML_MARKED)
    assert not has_generation_markers(plain) and has_generation_markers(marked)
    a, b = encode_conversation(plain, conv), encode_conversation(marked, conv)
    assert a.input_ids == b.input_ids
    assert a.assistant_mask == b.assistant_mask
    text = "".join(plain.decode([t]) for t, m in zip(a.input_ids, a.assistant_mask) if m)
    assert text == "".join(m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant")


def test_prefix_diff_on_smollm2_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert not has_generation_markers(tok)
    e = encode_conversation(tok, CONVS[1])
    spans, cur = [], []
    for t, m in zip(e.input_ids, e.assistant_mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    assert spans == ["c<|im_end|>", "e f g<|im_end|>"]


def test_truncation_and_template_errors():
    tok = make_tokenizer()
    e = encode_conversation(tok, CONVS[0], max_length=10)
    assert e.truncated and len(e.input_ids) == 10
    bare = make_tokenizer(None)
    with pytest.raises(ChatTemplateError):
        set_chat_template(bare, None)
    set_chat_template(bare, CHATML)
    assert encode_conversation(bare, CONVS[0]).num_assistant > 0


def test_empty_assistant_mask_is_an_error():
    # a template that drops assistant turns: nothing to learn, and tokenising says so instead of training on nothing
    tok = make_tokenizer("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                         "{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    recs = [{"messages": c} for c in CONVS]
    with pytest.raises(EmptyMaskError, match="no training example"):
        tokenize_records(recs, tok, 512)
    from spd_ds.train.loss import TeacherTargets, kd_loss

    empty = TeacherTargets(torch.zeros(0, 8), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(EmptyMaskError):
        kd_loss(torch.zeros(0, 8), empty, torch.zeros(0))
    one = TeacherTargets(torch.zeros(1, 8), torch.zeros(1), torch.zeros(1, dtype=torch.long))
    with pytest.raises(EmptyMaskError):  # all weights zero (e.g. every argmax outside the draft vocab, 'drop')
        kd_loss(torch.zeros(1, 8), one, torch.zeros(1))


# ---------------------------------------------------------------------------------------------------- batches
def test_pack_rows_places_every_example_once():
    rng = random.Random(1)
    lengths = [rng.randint(1, 50) for _ in range(300)]
    order = list(range(300))
    rng.shuffle(order)
    rows = pack_rows(lengths, order, 64, window=100)
    flat = sorted(i for r in rows for i in r)
    assert flat == list(range(300))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    assert sum(lengths) / (64 * len(rows)) > 0.85  # dense


def _tokenized(n=120):
    tok = make_tokenizer()
    rng = random.Random(0)
    recs = [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(3))},
                          {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(5))}]}
            for _ in range(n)]
    return tokenize_records(recs, tok, 64, 4)


@pytest.mark.parametrize("pack", [True, False])
def test_batch_planner_shards_and_collates(pack):
    data = _tokenized()
    planners = [BatchPlanner(data, 128, 2, r, 2, seed=3, pack=pack) for r in range(2)]
    plans = [p.plan(0) for p in planners]
    assert len(plans[0]) == len(plans[1]) > 0
    used = [i for p in plans for mb in p.micro_batches for row in mb for i in row]
    assert len(used) == len(set(used))  # no example twice in an epoch, across ranks
    assert planners[0].plan(0).micro_batches == plans[0].micro_batches  # deterministic
    assert planners[0].plan(1).micro_batches != plans[0].micro_batches  # reshuffled per epoch
    b = planners[0].collate(plans[0].micro_batches[0])
    assert b["input_ids"].shape == b["segments"].shape == b["valid"].shape
    if pack:
        assert b["input_ids"].shape == (2, 128)
    # valid[t] <=> token t+1 is an assistant token of the same document
    for r, row in enumerate(plans[0].micro_batches[0]):
        t = 0
        for i in row:
            ids, m = data.input_ids[i], data.assistant_mask[i]
            assert b["input_ids"][r, t:t + len(ids)].tolist() == ids
            assert b["valid"][r, t:t + len(ids)].tolist() == [bool(x) for x in m[1:]] + [False]
            t += len(ids)
        assert not b["valid"][r, t:].any() and not b["segments"][r, t:].any()
        # documents 1, 2, ... left to right, each one contiguous run (what the segment-tile block masks assume)
        expected = [d for d, i in enumerate(row, 1) for _ in data.input_ids[i]]
        assert b["segments"][r, :t].tolist() == expected


def test_planner_refuses_too_little_data():
    data = _tokenized(3)
    with pytest.raises(DataError, match="fewer than"):
        BatchPlanner(data, 64, 4, 0, 2).plan(0)


def test_skip_loops_leaves_loop_positions_out_of_the_loss():
    """data.skip_loops: the planner's batches keep every token as context and drop exactly the loop positions from
    ``valid`` (a 9-gram closed again in the same answer); without it nothing changes."""
    loop_answer = list(range(10, 20)) * 3  # every token from the 2nd repetition's 9th on closes a seen 9-gram
    ids = [[1, 2, 3] + loop_answer + [2], [1, 4, 5] + list(range(30, 60)) + [2]]
    masks = [[0, 0, 0] + [1] * (len(loop_answer) + 1), [0, 0, 0] + [1] * 31]
    data = TokenizedData(ids, masks)
    plain = BatchPlanner(data, 128, 1, pack=True)  # both examples packed into one row
    skip = BatchPlanner(data, 128, 1, pack=True, skip_loops=True)
    rows = plain.plan(0).micro_batches[0]
    a, b = plain.collate(rows), skip.collate(rows)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["segments"], b["segments"])
    loop = loop_positions(a["input_ids"], a["valid"])
    assert int(loop.sum()) == len(loop_answer) - 10 - 8  # 30-token answer: 10 new, 8 more before a 9-gram repeats
    assert torch.equal(b["valid"], a["valid"] & ~loop)
    assert int(a["valid"].sum()) - int(b["valid"].sum()) == int(loop.sum())


def test_regenerated_answers_keep_their_conversation_id(tmp_path, capsys):
    """regenerate answers each first user turn with the target; each record keeps its source's conv_id (the held-out
    split keeps an answer with its conversation), and a run that answers nothing leaves an earlier --out alone."""
    from spd_ds.builder import load_tokenizer
    from spd_ds.commands import prepare_train_data
    from spd_ds.train.data import load_records
    from spd_ds.train.regenerate import regenerate_records

    model = make_chat_model(tmp_path)
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "answer"}]}) + "\n" for i in range(3)))
    tok = load_tokenizer(model)
    out = regenerate_records(load_records([str(data)]), model, tok, max_new_tokens=3, batch_size=2, device="cpu")
    assert sorted(r["conv_id"] for r in out) == ["c0", "c1", "c2"]
    assert all(len(r["input_ids"]) == len(r["assistant_mask"]) and 1 <= sum(r["assistant_mask"]) <= 3 for r in out)
    kept = tmp_path / "kept.jsonl.gz"
    kept.write_bytes(b"earlier")
    assert prepare_train_data.main(["regenerate", "--model", str(model), "--data", str(data), "--max-prompt-tokens",
                                    "1", "--max-new-tokens", "2", "--out", str(kept)]) == 1
    assert kept.read_bytes() == b"earlier" and "regenerated 0 answers of 3 records" in capsys.readouterr().err


def test_an_interrupted_write_leaves_the_earlier_file_and_a_fifo_is_written_in_place(tmp_path):
    """write_jsonl wrote in place: an interrupted export/regenerate left a shorter file of whole lines that read as
    complete, and the earlier good file was already gone. The lines go to a temporary file renamed at the end; an
    error or an interrupt leaves the earlier file as it was and no temporary file. A FIFO (or /dev/stdout) has
    nothing to replace: it is written in place and stays a FIFO."""
    import os
    import threading

    from spd_ds.train.data import write_jsonl

    def records(n, stop_at=None, error=None):
        for i in range(n):
            if i == stop_at:
                raise error
            yield {"i": i}

    for name in ("out.jsonl", "out.jsonl.gz"):
        out = tmp_path / name
        assert write_jsonl(records(5), out) == 5
        before = out.read_bytes()
        for error in (KeyboardInterrupt(), TypeError("not JSON")):
            with pytest.raises(type(error)):
                write_jsonl(records(5, 3, error), out)
            assert out.read_bytes() == before
        assert not [f.name for f in tmp_path.iterdir() if ".tmp" in f.name]
    assert gzip.decompress((tmp_path / "out.jsonl.gz").read_bytes()) == (tmp_path / "out.jsonl").read_bytes()
    private = tmp_path / "out.jsonl"
    private.chmod(0o600)  # a replaced file keeps its permission bits (a private data file stays private)
    write_jsonl(records(3), private)
    assert private.stat().st_mode & 0o777 == 0o600 and private.read_bytes().count(b"\n") == 3
    assert b"tmp" not in (tmp_path / "out.jsonl.gz").read_bytes()[:40]  # the gzip header names the file, as before
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    assert write_jsonl(records(2), fifo) == 2
    reader.join(10)
    assert got == [b'{"i": 0}\n{"i": 1}\n'] and fifo.is_fifo()


def test_export_prompts_that_keep_nothing_write_nothing_and_export_says_where_limit_cut(tmp_path, capsys,
                                                                                         monkeypatch):
    """export-prompts keeping no conversation (--max-turn-chars under every first turn) wrote an empty file over an
    earlier one and exited 0: it exits 1 and leaves the file, as regenerate does. export --max-chars 0 was silently no
    limit: refused in one line. export stopping at --limit (6000 by default) did not say the sources held more."""
    from spd_ds.commands import prepare_train_data

    data = make_chats(tmp_path / "chats.jsonl", 3)
    out = tmp_path / "p.jsonl"
    out.write_text("earlier")
    assert prepare_train_data.main(["export-prompts", "--data", str(data), "--max-turn-chars", "1",
                                    "--out", str(out)]) == 1
    assert out.read_text() == "earlier"
    assert f"kept 0 of 3 conversations (each first turn is longer than --max-turn-chars 1); {out} not written" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        prepare_train_data.main(["export", "--data", str(data), "--max-chars", "0", "--out", str(out)])
    assert e.value.code == 2 and "argument --max-chars: must be >= 1, got 0" in capsys.readouterr().err
    assert out.read_text() == "earlier"
    for limit, cut in (("2", True), ("3", False)):
        assert prepare_train_data.main(["export", "--data", str(data), "--limit", limit, "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert f"{limit} conversations -> {out}" in err and len(out.read_text().splitlines()) == int(limit)
        assert ("; stopped at --limit 2, the sources hold more (raise --limit to keep them)" in err) == cut, err
    monkeypatch.setattr(prepare_train_data, "_EXPORT_LIMIT", 2)  # the default limit (6000) on 3 conversations
    assert prepare_train_data.main(["export", "--data", str(data), "--out", str(out)]) == 0
    assert "stopped at --limit 2 (the default), the sources hold more" in capsys.readouterr().err


def test_json_reading_edges_of_cut_and_damaged_files(tmp_path):
    """A file cut just after a ']' inside a record is still a cut (read to it); a gzip file cut short is a one-line
    error; a plain-text 'template' too long for a file name is refused in one line."""
    from spd_ds.train.chat import ChatTemplateError, set_chat_template

    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i} x[0]"}, {"from": "gpt", "value": "a"}]}
            for i in range(3)]
    text = json.dumps(recs)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('x[0]', text.index('"q2')) + 4])  # ends with ']' inside the third record
    assert [r["id"] for r in iter_json_records(cut)] == ["0", "1"]
    gz = tmp_path / "short.jsonl.gz"
    gz.write_bytes(gzip.compress(("\n".join(json.dumps(r) for r in recs) + "\n").encode())[:-12])
    with pytest.raises(DataError, match="short.jsonl.gz is a damaged gzip file"):
        list(iter_json_records(gz))
    with pytest.raises(ChatTemplateError, match="neither a file nor Jinja text"):
        set_chat_template(make_tokenizer(), "You are a helpful assistant. " * 20)


def test_regenerate_refuses_a_model_with_missing_weights(tmp_path, capsys):
    """Answers from a model whose checkpoint lacks a weight would be another model's (transformers initialises it at
    random): regenerate refuses it in one line, exit status 2, as every other command does."""
    import shutil

    from safetensors.torch import load_file, save_file

    from spd_ds.commands import prepare_train_data

    model = make_chat_model(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    data = make_chats(tmp_path / "chats.jsonl", 4)
    out = tmp_path / "r.jsonl.gz"
    capsys.readouterr()
    assert prepare_train_data.main(["regenerate", "--model", str(bad), "--data", str(data), "--max-new-tokens", "2",
                                    "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "model.layers.3.mlp.down_proj.weight" in err and "different models" in err
    assert not out.exists()


_WORKER_SCRIPT = """
import multiprocessing, time
from tests.test_train_data import _tokenized
from spd_ds.train.batching import BatchPlanner, batches_on_device
batches = batches_on_device(BatchPlanner(_tokenized(), 128, 2), 0, 0, prefetch=2)
next(batches)
print(*[c.pid for c in multiprocessing.active_children()], flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_prefetch_worker_dies_with_its_training_process():
    """A rank killed by the launcher takes its DataLoader worker with it at once (prctl PR_SET_PDEATHSIG), not after
    PyTorch's 5-s watchdog."""
    import signal
    import subprocess
    import sys
    import time

    root = str(Path(__file__).resolve().parents[1])  # python -c puts the working directory first on sys.path
    proc = subprocess.Popen([sys.executable, "-c", _WORKER_SCRIPT], stdout=subprocess.PIPE,
                            text=True, cwd=root)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 1 and _alive(workers[0])
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 1.5
        while _alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(workers[0]), "the prefetch worker outlived its training process"
    finally:
        proc.kill()


def test_missing_sources_are_refused_before_loading(tmp_path):
    """train checks data.train_files before its process group and model: a missing path or no source at all."""
    (tmp_path / "a.jsonl").write_text("")
    check_sources([str(tmp_path / "a.jsonl"), str(tmp_path), "sharegpt", "org/dataset:train"])  # loading judges these
    with pytest.raises(DataError, match=r"^data source '.*nope.jsonl' not found \(a file, a directory"):
        check_sources([str(tmp_path / "a.jsonl"), str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match="^data.train_files is empty"):
        check_sources([])
    for missing in ("runs/train_data/x.jsonl", "a/b/c", "org/name.json.gz:train"):  # paths, not hub ids
        with pytest.raises(DataError, match=f"^data source '{missing}' not found"):
            check_sources([missing])
    with pytest.raises(DataError, match="^data.train_files holds an empty entry"):  # Path('') is the working dir
        check_sources([str(tmp_path / "a.jsonl"), ""])


def test_regenerated_answers_of_another_world_size_are_not_reused(tmp_path, monkeypatch):
    """data.regenerate keeps each rank's answers in the run directory for a rerun. A rerun after a crash before the
    first checkpoint with another world size used to read the old run's part-000 alone (records 0::2 of 2 ranks):
    half the data, silently. Now the parts live in a folder keyed by the world size, settings and records."""
    from types import SimpleNamespace

    import deepspeed.comm

    import spd_ds.train.regenerate as regen
    from spd_ds.config import load_config
    from spd_ds.train.loop import _regenerate_shared

    calls = []

    def fake_regenerate(records, model_dir, tokenizer, **kw):
        calls.append(len(records))
        return [{"input_ids": [1, 2, 3], "assistant_mask": [0, 1, 1], "conv_id": r["id"]} for r in records]

    class Crash(Exception):
        pass

    def crash(*a, **k):
        raise Crash

    monkeypatch.setattr(regen, "regenerate_records", fake_regenerate)
    monkeypatch.setattr(deepspeed.comm, "barrier", crash)
    cfg = load_config(None, ["data.regenerate=true"])
    arch = SimpleNamespace(model_dir=tmp_path, fingerprint=lambda: "sha:target")
    tok = SimpleNamespace(chat_template="{{ messages }}")
    records = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]

    def run(rank, world, recs=records):
        return _regenerate_shared(cfg, recs, tok, arch, tmp_path / "run", rank, world, "cpu", [2])

    for rank in (0, 1):  # two ranks: each answers its half, then the run crashes
        with pytest.raises(Crash):
            run(rank, 2)
    assert calls == [2, 2]
    monkeypatch.setattr(deepspeed.comm, "barrier", lambda *a, **k: None)
    assert sorted(r["conv_id"] for r in run(0, 1)) == ["c0", "c1", "c2", "c3"] and calls == [2, 2, 4]  # one rank
    assert len(run(0, 1)) == 4 and calls == [2, 2, 4]  # the same inputs again: read, not answered again
    assert sorted(r["conv_id"] for r in run(0, 1, records[:3])) == ["c0", "c1", "c2"] and calls[-1] == 3
