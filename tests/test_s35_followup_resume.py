"""Follow-up of the session 35 reviews (resume): a forwarded stream cut off while no orchestrator can finish it
ends at the request's deadline with the 504 ``deadline_exceeded`` a request waiting here for a chain past its
deadline gets, not after ``RESUME_S`` with a 503 ``stream_cut`` (chat and Responses alike). In process, over
``resume.finish`` (test_resume's harness)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from test_resume import cmpl, feed, parsed

import petals_chain.orchestrator.resume as rs


def finish_nowhere(rec, path: str, monkeypatch) -> list[bytes]:
    """``finish`` with no orchestrator able to rerun the stream (RESUME_S cut to 5 s: the old code ended there)."""
    monkeypatch.setattr(rs, "RESUME_S", 5.0)

    async def main():
        return [e async for e in rs.finish(rec, path, {}, lambda refused: (None, False), lambda u: True, "http://lost")]
    return asyncio.run(main())


@pytest.mark.parametrize("field", ["deadline_ms", "ttft_deadline_ms"])
def test_a_cut_chat_stream_nobody_can_finish_ends_at_its_deadline_with_a_504(monkeypatch, field):
    rec = rs.StreamRecord({"messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0,
                           field: 300}, time.monotonic())
    err = parsed(finish_nowhere(rec, "/v1/chat/completions", monkeypatch))[0]["error"]
    assert (err["status"], err["code"]) == (504, "deadline_exceeded") and field in err["message"]


def test_a_cut_responses_stream_nobody_can_finish_ends_at_its_deadline_with_a_504(monkeypatch):
    rec = rs.ResponsesRecord({"input": "hi", "stream": True, "temperature": 0, "deadline_ms": 300}, time.monotonic())
    events = b"".join(finish_nowhere(rec, "/v1/responses", monkeypatch)).split(b"\n\n")
    failed, error = [json.loads(e.split(b"data: ", 1)[1]) for e in events if e]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert (error["type"], error["code"], error["error"]["status"]) == ("error", "deadline_exceeded", 504)


def test_a_spent_ttft_deadline_or_best_effort_leaves_the_cut_to_resume_s(monkeypatch):
    """Once a generated token went out its TTFT deadline is met or missed already, and a best effort request is
    served late as asked: neither ends at it (the stream is given up after RESUME_S, 503 stream_cut, as before)."""
    monkeypatch.setattr(rs, "RESUME_PAUSE_S", 0.05)
    spent = rs.StreamRecord({"prompt": [1], "stream": True, "temperature": 0, "ttft_deadline_ms": 1}, time.monotonic())
    feed(spent, [cmpl("Hi")])
    best = rs.StreamRecord({"prompt": [1], "stream": True, "temperature": 0, "deadline_ms": 1, "best_effort": True},
                           time.monotonic())
    assert spent.deadline() is None and best.deadline() is None
    monkeypatch.setattr(rs, "RESUME_S", 0.2)
    for rec in (spent, best):
        async def main():
            return [e async for e in rs.finish(rec, "/v1/completions", {}, lambda refused: (None, False),
                                               lambda u: True, "http://lost")]
        err = parsed(asyncio.run(main()))[0]["error"]
        assert (err["status"], err["code"]) == (503, "stream_cut")
