#!/usr/bin/env python
"""Runs spd_ds/commands/prepare_eval_data.py (its docstring and `--help` document it) from this checkout."""
import _checkout  # noqa: F401  this checkout's spd_ds first (launch/_checkout.py)
from spd_ds.commands.prepare_eval_data import main

if __name__ == "__main__":
    raise SystemExit(main())
