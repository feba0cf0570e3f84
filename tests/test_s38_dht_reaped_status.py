"""A DHT process ended by a stop signal, reaped by another thread of its role before the watch read how it ended.

``multiprocessing``'s ``Popen.poll`` reaps the child (``os.waitpid``) and only then records its status. The DHT
watch read the status with ``waitid(WNOWAIT)``, and where the child was reaped already, from ``exitcode``: a thread
of the role between those two steps (``dht.join`` in ``SwarmDHT.shutdown``, ``SwarmDHT.alive`` in the server's
``announce_offline``) left it no status at all, and the watch took that for a crash. A SIGTERM'd DHT process (systemd's
control-group stop) was then reported lost at once, without the grace its role gets to stop it: the server exited 1
and skipped its drain. (CI failure of ``test_s32_roles``'s stop-signal test on a loaded host, whose ``join`` races the
watch so.) The race is widened here: the reaping thread waits, between the reap and the record, until the watch read.
"""

from __future__ import annotations

import os
import signal
import threading


def test_a_stop_signal_death_reaped_by_another_thread_gets_the_grace(scaled, monkeypatch):
    from petals_chain.swarm import dht as dht_module
    from petals_chain.swarm.dht import SwarmDHT, on_dht_lost

    lost: list = []
    on_dht_lost(lost.append)
    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        monkeypatch.setattr(dht_module, "STOP_SIGNAL_GRACE_S", 3600.0)  # the role's stop comes first
        reaper = threading.get_ident()
        reaped, read = threading.Event(), threading.Event()
        to_exitcode, killed_by = os.waitstatus_to_exitcode, dht_module._killed_by

        def recorded_late(status: int) -> int:  # Popen.poll, right after its waitpid reaped the child
            if threading.get_ident() == reaper and not reaped.is_set():
                reaped.set()
                read.wait(scaled(10))
            return to_exitcode(status)

        def read_after_the_reap(process):
            reaped.wait(scaled(10))
            try:
                return killed_by(process)
            finally:
                read.set()

        monkeypatch.setattr(os, "waitstatus_to_exitcode", recorded_late)
        monkeypatch.setattr(dht_module, "_killed_by", read_after_the_reap)
        os.kill(sd.dht.pid, signal.SIGTERM)
        sd.dht.join(scaled(10))
        assert reaped.is_set() and read.is_set() and sd.dht.exitcode == -signal.SIGTERM
        assert not sd.lost and not lost  # within the grace: the role's stop may still come
        sd.shutdown()
        sd._watch.join(scaled(10))
        assert not sd._watch.is_alive() and not sd.lost and not lost
    finally:
        on_dht_lost(None)
        sd.shutdown()


def test_a_crash_whose_status_another_thread_took_is_still_reported_after_the_grace(monkeypatch, caplog):
    """The other side: a status never recorded (the reaping thread's record lost) delays the report by the grace
    only; the node is still reported lost."""
    import multiprocessing
    import time
    from types import SimpleNamespace

    from petals_chain.swarm import dht as dht_module

    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    process.start()
    os.kill(process.pid, signal.SIGKILL)
    os.waitpid(process.pid, 0)  # reaped here: multiprocessing never learns how it ended
    sd = SimpleNamespace(dht=process, _closing=False, _shut=threading.Event(), lost=False)
    lost: list = []
    monkeypatch.setattr(dht_module, "STOP_SIGNAL_GRACE_S", 0.0)
    monkeypatch.setattr(dht_module, "_on_lost", lost.append)
    dht_module._watch_dht_process(sd)
    assert sd.lost and lost == [sd]
    assert f"the DHT process (pid {process.pid}) exited unexpectedly" in caplog.text
