"""Portable ``torch.compile`` caches: one file that carries what a run compiled to the next run on a fresh machine.

A GPU machine starts bare every session, so every run pays its compiles again (the self-distillation decode step:
~160 s of its first call on an H200; FlexAttention for head training: once per pipeline fill and process). PyTorch's
``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` serialise the inductor and AOT-autograd caches
(generated kernels, autotuning results) into bytes; :func:`load_compile_cache` before the first compile and
:func:`save_compile_cache` at the end carry them in a file (kept beside the working tree and sent with it). A file
from another torch / triton version or device kind is not an error: its entries simply miss.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from spd_ds.files import replaced_when_done

log = logging.getLogger(__name__)


def load_compile_cache(path: str | os.PathLike | None) -> int:
    """Load the cache artifacts of ``path`` into this process's compile caches (call before the first compile).

    Args:
        path: a file written by :func:`save_compile_cache`; ``None`` or a missing file: nothing to load.
    Returns:
        The number of artifacts loaded (0 when none, or when the file cannot be read: a warning says why).
    """
    if path is None or not Path(path).is_file():
        return 0
    import torch

    try:
        info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001 - a stale or foreign cache must never stop a run
        log.warning("compile cache %s not loaded (%s): compiling from scratch", path, e)
        return 0
    if info is None:  # torch logs why (e.g. a checksum mismatch) and loads nothing
        log.warning("compile cache %s not loaded (unreadable, or from another torch version): compiling from "
                    "scratch", path)
        return 0
    n = sum(len(v) for v in info.artifacts.values())
    log.info("compile cache %s: %d artifacts loaded", path, n)
    return n


def check_compile_cache_path(path: str | os.PathLike, what: str) -> None:
    """Check at a run's start that :func:`save_compile_cache` can write ``path`` at its end: an output file
    (:func:`spd_ds.cli.check_output_file`; a new folder is made) whose folder takes new files even when the file
    exists (the file is replaced through a temporary file beside it, whole or not there, which needs a folder that
    takes new files; a writable file in a folder that took none was refused only at the end: '0 bytes saved', the
    run's kernels lost).

    Args:
        path: the cache file; what: how the user named it (``train.compile_cache``, ``--compile-cache``).
    Raises:
        ConfigError: one line naming ``what`` and the path.
    """
    from spd_ds.cli import check_output_file, ensure_output_dir

    check_output_file(str(path), what)
    ensure_output_dir(os.path.dirname(os.path.abspath(path)), f"{what}'s folder")


def save_compile_cache(path: str | os.PathLike | None) -> int:
    """Write every cache artifact this process compiled or loaded so far to ``path`` (atomically, through
    :func:`spd_ds.files.replaced_when_done`: a temporary file renamed over it, so concurrent writers leave one whole
    file; a replaced file keeps its permission bits). Loaded entries this process never used are not kept, so a
    shorter run (one that never validated, say) writes a smaller file.

    Args:
        path: destination file (parent directories are made); ``None``: nothing is written.
    Returns:
        Bytes written (0 when there was nothing to save or saving failed: a warning says why).
    """
    if path is None:
        return 0
    import torch

    try:
        out = torch.compiler.save_cache_artifacts()
    except Exception as e:  # noqa: BLE001 - the run's results matter more than its cache
        log.warning("compile cache not saved to %s (%s)", path, e)
        return 0
    if not out or not out[0]:
        return 0
    dest = Path(path)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with replaced_when_done(dest) as tmp:  # the temporary file is removed on any error, Ctrl-C too
            tmp.write_bytes(out[0])
    except OSError as e:  # a full or read-only disk, a directory in the way: the run itself has finished
        log.warning("compile cache not saved to %s (%s)", dest, e)
        return 0
    log.info("compile cache: %d bytes -> %s", len(out[0]), dest)
    return len(out[0])
