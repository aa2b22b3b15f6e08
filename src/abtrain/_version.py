"""abtrain's version: one string, read from the installed package's metadata (pyproject.toml)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("abtrain")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
