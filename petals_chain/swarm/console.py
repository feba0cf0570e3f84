"""What the command lines share about the place they run in: a standard output whose reader may go away or whose
encoding is not UTF-8, and a working directory that may be gone."""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import IO, Optional


def say(*parts: object, file: Optional[IO[str]] = None) -> None:
    """``print(*parts, flush=True)`` that never raises. A reader gone (``| head -1``, ``| grep -m1 /p2p/``, a ``tee``
    ended by Ctrl-C) or a terminal closed raised BrokenPipeError / EIO out of a role: the orchestrator exited with
    "error: [Errno 32] Broken pipe" before serving, the server with a traceback at its ``PEER_ID`` line. The stream's
    descriptor then goes to ``/dev/null``, so later lines and the interpreter's flush at exit do not fail again.
    A character the stream's encoding cannot write (a path's, under a non-UTF-8 locale) is written as an escape; any
    other write error (a full disk under a redirected stdout) is logged once and later lines are tried again."""
    stream = file if file is not None else sys.stdout
    line = " ".join(map(str, parts))  # one write: a part that cannot be encoded leaves none of the line behind
    try:
        try:
            print(line, file=stream, flush=True)
        except UnicodeEncodeError:
            encoding = getattr(stream, "encoding", None) or "ascii"
            print(line.encode(encoding, "backslashreplace").decode(encoding), file=stream, flush=True)
    except OSError as e:
        if e.errno in _READER_GONE:
            _to_devnull(stream)
        else:
            _not_written(e)
    except ValueError:  # the stream was closed
        pass


# errnos of a standard output nobody reads any more; a full disk (ENOSPC, EDQUOT, EFBIG) is not one of them
_READER_GONE = frozenset({errno.EPIPE, errno.EIO, errno.ECONNRESET})
_warned = False


def _not_written(e: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        logging.getLogger(__name__).warning(f"a line of standard output could not be written ({e.strerror or e}); "
                                            "later lines are tried again")


def tolerant_stdout() -> None:
    """Characters the standard output's encoding cannot write (a non-UTF-8 locale, such as ISO-8859-1) come out as
    escapes (``\\ufffd``) instead of failing: a model's text with one such character (the random-weight model's
    U+FFFD) ended the demo with "'latin-1' codec can't encode character" before its results were shown."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and getattr(sys.stdout, "errors", None) == "strict":
        reconfigure(errors="backslashreplace")


def _to_devnull(stream: IO[str]) -> None:
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


def check_working_directory(role: str) -> None:
    """ValueError when this process's working directory no longer exists (deleted, or its file system unmounted, after
    the shell entered it). torch's import then died with "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so" and
    transformers' with a bare FileNotFoundError, which read as a broken install."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise ValueError(f"the working directory of this {role} no longer exists (deleted or moved since the shell "
                         "entered it): cd to an existing directory and start it again") from None
