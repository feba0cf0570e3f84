"""An orchestrator stopped (SIGTERM: systemd, ``docker stop``, Kubernetes; Ctrl-C) with work in flight.

Before: uvicorn closed the socket at once (a new request: connection refused; ``/healthz``: a reset), gave running
requests a fixed 3 s, then cancelled them: a stream ended in a TCP reset mid-stream ("incomplete chunked read", no
event a client could act on), a queued request got a plain-text 500 "Internal Server Error" after those 3 s (and the
log a CancelledError traceback per request); a second SIGTERM did nothing; the interpreter's teardown added 2-3 s.
Now: new API requests get 503 ``shutting_down`` with ``Retry-After`` and ``/healthz`` 503 (load balancers stop
sending), queued requests get that 503 at once, running ones get ``--shutdown-grace-s`` (5 s) to finish, then a stream
ends with an error event (503 ``shutting_down``: the Python client resumes it on another orchestrator) and
``[DONE]``, an unanswered request with the 503; a second signal ends the grace now, one more exits at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest
import torch
from test_queue_bound_siblings import _Session

from petals_chain.model import Chain


def _chain(capacity: int) -> Chain:
    return Chain(servers=("a",), blocks=(2,), service_time=1.0, capacity=capacity, spans=((0, 2),))


@pytest.fixture
def swarm(tiny_model_factory, monkeypatch):
    """An orchestrator of a 2-layer tiny model whose chain sessions open at once and whose steps wait for
    ``gate`` (``stepping`` is set at the first step): ``(orch, app, gate, stepping)``, run inside ``asyncio.run``."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=64, port=0))
    orch.load_model()
    hidden = int(orch.config.hidden_size)
    events: dict[str, asyncio.Event] = {}

    async def forward(self, x, position, budget, tokens):
        events["stepping"].set()
        await events["gate"].wait()
        return torch.zeros(1, len(tokens) - position, hidden, dtype=orch.head.dtype)

    monkeypatch.setattr(failover, "ChainSession", _Session)
    monkeypatch.setattr(failover.ChainHolder, "_forward", forward)

    def start(capacity: int):
        from petals_chain.orchestrator.relay import HeadBatcher

        events["gate"], events["stepping"] = asyncio.Event(), asyncio.Event()
        orch.batcher = HeadBatcher(orch.head, window_s=orch.cfg.head_window_s)
        orch.dispatch.set_chains([_chain(capacity)])
        return orch, create_app(orch), events["gate"], events["stepping"]

    yield start
    if orch.batcher is not None:
        orch.batcher.close()


def _body(orch, stream: bool = False, **kw) -> dict:
    return {"model": orch.model_id, "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True, "temperature": 0,
            "stream": stream, **kw}


def _events(text: str) -> list:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def _shutting_down(r: httpx.Response) -> None:
    """``r`` is the 503 ``shutting_down`` a client sends again elsewhere, with ``Retry-After``."""
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.json()["error"]["code"] == "shutting_down", r.text
    assert int(r.headers["retry-after"]) >= 1, r.headers


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_drain_answers_queued_and_new_requests_at_once_and_lets_the_running_one_finish(swarm):
    """One slot, its request stepping; a request and a stream queued behind it. The drain answers both queued ones
    with 503 ``shutting_down`` at once (before: they hung until uvicorn cancelled them, a plain-text 500), refuses a
    new request so too (before: connection refused) and fails ``/healthz`` (before: 200 until the socket closed),
    while the request that runs finishes as usual."""
    async def main():
        orch, app, gate, stepping = swarm(capacity=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            running = asyncio.ensure_future(c.post("/v1/completions", json=_body(orch, stream=True)))
            await asyncio.wait_for(stepping.wait(), 30)
            queued = asyncio.ensure_future(c.post("/v1/completions", json=_body(orch)))
            queued_stream = asyncio.ensure_future(c.post("/v1/completions", json=_body(orch, stream=True)))
            await _until(lambda: orch.dispatch.queue_length == 2, "two queued requests")
            assert (await c.get("/healthz")).status_code == 200
            assert orch.begin_drain() == 2
            _shutting_down(await asyncio.wait_for(queued, 10))
            r = await asyncio.wait_for(queued_stream, 10)
            if r.status_code == 200:  # admitted (queued): its stream ends with the error event
                last = json.loads(_events(r.text)[-2])["error"]
                assert (last["status"], last["code"]) == (503, "shutting_down"), r.text
            else:
                _shutting_down(r)
            assert orch.dispatch.queue_length == 0
            new = await c.post("/v1/completions", json=_body(orch))
            _shutting_down(new)
            assert new.headers["connection"] == "close"
            h = await c.get("/healthz")
            assert h.status_code == 503 and h.json()["ok"] is False and h.json()["shutting_down"] is True, h.text
            assert (await c.get("/v1/models")).status_code == 200  # reading goes on
            assert app.state.gate.running == 1
            gate.set()
            r = await asyncio.wait_for(running, 30)
            assert r.status_code == 200 and _events(r.text)[-1] == "[DONE]", r.text
            assert not any("error" in e for e in _events(r.text)), r.text
            await asyncio.wait_for(app.state.gate.wait_idle(), 10)

    asyncio.run(main())


def test_requests_still_running_after_the_grace_end_in_an_error_a_client_acts_on(swarm):
    """Cut once the grace is over: a stream ends with a last error event (503 ``shutting_down``) and ``[DONE]``
    (before: a TCP reset mid-stream), a request not answered yet with the 503 and ``Retry-After`` (before: uvicorn's
    plain-text 500 and a traceback in the log); a session's turn under way too."""
    async def main():
        orch, app, gate, stepping = swarm(capacity=4)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            sid = (await c.post("/api/v1/sessions", json={})).json()["session_id"]
            calls = [asyncio.ensure_future(c.post("/v1/completions", json=_body(orch, stream=True))),
                     asyncio.ensure_future(c.post("/v1/chat/completions", json={
                         "model": orch.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})),
                     asyncio.ensure_future(c.post(f"/api/v1/sessions/{sid}/generate",
                                                  json={"input_ids": [1, 2], "max_tokens": 2, "stream": True}))]
            await _until(lambda: orch.dispatch.running == 3, "three running requests")
            await asyncio.wait_for(stepping.wait(), 30)
            orch.begin_drain()
            assert app.state.gate.cut() == 3
            await asyncio.wait_for(app.state.gate.wait_idle(), 10)
            stream, chat, turn = [await asyncio.wait_for(t, 10) for t in calls]
            for r in (stream, turn):
                assert r.status_code == 200, r.text
                *_, last, done = _events(r.text)
                err = json.loads(last)["error"]
                assert (err["status"], err["code"], err["type"]) == (503, "shutting_down", "service_unavailable"), last
                assert done == "[DONE]"
            _shutting_down(chat)
            assert orch.dispatch.running == 0  # their chains given back
        gate.set()

    asyncio.run(main())


def test_the_dispatcher_refuses_new_jobs_once_stopping_but_not_a_running_requests_failover():
    """After ``refuse_waiting`` a new job is refused at once (it passed the API's gate just before the drain: it
    queued behind work about to be cut); a re-queued job (a failover of a request being served) waits on."""
    from petals_chain.orchestrator.core import ShuttingDown
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    async def main():
        dm = DispatchManager()
        dm.set_chains([_chain(1)])
        lease = await dm.acquire(DispatchJob("a"))
        waiting = asyncio.ensure_future(dm.acquire(DispatchJob("b")))
        await _until(lambda: dm.queue_length == 1, "a queued job")
        assert dm.refuse_waiting(ShuttingDown) == 1
        with pytest.raises(ShuttingDown):
            await asyncio.wait_for(waiting, 5)
        assert dm.queue_length == 0
        with pytest.raises(ShuttingDown):
            await dm.acquire(DispatchJob("c"))
        failover = asyncio.ensure_future(dm.acquire(DispatchJob("d", requeue=True)))
        await asyncio.sleep(0.05)
        assert not failover.done()
        dm.release(lease)
        second = await asyncio.wait_for(failover, 5)  # the slot freed goes to it
        dm.release(second)
        assert dm.running == 0

    asyncio.run(main())


def test_a_forwarded_stream_its_orchestrator_ends_because_it_stops_is_finished_elsewhere():
    """HERD: a stream forwarded to another orchestrator that stops now ends with an error event ``shutting_down``
    (it was a TCP reset, which the forwarding orchestrator took for a cut and finished the stream from elsewhere):
    that event is a cut too, not passed on to the client as the stream's end. Any other error event still is."""
    import petals_chain.orchestrator.resume as rs
    from petals_chain.orchestrator.sse import error_event

    def ev(text: str) -> bytes:
        return f"data: {json.dumps({'id': 'c', 'choices': [{'index': 0, 'text': text}]})}\n\n".encode()

    async def collect(events: list[bytes]) -> tuple[list, rs.StreamRecord]:
        async def chunks():
            for e in events:
                yield e

        rec = rs.StreamRecord({"prompt": [1, 2], "stream": True, "temperature": 0}, time.monotonic())
        out: list = []
        try:
            async for e in rs.relay_events(rec, chunks(), lambda: True):
                out.append(e)
        except rs.Cut as e:
            out.append(f"cut: {e}")
        return out, rec

    stopping = error_event(503, "the orchestrator is shutting down", code="shutting_down").encode()
    out, rec = asyncio.run(collect([ev("A"), stopping, b"data: [DONE]\n\n"]))
    assert len(out) == 2 and out[1].startswith("cut: it stops") and not rec.finished and rec.text == {0: "A"}
    failed = error_event(503, "too many failovers", code="swarm_unavailable").encode()
    out, rec = asyncio.run(collect([ev("A"), failed, b"data: [DONE]\n\n"]))
    assert out[1] == failed and rec.finished


class _Gate:
    """A ShutdownGate's face to the stop: ``running`` calls until ``finish()`` or ``cut()``."""

    def __init__(self, running: int):
        self.running, self.cuts = running, 0
        self.idle = asyncio.Event()
        if not running:
            self.idle.set()

    async def wait_idle(self) -> None:
        await self.idle.wait()

    def cut(self) -> int:
        self.cuts += 1
        n, self.running = self.running, 0
        self.idle.set()
        return n


class _App:
    def __init__(self, gate):
        self.state = type("S", (), {"gate": gate})()


class _Orch:
    def __init__(self):
        self.drained = 0

    def begin_drain(self) -> int:
        self.drained += 1
        return 0


def _stop(grace_s: float, running: int = 1):
    from petals_chain.orchestrator.__main__ import _GracefulStop

    gate, orch = _Gate(running), _Orch()
    server = type("Server", (), {"should_exit": False})()
    return _GracefulStop(server, [orch], [_App(gate)], grace_s), server, gate, orch


def test_a_stop_waits_for_running_requests_within_the_grace_then_cuts_them():
    async def main():
        stop, server, gate, orch = _stop(grace_s=0.3)
        stop(signal.SIGTERM)
        stop.begin(10.0)  # once: the DHT watch's begin after a signal changes nothing
        assert orch.drained == 1 and not server.should_exit
        await asyncio.wait_for(stop.task, 10)
        assert server.should_exit and gate.cuts == 1  # not done within 0.3 s: cut
        # done within the grace: not cut, and the server stops as soon as it is done (not after the grace)
        stop, server, gate, orch = _stop(grace_s=60.0)
        stop(signal.SIGINT)
        await asyncio.sleep(0.05)
        gate.running = 0
        gate.idle.set()
        await asyncio.wait_for(stop.task, 10)
        assert server.should_exit and gate.cuts == 0

    asyncio.run(main())


def test_a_second_signal_ends_the_grace_now_and_a_third_exits_at_once(monkeypatch):
    """Before: every signal after the first only set uvicorn's should_exit again (ignored for its 3 s, and during
    the stop after it)."""
    from petals_chain.orchestrator import __main__ as cli

    exits = []
    monkeypatch.setattr(cli, "_stop_now", lambda signum, when="": exits.append((signum, when)))

    async def main():
        stop, server, gate, orch = _stop(grace_s=60.0)
        stop(signal.SIGTERM)
        await asyncio.sleep(0.05)
        assert not stop.task.done() and gate.cuts == 0
        stop(signal.SIGTERM)  # the grace ends now
        await asyncio.wait_for(stop.task, 10)
        assert gate.cuts == 1 and server.should_exit and exits == []
        stop(signal.SIGTERM)  # the stop after the grace runs: at once
        assert exits == [(signal.SIGTERM, "while stopping")]

    asyncio.run(main())


def test_the_shutdown_grace_flag():
    from petals_chain.orchestrator.__main__ import DEFAULT_SHUTDOWN_GRACE_S, build_parser

    p = build_parser()
    assert p.parse_args(["--model", "m"]).shutdown_grace_s == DEFAULT_SHUTDOWN_GRACE_S < 10  # docker stop's timeout
    assert p.parse_args(["--model", "m", "--shutdown-grace-s", "0"]).shutdown_grace_s == 0
    for bad in ("-1", "inf", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "m", "--shutdown-grace-s", bad])


def _slow_post(url: str) -> socket.socket:
    """A POST to the API whose body never arrives whole: a request under way that the orchestrator cannot finish."""
    host, port = url.split("//")[1].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")
    return s


@pytest.mark.slow
def test_sigterm_to_a_real_orchestrator(tiny_model_factory, tmp_path, scaled):
    """The process: after SIGTERM ``/healthz`` answers 503 and a new request 503 ``shutting_down`` (before: connection
    refused or reset: uvicorn's own signal handler, installed over ours, closed the socket at once) while a request
    under way has its grace (here 600 s); a second SIGTERM ends it (before: ignored): that request gets the 503, the
    process exits 0 and its DHT process and p2pd are gone."""
    import psutil

    from petals_chain.swarm.local import LocalSwarm

    sw = LocalSwarm(tiny_model_factory("llama", num_layers=2), [], max_length=64, log_dir=tmp_path,
                    orchestrator_args=["--shutdown-grace-s", "600"])
    sw.start(timeout=scaled(120))
    try:
        pid = sw.orchestrator.popen.pid
        children = psutil.Process(pid).children(recursive=True)
        assert children  # the DHT process and p2pd
        slow = _slow_post(sw.url)
        deadline = time.monotonic() + scaled(10)
        while httpx.get(f"{sw.url}/healthz", timeout=10).json()["requests_running"] < 1:  # it reached the API
            assert time.monotonic() < deadline, "the request under way never reached the API"
            time.sleep(0.05)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + scaled(10)
        while (h := httpx.get(f"{sw.url}/healthz", timeout=10)).status_code != 503:
            assert time.monotonic() < deadline, h.text
            time.sleep(0.05)
        assert h.json()["shutting_down"] is True and h.json()["requests_running"] == 1, h.text
        _shutting_down(httpx.post(f"{sw.url}/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=10))
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)  # the grace ends now
        slow.settimeout(scaled(30))
        answer = b""
        while b"shutting_down" not in answer and (chunk := slow.recv(65536)):
            answer += chunk
        slow.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"shutting_down" in answer, answer
        assert sw.orchestrator.popen.wait(timeout=scaled(30)) == 0
        took = time.monotonic() - t0
        gone = psutil.wait_procs(children, timeout=scaled(10))[1]
        assert not gone, gone  # no DHT process or p2pd left
        print(f"second SIGTERM -> exit 0 in {took:.1f} s")
    finally:
        sw.stop()


def test_a_request_forwarded_to_a_stopping_orchestrator_is_served_here(monkeypatch):
    """A peer that forwards to an orchestrator which stops gets its 503 ``shutting_down``: the request is served here,
    as when the other cannot be reached (it was passed back to the client); another 503 is passed back as it was."""
    import httpx

    from tests.test_s33_api_envelope import forwarder

    code = {"value": "shutting_down"}

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "stopping", "code": code["value"]}},
                              headers={"retry-after": "3"})

    forward = forwarder(monkeypatch, handler)
    assert asyncio.run(forward()) is None  # served here
    code["value"] = "swarm_unavailable"
    other = asyncio.run(forward())
    assert other is not None and other.status_code == 503 and other.headers["retry-after"] == "3"


@pytest.mark.parametrize("kw", [{"n": 2}, {"prompt": [[1, 2, 3], [4, 5, 6]]}], ids=["n2", "two_prompts"])
def test_a_running_request_of_several_jobs_finishes_within_the_grace(swarm, kw):
    """One slot, a request of two jobs running its first (n = 2, or two prompts): the drain refused its second job
    (waiting for the slot, or coming once the first's prefill was done) as if it were a new request, and the request
    being served was answered 503 ``shutting_down`` "not served" at once (its first choice's work thrown away). Now
    its jobs run on within the grace, as a request of one job does."""
    async def main():
        orch, app, gate, stepping = swarm(capacity=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            req = asyncio.ensure_future(c.post("/v1/completions", json=_body(orch, **kw)))
            await asyncio.wait_for(stepping.wait(), 30)
            await asyncio.sleep(0.1)  # a second prompt's job reaches the queue
            assert orch.dispatch.running == 1
            assert orch.begin_drain() == 0
            _shutting_down(await c.post("/v1/completions", json=_body(orch)))  # a new request still is refused
            assert not req.done()
            gate.set()
            r = await asyncio.wait_for(req, 30)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 6, r.text
            assert orch.dispatch.running == 0 and orch.dispatch.queue_length == 0

    asyncio.run(main())


def test_a_queued_request_of_several_jobs_is_refused_whole_at_once(swarm):
    """Two prompts queued behind a running request: the drain answers that request 503 at once (its first job
    refused; its second, waiting in a place held for it, goes with it), not once the grace is over."""
    async def main():
        orch, app, gate, stepping = swarm(capacity=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            running = asyncio.ensure_future(c.post("/v1/completions", json=_body(orch)))
            await asyncio.wait_for(stepping.wait(), 30)
            queued = asyncio.ensure_future(c.post("/v1/completions", json=_body(orch, prompt=[[1, 2], [3, 4]])))
            await _until(lambda: orch.dispatch.queue_length == 2, "two queued jobs")
            assert orch.begin_drain() == 1
            _shutting_down(await asyncio.wait_for(queued, 10))
            assert orch.dispatch.queue_length == 0 and not running.done()
            gate.set()
            assert (await asyncio.wait_for(running, 30)).status_code == 200

    asyncio.run(main())


def test_the_dispatcher_keeps_the_later_jobs_of_an_admitted_request_once_stopping():
    """A later choice (``checked``) waiting when the drain begins, or arriving after it, is not refused: its request
    is being served; a new request's job is."""
    from petals_chain.orchestrator.core import ShuttingDown
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    async def main():
        dm = DispatchManager()
        dm.set_chains([_chain(1)])
        lease = await dm.acquire(DispatchJob("r0"))
        waiting = asyncio.ensure_future(dm.acquire(DispatchJob("r1", checked=True)))
        new = asyncio.ensure_future(dm.acquire(DispatchJob("x")))
        await _until(lambda: dm.queue_length == 2, "two queued jobs")
        assert dm.refuse_waiting(ShuttingDown) == 1
        with pytest.raises(ShuttingDown):
            await asyncio.wait_for(new, 5)
        late = asyncio.ensure_future(dm.acquire(DispatchJob("r2", checked=True)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and not late.done() and dm.queue_length == 2
        dm.release(lease)
        second = await asyncio.wait_for(waiting, 5)
        dm.release(second)
        dm.release(await asyncio.wait_for(late, 5))
        assert dm.running == 0 and dm.queue_length == 0

    asyncio.run(main())


def test_requests_turned_away_by_a_stop_are_counted_refused_not_failed():
    """A deploy's SIGTERM turns requests away with 503 ``shutting_down``: they never ran and go elsewhere, so they
    count as ``refused`` (they were ``failed``, firing error-rate alerts at every deploy)."""
    from petals_chain.orchestrator.core import ShuttingDown
    from petals_chain.orchestrator.stats import request_outcome, status_outcome

    assert status_outcome(503, "shutting_down") == "refused"
    assert status_outcome(503, "swarm_unavailable") == "failed"
    assert request_outcome(ShuttingDown("stopping")) == "refused"
