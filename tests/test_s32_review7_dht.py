"""Review of f3fd9be (swarm/dht.py): how the DHT process died, on a platform without ``os.waitid`` (macOS)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time

import pytest

from petals_chain.swarm.dht import _killed_by


def _sleep() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # the defaults, as a DHT process has them (not a handler of pytest)
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(60)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_signal_that_ended_the_dht_process_is_known_without_waitid(monkeypatch, sig):
    # macOS has no os.waitid: a DHT process stopped with its service (SIGTERM) read as "exited unexpectedly", and the
    # role was reported lost at once (a server exited 1 and skipped its drain), the case f3fd9be fixed on Linux
    process = multiprocessing.get_context("fork").Process(target=_sleep, daemon=True)
    process.start()
    try:
        os.kill(process.pid, sig)
        multiprocessing.connection.wait([process.sentinel], timeout=60)
        monkeypatch.delattr(os, "waitid", raising=False)
        assert _killed_by(process) == sig
        assert process.exitcode == -sig  # its status is kept for shutdown()'s join
    finally:
        process.kill()
        process.join(timeout=30)


def test_a_dht_process_that_exited_by_itself_was_killed_by_nothing_without_waitid(monkeypatch):
    process = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,), daemon=True)
    process.start()
    try:
        multiprocessing.connection.wait([process.sentinel], timeout=60)
        monkeypatch.delattr(os, "waitid", raising=False)
        assert _killed_by(process) is None
    finally:
        process.join(timeout=30)
