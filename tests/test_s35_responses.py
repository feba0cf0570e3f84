"""OpenAI's Responses API (``POST /v1/responses``) as the ``openai`` package calls it: ``responses.create`` (streamed
or not) and ``responses.stream``, over chat's generation path, and what the server cannot do refused naming the
field. The orchestrator runs in this process with the real API, limits and dispatcher over fake chains
(test_s33_api_envelope's ``api``, here ``envelope``): no server process, no DHT."""

from __future__ import annotations

import asyncio
import json

import pytest
import test_s33_api_envelope as _envelope
from test_s32_openai import _type_errors
from test_s33_api_envelope import KEYS, _chain

from petals_chain.orchestrator.errors import Unavailable

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport of the openai package installed here
envelope = _envelope.api  # the fixture: (orchestrator, app) over fake chains, keys alice and bob

HI = [{"role": "user", "content": "hi"}]
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _with_sdk(envelope, fn):
    """``fn(orch, client, http)`` with an ``AsyncOpenAI`` (no retries) over the app, one chain up; ``http``: its
    transport, for raw requests (key bob)."""
    orch, app = envelope

    async def main():
        orch.dispatch.set_chains([_chain(2)])
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app, raise_app_exceptions=False),
                                  base_url="http://orch", timeout=60,
                                  headers={"Authorization": f"Bearer {KEYS['bob']}"})
        async with openai.AsyncOpenAI(base_url="http://orch/v1", api_key=KEYS["bob"], http_client=http,
                                      max_retries=0) as client:
            return await fn(orch, client, http)

    return asyncio.run(main())


def _events(raw: str) -> list[tuple[str, dict]]:
    """A raw event stream's ``(event name, data)`` pairs."""
    out = []
    for block in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if "data" in lines:
            out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def test_a_response_is_chats_generation_in_the_responses_shape(envelope):
    """``client.responses.create`` was a 404. Now the same prompt greedy gives the same tokens as
    ``/v1/chat/completions`` (string input, or messages with ``instructions`` and the previous response's output
    item sent back), in a response the package parses without a field lost: ``output_text``, ``status``
    incomplete at the output limit (completed at the end of text), usage counted as chat's, metadata echoed,
    logprobs when included, the deadline report when a deadline was given."""
    async def fn(orch, client, http):
        eos = orch.tokenizer.eos_token_id
        out = {"chat": await client.chat.completions.create(model=orch.model_id, messages=HI, max_tokens=5,
                                                            temperature=0)}
        raw = await client.responses.with_raw_response.create(
            model=orch.model_id, input="hi", max_output_tokens=5, temperature=0, metadata={"run": "7"},
            include=["message.output_text.logprobs"], top_logprobs=2, extra_body={"deadline_ms": 60_000})
        out["raw"], out["response"] = json.loads(raw.http_response.text), raw.parse()
        previous = out["response"].output  # sent back as the package's users continue a conversation
        turn = [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]}, *HI,
                *[item.model_dump(exclude_none=True) for item in previous], {"role": "user", "content": "and?"}]
        out["turn"] = await client.responses.create(model=orch.model_id, input=turn, instructions="you help",
                                                    max_output_tokens=4, temperature=0)
        out["turn_chat"] = await client.chat.completions.create(
            model=orch.model_id, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": "you help"}, {"role": "system", "content": "be brief"}, *HI,
                      {"role": "assistant", "content": out["response"].output_text},
                      {"role": "user", "content": "and?"}])
        out["stopped"] = await client.responses.create(model=orch.model_id, input="hi", max_output_tokens=5,
                                                       extra_body={"logit_bias": {str(eos): 100}})
        return out

    out = _with_sdk(envelope, fn)
    chat, r, raw = out["chat"], out["response"], out["raw"]
    # times are whole seconds, as OpenAI sends them (the package's type reads them as floats)
    assert isinstance(raw["created_at"], int) and r.created_at == raw["created_at"]
    assert _type_errors(r.model_dump(exclude={"created_at"}), {k: v for k, v in raw.items() if k != "created_at"}) == []
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert raw["petals_chain"][0]["token_ids"] == chat.model_extra["petals_chain"][0]["token_ids"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, 5, chat.usage.prompt_tokens + 5)
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens_details.cached_tokens == 0
    message = r.output[0]
    assert (message.type, message.role, message.status, message.content[0].annotations) == (
        "message", "assistant", "incomplete", [])
    assert r.metadata == {"run": "7"} and r.max_output_tokens == 5 and r.tools == [] and raw["store"] is False
    lps = message.content[0].logprobs
    assert len(lps) == 5 and all(len(e.top_logprobs) == 2 for e in lps)
    assert "".join(e.token for e in lps) == r.output_text
    assert raw["deadline"]["deadline_ms"] == 60_000, raw["deadline"]
    assert out["turn"].output_text == out["turn_chat"].choices[0].message.content
    assert out["turn"].usage.input_tokens == out["turn_chat"].usage.prompt_tokens
    stopped = out["stopped"]
    assert (stopped.status, stopped.incomplete_details, stopped.output_text) == ("completed", None, "")
    assert stopped.output[0].status == "completed" and stopped.completed_at is not None


def test_a_streamed_response_is_the_events_the_openai_package_consumes(envelope):
    """``stream=True``: the named events OpenAI sends, numbered from 0, one delta per piece of text, ending in
    ``response.incomplete`` at the output limit or ``response.completed`` (``responses.stream()``'s final response),
    the text equal to the non-streamed greedy one; no ``[DONE]``."""
    async def fn(orch, client, http):
        eos = orch.tokenizer.eos_token_id
        body = {"model": orch.model_id, "input": "hi", "max_output_tokens": 6, "temperature": 0}
        plain = await client.responses.create(**body)
        events = [e async for e in await client.responses.create(**body, stream=True)]
        raw = await http.post("/v1/responses", json={**body, "stream": True})
        async with client.responses.stream(**body, extra_body={"logit_bias": {str(eos): 100}}) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        return plain, events, raw, final

    plain, events, raw, final = _with_sdk(envelope, fn)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [*OPENING, *["response.output_text.delta"] * len(deltas), *CLOSING, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == events[-4].text == plain.output_text and len(deltas) > 1
    last = events[-1].response
    assert last.output_text == plain.output_text and last.incomplete_details.reason == "max_output_tokens"
    assert last.usage.output_tokens == 6 and last.usage.input_tokens == plain.usage.input_tokens
    assert {e.response.id for e in events if hasattr(e, "response")} == {last.id}
    assert {e.item_id for e in deltas} == {last.output[0].id}
    sent = _events(raw.text)
    assert [name for name, _ in sent] == [data["type"] for _, data in sent] and sent[0][0] == "response.created"
    assert "[DONE]" not in raw.text and raw.headers["content-type"].startswith("text/event-stream")
    assert final.status == "completed" and final.output_text == "" and final.output[0].status == "completed"


def test_a_failure_mid_stream_reaches_the_client_as_events(envelope, monkeypatch):
    """A generation that fails after its first text (a chain lost, no other) ends the stream with
    ``response.failed`` (its error, the text so far) and an ``error`` event, on which the openai package raises
    with the message; not a cut stream."""
    orch, _ = envelope
    real = orch.generate_n

    def failing(ids, params, explicit, emits=None, **kw):
        async def second_fails(text, choices, count=[0]):
            count[0] += 1
            if count[0] == 2:
                raise Unavailable("the chain was lost and no other chain can take the request")
            await emits[0](text, choices)
        return real(ids, params, explicit, [second_fails] if emits else None, **kw)

    async def fn(orch, client, http):
        monkeypatch.setattr(orch, "generate_n", failing)
        body = {"model": orch.model_id, "input": "hi", "max_output_tokens": 6, "temperature": 0, "stream": True}
        seen = []
        with pytest.raises(openai.APIError) as e:
            async for event in await client.responses.create(**body):
                seen.append(event)
        raw = await http.post("/v1/responses", json=body)
        return seen, e.value, _events(raw.text)

    seen, error, raw = _with_sdk(envelope, fn)
    assert [e.type for e in seen] == [*OPENING, "response.output_text.delta", "response.failed"]
    failed = seen[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "no other chain" in failed.error.message and failed.output_text == seen[-2].delta
    assert "no other chain" in error.message and error.body["status"] == 503
    name, last = raw[-1]
    assert name == last["type"] == "error" and last["sequence_number"] == len(raw) - 1
    assert last["code"] == "swarm_unavailable" and "no other chain" in last["message"]


def test_what_this_server_cannot_do_is_refused_naming_the_field(envelope):
    """Built-in tools, stored responses and conversations, background runs, image and file input, includes it does
    not have, structured output, reasoning effort, ``store: true``, chat's ``max_tokens``: each a 400 naming its field,
    never silently dropped. What changes nothing here (store false, no tools, tool_choice none, cache keys, reasoning
    effort none, text format text) is taken: the same output. A stored response asked for is a 404 saying none is
    kept."""
    refusals = {
        "tools.0.type": {"tools": [{"type": "web_search"}]},
        "previous_response_id": {"previous_response_id": "resp_1"},
        "conversation": {"conversation": "conv_1"},
        "background": {"background": True},
        "store": {"store": True},
        "include.1": {"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]},
        "text.format.type": {"text": {"format": {"type": "yaml"}}},
        "reasoning.effort": {"reasoning": {"effort": "low"}},
        "tool_choice": {"tool_choice": "required"},
        "truncation": {"truncation": "auto"},
        "input.0.content.1": {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "input.0.content.0": {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input.1.type": {"input": [*HI, {"type": "item_reference", "id": "msg_1"}]},
        "max_tokens": {"extra_body": {"max_tokens": 3}},
        "n": {"extra_body": {"n": 2}},
    }
    taken = {"store": False, "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "truncation": "disabled",
             "reasoning": {"effort": "none"}, "text": {"format": {"type": "text"}, "verbosity": "medium"},
             "prompt_cache_key": "k", "safety_identifier": "u", "user": "u", "service_tier": "auto",
             "stream_options": None, "max_tool_calls": 3}

    async def fn(orch, client, http):
        base = {"model": orch.model_id, "input": "hi", "max_output_tokens": 3, "temperature": 0}
        out = {}
        for field, kw in refusals.items():
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(**{**base, **kw})
            out[field] = (e.value.param, e.value.code, e.value.message)
        plain = await client.responses.create(**base)
        hinted = await client.responses.create(**base, **taken)
        stored = []
        for call in (client.responses.retrieve("resp_x"), client.responses.delete("resp_x"),
                     client.responses.cancel("resp_x")):
            with pytest.raises(openai.NotFoundError) as e:
                await call
            stored.append((e.value.code, e.value.message))
        return out, plain, hinted, stored

    out, plain, hinted, stored = _with_sdk(envelope, fn)
    assert {field: got[0] for field, got in out.items()} == {field: field for field in refusals}, out
    assert all(code in ("invalid_value", "unsupported_parameter") for _, code, _ in out.values()), out
    assert '"web_search" is not supported' in out["tools.0.type"][2]
    assert "stores no responses" in out["previous_response_id"][2] and "store: false" in out["store"][2]
    assert 'not "input_image"' in out["input.0.content.1"][2] and "stores no items" in out["input.1.type"][2]
    assert "'yaml'" not in out["text.format.type"][2] and '"yaml"' in out["text.format.type"][2]
    assert "max_output_tokens" in out["max_tokens"][2]
    assert hinted.output_text == plain.output_text and hinted.usage.output_tokens == 3
    assert hinted.parallel_tool_calls is True and hinted.tool_choice == "none"
    assert all(code == "response_not_found" and "stores no responses" in message for code, message in stored), stored
