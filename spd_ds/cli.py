"""Command-line pieces shared by the ``launch/*.py`` programs: the experiment arguments and the engine choice."""

from __future__ import annotations

import argparse

ENGINES = ("auto", "reference", "deepspeed")


def experiment_parser(description: str | None, *, overrides_help: str, config_help: str | None = None,
                      engine_help: str | None = None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with ``--config``, positional ``section.key=value`` overrides, ``--engine`` (when
    ``engine_help`` is given) and the DeepSpeed launcher's ``--local_rank`` (hidden).

    Args:
        description: the program's docstring (shown raw by ``--help``).
        overrides_help, config_help, engine_help: help texts of those arguments.
    """
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help=config_help or "experiment YAML (default: built-in defaults)")
    ap.add_argument("overrides", nargs="*", help=overrides_help)
    if engine_help is not None:
        ap.add_argument("--engine", choices=ENGINES, default="auto", help=engine_help)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def chosen_engine(engine: str) -> str:
    """``auto`` -> ``deepspeed`` when launched with more than one process (``WORLD_SIZE`` or the MPI variables, as
    :func:`spd_ds.pipe.topology.detect_world_size` reads them), else ``reference``; other values unchanged."""
    from spd_ds.pipe.topology import detect_world_size

    if engine != "auto":
        return engine
    return "deepspeed" if detect_world_size() > 1 else "reference"
