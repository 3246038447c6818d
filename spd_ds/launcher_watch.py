"""The watch that ends a rank when the ``deepspeed`` command that started it, or its per-node launcher, is gone
(:func:`watch_launcher`, started by every launch program: :func:`spd_ds.cli.setup_process`). Linux only
(``/proc``); elsewhere, and under other launchers, it does nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

_DS_LAUNCH = b"deepspeed.launcher.launch"  # the per-node launcher module (`deepspeed` runs it, locally or over pdsh)
_DS_RUNNER = b"deepspeed.launcher.runner"  # the `deepspeed` command's module (its script is bin/deepspeed)


def _argv_of(pid: int) -> list[bytes] | None:
    """The command line of ``pid`` from ``/proc`` (Linux), one element per argument; ``None`` when unreadable."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc`` (Linux), or ``None`` when the process is gone or unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[1])  # "pid (comm) state ppid ...": comm may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _is_ds_runner(argv: list[bytes] | None) -> bool:
    """Whether ``argv`` is DeepSpeed's ``deepspeed`` command (its script ``.../deepspeed`` run by Python, or the
    runner module)."""
    return bool(argv) and any(a == _DS_RUNNER or os.path.basename(a) == b"deepspeed" for a in argv[:3])


def _watch_step(launcher: int, runner: int | None) -> str | None:
    """One look at the processes above this rank (:func:`watch_launcher`): ``"launcher"`` when this rank's parent is
    no longer ``launcher`` (the launcher was killed), ``"runner"`` when ``runner`` (the ``deepspeed`` command; ``None``
    = not watched) is no longer the launcher's parent, else ``None``. A ``/proc`` read that fails says nothing."""
    if os.getppid() != launcher:
        return "launcher"
    if runner is not None:
        now = _parent_of(launcher)
        if now is not None and now != runner:
            return "runner"
    return None


def watch_launcher(poll_s: float = 0.5) -> threading.Thread | None:
    """End this rank's run when the ``deepspeed`` command that started it, or its launcher, is gone.

    DeepSpeed's single-node runner forwards no signal: ``kill <pid of deepspeed>`` (or a job tool that signals that
    one process) ends the runner and leaves its ``deepspeed.launcher.launch`` and every rank running. Under that
    launcher this starts a daemon thread that polls every ``poll_s`` seconds (:func:`_watch_step`):

    - the launcher's parent was the ``deepspeed`` command and is no longer (the command ended): local rank 0 sends
      SIGTERM to the launcher, which ends every rank of the node (as it does on Ctrl-C);
    - this rank's parent is no longer the launcher (the launcher was killed, even by SIGKILL): the rank sends SIGTERM
      to itself.

    A launcher started by something else (pdsh on a remote node, a detached shell) is not tied to its parent. Linux
    only (``/proc``); elsewhere, and under other launchers (MPI, torchrun, none), it does nothing.

    Returns:
        The watching thread, or ``None`` when there is nothing to watch.
    """
    launcher = os.getppid()
    if _DS_LAUNCH not in (_argv_of(launcher) or []):  # not Linux, or not DeepSpeed's launcher
        return None
    runner = _parent_of(launcher)
    if runner is None or not _is_ds_runner(_argv_of(runner)) or os.environ.get("LOCAL_RANK", "0") != "0":
        runner = None  # one rank per node stops the launcher; the others watch their launcher alone
    from spd_ds.cli import error_prefix, stderr_writer

    say = stderr_writer()  # the terminal's stderr even while DeepSpeed points fd 2 elsewhere (its op builds do)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            gone = _watch_step(launcher, runner)
            if gone == "launcher":  # nothing else will end this rank
                say(f"{error_prefix('error')}: the DeepSpeed launcher (pid {launcher}) has ended; stopping")
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if gone == "runner":
                say(f"{error_prefix('error')}: the deepspeed command (pid {runner}) has ended; stopping its "
                    f"launcher (pid {launcher}) and every rank")
                with contextlib.suppress(OSError):
                    os.kill(launcher, signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="spd-launcher-watch", daemon=True)
    thread.start()
    return thread


__all__ = ["watch_launcher"]
