"""``argparse`` pieces of the launch programs beside :mod:`spd_ds.cli` (kept apart to keep that module small)."""

from __future__ import annotations

import argparse


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
