"""Stop strings (``decoding.stop``): the matcher, and every decoder ending at the same token (SPD = AR, T = 0 and
T > 0, rollbacks in flight), on tiny random models with a synthetic detokenizer and on SmolLM2 with its tokenizer."""

import pytest
import torch

from spd_ds.config import ConfigError, load_config
from spd_ds.decoding.ar import ARDecoder
from spd_ds.decoding.ar_graph import ARGraphDecoder
from spd_ds.decoding.cycle import TokenOutput
from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.decoding.stopping import StopStrings
from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model

L = 6


def letters(ids):
    """A synthetic detokenizer for the tiny models: one letter per token id (so a stop string is a token n-gram)."""
    return "".join(chr(97 + int(i) % 26) for i in ids)


def first_hit(tokens, stop: StopStrings) -> int | None:
    """Brute force: the smallest k whose whole text ``decode(tokens[:k])`` contains a stop string."""
    for k in range(1, len(tokens) + 1):
        if any(s in stop.decode(list(tokens[:k])) for s in stop.strings):
            return k
    return None


@pytest.fixture(scope="module")
def tiny(tiny_root):
    return TargetArch(make_tiny_model(tiny_root, "llama", L))


def build(arch, n):
    part = StagePartition.build(L, n)
    target = Target(arch, part, torch.float32, "cpu")
    torch.manual_seed(n)
    return target, SpeculationHead(arch, part, num_layers=1)


def test_matcher_finds_strings_across_and_inside_tokens():
    stop = StopStrings(["cde", "z"], letters)
    assert stop.window == 3 + 4
    ids = [0, 1, 2, 3]  # "abcd"
    assert not stop.hit(ids) and stop.hit(ids + [4])  # "abcde": completed by the newest token, across three tokens
    assert stop.hit([7] * 20 + [25])  # found in the window at the end of a long generation
    assert stop.truncate("xxcdeyyz") == "xx" and stop.truncate("none") == "none"
    for bad in ([], [""], ["ok", ""]):
        with pytest.raises(ValueError, match="non-empty"):
            StopStrings(bad, letters)
    assert StopStrings.from_tokenizer([], None) is None


def test_token_output_stops_after_eos_and_before_length():
    out = TokenOutput(frozenset({4}), 10, StopStrings(["de"], letters))
    assert not out.emit(3) and out.emit(4) and out.finish_reason == "eos"  # EOS first when one token is both
    out = TokenOutput(frozenset(), 2, StopStrings(["ab"], letters))
    assert not out.emit(0) and out.emit(1) and out.finish_reason == "stop"  # the stop string before the limit
    out = TokenOutput(frozenset(), 2, StopStrings(["zz"], letters))
    assert not out.emit(0) and out.emit(1) and out.finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_decoder_stops_at_the_same_token(tiny, n, temperature):
    """SPD (oracle drafts accepted half the time, so rollbacks are in flight when the stop string arrives), AR and
    the static-cache AR (eager on CPU, tokens read in chunks of 4) end with the token that completes the stop string:
    their unstopped output cut at its first hit. At T > 0 SPD is checked against its own unstopped run (same keyed
    uniforms), AR and the static-cache AR against each other."""
    target, head = build(tiny, n)
    prompt, max_new = [3, 14, 15, 92, 65], 40
    sampling = SamplingParams(temperature=temperature, seed=7)
    ar_free = ARDecoder(target, sampling).generate(prompt, max_new).tokens

    def spd(stop=None):
        drafter = OracleDrafter(prompt + ar_free, 0.5, base=HeadDrafter(head, 256, torch.float32, "cpu"), seed=n)
        return SPDReferenceDecoder(target, drafter, sampling, max_len=256, stop_strings=stop).generate(prompt, max_new)

    spd_free = spd().tokens
    if temperature == 0:
        assert spd_free == ar_free
    for cut in (12, 25):  # a stop string taken from inside the generation: 3 tokens ending at token ``cut``
        stop = StopStrings([letters(spd_free[cut - 3:cut])], letters)
        k = first_hit(spd_free, stop)
        assert k is not None and k <= cut
        res = spd(stop)
        assert res.tokens == spd_free[:k] and res.finish_reason == "stop"
        assert res.metrics.num_new_tokens == k
        stop_ar = StopStrings([letters(ar_free[cut - 3:cut])], letters)
        k_ar = first_hit(ar_free, stop_ar)
        ar = ARDecoder(target, sampling, stop_strings=stop_ar).generate(prompt, max_new)
        graph = ARGraphDecoder(target, sampling, max_len=128, sync_every=4,
                               stop_strings=stop_ar).generate(prompt, max_new)
        assert ar.tokens == graph.tokens == ar_free[:k_ar] and ar.finish_reason == graph.finish_reason == "stop"


def test_config_stop_strings(tmp_path):
    cfg = load_config(None, ['decoding.stop=["User:", "\\n\\n"]'])
    assert cfg.decoding.stop == ["User:", "\n\n"]
    assert load_config(None).decoding.stop == []
    with pytest.raises(ConfigError, match="non-empty strings"):
        load_config(None, ['decoding.stop=[""]'])
    for scalar in ("User:", "x"):  # a scalar for the list, mapping-like or not
        with pytest.raises(ConfigError, match=rf"takes a list; .*decoding.stop='\[\"{scalar}\"\]'"):
            load_config(None, [f"decoding.stop={scalar}"])
    for unquoted in ("[No, Yes, 1e3]", "[[a]]"):  # YAML would make booleans and numbers of these
        with pytest.raises(ConfigError, match="list of non-empty strings, quoted in YAML"):
            load_config(None, [f"decoding.stop={unquoted}"])
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(None, ["decoding.stop=[User:]"])
    with pytest.raises(ValueError, match="got the string 'User:'"):  # the Python API: not split into characters
        StopStrings("User:", letters)


def test_eval_refuses_stop_strings():
    from spd_ds.eval.runner import prepare

    with pytest.raises(ConfigError, match="decoding.stop is for launch/infer.py"):
        prepare(load_config(None, ['decoding.stop=["x"]']))


def test_smollm2_spd_equals_ar_with_a_stop_string(smollm2_arch, smollm2_dir):
    """The shipped n = 2 head on SmolLM2 with its tokenizer: a stop string taken from inside AR's answer (across a
    token boundary) ends SPD and AR at the same token, the first whose text completes it."""
    from transformers import AutoTokenizer

    from spd_ds import builder
    from spd_ds.builder import encode_prompt

    cfg = load_config("launch/configs/smollm2_spd.yaml", ["model.dtype=float32", "model.device=cpu"])
    part = builder.build_partition(cfg, smollm2_arch)
    target = builder.build_target(cfg, smollm2_arch, part)
    head = builder.build_head(cfg, smollm2_arch, part)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = encode_prompt(tok, "Write two sentences about the sea.")
    eos = builder.eos_token_ids(cfg, smollm2_arch, tok)
    free = ARDecoder(target, eos_token_ids=eos, max_len=512).generate(prompt, 48).tokens
    text = tok.decode(free[:30])
    cut = tok.decode(free[:20])
    assert text.startswith(cut) and len(text) - len(cut) >= 8
    stop_text = text[len(cut) - 3:len(cut) + 5]  # spans the boundary after token 20
    cfg.decoding.stop = [stop_text]
    stop = builder.stop_strings(cfg, tok)
    k = first_hit(free, stop)
    assert k is not None and 20 <= k <= 30
    ar = ARDecoder(target, eos_token_ids=eos, max_len=512, stop_strings=stop).generate(prompt, 48)
    drafter = builder.build_drafter(cfg, head, smollm2_arch, target.device)
    spd = SPDReferenceDecoder(target, drafter, eos_token_ids=eos, max_len=512, stop_strings=stop).generate(prompt, 48)
    assert spd.tokens == ar.tokens == free[:k] and spd.finish_reason == ar.finish_reason == "stop"
    assert stop_text in tok.decode(spd.tokens) and stop_text not in tok.decode(spd.tokens[:-1])
    assert stop_text not in stop.truncate(tok.decode(spd.tokens))
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        builder.stop_strings(load_config(None, ['decoding.stop=["x"]']), None)


@pytest.mark.parametrize("n", [1, 3])
def test_on_token_streams_every_verified_token_in_order(tiny, n):
    """``generate(on_token=...)`` hands over each returned token once, in order, rollbacks in flight included."""
    target, head = build(tiny, n)
    prompt = [3, 14, 15, 92, 65]
    ar = ARDecoder(target).generate(prompt, 30).tokens
    drafter = OracleDrafter(prompt + ar, 0.5, base=HeadDrafter(head, 256, torch.float32, "cpu"), seed=n)
    seen = []
    res = SPDReferenceDecoder(target, drafter, max_len=256).generate(prompt, 30, on_token=seen.append)
    assert seen == res.tokens == ar and res.metrics.num_rollbacks > 0


def test_streamer_prints_only_what_is_certain():
    """``--stream``: an incomplete character and a possible stop-string start wait; the end cuts the stop string."""
    import io
    from types import SimpleNamespace

    from spd_ds.commands.infer import _Streamer

    pieces = {0: "ab", 1: "\ufffd", 2: "c", 3: "S", 4: "TOP", 5: "x"}  # 1 stands for half a character
    tok = SimpleNamespace(decode=lambda ids, **kw: "".join(pieces[i] for i in ids).replace("\ufffdc", "é"))
    out = io.StringIO()
    s = _Streamer(tok, [("q0", "question")], StopStrings(["STOP"], letters), out)
    s.start(0)
    printed = []
    for t in (0, 1, 2, 3):
        s(0, t)
        printed.append(out.getvalue())
    # "ab" is held back by len("STOP") - 1 = 3 characters (no header before the first printed character either);
    # then "ab" + half a character, "abé", "abéS"
    assert printed[:3] == ["", "", ""] and printed[3] == "\n=== [q0] question\na"
    s(0, 4)  # "abéSTOP": the stop string is complete: everything before it is certain
    s.end(SimpleNamespace(finish_reason="stop"))
    assert out.getvalue() == "\n=== [q0] question\nabé\n"
    out2 = io.StringIO()
    s2 = _Streamer(tok, [("q0", "question")], None, out2)
    s2.start(0)
    for t in (0, 1):
        s2(0, t)
    assert out2.getvalue().endswith("question\nab")  # the half character waits
    s3 = _Streamer(tok, [("q0", "question")], None, io.StringIO())
    s3.start(0)
    s3.close()  # a prompt refused before its first token: nothing printed
    assert s3.out.getvalue() == ""
    s2(0, 2)
    s2.end(SimpleNamespace(finish_reason="length"))
    assert out2.getvalue().endswith("question\nabé\n")
