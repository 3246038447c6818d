#!/usr/bin/env python
"""`python launch/eval.py` runs spd_ds/commands/eval.py (its docstring and `--help` document it) from the
installed package (`pip install -e .`, which also installs the console commands)."""
from spd_ds.commands.eval import main

if __name__ == "__main__":
    raise SystemExit(main())
