"""The package's version and the `--version` flag every command takes (stdlib only: the client imports it)."""

from __future__ import annotations

import argparse

VERSION = "0.1.0"  # pyproject.toml's [project] version (tests/test_launch.py checks they agree)


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """Register --version: print `inference_engine VERSION` and exit 0."""
    parser.add_argument("--version", action="version", version=f"inference_engine {VERSION}")
