"""Structured outputs through the API, as clients send them: the openai package's ``chat.completions.parse`` and
``responses.parse`` with a pydantic model, streamed and not; vLLM's ``structured_outputs`` (json, regex, choice,
grammar) on completions and chat; ``response_format`` on completions and on a session's turn; ``n`` > 1;
speculative decoding; what stays a 400; the metric. Before, chat's ``response_format`` other than text and the
Responses API's ``text.format`` json_schema were a 400, and nothing else took a schema.

The orchestrator runs in this process over fake chains (test_s33_api_envelope's: their hops return their input) on
the tiny random-weight model, whose output knows nothing of JSON: only the grammar makes it valid."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import pydantic
import pytest
from test_s33_api_envelope import _chain, fake_chain_app

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport of the openai package installed here


class Answer(pydantic.BaseModel):
    ok: bool
    level: Literal["low", "high"]


STRICT = {**Answer.model_json_schema(), "additionalProperties": False}  # what the openai package sends for Answer


@pytest.fixture
def api(tiny_model_factory, monkeypatch):
    """(orchestrator, app) over fake chains, one chain up; no API keys."""
    yield from fake_chain_app(tiny_model_factory, monkeypatch, max_length=128, no_chain_wait_s=5.0)


def _run(api, fn):
    orch, app = api

    async def main():
        orch.dispatch.set_chains([_chain(4)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            return await fn(orch, c)

    return asyncio.run(main())


def _sdk(api, fn):
    orch, app = api

    async def main():
        orch.dispatch.set_chains([_chain(4)])
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://o", timeout=60)
        async with openai.AsyncOpenAI(base_url="http://o/v1", api_key="x", http_client=http, max_retries=0) as client:
            return await fn(orch, client)

    return asyncio.run(main())


def test_the_openai_package_parse_helpers_return_validated_objects(api):
    """``chat.completions.parse(response_format=Model)`` greedy and seeded, its streaming twin, and
    ``responses.parse(text_format=Model)``: each returns a parsed ``Answer`` (the package validates it), finish
    "stop"; the Responses object echoes the format; a streamed answer is the non-streamed one."""
    msgs = [{"role": "user", "content": "Is it ok?"}]

    async def fn(orch, client):
        out = {}
        for name, kw in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 1.0, "seed": 5})):
            r = await client.chat.completions.parse(model=orch.model_id, messages=msgs, response_format=Answer,
                                                    max_completion_tokens=60, **kw)
            async with client.chat.completions.stream(model=orch.model_id, messages=msgs, response_format=Answer,
                                                      max_completion_tokens=60, **kw) as stream:
                final = await stream.get_final_completion()
            out[name] = (r.choices[0], final.choices[0])
        out["responses"] = await client.responses.parse(model=orch.model_id, input="Is it ok?", text_format=Answer,
                                                        max_output_tokens=60, temperature=0)
        return out

    out = _sdk(api, fn)
    for name in ("greedy", "seeded"):
        plain, streamed = out[name]
        assert isinstance(plain.message.parsed, Answer) and plain.finish_reason == "stop", plain
        assert streamed.message.content == plain.message.content and streamed.message.parsed == plain.message.parsed
    resp = out["responses"]
    assert isinstance(resp.output_parsed, Answer) and resp.status == "completed"
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "Answer"
    assert resp.text.format.schema_["properties"]["level"]["enum"] == ["low", "high"]
    assert json.loads(resp.output_text) == json.loads(out["greedy"][0].message.content)  # same prompt, greedy


def _an_object_or_cut(text: str, finish: str) -> None:
    """JSON mode's output: a whole JSON object ("stop"), or one cut by max_tokens ("length"; random weights may
    write a long string): then a prefix of one, which a JSON parser reads to its end without a syntax error."""
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
        return
    assert finish == "length" and text.startswith("{"), (finish, text)
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(text)
    assert e.value.pos >= len(text) - 1 or e.value.msg.startswith("Unterminated string"), (e.value, text)


def test_vllm_structured_outputs_and_response_format_on_every_endpoint(api):
    """Completions with ``structured_outputs`` (choice, regex, json text, Lark grammar) and ``response_format``
    json_object; chat with ``n`` = 3 seeded (each choice valid on its own); ngram speculation gives the same tokens
    as none; a session turn takes ``response_format`` (and the next turn, without one, is free text)."""
    async def fn(orch, c):
        m, out = orch.model_id, {}

        async def completion(extra, **kw):
            r = await c.post("/v1/completions", json={"model": m, "prompt": "Answer:", "max_tokens": 40,
                                                      "temperature": 0, **kw, **extra})
            assert r.status_code == 200, r.text
            return r.json()

        out["choice"] = await completion({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
        out["regex"] = await completion({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, n=2, seed=3,
                                        temperature=1.0)
        out["json"] = await completion({"structured_outputs": {"json": json.dumps(STRICT)}})
        out["grammar"] = await completion({"structured_outputs": {"grammar": 'start: "x" NUM\nNUM: /[0-9]+/'}},
                                          max_tokens=4)
        out["json_object"] = await completion({"response_format": {"type": "json_object"}})
        r = await c.post("/v1/chat/completions", json={
            "model": m, "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 9, "temperature": 1.0,
            "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": STRICT, "strict": True}}})
        out["chat_n"] = r.json()
        spec = {}
        for mode in ("none", "ngram"):
            r = await c.post("/v1/completions", json={"model": m, "prompt": "[1, 1, 1, 1", "max_tokens": 30,
                                                      "temperature": 0, "speculative": mode, "structured_outputs": {
                                                          "regex": r"(, 1){0,20}\]"}})
            spec[mode] = r.json()
        out["spec"] = spec
        sid = (await c.post("/api/v1/sessions", json={})).json()["session_id"]
        t1 = await c.post(f"/api/v1/sessions/{sid}/generate", json={
            "prompt": "Q:", "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}})
        t2 = await c.post(f"/api/v1/sessions/{sid}/generate", json={"prompt": " more", "max_tokens": 3,
                                                                     "temperature": 0})
        out["session"] = (t1.json(), t2.json())
        return out

    out = _run(api, fn)
    assert out["choice"]["choices"][0]["text"] in ("alpha", "beta", "gamma")
    assert out["choice"]["choices"][0]["finish_reason"] == "stop"
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", ch["text"]) for ch in out["regex"]["choices"])
    Answer.model_validate_json(out["json"]["choices"][0]["text"])
    assert re.fullmatch(r"x[0-9]+", out["grammar"]["choices"][0]["text"])
    _an_object_or_cut(out["json_object"]["choices"][0]["text"], out["json_object"]["choices"][0]["finish_reason"])
    assert [Answer.model_validate_json(ch["message"]["content"]) for ch in out["chat_n"]["choices"]]
    assert all(ch["finish_reason"] == "stop" for ch in out["chat_n"]["choices"])
    none, ngram = out["spec"]["none"], out["spec"]["ngram"]
    assert ngram["petals_chain"][0]["token_ids"] == none["petals_chain"][0]["token_ids"]
    assert re.fullmatch(r"(, 1){0,20}\]", none["choices"][0]["text"])
    t1, t2 = out["session"]
    _an_object_or_cut(t1["text"], t1["finish_reason"])
    assert t2["finish_reason"] == "length" and len(t2["token_ids"]) == 3


def test_max_tokens_cuts_the_json_with_length_and_what_stays_a_400(api):
    """``max_tokens`` before the output is complete: "length" and the JSON cut (OpenAI's). Refused with a 400
    naming the field: an unknown response_format type, ignore_eos with a grammar, two structured outputs at once,
    ``response_format`` on the Responses API, a text.format of another type; each compile error is counted."""
    async def fn(orch, c):
        m, msgs = orch.model_id, [{"role": "user", "content": "hi"}]
        cut = (await c.post("/v1/chat/completions", json={
            "model": m, "messages": msgs, "max_tokens": 3, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": STRICT}}})).json()
        refused = {}
        for name, path, body in (
                ("type", "/v1/chat/completions", {"messages": msgs, "response_format": {"type": "xml"}}),
                ("ignore_eos", "/v1/chat/completions", {"messages": msgs, "ignore_eos": True,
                                                        "response_format": {"type": "json_object"}}),
                ("two", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                                            "structured_outputs": {"regex": "a"}}),
                ("responses", "/v1/responses", {"input": "x", "response_format": {"type": "json_object"}}),
                ("text.format", "/v1/responses", {"input": "x", "text": {"format": {"type": "grammar"}}}),
                ("regex", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(("}}),
                ("session", "/api/v1/sessions/{sid}/generate", {"prompt": "x", "structured_outputs": {
                    "grammar": "start: nothing_defined"}})):
            if "{sid}" in path:
                path = path.format(sid=(await c.post("/api/v1/sessions", json={})).json()["session_id"])
            else:
                body = {"model": m, **body}
            r = await c.post(path, json=body)
            refused[name] = (r.status_code, r.json()["error"]["type"], r.json()["error"]["param"])
        metrics = (await c.get("/metrics")).text
        return cut, refused, metrics

    cut, refused, metrics = _run(api, fn)
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3
    assert cut["choices"][0]["message"]["content"].startswith("{")
    assert refused == {"type": (400, "invalid_request_error", "response_format.type"),
                       "ignore_eos": (400, "invalid_request_error", "ignore_eos"),
                       "two": (400, "invalid_request_error", "structured_outputs"),
                       "responses": (400, "invalid_request_error", "response_format"),
                       "text.format": (400, "invalid_request_error", "text.format.type"),
                       "regex": (400, "invalid_request_error", "structured_outputs.regex"),
                       "session": (400, "invalid_request_error", "structured_outputs.grammar")}
    assert 'petals_chain_structured_requests_total{kind="json_schema",outcome="ok"} 1.0' in metrics
    assert 'petals_chain_structured_requests_total{kind="regex",outcome="invalid"} 1.0' in metrics
    assert 'petals_chain_structured_requests_total{kind="grammar",outcome="invalid"} 1.0' in metrics
