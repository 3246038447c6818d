"""spd_ds.cli: overrides anywhere on the command line, CPU threads per rank, one error line per failing rank."""

from __future__ import annotations

import argparse
import importlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spd_ds import cli, cli_args
from spd_ds.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "launch" / "configs" / "smollm2_spd.yaml"


def launcher_module(name: str):
    """The command behind ``launch/<name>.py`` (``spd_ds.commands.<name>``)."""
    return importlib.import_module(f"spd_ds.commands.{name}")


# ---------------------------------------------------------------------------------------------- item 11
@pytest.mark.parametrize("prog", ["infer", "eval", "benchmark", "pipe_bench"])
def test_a_second_config_file_is_refused_not_silently_kept_instead_of_the_first(prog, capsys):
    """argparse kept the last of two --config files, so `--config base.yaml --config mine.yaml` ran mine.yaml alone
    (files are not layered), without a word."""
    if prog == "pipe_bench":  # its parser is made inside main
        parse = launcher_module(prog).main
    else:
        parse = launcher_module(prog).parse_args
        assert parse(["--config", "a.yaml", "x.y=1"]).config == "a.yaml"
    with pytest.raises(SystemExit) as e:
        parse(["--config", "a.yaml", "--config", "b.yaml"] if prog == "pipe_bench" else
              ["--config", "a.yaml", "x.y=1", "--config", "b.yaml"])
    assert e.value.code == 2
    assert "error: --config is given twice ('a.yaml' and 'b.yaml'); give one (files are not layered: put further " \
           "settings as section.key=value overrides)" in capsys.readouterr().err


def test_repeated_lists_the_values_given_twice():
    """The one check behind the lists refused with a value given twice (--suite / --stages / --alphas,
    eval.baselines, oracle alphas): the values equal to an earlier one, in order."""
    from spd_ds.cli_args import repeated

    assert repeated([]) == [] and repeated(["ar", "ar_graph"]) == []
    assert repeated(["ar", "ar_graph", "ar", "ar_graph", "ar"]) == ["ar", "ar_graph", "ar"]
    assert repeated([2, 3, 2.0]) == [2.0]  # equal, not identical


def test_overrides_before_and_after_options():
    infer = launcher_module("infer")
    args = infer.parse_args(["--local_rank=1", "--config", "x.yaml", "deepspeed.timeout_s=20", "--no-compare-ar",
                             "head.placement=dedicated", "--prompt", "hi", "data.num_prompts=2"])
    assert args.overrides == ["deepspeed.timeout_s=20", "head.placement=dedicated", "data.num_prompts=2"]
    assert args.config == "x.yaml" and args.compare_ar is False and args.prompt == ["hi"]
    ev = launcher_module("eval").parse_args(["a.b=1", "--strict-exact", "c.d=2", "--engine", "reference"])
    assert ev.overrides == ["a.b=1", "c.d=2"] and ev.strict_exact and ev.engine == "reference"
    bench = launcher_module("benchmark").parse_args(["e.f=3", "--out", "o", "g.h=4", "--suite", "c"])
    assert bench.overrides == ["e.f=3", "g.h=4"] and bench.suite == ["c"] and bench.out == "o"
    # --prompt-sets takes every word up to the next option: the overrides among them are given back as overrides
    bench = launcher_module("benchmark").parse_args(["--prompt-sets", "gsm8k", "runs/my.set.jsonl",
                                                     "data.eval_dir=runs/eval_sets", "model.device=cpu",
                                                     "--suite", "c"])
    assert bench.prompt_sets == ["gsm8k", "runs/my.set.jsonl"]
    assert bench.overrides == ["data.eval_dir=runs/eval_sets", "model.device=cpu"]
    bench = launcher_module("benchmark").parse_args(["--prompt-sets", "gsm8k", "x.y=2", "--out", "o", "x.y=3"])
    assert bench.overrides == ["x.y=2", "x.y=3"]  # command-line order: the later one wins
    with pytest.raises(SystemExit):  # nothing but overrides after --prompt-sets
        launcher_module("benchmark").parse_args(["--prompt-sets", "model.device=cpu"])


def test_benchmark_overrides_after_options_that_take_several_values():
    """An override after --stages, --suite or --alphas was taken for one of its values: argparse said "argument
    --stages: invalid int value: 'decoding.temperature=1'", as if the stage count were wrong."""
    bench = launcher_module("benchmark").parse_args(["--suite", "c", "model.device=cpu", "--stages", "2", "3",
                                                     "decoding.temperature=1", "--alphas", "1", "0.5", "x.y=2",
                                                     "--out", "o", "x.y=3"])
    assert bench.suite == ["c"] and bench.stages == [2, 3] and bench.alphas == [1.0, 0.5] and bench.out == "o"
    assert bench.overrides == ["model.device=cpu", "decoding.temperature=1", "x.y=2", "x.y=3"]
    with pytest.raises(SystemExit):  # nothing but overrides after --stages
        launcher_module("benchmark").parse_args(["--stages", "model.device=cpu"])


@pytest.mark.parametrize("alphas", [["2"], ["1", "-0.5"], ["nan"]])
def test_benchmark_refuses_an_oracle_alpha_outside_0_1_when_the_command_line_is_read(alphas, capsys):
    """``--alphas 2`` reached suite b's evaluation only: suite a ran to its end first (minutes), then the run stopped
    on 'oracle alpha must be in [0, 1], got 2.0'. Refused in one argparse line (exit status 2) before any suite."""
    with pytest.raises(SystemExit) as e:
        launcher_module("benchmark").parse_args(["--suite", "a", "b", "--alphas", *alphas])
    assert e.value.code == 2 and "argument --alphas: must be >= 0 and <= 1" in capsys.readouterr().err


def test_infer_takes_overrides_after_options():
    """The issue's command line: overrides after ``--no-compare-ar`` reach the config (the unknown key proves it:
    argparse no longer says ``unrecognized arguments``)."""
    r = subprocess.run([sys.executable, "launch/infer.py", "--config", str(CONFIG), "deepspeed.timeout_s=20",
                        "--no-compare-ar", "head.placement=dedicated", "partition.stages=3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "unrecognized arguments" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: unknown config key 'partition.stages'")


# ---------------------------------------------------------------------------------------------- item 5
@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_per_rank_unless_the_user_set_them(restore_threads):
    env = {"LOCAL_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2"}  # what `deepspeed --num_gpus 2` sets
    assert cli.configure_cpu_threads(env, cores=8) == 4
    assert env["OMP_NUM_THREADS"] == "4" and torch.get_num_threads() == 4
    assert cli.configure_cpu_threads({"LOCAL_WORLD_SIZE": "3"}, cores=2) == 1  # torchrun; never below one
    assert torch.get_num_threads() == 1
    user = {"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}
    assert cli.configure_cpu_threads(user, cores=8) is None and user["OMP_NUM_THREADS"] == "3"  # the user's wins
    assert cli.configure_cpu_threads({}, cores=8) is None  # one process: torch's default
    assert cli.local_world_size({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4


@pytest.mark.parametrize("local, warned", [(3, True), (2, False)])
def test_more_ranks_than_cores_is_a_warning(local, warned, monkeypatch, caplog):
    # 3 ranks on 2 cores ran at a fraction of the speed with only an info line about threads
    monkeypatch.setattr(cli, "configure_cpu_threads", lambda: 1)
    monkeypatch.setattr(cli, "local_world_size", lambda environ=None: local)
    monkeypatch.setattr(cli, "usable_cores", lambda: 2)
    monkeypatch.setattr(cli, "settle_accelerator", lambda: None)
    monkeypatch.setattr(cli, "watch_launcher", lambda: None)
    with caplog.at_level(logging.INFO, logger=cli.log.name):
        cli.setup_process()
    (record,) = [r for r in caplog.records if "local ranks" in r.getMessage()]
    assert record.getMessage().startswith(f"{local} local ranks on 2 CPU cores: 1 thread(s) per rank")
    assert (record.levelno == logging.WARNING) == warned == ("expect a slow run" in record.getMessage())


# ---------------------------------------------------------------------------------------------- item 13
def _launched(monkeypatch, rank=1, world=2):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


def test_user_error_is_one_rank_tagged_line(monkeypatch, capsys):
    _launched(monkeypatch)

    def main(argv):
        raise ConfigError("partition.num_stages=31 exceeds the model's 30 decoder layers")

    assert cli.run_cli(main, [], user_errors=(ConfigError,)) == 2
    err = capsys.readouterr().err
    assert err == "error (rank 1 of 2): partition.num_stages=31 exceeds the model's 30 decoder layers\n"


def test_other_error_under_a_launcher_is_one_line_and_a_traceback_file(monkeypatch, capsys, tmp_path):
    _launched(monkeypatch, rank=2, world=3)
    monkeypatch.setenv(cli.LOG_DIR_ENV, str(tmp_path))

    def main(argv):
        raise RuntimeError("rank 2 (target stage 1): receiving from rank 1 failed;\na rank died")

    assert cli.run_cli(main, [], prog="infer") == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error (rank 2 of 3): RuntimeError: rank 2 (target stage 1)")
    logs = list(tmp_path.glob("spd_ds-infer-rank2-*.log"))
    assert len(logs) == 1 and str(logs[0]) in lines[0] and "Traceback" in logs[0].read_text()
    monkeypatch.setenv(cli.DEBUG_ENV, "1")  # the debug switch: the traceback itself
    with pytest.raises(RuntimeError):
        cli.run_cli(main, [])


def test_other_error_in_one_process_keeps_its_traceback(monkeypatch):
    _launched(monkeypatch, rank=0, world=1)

    def main(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        cli.run_cli(main, [], user_errors=(ConfigError,))


def test_user_errors_may_be_a_function_called_only_after_an_exception(monkeypatch, capsys):
    _launched(monkeypatch, rank=0, world=1)
    calls = []

    def errors():
        calls.append(1)
        return (ConfigError,)

    assert cli.run_cli(lambda argv: 0, [], user_errors=errors) == 0 and not calls
    def main(argv):
        raise ConfigError("train.lr must be >= 0, got -1")

    assert cli.run_cli(main, [], user_errors=errors) == 2 and calls == [1]
    assert capsys.readouterr().err == "error: train.lr must be >= 0, got -1\n"
    with pytest.raises(KeyError):
        cli.run_cli(lambda argv: {}["a bug"], [], user_errors=errors)


EXPERIMENT_PROGRAMS = ("train", "infer", "eval", "benchmark")  # built on cli.experiment_parser
DATA_PROGRAMS = ("build_draft_vocab", "prepare_train_data", "prepare_eval_data")  # their own parsers


@pytest.mark.parametrize("program,flag", [(p, f) for p in (*DATA_PROGRAMS, *EXPERIMENT_PROGRAMS,
                                                                      "pipe_bench") for f in ("--help", "--version")])
def test_program_help_and_version_do_not_import_torch(program, flag):
    """``--help`` and ``--version`` exit 0 at once, torch not imported;
    ``--version`` prints one line: spd-ds's version, then torch's, deepspeed's and transformers' (their metadata)."""
    from importlib.metadata import version

    import spd_ds

    code = (f"import sys; from spd_ds.commands.{program} import main\n"
            f"try:\n    main([{flag!r}])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "else:\n    raise AssertionError('no exit')\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if flag == "--help":
        assert "usage:" in r.stdout and "--version" in r.stdout, r.stdout
    else:
        assert r.stdout == (f"spd-ds {spd_ds.__version__} (torch {version('torch')}, deepspeed {version('deepspeed')}, "
                            f"transformers {version('transformers')})\n") and r.stderr == "", (r.stdout, r.stderr)


def test_version_is_the_distributions_and_import_spd_ds_stays_light(monkeypatch):
    """``spd_ds.__version__``: the installed distribution's (setup.cfg's version, which ``pip show spd-ds`` shows),
    read on first use (``import spd_ds`` imports neither torch nor importlib.metadata); setup.cfg's when the
    distribution is not installed (a checkout on PYTHONPATH)."""
    import configparser
    import importlib.metadata

    import spd_ds

    cp = configparser.ConfigParser()
    cp.read(ROOT / "setup.cfg")
    assert spd_ds.__version__ == importlib.metadata.version("spd-ds") == cp["metadata"]["version"]
    r = subprocess.run([sys.executable, "-c", "import sys, spd_ds; print(sorted({'torch', 'importlib.metadata'} & "
                        "set(sys.modules)))"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout == "[]\n", r.stdout + r.stderr

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert spd_ds._read_version() == cp["metadata"]["version"]


def test_ctrl_c_is_one_line_and_the_process_dies_of_sigint():
    """One line, no traceback; then the process ends by SIGINT (as an uncaught KeyboardInterrupt ends it), so that
    a shell loop around the program stops too."""
    import signal

    code = ("import os; os.environ.update(RANK='1', WORLD_SIZE='2'); from spd_ds import cli\n"
            "def main(argv):\n    raise KeyboardInterrupt\n"
            "cli.run_cli(main, [])\nprint('not reached')")
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == -signal.SIGINT, (r.returncode, r.stderr)
    assert r.stderr == "error (rank 1 of 2): interrupted\n" and "not reached" not in r.stdout
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**env, cli.DEBUG_ENV: "1"})
    assert "Traceback" in r.stderr and "KeyboardInterrupt" in r.stderr  # the debug switch: the traceback itself


def test_launcher_watch_step(monkeypatch):
    """spd_ds.launcher_watch.watch_launcher's rule: the launcher gone (this rank reparented), or the deepspeed
    command gone (the launcher reparented); a /proc read that fails says nothing (it must not stop a healthy run)."""
    from spd_ds import launcher_watch as lw

    parents = {"me": 100, 100: 50}
    monkeypatch.setattr(lw.os, "getppid", lambda: parents["me"])
    monkeypatch.setattr(lw, "_parent_of", lambda pid: parents.get(pid))
    assert lw._watch_step(100, 50) is None
    parents[100] = None  # unreadable
    assert lw._watch_step(100, 50) is None
    parents[100] = 1  # the runner ended: the launcher was reparented
    assert lw._watch_step(100, 50) == "runner"
    assert lw._watch_step(100, None) is None  # the launcher's parent is not watched (not deepspeed, or not rank 0)
    parents["me"] = 1  # the launcher itself ended
    assert lw._watch_step(100, 50) == "launcher" and lw._watch_step(100, None) == "launcher"
    assert lw._is_ds_runner([b"/usr/bin/python3", b"/venv/bin/deepspeed", b"--num_gpus", b"2"])
    assert lw._is_ds_runner([b"python", b"-m", b"deepspeed.launcher.runner"])
    assert not lw._is_ds_runner([b"bash", b"-c", b"python -m deepspeed.launcher.launch x"])
    assert not lw._is_ds_runner(None)
    assert lw.watch_launcher() is None  # pytest's parent is no DeepSpeed launcher


def test_launcher_watch_lines_reach_stderr_while_deepspeed_points_it_elsewhere(tmp_path):
    """DeepSpeed's op builder points file descriptor 2 at a temporary file while it compiles (a rank JIT-building an
    op); the launcher watch's line ("the deepspeed command ... has ended") written then went there and was lost. The
    watch writes through cli.stderr_writer, made when the watch starts: its line reaches the real stderr."""
    elsewhere = tmp_path / "stderr.txt"
    code = ("import os\nfrom spd_ds import cli\nsay = cli.stderr_writer()\n"
            f"f = open({str(elsewhere)!r}, 'w'); old = os.dup(2); os.dup2(f.fileno(), 2)\n"
            "say('the watch line')\nos.dup2(old, 2)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    assert "the watch line" in r.stderr and "the watch line" not in elsewhere.read_text()


@pytest.mark.parametrize("argv,message", [
    (["--baseline-prompts", "-1"], "argument --baseline-prompts: must be >= 0, got -1"),
    (["--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
])
def test_benchmark_numbers_are_checked_by_their_own_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        launcher_module("benchmark").build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_benchmark_builds_its_parser_once_and_passes_the_options_keys(tmp_path, monkeypatch):
    """The benchmark built its parser a second time to read the options' defaults; once is enough. The config keys
    of the options given on the command line still reach replaced_file_settings as the user's own settings."""
    from spd_ds.eval import benchmark as bm

    bench, built = launcher_module("benchmark"), []
    real = bench.build_parser
    monkeypatch.setattr(bench, "build_parser", lambda: built.append(1) or real())
    monkeypatch.setattr(bench, "setup_process", lambda: None)  # no thread settings or launcher watch in pytest
    monkeypatch.setattr(bench, "setup_logging", lambda: None)

    class Stop(Exception):
        pass

    def stop(base_config, runs, extra=(), suite_cfgs=None):
        raise Stop(list(extra))

    monkeypatch.setattr(bm, "replaced_file_settings", stop)  # the last step before any model is looked for
    with pytest.raises(Stop) as e:
        bench._main(["--suite", "c", "--stages", "2", "--num-prompts", "1", "--out", str(tmp_path / "o"),
                     "decoding.temperature=0"])
    assert e.value.args[0] == ["decoding.temperature=0", "data.num_prompts=", "partition.num_stages="]
    assert len(built) == 1


def test_error_prefix():
    assert cli.error_prefix("error", {}) == "error"
    assert cli.error_prefix("train.py", {"RANK": "0", "WORLD_SIZE": "4"}) == "train.py (rank 0 of 4)"
    assert cli.rank_and_world({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}) == (3, 4)


def test_launcher_variables_read_alike(monkeypatch):
    """Every reader of the launcher's variables knows the same launchers (MVAPICH2's rank was unknown to the error
    prefix while its world size counted) and skips a value that is no number instead of giving up on all."""
    from spd_ds import launch_env
    from spd_ds.pipe.topology import detect_world_size

    mv2 = {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "3"}
    assert cli.rank_and_world(mv2) == (2, 3)
    assert cli.error_prefix("error", mv2) == "error (rank 2 of 3)"
    assert launch_env.launched(mv2) and not launch_env.launched({}) and not launch_env.launched({"RANK": ""})
    assert cli.rank_and_world({"RANK": "x", "PMI_RANK": "1", "WORLD_SIZE": "", "PMI_SIZE": "2"}) == (1, 2)
    assert cli.local_world_size({"SLURM_NTASKS_PER_NODE": "2(x3)"}) == 1  # Slurm's compressed per-node counts
    assert cli.local_world_size({"LOCAL_SIZE": "0", "LOCAL_WORLD_SIZE": "2"}) == 2
    for env, world in (({}, 1), ({"WORLD_SIZE": "5"}, 5), ({"PMI_SIZE": "4"}, 4),
                       ({"WORLD_SIZE": "n", "OMPI_COMM_WORLD_SIZE": "6"}, 6)):
        assert launch_env.world_size(env) == cli.rank_and_world(env)[1] == world
    for key in launch_env.WORLD_SIZE_ENVS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MV2_COMM_WORLD_SIZE", "7")
    assert detect_world_size() == 7 and cli.chosen_engine("auto") == "deepspeed"


# ---------------------------------------------------------------------------------------------- item 8
@pytest.mark.parametrize("env,level", [({}, 20), ({"RANK": "1", "WORLD_SIZE": "2"}, 40),
                                       ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, 40),
                                       ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, 20)])
def test_log_level_is_info_on_rank_0_and_error_on_the_other_ranks(env, level):
    """Open MPI's variables count too: under ``--launcher openmpi`` no RANK is set before the process group."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE") and not k.startswith("OMPI_")}
    code = "import logging; from spd_ds.cli import setup_logging; setup_logging(); print(logging.getLogger().level)"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    assert int(out.stdout) == level


def test_prepare_train_data_help_documents_every_option():
    """Every option of every subcommand says what it is in ``--help`` (regenerate's --model, --out, --limit, ... and
    selfdistill's --model, --temperature, --seed, --chat-template printed their names alone)."""
    import argparse

    from spd_ds.commands.prepare_train_data import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == ["export", "export-prompts", "regenerate", "selfdistill"]
    undocumented = [f"{name} {a.option_strings[0]}" for name, sp in sub.choices.items() for a in sp._actions
                    if a.help in (None, "")]
    assert undocumented == []


def test_benchmark_help_documents_every_flag_and_its_paths_exist():
    import argparse
    import re

    bench = launcher_module("benchmark")
    ap = bench.build_parser()
    undocumented = [a.option_strings or a.dest for a in ap._actions if a.help in (None, "")]
    assert undocumented == []
    assert all(a.help != argparse.SUPPRESS or a.dest == "local_rank" for a in ap._actions)
    text = ap.format_help()
    for pattern in re.findall(r"'([\w./{}-]+\{n\}[\w./-]*)'", text):  # head patterns in the examples
        if not pattern.startswith("runs/"):  # runs/...: the user's own training output, named as such
            assert (ROOT / pattern.format(n=2)).is_dir(), pattern
    assert "Needs a GPU" in text and "a c on CPU" in text


def test_readme_commands_name_files_that_exist():
    """Every repository path in the README's commands (configs, launchers, DeepSpeed JSON, heads) exists."""
    import re

    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"`((?:python|deepspeed|OMP_NUM_THREADS|bash)[^`]*)`", readme)
    commands += re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    paths = {tok for cmd in commands for tok in re.split(r"[\s=]+", cmd)
             if re.match(r"^(launch|ds_configs|spd_ds|draft_vocab|scripts|docs)/[\w./-]+$", tok)}
    assert paths and sorted(p for p in paths if not (ROOT / p).exists()) == []


# ---------------------------------------------------------------------------------------------- item 5 (hostfile)
# test_localhost_hostfile_with_the_documented_flags is in tests/test_pipe_engine.py: its 2-rank launch is world2's
# (``deepspeed --hostfile hosts --no_ssh_check --master_addr 127.0.0.1``), one launch instead of two.


# ---------------------------------------------------------------------------------------------- issue 13 item 5
def test_console_scripts_are_declared_and_resolve_to_the_launchers_main():
    """setup.cfg declares the pip console scripts; each names a callable ``main`` in spd_ds.commands, and
    ``launch/<name>.py`` is a thin wrapper around that same ``main``."""
    import configparser

    cp = configparser.ConfigParser()
    cp.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in cp["options.entry_points"]["console_scripts"].strip().splitlines())
    for name in ("spd-infer", "spd-train", "spd-eval", "spd-bench", "spd-prepare-data"):
        assert name in scripts, name
    for name, target in scripts.items():
        module, func = target.split(":")
        assert module.startswith("spd_ds.commands.") and func == "main", (name, target)
        assert callable(getattr(importlib.import_module(module), func)), name
        wrapper = ROOT / "launch" / f"{module.rsplit('.', 1)[1]}.py"
        assert f"from {module} import main" in wrapper.read_text(), wrapper


def test_no_sys_path_manipulation_anywhere():
    """Nothing puts a path on sys.path: launchers, scripts and tests import the installed package (pip install -e .)."""
    hits = [p.relative_to(ROOT).as_posix()
            for d in ("spd_ds", "launch", "scripts", "tests") for p in (ROOT / d).rglob("*.py")
            if any(f"sys.path.{m}(" in p.read_text() for m in ("insert", "append", "extend"))
            and p.name != "test_cli.py"]
    assert hits == []


def test_launch_wrapper_runs_the_installed_command():
    r = subprocess.run([sys.executable, "launch/eval.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--strict-exact" in r.stdout


def test_closed_stdout_ends_quietly():
    """``launch/infer.py ... | head``: when stdout's reader goes away the program stops with status 141 (128 +
    SIGPIPE) and no traceback, instead of a BrokenPipeError."""
    code = ("import sys\nfrom spd_ds.cli import run_cli\n"
            "def main(argv):\n    for _ in range(100000):\n        print('x' * 1000, flush=True)\n    return 0\n"
            "sys.exit(run_cli(main))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_output_folder_is_made_or_refused_in_one_line_before_the_run(tmp_path):
    """``ensure_output_dir``: a bad output path fails at the start (ConfigError naming the option), not after the run;
    the DeepSpeed logger writes to stderr, so stdout keeps the answers and tables alone."""
    assert cli.ensure_output_dir(tmp_path / "a" / "b", "--out") == str(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(ConfigError, match=r"^--out .* cannot be created as a folder \(a file stands at it"):
            cli.ensure_output_dir(bad, "--out")
    # a folder where no file can be made, though access() says writable (root on /sys): refused, nothing left behind
    before = set(os.listdir(tmp_path / "a" / "b"))
    cli.check_output_file(str(tmp_path / "a" / "b" / "out.jsonl"), "--output")
    assert set(os.listdir(tmp_path / "a" / "b")) == before
    unwritable = "/sys" if os.path.isdir("/sys/kernel") else None
    if unwritable is None or os.access(unwritable, os.W_OK) is False:  # not root on Linux: a folder made read-only
        unwritable = tmp_path / "ro"
        unwritable.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=r"^--output's folder .* is not writable \(.+\); give another path"):
        cli.check_output_file(os.path.join(unwritable, "out.jsonl"), "--output")
    with pytest.raises(ConfigError, match=r"^--output - is not supported; give a file path"):
        cli.check_output_file("-", "--output")
    for folder in (str(tmp_path / "a"), str(tmp_path / "new") + "/"):  # a folder, or a new one's path: dir/ (its
        with pytest.raises(ConfigError, match=r"names a folder; give a file path inside it$"):  # file was "dir")
            cli.check_output_file(folder, "--output")
    assert not (tmp_path / "new").exists()
    dangling = tmp_path / "dangling.jsonl"  # a link to a file not made yet: its target's folder is checked (made)
    dangling.symlink_to(tmp_path / "later" / "out.jsonl")
    cli.check_output_file(str(dangling), "--output")
    assert (tmp_path / "later").is_dir()
    (tmp_path / "later").rmdir()
    (tmp_path / "later").write_text("a file where the link's folder should be")
    with pytest.raises(ConfigError, match=r"cannot be created as a folder \(a file stands at it"):
        cli.check_output_file(str(dangling), "--output")
    code = ("from spd_ds.cli import settle_accelerator; settle_accelerator(); "
            "from deepspeed.utils import logger; logger.warning('a-later-deepspeed-warning')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == "" and "a-later-deepspeed-warning" in p.stderr
    # DeepSpeed imported before (its notice went to stdout then): the handler is moved, later lines go to stderr
    p = subprocess.run([sys.executable, "-c", "import deepspeed; " + code], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"})
    assert p.returncode == 0 and "a-later-deepspeed-warning" in p.stderr and "a-later" not in p.stdout, p.stderr[-2000:]


def test_output_paths_are_checked_by_every_rank_of_one_node_and_by_rank_0_across_nodes():
    one_node = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2"}
    assert cli.checks_outputs({}) and cli.checks_outputs(one_node)
    assert cli.checks_outputs({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_SIZE": "2"})
    assert not cli.checks_outputs({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_SIZE": "2"})


# ---------------------------------------------------------------------------------------------- FIFO outputs
@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "answers.fifo"
    os.mkfifo(path)
    yield str(path)
    held = cli._FIFO_WRITERS.pop(str(path), None)
    if held is not None:
        os.close(held)


def test_fifo_output_without_a_reader_is_refused_before_the_run(fifo):
    """A FIFO with no reader passed the check, and the final open for writing then blocked forever after the whole
    run: now one line, at the start."""
    with pytest.raises(ConfigError, match=rf"^--output {fifo} is a FIFO with no reader; start the reader first "
                                          r"\(or write to a regular file\)$"):
        cli.check_output_file(fifo, "--output")
    link = os.path.join(os.path.dirname(fifo), "link.jsonl")
    os.symlink(fifo, link)
    with pytest.raises(ConfigError, match="is a FIFO with no reader"):
        cli.check_output_file(link, "--output")


def test_fifo_output_with_a_reader_passes_and_the_reader_sees_no_early_end(fifo):
    """With a reader the check passes; the write end it opened stays open (held until the process ends), so the
    reader does not see end-of-file before the run's own write, which then reaches it."""
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        cli.check_output_file(fifo, "--output")
        cli.check_output_file(fifo, "--output")  # checked twice (two options, two calls): one write end
        assert list(cli._FIFO_WRITERS) == [fifo]
        with pytest.raises(BlockingIOError):  # a writer is there, no data yet: not b"" (end-of-file)
            os.read(reader, 10)
        with open(fifo, "w") as f:  # the program's final write: a reader is there, so it does not block
            f.write("answer\n")
        assert os.read(reader, 10) == b"answer\n"
        os.close(cli._FIFO_WRITERS.pop(fifo))
        assert os.read(reader, 10) == b""  # every writer gone: end-of-file
    finally:
        os.close(reader)


def test_dev_stdout_as_output_file_to_a_pipe():
    """``--output /dev/stdout`` passes when stdout is a pipe (``| tee``; it was refused naming /proc/<pid>/fd, the
    pipe having no path)."""
    code = "from spd_ds.cli import check_output_file; check_output_file('/dev/stdout', '--output'); print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-2000:]


@pytest.mark.parametrize("argv,message", [
    (["regenerate", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    (["regenerate", "--temperature", "nan"], "argument --temperature: must be >= 0, got nan"),
    (["regenerate", "--sample-fraction", "1.5"], "argument --sample-fraction: must be >= 0 and <= 1, got 1.5"),
    (["regenerate", "--time-budget", "0"], "argument --time-budget: must be > 0, got 0"),
    (["selfdistill", "--time-budget", "-5"], "argument --time-budget: must be > 0, got -5"),
    (["selfdistill", "--flush-every", "0"], "argument --flush-every: must be > 0, got 0"),
    (["selfdistill", "--device", "gpu"], "argument --device: 'gpu' is not a device; give cpu, cuda or cuda:N"),
])
def test_data_commands_refuse_numbers_out_of_range(argv, message, capsys):
    """A negative temperature used to decode greedily without a word (regenerate); the parser refuses it, and the
    other numbers out of range, in one line with exit status 2 before anything loads; so is a device name torch does
    not know (it was a RuntimeError traceback after the model had loaded)."""
    from spd_ds.commands.prepare_train_data import main

    with pytest.raises(SystemExit) as e:
        main([argv[0], "--data", "x", "--out", "y", *argv[1:]])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(message)


def test_selfdistill_refuses_a_gpu_the_machine_lacks(monkeypatch, capsys, tmp_path):
    """``selfdistill --device cuda`` on a machine without that GPU: one line (exit status 2) when the command line is
    read, before the model loads and before --out is made (it was torch's 'Torch not compiled with CUDA enabled'
    traceback after the model had loaded)."""
    from spd_ds.commands.prepare_train_data import main

    out = tmp_path / "sd"
    for visible, device, message in ((0, "cuda", "sees no CUDA device here; give cpu"),
                                     (2, "cuda:2", "this machine has 2 visible GPU(s), cuda:0 to cuda:1")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=visible: v > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda v=visible: v)
        with pytest.raises(SystemExit) as e:
            main(["selfdistill", "--data", "x", "--out", str(out), "--device", device])
        assert e.value.code == 2 and message in capsys.readouterr().err and not out.exists()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli_args.torch_device("cuda:1") == "cuda:1" and cli_args.torch_device("cpu") == "cpu"


def test_selfdistill_refuses_a_compile_cache_it_could_not_write(tmp_path, capsys):
    """``selfdistill --compile-cache`` naming a folder (or a path below a file) ran to the end and then saved nothing
    (``0 bytes saved``, the compiled kernels lost); now one line, exit status 2, before the model resolves (here it
    does not exist), leaving no --out folder behind."""
    from spd_ds.commands.prepare_train_data import main

    out = tmp_path / "sd"
    (tmp_path / "file").write_text("")
    for cache, message in ((f"{tmp_path}", "names a folder; give a file path inside it"),
                           (f"{tmp_path}/new/", "names a folder; give a file path inside it"),
                           (f"{tmp_path}/file/cc.bin", "'s folder TMP/file cannot be created as a folder (a file "
                                                       "stands at it or above it)")):
        message = "--compile-cache" + ("" if message.startswith("'") else f" {cache} ") + message.replace("TMP",
                                                                                                         str(tmp_path))
        assert main(["selfdistill", "--model", str(tmp_path / "no_model"), "--data", "x", "--out", str(out),
                     "--compile-cache", cache]) == 2
        assert message in capsys.readouterr().err and not out.exists()


def test_float_in_accepts_its_bounds():
    assert cli.float_in(0.0)("0") == 0.0 and cli.float_in(0.0, 1.0)("1") == 1.0
    assert cli.float_in(0.0, above=True)("1e-3") == 1e-3
    for bad in ("inf", "-0.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.float_in(0.0, 1.0)(bad)


def test_an_error_line_is_one_write(monkeypatch):
    """Ranks share the terminal: each error line goes out in one write with its newline (print wrote the newline
    separately, and two ranks' lines ran together: '...decoding.max_lengtherror (rank 0 of 2): ...')."""
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.run_cli(lambda argv: (_ for _ in ()).throw(ConfigError("bad value")), [],
                       user_errors=(ConfigError,)) == 2
    assert writes == ["error (rank 1 of 2): bad value\n"]


def test_removed_if_left_empty(tmp_path):
    """The folders a failing run created and left empty go; what existed or holds a file stays; success keeps all."""
    with pytest.raises(ConfigError):
        with cli.removed_if_left_empty(tmp_path / "a" / "b"):
            cli.ensure_output_dir(tmp_path / "a" / "b", "x")
            raise ConfigError("refused")
    assert tmp_path.exists() and not (tmp_path / "a").exists()
    with pytest.raises(KeyboardInterrupt):
        with cli.removed_if_left_empty(tmp_path / "a" / "b"):
            cli.ensure_output_dir(tmp_path / "a" / "b", "x")
            (tmp_path / "a" / "keep.txt").write_text("")
            raise KeyboardInterrupt
    assert (tmp_path / "a" / "keep.txt").exists() and not (tmp_path / "a" / "b").exists()
    with cli.removed_if_left_empty(tmp_path / "c"):
        cli.ensure_output_dir(tmp_path / "c", "x")
    assert (tmp_path / "c").is_dir()


@pytest.mark.parametrize("job", ["train", "eval"])
def test_a_refused_run_leaves_no_empty_output_folder(tmp_path, job):
    """A run refused after its output folder was made (to check it early) left that folder behind, empty."""
    out = tmp_path / "runs" / "new"
    if job == "train":  # refused when the DeepSpeed config is read, after train.output_dir is checked
        (tmp_path / "z3.json").write_text('{"zero_optimization": {"stage": 3}}')
        cmd = ["launch/train.py", "--config", "launch/configs/train_smollm2_n2.yaml", "--deepspeed_config",
               str(tmp_path / "z3.json"), f"train.output_dir={out}"]
    else:  # refused when the prompt set is read, after eval.output_dir is checked
        (tmp_path / "empty.jsonl").write_text("")
        cmd = ["launch/eval.py", "--config", str(CONFIG), f"eval.prompt_sets=[{tmp_path / 'empty.jsonl'}]",
               f"eval.output_dir={out}", f"model.name={tmp_path / 'no_model_here'}"]
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))


@pytest.mark.parametrize("job", ["infer", "eval", "benchmark", "train"])
def test_missing_draft_vocab_is_one_line_before_the_model(tmp_path, job):
    """A head.draft_vocab that does not exist (a config saved by a training run elsewhere names one): one line naming
    the file and what to give, exit 2, before the model is resolved (the model named here does not exist) and, in
    training, before the process group. It used to come after the target loaded (train: after the process group)."""
    missing = tmp_path / "vocab" / "sharegpt_16k.json"
    over = [f"head.draft_vocab={missing}", f"model.name={tmp_path / 'no_model_here'}"]
    cmd = {"infer": ["launch/infer.py", "--config", str(CONFIG), *over],  # with the shipped head.checkpoint
           "eval": ["launch/eval.py", "--config", str(CONFIG), f"eval.output_dir={tmp_path / 'out'}", *over],
           "benchmark": ["launch/benchmark.py", "--suite", "c", "--stages", "2", "--out", str(tmp_path / "out"),
                         *over],
           "train": ["launch/train.py", "--config", "launch/configs/train_smollm2_n2.yaml", "--deepspeed_config",
                     "ds_configs/zero2.json", f"train.output_dir={tmp_path / 'out'}", *over]}[job]
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: head.draft_vocab={missing} does not exist; give a draft-vocabulary JSON"), last
    assert "no_model_here" not in p.stderr and "Traceback" not in p.stderr


def test_a_home_folder_after_the_equals_sign_of_a_flag_is_expanded(monkeypatch, tmp_path):
    # the shell expands --out ~/x but leaves --out=~/x: infer --output=~/a.jsonl wrote into ./~/a.jsonl
    from spd_ds.cli_args import home_expanded

    monkeypatch.setenv("HOME", str(tmp_path))
    argv = ["--output=~/a.jsonl", "--config", "~/kept.yaml", "--prompt=~/not a path", "train.output_dir=~/x",
            "--deepspeed_config=~/ds.json", "--name=~x", "--flag=a~b"]
    assert home_expanded(argv) == [f"--output={tmp_path}/a.jsonl", "--config", "~/kept.yaml", "--prompt=~/not a path",
                                   "train.output_dir=~/x", f"--deepspeed_config={tmp_path}/ds.json", "--name=~x",
                                   "--flag=a~b"]
    seen = []
    assert cli.run_cli(lambda a: seen.append(a) or 0, ["--out=~/o"]) == 0 and seen == [[f"--out={tmp_path}/o"]]
    monkeypatch.setattr(sys, "argv", ["infer", "--out=~/p"])
    assert cli.run_cli(lambda a: seen.append(a) or 0) == 0 and seen[-1] == [f"--out={tmp_path}/p"]


class _Broken(io.StringIO):
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


class _NoFlush:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s


@pytest.mark.parametrize("kind", ["open", "no_flush", "none", "closed", "broken_pipe", "no_write", "binary", "ascii"])
def test_notice_writes_the_line_once_to_stderr_or_to_the_log(kind, monkeypatch, capsys, caplog):
    """``cli.notice``: the line on stderr where it can be written (a missing flush loses nothing), else in the log at
    INFO, never both, never on stdout, never an exception."""
    closed = io.StringIO()
    closed.close()
    ascii_err = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    stream = {"open": io.StringIO(), "no_flush": _NoFlush(), "none": None, "closed": closed, "broken_pipe": _Broken(),
              "no_write": object(), "binary": io.BytesIO(), "ascii": ascii_err}[kind]
    text = "spd_ds: converting /tmp/modèle once"  # not ASCII: an ASCII-only stderr cannot take it
    monkeypatch.setattr(sys, "stderr", stream)
    with caplog.at_level(logging.INFO, logger="spd_ds.test_notice"):
        cli.notice(text, logging.getLogger("spd_ds.test_notice"))
    monkeypatch.undo()
    written = {"open": lambda: stream.getvalue(), "no_flush": lambda: stream.text}.get(kind, lambda: "")()
    assert capsys.readouterr().out == ""
    assert written == (text + "\n" if kind in ("open", "no_flush") else "")
    assert caplog.text.count(text) == (0 if kind in ("open", "no_flush") else 1)


def test_notice_survives_a_log_handler_on_the_same_closed_stderr(monkeypatch):
    """The launchers log to stderr (logging.basicConfig): with that stream closed, the fallback's handler fails too and
    logging's own error report writes to it again (ValueError); the line is dropped, nothing raised."""
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    log = logging.getLogger("spd_ds.test_notice_closed")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        err.close()
        monkeypatch.setattr(sys, "stderr", err)
        cli.notice("spd_ds: converting once", log)
    finally:
        monkeypatch.undo()
        log.removeHandler(handler)
