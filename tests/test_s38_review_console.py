"""Review of 6e30f2c's ``swarm.console.say`` (the roles' and ``fetch``'s standard-output lines).

It sent the stream's descriptor to ``/dev/null`` on any OSError or ValueError, taking every error for a reader gone:

* a line with a character the stream's encoding cannot write (a path under a non-UTF-8 locale, a path's undecodable
  byte under a strict UTF-8 one) raised UnicodeEncodeError, a ValueError: ``PETALS_CHAIN_MODELS_DIR=/tmp/模型
  python -m petals_chain.fetch --list`` under ``PYTHONIOENCODING=latin-1`` printed nothing at all and exited 0;
* a full disk under a redirected stdout (ENOSPC) muted every later line for good, with no word anywhere, even once
  the disk had room again.
"""

from __future__ import annotations

import errno
import io
import logging
import os

import pytest

from petals_chain.swarm import console
from petals_chain.swarm.console import say


@pytest.fixture
def out_file(tmp_path):
    """(fd, path) of a file open for writing, closed at the end."""
    path = tmp_path / "out.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    yield fd, path
    os.close(fd)


def _is_devnull(fd: int) -> bool:
    return os.path.samestat(os.fstat(fd), os.stat(os.devnull))


@pytest.mark.parametrize("encoding, text, escaped", [
    ("latin-1", "Model m: /home/用户/m.gguf", "Model m: /home/\\u7528\\u6237/m.gguf"),
    ("utf-8", "models directory: /tmp/\udcff", "models directory: /tmp/\\udcff"),  # os.fsdecode of byte 0xff
])
def test_a_line_its_encoding_cannot_write_comes_out_escaped_and_later_lines_too(out_file, encoding, text, escaped):
    fd, path = out_file
    stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding)
    say(text, file=stream)
    say("HTTP API:", "http://127.0.0.1:8000/v1", file=stream)
    assert not _is_devnull(fd)
    assert path.read_text(encoding) == f"{escaped}\nHTTP API: http://127.0.0.1:8000/v1\n"


def test_a_full_disk_is_logged_once_and_later_lines_are_written_once_there_is_room(out_file, caplog, monkeypatch):
    fd, path = out_file
    full = [True]

    class Disk(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def fileno(self) -> int:
            return fd

        def write(self, b) -> int:
            if full[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return os.write(fd, b)

    monkeypatch.setattr(console, "_warned", False, raising=False)  # (not in 6e30f2c)
    stream = io.TextIOWrapper(io.BufferedWriter(Disk()), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger=console.__name__):
        say("Loading m...", file=stream)
        say("Model 0: m", file=stream)
    assert [r.getMessage() for r in caplog.records] == [
        "a line of standard output could not be written (No space left on device); later lines are tried again"]
    assert not _is_devnull(fd)
    full[0] = False
    say("HTTP API: http://127.0.0.1:8000/v1", file=stream)
    assert path.read_text().splitlines()[-1] == "HTTP API: http://127.0.0.1:8000/v1"


def test_a_reader_gone_still_sends_the_stream_to_dev_null():
    """What 6e30f2c did for ``| head -1`` stays: EPIPE mutes the descriptor, the next line raises nothing."""
    r, w = os.pipe()
    os.close(r)
    stream = io.TextIOWrapper(io.FileIO(w, "w"), encoding="utf-8")
    try:
        say("PEER_ID x", file=stream)
        assert _is_devnull(w)
        say("next", file=stream)
    finally:
        stream.close()
