#!/usr/bin/env python
"""`python launch/build_draft_vocab.py` runs spd_ds/commands/build_draft_vocab.py (its docstring and `--help` document
it) from the installed package (`pip install -e .`, which also installs the console commands)."""
from spd_ds.commands.build_draft_vocab import main

if __name__ == "__main__":
    raise SystemExit(main())
