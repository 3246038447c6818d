#!/usr/bin/env python
"""`python launch/benchmark.py` runs spd_ds/commands/benchmark.py (its docstring and `--help` document it) from the
installed package (`pip install -e .`, which also installs the console commands)."""
from spd_ds.commands.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
