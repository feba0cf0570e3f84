"""Tool calling on the Responses API (``POST /v1/responses``), as the openai Agents SDK and other agent frameworks
send it: flat function ``tools``, ``tool_choice``, ``function_call`` output items (streamed as the SDK's
``response.function_call_arguments.*`` events), and ``function_call`` / ``function_call_output`` input items sent
back. Before, ``tools``, ``tool_choice`` other than none / auto and both input items were 400s ("this server offers no
tools").

Over test_s36_tools_api's in-process orchestrator (fake chains, the tiny random-weight model; only the grammar makes
its output a call) and its scripted "model" that steers ``auto``'s branch."""

from __future__ import annotations

import json

import pytest
import test_s36_tools_api as _chat
from test_s36_tools_api import _run, _valid_weather

api, scripted = _chat.api, _chat.scripted  # its fixtures, used here as there

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
NOARGS = {"type": "function", "name": "now", "parameters": None, "strict": None}
TOOLS = [WEATHER, NOARGS]
ASK = "What is the weather in Rome?"


async def _streamed(client, **kw) -> tuple[list, object]:
    """The events of a streamed response, and the openai package's accumulation of them."""
    async with client.responses.stream(**kw) as stream:
        events = [e async for e in stream]
        return events, await stream.get_final_response()


def _check_sequence(events: list) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_sdk_tool_loop_required_then_a_function_call_output_then_an_answer(api):
    """tools + ``tool_choice: "required"``: ``responses.create`` gives a ``function_call`` output item (``fc_`` id,
    ``call_`` call_id, arguments valid JSON for the tool's schema, no message, ``output_text`` ""); streamed, the
    SDK's events (item added with empty arguments, argument deltas, arguments done, item done) add up to the same
    call. Sent back as ``function_call`` + ``function_call_output`` input items, the next turn is a text answer."""
    async def fn(orch, client):
        body = dict(model=orch.model_id, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=60, temperature=0)
        plain = await client.responses.create(**body)
        events, final = await _streamed(client, **body)
        call = plain.output[0]
        answer = await client.responses.create(
            model=orch.model_id, tools=TOOLS, max_output_tokens=8, temperature=0, tool_choice="none",
            input=[{"role": "user", "content": ASK}, *plain.output,  # the SDK's own items, resent as agents do
                   {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        return plain, events, final, answer

    plain, events, final, answer = _run(api, fn, sdk=True)
    assert plain.status == "completed" and plain.output_text == "" and len(plain.output) == 1, plain
    call = plain.output[0]
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed" and call.name in ("get_weather", "now")
    if call.name == "get_weather":
        _valid_weather(call.arguments)
    else:
        assert call.arguments == "{}"
    assert plain.tools[0].name == "get_weather" and plain.tool_choice == "required"
    (streamed,) = final.output
    assert (streamed.type, streamed.name, streamed.arguments, streamed.status) == (
        "function_call", call.name, call.arguments, "completed")
    _check_sequence(events)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"], kinds
    assert not any(k.startswith("response.output_text") or k.startswith("response.content_part") for k in kinds)
    added = events[2]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.output_index == 0
    assert added.item.id == streamed.id and added.item.call_id == streamed.call_id
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(d.delta for d in deltas) == streamed.arguments
    assert all(d.item_id == streamed.id and d.output_index == 0 for d in deltas)
    assert events[-3].arguments == streamed.arguments and events[-2].item.status == "completed"
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    assert isinstance(answer.output_text, str) and answer.output_text


def test_auto_gives_a_message_or_function_calls_as_the_model_chose(api, scripted):
    """``tool_choice`` auto (the default with tools): a reply in the call branch (two ``<tool_call>`` blocks) is two
    ``function_call`` items, streamed one after the other (the first done before the second is added, each at its
    own output_index); one in the text branch is a message, streamed as text deltas with its item added first."""
    calls = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","days":2}}\n</tool_call>\n'
             '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>')

    async def fn(orch, client):
        out = {}
        for name, text in (("calls", calls), ("text", "It is <b>sunny</b> {x}.")):
            scripted(orch.tokenizer, text)
            body = dict(model=orch.model_id, input=ASK, tools=TOOLS, max_output_tokens=200, temperature=0)
            out[name] = (await client.responses.create(**body), await _streamed(client, **body))
        return out

    out = _run(api, fn, sdk=True)
    plain, (events, final) = out["calls"]
    for r in (plain, final):
        assert r.status == "completed" and r.output_text == "" and r.tool_choice == "auto"
        got = [(o.type, o.name, json.loads(o.arguments), o.status) for o in r.output]
        assert got == [("function_call", "get_weather", {"city": "Rome", "days": 2}, "completed"),
                       ("function_call", "now", {}, "completed")], got
    assert len({o.call_id for o in final.output}) == 2 and len({o.id for o in final.output}) == 2
    _check_sequence(events)
    items = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item")]
    assert items == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1)], items
    plain, (events, final) = out["text"]
    for r in (plain, final):
        assert r.status == "completed" and [o.type for o in r.output] == ["message"]
        assert r.output_text == "It is <b>sunny</b> {x}."
    _check_sequence(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"] and kinds[-1] == \
        "response.completed" and not any("function_call" in k for k in kinds), kinds


def test_a_named_function_and_the_input_items_rendered_as_chat_s_messages(api):
    """``tool_choice`` ``{"type": "function", "name": ...}`` (the Responses API's shape): every call is that one;
    ``function_call`` / ``function_call_output`` input items make the same prompt as chat's ``tool_calls`` and
    ``role: "tool"`` messages (a result as a list of text parts too)."""
    async def fn(orch, c):
        r = await c.post("/v1/responses", json={
            "model": orch.model_id, "input": ASK, "tools": TOOLS, "temperature": 0, "max_output_tokens": 120,
            "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        named = r.json()
        args = '{"city":"Rome","days":2}'
        items = [{"role": "user", "content": ASK},
                 {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                  "arguments": args, "status": "completed"},
                 {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text",
                                                                                   "text": "sunny"}]},
                 {"type": "function_call_output", "call_id": "call_2", "output": "noon"}]
        msgs = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
                    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
        chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
        resp = await c.post("/v1/responses", json={"model": orch.model_id, "input": items, "tools": TOOLS,
                                                   "tool_choice": "none", "max_output_tokens": 6, "temperature": 0})
        chat = await c.post("/v1/chat/completions", json={"model": orch.model_id, "messages": msgs,
                                                          "tools": chat_tools, "tool_choice": "none",
                                                          "max_tokens": 6, "temperature": 0})
        return named, resp.json(), chat.json()

    named, resp, chat = _run(api, fn)
    (call,) = named["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and named["status"] == "completed"
    _valid_weather(call["arguments"])
    assert named["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"], (resp, chat)
    assert resp["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_hostile_or_malformed_tools_are_a_400_naming_the_field(api):
    """Built-in tools (web_search, file_search, mcp), chat's nested shape, a tool without a name, parameters that
    are no schema, a name given twice, a tool_choice naming no tool (or in chat's shape, or a built-in's), tools
    beside text.format, input items that are not whole: a 400 naming the field (as the Responses API names it)."""
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [NOARGS, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.1.type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.function"),
        ({"tools": [{"type": "function", "description": "x"}]}, "tools.0.name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "foo"}}]}, "tools.0.parameters"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools.0.parameters"),
        ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools.0.strict"),
        ({"tools": [{"type": "function", "name": "f", "description": "\ud800"}]}, "tools.0.description"),
        ({"tools": [NOARGS, NOARGS]}, "tools.1.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                     "namespace": "ns"}]}, "input.0.namespace"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "\ud800"}]},
         "input.0.arguments"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
         "input.0.output.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ]

    async def fn(orch, c):
        out = []
        for extra, param in cases:
            body = json.dumps({"model": orch.model_id, "input": ASK, **extra})  # lone surrogates as JSON escapes
            r = await c.post("/v1/responses", content=body, headers={"content-type": "application/json"})
            out.append((extra, param, r.status_code, r.json()["error"]))
        return out

    for extra, param, status, err in _run(api, fn):
        assert status == 400 and err["param"] == param, (extra, param, err)
