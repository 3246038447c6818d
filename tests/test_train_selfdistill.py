"""spd_ds.train.selfdistill: rounds of the target's own answers, keyed sampling, shards, resume, held-out split.

The target is a tiny random llama over the character tokenizer of ``test_train_data`` whose EOS (``<|im_end|>``)
logit copies, slightly enlarged, that of a common character: its answers end after a few to ~60 tokens, greedy and
sampled, so multi-turn chains exist. One test runs the real SmolLM2-135M-Instruct (a few short answers).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from spd_ds.train import selfdistill as sd
from spd_ds.train.chat import encode_conversation, prompt_ids
from spd_ds.train.batching import BatchPlanner
from spd_ds.train.data import load_records, tokenize_records
from spd_ds.train.selfdistill.generation import _signed64
from spd_ds.train.selfdistill.prompts import _encode_texts, _render
from spd_ds.train.split import conversation_key, split_held_out
from tests.test_train_data import WORDS, make_chat_model, make_chats, make_tokenizer
from tests.tiny_models import make_tiny_model

EOS = 2
CFG = dict(greedy=1, samples=2, max_new_tokens=40, chunk_new_tokens=16, batch_size=16, min_alive=0.25,
           max_prompt_tokens=400, wave_conversations=8)


@pytest.fixture(scope="module")
def ending_model(tmp_path_factory) -> Path:
    """Tiny untied llama (vocab = the 99 ids of the character tokenizer) whose EOS row of the LM head is 1.05 x the
    row of character 17: answers end where the model would write that character."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sd_models")
    base = make_tiny_model(root, "llama", num_layers=2, vocab_size=99, eos_token_id=EOS, bos_token_id=1,
                           tie_word_embeddings=False)
    out = root / "ending"
    m = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        m.lm_head.weight[EOS] = m.lm_head.weight[17] * 1.05
    m.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def loaded(ending_model):
    """The target as run_selfdistill loads it (gqa-decode attention) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ending_model, attn_implementation=sd.register_gqa_decode_attention())
    return model.eval(), AutoTokenizer.from_pretrained(ending_model)


@pytest.fixture(scope="module")
def plain_target(ending_model):
    """The same target with transformers' own SDPA: the reference for "its own greedy decoding"."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ending_model, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def chats_file(tmp_path_factory) -> Path:
    return make_chats(tmp_path_factory.mktemp("sd_chats") / "chats.jsonl", 24, seed=1)


@pytest.fixture(scope="module")
def convs(chats_file):
    return sd.load_prompt_conversations([str(chats_file)])


def _run(loaded, ending_model, convs, out, **kw):
    model, tok = loaded
    cfg = sd.SelfDistillConfig(**{**CFG, **kw})
    return sd.run_selfdistill(convs, ending_model, tok, out, cfg, model=model, log=lambda s: None)


@pytest.fixture(scope="module")
def reference_run(loaded, ending_model, convs, tmp_path_factory):
    out = tmp_path_factory.mktemp("sd_ref") / "sd"
    run = _run(loaded, ending_model, convs, out)
    return out, run, list(sd.iter_records(out))


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """The target's own greedy decoding of one prompt (no padding, no batch), up to and including EOS."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
                         pad_token_id=EOS)[0, len(ids):].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


# ---------------------------------------------------------------------------------------------------- prompts
def test_conversation_rounds_and_prompt_file(tmp_path):
    rec = {"id": "a_1", "conversations": [
        {"from": "gpt", "value": "leading answer"}, {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2a"},
        {"from": "human", "value": "Q2b"}, {"from": "gpt", "value": "A2"}, {"from": "human", "value": "Q3"}]}
    c = sd.conversation_rounds(rec)
    assert c.uid == "a_1"
    assert c.rounds == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"}],
                        [{"role": "user", "content": "Q2a"}, {"role": "user", "content": "Q2b"}],
                        [{"role": "user", "content": "Q3"}]]
    assert sd.conversation_rounds({"messages": [{"role": "assistant", "content": "x"}]}) is None
    anon = sd.conversation_rounds({"messages": [{"role": "user", "content": "hi"}]})
    assert anon.uid.startswith("h") and anon.uid == sd.conversation_rounds({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "other"}]}).uid
    p = tmp_path / "prompts.jsonl.gz"
    assert sd.write_prompts([c, anon], p) == 2
    back = sd.load_prompt_conversations([str(p)])
    assert [(x.uid, x.rounds) for x in back] == [(c.uid, c.rounds), (anon.uid, anon.rounds)]


# ---------------------------------------------------------------------------------------------------- sampling
def _keyed_uniform_py(key: int, pos: int) -> float:
    def mix(x):
        x ^= x >> 16
        x = (x * 0x45D9F3B) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x45D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    lo, hi = key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF
    return (mix(mix(mix(pos) ^ lo) ^ hi) + 0.5) / 2 ** 32


def test_keyed_uniform_matches_plain_integer_hash():
    keys = [sd.item_key(0, "conv", v, r) for v in range(3) for r in (1, 2)] + [0, 2 ** 64 - 1, 2 ** 63]
    pos = [0, 1, 767, 2 ** 31 + 5] * 3
    got = sd.keyed_uniform(torch.tensor([_signed64(k) for k in keys]), torch.tensor(pos[: len(keys)]))
    want = [_keyed_uniform_py(k, p) for k, p in zip(keys, pos)]
    assert got.tolist() == want
    assert all(0 < u < 1 for u in want)


def test_keyed_sampler_draws_the_tempered_distribution_and_ignores_the_batch():
    torch.manual_seed(0)
    V, N, T = 6, 6000, 0.7
    logits = torch.randn(V) * 2
    keys = torch.tensor([_signed64(sd.item_key(1, f"c{i}", 1, 1)) for i in range(N)])
    scores = logits.expand(N, V).clone()
    ids = torch.zeros(N, 5, dtype=torch.long)
    temps = torch.full((N,), T)
    out = sd.KeyedSampler(keys, temps, torch.zeros(N, dtype=torch.long), 5)(ids, scores)
    tok = out.argmax(-1)
    assert bool((out.max(-1).values == 0).all()) and bool(torch.isinf(out).sum(-1).eq(V - 1).all())
    freq = torch.bincount(tok, minlength=V).double() / N
    p = torch.softmax(logits.double() / T, -1)
    assert torch.allclose(freq, p, atol=4 * (p * (1 - p) / N).sqrt().max().item() + 1e-3)
    # the same row alone, or later in another batch, draws the same token; a greedy row passes unchanged
    sub = slice(100, 103)
    again = sd.KeyedSampler(keys[sub], temps[sub], torch.zeros(3, dtype=torch.long), 5)(ids[sub], scores[sub])
    assert again.argmax(-1).tolist() == tok[sub].tolist()
    mixed = sd.KeyedSampler(keys[:2], torch.tensor([0.0, T]), torch.zeros(2, dtype=torch.long), 5)(ids[:2],
                                                                                                   scores[:2])
    assert torch.equal(mixed[0], scores[0]) and mixed[1].argmax().item() == tok[1].item()
    # a continuation (start position 3, 2 tokens already in this call) draws what position 5 draws
    a = sd.KeyedSampler(keys[:4], temps[:4], torch.full((4,), 3), 5)(torch.zeros(4, 7, dtype=torch.long), scores[:4])
    b = sd.KeyedSampler(keys[:4], temps[:4], torch.full((4,), 5), 9)(torch.zeros(4, 9, dtype=torch.long), scores[:4])
    assert torch.equal(a, b)


def test_stop_when_few_alive():
    eos = torch.tensor([EOS])
    crit = sd.StopWhenFewAlive(eos, torch.tensor([3, 3, 3, 1]), prompt_width=4, min_alive=0.25)
    ids = torch.zeros(4, 5, dtype=torch.long)
    ids[0, -1] = EOS
    assert crit(ids).tolist() == [True, False, False, True]  # row 0 ended, row 3 spent its budget of 1
    ids2 = torch.cat([ids, torch.tensor([[0], [EOS], [5], [0]])], 1)
    assert crit(ids2).tolist() == [True, True, True, True]  # one of four alive <= 25 %: the call stops
    never = sd.StopWhenFewAlive(eos, torch.tensor([9, 9]), 4, 0.0)
    assert never(torch.zeros(2, 6, dtype=torch.long)).tolist() == [False, False]


def test_gqa_decode_attention_equals_sdpa(tiny_root):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    mod = torch.nn.Module()
    mod.num_key_value_groups = 3
    q, k, v = torch.randn(4, 6, 1, 8), torch.randn(4, 2, 10, 8), torch.randn(4, 2, 10, 8)
    mask = torch.rand(4, 1, 1, 10) > 0.3
    mask[:, :, :, 0] = True
    for m in (mask, None, torch.where(mask, 0.0, float("-inf"))):
        got, _ = sd.gqa_decode_attention(mod, q, k, v, m, scaling=0.3)
        want, _ = sdpa_attention_forward(mod, q, k, v, m, scaling=0.3)
        assert got.shape == want.shape == (4, 1, 6, 8) and torch.allclose(got, want, atol=1e-6)
    # a whole left-padded, static-cache generate: same logits, same tokens
    d = make_tiny_model(tiny_root, "llama", num_layers=2)
    name = sd.register_gqa_decode_attention()
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    att = (ids > 0).long()
    outs = []
    for attn in ("sdpa", name):
        model = AutoModelForCausalLM.from_pretrained(d, attn_implementation=attn).eval()
        assert model.config._attn_implementation == attn
        outs.append(model.generate(input_ids=ids, attention_mask=att, max_new_tokens=6, do_sample=False,
                                   cache_implementation="static", pad_token_id=0, eos_token_id=None,
                                   return_dict_in_generate=True, output_logits=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(outs[0].logits, outs[1].logits))


# ---------------------------------------------------------------------------------------------------- generation
def test_round_one_prompt_tokens_equal_the_chat_template(loaded, convs):
    _, tok = loaded
    texts = [_render(tok, c.rounds[0], True) for c in convs]
    for c, ids in zip(convs, _encode_texts(tok, texts)):
        assert ids.tolist() == prompt_ids(tok, c.rounds[0])


def test_greedy_answers_equal_the_targets_own_greedy_decoding(plain_target, reference_run):
    model = plain_target
    out, _, recs = reference_run
    items = {it.key: it for f in sd.shard_files(out) for it in sd.read_items(f)}
    greedy = [it for it in items.values() if it.variant == 0]
    assert len(greedy) >= 24 and any(it.round == 2 for it in greedy)
    for it in greedy:
        prev = [items[(it.uid, 0, r)] for r in range(1, it.round)]
        prompt = np.concatenate([p.tokens for p in prev] + [it.tokens[: it.prompt_len]]).tolist()
        answer = it.tokens[it.prompt_len:].tolist()
        assert answer == _greedy(model, prompt, CFG["max_new_tokens"]), it.key
        assert (answer[-1] == EOS) == (it.finish == sd.FINISH_EOS)
        assert it.finish == sd.FINISH_EOS or len(answer) == CFG["max_new_tokens"]


def test_multi_turn_prompts_hold_the_targets_own_earlier_answers(loaded, reference_run, convs, chats_file):
    _, tok = loaded
    originals = {}
    for line in chats_file.read_text().splitlines():
        c = sd.conversation_rounds(json.loads(line))
        originals[c.uid] = json.loads(line)["messages"][1]["content"]
    out, run, recs = reference_run
    by_uid = {c.uid: c for c in convs}
    multi = [r for r in recs if r["rounds"] == 2]
    assert {r["variant"] for r in multi} >= {0, 1}, "expected 2-turn chains for greedy and sampled variants"
    items = {it.key: it for f in sd.shard_files(out) for it in sd.read_items(f)}
    for r in multi:
        c = by_uid[r["conv_id"]]
        first, second = items[(c.uid, r["variant"], 1)], items[(c.uid, r["variant"], 2)]
        ans1 = first.tokens[first.prompt_len:].tolist()
        # token level: turn 2's prompt = turn 1's prompt + the target's answer (with its EOS) + the template's glue
        assert r["input_ids"][: len(first.tokens)] == first.tokens.tolist()
        assert ans1[-1] == EOS
        ctx = first.tokens.tolist() + second.tokens[: second.prompt_len].tolist()
        # text level: that prompt is the chat template of [turn 1, the target's answer, turn 2]
        hist = c.rounds[0] + [{"role": "assistant", "content": tok.decode(ans1[:-1])}] + c.rounds[1]
        assert tok.decode(ctx) == _render(tok, hist, True)
        # ... and not the source's own answer to turn 1
        assert originals[c.uid] not in tok.decode(ctx)
    assert run["by_round"]["2"]["answers"] == len([k for k in items if k[2] == 2])


def test_assistant_mask_is_exactly_the_generated_tokens(loaded, reference_run, convs):
    _, tok = loaded
    out, _, recs = reference_run
    items = {it.key: it for f in sd.shard_files(out) for it in sd.read_items(f)}
    by_uid = {c.uid: c for c in convs}
    checked = 0
    for r in recs:
        chain = [items[(r["conv_id"], r["variant"], k)] for k in range(1, r["rounds"] + 1)]
        want = []
        for it in chain:
            want += [0] * it.prompt_len + [1] * (len(it.tokens) - it.prompt_len)
        assert r["assistant_mask"] == want
        # the same convention as chat.encode_conversation (answer text + end-of-turn token), where the answers
        # ended with EOS and the text re-tokenises to the same ids (the test tokenizer maps "\n\n" to <unk>)
        text = tok.decode(r["input_ids"])
        if chain[-1].finish == sd.FINISH_EOS and tok(text, add_special_tokens=False)["input_ids"] == r["input_ids"]:
            msgs = []
            for k, it in enumerate(chain):
                msgs += by_uid[r["conv_id"]].rounds[k]
                msgs.append({"role": "assistant", "content": tok.decode(it.tokens[it.prompt_len:-1].tolist())})
            enc = encode_conversation(tok, msgs)
            n = len(r["input_ids"])
            assert enc.input_ids[:n] == r["input_ids"] and enc.assistant_mask[:n] == r["assistant_mask"]
            assert tok.decode(enc.input_ids[n:]).strip() == "" and not any(enc.assistant_mask[n:])
            checked += 1
    assert checked >= 5


def test_same_answers_whatever_the_batching(loaded, ending_model, convs, reference_run, tmp_path):
    _, _, recs = reference_run
    run = _run(loaded, ending_model, convs, tmp_path / "b", batch_size=5, chunk_new_tokens=7, min_alive=0.0,
               wave_conversations=3, cache="dynamic")
    assert list(sd.iter_records(tmp_path / "b")) == recs
    assert run["calls"] > 0 and run["generated_tokens"] == sum(sum(r["assistant_mask"]) for r in recs)


def test_out_of_memory_splits_the_call_and_keeps_the_answers(loaded, ending_model, convs, reference_run, tmp_path,
                                                            monkeypatch):
    """A call over 3 rows raises torch.OutOfMemoryError (as a crowded GPU would): it is run again as smaller calls,
    later calls stay under the lowered token cap, and the stored answers are those of the unconstrained run (CPU,
    fp32: no near-ties between batch shapes here)."""
    model, _ = loaded
    _, _, recs = reference_run
    real_generate = model.generate
    sizes = []

    def generate(*a, input_ids, **kw):
        sizes.append(input_ids.shape[0])
        if input_ids.shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_generate(*a, input_ids=input_ids, **kw)

    monkeypatch.setattr(model, "generate", generate)
    logs = []
    cfg = sd.SelfDistillConfig(**{**CFG, "cache": "dynamic"})
    run = sd.run_selfdistill(convs, ending_model, loaded[1], tmp_path / "oom", cfg, model=model, log=logs.append)
    assert list(sd.iter_records(tmp_path / "oom")) == recs
    failed = [n for n in sizes if n > 3]
    assert sizes[:4] == [16, 8, 4, 2]  # halved until it fits
    assert run["oom_splits"] == len(failed) == 3 and run["calls"] == len(sizes) - len(failed)
    assert max(sizes[4:]) <= 3  # later calls stay under the cap: no more failures
    first = run["call_stats"][0]  # the first call that fit: 2 rows at the failed calls' cache length
    assert first.rows == 2 and run["token_cap"] == 2 * first.cache_len < cfg.max_batch_tokens
    assert sum("out of device memory" in line for line in logs) == 1
    manifest_run = json.loads((tmp_path / "oom" / "manifest.json").read_text())["runs"][-1]
    assert (manifest_run["oom_splits"], manifest_run["token_cap"]) == (3, run["token_cap"])

    def no_room(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(model, "generate", no_room)
    with pytest.raises(torch.OutOfMemoryError):  # one row that does not fit is not split forever
        _run(loaded, ending_model, convs[:1], tmp_path / "none", cache="dynamic")


# ---------------------------------------------------------------------------------------------------- storage
def test_shard_round_trip_exact(tmp_path):
    rng = np.random.default_rng(0)
    items = [sd.Item(f"c{i}", i % 3, 1 + i % 2, rng.integers(0, 65535, size=int(rng.integers(1, 50))), 0, i % 2)
             for i in range(20)]
    for it in items:
        it.prompt_len = int(rng.integers(0, len(it.tokens)))
    stats = sd.write_shard(tmp_path / "shard-r01-00001.npz", items, sd.id_dtype_for(65535))
    assert stats["items"] == 20 and stats["tokens"] == sum(len(i.tokens) for i in items)
    back = list(sd.read_items(tmp_path / "shard-r01-00001.npz"))
    for a, b in zip(items, back):
        fields = ("uid", "variant", "round", "prompt_len", "finish")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert np.array_equal(a.tokens, b.tokens)
    with np.load(tmp_path / "shard-r01-00001.npz") as z:
        assert z["ids"].dtype == np.uint16
    big = [sd.Item("x", 0, 1, np.array([5, 70000, 151000]), 1, 0)]
    assert sd.id_dtype_for(151_936) == np.int32
    sd.write_shard(tmp_path / "shard-r01-00002.npz", big, sd.id_dtype_for(151_936))
    assert next(sd.read_items(tmp_path / "shard-r01-00002.npz")).tokens.tolist() == [5, 70000, 151000]
    with pytest.raises(sd.SelfDistillError, match="does not fit"):
        sd.write_shard(tmp_path / "shard-r01-00003.npz", big, sd.id_dtype_for(65535))
    np.savez(tmp_path / "other.npz", a=np.zeros(2))
    with pytest.raises(sd.SelfDistillError, match="not a spd-ds/selfdistill"):
        sd.read_shard(tmp_path / "other.npz")


def test_shards_and_manifest_are_whole_or_not_there(tmp_path, monkeypatch):
    """Shards and manifest.json go through spd_ds.files.replaced_when_done: an interrupted write (Ctrl-C while a shard
    is compressed, a full disk while the manifest is written) left its temporary file ('shard-...npz.tmp',
    'manifest.json.tmp') in the output directory; now nothing is left and the earlier files stay as they were. A
    manifest made private (0600) stays private when it is rewritten (it became 0644). A shard is still an .npz of its
    own name (np.savez_compressed gets a file object: given the temporary name it would have appended '.npz')."""
    import pathlib

    from spd_ds.train.selfdistill.storage import _Store

    out = tmp_path / "sd"
    store = _Store(out, {"format": "x"}, np.dtype(np.uint16), sd.SelfDistillConfig(), log=lambda msg: None)
    store.add(sd.Item("c0", 0, 1, np.arange(5), 2, 0))
    store.flush()
    assert sorted(f.name for f in out.iterdir()) == ["manifest.json", "shard-r01-00001.npz"]
    (out / "manifest.json").chmod(0o600)
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    store.add(sd.Item("c1", 0, 1, np.arange(7), 3, 0))
    with monkeypatch.context() as m:
        m.setattr(np, "savez_compressed", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store.flush()
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before

    real_write_text = pathlib.Path.write_text

    def disk_full(self, text, *a, **kw):
        real_write_text(self, text[:10], *a, **kw)
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_text", disk_full)
        with pytest.raises(OSError, match="No space"):
            store.write_manifest()
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    store.flush()
    assert len(sd.shard_files(out)) == 2 and not [f.name for f in out.iterdir() if ".tmp" in f.name]
    assert (out / "manifest.json").stat().st_mode & 0o777 == 0o600
    assert json.loads((out / "manifest.json").read_text())["counts"]["items"] == 2
    assert [it.uid for f in sd.shard_files(out) for it in sd.read_items(f)] == ["c0", "c1"]


def test_manifest_and_data_files_accept_the_directory(loaded, reference_run):
    _, tok = loaded
    out, run, recs = reference_run
    man = json.loads((out / sd.MANIFEST).read_text())
    assert man["format"] == sd.FORMAT and man["id_dtype"] == "uint16" and man["eos_token_ids"] == [EOS]
    assert man["sampling"] == {"greedy": 1, "temperature": 1.0, "seed": 0, "max_new_tokens": 40}
    c = man["counts"]
    assert c["records"] == len(recs) == 24 * 3
    assert c["assistant_tokens"] == sum(sum(r["assistant_mask"]) for r in recs)
    assert c["tokens"] == c["record_tokens"] == sum(len(r["input_ids"]) for r in recs)
    assert man["runs"][-1]["generated_tokens"] == run["generated_tokens"] > 0
    assert sum(s["bytes"] for s in man["shards"]) == sum(f.stat().st_size for f in sd.shard_files(out))
    got = load_records([str(out)])
    assert len(got) == len(recs) and all("conv_id" in r for r in got)
    assert [r["input_ids"] for r in got] == [r["input_ids"] for r in recs]
    data = tokenize_records(got, tok, 512)
    assert len(data) == len(recs)
    planner = BatchPlanner(data, 256, 2)
    batch = planner.collate(planner.plan(0).micro_batches[0])
    assert batch["valid"].any()
    assert len(load_records([str(sd.shard_files(out)[0])])) > 0  # one shard works too


def test_data_folder_reads_its_self_distillation_sub_folder(reference_run, chats_file, tmp_path, caplog):
    out, _, recs = reference_run
    folder = tmp_path / "data"
    shutil.copytree(out, folder / "selfdistill")
    shutil.copy(chats_file, folder / "chats.jsonl")
    got = load_records([str(folder)])
    chats = load_records([str(chats_file)])
    # name order: chats.jsonl, then the sub-folder's records (its manifest.json is not read as chats)
    assert len(got) == len(chats) + len(recs)
    assert got[:len(chats)] == chats
    assert [r["input_ids"] for r in got[len(chats):]] == [r["input_ids"] for r in recs]
    # a self-distillation folder without shards yet is skipped; another folder's manifest.json does not hide its data
    (folder / "later").mkdir()
    shutil.copy(out / sd.MANIFEST, folder / "later" / sd.MANIFEST)
    (folder / "other").mkdir()
    (folder / "other" / "manifest.json").write_text('{"files": ["train.jsonl"]}\n')
    shutil.copy(chats_file, folder / "other" / "train.jsonl")
    got = load_records([str(folder)])
    assert len(got) == 2 * len(chats) + len(recs)
    # linked sub-folders are read (a self-distillation one too), each real folder once: a link back up is not a loop
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "data").symlink_to(folder, target_is_directory=True)
    (folder / "up").symlink_to(linked, target_is_directory=True)
    assert len(load_records([str(linked)])) == len(got)
    (folder / "up").unlink()
    (folder / "again.jsonl").symlink_to(folder / "chats.jsonl")  # a linked file is the same data: read once
    assert len(load_records([str(folder)])) == len(got)
    (folder / "again.jsonl").unlink()
    # data files put inside a self-distillation directory itself are not read: said, not silent
    shutil.copy(chats_file, folder / "selfdistill" / "extra.jsonl")
    with caplog.at_level(logging.WARNING, logger="spd_ds.train.data"):
        assert len(load_records([str(folder / "selfdistill")])) == len(recs)
    assert "1 data file(s) in it are not read (extra.jsonl)" in caplog.text


def test_self_distilled_data_of_another_model_is_refused(ending_model, reference_run, tmp_path, capsys):
    """Shards hold the answering model's token ids: training or a draft vocabulary on them for another target is
    refused in one line (it trained silently on the wrong ids, or failed with an IndexError)."""
    from spd_ds.commands.build_draft_vocab import main as build_draft_vocab
    from spd_ds.train.data import DataError, check_selfdistill_target

    out, _, _ = reference_run
    mine = sd.model_fingerprint(ending_model)
    folder = tmp_path / "data"
    shutil.copytree(out, folder / "sd")
    for src in (out, folder):  # the directory itself, or a data folder that holds it
        check_selfdistill_target([str(src)], mine, "the target")
        with pytest.raises(DataError, match=r"holds answers of .* not of the target other \(0123\): its token ids"):
            check_selfdistill_target([str(src)], "0123", "other")
    check_selfdistill_target(["sharegpt", str(tmp_path / "none.jsonl")], "0123", "other")  # nothing to compare
    other = make_chat_model(tmp_path, num_layers=2)  # another model with a tokenizer
    assert build_draft_vocab(["--model", str(other), "--data", str(out), "--size", "8",
                              "--out", str(tmp_path / "dv.json")]) == 2
    assert "holds answers of" in capsys.readouterr().err and not (tmp_path / "dv.json").exists()


def test_time_budget_and_resume(loaded, ending_model, convs, reference_run, tmp_path, monkeypatch):
    _, _, recs = reference_run
    # a spent budget starts no call and writes an empty manifest
    run = _run(loaded, ending_model, convs, tmp_path / "none", time_budget_s=0.0)
    assert run["stopped_by_time_budget"] and run["calls"] == 0 and not sd.shard_files(tmp_path / "none")
    # killed after a few calls (as by `timeout`): finished answers are kept, small shards flushed on the way
    out = tmp_path / "r"
    real_step, calls = sd.AnswerGenerator.step, {"n": 0}

    def dying_step(self, rows):
        calls["n"] += 1
        if calls["n"] > 6:
            raise KeyboardInterrupt
        return real_step(self, rows)

    monkeypatch.setattr(sd.AnswerGenerator, "step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        _run(loaded, ending_model, convs, out, shard_bytes=400)
    monkeypatch.setattr(sd.AnswerGenerator, "step", real_step)
    first = sd.shard_files(out)
    kept = sum(1 for f in first for _ in sd.read_items(f))
    assert len(first) >= 2 and 0 < kept < 24 * 3
    assert json.loads((out / sd.MANIFEST).read_text())["counts"]["items"] == kept
    # the rerun skips what is there and ends with the uninterrupted run's records
    run2 = _run(loaded, ending_model, convs, out)
    assert run2["resumed_answers"] == kept and run2["answers"] == sum(
        sum(1 for _ in sd.read_items(f)) for f in sd.shard_files(out)) - kept
    assert list(sd.iter_records(out)) == recs
    assert all(f in sd.shard_files(out) for f in first)
    man = json.loads((out / sd.MANIFEST).read_text())
    assert len(man["runs"]) == 2
    # other content settings refuse to mix into the same directory
    with pytest.raises(sd.SelfDistillError, match="another sampling"):
        _run(loaded, ending_model, convs, out, temperature=0.5)
    model, tok = loaded  # another chat template would render the prompts otherwise: refused too
    template = tok.chat_template
    try:
        tok.chat_template = template + "{# another #}"
        with pytest.raises(sd.SelfDistillError, match="another chat_template"):
            _run(loaded, ending_model, convs, out)
    finally:
        tok.chat_template = template
    # a finished directory: nothing to do
    assert _run(loaded, ending_model, convs, out)["answers"] == 0


def test_config_errors():
    with pytest.raises(sd.SelfDistillError, match="--greedy"):
        sd.SelfDistillConfig(greedy=2)
    with pytest.raises(sd.SelfDistillError, match="at least one answer"):
        sd.SelfDistillConfig(greedy=0, samples=0)
    with pytest.raises(sd.SelfDistillError, match="--shard-bytes"):
        sd.SelfDistillConfig(shard_bytes=20_000_000)


# ---------------------------------------------------------------------------------------------------- held-out split
def test_split_held_out_deterministic_disjoint_and_grouped():
    rng = random.Random(0)
    recs = []
    for i in range(3000):
        for v in range(2):
            recs.append({"input_ids": [1, 2, 3], "assistant_mask": [0, 1, 1], "conv_id": f"C{i}_{v % 2}"})
    recs += [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(6))},
                           {"role": "assistant", "content": "x"}]} for _ in range(200)]
    recs += [{"input_ids": [9, i, 7, 8], "assistant_mask": [0, 0, 1, 1]} for i in range(200)]
    train, held = split_held_out(recs, 0.1, seed=3)
    assert len(train) + len(held) == len(recs)
    assert not {id(r) for r in train} & {id(r) for r in held}
    assert 0.07 < len(held) / len(recs) < 0.13
    shuffled = recs[:]
    rng.shuffle(shuffled)
    t2, h2 = split_held_out(shuffled, 0.1, seed=3)
    assert {id(r) for r in h2} == {id(r) for r in held}
    # the parts _0/_1 of a ShareGPT conversation (and its variants) stay on one side
    side = {}
    for r in held:
        if "conv_id" in r:
            side[r["conv_id"].rsplit("_", 1)[0]] = "held"
    assert all(r["conv_id"].rsplit("_", 1)[0] not in side for r in train if "conv_id" in r)
    assert {id(r) for r in split_held_out(recs, 0.1, seed=4)[1]} != {id(r) for r in held}
    assert split_held_out(recs, 0.0)[1] == []
    with pytest.raises(ValueError, match="held_out_fraction"):
        split_held_out(recs, 1.0)
    # no conversation id and no first prompt: the whole record is the key (such records are not lumped together)
    bare = [{"input_ids": [i, 5], "assistant_mask": [1, 1]} for i in range(3)]
    assert len({conversation_key(r) for r in bare}) == 3


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_export_prompts_and_selfdistill(ending_model, tmp_path, capsys):
    from spd_ds.commands.prepare_train_data import main

    chats = make_chats(tmp_path / "c.jsonl", 6, seed=2)
    prompts = tmp_path / "p.jsonl.gz"
    assert main(["export-prompts", "--data", str(chats), "--out", str(prompts)]) == 0
    assert "6 conversations" in capsys.readouterr().err
    plain = tmp_path / "p.jsonl"  # plain JSON lines under a name without .gz, read back the same
    assert main(["export-prompts", "--data", str(chats), "--out", str(plain)]) == 0 and plain.read_text()[0] == "{"
    assert sd.load_prompt_conversations([str(plain)]) == sd.load_prompt_conversations([str(prompts)])
    out = tmp_path / "sd"
    rc = main(["selfdistill", "--model", str(ending_model), "--data", str(prompts), "--out", str(out),
               "--greedy", "1", "--samples", "1", "--max-new-tokens", "24", "--batch-size", "8",
               "--chunk-new-tokens", "8", "--max-prompt-tokens", "256",
               "--compile-cache", str(tmp_path / "cc" / "sd.bin")])  # no compile on CPU: nothing to save, no error
    err = capsys.readouterr().err
    assert rc == 0 and "generated tokens/s" in err and "records" in err
    man = json.loads((out / sd.MANIFEST).read_text())
    assert man["counts"]["records"] == 12 and man["variants"] == {"greedy": 1, "samples": 1}
    # every prompt over --max-prompt-tokens: nothing generated (exit 1), and the output says why
    rc = main(["selfdistill", "--model", str(ending_model), "--data", str(prompts), "--out", str(tmp_path / "sd2"),
               "--greedy", "1", "--samples", "0", "--max-new-tokens", "8", "--max-prompt-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and "answer chains stopped early: 6 prompt too long" in err and "--max-prompt-tokens 2" in err


# ---------------------------------------------------------------------------------------------------- SmolLM2
def test_smollm2_template_prompts_and_glue(smollm2_dir):
    """SmolLM2's ChatML (which adds a default system prompt): round-1 prompts batch-encode to apply_chat_template's
    ids, and the glue after an answer is the next user turn plus the generation prompt."""
    from spd_ds.builder import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    convs = [sd.conversation_rounds(r) for r in (
        {"id": "a", "messages": [{"role": "user", "content": "Write a haiku about rain."}]},
        {"id": "b", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"},
                                 {"role": "assistant", "content": "x"},
                                 {"role": "user", "content": "Explain  more.\n"}]})]
    enc = _encode_texts(tok, [_render(tok, c.rounds[0], True) for c in convs])
    assert [e.tolist() for e in enc] == [prompt_ids(tok, c.rounds[0]) for c in convs]
    hist = convs[1].rounds[0] + [{"role": "assistant", "content": "Because."}]
    glue = sd.turn_glue(tok, hist, convs[1].rounds[1], tok.decode([tok.eos_token_id]))
    assert glue == "\n<|im_start|>user\nExplain  more.\n<|im_end|>\n<|im_start|>assistant\n"
    assert sd.turn_glue(tok, hist, convs[1].rounds[1], "<|endoftext|>") is None  # not the template's end of turn


@pytest.mark.slow
def test_smollm2_two_turns(smollm2_dir, tmp_path):
    """The real target and template (default system prompt): turn 2 continues from its own greedy turn-1 answer, and
    equals its own greedy decoding of that prompt."""
    from transformers import AutoModelForCausalLM

    from spd_ds.builder import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    convs = [sd.conversation_rounds({"id": "s1", "messages": [
        {"role": "user", "content": "Say hello in one word."}, {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Now say goodbye in one word."}]})]
    cfg = sd.SelfDistillConfig(greedy=1, samples=0, max_new_tokens=40, chunk_new_tokens=16, batch_size=4)
    sd.run_selfdistill(convs, smollm2_dir, tok, tmp_path / "sd", cfg, model=model, log=lambda s: None)
    items = {it.key: it for f in sd.shard_files(tmp_path / "sd") for it in sd.read_items(f)}
    a1, a2 = items[("s1", 0, 1)], items[("s1", 0, 2)]
    ans1 = a1.tokens[a1.prompt_len:].tolist()
    assert ans1[-1] == tok.eos_token_id and a1.tokens[: a1.prompt_len].tolist() == prompt_ids(tok, convs[0].rounds[0])
    assert tok.decode(a2.tokens[: a2.prompt_len]).startswith("\n<|im_start|>user\nNow say goodbye")
    ctx = a1.tokens.tolist() + a2.tokens[: a2.prompt_len].tolist()
    eos = tok.eos_token_id

    def greedy(ids):
        g = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos)[0, len(ids):].tolist()
        return g[: g.index(eos) + 1] if eos in g else g

    assert ans1 == greedy(a1.tokens[: a1.prompt_len].tolist())
    assert a2.tokens[a2.prompt_len:].tolist() == greedy(ctx)
    shutil.rmtree(tmp_path / "sd")


def test_a_resume_with_more_samples_or_other_data_keeps_the_earlier_runs_in_the_manifest(tmp_path):
    """A resumed run with more --samples or another --data adds answers to the shards already there; manifest.json
    described only the latest run (its 'variants' and 'source'), so a directory holding variants 0-2 from two sources
    claimed one sample of one source. Now 'variants.samples' is the largest of the runs' and 'source' lists every
    run's sources, first seen first."""
    from spd_ds.train.selfdistill.storage import _Store

    out = tmp_path / "sd"
    quiet = dict(id_dtype=np.dtype(np.uint16), cfg=sd.SelfDistillConfig(), log=lambda msg: None)
    first = {"format": "x", "variants": {"greedy": 1, "samples": 2}, "source": ["a.jsonl"], "num_conversations": 5}
    store = _Store(out, first, **quiet)
    store.add(sd.Item("c0", 2, 1, np.arange(5), 2, 0))
    store.flush()
    second = {"format": "x", "variants": {"greedy": 1, "samples": 1}, "source": ["b.jsonl", "a.jsonl"],
              "num_conversations": 9}
    store = _Store(out, second, **quiet)
    store.add(sd.Item("c9", 1, 1, np.arange(4), 2, 0))
    store.flush()
    man = json.loads((out / "manifest.json").read_text())
    assert man["variants"] == {"greedy": 1, "samples": 2}
    assert man["source"] == ["a.jsonl", "b.jsonl"]
    assert {it.variant for f in sd.shard_files(out) for it in sd.read_items(f)} == {1, 2}
    third = dict(second, variants={"greedy": 1, "samples": 4}, source=["c.jsonl"])
    store = _Store(out, third, **quiet)
    store.write_manifest()
    man = json.loads((out / "manifest.json").read_text())
    assert man["variants"]["samples"] == 4 and man["source"] == ["a.jsonl", "b.jsonl", "c.jsonl"]
