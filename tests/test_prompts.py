"""spd_ds.eval.prompts: EAGLE-form prompt sets from a prepared dir, the registry, and loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spd_ds.eval import prompts
from spd_ds.eval.prompts import (
    PROMPT_SETS,
    PromptSetUnavailableError,
    load_prompts,
    materialize_prompt_set,
)
from tests.conftest import write_prompt_set

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def source_dir(tmp_path) -> Path:
    """A prepared copy of the three sets, of our own (as ``--source-dir`` expects it on an offline machine)."""
    src = tmp_path / "source"
    write_prompt_set(src, "mt_bench", 4, turns=2)
    write_prompt_set(src, "humaneval", 3)
    write_prompt_set(src, "gsm8k", 6)
    return src


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _registry(name: str, out_dir: Path) -> Path:
    try:
        return materialize_prompt_set(name, out_dir)
    except PromptSetUnavailableError as e:
        if "cannot download registry package" in str(e):
            pytest.skip(f"no registry access: {e}")
        raise


@pytest.mark.parametrize("name", ["mt_bench", "humaneval", "gsm8k"])
def test_materialize_from_source_dir(tmp_path, source_dir, name):
    path = materialize_prompt_set(name, tmp_path / "eval_data", source_dir=source_dir)
    assert path == tmp_path / "eval_data" / name / "question.jsonl"
    recs = _read(path)
    assert recs == _read(source_dir / name / "question.jsonl")
    assert len(recs) == {"mt_bench": 4, "humaneval": 3, "gsm8k": 6}[name]
    assert all("question_id" in r and isinstance(r["turns"], list) and r["turns"] for r in recs)


def test_humaneval_from_registry(tmp_path):
    path = _registry("humaneval", tmp_path)
    recs = _read(path)
    assert len(recs) == 164
    assert recs[0]["question_id"] == "HumanEval/0"
    assert recs[0]["category"] == "code"
    assert len(recs[0]["turns"]) == 1 and "def has_close_elements(" in recs[0]["turns"][0]
    assert recs[0]["reference"][0].strip()
    assert len({r["question_id"] for r in recs}) == 164


def test_mt_bench_from_registry(tmp_path):
    recs = _read(_registry("mt_bench", tmp_path))
    assert len(recs) == 80
    assert recs[0]["question_id"] == 81 and recs[0]["category"] == "writing"
    assert all(len(r["turns"]) == 2 for r in recs)
    assert (len({r["question_id"] for r in recs}) == 80
            and {r["category"] for r in recs} >= {"writing", "math", "coding"})


def test_gsm8k_offline_without_source_raises_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PromptSetUnavailableError) as ei:
        materialize_prompt_set("gsm8k", tmp_path)
    msg = str(ei.value)
    assert "\n" not in msg and "offline" in msg
    assert "prepare_eval_data.py gsm8k --source-dir" in msg and "data.eval_dir=" in msg
    assert not (tmp_path / "gsm8k" / "question.jsonl").exists()


def test_bad_names_and_sources(tmp_path):
    with pytest.raises(ValueError):
        materialize_prompt_set("no_such_set", tmp_path)
    with pytest.raises(PromptSetUnavailableError):
        materialize_prompt_set("mt_bench", tmp_path / "out", source_dir=tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        load_prompts("no_such_set", eval_dir=tmp_path)
    assert set(PROMPT_SETS) == {"mt_bench", "humaneval", "gsm8k"}
    assert prompts.canonical_name("MT-Bench") == "mt_bench"


def test_an_eval_data_folder_that_cannot_be_written_is_one_line(tmp_path, source_dir):
    """data.eval_dir under a file (or read-only): the set cannot be written there. It ended launch/infer.py with
    "error: [Errno 20] Not a directory: '.../mt_bench'", naming neither the set nor the setting to change."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "eval_data"
    for source in (source_dir, None):  # a copy of a prepared folder; a set from its registry package
        with pytest.raises(PromptSetUnavailableError) as ei:
            if source is None:
                load_prompts("humaneval", limit=1, eval_dir=bad)  # materialises it first, as infer and eval do
            else:
                materialize_prompt_set("mt_bench", bad, source_dir=source)
        msg = str(ei.value)
        if "cannot download registry package" in msg:
            pytest.skip(f"no registry access: {msg}")
        assert msg.startswith("prompt set ") and f"cannot be written to {bad}" in msg and "\n" not in msg, msg
        assert "(Not a directory); give an eval-data folder that can be made and written (data.eval_dir=DIR" in msg


def test_load_prompts_by_name_path_and_limit(tmp_path, source_dir):
    eval_dir = tmp_path / "eval_data"
    for name in ("mt_bench", "humaneval"):  # from the registry, as the product gets them
        _registry(name, eval_dir)
    materialize_prompt_set("gsm8k", eval_dir, source_dir=source_dir)  # hub-only: our own copy
    recs = load_prompts("gsm8k", limit=5, eval_dir=eval_dir)
    assert len(recs) == 5 and all(set(r) >= {"question_id", "turns"} for r in recs)
    assert [r["question_id"] for r in recs] == list(range(5))
    assert len(load_prompts("mt_bench", eval_dir=eval_dir)) == 80
    assert load_prompts("humaneval", limit=0, eval_dir=eval_dir) == []
    by_path = load_prompts(eval_dir / "mt_bench" / "question.jsonl", limit=3)
    assert by_path == load_prompts("mt_bench", limit=3, eval_dir=eval_dir)
    assert load_prompts(eval_dir / "mt_bench", limit=3) == by_path


def test_load_prompts_materialises_missing_set(tmp_path):
    try:
        recs = load_prompts("humaneval", limit=4, eval_dir=tmp_path)
    except PromptSetUnavailableError as e:
        pytest.skip(f"no registry access: {e}")
    assert len(recs) == 4 and recs[3]["question_id"] == "HumanEval/3"
    assert (tmp_path / "humaneval" / "question.jsonl").is_file()


def test_load_prompts_normalises_plain_jsonl(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "hello"}\n\n{"id": "x", "turns": "one"}\n{"question_id": 7, "turns": ["a", "b"]}\n')
    recs = load_prompts(f)
    assert [r["question_id"] for r in recs] == [0, "x", 7]
    assert [r["turns"] for r in recs] == [["hello"], ["one"], ["a", "b"]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(ValueError):
        load_prompts(bad)
    array = tmp_path / "arr.json"  # a JSON array file, not jsonl
    array.write_text('[{"prompt": "hi"}]')
    with pytest.raises(ValueError, match=r"arr.json:1: the line is a JSON array .* one JSON object per line"):
        load_prompts(array)
    plain = tmp_path / "s.jsonl"
    plain.write_text('"hi"\n')
    with pytest.raises(ValueError, match=r"s.jsonl:1: the line is a JSON string, not an object"):
        load_prompts(plain)
    # json.dump(..., indent=2) of a list or of one record: the first line alone ('[' or '{') was "not JSON
    # (Expecting value)", which it is, and said nothing of what to change
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps([{"turns": ["What is 2+2?"]}, {"turns": ["Hi"]}], indent=2))
    with pytest.raises(ValueError) as e:
        load_prompts(pretty)
    assert str(e.value) == (f"{pretty} is one JSON array over several lines, not JSON lines; write each record on a "
                            "line of its own ({\"turns\": [\"...\"]} a line: jq -c '.[]' FILE > FILE.jsonl)")
    pretty.write_text(json.dumps({"turns": ["What is 2+2?"]}, indent=2))
    with pytest.raises(ValueError, match=r"is one JSON object over several lines, not JSON lines; .* jq -c '\.' "):
        load_prompts(pretty)
    # `jq . FILE.jsonl` (no -c): records one after another, each over several lines; was "not JSON" at line 1
    pretty.write_text("".join(json.dumps({"turns": [t]}, indent=2) + "\n" for t in ("Hi", "Bye")))
    with pytest.raises(ValueError) as e:
        load_prompts(pretty)
    assert str(e.value) == (f"{pretty} is several JSON objects, not one per line (pretty-printed: jq without -c?); "
                            "write each record on a line of its own ({\"turns\": [\"...\"]} a line: jq -c '.' FILE > "
                            "FILE.jsonl)")
    pretty.write_text('{"turns": ["a"]} {"turns": ["b"]}\n')  # two on one line: not "over several lines"
    with pytest.raises(ValueError, match=r"is several JSON objects, not one per line .* jq -c '\.' "):
        load_prompts(pretty)
    pretty.write_text('{"turns": [\n"a"]}\u00a0{"turns": ["b"]}\n', encoding="utf-8")  # no JSON whitespace: jq fails
    with pytest.raises(ValueError, match=r"pretty.json:1: not JSON \(.*\); give one JSON object per line$"):
        load_prompts(pretty)
    pretty.write_text('{"turns": [\n"a"]}\n[1]\n')  # not all records: no advice to keep them as they are
    with pytest.raises(ValueError, match=r"pretty.json:1: not JSON \(.*\); give one JSON object per line$"):
        load_prompts(pretty)
    pretty.write_text('{"turns": ["a"]}\n{"turns": [\n')  # a bad line after good ones: named by its number
    with pytest.raises(ValueError, match=r"pretty.json:2: not JSON \(.*\); give one JSON object per line$"):
        load_prompts(pretty)


def test_missing_prompt_file_is_named_as_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"prompt file '.*nope.jsonl' does not exist; give a jsonl file"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"is a directory without question.jsonl"):
        load_prompts(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'nope' is neither a jsonl file nor a prompt set name"):
        load_prompts("nope", eval_dir=tmp_path)


def test_empty_user_turn_is_refused_before_the_model(tmp_path):
    """A blank user turn (empty or whitespace) used to be encoded and answered; it is refused while the records are
    read, in one line naming the file, line, record index and turn, before any model is resolved (none exists here)."""
    from spd_ds.config import ConfigError, load_config
    from spd_ds.eval.runner import run_eval

    f = tmp_path / "mine.jsonl"
    f.write_text('{"turns": ["fine"]}\n{"question_id": "q2", "turns": [" \\n\\t"]}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:2: record 1 has an empty user turn \(turns\[0\] is ' \\n\\t'\); "
                                         r"write the prompt's text into it or remove the record$"):
        load_prompts(f)
    (tmp_path / "p.jsonl").write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: record 0 has an empty user turn \(turns\[0\] is ''\)"):
        load_prompts(tmp_path / "p.jsonl")
    q = write_prompt_set(tmp_path / "eval_data", "mt_bench", 3, turns=2)
    recs = [json.loads(x) for x in q.read_text().splitlines()]
    recs[2]["turns"][1] = ""
    q.write_text("".join(json.dumps(r) + "\n" for r in recs))
    messages = {}
    for sets in ("[mt_bench]", f"[{f}]"):  # a named set (its second turn is empty) and a file (a whitespace turn)
        cfg = load_config(None, [f"eval.prompt_sets={sets}", f"data.eval_dir={tmp_path / 'eval_data'}",
                                 f"model.name={tmp_path / 'no_model_here'}", "eval.progress=false"])
        with pytest.raises(ConfigError) as e:
            run_eval(cfg, engine="reference")
        messages[sets] = str(e.value)
    assert messages["[mt_bench]"].startswith(f"prompt set 'mt_bench': {q}:3: record 2 has an empty user turn "
                                             "(turns[1] is ''); write the prompt's text into it or remove the record")
    assert messages[f"[{f}]"].startswith(f"prompt set '{f}': {f}:2: record 1 has an empty user turn")
    assert not any("\n" in m or "no_model_here" in m for m in messages.values())


def test_prepare_eval_data_cli(tmp_path, source_dir, capsys):
    from spd_ds.commands import prepare_eval_data as mod

    out = tmp_path / "ed"
    assert mod.main(["--out-dir", str(out), "--source-dir", str(source_dir)]) == 0
    assert {p.parent.name for p in out.glob("*/question.jsonl")} == {"mt_bench", "humaneval", "gsm8k"}
    assert mod.main(["--out-dir", str(out), "--source-dir", str(tmp_path / "nothing"), "gsm8k"]) == 1
    assert "FAILED" in capsys.readouterr().err
    # --keep with a damaged kept file: that set fails in one line, the next is still written
    (out / "mt_bench" / "question.jsonl").write_text("{bad\n")
    (out / "humaneval" / "question.jsonl").unlink()
    assert mod.main(["--out-dir", str(out), "--source-dir", str(source_dir), "--keep", "mt_bench", "humaneval"]) == 1
    assert "mt_bench: FAILED" in capsys.readouterr().err and (out / "humaneval" / "question.jsonl").exists()


def test_prepare_eval_data_goes_through_run_cli(tmp_path, source_dir, monkeypatch):
    """prepare_eval_data was the one program without spd_ds.cli.run_cli: Ctrl-C while a set was fetched printed
    KeyboardInterrupt's traceback, and --out-dir=~/ed (which the shell leaves as it is) wrote into a folder named '~'.
    Now Ctrl-C is one line and the process ends by SIGINT, as the other programs, and ~ is the home folder."""
    import os
    import signal
    import subprocess
    import sys

    from spd_ds import cli
    from spd_ds.commands import prepare_eval_data as mod

    code = ("import sys\nfrom spd_ds.commands import prepare_eval_data as mod\n"
            "def fetch(*a, **k):\n    raise KeyboardInterrupt\n"
            "mod.materialize_prompt_set = fetch\nmod.main(sys.argv[1:])\nprint('not reached')")
    env = {k: v for k, v in os.environ.items() if k not in (cli.DEBUG_ENV, "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", code, "mt_bench", "--out-dir", str(tmp_path / "ed"), "--source-dir",
                        str(source_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGINT, (r.returncode, r.stderr)
    assert r.stderr == "error: interrupted\n" and "not reached" not in r.stdout
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert mod.main(["mt_bench", "--out-dir=~/ed", f"--source-dir={source_dir}"]) == 0
    assert (tmp_path / "home" / "ed" / "mt_bench" / "question.jsonl").is_file() and not (tmp_path / "~").exists()


def test_an_empty_or_gzipped_source_and_a_gzipped_prompt_file(tmp_path, source_dir, capsys):
    """An empty --source-dir file was copied over a good set (then reported as the kept file's fault, "leave out
    --keep", which was never given): it is refused by its own name, the set as it was. A gzip-compressed prompt file
    failed with "'utf-8' codec can't decode byte 0x8b": it is read as gzip, as the training data reader does, and a
    --source-dir copy is written decompressed; a file that is not UTF-8 says so."""
    import gzip

    from spd_ds.commands import prepare_eval_data as mod

    out = tmp_path / "ed"
    good = materialize_prompt_set("mt_bench", out, source_dir).read_bytes()
    empty = tmp_path / "empty"
    (empty / "mt_bench").mkdir(parents=True)
    (empty / "mt_bench" / "question.jsonl").write_text("\n")
    with pytest.raises(PromptSetUnavailableError, match=f"{empty / 'mt_bench' / 'question.jsonl'} holds no prompt"):
        materialize_prompt_set("mt_bench", out, empty)
    assert mod.main(["mt_bench", "--out-dir", str(out), "--source-dir", str(empty)]) == 1
    err = capsys.readouterr().err
    assert f"{empty / 'mt_bench' / 'question.jsonl'} holds no prompt" in err and "--keep" not in err, err
    assert (out / "mt_bench" / "question.jsonl").read_bytes() == good
    zipped = tmp_path / "zipped"
    (zipped / "mt_bench").mkdir(parents=True)
    (zipped / "mt_bench" / "question.jsonl").write_bytes(gzip.compress(good))
    assert load_prompts(zipped / "mt_bench" / "question.jsonl") == load_prompts(out / "mt_bench" / "question.jsonl")
    assert mod.main(["mt_bench", "--out-dir", str(tmp_path / "ed2"), "--source-dir", str(zipped)]) == 0
    assert (tmp_path / "ed2" / "mt_bench" / "question.jsonl").read_bytes() == good
    bom = tmp_path / "bom.jsonl"  # UTF-8 with a byte-order mark (as Notepad saves it): read past
    bom.write_bytes(b"\xef\xbb\xbf" + good)
    assert load_prompts(bom) == load_prompts(out / "mt_bench" / "question.jsonl")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"turns": ["caf\u00e9"]}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"^{latin} is not UTF-8 text .*; save it as UTF-8"):
        load_prompts(latin)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(good)[:-12])
    with pytest.raises(ValueError, match=f"^{cut} is a damaged gzip file"):
        load_prompts(cut)


def test_gsm8k_with_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    t = time.perf_counter()
    with pytest.raises(PromptSetUnavailableError, match="cannot be reached"):
        materialize_prompt_set("gsm8k", tmp_path)
    assert time.perf_counter() - t < 10


def test_default_prompt_sets_skip_an_unavailable_set_explicit_ones_fail(smollm2_dir, tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    from spd_ds.config import ConfigError, load_config
    from spd_ds.eval.inputs import load_eval_prompts

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    eval_dir = tmp_path / "eval_data"
    write_prompt_set(eval_dir, "mt_bench")
    write_prompt_set(eval_dir, "humaneval")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = load_config(None, [f"data.eval_dir={eval_dir}", "data.num_prompts=2"])
    with caplog.at_level("WARNING"):
        got = load_eval_prompts(cfg, tok, tok.vocab_size)
    assert [p.prompt_set for p in got] == ["mt_bench"] * 2 + ["humaneval"] * 2
    assert "skipping prompt set 'gsm8k'" in caplog.text
    aliased = load_config(None, [f"data.eval_dir={eval_dir}", "data.num_prompts=1",
                                 "eval.prompt_sets=[MT-Bench,human-eval,gsm8k]"])
    assert [p.prompt_set for p in load_eval_prompts(aliased, tok, tok.vocab_size)] == ["MT-Bench", "human-eval"]
    explicit = load_config(None, [f"data.eval_dir={eval_dir}", "data.num_prompts=2",
                                  "eval.prompt_sets=[mt_bench,gsm8k]"])
    with pytest.raises(PromptSetUnavailableError, match="gsm8k"):
        load_eval_prompts(explicit, tok, tok.vocab_size)
    # the report groups rows by set label: a set given twice, or two files of one name, would merge
    other = write_prompt_set(tmp_path / "other", "mt_bench")
    for sets, message in [("[mt_bench,MT-Bench]", r"'MT-Bench' is given twice \('mt_bench'\)"),
                          ("[random,random]", "'random' is given twice"),
                          (f"[{eval_dir}/mt_bench/question.jsonl,{other}]", "both report as 'mt_bench'")]:
        cfg = load_config(None, [f"data.eval_dir={eval_dir}", f"eval.prompt_sets={sets}"])
        with pytest.raises(ConfigError, match=message):
            load_eval_prompts(cfg, tok, tok.vocab_size)


@pytest.mark.parametrize("endpoint", ["https://huggingface.co:99999", "http://[::1", "huggingface.co"])
def test_hub_probe_leaves_malformed_endpoints_to_the_libraries(monkeypatch, endpoint):
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    assert prompts._hub_reachable(0.5) is True  # no crash, no false "unreachable"


def test_eval_warns_when_data_prompts_names_a_set_it_does_not_run(caplog):
    """eval reads eval.prompt_sets alone; data.prompts (infer's set, in the shipped configs) is named when left out."""
    from spd_ds.config import load_config
    from spd_ds.eval.inputs import warn_unused_prompts

    # the shipped config's data.prompts (mt_bench) is among the default sets
    shipped = load_config(Path(__file__).parent.parent / "launch/configs/smollm2_spd.yaml", [])
    assert not warn_unused_prompts(shipped)
    assert not warn_unused_prompts(load_config(None, ["data.prompts=MT-Bench"]))  # an alias of a set it runs
    # the default data.prompts says nothing of the user's intent (the benchmark's random-prompt suites)
    assert not warn_unused_prompts(load_config(None, ["eval.prompt_sets=[random]"]))
    with caplog.at_level("WARNING"):
        assert warn_unused_prompts(load_config(None, ["data.prompts=my.jsonl", "eval.prompt_sets=[humaneval]"]))
    assert "data.prompts=my.jsonl is ignored: eval runs eval.prompt_sets=['humaneval']" in caplog.text


def test_ppsd_head_for_other_stages_is_refused_before_any_row_runs(smollm2_arch, caplog):
    """An n = 3 PPSD head beside the n = 2 SPD head: refused when the variants are made, not after the SPD row. An
    oracle alpha sweep with the head drafter is named as ignored."""
    from spd_ds.config import ConfigError, load_config
    from spd_ds.eval.runner import spd_variants

    root = Path(__file__).parent.parent
    cfg = load_config(root / "launch/configs/smollm2_spd.yaml",
                      [f"eval.ppsd_checkpoint={root}/spd_ds/assets/heads/smollm2-135m-instruct-n3"])
    with pytest.raises(ConfigError, match=r"the PPSD head's stages \[10, 10, 10\] differ from the run's \[15, 15\]"):
        spd_variants(cfg, smollm2_arch)
    alone = load_config(root / "launch/configs/smollm2_spd.yaml", [
        "eval.spd=false", f"eval.ppsd_checkpoint={root}/spd_ds/assets/heads/smollm2-135m-instruct-n3"])
    assert [v.name for v in spd_variants(alone, smollm2_arch)] == ["ppsd"]
    swept = load_config(root / "launch/configs/smollm2_spd.yaml", ["eval.oracle_alphas=[0.5]"])
    with caplog.at_level("WARNING"):
        assert [v.name for v in spd_variants(swept, smollm2_arch)] == ["spd"]
    assert "eval.oracle_alphas=[0.5] is ignored with decoding.drafter=head" in caplog.text


def test_oracle_alphas_given_twice_are_refused(smollm2_arch):
    """eval.oracle_alphas=[1, 1.0] (or benchmark --alphas 1 1) made two variants named spd_oracle_1: both ran, and
    the report kept one row, the second run's. Refused when the variants are made, before any row runs."""
    from spd_ds.config import ConfigError, load_config
    from spd_ds.eval.runner import spd_variants

    cfg = load_config(None, ["decoding.drafter=oracle", "eval.oracle_alphas=[0.8, 1, 1.0]"])
    with pytest.raises(ConfigError, match=r"oracle alphas \[0.8, 1.0, 1.0\] give spd_oracle_1 twice; give each alpha"):
        spd_variants(cfg, smollm2_arch)
    ok = load_config(None, ["decoding.drafter=oracle", "eval.oracle_alphas=[0.8, 1]"])
    assert [v.name for v in spd_variants(ok, smollm2_arch)] == ["spd_oracle_0.8", "spd_oracle_1"]
    with pytest.raises(ConfigError, match=r"^eval.oracle_alphas: each alpha must be in \[0, 1\], got 2.0 \(e.g. "):
        load_config(None, ["decoding.drafter=oracle", "eval.oracle_alphas=[0.8, 2]"])  # before any model is fetched
    with pytest.raises(ConfigError, match=r"^eval.oracle_alphas: each alpha must be in \[0, 1\], got 2.0$"):
        spd_variants(ok, smollm2_arch, [0.8, 2.0])  # alphas given to the runner itself
