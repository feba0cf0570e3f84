"""Locks shared by forked processes that a killed holder does not leave held.

hivemind guards the pipe its DHT processes send results on (and a few other process-wide things) with
``multiprocessing.Lock``s created when it is imported: semaphores shared by every process forked afterwards. A
process killed while holding one (a DHT process stopped "the hard way" in the middle of a reply, a role killed by
its operator or a test) leaves it held for good, and every DHT process of the same family then blocks on its first
reply, so its start never returns. :class:`RobustProcessLock` is a POSIX record lock (``fcntl.lockf``) on a private
unlinked file, which the kernel releases when its holder dies, plus a thread lock for the threads of one process
(record locks belong to a process and are not inherited by ``fork``).
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import threading
import time
import weakref
from typing import Optional

_POLL_S = 0.002  # between non-blocking tries when acquire() has a timeout


class RobustProcessLock:
    """A mutex for the threads of this process and of every process forked from it after its creation.

    Same interface as ``multiprocessing.Lock`` (``acquire(block, timeout)``, ``release``, a context manager); a
    holder that dies, even by SIGKILL, releases it."""

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="petals-chain-lock-")
        os.unlink(path)  # only the inherited descriptor names it; nothing is left behind
        self._fd = fd
        self._thread_lock = threading.Lock()
        _LIVE.add(self)

    def acquire(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        deadline = None if (not block or timeout is None) else time.monotonic() + max(0.0, timeout)
        if not self._thread_lock.acquire(block, -1 if deadline is None else max(0.0, timeout)):
            return False
        try:
            if block and deadline is None:
                fcntl.lockf(self._fd, fcntl.LOCK_EX)
                return True
            while True:
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
                    if deadline is None or time.monotonic() >= deadline:
                        self._thread_lock.release()
                        return False
                    time.sleep(_POLL_S)
        except BaseException:
            self._thread_lock.release()
            raise

    def release(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _after_fork_in_child(self) -> None:
        # A thread of the parent may have held the thread lock at fork; that thread does not exist here. The
        # record lock was not inherited, so this process holds nothing.
        self._thread_lock = threading.Lock()

    def __del__(self) -> None:
        try:
            os.close(self._fd)
        except Exception:  # OSError, or os already torn down at interpreter exit
            pass


_LIVE: "weakref.WeakSet[RobustProcessLock]" = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for lock in list(_LIVE):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_reinit_after_fork)


def install_robust_hivemind_locks() -> None:
    """Replace hivemind's process-wide ``multiprocessing.Lock``s by new :class:`RobustProcessLock`s.

    Shared with processes forked from now on (a DHT process and the process that started it), not with the
    process that forked this one. A no-op until hivemind is imported; call it again in a forked role."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture._initialization_lock = RobustProcessLock()
        mpfuture.MPFuture._update_lock = RobustProcessLock()  # the one every DHT reply takes
        mpfuture.SharedBytes._lock = RobustProcessLock()
    hm_asyncio = sys.modules.get("hivemind.utils.asyncio")
    if hm_asyncio is not None:
        hm_asyncio._AsyncContextWrapper.EXECUTOR_LOCK = RobustProcessLock()
