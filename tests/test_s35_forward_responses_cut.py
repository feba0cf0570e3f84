"""A forwarded reply relayed as bytes (``forward._relay_raw``) whose upstream orchestrator is lost ends with an error
event in the reply's own format: a Responses API stream with ``response.failed`` and ``error`` (the openai package
reads no ``[DONE]``), anything else as chat's error event and ``[DONE]``."""
import asyncio
import json
from types import SimpleNamespace as NS

import httpx
import pytest

import petals_chain.orchestrator.forward as fw


class _Cut(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
               b'"response":{"id":"resp_up","object":"response","status":"in_progress","output":[]}}\n\n')
        raise httpx.ReadError("connection reset")


def _relayed(path: str) -> list[bytes]:
    req = httpx.Request("POST", f"http://other:8000{path}")
    upstream = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Cut(), request=req)
    closed = []

    async def close():
        closed.append(True)

    async def main():
        return [c async for c in fw._relay_raw(NS(), "http://other:8000", upstream, close)]

    out = asyncio.run(main())
    assert closed == [True]
    return out


def test_a_cut_responses_stream_ends_with_response_failed_and_an_error_event():
    chunks = _relayed("/v1/responses")
    events = [e for e in b"".join(chunks[1:]).split(b"\n\n") if e]
    names = [e.split(b"\n")[0] for e in events]
    assert names == [b"event: response.failed", b"event: error"], events
    failed = json.loads(events[0].split(b"data: ", 1)[1])
    assert failed["response"]["status"] == "failed" and "was lost" in failed["response"]["error"]["message"]
    # numbered on from the events relayed, under the relayed response's id
    assert failed["sequence_number"] == 1 and failed["response"]["id"] == "resp_up", failed
    assert json.loads(events[1].split(b"data: ", 1)[1])["sequence_number"] == 2
    assert b"[DONE]" not in b"".join(chunks)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/v1/sessions/s1/generate"])
def test_other_cut_streams_keep_chats_error_event_and_done(path):
    tail = b"".join(_relayed(path)[1:])
    assert b'"code":"stream_cut"' in tail and tail.endswith(b"data: [DONE]\n\n"), tail
