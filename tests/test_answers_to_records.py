"""scripts/diagnostics/answers_to_records.py and validate_heads.py --all-records: a head's predicted acceptance on the
target's own answers of an eval run (real SmolLM2 tokenizer, prompts and shipped head)."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import write_prompt_set

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "diagnostics" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def eval_prompts(smollm2_dir, tmp_path_factory):
    """Two prompts of a prompt set of our own, encoded the way an eval run encodes them."""
    from spd_ds.builder import build_arch, load_tokenizer
    from spd_ds.config import load_config
    from spd_ds.eval.inputs import load_eval_prompts

    eval_dir = tmp_path_factory.mktemp("eval_sets")
    qfile = write_prompt_set(eval_dir, "mine", n=2)  # a jsonl path: the run labels its prompts "mine"
    sets = [f"eval.prompt_sets=[{qfile}]", "data.num_prompts=2"]
    cfg = load_config(None, sets)
    arch = build_arch(cfg)
    prompts = load_eval_prompts(cfg, load_tokenizer(arch), arch.vocab_size)
    return sets, {p.question_id: list(p.ids) for p in prompts}


def _per_prompt(path, prompts, answers, method="spd", lengths=None):
    with open(path, "w") as f:
        for qid, toks in answers.items():
            f.write(json.dumps({"method": method, "prompt_set": "mine", "question_id": qid, "tokens": toks,
                                "prompt_tokens": (lengths or {}).get(qid, len(prompts[qid]))}) + "\n")


def test_records_are_prompt_then_answer_with_the_loss_on_the_answer(eval_prompts, tmp_path):
    sets, prompts = eval_prompts
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _per_prompt(a, prompts, {"0": [28, 29, 30], "1": [40, 41]})
    _per_prompt(b, prompts, {"1": [50]})
    with open(b, "a") as f:  # another method's answers are left out
        f.write(json.dumps({"method": "ppsd", "prompt_set": "mine", "question_id": "0", "tokens": [1],
                            "prompt_tokens": len(prompts["0"])}) + "\n")
    out = tmp_path / "records.jsonl"
    args = [str(a), str(b), "--out", str(out)] + [x for s in sets for x in ("--set", s)]
    assert _script("answers_to_records").main(args) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["conv_id"] for r in recs] == ["mine/0/0", "mine/1/0", "mine/1/1"]
    assert recs[0]["input_ids"] == prompts["0"] + [28, 29, 30]
    assert recs[0]["assistant_mask"] == [0] * len(prompts["0"]) + [1, 1, 1]
    assert recs[2]["input_ids"] == prompts["1"] + [50]


def test_a_prompt_the_config_does_not_encode_as_the_run_did_is_refused(eval_prompts, tmp_path, capsys):
    sets, prompts = eval_prompts
    f, out = tmp_path / "a.jsonl", tmp_path / "r.jsonl"
    args = [str(f), "--out", str(out)] + [x for s in sets for x in ("--set", s)]
    _per_prompt(f, prompts, {"0": [28]}, lengths={"0": len(prompts["0"]) + 1})  # another chat template
    assert _script("answers_to_records").main(args) == 2
    assert "encodes to" in capsys.readouterr().err
    _per_prompt(f, {"7": [1]}, {"7": [28]})  # not in the set
    assert _script("answers_to_records").main(args) == 2
    assert "is not among the config's prompts" in capsys.readouterr().err
    f.write_text(json.dumps({"method": "spd", "question_id": "0"}) + "\n")  # not a per-prompt record
    assert _script("answers_to_records").main(args) == 2
    assert "no prompt_set, tokens, prompt_tokens" in capsys.readouterr().err
    f.write_text("Traceback (most recent call last):\n")  # not JSON: one line, no traceback
    assert _script("answers_to_records").main(args) == 2
    assert ":1: not a JSON object" in capsys.readouterr().err
    assert _script("answers_to_records").main([str(tmp_path / "none.jsonl"), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_validate_heads_scores_every_record_with_all_records(eval_prompts, tmp_path, capsys):
    sets, prompts = eval_prompts
    answers = {"0": list(range(300, 340)), "1": list(range(500, 530))}
    f, recs = tmp_path / "a.jsonl", tmp_path / "r.jsonl"
    _per_prompt(f, prompts, answers)
    assert _script("answers_to_records").main([str(f), "--out", str(recs)] +
                                              [x for s in sets for x in ("--set", s)]) == 0
    head = str(ROOT / "spd_ds" / "assets" / "heads" / "smollm2-135m-instruct-n2")
    base = [head, "--data", str(recs), "--config", str(ROOT / "launch" / "configs" / "train_smollm2_n2.yaml"),
            "--set", "data.max_seq_length=256"]
    assert _script("validate_heads").main(base + ["--all-records"]) == 0
    val = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert val["head"] == head
    assert val["val_positions"] == 70  # every answer token of both records is a scored position
    assert 0.0 <= val["val_pred_acceptance_sampled"] <= 1.0 and 1.0 <= val["val_pred_accept_length"] <= 2.0
    # without it only the held-out split is scored: of two records, one (at least one is always held out)
    assert _script("validate_heads").main(base) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["val_positions"] in (30, 40)
    # the whole-vocabulary head over a smaller draft vocabulary: the same positions, other figures
    vocab = str(ROOT / "draft_vocab" / "smollm2-135m-instruct_sharegpt_16k.json")
    assert _script("validate_heads").main(base + ["--all-records", "--draft-vocab", vocab]) == 0
    narrow = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert narrow["val_positions"] == 70 and narrow["val_overlap_by_fill_sampled"] != val["val_overlap_by_fill_sampled"]


def test_validate_heads_names_a_wrong_head_folder_in_one_line(tmp_path):
    """A head argument that is no head folder (missing, or without head_config.json) is one line naming the
    argument, before the model loads (it was a FileNotFoundError traceback naming head.checkpoint)."""
    (tmp_path / "empty").mkdir()
    good = str(ROOT / "spd_ds" / "assets" / "heads" / "smollm2-135m-instruct-n2")
    for bad, says in ((tmp_path / "nothing", "does not exist"), (tmp_path / "empty", "holds no head")):
        with pytest.raises(SystemExit) as e:
            _script("validate_heads").main([good, str(bad), "--data", str(tmp_path / "r.jsonl")])
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg and says in msg and "the head argument" in msg, msg
        assert "head.checkpoint" not in msg
