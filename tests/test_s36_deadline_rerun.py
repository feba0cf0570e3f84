"""A cut forwarded stream's rerun and the request's deadline (session 36, resume.finish): a rerun refused as
``deadline_infeasible`` because too little of the deadline was left ends the stream with the 504
``deadline_exceeded`` of a late request (was: that 429, a refusal inviting a retry), and the wait for the rerun's
answer ends at the deadline (was: for as long as the target took to answer, read=None)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from test_resume import parsed

import petals_chain.orchestrator.resume as rs

_CLIENT = httpx.AsyncClient


def _finish(rec, monkeypatch, handler, limit_s: float = 6.0) -> tuple[list, float]:
    """``finish`` with every rerun sent to ``handler`` (an httpx mock, maybe async); its error events, seconds."""
    class Client(_CLIENT):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(handler), **kw)

    monkeypatch.setattr(rs.httpx, "AsyncClient", Client)
    monkeypatch.setattr(rs, "RESUME_PAUSE_S", 0.05)

    async def main():
        return [e async for e in rs.finish(rec, "/v1/completions", {}, lambda refused: ("http://peer:1", False),
                                           lambda u: True, "http://lost")]
    t0 = time.monotonic()
    events = asyncio.run(asyncio.wait_for(main(), limit_s))
    return [e for e in parsed(events) if isinstance(e, dict) and "error" in e], time.monotonic() - t0


def _record(deadline_ms: float) -> rs.StreamRecord:
    return rs.StreamRecord({"prompt": "hi", "stream": True, "temperature": 0, "deadline_ms": deadline_ms},
                           time.monotonic())


def test_a_rerun_refused_as_infeasible_for_the_time_left_ends_with_504_deadline_exceeded(monkeypatch):
    def handler(request):
        assert json.loads(request.content)["deadline_ms"] < 5_000  # the rerun carries what is left
        return httpx.Response(429, json={"error": {"code": "deadline_infeasible", "message": "even an idle swarm misses"
                                                   " it", "type": "rate_limit_error"}})

    events, _ = _finish(_record(5_000), monkeypatch, handler)
    err = events[-1]["error"]
    assert (err["status"], err["code"]) == (504, "deadline_exceeded"), err  # was: 429 deadline_infeasible
    assert "deadline_ms" in err["message"]


def test_an_infeasible_rerun_without_a_deadline_of_its_own_is_still_the_refusal(monkeypatch):
    """Best effort (no deadline applies to the stream): the target's answer is passed on as it was."""
    def handler(request):
        return httpx.Response(429, json={"error": {"code": "deadline_infeasible", "message": "no"}})

    rec = rs.StreamRecord({"prompt": "hi", "stream": True, "temperature": 0, "deadline_ms": 5_000,
                           "best_effort": True}, time.monotonic())
    err = _finish(rec, monkeypatch, handler)[0][-1]["error"]
    assert (err["status"], err["code"]) == (429, "deadline_infeasible")


def test_the_wait_for_a_slow_rerun_target_ends_at_the_deadline(monkeypatch):
    """The target takes the request and answers after 30 s: the stream ends at its 0.5 s deadline, 504 (before: it
    waited for the answer; here the test's 6 s limit ends it)."""
    async def handler(request):
        await asyncio.sleep(30)
        return httpx.Response(503)

    events, took = _finish(_record(500), monkeypatch, handler)
    err = events[-1]["error"]
    assert (err["status"], err["code"]) == (504, "deadline_exceeded"), err
    assert "no answer before the deadline" in err["message"]
    assert took < 5.0
