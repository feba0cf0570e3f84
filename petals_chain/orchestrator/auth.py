"""API keys: who a request comes from, and each client's own limits.

``--api-keys FILE`` holds one key a line (a ``#`` at the start of a line or after a space starts a comment; in a
key it is part of the key)::

    NAME KEY [max_concurrent=N] [tokens_per_minute=N] [max_sessions=N] [deadline_ms=N] [ttft_deadline_ms=N]

``deadline_ms`` / ``ttft_deadline_ms`` are the key's default deadlines (a request's own fields override them). A key
is printable ASCII without spaces (what an HTTP header carries), at least :data:`MIN_KEY_CHARS` long. A file other
users of the host may read or write is loaded with a warning (``chmod 600``).

Clients send ``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``). The client identity everywhere (limits,
session ownership, metrics, fairness) is the key's *name*; the key itself is kept only as a SHA-256 digest and
never shown. Without ``--api-keys`` every request is the one client ``anonymous``.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from petals_chain.orchestrator.deadlines import MAX_DEADLINE_MS

ANONYMOUS = "anonymous"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@\-]{0,63}$")
_LIMITS = ("max_concurrent", "tokens_per_minute", "max_sessions", "deadline_ms", "ttft_deadline_ms")
_LIMIT_MAX = {"max_concurrent": 10**9, "tokens_per_minute": 10**12, "max_sessions": 10**9,
              "deadline_ms": int(MAX_DEADLINE_MS), "ttft_deadline_ms": int(MAX_DEADLINE_MS)}
MIN_KEY_CHARS = 16
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: a header's bytes are read as latin-1, a file's as UTF-8
_COMMENT = re.compile(r"(?:^|\s)#")  # a '#' inside a field is part of it (it cut a key short, silently)

logger = logging.getLogger(__name__)
_warned: set[tuple[str, int]] = set()  # (path, mode) warned about: the file is read once per model's API
# rings read from a pipe or a device, by its (st_dev, st_ino): the CLI's check and each model's API read the file, and
# a pipe (--api-keys <(...), /dev/stdin) reads empty after the first ("no keys": the orchestrator exited at start)
_read_once: dict[tuple[int, int], "KeyRing"] = {}

# The client of the request being served (set by the API middleware; copied into the tasks a request spawns).
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("petals_chain_client", default=ANONYMOUS)


class KeyFileError(ValueError):
    """The API key file is malformed (the message names the line)."""


@dataclass(frozen=True)
class ApiKey:
    """A named key and its limits (None: the orchestrator's per-client default)."""

    name: str
    digest: bytes  # sha256 of the key
    max_concurrent: Optional[int] = None  # requests running or queued at once
    tokens_per_minute: Optional[int] = None  # prompt + generated tokens over the last 60 s
    max_sessions: Optional[int] = None  # open multi-turn sessions
    deadline_ms: Optional[int] = None  # default time to the last token (orchestrator/deadlines.py)
    ttft_deadline_ms: Optional[int] = None  # default time to the first token


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyRing:
    """The configured keys; :meth:`lookup` compares digests in constant time."""

    def __init__(self, keys: list[ApiKey]):
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise KeyFileError("duplicate key names")
        self.keys = list(keys)
        self._by_name = {k.name: k for k in keys}

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, key: str) -> Optional[ApiKey]:
        d = _digest(key)
        found = None
        for k in self.keys:  # every entry is compared: the time does not tell which one matched
            if hmac.compare_digest(k.digest, d):
                found = k
        return found

    def get(self, name: str) -> Optional[ApiKey]:
        return self._by_name.get(name)

    @classmethod
    def from_file(cls, path: str | Path) -> "KeyRing":
        """Parse an API key file; raises :class:`KeyFileError` naming the first bad line. A pipe or a device is read
        once: later calls for it get the ring read then."""
        once = _unseekable(path)
        if once in _read_once:
            return _read_once[once]
        try:  # utf-8-sig: a byte order mark (Notepad's) made the first name invalid
            text = Path(path).read_text(encoding="utf-8-sig")
        except OSError as e:
            raise KeyFileError(f"cannot read the API key file {path}: {e}") from None
        except UnicodeDecodeError as e:  # a binary file, or another encoding: a traceback before
            raise KeyFileError(f"the API key file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        _warn_if_shared(path)
        keys, digests, lines_of = [], set(), {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = _COMMENT.split(raw, 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            where = f"{path}:{lineno}"
            if len(fields) < 2:
                raise KeyFileError(f"{where}: expected 'NAME KEY [max_concurrent=N] [tokens_per_minute=N] "
                                   f"[max_sessions=N] [deadline_ms=N] [ttft_deadline_ms=N]'")
            name, key, extra = fields[0], fields[1], fields[2:]
            if not _NAME.match(name) or name == ANONYMOUS:
                raise KeyFileError(f"{where}: invalid key name {name!r} (letters, digits, '_.@-', at most 64; "
                                   f"not {ANONYMOUS!r})")
            if len(key) < MIN_KEY_CHARS:
                raise KeyFileError(f"{where}: the key of {name!r} is shorter than {MIN_KEY_CHARS} characters")
            if not _KEY_CHARS.match(key):  # loaded, it matched no request: a header cannot carry it as the file has it
                raise KeyFileError(f"{where}: the key of {name!r} has a character other than printable ASCII (an HTTP "
                                   "header cannot carry it: no client could present this key)")
            if name in lines_of:
                raise KeyFileError(f"{where}: duplicate key name {name!r} (also on line {lines_of[name]})")
            lines_of[name] = lineno
            limits: dict[str, int] = {}
            for field, item in enumerate(extra, 3):
                k, sep, v = item.partition("=")
                # ASCII digits, at most 18 (str.isdigit() takes "²", and int() refuses 4300 digits)
                if not sep or k not in _LIMITS or not (v.isascii() and v.isdigit() and len(v) <= 18) or int(v) < 1:
                    # a field without '=' is not echoed: it may be a key (a line with its fields out of order)
                    shown = repr(item) if sep else f"field {field} (not NAME=N)"
                    raise KeyFileError(f"{where}: invalid limit {shown} (use {', '.join(f'{x}=N' for x in _LIMITS)}"
                                       f" with N >= 1)")
                if int(v) > _LIMIT_MAX[k]:  # also keeps float(deadline) from overflowing at every request
                    raise KeyFileError(f"{where}: {k}={v} is above its largest value, {_LIMIT_MAX[k]}")
                if k in limits:
                    raise KeyFileError(f"{where}: {k} given twice")
                limits[k] = int(v)
            d = _digest(key)
            if d in digests:
                raise KeyFileError(f"{where}: the same key is listed twice")
            digests.add(d)
            keys.append(ApiKey(name=name, digest=d, **limits))
        if not keys:
            raise KeyFileError(f"{path}: no keys (an empty key file would lock every client out)")
        try:
            ring = cls(keys)
        except KeyFileError as e:
            raise KeyFileError(f"{path}: {e}") from None
        if once is not None:
            _read_once[once] = ring
        return ring


def _unseekable(path: str | Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` when it is not a regular file (a pipe or a device: read once), else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # the read says why
    return None if stat.S_ISREG(st.st_mode) else (st.st_dev, st.st_ino)


def _warn_if_shared(path: str | Path) -> None:
    """Warn (once per file and mode) when users other than its owner may read the key file (its keys are theirs
    to use) or write it (a key of their own added); as ssh does for a private key, though not refused: a file made
    under the usual umask 022 is world-readable and refusing it would stop orchestrators that started before."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        return  # a pipe (<(...)) or a device: no permissions of its own to fix
    mode = stat.S_IMODE(st.st_mode)
    loose = [what for bit, what in ((stat.S_IROTH, "read"), (stat.S_IWOTH, "write")) if mode & bit]
    if loose and (str(path), mode) not in _warned:
        _warned.add((str(path), mode))
        logger.warning("the API key file %s (mode %04o) lets other users of this host %s it: chmod 600 %s", path,
                       mode, " and ".join(loose), path)


def bearer_key(headers: dict[str, str]) -> Optional[str]:
    """The key a request presents (``X-API-Key`` or ``Authorization: Bearer``), or None."""
    key = headers.get("x-api-key")
    auth = headers.get("authorization", "")
    if not key and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    return key or None
