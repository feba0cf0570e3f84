"""Locks that a killed holder releases, and DHT starts that cannot hang on hivemind's process-wide locks."""

import multiprocessing as mp
import os
import signal
import threading
import time

import psutil
import pytest

from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.process_locks import RobustProcessLock

_FORK = mp.get_context("fork")


def _hold(lock: RobustProcessLock, held, release) -> None:
    with lock:
        held.set()
        release.wait(30)


def _hold_until_killed(lock: RobustProcessLock, held) -> None:
    lock.acquire()
    held.set()
    time.sleep(60)


def test_a_lock_excludes_forked_processes_and_is_released_when_its_holder_is_killed():
    lock = RobustProcessLock()
    held = _FORK.Event()  # only set by the child: a waiter killed inside an mp.Event would jam it
    child = _FORK.Process(target=_hold_until_killed, args=(lock, held))
    child.start()
    try:
        assert held.wait(10)
        t0 = time.monotonic()
        assert not lock.acquire(timeout=0.3)  # the child holds it
        assert time.monotonic() - t0 >= 0.25
        assert not lock.acquire(block=False)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # dies holding it
        child.join(10)
    assert lock.acquire(timeout=5)
    lock.release()


def test_a_lock_excludes_threads_of_one_process_and_survives_a_fork_while_a_thread_holds_it():
    lock = RobustProcessLock()
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(lock, held, release), daemon=True)
    holder.start()
    assert held.wait(10)
    assert not lock.acquire(timeout=0.2)  # record locks alone would let a second thread in

    def in_child(result):
        # forked while another thread of the parent holds it: the thread lock is fresh here, the record lock is
        # still the parent's, so the child waits for the parent's thread, then gets it
        result.put(lock.acquire(timeout=0.3))
        result.put(lock.acquire(timeout=10))

    result = _FORK.Queue()
    child = _FORK.Process(target=in_child, args=(result,))
    child.start()
    assert result.get(timeout=10) is False
    release.set()
    holder.join(10)
    assert result.get(timeout=15) is True
    child.join(10)
    assert child.exitcode == 0
    assert lock.acquire(timeout=5)
    lock.release()


def _take_hivemind_reply_lock_and_die() -> None:
    from hivemind.utils.mpfuture import MPFuture

    MPFuture._update_lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dht_process_killed_holding_the_reply_lock_does_not_hang_the_next_dht_start():
    """hivemind's DHT processes send every result under one lock shared by all processes forked from the same
    parent; one killed while holding it (hivemind's "terminating it the hard way") used to hang every later DHT
    start of that parent for good (seen in CI: test_token_budget's in-process swarms, 300 s each)."""
    child = _FORK.Process(target=_take_hivemind_reply_lock_and_die)
    child.start()
    child.join(10)
    assert child.exitcode == -signal.SIGKILL
    dht = SwarmDHT.create(ready_timeout_s=60)
    try:
        assert dht.dht.is_alive()
    finally:
        dht.shutdown()


def test_a_dht_start_that_hangs_is_killed_with_its_p2pd_and_raises():
    from hivemind.utils.mpfuture import MPFuture

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with MPFuture._update_lock:  # the new DHT process cannot send "ready" while this process holds it
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not become ready within 3 s"):
            SwarmDHT.create(ready_timeout_s=3)
        assert time.monotonic() - t0 < 30
    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # ended between the listing and the read
            return False

    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and alive(p)]
    assert left == [], [p.cmdline() for p in left]
    dht = SwarmDHT.create(ready_timeout_s=60)  # and the next start works
    dht.shutdown()
