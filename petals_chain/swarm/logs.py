"""Logging set-up the roles' command lines share."""

from __future__ import annotations

import argparse
import logging


def log_level(parser: argparse.ArgumentParser, name: str) -> int:
    """The logging level called ``name`` (any case); else a usage error naming the choices (exit 2), not a
    traceback from :func:`logging.basicConfig` or a silent fallback."""
    level = logging.getLevelName(str(name).upper())
    if not isinstance(level, int):
        parser.error(f"--log-level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {name!r}")
    return level
