"""argparse ``type=`` validators shared by the scripts: a bad number is refused while the arguments are parsed (exit
2, ``error: argument --x: ...``), before any model is built or swarm started. Without them a zero, negative or NaN
count, duration or rate ran for seconds to minutes and then crashed (``statistics.median`` of nothing, a division by
zero) or printed nonsense. ``output_file`` (``--json FILE``, ``--out``, ``--plot``): a directory or a file in a
missing or unwritable directory failed with a traceback after the whole run.

Import from a script as ``sys.path.insert(0, str(Path(__file__).resolve().parent)); from _args import ...`` (the
scripts are loaded by path in the tests too, where their directory is not on ``sys.path``).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Sequence

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "probability",
           "probability_list", "name_list", "output_file"]


def _int(text: str, lowest: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer {what}, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be an integer {what}, got {text!r}")
    return value


def _float(text: str, ok: Callable[[float], bool], what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number {what}, got {text!r}") from None
    if not ok(value):  # NaN fails every comparison: refused too
        raise argparse.ArgumentTypeError(f"must be a number {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count: servers, requests, steps, repeats)."""
    return _int(text, 1, ">= 1")


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (a seed, an optional count)."""
    return _int(text, 0, ">= 0")


def positive_float(text: str) -> float:
    """A finite number > 0 (a duration, a rate, a factor)."""
    return _float(text, lambda v: 0 < v < math.inf, "> 0 and finite")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (an emulated delay, a temperature)."""
    return _float(text, lambda v: 0 <= v < math.inf, ">= 0 and finite")


def probability(text: str) -> float:
    """A number in [0, 1] (a rate of faults or audits, a fraction)."""
    return _float(text, lambda v: 0 <= v <= 1, "in [0, 1]")


def probability_list(text: str) -> list[float]:
    """Comma-separated numbers, each in [0, 1] (at least one)."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts) or not all(parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers in [0, 1], got {text!r}")
    try:
        return [probability(p) for p in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers in [0, 1], got {text!r}") from None


def name_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """The ``type=`` of a comma-separated list of names, each one of ``choices`` (at least one): a typo was found
    only when its turn came, after the runs before it."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"must name one or more of {', '.join(choices)} (comma-separated), "
                                             f"got {text!r}")
        return names

    parse.__name__ = "name_list"
    return parse


def output_file(text: str) -> str:
    """A file the script writes (``--json FILE``, ``--out``, ``--plot``): not a directory, in an existing directory
    this user can write (``petals_chain.swarm.paths``, the roles' own check; imported here only when one is given)."""
    from petals_chain.swarm.paths import output_file_arg

    return output_file_arg(text)
