"""Structured outputs through the Python client (petals_chain/client): ``structured_outputs=`` and a dict
``response_format=`` go through ``complete``, ``stream``, ``chat_completion`` and a session's ``chat``, ``complete``
and ``stream`` as they are, and a pydantic model as ``response_format`` (the openai package's ``parse`` style) is sent
as its ``json_schema`` format, the result's ``.parsed`` its validated instance. Before, a model class was a TypeError
("response_format must be what JSON carries").

The client's requests reach the orchestrator app in this process (over fake chains on the tiny random-weight
model, test_s36_structured_api's fixture) through a transport that runs them on one event loop in a thread."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Literal, Optional

import httpx
import pydantic
import pytest
import test_s36_structured_api
from test_s33_api_envelope import _chain
from test_s36_structured_api import STRICT, Answer

from petals_chain.client import Client

api = test_s36_structured_api.api  # the fixture: the app over fake chains on the tiny model


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    answer: Answer  # a nested model: a $ref into $defs
    note: Optional[Literal["a", "b"]] = None


@pytest.fixture
def client(api):
    """(a Client whose requests the in-process app serves, the JSON bodies it sent)."""
    orch, app = api
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sent: list[dict] = []

    async def start():
        orch.dispatch.set_chains([_chain(4)])
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60)

    inner = asyncio.run_coroutine_threadsafe(start(), loop).result(60)

    async def forward(req: httpx.Request) -> httpx.Response:
        r = await inner.request(req.method, req.url.path, content=req.content, headers=dict(req.headers))
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    def handle(req: httpx.Request) -> httpx.Response:
        if req.content:
            sent.append(json.loads(req.content))
        return asyncio.run_coroutine_threadsafe(forward(req), loop).result(60)

    c = Client("http://o", model=orch.model_id)
    c._https[0].close()
    c._https[0] = httpx.Client(base_url="http://o", transport=httpx.MockTransport(handle), timeout=60)
    try:
        yield c, sent
    finally:
        c.close()
        asyncio.run_coroutine_threadsafe(inner.aclose(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_structured_fields_pass_through_every_call(client):
    c, sent = client
    digits = {"regex": r"[0-9]{3}"}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": STRICT, "strict": True}}
    assert re.fullmatch("[0-9]{3}", c.complete("n:", max_tokens=8, structured_outputs=digits).text)
    assert re.fullmatch("[0-9]{3}", "".join(c.stream("n:", max_tokens=8, structured_outputs=digits)))
    chat = c.chat_completion([{"role": "user", "content": "hi"}], max_tokens=40, response_format=fmt)
    assert chat.finish_reason == "stop" and chat.parsed is None  # a dict: nothing to parse into
    Answer.model_validate_json(chat.text)
    with c.session() as s:
        Answer.model_validate_json(s.chat("hi", max_tokens=40, response_format=fmt).text)
    with c.session() as s:  # a text session (a chat one takes only messages)
        assert re.fullmatch("[0-9]{3}", s.complete(" n:", max_tokens=8, structured_outputs=digits).text)
        assert re.fullmatch("[0-9]{3}", "".join(s.stream(" n:", max_tokens=8, structured_outputs=digits)))
    bodies = [b for b in sent if "max_tokens" in b]
    assert len(bodies) == 6
    assert [b.get("structured_outputs") or b.get("response_format") for b in bodies] == \
        [digits, digits, fmt, fmt, digits, digits]


def test_a_pydantic_model_as_response_format_is_sent_as_its_schema_and_parsed(client):
    c, sent = client
    msgs = [{"role": "user", "content": "where?"}]
    got = c.chat_completion(msgs, max_tokens=80, response_format=Place)
    assert isinstance(got.parsed, Place) and got.parsed == Place.model_validate_json(got.text)
    fmt = sent[-1]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Place" and fmt["json_schema"]["strict"]
    schema = fmt["json_schema"]["schema"]  # closed to other properties, the nested model's too
    assert schema["additionalProperties"] is False and schema["$defs"]["Answer"]["additionalProperties"] is False
    assert isinstance(c.complete("x", max_tokens=80, response_format=Place).parsed, Place)
    with c.session() as s:
        assert isinstance(s.chat("where?", max_tokens=80, response_format=Place).parsed, Place)
    with c.session() as s:
        "".join(s.stream(" again", max_tokens=80, response_format=Place))
        assert isinstance(s.last.parsed, Place)
        cut = s.complete(" more", max_tokens=3, response_format=Place)  # the JSON cut at max_tokens
    assert cut.finish_reason == "length" and cut.text.startswith("{")
    with pytest.raises(ValueError, match="finish_reason 'length'"):
        cut.parsed
    assert c.complete("x", max_tokens=2).parsed is None  # no model: nothing to parse
    with pytest.raises(TypeError, match="response_format must be a pydantic model class or a dict"):
        c.chat_completion(msgs, response_format=dict)
