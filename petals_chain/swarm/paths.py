"""Checks of the files a command line names for the program to write (``--ready-file``, ``--profile-cache``, a
script's ``--json``/``--out``/``--plot``), made while the arguments are checked: a directory, a missing directory
or one this user cannot write was found only when the file was written, after the model had loaded or the run had
ended (minutes), with a traceback or a late error.

Root passes every ``os.access`` check: the "not writable" cases are refused only for other users."""

from __future__ import annotations

import argparse
import os
from typing import Optional

__all__ = ["output_file_problem", "output_file_arg", "output_file_arg_making_dirs"]


def output_file_problem(path: str | os.PathLike, *, make_dirs: bool = False, replace: bool = False) -> Optional[str]:
    """Why ``path`` cannot be written as a file, in a few words (None: it can, as far as can be told now).

    ``make_dirs``: the writer makes missing directories (then the nearest existing one must be a writable directory).
    ``replace``: the writer writes a temporary file beside it and renames it over ``path`` (atomic): the directory
    must be writable even if the file exists, and an existing non-regular file (a FIFO, a device) is refused, which
    the rename would replace (as root, ``/dev/null`` itself)."""
    text = os.fspath(path)
    if not text:
        return "is empty: give a file's path"
    if os.path.isdir(text):
        return "is a directory: give the path of a file"
    if os.path.basename(text) in ("", ".", ".."):  # ("out/", missing: the writer's open found it after the run)
        return "names a directory (ends with /, . or ..): give the path of a file"
    exists = os.path.lexists(text)
    if exists and not os.path.exists(text):  # a symbolic link to nothing yet (refused as unwritable, or not a file)
        if replace:
            exists = False  # the rename replaces the link itself, in the link's directory
        else:  # the writer's open follows it and makes its target, whose directory must exist
            target = os.path.realpath(text)
            if os.path.lexists(target):
                return "is a symbolic link that leads to no file (a loop of links)"
            problem = output_file_problem(target)
            return None if problem is None else f"is a symbolic link to {target}: {problem}"
    if exists and replace and not os.path.isfile(text):
        return "is not a regular file (a FIFO or a device), which writing it would replace: give a file's path"
    if exists and not replace:
        return None if os.access(text, os.W_OK) else "cannot be written by this user"
    folder = os.path.dirname(os.path.abspath(text))
    if make_dirs:
        while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)  # the nearest existing one: the writer makes the rest in it
    if not os.path.lexists(folder):
        return "no such directory"
    if not os.path.isdir(folder):
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "its directory is not writable by this user" if folder == os.path.dirname(os.path.abspath(text)) \
            else f"its directory cannot be made: {folder} is not writable by this user"
    return None


def output_file_arg(text: str) -> str:
    """argparse ``type=`` of a file the program writes in place (``open(path, "w")``): a bad one exits 2 with
    ``error: argument --json: PATH: is a directory ...`` before anything runs."""
    problem = output_file_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def output_file_arg_making_dirs(text: str) -> str:
    """As :func:`output_file_arg`, for a writer that makes the file's missing directories."""
    problem = output_file_problem(text, make_dirs=True)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text
