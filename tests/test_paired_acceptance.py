"""scripts/diagnostics/paired_acceptance.py: pooled acceptance per method and the paired per-prompt difference."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "diagnostics" / "paired_acceptance.py"


@pytest.fixture(scope="module")
def paired():
    spec = importlib.util.spec_from_file_location("paired_acceptance", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(method, pset, qid, drafts, accepted, new_tokens, cycles, n=3):
    return {"method": method, "prompt_set": pset, "question_id": qid, "num_stages": n, "num_drafts": drafts,
            "num_accepted_tokens": accepted, "num_new_tokens": new_tokens, "num_cycles": cycles,
            "draft_acceptance_rate": accepted / drafts}


def test_pooled_and_paired_figures(paired, tmp_path, capsys):
    recs = [_rec("spd", "a", "1", 10, 5, 12, 24), _rec("ppsd", "a", "1", 10, 4, 12, 26),
            _rec("spd", "b", "2", 20, 8, 30, 60), _rec("ppsd", "b", "2", 20, 8, 30, 60),
            _rec("spd", "b", "3", 10, 6, 10, 18), _rec("ppsd", "b", "3", 10, 3, 10, 24)]
    f = tmp_path / "per_prompt.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    alpha, lprime = paired.pooled(r for r in recs if r["method"] == "spd")
    assert alpha == pytest.approx(19 / 40)
    assert lprime == pytest.approx(3 * 52 / 102)  # n * sum N / sum K
    assert paired.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "| spd | 0.475 | 1.529 | 0.500 / 1.500 | 0.467 / 1.538 |" in out
    # differences 0.1, 0.0, 0.3: mean 0.1333, A leads on 2, B on 0
    assert "3 prompts): mean +0.1333" in out and "A leads on 2, B on 0" in out


def test_two_files_compare_their_first_methods(paired, tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(_rec("spd", "s", q, 10, k, 10, 20)) + "\n" for q, k in (("1", 6), ("2", 2))))
    b.write_text("".join(json.dumps(_rec("spd", "s", q, 10, k, 10, 20, n=2)) + "\n" for q, k in (("1", 5), ("2", 2))))
    assert paired.main([str(a), str(b)]) == 0
    assert "2 prompts): mean +0.0500" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        paired.main([str(a), str(b), str(a)])
    with pytest.raises(SystemExit):  # b holds no ppsd method
        paired.main([str(a), str(b), "--methods", "spd", "ppsd"])
    assert "holds no method 'ppsd' (it holds spd)" in capsys.readouterr().err


def test_methods_pick_one_method_of_each_file(paired, tmp_path, capsys):
    f = tmp_path / "pp.jsonl"
    f.write_text("".join(json.dumps(_rec(m, "s", q, 10, k, 10, 20)) + "\n"
                         for m, q, k in (("spd", "1", 6), ("ppsd", "1", 2), ("spd", "2", 4), ("ppsd", "2", 4),
                                         ("spd", "3", 5), ("ppsd", "3", 0))))
    g = tmp_path / "other.jsonl"
    g.write_text("".join(json.dumps(_rec("spd", "s", q, 10, 3, 10, 20)) + "\n" for q in ("1", "2", "3")))
    assert paired.main([str(f), str(g), "--methods", "ppsd", "spd"]) == 0  # ppsd of f against spd of g
    assert "3 prompts): mean -0.1000" in capsys.readouterr().out


def test_draws_joined_by_commas_are_pooled_per_prompt(paired, tmp_path, capsys):
    a1, a2, b = tmp_path / "a1.jsonl", tmp_path / "a2.jsonl", tmp_path / "b.jsonl"
    a1.write_text("".join(json.dumps(_rec("spd", "s", q, 10, k, 10, 20)) + "\n" for q, k in (("1", 6), ("2", 2))))
    a2.write_text("".join(json.dumps(_rec("spd", "s", q, d, k, 10, 20)) + "\n"
                          for q, d, k in (("1", 30, 10), ("2", 10, 4))))
    b.write_text("".join(json.dumps(_rec("spd", "s", q, 10, 3, 10, 20)) + "\n" for q in ("1", "2")))
    side = paired.load_draws(f"{a1},{a2}", "spd")
    assert side[("s", "1")]["draft_acceptance_rate"] == pytest.approx(16 / 40)  # pooled, not the mean of 0.6, 0.33
    assert side[("s", "2")]["num_cycles"] == 40
    assert paired.main([f"{a1},{a2}", str(b)]) == 0
    out = capsys.readouterr().out
    assert "| 0.367 | " in out  # 22 / 60 drafts over both draws
    assert "2 prompts): mean +0.0500" in out and "A leads on 1, B on 0" in out  # 16/40 - 0.3 and 6/20 - 0.3
    assert paired.load_draws(f"{a1},{b}", "ppsd") is None


def test_missing_or_damaged_file_is_a_usage_error(paired, tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(_rec("spd", "s", q, 10, 5, 10, 20)) + "\n" for q in ("1", "2")))
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text(json.dumps(_rec("spd", "s", "1", 10, 5, 10, 20)) + "\n{\"method\": \"spd\", \"prom\n")
    not_records = tmp_path / "summary.json"
    not_records.write_text(json.dumps({"acceptance": 0.6}) + "\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    for bad, words in ((tmp_path / "missing.jsonl", "cannot read"), (damaged, "line 2"), (not_records, "line 1"),
                       (binary, "is not UTF-8 text")):
        with pytest.raises(SystemExit) as e:
            paired.main([str(good), str(bad)])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert str(bad) in err and words in err and "Traceback" not in err
