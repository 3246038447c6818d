#!/usr/bin/env python
"""`python launch/infer.py` runs spd_ds/commands/infer.py (its docstring and `--help` document it) from the
installed package (`pip install -e .`, which also installs the console commands)."""
from spd_ds.commands.infer import main

if __name__ == "__main__":
    raise SystemExit(main())
