import re
from pathlib import Path

import pytest

from spd_ds.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_overrides():
    cfg = load_config(None, ["partition.num_stages=3", "decoding.temperature=0.7", "partition.anchors=[0,2,4]"])
    assert cfg.partition.num_stages == 3 and cfg.decoding.temperature == 0.7 and cfg.partition.anchors == [0, 2, 4]


@pytest.mark.parametrize("path", sorted((ROOT / "launch" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


def test_unknown_key_names_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'partition.stages'.*num_stages, stage_layers, anchors"):
        load_config(None, ["partition.stages=2"])
    with pytest.raises(ConfigError, match="sections: model, partition"):
        load_config(None, ["pipeline.num_stages=2"])


def test_an_unknown_key_names_the_likely_one():
    """A misspelled key or section, or a key given under the wrong section, is named first (the list of valid keys
    follows); a name like none gets the list alone."""
    for given, meant in (("train.lrr", "train.lr"), ("decoding.temprature", "decoding.temperature"),
                         ("head.anchors", "partition.anchors"), ("trian.lr", "train"), ("moddel.name", "model")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{given}=1"])
        assert f" (did you mean '{meant}'?); " in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.bogus=1"])
    assert str(e.value).startswith("unknown config key 'train.bogus'; valid keys of train: output_dir,")


def test_an_unknown_key_of_several_sections_names_each_and_case_is_no_typo():
    """``seed`` is decoding's and train's: ``head.seed`` named ``decoding.seed`` alone (the first section holding it),
    though ``data.seed`` is more likely ``train.seed``; a key that differs only in case (``train.LR``) named none."""
    for given, meant in (("head.seed", "'decoding.seed' or 'train.seed'"),
                         ("data.output_dir", "'train.output_dir' or 'eval.output_dir'"),
                         ("train.LR", "'train.lr'"), ("model.Name", "'model.name'")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{given}=1"])
        assert f" (did you mean {meant}?); " in str(e.value), str(e.value)


def test_unknown_key_in_yaml_file(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("decoding:\n  max_tokens: 3\n")
    with pytest.raises(ConfigError, match="valid keys of decoding: max_new_tokens"):
        load_config(f)


def test_a_section_key_at_the_top_of_a_yaml_file_names_its_section(tmp_path):
    """`max_new_tokens: 16` at the top of the file (not under decoding:) listed the sections only."""
    f = tmp_path / "x.yaml"
    f.write_text("max_new_tokens: 16\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == ("unknown config key 'max_new_tokens'; sections: model, partition, head, decoding, data, "
                            "train, eval, deepspeed (max_new_tokens belongs in a section: indent it under decoding:)")
    f.write_text("seed: 3\n")
    with pytest.raises(ConfigError, match=re.escape("(seed belongs in a section: indent it under decoding: or "
                                                    "train:)")):
        load_config(f)
    f.write_text("bogus: 3\n")
    with pytest.raises(ConfigError, match=r"sections: model, .*, deepspeed$"):
        load_config(f)


def test_an_unquoted_colon_in_a_yaml_value_is_named(tmp_path):
    """`stop: User:` in the file: YAML's "mapping values are not allowed" was followed by "check its indentation"
    alone, while the fix is quoting the value."""
    f = tmp_path / "x.yaml"
    f.write_text("decoding:\n  stop: User:\n")
    with pytest.raises(ConfigError, match=re.escape("check its indentation, and quote a value that holds ': '")):
        load_config(f)


def test_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="could not be converted"):
        load_config(None, ["partition.num_stages=two"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["num_stages=2"])
    with pytest.raises(ConfigError, match="head.placement"):
        load_config(None, ["head.placement=sideways"])
    with pytest.raises(ConfigError, match="decoding.temperature must be >= 0"):
        load_config(None, ["decoding.temperature=-1"])
    with pytest.raises(ConfigError, match="top_p must be in"):
        load_config(None, ["decoding.top_p=2"])
    with pytest.raises(ConfigError, match="data.num_prompts must be >= 1"):
        load_config(None, ["data.num_prompts=0"])
    with pytest.raises(ConfigError, match="train.compile_teacher must be auto, a torch.compile backend"):
        load_config(None, ["train.compile_teacher=fastest"])
    assert load_config(None, ["train.compile_teacher=inductor"]).train.compile_teacher == "inductor"
    with pytest.raises(ConfigError, match="train.compile_loss must be auto, a torch.compile backend"):
        load_config(None, ["train.compile_loss=fastest"])
    assert load_config(None, ["train.compile_loss=aot_eager"]).train.compile_loss == "aot_eager"
    with pytest.raises(ConfigError, match="train.teacher_attention must be auto, sdpa or flex"):
        load_config(None, ["train.teacher_attention=eager"])
    with pytest.raises(ConfigError, match="train.teacher_attention=flex needs data.pack=true"):
        load_config(None, ["train.teacher_attention=flex", "data.pack=false"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match="model.dtype='float64' is not one of"):
        load_config(None, ["model.dtype=float64"])
    with pytest.raises(ConfigError, match="model.device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        load_config(None, ["model.device=gpu"])
    assert load_config(None, ["model.device=cuda:1"]).model.device == "cuda:1"  # checked against torch when used
    with pytest.raises(ConfigError, match="head.dtype='fp8' is not one of float32, bfloat16, float16"):
        load_config(None, ["head.dtype=fp8"])
    assert load_config(None, ["head.dtype=bfloat16"]).head.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="head.num_layers .* must be >= 1, got 0"):
        load_config(None, ["head.num_layers=0"])
    with pytest.raises(ConfigError, match="model.attn_implementation must be one of sdpa, eager"):
        load_config(None, ["model.attn_implementation=flashx"])
    assert load_config(None, ["model.attn_implementation=eager"]).model.attn_implementation == "eager"
    with pytest.raises(ConfigError, match="decoding.max_length .* must be >= 2, got 0"):
        load_config(None, ["decoding.max_length=0"])
    # a list override given a scalar: the example keeps a number a number, a string a string
    with pytest.raises(ConfigError, match=re.escape("e.g. decoding.eos_token_ids='[2]'")):
        load_config(None, ["decoding.eos_token_ids=2"])
    with pytest.raises(ConfigError, match=re.escape("""e.g. decoding.stop='["User:"]'""")):
        load_config(None, ["decoding.stop=User:"])
    with pytest.raises(ConfigError, match=re.escape("""e.g. decoding.stop='["5"]'""")):  # stop strings stay strings
        load_config(None, ["decoding.stop=5"])
    assert load_config(None, ["""decoding.stop=["5"]"""]).decoding.stop == ["5"]
    # a list of integers given a word: an integer example (the word in quotes was a list of strings, refused next)
    with pytest.raises(ConfigError, match=re.escape("decoding.eos_token_ids takes a list of integers; write it as a "
                                                    "YAML list in quotes, e.g. decoding.eos_token_ids='[2]'")):
        load_config(None, ["decoding.eos_token_ids=abc"])
    with pytest.raises(ConfigError, match=re.escape("takes a list of numbers; write it as a YAML list in quotes, e.g. "
                                                    "eval.oracle_alphas='[0.5]'")):
        load_config(None, ["eval.oracle_alphas=abc"])
    with pytest.raises(ConfigError, match=re.escape("data.train_files has no value; give a YAML list in quotes, e.g. "
                                                    "data.train_files='[\"...\"]' (or '[]')")):
        load_config(None, ["data.train_files="])
    # an empty value reads as null: named as such, not as OmegaConf's "Incompatible value 'None'" / "is not Optional"
    for key in ("train.output_dir", "decoding.max_new_tokens"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}="])
        assert str(e.value) == (f"{key} has no value (an empty override or YAML entry reads as null); give one, e.g. "
                                f"{key}=<value>")
    (tmp_path / "e.yaml").write_text("data:\n  train_files:\n")  # a YAML key with nothing after it
    with pytest.raises(ConfigError, match=r"^data.train_files has no value \(an empty override or YAML entry"):
        load_config(tmp_path / "e.yaml")


@pytest.mark.parametrize("override,message", [
    ("train.lr=-1", "train.lr must be >= 0, got -1.0"), ("train.save_every=0", "train.save_every must be >= 1"),
    ("train.log_every=0", "train.log_every must be >= 1"),
    ("train.kd_temperature=0", "train.kd_temperature must be > 0"),
    ("train.loss_chunk=0", "train.loss_chunk must be >= 1"),
    ("train.warmup_steps=-5", "train.warmup_steps must be >= 0"),
    ("train.max_steps=0", "train.max_steps must be >= 1 (or null)"), ("train.epochs=-1", "train.epochs must be >= 0"),
    ("train.max_time_s=-1", "train.max_time_s must be > 0 (or null)"),
    ("train.full_pipeline_prob=2", "must be in [0, 1], got 2.0"),
    ("train.save_dtype=bogus", "train.save_dtype='bogus' is not one of"),
    ("data.micro_batch_size=0", "data.micro_batch_size must be >= 1"),
    ("data.max_conversations=0", "data.max_conversations must be >= 1 (or null)"),
    ("data.overflow=bogus", "data.overflow must be truncate or drop"),
    ("eval.baseline_num_prompts=0", "eval.baseline_num_prompts must be >= 1 (or null)"),
    ("eval.random_prompt_lengths=[0]", "eval.random_prompt_lengths must list prompt lengths >= 1 (tokens)"),
    ("eval.random_prompt_lengths=[]", "eval.random_prompt_lengths must list prompt lengths >= 1 (tokens)"),
    ("decoding.temperature=.nan", "decoding.temperature must be a finite number, got nan"),
    ("decoding.temperature=nan", "decoding.temperature must be a finite number, got nan"),
    ("decoding.temperature=inf", "decoding.temperature must be a finite number, got inf"),
    ("train.lr=.nan", "train.lr must be a finite number, got nan"),
    ("train.max_time_s=.inf", "train.max_time_s must be a finite number, got inf"),
    ("decoding.top_p=nan", "decoding.top_p must be a finite number"),
    ("train.kd_temperature=1e30", "train.kd_temperature must be in [0.01, 100]"),
    ("train.kd_temperature=1e-30", "train.kd_temperature must be in [0.01, 100]"),
    ("train.seed=99999999999999999999", "train.seed must be in [0, 2^63)"),
    ("decoding.seed=-1", "decoding.seed must be in [0, 2^63)"),
    ("head.intermediate_size=0", "head.intermediate_size must be >= 1 (or null)"),
    ("train.teacher_pipe_degree=0", "train.teacher_pipe_degree must be >= 1 (or null)"),
    ("data.max_seq_length=0", "data.max_seq_length must be >= 2"),
    ("deepspeed.timeout_s=0", "deepspeed.timeout_s must be > 0"),
    # data.regenerate's: a traceback after the target loaded, no answer ("no conversation with a user turn?") or greedy
    ("data.regenerate_batch_size=0", "data.regenerate_batch_size must be >= 1, got 0"),
    ("data.regenerate_batch_size=-4", "data.regenerate_batch_size must be >= 1, got -4"),
    ("data.regenerate_max_new_tokens=0", "data.regenerate_max_new_tokens must be >= 1, got 0"),
    ("data.regenerate_max_prompt_tokens=0", "data.regenerate_max_prompt_tokens must be >= 1, got 0"),
    ("data.regenerate_temperature=-1", "data.regenerate_temperature must be >= 0, got -1.0"),
    # refused by the eval runner only after the model was fetched and its config read
    ("eval.oracle_alphas=[1,2]", "eval.oracle_alphas: each alpha must be in [0, 1], got 2.0"),
    ("eval.oracle_alphas=[-0.5]", "eval.oracle_alphas: each alpha must be in [0, 1], got -0.5"),
    ("eval.oracle_alphas=[.nan]", "eval.oracle_alphas: each alpha must be in [0, 1], got nan"),
])
def test_out_of_range_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_epochs_zero_means_no_epoch_limit_and_needs_max_steps():
    with pytest.raises(ConfigError, match="train.epochs=0 .* needs train.max_steps"):
        load_config(None, ["train.epochs=0"])
    assert load_config(None, ["train.epochs=0", "train.max_steps=5"]).train.max_steps == 5
    assert load_config(None, ["train.max_time_s=null", "train.session_time_s=0"]).train.session_time_s == 0
    assert load_config(None, ["train.lr=0"]).train.lr == 0  # a frozen head (tests/test_train_run.py's warm start)


def test_bad_config_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: x\n   dtype: float32\n")  # over-indented
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 3, column 9\).*check its indentation"):
        load_config(bad)
    bad.write_text("model:\n  name: x\nmodel:\n  dtype: float32\n")  # a section given twice: not an indentation slip
    with pytest.raises(ConfigError, match=r"\(line 3, column 1\): found duplicate key model; give each key once "
                                          r"\(merge the two\)$"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- model\n- head\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections .* got a list"):
        load_config(lst)
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(tmp_path)


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """A YAML file saved as UTF-16 (Windows Notepad) or Latin-1 was a UnicodeDecodeError traceback in every program;
    it is one ConfigError line saying to save it as UTF-8. UTF-8 with a byte-order mark reads as UTF-8."""
    from spd_ds.commands import eval as eval_cmd

    text = "decoding:\n  max_new_tokens: 8\n  stop: ['Caf\u00e9']\n"
    cases = {"u16.yaml": (text.encode("utf-16"), "it is UTF-16, as Windows Notepad saves it"),
             "u16le.yaml": (text.encode("utf-16-le"), "it holds NUL bytes, as UTF-16 text does"),
             "latin.yaml": (text.encode("latin-1"), "invalid continuation byte at byte ")}
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=rf"^config file {tmp_path / name} is not UTF-8 text \({why}.*\); save it "
                                              "as UTF-8$"):
            load_config(tmp_path / name)
    assert eval_cmd.main(["--config", str(tmp_path / "u16.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"error: config file {tmp_path / 'u16.yaml'} is not "
                                                                "UTF-8 text (it is UTF-16, as Windows Notepad saves "
                                                                "it); save it as UTF-8")
    (tmp_path / "bom.yaml").write_bytes(text.encode("utf-8-sig"))
    assert load_config(tmp_path / "bom.yaml").decoding.stop == ["Caf\u00e9"]


def test_a_cuda_device_without_cuda_is_a_config_error(monkeypatch):
    import torch

    from spd_ds.builder import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError,
                       match="model.device=cuda but torch .* sees no CUDA device here; use model.device=cpu"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")


def test_compile_teacher_auto_is_inductor_on_cuda_and_eager_elsewhere(monkeypatch):
    import torch

    from spd_ds.train import teacher
    from spd_ds.train.teacher import compile_backend

    assert load_config(None).train.compile_teacher == load_config(None).train.compile_loss == "auto"
    assert load_config(None, ["train.compile_teacher=null"]).train.compile_teacher is None
    monkeypatch.setattr(teacher, "_has_triton", lambda: True)
    assert compile_backend("auto", torch.device("cuda", 0)) == "inductor"
    assert compile_backend("auto", torch.device("cpu")) is None
    monkeypatch.setattr(teacher, "_has_triton", lambda: False)  # inductor's GPU kernels need Triton: eager then
    assert compile_backend("auto", torch.device("cuda", 0)) is None
    assert compile_backend("aot_eager", torch.device("cpu")) == "aot_eager"
    assert compile_backend(None, torch.device("cuda", 0)) is None


def test_teacher_attention_auto_is_sdpa_and_flex_is_selectable():
    import torch

    from spd_ds.train.teacher import teacher_attention

    assert load_config(None).train.teacher_attention == "auto"
    assert teacher_attention("auto", torch.device("cuda", 0)) == "sdpa"  # measured faster on an H200
    assert teacher_attention("auto", torch.device("cpu")) == "sdpa"
    assert teacher_attention("flex", torch.device("cuda", 0)) == "flex"
    assert teacher_attention("sdpa", torch.device("cpu")) == "sdpa"
    with pytest.raises(ValueError, match="train.teacher_attention must be"):
        teacher_attention("eager", torch.device("cpu"))


def test_head_cuda_graph_is_the_default_and_old_saved_configs_load(tmp_path):
    from spd_ds.builder import head_cuda_graph

    assert load_config(None).head.cuda_graph is True and head_cuda_graph(load_config(None), "cuda")
    assert not head_cuda_graph(load_config(None), "cpu")  # the head runs eagerly on CPU
    # configs saved by older versions of train.py hold `cuda_graph: null`: the default
    (tmp_path / "old.yaml").write_text("head:\n  cuda_graph: null\n")
    old = load_config(tmp_path / "old.yaml")
    assert old.head.cuda_graph is None and head_cuda_graph(old, "cuda")
    assert not head_cuda_graph(load_config(None, ["head.cuda_graph=false"]), "cuda")
    with pytest.raises(ConfigError):
        load_config(None, ["head.cuda_graph=maybe"])


def test_sdpa_backends_default_is_per_device_and_bad_lists_are_one_line_errors():
    assert load_config(None).model.sdpa_backends is None  # the device's DEFAULT_SDPA_BACKENDS
    assert load_config(None, ["model.sdpa_backends=null"]).model.sdpa_backends is None
    assert load_config(None, ["model.sdpa_backends=[efficient, math]"]).model.sdpa_backends == ["efficient", "math"]
    for bad in ("[]", "[fast]", "[efficient, cuDNN]"):
        with pytest.raises(ConfigError, match="model.sdpa_backends must list") as e:
            load_config(None, [f"model.sdpa_backends={bad}"])
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="takes a list"):
        load_config(None, ["model.sdpa_backends=math"])


def test_sdpa_backends_that_cannot_run_every_call_are_refused_per_device(sdpa_flags):
    from spd_ds.builder import set_sdpa_backends

    for backends, device in ((["efficient"], "cpu"), (["cudnn"], "cpu"), (["flash"], "cuda"), (["cudnn"], "cuda")):
        with pytest.raises(ConfigError, match="cannot run every attention call") as e:
            set_sdpa_backends(backends, device)
        assert "\n" not in str(e.value)
    set_sdpa_backends(["flash"], "cpu")  # CPU's flash kernel takes masks
    set_sdpa_backends(["efficient", "cudnn"], "cuda")


def test_build_arch_sets_the_sdpa_backends_for_decoding_only(sdpa_flags):
    from spd_ds.builder import build_arch, set_sdpa_backends

    def flags():
        c = sdpa_flags
        return (c.flash_sdp_enabled(), c.mem_efficient_sdp_enabled(), c.math_sdp_enabled(), c.cudnn_sdp_enabled())

    sdpa_flags.enable_cudnn_sdp(True)
    build_arch(load_config(None, ["model.name=random:qwen3.5-tiny"]), decoding=False)  # training: untouched
    assert flags() == (True, True, True, True)
    build_arch(load_config(None, ["model.name=random:qwen3.5-tiny", "model.device=cpu"]))  # CPU default: no cuDNN
    assert flags() == (True, True, True, False)
    sdpa_flags.enable_cudnn_sdp(True)
    set_sdpa_backends(None, "cuda")  # the CUDA default: the memory-efficient kernel (every call passes a mask there)
    assert flags() == (False, True, True, False)
    build_arch(load_config(None, ["model.name=random:qwen3.5-tiny", "model.sdpa_backends=[math, cudnn]"]))
    assert flags() == (False, False, True, True)


def test_a_section_that_is_not_a_mapping_is_named_and_an_empty_one_keeps_its_defaults(tmp_path):
    """``decoding: 5`` gave OmegaConf's 'Merge error: int is not a subclass of DecodingConfig'; a section whose keys are
    all commented out gave "field 'decoding' is not Optional"."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("decoding: [1]\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value).startswith(f"config file {bad}: section decoding must be a mapping of keys (decoding:, then "
                                   "indented key: value lines), got [1]; valid keys of decoding: max_new_tokens")
    empty = tmp_path / "empty.yaml"
    empty.write_text("decoding:\n#  temperature: 0.7\nhead:\n  placement: dedicated\n")
    cfg = load_config(empty)
    assert cfg.decoding.temperature == 0.0 and cfg.head.placement == "dedicated"
    typo = tmp_path / "typo.yaml"
    typo.write_text("moddel:\n#  name: x\n")  # a misspelled section stays an error even when it is empty
    with pytest.raises(ConfigError, match=r"unknown config key 'moddel' \(did you mean 'model'\?\); sections: model, "):
        load_config(typo)


def test_an_unknown_distributed_backend_is_a_config_error():
    """It was DeepSpeed's AssertionError on every rank (exit status 1), and accepted silently in one process."""
    with pytest.raises(ConfigError, match=r"^deepspeed.backend must be one of gloo, nccl, ccl, mpi, ucc, xccl, hccl, "
                                          r"a per-device map such as cpu:gloo,cuda:nccl, or null"):
        load_config(None, ["deepspeed.backend=foo"])
    for ok in ("gloo", "NCCL", "cpu:gloo,cuda:nccl"):  # torch lowercases names and takes device maps
        assert load_config(None, [f"deepspeed.backend={ok}"]).deepspeed.backend == ok


def test_an_empty_training_output_dir_is_refused():
    """Path('') is '.': training wrote its checkpoints and heads into the working directory."""
    with pytest.raises(ConfigError, match=r"^train.output_dir is empty; give the run's folder"):
        load_config(None, ["train.output_dir=''"])


@pytest.mark.parametrize("override,message", [
    ("data.prompts=[a,b]", "data.prompts takes one value (a string), not a list; give one, e.g. data.prompts=mt_bench"),
    ("model.name=[a]", "model.name takes one value (a string), not a list; give one, e.g. "
                       "model.name=smollm2-135m-instruct"),
    ("model.name={a: 1}", "model.name takes one value (a string), not a mapping; give one, e.g. "
                          "model.name=smollm2-135m-instruct"),
    ("partition.num_stages=[2]", "partition.num_stages takes one value (an integer), not a list; give one, e.g. "
                                 "partition.num_stages=2"),
    ("data.pack=[true]", "data.pack takes one value (true or false), not a list; give one, e.g. data.pack=true"),
])
def test_a_list_given_to_a_one_value_key_is_a_one_line_error(override, message, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == message
    key, value = override.split("=", 1)  # the same value in an experiment file
    section, name = key.split(".")
    (tmp_path / "e.yaml").write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "e.yaml")
    assert str(e.value) == message


@pytest.mark.parametrize("entry,message", [
    ("eval:\n  baselines: ar\n", "eval.baselines takes a list, got one value; write a YAML list, e.g. baselines: "
                                "[a, b] in the file (eval.baselines='[a, b]' on the command line)"),
    ("partition:\n  stage_layers: 15,15\n", "partition.stage_layers takes a list, got one value; write a YAML list, "
                                            "e.g. stage_layers: [2] in the file (partition.stage_layers='[2]' on the "
                                            "command line)"),
    ("eval:\n  oracle_alphas: 0.5\n", "eval.oracle_alphas takes a list, got one value; write a YAML list, e.g. "
                                     "oracle_alphas: [0.5] in the file (eval.oracle_alphas='[0.5]' on the command "
                                     "line)"),
])
def test_one_value_given_to_a_list_key_in_a_yaml_file_is_a_one_line_error(entry, message, tmp_path):
    """The experiment file's `key: value` for a list key gave OmegaConf's "Invalid value assigned: AnyNode is not a
    ListConfig, TupleConfig, list, or tuple" (the override form already said how to write the list)."""
    (tmp_path / "e.yaml").write_text(entry)
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "e.yaml")
    assert str(e.value) == message


def test_a_leading_tilde_in_a_path_setting_is_the_home_folder(tmp_path, monkeypatch):
    # bash leaves "train.output_dir=~/x" alone (the word is no assignment) and YAML never expands: a run wrote into a
    # folder named "~" under the working directory
    monkeypatch.setenv("HOME", str(tmp_path))
    exp = tmp_path / "exp.yaml"
    exp.write_text("train:\n  output_dir: ~/runs/head\neval:\n  prompt_sets: [~/sets/mine.jsonl, mt_bench]\n")
    cfg = load_config(exp, ["head.checkpoint=~/heads/h", "deepspeed.config=~/ds.json", "data.prompts=humaneval",
                            "model.name=~/models/m", "data.chat_template=~/{{ messages }}"])
    assert cfg.train.output_dir == f"{tmp_path}/runs/head"
    assert cfg.eval.prompt_sets == [f"{tmp_path}/sets/mine.jsonl", "mt_bench"]
    assert (cfg.head.checkpoint, cfg.deepspeed.config) == (f"{tmp_path}/heads/h", f"{tmp_path}/ds.json")
    assert cfg.data.prompts == "humaneval" and cfg.model.cache_dir is None  # names and nulls stay as they are
    assert cfg.model.name == f"{tmp_path}/models/m"  # a local model folder (config.yaml records it expanded)
    assert cfg.data.chat_template == "~/{{ messages }}"  # a file or Jinja text: the file's ~ is chat.py's to expand


def test_a_chat_template_that_is_no_template_is_refused_before_any_model_loads(tmp_path, capsys):
    """data.chat_template was checked by training alone: eval, infer and benchmark took a CSV as the template (every
    prompt the same tokens) or failed in jinja2 once the model had loaded. load_config refuses it in one line, so
    every program does before its model resolves (here: one that does not exist)."""
    from spd_ds.commands import eval as eval_cmd, infer

    csv = tmp_path / "prompts.csv"
    csv.write_text("id,prompt\n1,hello\n")
    with pytest.raises(ConfigError, match=rf"^data.chat_template: chat template file {csv} holds no Jinja"):
        load_config(None, [f"data.chat_template={csv}"])
    with pytest.raises(ConfigError, match=r"^data.chat_template: chat template '\{\{ messages \}\{% if %\}' is not "
                                          r"valid Jinja \(line 1: "):
        load_config(None, ["data.chat_template='{{ messages }{% if %}'"])
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_config(None, [f"data.chat_template={tmp_path / 't.jinja'}"]).data.chat_template
    ov = [f"data.chat_template={csv}", f"model.name={tmp_path / 'no_model'}", f"eval.output_dir={tmp_path / 'ev'}"]
    for run in (lambda: eval_cmd.main(ov), lambda: infer.main(["--prompt", "hi", *ov])):
        assert run() == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: data.chat_template: chat template "
                                                                           f"file {csv} holds no Jinja")
    assert not (tmp_path / "ev").exists()
