"""Tool calling on the chat API (orchestrator/tools.py), as agent frameworks send it: the openai package's tool loop
(tools + ``tool_choice`` required -> ``tool_calls`` with valid JSON arguments -> a ``role: "tool"`` result -> an
answer), streamed and not; a named function; ``auto`` taking each branch; hostile tools a 400 naming the field.
Before, ``tools``, ``tool_choice`` other than none, an assistant's ``tool_calls`` and a tool's result were all 400s.

The orchestrator runs in this process over fake chains (test_s33_api_envelope's) on the tiny random-weight model:
only the grammar makes its output a call. ``auto``'s branch is steered by a scripted "model" (the grammar's allowed
tokens narrowed to a script's next token), the grammar still checking every token."""

from __future__ import annotations

import asyncio
import json

import httpx
import llguidance
import pytest
from test_s33_api_envelope import _chain, fake_chain_app

from petals_chain.orchestrator import structured
from petals_chain.orchestrator.tools import CallScanner, encode_conversation, hermes, parse_tools, read_reply

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOARGS]
MSGS = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture
def api(tiny_model_factory, monkeypatch):
    """(orchestrator, app) over fake chains, one chain up; no API keys."""
    yield from fake_chain_app(tiny_model_factory, monkeypatch, max_length=1024, no_chain_wait_s=5.0)  # the tools' prompt alone is ~560 tokens


def _run(api, fn, sdk: bool = False):
    orch, app = api

    async def main():
        orch.dispatch.set_chains([_chain(4)])
        if sdk:
            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://o", timeout=60)
            async with openai.AsyncOpenAI(base_url="http://o/v1", api_key="x", http_client=http,
                                          max_retries=0) as client:
                return await fn(orch, client)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            return await fn(orch, c)

    return asyncio.run(main())


def _valid_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7, args


async def _streamed(client, **kw) -> tuple[list, object]:
    """The chunks of a streamed chat completion, and the openai package's accumulation of them."""
    chunks = []
    async with client.chat.completions.stream(**kw) as stream:
        async for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        return chunks, await stream.get_final_completion()


def test_the_openai_tool_loop_required_then_a_tool_result_then_an_answer(api):
    """tools + ``tool_choice: "required"``: the openai package gets ``tool_calls`` (content null, finish
    "tool_calls", an id ``call_...``) whose arguments are JSON valid for the tool's schema, greedy and seeded; the
    stream's deltas (index, id and name first, then the arguments in pieces) add up to the same call. Sent back with
    a ``role: "tool"`` result, the conversation gets a text answer."""
    async def fn(orch, client):
        out = {}
        for name, kw in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 1.0, "seed": 7})):
            body = dict(model=orch.model_id, messages=MSGS, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, max_completion_tokens=60, **kw)
            out[name] = (await client.chat.completions.create(**body), await _streamed(client, **body))
        r = out["greedy"][0]
        msgs = MSGS + [r.choices[0].message,  # the SDK's own object, resent as agent loops do
                       {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "sunny"}]
        out["answer"] = await client.chat.completions.create(model=orch.model_id, messages=msgs, tools=TOOLS,
                                                             tool_choice="none", max_completion_tokens=8,
                                                             temperature=0)
        return out

    out = _run(api, fn, sdk=True)
    for name in ("greedy", "seeded"):
        plain, (chunks, final) = out[name]
        choice = plain.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in ("get_weather", "now")
        if call.function.name == "get_weather":
            _valid_weather(call.function.arguments)
        else:
            assert call.function.arguments == "{}"
        (streamed,) = final.choices[0].message.tool_calls
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
        assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content is None
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        first = deltas[0].tool_calls[0]
        assert first.index == 0 and first.id == streamed.id and first.function.name == call.function.name
        assert all(d.tool_calls[0].id is None and d.tool_calls[0].function.name is None for d in deltas[1:])
    answer = out["answer"].choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")


def test_a_named_function_and_parallel_calls(api):
    """``tool_choice`` naming a function: one call of that one (its arguments its schema's), with
    ``parallel_tool_calls`` or without: OpenAI's "forced function" (test_s37_frameworks; before, with it the reply was
    a list of calls the model could go on with)."""
    async def fn(orch, c):
        out = []
        for par in (False, True):
            r = await c.post("/v1/chat/completions", json={
                "model": orch.model_id, "messages": MSGS, "tools": TOOLS, "temperature": 0, "max_tokens": 120,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "parallel_tool_calls": par})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0])
        return out

    for choice in _run(api, fn):
        assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1, choice
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        _valid_weather(call["function"]["arguments"])


@pytest.fixture
def scripted(monkeypatch):
    """``script(text)``: the next generations write ``text`` (its tokens, then the end token) wherever the grammar
    allows it: a "model" that takes a branch of ``auto``, still checked by the grammar at every token."""
    box = {}
    real = structured.GrammarState.allowed

    def allowed(self):
        out = real(self)
        ids = box["ids"]
        nxt = ids[self.consumed] if self.consumed < len(ids) else None
        pick = nxt if nxt is not None and out[nxt] else next((e for e in self.grammar.eos if out[e]), None)
        if pick is not None:
            out[:] = False
            out[pick] = True
        return out

    monkeypatch.setattr(structured.GrammarState, "allowed", allowed)

    def script(tokenizer, text):
        box["ids"] = tokenizer.encode(text, add_special_tokens=False)
    return script


def test_auto_returns_text_or_calls_as_the_model_chose(api, scripted):
    """``tool_choice`` auto (the default with tools): a reply in the call branch (``<tool_call>`` blocks, two of
    them) comes back as ``tool_calls``, finish "tool_calls", streamed as OpenAI's deltas; one in the text branch as
    ``content``, finish "stop", streamed as content deltas."""
    calls = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","days":2}}\n</tool_call>\n'
             '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>')

    async def fn(orch, client):
        out = {}
        for name, text in (("calls", calls), ("text", "It is <b>sunny</b> {x}.")):
            scripted(orch.tokenizer, text)
            body = dict(model=orch.model_id, messages=MSGS, tools=TOOLS, max_completion_tokens=200, temperature=0)
            out[name] = (await client.chat.completions.create(**body), await _streamed(client, **body))
        return out

    out = _run(api, fn, sdk=True)
    plain, (chunks, final) = out["calls"]
    for choice in (plain.choices[0], final.choices[0]):
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert got == [("get_weather", {"city": "Rome", "days": 2}), ("now", {})], got
    starts = [d.tool_calls[0] for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls
              and d.tool_calls[0].id is not None]
    assert [(s.index, s.function.name) for s in starts] == [(0, "get_weather"), (1, "now")]
    plain, (chunks, final) = out["text"]
    for choice in (plain.choices[0], final.choices[0]):
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content == "It is <b>sunny</b> {x}."


def test_hostile_or_malformed_tools_are_a_400_naming_the_field(api):
    """What an OpenAI server refuses, named: a tool that is not a function, one without a name, parameters that are
    no JSON schema (or an unsatisfiable one), a name given twice, a tool_choice naming no tool or without tools,
    tools beside response_format, a tool result without its tool_call_id, the legacy role "function"."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
    cases = [
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [True]}, "tools.0"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [NOARGS, bad]}, "tools.1.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string", "minLength": 5, "maxLength": 2}}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
         "tools.0.function.parameters"),
        ({"tools": [NOARGS, NOARGS]}, "tools.1.function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
        ({"messages": MSGS + [{"role": "tool", "content": "1"}]}, "messages.1.tool_call_id"),
        ({"messages": MSGS + [{"role": "function", "name": "f", "content": "1"}]}, "messages.1.role"),
        ({"messages": MSGS + [{"role": "user", "content": None}]}, "messages.1.content"),
    ]

    async def fn(orch, c):
        for extra, param in cases:
            r = await c.post("/v1/chat/completions", json={"model": orch.model_id, "messages": MSGS, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        # a session turn still takes no tool messages (its template renders plain text)
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"messages": [
            {"role": "tool", "tool_call_id": "c", "content": "1"}]})
        assert r.status_code == 400, r.text

    _run(api, fn)


# ---- units: the grammar, the reading of a reply, the prompt --------------------------------------------------------
def _matches(lltok, tokenizer, toolset, text: str) -> bool:
    m = llguidance.LLMatcher(lltok, toolset.spec().grammar_text(), log_level=0)
    return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def test_the_grammar_is_exactly_the_calls(tiny_model_factory):
    """Each layout's language: one call (name first, compact JSON), a list, text or tagged calls for ``auto``; a
    strict tool's objects are closed (an undeclared property is refused), a non-strict one's that name their properties
    too, unless they say otherwise (test_s37_frameworks)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_factory("llama", num_layers=2))
    lltok = structured.ll_tokenizer(tok, len(tok), [tok.eos_token_id])
    a = '{"name":"get_weather","arguments":{"city":"Rome","days":3}}'
    b = '{"name":"now","arguments":{}}'
    req, lst = parse_tools(TOOLS, "required", False), parse_tools(TOOLS, "required", True)
    auto = parse_tools(TOOLS, None, None)
    assert (req.layout, lst.layout, auto.layout) == ("json", "list", "tagged")
    assert _matches(lltok, tok, req, a) and _matches(lltok, tok, req, b)
    assert not _matches(lltok, tok, req, f"[{a}]") and not _matches(lltok, tok, req, a.replace(":3", ": 3"))
    assert not _matches(lltok, tok, req, '{"arguments":{},"name":"now"}')
    assert not _matches(lltok, tok, req, a.replace("Rome", "Oslo"))
    assert _matches(lltok, tok, lst, f"[{a},{b}]") and not _matches(lltok, tok, lst, "[]")
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "now"}}, False)
    assert _matches(lltok, tok, named, b) and not _matches(lltok, tok, named, a)
    tagged = f"<tool_call>\n{a}\n</tool_call>\n<tool_call>\n{b}\n</tool_call>"
    assert _matches(lltok, tok, auto, "any <b>text</b>") and _matches(lltok, tok, auto, tagged)
    assert not _matches(lltok, tok, auto, "<tool_call>\nnot json")
    # a marker after some text would be content holding an unchecked call: text holds no marker anywhere
    assert not _matches(lltok, tok, auto, f"Sure.\n{tagged}") and not _matches(lltok, tok, auto, f" {tagged}")
    assert not _matches(lltok, tok, parse_tools(TOOLS, "auto", False), tagged)
    open_params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for strict, params, extra_ok in ((True, open_params, False), (False, open_params, False),
                                     (False, {**open_params, "additionalProperties": True}, True)):
        ts = parse_tools([{"type": "function", "function": {"name": "f", "parameters": params,
                                                            "strict": strict}}], "required", False)
        assert _matches(lltok, tok, ts, '{"name":"f","arguments":{"a":1}}')
        assert _matches(lltok, tok, ts, '{"name":"f","arguments":{"a":1,"b":2}}') is extra_ok


def test_a_reply_is_read_the_same_whole_or_piece_by_piece():
    """CallScanner: strings with braces and escaped quotes in the arguments, a list of calls, a cut call (not
    complete), text held back while it may be a call marker, then given as content."""
    a = '{"name":"f","arguments":{"s":"}{\\"]","n":[1,{"x":2}]}}'
    for layout, text in (("json", a), ("list", f"[{a},{a}]"), ("tagged", f"<tool_call>\n{a}\n</tool_call>"),
                         ("tagged", "<tool maybe"), ("tagged", "plain {text}"), ("json", a[:30])):
        whole = read_reply(layout, text)
        s = CallScanner(layout)
        events = [e for ch in text for e in s.feed(ch)] + s.finish()
        pieces = {}
        for e in events:
            if e[0] == "arguments":
                pieces[e[1]] = pieces.get(e[1], "") + e[2]
        assert [(c.name, c.arguments, c.complete) for c in s.calls] == \
            [(c.name, c.arguments, c.complete) for c in whole.calls]
        assert [pieces.get(i, "") for i in range(len(s.calls))] == [c.arguments for c in s.calls]
        assert s.content == whole.content
        if whole.is_calls and text != a[:30]:
            assert all(c.complete and json.loads(c.arguments)["n"] == [1, {"x": 2}] for c in whole.calls)
        else:
            assert whole.content == text or not whole.calls[0].complete


def test_the_prompt_of_a_conversation_with_tools():
    """A template that takes tools gets them (and calls with their arguments as objects); one that does not gets the
    Hermes rendering: the tools in the system message, calls as ``<tool_call>`` blocks, results as
    ``<tool_response>`` blocks in one user message."""
    conv = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
            {"role": "tool", "tool_call_id": "c2", "content": "x"}]
    ts = parse_tools(TOOLS, None, None)
    seen = {}

    class Tok:
        chat_template = "{% if tools %}...{% endif %}"

        def apply_chat_template(self, messages, tools=None, **kw):
            seen.update(messages=messages, tools=tools)
            return [1, 2]

    class Orch:
        tokenizer = Tok()

        def encode_chat(self, messages):
            seen["hermes"] = messages
            return [3]

    assert encode_conversation(Orch(), conv, ts) == [1, 2]
    assert seen["tools"] == ts.definitions() and seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {}
    Tok.chat_template = "{{ messages }}"
    assert encode_conversation(Orch(), conv, ts) == [3]
    out = seen["hermes"]
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>\n"
                                                 "<tool_response>\nx\n</tool_response>"}
    assert hermes([{"role": "system", "content": "Be brief."}], ts)[0]["content"].startswith("Be brief.\n\n# Tools")
