"""Review of dd3bec5's shutdown end of a Responses stream (api.py ``_Call.tail``): a stream this orchestrator relays
from another one (HERD forwarding) and cuts at the end of its grace ended with chat's error object and
``data: [DONE]``; one generated here whose client was slow (the cut came while an event was being written) ended
numbered past that event (a gap) with its text in ``response.failed``. In this process over fake chains
(test_s33_api_envelope's ``api``)."""

from __future__ import annotations

import asyncio
import json

import test_s33_api_envelope as _envelope
from test_s33_api_envelope import KEYS, FakeChainSession, _chain
from test_s35_review_responses import _events

from petals_chain.orchestrator import api as api_module
from petals_chain.orchestrator.dispatch import note_admission
from petals_chain.orchestrator.responses import ResponseBuilder

envelope = _envelope.api  # the fixture: (orchestrator, app) over fake chains


def _cut_stream(app, body: dict, when, stall: bool) -> list[bytes]:
    """The bodies a client was sent of a stream the gate cuts once ``when(body)`` holds for a body written (or,
    ``stall``: being written, a slow reader's write that never completes)."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("orch", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"host", b"orch"), (b"content-type", b"application/json"),
                         (b"authorization", f"Bearer {KEYS['bob']}".encode())]}

    async def main():
        sent: list[bytes] = []
        ready = asyncio.Event()
        requested = False

        async def receive():
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": data, "more_body": False}
            await asyncio.Event().wait()

        async def send(message):
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            if body and not ready.is_set() and when(body):
                ready.set()
                if stall:
                    await asyncio.Event().wait()  # never written: the cut cancels it
            sent.append(body)

        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(ready.wait(), 60)
        assert app.state.gate.cut() == 1
        await asyncio.wait_for(task, 60)
        return sent

    return asyncio.run(main())


def _ended_as_a_failed_response(sent: list[bytes]) -> list[dict]:
    events = _events(b"".join(sent))
    assert all(isinstance(data, dict) for _, data in events), events[-2:]  # no [DONE]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events))), events
    (_, failed), (_, error) = events[-2:]
    assert failed["type"] == "response.failed" and error["type"] == "error" and error["code"] == "shutting_down"
    return [data for _, data in events]


def test_a_relayed_responses_stream_cut_by_the_shutdown_ends_as_a_failed_response(envelope, monkeypatch):
    """Relayed (``maybe_forward`` answers with the other orchestrator's events, two deltas, then silence), it ends
    with ``response.failed`` numbered 6 under the relayed response and message ids, with the relayed text, and
    an ``error`` event 7; no ``[DONE]``."""
    from starlette.responses import StreamingResponse

    orch, app = envelope
    there = ResponseBuilder("m", {})
    relayed = [there.opening().encode(), there.delta("Hel").encode(), there.delta("lo").encode()]

    async def forwarded(orch_, request, url=None):
        note_admission(True)  # as maybe_forward: the other orchestrator admitted it

        async def relay():
            for chunk in relayed:
                yield chunk
            await asyncio.Event().wait()  # the other orchestrator's next step

        return StreamingResponse(relay(), media_type="text/event-stream")

    monkeypatch.setattr(api_module, "maybe_forward", forwarded)
    sent = _cut_stream(app, {"model": orch.model_id, "input": "hi", "temperature": 0, "stream": True},
                       lambda body: body == relayed[-1], stall=False)
    events = _ended_as_a_failed_response(sent)
    failed = events[-2]["response"]
    assert len(events) == 8 and failed["id"] == there.id and failed["output"][0]["id"] == there.message_id
    assert failed["output"][0]["content"][0]["text"] == "Hello"


def test_a_stream_cut_while_its_client_was_slow_is_numbered_on_from_what_it_was_sent(envelope, monkeypatch):
    """The cut came while the second delta was being written (a slow reader): that delta is not the client's, so
    ``response.failed`` takes its number and holds only the first delta's text (was: a number skipped, and text the
    client never got)."""
    orch, app = envelope
    monkeypatch.setattr(FakeChainSession, "delay", 0.01)
    orch.dispatch.set_chains([_chain(2)])
    deltas = []

    def stall(body: bytes) -> bool:
        if b"response.output_text.delta" in body:
            deltas.append(body)
        return len(deltas) == 2

    sent = _cut_stream(app, {"model": orch.model_id, "input": "hi", "max_output_tokens": 60, "temperature": 0,
                             "stream": True}, stall, stall=True)
    events = _ended_as_a_failed_response(sent)
    texts = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(texts) == 1, events
    assert events[-2]["response"]["output"][0]["content"][0]["text"] == texts[0]
    assert events[-2]["response"]["id"] == events[0]["response"]["id"]
