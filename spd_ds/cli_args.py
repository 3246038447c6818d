"""Checks of the launch programs' arguments beside :mod:`spd_ds.cli` (kept apart to keep that module small): an
option given twice (:class:`GivenOnce`, an ``argparse`` action), a value given twice in a list (:func:`repeated`), a
device this machine has (:func:`torch_device`, an ``argparse`` type), the key of an override (:func:`override_key`),
a home folder in ``--flag=~/path`` (:func:`home_expanded`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

_TEXT_FLAGS = frozenset({"--prompt", "--name"})  # values that are text, not paths: left as given


def home_expanded(argv: Sequence[str] | None) -> list[str]:
    """``argv`` (default ``sys.argv[1:]``) with a leading ``~`` (``~user``) expanded in each ``--flag=~/path``
    value, as the shell expands it in ``--flag ~/path`` but not after the ``=``. Prompt texts (``--prompt=``) and
    ``--name=`` are left as given; :func:`spd_ds.config.load_config` expands ``section.key=~/path`` overrides."""
    expanded = []
    for arg in sys.argv[1:] if argv is None else argv:
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("--") and value.startswith("~") and flag not in _TEXT_FLAGS:
            arg = f"{flag}={os.path.expanduser(value)}"
        expanded.append(arg)
    return expanded


class GivenOnce(argparse.Action):
    """An option that may be given once, e.g. ``--config``: argparse keeps the last of two, so a second experiment
    file would replace the first without a word (they are not layered). A second one is refused in one line
    (argparse's usage error, exit status 2)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        if before is not None and before is not self.default:  # the default: set by argparse before the options
            parser.error(f"{option_string} is given twice ({before!r} and {values!r}); give one (files are not "
                         "layered: put further settings as section.key=value overrides)")
        setattr(namespace, self.dest, values)


def override_key(override: str) -> str:
    """The ``section.key`` of a ``section.key=value`` override as the launch programs take it (``"data.num_prompts"``
    for ``" data.num_prompts =3"``; the whole text, stripped, when it holds no ``=``). Never raises: malformed
    overrides are refused by :func:`spd_ds.config.load_config`."""
    return override.split("=", 1)[0].strip()


def repeated(values: Sequence) -> list:
    """The values of ``values`` equal to an earlier one, in order (``[]``: each is given once), for the checks that
    refuse a list naming one value twice (``--suite c c``, ``eval.baselines=[ar,ar]``): its second run would replace
    the first's results.

    Args:
        values: a short list of comparable values (suite names, stage counts, baseline names; compared with ``==``,
            quadratic in its length).
    Returns:
        Each repeat, once per repeat (``[2, 2, 2]`` gives ``[2, 2]``). Raises nothing; the caller words the error.
    """
    return [v for k, v in enumerate(values) if v in values[:k]]


def torch_device(text: str) -> str:
    """An ``argparse`` type: a torch device this machine can use (``cpu``, ``cuda``, ``cuda:N`` with N below the
    visible GPU count), checked when the command line is read, before any model loads; argparse refuses other values
    in one line, exit status 2.

    Args:
        text: the option's value.
    Returns:
        ``text`` unchanged.
    Raises:
        argparse.ArgumentTypeError: not a device name torch knows, or a CUDA device this machine does not have.
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; give cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise argparse.ArgumentTypeError(f"{text}: torch {torch.__version__} sees no CUDA device here; give cpu "
                                             "(or leave the option out)")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} visible GPU(s), cuda:0 to "
                                             f"cuda:{count - 1}")
    return text


torch_device.__name__ = "device"
