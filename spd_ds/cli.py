"""Command-line pieces shared by the ``launch/*.py`` programs: the experiment arguments, the engine choice, CPU
threads per rank, and how a failing rank reports its error.

Error reporting (:func:`run_cli`): a user error (bad config, prompt, head, model, world size) is one line on stderr
and exit status 2; under a launcher (``WORLD_SIZE > 1``) any other exception is one line too, tagged with the rank,
exit status 1, and its traceback goes to a log file (``$SPD_LOG_DIR``, default the system temp directory) named in
that line. Ctrl-C is one line too (``interrupted``), and the process then ends by SIGINT as Python's own handling
does. ``SPD_DEBUG=1`` prints every traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Sequence, Union

from spd_ds.cli_args import GivenOnce, home_expanded
from spd_ds.launch_env import local_world_size, rank_and_world, world_size
from spd_ds.launcher_watch import watch_launcher

ENGINES = ("auto", "reference", "deepspeed")
DEBUG_ENV = "SPD_DEBUG"  # 1: print tracebacks instead of one line per failing rank
LOG_DIR_ENV = "SPD_LOG_DIR"  # where a failing rank writes its traceback (default: the system temp directory)

log = logging.getLogger(__name__)


class ExperimentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose :meth:`parse_args` is ``parse_intermixed_args``: positional ``section.key=value``
    overrides may stand before, between and after the options (``infer.py a.b=1 --no-compare-ar c.d=2``)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # noqa: D102 - see the class
        return self.parse_intermixed_args(args, namespace)


VERSION_OF = ("torch", "deepspeed", "transformers")  # the distributions --version names beside spd-ds


def version_text() -> str:
    """``spd-ds <version> (torch <v>, deepspeed <v>, transformers <v>)``: the installed distributions' versions, read
    from their metadata (nothing is imported: torch's import alone takes seconds); ``not installed`` for one that is
    missing."""
    from importlib.metadata import PackageNotFoundError, version

    import spd_ds

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"spd-ds {spd_ds.__version__} ({', '.join(f'{d} {installed(d)}' for d in VERSION_OF)})"


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` to stdout and exit 0 (argparse's own ``version`` action takes the
    text when the parser is built, which would read the metadata on every run)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text(), flush=True)
        parser.exit()


def add_version_argument(ap: argparse.ArgumentParser) -> None:
    """Give ``ap`` a ``--version`` option (:func:`version_text`; imports no torch)."""
    ap.add_argument("--version", action=_VersionAction,
                    help="print the versions of spd-ds, torch, deepspeed and transformers and exit")


def experiment_parser(description: str | None, *, overrides_help: str, config_help: str | None = None,
                      engine_help: str | None = None) -> ExperimentParser:
    """An :class:`ExperimentParser` with ``--config``, positional ``section.key=value`` overrides (anywhere on the
    command line), ``--engine`` (when ``engine_help`` is given), ``--version`` (:func:`add_version_argument`) and
    the DeepSpeed launcher's ``--local_rank`` (hidden).

    Args:
        description: the program's docstring (shown raw by ``--help``).
        overrides_help, config_help, engine_help: help texts of those arguments.
    """
    ap = ExperimentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action=GivenOnce, help=config_help or "experiment YAML (default: built-in defaults)")
    ap.add_argument("overrides", nargs="*", help=overrides_help + " (before or after the options)")
    if engine_help is not None:
        ap.add_argument("--engine", choices=ENGINES, default="auto", help=engine_help)
    add_version_argument(ap)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def chosen_engine(engine: str) -> str:
    """``auto`` -> ``deepspeed`` when launched with more than one process (``WORLD_SIZE`` or the MPI variables:
    :func:`spd_ds.launch_env.world_size`), else ``reference``; other values unchanged."""
    if engine != "auto":
        return engine
    return "deepspeed" if world_size() > 1 else "reference"


# ---------------------------------------------------------------------------------------------- processes
def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure_cpu_threads(environ=None, cores: int | None = None) -> int | None:
    """Give each rank of a multi-process launch its share of the cores: ``max(1, cores // local ranks)`` torch
    threads (and ``OMP_NUM_THREADS`` for child processes).

    Without it every rank starts one thread per core, so N ranks on a C-core machine run N x C threads that spin
    against each other (seen: ``deepspeed --num_gpus 2`` on 2 cores at 0.5-1.1 tok/s, 9-11 tok/s with one thread
    each). The user's explicit ``OMP_NUM_THREADS`` wins: then nothing changes. A single process is left alone.

    Args:
        environ: the environment to read and update (default ``os.environ``).
        cores: usable cores (default :func:`usable_cores`).
    Returns:
        The number of threads set, or ``None`` when nothing was changed.
    """
    env = os.environ if environ is None else environ
    local = local_world_size(env)
    if local <= 1 or env.get("OMP_NUM_THREADS"):
        return None
    import torch

    threads = max(1, (cores or usable_cores()) // local)
    torch.set_num_threads(threads)
    env["OMP_NUM_THREADS"] = str(threads)
    return threads


def settle_accelerator() -> None:
    """Let DeepSpeed pick its accelerator now, so that its one-time notice ("Setting accelerator to CPU ...") is
    printed before any progress bar instead of inside one (transformers and spd-ds import DeepSpeed lazily); DeepSpeed's
    log lines go to stderr, as the programs' own do, so that stdout holds the answers and tables alone."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed makes its logger's handler on import, on the stdout
            from deepspeed.accelerator import get_accelerator  # of that moment, and logs the notice then

            get_accelerator()
        from deepspeed.utils import logger as ds_logger
    except ImportError:
        return
    for h in ds_logger.handlers:  # DeepSpeed imported before (by another module): move its handler too
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


def checks_outputs(environ=None) -> bool:
    """Whether this rank checks the run's output paths at its start (:func:`ensure_output_dir`): every rank of a
    one-node run (they share its file system, so a bad path stops them all, one line each, before any collective),
    and across nodes rank 0 alone, the rank that writes the results (another node's file system may differ; the
    launcher ends the ranks of rank 0's node, and the other nodes' ranks stop at the rendezvous timeout)."""
    rank, world = rank_and_world(environ)
    return rank == 0 or local_world_size(environ) >= world


@contextlib.contextmanager
def removed_if_left_empty(path: str | os.PathLike):
    """Context of a run that creates output folder ``path`` (:func:`ensure_output_dir`): if the run raises (a refused
    setting, a crash, Ctrl-C) and leaves the folders it created empty, they are removed, innermost first, so that a
    refused run leaves nothing behind; folders that existed before, or hold anything, are kept.

    Args:
        path: the output folder (relative to the working directory or absolute), before the run creates it.
    Raises:
        Whatever the run raises, unchanged (after the cleanup); the cleanup itself raises nothing.
    """
    new, q = [], Path(path).absolute()
    while not q.exists() and q != q.parent:  # the folders this run would create, innermost first
        new.append(q)
        q = q.parent
    try:
        yield
    except BaseException:
        for d in new:
            try:
                d.rmdir()  # only an empty folder; another rank may have removed it already
            except OSError:
                break
        raise


def ensure_output_dir(path: str | os.PathLike, what: str) -> str:
    """Create output folder ``path`` (and its parents) at the start of a run, so that a path that cannot hold the
    results fails in one line before any model is loaded, not after the run.

    Args:
        path: the folder (relative to the working directory or absolute).
        what: how the user named it (``--out``, ``eval.output_dir``), for the message.
    Returns:
        ``path`` as a string.
    Raises:
        ConfigError: a file stands at ``path`` or above it, or the folder cannot be created or a file cannot be
            created in it (tried with a temporary file that leaves nothing behind).
    """
    from spd_ds.config import ConfigError

    if not str(path).strip():
        raise ConfigError(f"{what} is empty; give a folder path")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        why = "a file stands at it or above it" if isinstance(e, (FileExistsError, NotADirectoryError)) else \
            (e.strerror or str(e))
        raise ConfigError(f"{what} {path} cannot be created as a folder ({why}); give another path") from None
    try:  # a real write, not os.access alone: root passes access() on file systems that refuse files (/sys)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"{what} {path} is not writable ({e.strerror or e}); give another path") from None
    return str(path)


_FIFO_WRITERS: dict[str, int] = {}  # FIFO path -> the write end check_output_file holds open until the process ends


def _hold_fifo(path: str, what: str) -> None:
    """Open FIFO ``path``'s write end without blocking and keep it open until the process ends
    (:func:`check_output_file`).

    Without a reader a plain open for writing blocks until one comes (forever, after the whole run); non-blocking,
    it fails with ENXIO instead. The write end stays open so that the reader does not see end-of-file between this
    check and the run's own write (``cat fifo`` would end at once); it closes when the process ends.

    Raises:
        ConfigError: no reader (ENXIO), or the FIFO cannot be opened for writing.
    """
    import errno

    from spd_ds.config import ConfigError

    if path in _FIFO_WRITERS:
        return
    try:
        _FIFO_WRITERS[path] = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise ConfigError(f"{what} {path} is a FIFO with no reader; start the reader first (or write to a "
                              "regular file)") from None
        raise ConfigError(f"{what} {path} is a FIFO that cannot be opened for writing ({e.strerror or e}); give "
                          "another path") from None


def check_output_file(path: str, what: str) -> None:
    """Check an output *file* path now, so that a bad one fails in one line before any work rather than after it:
    an existing file must be writable (``/dev/stdout`` is fine, a pipe or a terminal included), a new one's folder
    is created (:func:`ensure_output_dir`); a folder at ``path`` itself, or a path ending in ``/``, is refused. A FIFO
    (named pipe; also ``/dev/stdout`` when stdout is a pipe) must have a reader already: its write end is opened now
    and held open until the process ends (:func:`_hold_fifo`).

    Args:
        path: the file; what: how the user named it (``--output``, ``--out``), for the message.
    Raises:
        ConfigError: ``path`` is a folder or a file that cannot be written, a FIFO with no reader, or its folder
            cannot be created or written.
    """
    import stat

    from spd_ds.config import ConfigError

    if not path.strip():
        raise ConfigError(f"{what} is empty; give a file path")
    if path == "-":
        raise ConfigError(f"{what} - is not supported; give a file path (/dev/stdout writes to the terminal)")
    try:  # through every link, /proc/self/fd/N's too: a pipe's has no path that realpath could give
        is_fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except (OSError, ValueError):
        is_fifo = False
    if is_fifo:
        _hold_fifo(path, what)
        return
    path = os.path.realpath(path) if os.path.islink(path) else path  # a link's target, even a dangling one's
    if os.path.isdir(path) or path.endswith(("/", os.sep)):  # a new dir/: its file would be written as "dir"
        raise ConfigError(f"{what} {path} names a folder; give a file path inside it")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{what} {path} exists and is not writable; give another path")
        return
    ensure_output_dir(os.path.dirname(path) or ".", f"{what}'s folder")


UserErrors = Union[tuple[type[BaseException], ...], Callable[[], tuple[type[BaseException], ...]]]
"""What ``run_cli`` takes as the user's errors: the exception types, or a function that returns them."""


def decoding_user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are the user's to fix in the decoding programs (infer, eval, benchmark, pipe_bench):
    :data:`spd_ds.eval.runner.USER_ERRORS`, imported only when an error needs sorting (``--help`` stays light)."""
    from spd_ds.eval.runner import USER_ERRORS

    return USER_ERRORS


def data_user_errors(*extra: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The exceptions that are the user's to fix in the data programs (training, data preparation, draft
    vocabularies): bad settings, data (self-distilled folders included), chat templates, models, head checkpoints (a
    warm start); plus ``extra``."""
    from spd_ds.config import ConfigError
    from spd_ds.head import HeadMismatchError
    from spd_ds.models.errors import ModelError
    from spd_ds.train.chat import ChatTemplateError, EmptyMaskError
    from spd_ds.train.data import DataError
    from spd_ds.train.selfdistill.config import SelfDistillError
    from spd_ds.zoo import ModelUnavailableError

    return (ConfigError, DataError, EmptyMaskError, ChatTemplateError, ModelUnavailableError, ModelError,
            HeadMismatchError, SelfDistillError, *extra)


def int_at_least(low: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer ``>= low`` (argparse then refuses other values in one line, exit status 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def float_in(low: float, high: float = float("inf"), *, above: bool = False) -> Callable[[str], float]:
    """An ``argparse`` type: a finite number in ``[low, high]`` (``(low, high]`` with ``above``); argparse refuses other
    values in one line, exit status 2."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (above and value == low) or value > high:
            bounds = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if math.isfinite(high) else "")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def setup_logging() -> None:
    """Log format and level of the decoding programs (infer, eval, benchmark): INFO on rank 0 (or without a
    launcher), ERROR on the other ranks of a multi-process run, whose lines would repeat rank 0's (the same config,
    prompts and warnings on every rank; a rank's own failure is an exception, reported with its rank). As
    transformers' Trainer does with ``log_level_replica``."""
    rank, world = rank_and_world()
    level = logging.INFO if rank == 0 or world == 1 else logging.ERROR
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def setup_process() -> None:
    """What every ``launch/*.py`` program does first: CPU threads per rank (:func:`configure_cpu_threads`),
    DeepSpeed's accelerator choice (:func:`settle_accelerator`) and, under DeepSpeed's launcher, the watch that ends
    the ranks when the ``deepspeed`` command is gone (:func:`spd_ds.launcher_watch.watch_launcher`)."""
    threads = configure_cpu_threads()
    if threads is not None:  # more ranks than cores: each waits for a core between its steps (a slow run, not a hang)
        local, cores = local_world_size(), usable_cores()
        log.log(logging.WARNING if local > cores else logging.INFO, "%d local ranks on %d CPU cores: %d thread(s) per "
                "rank%s (set OMP_NUM_THREADS to choose)", local, cores, threads,
                "; the ranks time-share the cores, so expect a slow run" if local > cores else "")
    settle_accelerator()
    watch_launcher()


# ---------------------------------------------------------------------------------------------- errors
def error_prefix(prefix: str = "error", environ=None) -> str:
    """``"error"`` alone, or ``"error (rank r of w)"`` under a multi-process launcher."""
    rank, world = rank_and_world(environ)
    return f"{prefix} (rank {rank} of {world})" if world > 1 else prefix


def say_error(line: str) -> None:
    """Print one error line to stderr in a single write, so that the lines of several ranks sharing the terminal do
    not run together (``print`` writes the text and its newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def stderr_writer() -> Callable[[str], None]:
    """A function that writes one line to this process's stderr as it is now, as :func:`say_error` does, also while
    file descriptor 2 points elsewhere later: DeepSpeed's op builder (``OpBuilder.has_function``, run when a rank
    JIT-builds an op) points it at a temporary file for the length of a compile, and a line written then was lost.

    Returns:
        ``write(line)``: ``line`` + newline in one ``os.write`` to a duplicate of fd 2 made now (kept for the process's
        life); :func:`say_error` where stderr has no descriptor (a test's capture). Neither raises."""
    try:
        fd = os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # no stderr, or one without a descriptor (a test's capture)
        return say_error

    def write(line: str) -> None:
        with contextlib.suppress(OSError):
            os.write(fd, (line + "\n").encode())
    return write


def one_line(e: object, limit: int = 600) -> str:
    """``e``'s text (an exception's message, or any object's ``str``) on one line: whitespace collapsed, at most
    ``limit`` characters; an exception without a message gives its class name."""
    text = " ".join(str(e).split()) or (type(e).__name__ if isinstance(e, BaseException) else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def notice(text: str, log: logging.Logger) -> None:
    """Tell the user ``text`` (one line) on stderr, flushed, or log it with ``log`` at INFO where there is no usable
    stderr: a pythonw or service process has ``sys.stderr = None`` (``print(file=None)`` would write to stdout); a
    closed, broken, binary or write-less one fails to take it. Never raises for the stream: where the log's handler
    writes to that same closed stderr, the line is dropped.

    Args:
        text: the line, without its newline (a user-facing progress or status line: "spd_ds: converting ...").
        log: the caller's module logger, used only when stderr cannot take the line.
    Raises:
        Nothing for the stream's or the log handler's failures (ValueError, OSError, AttributeError, TypeError)."""
    err = sys.stderr
    if err is not None:
        try:
            err.write(text + "\n")
        except (ValueError, OSError, AttributeError, TypeError):  # closed (or unencodable), broken, no write, binary
            pass
        else:
            with contextlib.suppress(ValueError, OSError, AttributeError):  # written: a failing flush loses nothing
                err.flush()
            return
    with contextlib.suppress(ValueError, OSError):  # logging's own error report writes to the closed stderr too
        log.info(text)


def _traceback_file(prog: str, rank: int) -> str | None:
    """Write the current exception's traceback to a log file; its path, or ``None`` if it cannot be written."""
    folder = os.environ.get(LOG_DIR_ENV) or tempfile.gettempdir()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"spd_ds-{prog}-rank{rank}-", suffix=".log", dir=folder)
        with os.fdopen(fd, "w") as f:
            traceback.print_exc(file=f)
        return path
    except OSError:
        return None


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None, *,
            user_errors: UserErrors = (), prefix: str = "error", prog: str = "spd") -> int:
    """Run a program's ``main(argv)`` and turn its exceptions into the exit statuses and messages of the module
    docstring.

    Args:
        main: the program; returns its exit status.
        argv: its arguments.
        user_errors: exception types that are the user's to fix (exit status 2, one line, no traceback), or a
            function of no argument that returns them, called only after an exception (so that ``--help`` does not
            import what defines them, torch included).
        prefix: first word of the error line (``error``).
        prog: short program name for the traceback file (``infer``, ``eval``, ...).
    Returns:
        ``main``'s status; 2 after a user error; 141 when stdout's reader went away (``| head``); 1 after another
        exception under a multi-process launcher. After Ctrl-C it prints one line (no traceback) and ends the
        process by SIGINT, as Python does, so that a calling shell stops too (130 where that signal is ignored).
    Raises:
        Any other exception of ``main`` in a single process (its traceback is the bug report), and every exception
        with ``SPD_DEBUG=1`` set.
    """
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return main(home_expanded(argv))  # --out=~/x as the shell gives --out ~/x
    except BrokenPipeError:  # stdout closed by its reader (`| head`): stop quietly, as command-line tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 141  # 128 + SIGPIPE, the shell's status for a writer whose pipe closed
    except KeyboardInterrupt:  # Ctrl-C: the user asked for it, no traceback
        if debug:
            raise
        say_error(f"{error_prefix(prefix)}: interrupted")
        # die of SIGINT, as an uncaught KeyboardInterrupt does: a calling shell script then stops too
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130  # 128 + SIGINT, where the signal does not end the process
    except Exception as e:  # noqa: BLE001 - sorted below: the user's to fix, or a bug
        errors = user_errors() if callable(user_errors) else user_errors
        if not isinstance(e, errors):
            rank, world = rank_and_world()
            if debug or world <= 1:
                raise
            path = _traceback_file(prog, rank)
            where = f"; traceback in {path}" if path else ""
            say_error(f"{error_prefix(prefix)}: {type(e).__name__}: {one_line(e)}{where} ({DEBUG_ENV}=1 prints it)")
            return 1
        if debug:
            traceback.print_exc()
        say_error(f"{error_prefix(prefix)}: {one_line(e)}")
        return 2
