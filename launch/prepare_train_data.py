#!/usr/bin/env python
"""`python launch/prepare_train_data.py` runs spd_ds/commands/prepare_train_data.py (its docstring and `--help` document
it) from the installed package (`pip install -e .`, which also installs the console commands)."""
from spd_ds.commands.prepare_train_data import main

if __name__ == "__main__":
    raise SystemExit(main())
