"""A server's DHT record through its whole life, read from a stand-in orchestrator's DHT node (real processes).

* The record stays alive in every state, also while the server is busy for longer than the record lives:
  profiling tau_p, loading its blocks, draining (issue 14, bug 3).
* Assignments the server must not follow: another model's fingerprint, more blocks than ``--max-blocks``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, ServerProcess
from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.records import AssignmentRecord, ServerRecord
from petals_chain.swarm.rpc import ServerClient

PREFIX = "records"
MAX_LENGTH = 64
REFRESH_S = 1.0
# A record lives max(3 x refresh, 10 s) after its last publish (server/announce.py). The slowed server's floor is
# RECORD_TTL_S instead (patched in its process, see SlowServer): each slowed phase outlasts the record's life on its
# own, in 5 s rather than the 12 s that the 10 s floor asked (three phases: 21 s less).
RECORD_TTL_S = 3 * REFRESH_S
SLOW_S = RECORD_TTL_S + 2.0
# Runs tests/slow_server.py with the record's lifetime floor lowered; fails loudly if the property it lowers is gone
# (a renamed one would leave the 10 s floor, and phases shorter than the record's life would prove nothing).
_TTL_PATCH = """
import runpy, sys
from petals_chain.server.announce import Announcer
assert isinstance(Announcer.__dict__.get("expiration_s"), property), "Announcer.expiration_s is not a property"
ttl = float(sys.argv.pop(1))
Announcer.expiration_s = property(lambda self: max(3 * self.refresh_s, ttl))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def server_args(model, orch: SwarmDHT, *extra: str) -> list[str]:
    return ["--model", str(model), "--initial-peers", *orch.visible_maddrs(), "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0", "--dht-prefix", PREFIX, "--memory-bytes", "50000000",
            "--assignment-poll-s", "0.3", "--refresh-s", str(REFRESH_S), "--no-progress", *extra]


def publish(orch: SwarmDHT, epoch: int, spans: dict, fingerprint: str = "") -> None:
    asg = AssignmentRecord(epoch=epoch, max_length=MAX_LENGTH, orchestrator_peer_id=orch.peer_id,
                           assignments={p: list(s) for p, s in spans.items()}, model_fingerprint=fingerprint)
    assert orch.publish_assignment(PREFIX, asg, 300)


class SlowServer(ServerProcess):
    """``tests/slow_server.py``: the real server with its profiling and first load slowed."""

    def __init__(self, profile_s: float, load_s: float, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", PETALS_CHAIN_CACHE_DIR=str(log_path.parent / "cache"))
        self.proc = subprocess.Popen([sys.executable, "-c", _TTL_PATCH, str(RECORD_TTL_S),
                                      str(REPO_ROOT / "tests" / "slow_server.py"), str(profile_s), str(load_s), *args],
                                     cwd=str(REPO_ROOT), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.peer_id = None


async def watch(orch: SwarmDHT, peer: str, phase: str, until, *, max_age: float, timeout: float,
                state: str | None = None) -> tuple[float, ServerRecord]:
    """Read ``peer``'s record every 0.3 s until ``until(record)``: every read must find it, republished within
    ``max_age`` seconds (and in ``state`` if given). Returns the seconds watched and the last record."""
    t0 = time.time()
    while True:
        rec = (await orch.afetch_servers(PREFIX)).get(peer)
        now = time.time()
        assert rec is not None, f"{phase}: the server's record expired {now - t0:.1f} s into the phase"
        assert now - rec.timestamp <= max_age, (f"{phase}: the record was last published {now - rec.timestamp:.1f}"
                                                f" s ago (refresh every {REFRESH_S} s)")
        assert state is None or rec.state == state, f"{phase}: state {rec.state}, expected {state}"
        if until(rec):
            return now - t0, rec
        assert now - t0 < timeout, f"{phase}: no progress in {timeout:.0f} s: {rec}"
        await asyncio.sleep(0.3)


@pytest.mark.slow
def test_record_stays_alive_while_profiling_loading_and_draining(tiny_model_dir, orchestrator_dht, tmp_path,
                                                                   scaled):
    orch = orchestrator_dht
    # a record must be fresh by refresh + slack, and never older than it lives
    max_age = min(scaled(3 * REFRESH_S + 1.0), 9.0)
    proc = SlowServer(SLOW_S, SLOW_S, server_args(tiny_model_dir, orch, "--drain-timeout-s", "120"),
                      tmp_path / "server.log")
    try:
        peer = proc.wait_peer_id(timeout=scaled(60))

        async def scenario() -> None:
            deadline = time.time() + scaled(60)
            while peer not in await orch.afetch_servers(PREFIX):  # the first record: joining, tau_p unknown
                assert time.time() < deadline, proc.log()[-3000:]
                await asyncio.sleep(0.2)
            # 1. profiling tau_p (slowed to SLOW_S): joining, republished all along
            took, rec = await watch(orch, peer, "profiling", lambda r: r.tau_p > 0, max_age=max_age,
                                    timeout=SLOW_S + scaled(30), state="joining")
            assert took >= SLOW_S - 3.0 and rec.tau_p == pytest.approx(0.01)
            # 2. loading the assigned blocks (the first block's load slowed to SLOW_S)
            publish(orch, 1, {peer: (0, 2)})
            took, rec = await watch(orch, peer, "loading", lambda r: r.state == "online", max_age=max_age,
                                    timeout=SLOW_S + scaled(60))
            assert took >= SLOW_S - 1.0 and (rec.epoch, rec.start_block, rec.num_blocks) == (1, 0, 2)
            # 3. draining: a new span while a session stays open for SLOW_S
            p2p = await orch.replicate_p2p()
            try:
                session = await ServerClient(p2p, step_timeout_s=scaled(60)).open_session(peer, "held", 0, 2,
                                                                                        MAX_LENGTH)
                await session.step(torch.zeros(1, 1, 64), 0)
                publish(orch, 2, {peer: (2, 2)})
                await watch(orch, peer, "drain starts", lambda r: r.state == "draining", max_age=max_age,
                            timeout=scaled(30))
                t_drain = time.time()
                await watch(orch, peer, "draining", lambda r: time.time() - t_drain >= SLOW_S, max_age=max_age,
                            timeout=SLOW_S + scaled(10), state="draining")
                await session.close()
            finally:
                await p2p.shutdown()
            _, rec = await watch(orch, peer, "reloading", lambda r: r.state == "online" and r.epoch == 2,
                                 max_age=max_age, timeout=scaled(60))
            assert (rec.start_block, rec.num_blocks) == (2, 2)

        asyncio.run(scenario())
        assert proc.stop(timeout=scaled(60)) == 0, proc.log()[-3000:]
        assert orch.fetch_servers(PREFIX)[peer].state == "offline"
    finally:
        proc.kill()


@pytest.mark.slow
def test_assignments_of_another_model_or_too_many_blocks_are_not_followed(tiny_model_dir, orchestrator_dht,
                                                                          server_procs, scaled):
    from petals_chain.swarm.sources import resolve_source

    orch = orchestrator_dht
    fingerprint = resolve_source(tiny_model_dir).fingerprint
    other = "0" * 16 if fingerprint != "0" * 16 else "1" * 16
    proc = server_procs(server_args(tiny_model_dir, orch, "--tau-p", "0.01", "--max-blocks", "2"))
    peer = proc.wait_peer_id(timeout=scaled(60))

    def record_after_polls() -> ServerRecord:
        time.sleep(scaled(3.0))  # ten assignment polls
        rec = orch.fetch_servers(PREFIX).get(peer)
        assert rec is not None, proc.log()[-3000:]
        return rec

    publish(orch, 1, {peer: (0, 2)}, fingerprint=other)  # another model's orchestrator
    rec = record_after_polls()
    assert (rec.state, rec.epoch, rec.num_blocks) == ("joining", -1, 0)
    assert rec.model_fingerprint == fingerprint and rec.max_blocks == 2
    said = f"it serves model {other}, not this server's {fingerprint}"
    assert said in proc.log()
    assert proc.log().count(said) == 1  # said once, not once per poll

    publish(orch, 2, {peer: (0, 3)}, fingerprint=fingerprint)  # our model, one block over --max-blocks
    rec = record_after_polls()
    assert (rec.state, rec.num_blocks) == ("joining", 0)
    assert "exceeds --max-blocks 2" in proc.log()

    publish(orch, 3, {peer: (1, 2)}, fingerprint=fingerprint)  # what the server accepts: it was listening
    deadline = time.time() + scaled(60)
    while time.time() < deadline:
        rec = orch.fetch_servers(PREFIX).get(peer)
        if rec is not None and rec.state == "online":
            break
        time.sleep(0.25)
    assert (rec.state, rec.epoch, rec.start_block, rec.num_blocks) == ("online", 3, 1, 2), proc.log()[-3000:]
    assert proc.stop(timeout=scaled(60)) == 0


def test_the_offline_record_is_retried_until_stored():
    """The last record a leaving server publishes is retried: a store the DHT refuses once (a busy peer) must not
    turn a graceful leave into one the orchestrator only notices by failed pings."""
    from types import SimpleNamespace

    from petals_chain.server.server import Server

    results = [False, False, True]
    calls = []

    async def publish(timeout_s=None) -> bool:
        calls.append(time.monotonic())
        return results[len(calls) - 1]

    server = SimpleNamespace(announcer=SimpleNamespace(publish=publish), sd=SimpleNamespace(alive=True))
    assert asyncio.run(Server.announce_offline(server, attempts=3, backoff_s=0.01)) is True and len(calls) == 3
    calls.clear()
    results[:] = [False] * 3
    assert asyncio.run(Server.announce_offline(server, attempts=3, backoff_s=0.01)) is False and len(calls) == 3
    # the DHT process is gone (a SIGTERM to the process group ended it first): no store is tried (each waited its
    # whole timeout: the server took ~90 s to exit)
    calls.clear()
    server.sd.alive = False
    assert asyncio.run(Server.announce_offline(server, attempts=3, backoff_s=0.01)) is False and calls == []


def test_a_store_cancelled_at_shutdown_leaves_no_unretrieved_error(caplog):
    """The DHT cancels a store in flight when it shuts down: publish() reports False and asyncio has nothing to
    log as "exception was never retrieved" (it logged a traceback at every such shutdown)."""
    import gc
    import logging
    from types import SimpleNamespace

    from petals_chain.server.announce import Announcer

    async def cancelled_store(prefix, record, expiration_s):
        raise asyncio.CancelledError()

    async def stored(prefix, record, expiration_s):
        return True

    async def main(store) -> bool:
        sd = SimpleNamespace(apublish_server=store)
        announcer = Announcer(sd, lambda: [("a", None), ("b", None)], refresh_s=1.0, rejoin_s=1.0,
                              initial_peer_ids=[])
        announcer._stopping = True
        ok = await announcer.publish()
        gc.collect()
        await asyncio.sleep(0)
        return ok

    with caplog.at_level(logging.DEBUG):
        assert asyncio.run(main(cancelled_store)) is False
        assert asyncio.run(main(stored)) is True
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_a_publish_cancelled_by_stop_leaves_no_unretrieved_error(caplog):
    """SIGTERM right after a state change: stop() cancels a publish whose stores are in flight; asyncio logged
    "_GatheringFuture exception was never retrieved" (an ERROR with a traceback) at such a shutdown."""
    import gc
    import logging
    from types import SimpleNamespace

    from petals_chain.server.announce import Announcer

    async def slow_store(prefix, record, expiration_s):
        await asyncio.sleep(10)
        return True

    async def main():
        announcer = Announcer(SimpleNamespace(apublish_server=slow_store), lambda: [("a", None)], refresh_s=30.0,
                              rejoin_s=3600.0, initial_peer_ids=[])
        announcer._rejoin = lambda: asyncio.sleep(0)
        announcer.start()
        announcer.mark_dirty()  # set_state("draining")
        await asyncio.sleep(0.1)  # the publish is in flight
        await announcer.stop()
        gc.collect()
        await asyncio.sleep(0.1)
        gc.collect()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.records
