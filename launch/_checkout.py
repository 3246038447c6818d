"""Puts this checkout's root first on ``sys.path``, so ``python launch/<name>.py`` (and ``deepspeed launch/<name>.py``)
runs this checkout's ``spd_ds``: without ``pip install``, and also when another copy (another worktree's editable
install) is installed. Python puts only ``launch/`` on the path for a script run; this is the one place that adds the
root. Installed console scripts (``spd-infer`` ...) and ``python -m spd_ds.commands.<name>`` do not need it."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path[:1]:
    sys.path.insert(0, ROOT)
