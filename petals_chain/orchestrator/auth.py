"""API keys: who a request comes from, and each client's own limits.

``--api-keys FILE`` holds one key a line (a ``#`` at the start of a line or after a space starts a comment; in a
key it is part of the key)::

    NAME KEY [max_concurrent=N] [tokens_per_minute=N] [max_sessions=N] [deadline_ms=N] [ttft_deadline_ms=N]

``deadline_ms`` / ``ttft_deadline_ms`` are the key's default deadlines (a request's own fields override them). A key
is printable ASCII without spaces (what an HTTP header carries), at least :data:`MIN_KEY_CHARS` long. A file other
users of the host may read or write, or its group may write, is loaded with a warning (``chmod 600``).

The orchestrator reads the file once at start and then watches it (:class:`KeyFile`): an edit (also an editor's
replace-by-rename) is loaded within ``--api-keys-reload-s`` seconds (plus :data:`SETTLE_S` after its last write),
without a restart. A new key works at once, a removed one is refused (401) from its next request on (what already
runs or waits finishes), changed limits apply to the next request. An edit that does not parse, or a file gone, keeps
the keys loaded before and is logged once. A file rewritten in place (``cat new > keys``) is read only once it has
not changed for :data:`SETTLE_S`: read half-written, the names after the cut were removed for a poll. A pipe or a
device (``--api-keys <(...)``) is read once.

Clients send ``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``). The client identity everywhere (limits,
session ownership, metrics, fairness) is the key's *name*; the key itself is kept only as a SHA-256 digest and
never shown. Without ``--api-keys`` every request is the one client ``anonymous``.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from petals_chain.orchestrator.deadlines import MAX_DEADLINE_MS

ANONYMOUS = "anonymous"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@\-]{0,63}$")
_LIMITS = ("max_concurrent", "tokens_per_minute", "max_sessions", "deadline_ms", "ttft_deadline_ms")
_LIMIT_MAX = {"max_concurrent": 10**9, "tokens_per_minute": 10**12, "max_sessions": 10**9,
              "deadline_ms": int(MAX_DEADLINE_MS), "ttft_deadline_ms": int(MAX_DEADLINE_MS)}
MIN_KEY_CHARS = 16
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: a header's bytes are read as latin-1, a file's as UTF-8
_COMMENT = re.compile(r"(?:^|\s)#")  # a '#' inside a field is part of it (it cut a key short, silently)

DEFAULT_RELOAD_S = 2.0  # --api-keys-reload-s
# A changed file is read once it has been left alone this long: a rewrite in place (truncate, then write) is done
# in milliseconds, and a poll between its writes read a file whose later names had been removed.
SETTLE_S = 1.0
# ~150,000 keys; each look-up compares every key, so a ring that large is already slow
MAX_KEY_FILE_BYTES = 16 * 2**20
logger = logging.getLogger(__name__)
_warned: set[tuple[str, int]] = set()  # (path, mode) warned about: the file is read again at each change

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
    """The configured keys, found by their SHA-256 digests (a key itself is never kept)."""

    def __init__(self, keys: list[ApiKey]):
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise KeyFileError("duplicate key names")
        self.keys = list(keys)
        self._by_name = {k.name: k for k in keys}
        self._by_digest = {k.digest: k for k in keys}

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, key: str) -> Optional[ApiKey]:
        # By the key's SHA-256 digest: what a look-up's time could tell (which digests share a hash bucket) says
        # nothing about any key, and comparing every entry in turn cost 58 ms a request with 200,000 keys.
        return self._by_digest.get(_digest(key))

    def get(self, name: str) -> Optional[ApiKey]:
        return self._by_name.get(name)

    @classmethod
    def from_file(cls, path: str | Path) -> "KeyRing":
        """Parse an API key file; raises :class:`KeyFileError` naming the first bad line. Each call reads the file
        (a pipe reads empty the second time: :class:`KeyFile` reads it once and is shared)."""
        return cls.parse(_read_key_text(path), path)

    @classmethod
    def parse(cls, text: str, path: str | Path) -> "KeyRing":
        """Parse the text of an API key file read from ``path`` (named in the errors)."""
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
            return cls(keys)
        except KeyFileError as e:
            raise KeyFileError(f"{path}: {e}") from None


def _read_key_text(path: str | Path) -> str:
    """The text of the key file at ``path`` (:class:`KeyFileError` if unreadable, or larger than
    :data:`MAX_KEY_FILE_BYTES`), warning if it is shared."""
    try:
        with open(path, "rb") as f:  # at most the limit read: a file replaced by a log of gigabytes was read whole
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise KeyFileError(f"cannot read the API key file {path}: {e}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"the API key file {path} is larger than {MAX_KEY_FILE_BYTES // 2**20} MiB: not a key file")
    try:  # utf-8-sig: a byte order mark (Notepad's) made the first name invalid
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # a binary file, or another encoding: a traceback before
        raise KeyFileError(f"the API key file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    _warn_if_shared(path)
    return text


# a listener of a reload: (added, removed, changed) key names
ReloadListener = Callable[[set[str], set[str], set[str]], None]


class KeyFile:
    """The keys of an ``--api-keys`` file, reloaded when the file changes: the :class:`KeyRing` interface over the
    ring loaded last, which one orchestrator process shares among every model's API.

    Every ``reload_s`` seconds (0: never) at most, a look-up (or :meth:`watch`) stats the file; a new
    ``(st_mtime_ns, st_size, st_ino, st_dev)`` (a rename over it is a new inode) has it read again, and a new text
    parsed. The path is followed (``stat``, not ``lstat``): a Kubernetes Secret's ``..data`` symlink swapped to a new
    version is a change. On an event loop the stat, read and parse run in a thread of their own and the look-up
    answers from the ring loaded last: a file system that hangs (NFS), or a large file, stalled every request, the
    health checks too. A text that fails to parse, or a file gone, keeps the old ring and is logged once per version
    of the file, not per poll. A pipe or a device is read once and never watched. The constructor raises
    :class:`KeyFileError` for a bad file (the orchestrator exits 2 before the model loads).

    A change is loaded only once it is stable, as a file rewritten in place can be caught between two writes (cut at
    a line boundary it parses, and every name after the cut was removed for a poll: 401s, sessions closed, the
    client's state forgotten). Stable: unmodified for ``settle_s`` (by its modification time; if that is more
    recent, or ahead of this host's clock, the poll waits until it would be, at most ``settle_s``, and finds the
    stat unchanged), and the stat the same before and after the read. A file still changing is read again at the
    next poll: an edit is loaded within two polls. The wait runs in the poll's thread (:meth:`poll` called directly
    blocks for it). ``clock`` (due times) and ``sleep`` (the wait) are replaceable for tests."""

    def __init__(self, path: str | Path, reload_s: float = DEFAULT_RELOAD_S,
                 clock: Callable[[], float] = time.monotonic, settle_s: float = SETTLE_S,
                 sleep: Callable[[float], None] = time.sleep):
        if not (0 <= reload_s < float("inf")):
            raise ValueError(f"reload_s must be a finite number of seconds >= 0, got {reload_s!r}")
        if not (0 <= settle_s < float("inf")):
            raise ValueError(f"settle_s must be a finite number of seconds >= 0, got {settle_s!r}")
        self.path, self.reload_s, self._clock = str(path), float(reload_s), clock
        self.settle_s, self._sleep = float(settle_s), sleep
        try:
            st: Optional[os.stat_result] = os.stat(self.path)
        except OSError:
            st = None  # the read below says why
        # stat before the read: a change between the two is seen by the next poll (read again), never lost
        self._seen: tuple = _signature(st) if st is not None else ()
        text = _read_key_text(self.path)
        self._ring = KeyRing.parse(text, self.path)
        self._text = _text_digest(text)  # of the version read last (loaded or refused): a touch reloads nothing
        self._racy = st is not None and _racy(st)
        self.watching = reload_s > 0 and st is not None and stat.S_ISREG(st.st_mode)
        self._due = clock() + self.reload_s
        self._reading = threading.Lock()  # one read of the file at a time (a thread's, or a caller's)
        self._pending: Optional[asyncio.Future] = None  # the poll running in a thread, on its event loop
        self.reloads = 0  # edits loaded
        self.failures = 0  # edits refused (kept the old keys), and times the file was found gone or unreadable
        self.listeners: list[ReloadListener] = []

    # ---- the KeyRing interface (each access polls the file when a poll is due) ----------------------
    @property
    def ring(self) -> KeyRing:
        """The keys loaded last (after a poll, if one was due and no event loop runs here)."""
        self.poll_if_due()
        return self._ring

    @property
    def keys(self) -> list[ApiKey]:
        return self.ring.keys

    def __len__(self) -> int:
        return len(self.ring)

    def lookup(self, key: str) -> Optional[ApiKey]:
        return self.ring.lookup(key)

    def get(self, name: str) -> Optional[ApiKey]:
        return self.ring.get(name)

    # ---- reloading -----------------------------------------------------------------------------------
    def poll_if_due(self) -> bool:
        """A poll if ``reload_s`` has passed since the last one: on a running event loop started in a thread
        (False: its keys are loaded when it ends), else :meth:`poll` here; True if the keys changed."""
        if not self.watching:
            return False
        now = self._clock()
        if now < self._due:
            return False
        self._due = now + self.reload_s
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.poll()
        self._poll_in_thread()
        return False

    def poll(self) -> bool:
        """Load the file again, here, if it changed since it was read last; True if the keys changed. Never raises:
        a failure is logged (once per version of the file) and the keys loaded before stay. It blocks while the
        file is read: on an event loop use :meth:`poll_async`."""
        ring = self._load()
        return self._apply(ring) if ring is not None else False

    async def poll_async(self) -> bool:
        """:meth:`poll` with the file read in a thread (or the poll already running joined); True if the keys
        changed."""
        if not self.watching:
            return False
        return await asyncio.shield(self._poll_in_thread())

    def _poll_in_thread(self) -> asyncio.Future:
        """The future of a poll whose read runs in a daemon thread (not the loop's executor: a read that never
        returns would hold up the loop's shutdown); the keys read are loaded on the loop. One at a time."""
        loop = asyncio.get_running_loop()
        pending = self._pending
        if pending is not None and not pending.done() and pending.get_loop() is loop:
            return pending  # a hung read keeps its thread, and no second one piles up behind it
        done = self._pending = loop.create_future()

        def read() -> None:
            try:
                ring, error = self._load(), None
            except BaseException as e:  # noqa: BLE001 - _load raises nothing it expects; a bug is logged on the loop
                ring, error = None, e
            try:
                loop.call_soon_threadsafe(self._loaded, done, ring, error)
            except RuntimeError:  # the loop closed meanwhile: the next poll reads and loads the file again
                with self._reading:
                    self._seen, self._text = (), b""

        threading.Thread(target=read, name="api-keys-poll", daemon=True).start()
        return done

    def _loaded(self, done: asyncio.Future, ring: Optional[KeyRing], error: Optional[BaseException]) -> None:
        changed = False
        if error is not None:
            logger.error("polling the API key file %s failed", self.path, exc_info=error)
        elif ring is not None:
            changed = self._apply(ring)
        if not done.done():
            done.set_result(changed)

    def _load(self) -> Optional[KeyRing]:
        """The ring of the file if it changed and parses, else None (a failure logged once per version)."""
        if not self.watching:
            return None
        with self._reading:
            return self._load_locked()

    def _load_locked(self) -> Optional[KeyRing]:
        try:
            st = os.stat(self.path)
        except OSError as e:  # gone (an editor's delete-and-write, caught between the two) or no longer ours
            gone = ("gone", e.errno)
            if self._seen != gone:
                self._seen, self._text = gone, b""
                self._failed(f"the API key file {self.path} cannot be read ({e.strerror or e})")
            return None
        sig = _signature(st)
        if sig == self._seen and not self._racy:
            return None
        if not stat.S_ISREG(st.st_mode):  # replaced by a FIFO (its read would block) or a directory
            if self._seen != sig:
                self._seen, self._text = sig, b""
                self._failed(f"the API key file {self.path} is no longer a regular file")
            return None
        if sig != self._seen and (wait := self._unsettled_for(st)) > 0:
            self._sleep(wait)  # a rewrite in place may be between two writes: wait for it to end
            try:
                st = os.stat(self.path)
            except OSError:
                return None  # gone meanwhile: the next poll says so
            if _signature(st) != sig:
                return None  # still being written: read at the next poll (the stat is not marked seen)
        # a change within the file system's timestamp granularity after a read leaves the stat as it was: a file
        # modified just before it was read is read again at the next poll, until it is older than that
        self._seen, self._racy = sig, _racy(st)
        try:
            text, error = _read_key_text(self.path), None
        except KeyFileError as e:
            text, error = "", e
        try:
            changed_meanwhile = _signature(os.stat(self.path)) != sig
        except OSError:
            changed_meanwhile = True
        if changed_meanwhile:  # written while read (a torn text, or a torn UTF-8 character): the next poll reads it
            return None
        if error is not None:  # said once: a read again while the file is recent fails alike
            if self._text != (marker := _text_digest(f"\0{error}")):
                self._text = marker
                self._failed(str(error))
            return None
        digest = _text_digest(text)
        if digest == self._text:
            return None
        self._text = digest
        try:
            return KeyRing.parse(text, self.path)
        except KeyFileError as e:
            self._failed(str(e))
            return None

    def _unsettled_for(self, st: os.stat_result) -> float:
        """Seconds until the file of ``st`` has gone ``settle_s`` unmodified (by its modification time; at most
        ``settle_s``, so a time ahead of this host's clock costs one wait, not the skew)."""
        age_s = (time.time_ns() - st.st_mtime_ns) / 1e9
        return min(self.settle_s, max(0.0, self.settle_s - age_s))

    def _apply(self, ring: KeyRing) -> bool:
        """Make ``ring`` the keys, log the change by name and tell the listeners; True if a key changed."""
        old, self._ring = self._ring, ring
        self.reloads += 1
        before, after = {k.name: k for k in old.keys}, {k.name: k for k in ring.keys}
        added, removed = set(after) - set(before), set(before) - set(after)
        changed = {n for n in set(before) & set(after) if before[n] != after[n]}  # its key or its limits
        names = [f"+{n}" for n in sorted(added)] + [f"-{n}" for n in sorted(removed)] + \
            [f"~{n}" for n in sorted(changed)]
        logger.info("API keys reloaded from %s: %d keys (%s)", self.path, len(ring),
                    ", ".join(names) if names else "no key changed")
        for listener in list(self.listeners):
            try:
                listener(added, removed, changed)
            except Exception:  # noqa: BLE001 - a listener's bug must not undo the reload nor fail the request
                logger.exception("a listener of the API key reload failed")
        return bool(names)

    def _failed(self, why: str) -> None:
        self.failures += 1
        logger.error("%s: keeping the %d API keys loaded before (the file is read again when it changes)", why,
                     len(self._ring))

    async def watch(self) -> None:
        """Poll the file every ``reload_s`` seconds until cancelled, so that an idle orchestrator reloads (and
        logs) an edit too; look-ups poll it when due as well."""
        if not self.watching:
            return
        while True:
            await asyncio.sleep(max(0.0, self._due - self._clock()) + 0.01)
            if self._clock() < self._due:
                continue
            self._due = self._clock() + self.reload_s
            try:
                await self.poll_async()
            except Exception:  # noqa: BLE001 - a bug here must not end the watch (look-ups still poll)
                logger.exception("polling the API key file %s failed", self.path)


def _signature(st: os.stat_result) -> tuple:
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


def _racy(st: os.stat_result) -> bool:
    """Whether ``st``'s file was modified so recently that a write after the read may have left its stat as is
    (file systems stamp times from a coarse clock)."""
    return time.time_ns() - st.st_mtime_ns < 2_000_000_000


def _text_digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def _warn_if_shared(path: str | Path) -> None:
    """Warn (once per file and mode) when users other than its owner may read the key file (its keys are theirs
    to use) or write it (a key of their own added), members of its group included; as ssh does for a private key,
    though not refused: a file made under the usual umask 022 is world-readable and refusing it would stop
    orchestrators that started before."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        return  # a pipe (<(...)) or a device: no permissions of its own to fix
    mode = stat.S_IMODE(st.st_mode)
    others = [what for bit, what in ((stat.S_IROTH, "read"), (stat.S_IWOTH, "write")) if mode & bit]
    who = [f"other users of this host {' and '.join(others)} it"] if others else []
    if mode & stat.S_IWGRP:  # a group member can add a key of their own (read by the group alone is as ssh allows)
        who.append("members of its group write it")
    if who and (str(path), mode) not in _warned:
        _warned.add((str(path), mode))
        logger.warning("the API key file %s (mode %04o) lets %s: chmod 600 %s", path, mode, " and ".join(who), path)


def bearer_key(headers: dict[str, str]) -> Optional[str]:
    """The key a request presents (``X-API-Key`` or ``Authorization: Bearer``), or None."""
    key = headers.get("x-api-key")
    auth = headers.get("authorization", "")
    if not key and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    return key or None
