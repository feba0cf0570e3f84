"""Logging set-up the roles' command lines share."""

from __future__ import annotations

import argparse
import logging


def one_line(text: object) -> str:
    """A peer's free text as one line of printable characters, each other one a space (it is logged and shown: a
    hostile one forged log lines; line and paragraph separators, bidi overrides and zero-width characters too)."""
    return "".join(c if c.isprintable() else " " for c in str(text))


def log_level(parser: argparse.ArgumentParser, name: str) -> int:
    """The logging level called ``name`` (any case); else a usage error naming the choices (exit 2), not a
    traceback from :func:`logging.basicConfig` or a silent fallback."""
    level = logging.getLevelName(str(name).upper())
    if not isinstance(level, int):
        parser.error(f"--log-level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {name!r}")
    return level
