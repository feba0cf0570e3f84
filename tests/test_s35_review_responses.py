"""Review of ``POST /v1/responses`` (ed196c6): a stream the orchestrator's shutdown cuts ends as the Responses API
ends a failed one (``response.failed`` then ``error``, numbered on), not with chat's error object and ``[DONE]``;
an input item whose ``type`` is not a string is a 400 naming it, not a 500. In this process over fake chains
(test_s33_api_envelope's ``api``)."""

from __future__ import annotations

import asyncio
import json

import pytest
import test_s33_api_envelope as _envelope
from test_s33_api_envelope import KEYS, FakeChainSession, _chain

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")
envelope = _envelope.api  # the fixture: (orchestrator, app) over fake chains, keys alice and bob


def _events(body: bytes) -> list[tuple[str | None, dict | str]]:
    """``(event name, data)`` of each server-sent event (data parsed when JSON)."""
    out = []
    for block in body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "data" in fields:
            data = fields["data"]
            out.append((fields.get("event"), data if data == "[DONE]" else json.loads(data)))
    return out


def test_a_stream_cut_by_the_shutdown_ends_with_response_failed(envelope, monkeypatch):
    """The shutdown's grace over, a Responses stream under way ended with chat's ``{"error": ...}`` and
    ``data: [DONE]`` (no ``type``, no ``sequence_number``: the openai package's ``responses.stream()`` raised on an
    event it does not know, not on the failure). Now ``response.failed`` (the text so far, its error) and an
    ``error`` event with the 503 ``shutting_down``, numbered on from the events sent; no ``[DONE]``."""
    orch, app = envelope
    monkeypatch.setattr(FakeChainSession, "delay", 0.05)  # steps slow enough to cut the stream between two
    body = json.dumps({"model": orch.model_id, "input": "hi", "max_output_tokens": 60, "temperature": 0,
                       "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("orch", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"host", b"orch"), (b"content-type", b"application/json"),
                         (b"authorization", f"Bearer {KEYS['bob']}".encode())]}

    async def main():
        orch.dispatch.set_chains([_chain(2)])
        sent: list[dict] = []
        got_text = asyncio.Event()
        requested = False

        async def receive():
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)
            if b"response.output_text.delta" in message.get("body", b""):
                got_text.set()

        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(got_text.wait(), 60)
        assert app.state.gate.cut() == 1
        await asyncio.wait_for(task, 60)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 200
    events = _events(b"".join(m.get("body", b"") for m in sent[1:]))
    assert all(isinstance(data, dict) for _, data in events), events[-2:]  # no [DONE]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    (_, failed), (_, error) = events[-2:]
    assert failed["type"] == "response.failed" and error["type"] == "error", events[-2:]
    texts = "".join(data["delta"] for _, data in events if data["type"] == "response.output_text.delta")
    assert texts and failed["response"]["output"][0]["content"][0]["text"] == texts
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "server_error"
    assert error["code"] == "shutting_down" and error["error"]["status"] == 503 and "shutting down" in error["message"]


def test_an_input_item_whose_type_is_not_a_string_is_a_400_naming_it(envelope):
    """``input: [{"type": [], ...}]`` (or an object) was a 500 ``internal_error`` (an unhashable type looked up in
    the table of refused item kinds); now a 400 naming ``input.0.type``, as ``{"type": 5}`` was."""
    orch, app = envelope

    async def main():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app, raise_app_exceptions=False),
                                      base_url="http://orch", headers={"Authorization": f"Bearer {KEYS['bob']}"}) as c:
            return [await c.post("/v1/responses", json={"model": orch.model_id, "max_output_tokens": 2, "input": [
                {"type": kind, "role": "user", "content": "hi"}]}) for kind in ([], {"a": 1}, 5)]

    for r in asyncio.run(main()):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input.0.type" and "only messages" in r.json()["error"]["message"]
