"""The orchestrator's process and HERD groups: defects found by a hunt (leftovers of the last review first)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from types import SimpleNamespace

import pytest


@pytest.fixture
def _signal_handlers_restored():
    """serve's event loop, closing, resets the handlers it installed: put back this process's own."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


class _JoiningOrchestrator:
    """An orchestrator whose start joins its DHT node in a thread (as core's does) that returns only once the test
    says so; what was started and stopped is recorded."""

    def __init__(self, cfg, release: threading.Event):
        self.cfg, self.release = cfg, release
        self.model_id, self.prefix, self.dht = "m", "m", None
        self.events: list[str] = []

    def load_model(self) -> None:
        pass

    async def start(self, shared=None) -> None:
        def join() -> str:
            os.kill(os.getpid(), signal.SIGTERM)  # a stop while the node joins
            assert self.release.wait(10), "the stop was never taken"
            return "node"

        self.dht = await asyncio.to_thread(join)
        self.events.append("started")

    async def stop(self) -> None:
        self.events.append("stopped" if self.dht is not None else "stopped without its node")
        self.dht = None


class _Taken(logging.Handler):
    def __init__(self, release: threading.Event):
        super().__init__()
        self.taken = release

    def emit(self, record: logging.LogRecord) -> None:
        if "stopping once" in record.getMessage():
            self.taken.set()


def test_sigterm_while_the_dht_node_joins_stops_it_once_joined(monkeypatch, caplog, _signal_handlers_restored):
    """SIGTERM before serving ended the process at once (SIGTERM's default): its DHT process and p2pd ran on (the
    real process: ``python -m petals_chain.orchestrator`` killed as its p2pd appeared, both left running). Now the
    start finishes, the node is stopped, and serve returns as after a stop while serving."""
    from petals_chain.orchestrator import __main__ as orch_main
    from petals_chain.orchestrator import api, core

    release = threading.Event()
    made: list[_JoiningOrchestrator] = []
    monkeypatch.setattr(core, "Orchestrator", lambda cfg: made.append(_JoiningOrchestrator(cfg, release)) or made[-1])
    monkeypatch.setattr(api, "create_app", lambda orch, *a: pytest.fail("served after a stop while starting"))

    def interrupted(signum, frame):  # the old code's default would have ended pytest: a stop as Ctrl-C instead
        release.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    taken = _Taken(release)
    caplog.set_level(logging.INFO, logger=orch_main.logger.name)
    orch_main.logger.addHandler(taken)
    cfg = SimpleNamespace(host="127.0.0.1", port=0, ssl_certfile=None, ssl_keyfile=None, public_ip=None,
                          public_url=None, model="m")
    try:
        asyncio.run(orch_main.serve([cfg]))
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "interrupted"
    finally:
        orch_main.logger.removeHandler(taken)
    assert (outcome, made[0].events) == ("returned", ["started", "stopped"])


def test_a_deadline_too_large_for_a_float_is_left_to_the_api_validation():
    """A 400-digit integer ``deadline_ms`` to an orchestrator that knows no split yet raised OverflowError in the
    forward's wait for a target (a 500); now it counts as no deadline there and the API answers it (400)."""
    import time

    from petals_chain.orchestrator.resume import first_deadline_s, with_time_gone

    huge = b'{"prompt": "x", "deadline_ms": 1' + b"0" * 400 + b', "ttft_deadline_ms": 400}'
    assert first_deadline_s(huge) == 0.4
    assert b'"deadline_ms": 1' + b"0" * 400 in with_time_gone(huge, time.monotonic() - 0.1)


def test_a_relayed_session_stream_whose_orchestrator_goes_silent_ends_with_an_error_event(monkeypatch):
    """A forwarded session stream (relayed as bytes) whose orchestrator stops refreshing its group record, the
    connection left open (its host gone): the relay waited for good (8 s in the reproducer, no end). Now it ends
    within a tick or two with a ``stream_cut`` error event, the events before it whole."""
    import asyncio
    from types import SimpleNamespace as NS

    import httpx
    from starlette.requests import Request

    import petals_chain.orchestrator.forward as fw

    url, live, closed = "http://other:8000", [True], []
    orch = NS(dispatch=NS(chains=["c"], max_queue=None, queue_length=0),
              groups=NS(me="me", forwarded=0, session_owners=fw.SessionOwners(), json=lambda: {"orchestrators": [
                  {"peer_id": "other", "http_url": url, "live": live[0], "servers": 3, "arrival_rate": 0.0}]}))
    orch.groups.session_owners.remember("s1", url)

    class Silent(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"session_id":"s1","text":"a",'
            yield b'"token_ids":[1],"finish_reason":null}\n\ndata: {"text":"half'
            live[0] = False  # no record any more, and no end of the connection either
            await asyncio.Event().wait()

        async def aclose(self):
            closed.append("upstream")

    real = httpx.AsyncClient

    class Client(real):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(
                lambda req: httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Silent())), **kw)

    monkeypatch.setattr(fw.httpx, "AsyncClient", Client)

    async def main():
        sent = [False]

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": b'{"prompt":"x","stream":true}', "more_body": False}
            await asyncio.Event().wait()

        scope = {"type": "http", "method": "POST", "path": "/api/v1/sessions/s1/generate", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "asgi": {"version": "3.0"}}
        resp = await fw.forward_session_call(orch, Request(scope, receive), "s1")
        got = bytearray()

        async def send(message):
            got.extend(message.get("body", b""))

        try:
            await asyncio.wait_for(resp(scope, receive, send), 5)
        except asyncio.TimeoutError:
            pass
        return bytes(got)

    got = asyncio.run(main())
    events = got.split(b"\n\n")
    assert events[0] == b'data: {"session_id":"s1","text":"a","token_ids":[1],"finish_reason":null}', got
    assert b'"code":"stream_cut"' in events[1] and events[2:] == [b"data: [DONE]", b""], got
    assert closed == ["upstream"]


def test_rival_splits_at_one_epoch_after_a_partition_are_settled_by_the_leader():
    """Three orchestrators, one server: cut off from each other, B and C each led and took the server at epoch 2.
    Healed, leader A adopted B's split, found the server best where it is and published nothing newer: C kept its
    own epoch-2 split for good, and B and C both planned the server. The leader now publishes above a rival split."""
    import asyncio

    from test_herd_groups import _servers_world

    seen, entries, now, coordinator, rounds = _servers_world(1)

    async def main():
        cs = {o: coordinator(o, "A" if o != "A" else "B") for o in "ABC"}
        for o, c in cs.items():
            c.peers = set(cs) - {o}
        await rounds(10, *cs.values())
        assert [c.members() for c in cs.values()] == [{"s0"}, set(), set()]
        heard = {o: c.dht.afetch_groups for o, c in cs.items()}
        for o, c in cs.items():
            async def alone(prefix, peers, fetch=heard[o], me=o):
                return {k: v for k, v in (await fetch(prefix, peers)).items() if k == me}
            c.dht.afetch_groups = alone
        await rounds(8, *cs.values())
        assert (cs["B"].epoch, cs["C"].epoch) == (2, 2) and cs["B"].members() == cs["C"].members() == {"s0"}
        for o, c in cs.items():
            c.dht.afetch_groups = heard[o]
        await rounds(3, *cs.values())
        assert sorted(len(c.members()) for c in cs.values()) == [0, 0, 1]
        assert len({tuple(sorted(c.split.items())) for c in cs.values()}) == 1

    asyncio.run(main())


def test_a_split_at_the_largest_epoch_is_not_continued_from():
    """A leader continues above the highest split epoch it reads: an entry at the largest epoch a record carries
    (``EPOCH_MAX``) made its next split one no record could carry, so it could publish none again. Such an entry is
    not followed or continued from."""
    import asyncio

    from test_herd_groups import _servers_world

    from petals_chain.swarm.records import EPOCH_MAX, GroupRecord

    dead = GroupRecord(orchestrator_peer_id="B", epoch=EPOCH_MAX, groups={"B": ["s0"]})
    seen, entries, now, coordinator, rounds = _servers_world(1, entries={"B": dead})

    async def main():
        a = coordinator("A", "B")
        await rounds(10, a)
        assert 0 < a.epoch < EPOCH_MAX and entries["A"].epoch == a.epoch and a.members() == {"s0"}

    asyncio.run(main())
