"""Files written and read the same way across the project: an output replaced only once it is whole
(:func:`replaced_when_done`), and gzip recognised by its first bytes whatever the file's name (:func:`is_gzip`)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Iterator

GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: str | os.PathLike) -> bool:
    """True when the file starts with gzip's magic bytes (read as gzip whatever its name).

    Raises:
        OSError: the file cannot be opened (missing, a folder, no read permission).
    """
    with open(path, "rb") as fh:
        return fh.read(2) == GZIP_MAGIC


@contextlib.contextmanager
def replaced_when_done(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write instead: it replaces ``path`` (``os.replace``, atomic) when the block
    ends, and is removed when it raises (``KeyboardInterrupt`` too), leaving ``path`` as it was; a replaced file keeps
    its permission bits. A ``path`` that exists and is no regular file (a FIFO, ``/dev/stdout``), or an existing file
    in a folder this process cannot write, is yielded itself: written in place. A link is replaced at its target.

    Yields:
        The path to write (``.<name>.tmp-<pid>`` in ``path``'s folder, or ``path`` itself).
    Raises:
        OSError: the permission bits cannot be copied or the rename fails (the temporary file is removed); and
            whatever the block raises, after the removal.
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and (not path.is_file() or not os.access(path.parent, os.W_OK)):
        yield path
        return
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if mode is not None:  # a private file stays private (a new file's bits come from the umask)
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
