"""A forwarded ``/v1/responses`` stream (HERD ``--group-with``) cut mid-way is finished elsewhere as chat's are
(resume.py): ``RESUMABLE_PATHS`` lacked it, so the relay passed it as bytes and a cut ended it with chat's error
object and ``data: [DONE]``, which the openai package's Responses stream does not know. The events are made by
responses.py's own builder (two runs, two sets of ids), the rerun answered by a mock transport: no process."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pydantic
import pytest

import petals_chain.orchestrator.resume as rs
from petals_chain.orchestrator.responses import ResponseBuilder, usage

openai = pytest.importorskip("openai")
_CLIENT = httpx.AsyncClient
BODY = {"model": "m", "input": "hi", "stream": True, "temperature": 0, "max_output_tokens": 4}
PIECES = ["Hel", "lo", " wor", "ld"]
LPS = [[{"token": p, "logprob": -1.0, "bytes": list(p.encode()), "top_logprobs": []}] for p in PIECES]


def _run(pieces=PIECES) -> list[bytes]:
    """One run's events, as the API streams them (each event alone, as sse_events yields them)."""
    b = ResponseBuilder("m", {"instructions": None, "metadata": {}, "temperature": 0.0, "top_p": 1.0,
                              "parallel_tool_calls": False, "tool_choice": "none", "tools": []})
    text = b.opening() + "".join(b.delta(p, lp) for p, lp in zip(pieces, LPS)) + b.closing(
        "length", usage(3, 4))
    return [e.encode() + b"\n\n" for e in text.split("\n\n") if e]


def _parsed(events: list[bytes]) -> list[dict]:
    out = []
    for e in b"".join(events).decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in e.splitlines() if line and not line.startswith(":"))
        if "data" in lines:
            assert lines.get("event") == json.loads(lines["data"])["type"], e
            out.append(json.loads(lines["data"]))
    return out


def _finish(rec, monkeypatch, reply) -> list[bytes]:
    class Client(_CLIENT):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(lambda req: _stream(reply)), **kw)

    monkeypatch.setattr(rs.httpx, "AsyncClient", Client)
    monkeypatch.setattr(rs, "RESUME_PAUSE_S", 0.0)

    async def main():
        return [e async for e in rs.finish(rec, "/v1/responses", {}, lambda refused: ("http://127.0.0.1:1", True),
                                           lambda u: True, "http://lost")]
    return asyncio.run(main())


def _record():
    rec = rs.StreamRecord.of("POST", "/v1/responses", json.dumps(BODY).encode(), 200,
                             {"content-type": "text/event-stream"}, time.monotonic())
    assert rec is not None, "a Responses stream is not resumable"
    return rec


class _Events(httpx.AsyncByteStream):
    def __init__(self, events: list[bytes]):
        self.events = events

    async def __aiter__(self):
        for e in self.events:
            yield e


def _stream(events: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Events(events))


def test_a_cut_responses_stream_is_finished_under_its_first_ids_and_numbers(monkeypatch):
    """The client had the opening events and two deltas when the sender was lost; the rerun (other ids) repeats
    them and goes on: the client's stream is one response, numbered 0.. without a gap, each piece of text and
    logprob entry once, the events the openai package parses."""
    from openai.types.responses import ResponseStreamEvent

    first, rerun = _run(), _run()
    rec = _record()
    got = [out for e in first[:6] if (out := rec.take(e)) is not None]
    # the sender stopping: response.failed and error shutting_down (relay_events: a Cut before take)
    assert rec.take(_run()[0].replace(b"response.created", b"response.failed")) is None
    got += _finish(rec, monkeypatch, rerun)
    events = _parsed(got)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [e["type"] for e in _parsed(first)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(d["delta"] for d in deltas) == "Hello world" and len(deltas) == 4
    assert [lp["token"] for d in deltas for lp in d["logprobs"]] == PIECES
    ids = _parsed(first)[0]["response"]["id"], _parsed(first)[2]["item"]["id"]
    assert {e["response"]["id"] for e in events if "response" in e} == {ids[0]}
    assert {e["item_id"] for e in events if "item_id" in e} == {ids[1]}
    last = events[-1]["response"]
    assert last["output"][0]["id"] == ids[1] and last["output"][0]["content"][0]["text"] == "Hello world"
    assert rec.finished and rec.finished_by


def test_a_responses_stream_that_cannot_be_finished_ends_as_a_failed_response(monkeypatch):
    """A rerun giving another text (or a sampled stream, which cannot be rerun) ends the client's stream with
    ``response.failed`` (the text it has) and an ``error`` event, numbered on; not chat's error and [DONE]."""
    rec = _record()
    first = [out for e in _run()[:6] if (out := rec.take(e)) is not None]
    out = _finish(rec, monkeypatch, _run(["Hex", "lo", " wor", "ld"]))
    assert b"[DONE]" not in b"".join(out)
    events = _parsed(first + out)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed, error = events[-2:]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["id"] == events[0]["response"]["id"]
    assert failed["response"]["output"][0]["content"][0]["text"] == "Hello"
    assert error["type"] == "error" and error["code"] == "resume_mismatch" and error["error"]["status"] == 502
    sampled = rs.StreamRecord.of("POST", "/v1/responses", json.dumps({**BODY, "temperature": 1}).encode(), 200,
                                 {"content-type": "text/event-stream"}, time.monotonic())
    for e in _run()[:5]:
        sampled.take(e)
    ended = _parsed(_finish(sampled, monkeypatch, []))
    assert [e["type"] for e in ended] == ["response.failed", "error"] and ended[-1]["code"] == "stream_cut"
    assert ended[0]["sequence_number"] == 5
