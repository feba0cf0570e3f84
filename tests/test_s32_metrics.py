"""Issue 18's per-request metrics: ``petals_chain_api_requests{client, outcome}`` counts API requests (one per request
whatever its ``n`` and prompts, one per session turn) by how they ended, beside the job-level
``petals_chain_requests`` whose names and meaning stay. Every job-level and deadline metric counted a request of
``n`` = 4 as 4 jobs, and only requests with a deadline were counted per request at all.

The orchestrator runs in this process with the real API, dispatcher and LM head over a fake chain (its hops return
their input): no server process."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.errors import RequestError, Unavailable
from petals_chain.orchestrator.relay import HopFailure
from petals_chain.orchestrator.stats import Stats, request_outcome

KEYS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}


class FakeChainSession:
    """A chain session whose hops return their input; ``fail`` hop steps raise a HopFailure (a dead server), each
    step waits ``delay`` s (class attributes, set per test)."""

    fail = 0
    delay = 0.0

    def __init__(self, client, hops, session_id, max_length, observe=None, wait_s=0.0, push=False):
        self.hops = list(hops)
        self.peers_used = {h[0] for h in self.hops}
        self.max_length = max_length
        self.cached_tokens, self.prefix_cache, self.push, self.wait_s = 0, False, False, wait_s
        self.silent_wait_max_s = float("inf")
        self.push_rescues = self.push_mismatches = 0

    async def open(self, fork_from=None, fork_length=0, named=b""):
        pass

    async def step(self, i, x, position):
        if FakeChainSession.delay:
            await asyncio.sleep(FakeChainSession.delay)
        if FakeChainSession.fail > 0:
            FakeChainSession.fail -= 1
            raise HopFailure(self.hops[i][0], ConnectionError("gone"), hop=i)
        return x.clone()

    async def extend(self, max_length):
        self.max_length = max(self.max_length, max_length)

    async def close(self, named=b""):
        pass


@pytest.fixture
def api(tiny_model_factory, tmp_path, monkeypatch):
    """(orchestrator, app) with keys alice and bob, ``--schedule edf``, over fake chains."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    monkeypatch.setattr(failover, "ChainSession", FakeChainSession)
    monkeypatch.setattr(FakeChainSession, "fail", 0)
    monkeypatch.setattr(FakeChainSession, "delay", 0.0)
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=128,
                                           port=0, api_keys=str(keys), schedule="edf"))
    orch.load_model()
    orch.batcher = HeadBatcher(orch.head)
    try:
        yield orch, create_app(orch)
    finally:
        orch.batcher.close()


def _samples(text: str, name: str) -> dict[tuple, float]:
    """``{(label values...): value}`` of the samples of ``name`` in an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[tuple(v.split('"')[1] for v in labels.split(","))] = float(value)
    return out


def _headers(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


async def _disconnect_mid_stream(app, body: dict, name: str) -> bytes:
    """POST a streamed completion straight to the ASGI app; the client goes away once the first event came."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    first_event = asyncio.Event()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await first_event.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            first_event.set()

    headers = [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
               (b"authorization", f"Bearer {KEYS[name]}".encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("x", 80)}
    await asyncio.wait_for(app(scope, receive, send), 60)
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_requests_are_counted_once_per_api_request_by_client_and_outcome(api):
    """Per request, whatever the path: n = 4, a stream of n = 2, two prompts, a failover, a client gone mid-stream,
    refusals of n = 2 and of two prompts (doomed deadlines), a drop in the queue, session turns (one completed, one
    refused). The job-level counter keeps counting jobs."""
    orch, app = api

    async def main():
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=0.1, capacity=2,
                                        spans=((0, 2),))])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=60) as c:
            body = {"model": orch.model_id, "prompt": [1, 2, 3, 4], "max_tokens": 3, "ignore_eos": True}

            async def post(name, extra, status=200, path="/v1/completions"):
                r = await c.post(path, headers=_headers(name), json={**body, **extra} if path == "/v1/completions"
                                 else extra)
                assert r.status_code == status, r.text
                return r

            await post("alice", {"n": 4})
            r = await post("alice", {"n": 2, "stream": True, "deadline_ms": 60_000})
            assert r.text.rstrip().endswith("data: [DONE]")
            await post("alice", {"prompt": [[1, 2], [3, 4]]})
            FakeChainSession.fail = 1
            assert (await post("bob", {})).json()["petals_chain"][0]["failovers"] == 1
            FakeChainSession.delay = 0.2
            events = await _disconnect_mid_stream(app, {**body, "stream": True, "max_tokens": 40}, "bob")
            assert events.startswith(b"data: ") and b"[DONE]" not in events
            FakeChainSession.delay = 0.0
            sid = (await c.post("/api/v1/sessions", headers=_headers("bob"), json={})).json()["session_id"]
            await post("bob", {"input_ids": [1, 2, 3], "max_tokens": 2}, path=f"/api/v1/sessions/{sid}/generate")
            await c.delete(f"/api/v1/sessions/{sid}", headers=_headers("bob"))
            # both slots taken: a doomed deadline is refused at once, one that passes in the queue is dropped
            from petals_chain.orchestrator.dispatch import DispatchJob

            held = [await orch.dispatch.acquire(DispatchJob(job_id=f"h{i}")) for i in range(2)]
            for extra in ({"n": 2}, {"prompt": [[1, 2], [3, 4]]}):
                r = await post("alice", {**extra, "ttft_deadline_ms": 1}, 429)
                # busy (both slots held), and 1 ms may be under even an idle chain's first token: refused either way
                assert r.json()["error"]["code"] in ("deadline_unreachable", "deadline_infeasible"), r.text
            assert (await post("alice", {"ttft_deadline_ms": 300}, 504)).json()["error"]["code"] == "deadline_exceeded"
            sid = (await c.post("/api/v1/sessions", headers=_headers("bob"), json={})).json()["session_id"]
            await post("bob", {"input_ids": [1, 2, 3], "max_tokens": 2, "ttft_deadline_ms": 1}, 429,
                       path=f"/api/v1/sessions/{sid}/generate")
            for lease in held:
                orch.dispatch.release(lease)
            return (await c.get("/metrics")).text, (await c.get("/api/v1/swarm")).json()

    text, swarm = asyncio.run(main())
    assert _samples(text, "petals_chain_api_requests_total") == {
        ("alice", "completed"): 3, ("alice", "refused"): 2, ("alice", "dropped"): 1,
        ("bob", "completed"): 2, ("bob", "cancelled"): 1, ("bob", "refused"): 1}
    # jobs, as before: 4 + 2 + 2 + 1 completed, a job its client left (cancelled, as its request: it was failed),
    # and 2 + 2 + 1 + 1 that never held a chain
    jobs = _samples(text, "petals_chain_requests_total")
    assert jobs == {("completed",): 10, ("cancelled",): 1, ("unserved",): 6}, jobs
    deadlines = _samples(text, "petals_chain_deadline_requests_total")
    assert deadlines == {("alice", "met"): 1, ("alice", "refused"): 2, ("alice", "dropped"): 1,
                         ("bob", "refused"): 1}, deadlines
    clients = {x["name"]: x for x in swarm["clients"]}
    assert clients["alice"]["request_outcomes"] == {"completed": 3, "failed": 0, "refused": 2, "dropped": 1,
                                                    "cancelled": 0, "invalid": 0}
    assert clients["bob"]["request_outcomes"]["cancelled"] == 1


def test_a_request_ends_once_with_its_first_failure():
    """The parts of a request (its prompts) end in any order: the request is counted once, at its last part, as the
    first failure (a refused prompt, not the others it cancelled), else cancelled, else completed."""
    s = Stats()
    cases = [([None, None], "completed"), ([asyncio.CancelledError(), None], "cancelled"),
             ([RequestError("full", status=429, code="queue_full"), asyncio.CancelledError()], "refused"),
             ([asyncio.CancelledError(), RequestError("late", status=504, code="deadline_exceeded")], "dropped"),
             ([Unavailable("no chain"), RequestError("late", status=504, code="deadline_exceeded")], "failed")]
    for errors, outcome in cases:
        key = object.__new__(type("Places", (), {}))
        for _ in errors:
            s.begin_request_part(key)
        for e in errors:
            s.end_request_part(key, e)
        s.end_request_part(key, RuntimeError("a part begun after the request was counted"))
        assert s.request_totals("anonymous")[outcome] == 1, (errors, s.request_totals("anonymous"))
    assert sum(s.request_totals("anonymous").values()) == len(cases)
    assert request_outcome(RequestError("bad", status=400)) == "invalid"
    with pytest.raises(ValueError):
        s.end_request("lost")


def test_a_session_turn_is_one_request_ended_by_the_error_being_handled():
    """A session turn's job is a whole request (``record`` counts it); a failed one by the exception that ended it,
    as sessions.py records it in its except clause."""
    s = Stats()
    s.record(wait_s=0.0, service_s=0.1, tokens=2, prompt_tokens=3, ok=True)

    async def release_chain_fails():
        await asyncio.sleep(0)
        raise ConnectionError("the chain's close failed")

    async def turn(error):
        try:
            raise error
        except BaseException:
            # as sessions.py does before it records: an await (the coroutine suspends and resumes) whose own error
            # is handled; sys.exc_info() is the turn's error again after it
            try:
                await asyncio.shield(release_chain_fails())
            except BaseException:  # noqa: BLE001
                pass
            s.record(wait_s=0.0, service_s=0.0, tokens=0, prompt_tokens=3, ok=False, served=False)

    for error in (asyncio.CancelledError(), RequestError("doomed", status=429, code="deadline_unreachable")):
        asyncio.run(turn(error))
    s.record(wait_s=0.0, service_s=0.0, tokens=0, prompt_tokens=3, ok=False)  # no exception known: failed
    s.record(wait_s=0.0, service_s=0.1, tokens=2, prompt_tokens=3, ok=True, whole_request=False)  # a job of a request
    assert s.request_totals("anonymous") == {"completed": 1, "failed": 1, "refused": 1, "dropped": 0,
                                             "cancelled": 1, "invalid": 0}
    assert s.completed == 2 and s.unserved == 2 and s.failed == 1
