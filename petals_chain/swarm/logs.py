"""Logging set-up the roles' command lines share."""

from __future__ import annotations

import argparse
import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def one_line(text: object) -> str:
    """A peer's free text as one line of printable characters (it is logged and shown: a hostile one forged log
    lines)."""
    return _CONTROL.sub(" ", str(text))


def log_level(parser: argparse.ArgumentParser, name: str) -> int:
    """The logging level called ``name`` (any case); else a usage error naming the choices (exit 2), not a
    traceback from :func:`logging.basicConfig` or a silent fallback."""
    level = logging.getLevelName(str(name).upper())
    if not isinstance(level, int):
        parser.error(f"--log-level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {name!r}")
    return level
