"""spd-ds: Speculative Pipeline Decoding (SPD) for DeepSpeed.

``spd_ds.__version__`` is the installed distribution's version (``importlib.metadata``; the ``version`` of
``setup.cfg`` beside the package when it is not installed), read on first use: ``import spd_ds`` imports nothing else
(torch included).
"""

from __future__ import annotations

DISTRIBUTION = "spd-ds"
_version: str | None = None


def _read_version() -> str:
    """The version of the installed ``spd-ds`` distribution, else ``setup.cfg``'s (a checkout that is not installed),
    else ``"0+unknown"``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    import configparser
    from pathlib import Path

    cfg = configparser.ConfigParser()
    try:
        cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
        return cfg.get("metadata", "version")
    except (configparser.Error, OSError):
        return "0+unknown"


def __getattr__(name: str):
    global _version
    if name == "__version__":
        if _version is None:
            _version = _read_version()
        return _version
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
