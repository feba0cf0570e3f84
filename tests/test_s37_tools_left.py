"""What session 36 left in tool calling and structured outputs (orchestrator/tools.py, structured.py, api.py):

* a stop string cut a call's arguments: stop strings now apply to text, never to calls (a forced reply ignores them,
  an ``auto`` one once it took the call branch; a stop string that starts like the call marker still cuts text);
* a streamed chat reply sent an empty delta for every piece held back as a possible call marker;
* Responses input: a ``function_call_output`` with no call before it, or a second output for one call, was rendered;
* ``max_tool_calls`` beside function tools was taken and ignored (OpenAI's counts built-in tools' calls only);
* a template with its own call format (Llama 3.1's ``"parameters"`` JSON, Mistral's ``[TOOL_CALLS]``) got Hermes
  ``<tool_call>`` blocks under ``auto``;
* a client refused by its limits had its schema compiled before its 429.

The orchestrator runs in this process over fake chains on the tiny random-weight model; the replies are scripted
(test_s36_tools_api's ``scripted``: the grammar's allowed tokens narrowed to a script, the grammar checking each)."""

from __future__ import annotations

import json

import llguidance
import pytest
from test_s33_api_envelope import fake_chain_app
import test_s36_tools_api as _chat
from test_s36_tools_api import MSGS, TOOLS, _run

from petals_chain.orchestrator import structured
from petals_chain.orchestrator.tools import CallScanner, call_format, encode_conversation, parse_tools

scripted = _chat.scripted  # its fixture, used here as there
CALL = '{"name":"get_weather","arguments":{"city":"Rome","days":2}}'
TAGGED = f"<tool_call>\n{CALL}\n</tool_call>"
# the parts of transformers' tool-use templates that decide the call format (Llama 3.1's, Mistral v0.3's), cut to
# what the tiny model's tokenizer renders
LLAMA31 = (
    "{{- bos_token }}{%- if tools is not none %}{{- 'Given the following functions, respond with a JSON for a function "
    "call with its proper arguments. Respond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.\\n' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}{%- if 'tool_calls' in message %}{%- if not message.tool_calls|length == 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}{{- '<|assistant|>\\n{\"name\": \"' + tool_call.name + "
    "'\", \"parameters\": ' + tool_call.arguments | tojson + '}' + eos_token }}"
    "{%- elif message.role == 'tool' %}{{- '<|ipython|>\\n' + message.content + eos_token }}"
    "{%- else %}{{- '<|' + message.role + '|>\\n' + message.content + eos_token }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}")
MISTRAL = (
    "{{- bos_token }}{%- for message in messages %}{%- if message.role == 'user' %}{%- if tools is not none %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}{%- elif message.tool_calls is defined and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function | tojson %}"
    "{{- out[:-1] }}{%- if not tool_call.id is defined or tool_call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id + '\"}' }}{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}"
    "{%- endif %}{%- endfor %}{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content + ', \"call_id\": \"' + message.tool_call_id + "
    "'\"}[/TOOL_RESULTS]' }}{%- else %}{{- message.content + eos_token }}{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def api(tiny_model_factory):
    """(orchestrator, app) over fake chains, one chain up; no API keys. One for the module (each test runs its own
    event loop over it)."""
    with pytest.MonkeyPatch.context() as patch:
        yield from fake_chain_app(tiny_model_factory, patch, max_length=1024, no_chain_wait_s=5.0)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_stop_strings_never_cut_a_call_and_still_cut_text(api, scripted):
    """A forced call (required, named) with stop strings every call holds (``"``, ``Rome``) comes back whole,
    finish "tool_calls", streamed or not; ``auto``: a call whole too, a text reply cut at its stop string (one that
    starts like the call marker, ``<``, included), finish "stop". Before: the call's JSON was cut at the stop (a
    forced reply's arguments ``{"city":`` or none at all, finish "stop")."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [  # (tool_choice, script, stop, expected message)
        ("required", CALL, ['"', "Rome"], "call"),
        (named, CALL, ['"'], "call"),
        ("auto", TAGGED, ['"', "Rome", "<"], "call"),
        ("auto", 'It is "sunny" in Rome.', ['"'], "It is "),
        ("auto", "sun <b>and</b> rain", ["<"], "sun "),
        ("auto", "<tool", ["<t"], ""),  # the whole text may be a marker's start: at its end, the stop applies
    ]

    async def fn(orch, c):
        out = []
        for choice, script, stop, want in cases:
            scripted(orch.tokenizer, script)
            body = {"model": orch.model_id, "messages": MSGS, "tools": TOOLS, "tool_choice": choice, "stop": stop,
                    "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0}
            r = await c.post("/v1/chat/completions", json=body)
            s = await c.post("/v1/chat/completions", json={**body, "stream": True})
            assert r.status_code == 200 and s.status_code == 200, (r.text, s.text)
            out.append((want, r.json()["choices"][0], _events(s.text)))
        return out

    for want, choice, events in _run(api, fn):
        msg = choice["message"]
        deltas = [e["choices"][0] for e in events if e.get("choices")]
        finish = [d["finish_reason"] for d in deltas if d["finish_reason"]]
        if want == "call":
            assert choice["finish_reason"] == "tool_calls" and msg["content"] is None, choice
            (call,) = msg["tool_calls"]
            assert json.loads(call["function"]["arguments"]) == {"city": "Rome", "days": 2}
            streamed = "".join(tc["function"].get("arguments") or "" for d in deltas
                               for tc in d["delta"].get("tool_calls") or [])
            assert streamed == call["function"]["arguments"] and finish == ["tool_calls"]
        else:
            assert choice["finish_reason"] == "stop" and msg == {"role": "assistant", "content": want}, choice
            assert "".join(d["delta"].get("content") or "" for d in deltas) == want and finish == ["stop"]


def test_a_streamed_reply_sends_no_empty_deltas(api, scripted):
    """While a possible call marker is held back no event goes out: every chunk between the opening and the last
    carries content or a call; the held pieces' logprobs come with the delta that shows them (as many entries as
    the non-streamed reply has). Before: one ``{"delta": {}}`` chunk per held piece."""
    async def fn(orch, c):
        out = {}
        for name, script in (("call", TAGGED), ("text", "<to be or not>")):
            scripted(orch.tokenizer, script)
            body = {"model": orch.model_id, "messages": MSGS, "tools": TOOLS, "max_tokens": 80, "temperature": 0,
                    "logprobs": True}
            plain = (await c.post("/v1/chat/completions", json=body)).json()
            out[name] = (plain, _events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text))
        return out

    for name, (plain, events) in _run(api, fn).items():
        chunks = [e["choices"][0] for e in events if e.get("choices")]
        middle = chunks[1:-1]
        assert chunks[-1]["finish_reason"] is not None and middle, chunks
        empty = [c for c in middle if not c["delta"]]
        assert not empty, f"{name}: {len(empty)} empty deltas of {len(middle)}"
        if name == "text":
            assert "".join(c["delta"]["content"] for c in middle) == plain["choices"][0]["message"]["content"]
        entries = sum(len((c.get("logprobs") or {}).get("content") or []) for c in chunks)
        assert entries == len(plain["choices"][0]["logprobs"]["content"]) > 0, name


def test_responses_input_outputs_must_answer_a_call_sent_before(api):
    """OpenAI's 400 "No tool call found for function call output with call_id ..." for an output with no call
    before it, and a 400 for a second output of one call, each naming the item (``input.N``); a call without its
    output yet, and a call_id used again for a new call with its own output, are taken (as OpenAI pairs them).
    Before: all rendered, a result of nothing shown to the model."""
    def call(cid):
        return {"type": "function_call", "call_id": cid, "name": "now", "arguments": "{}"}

    def output(cid):
        return {"type": "function_call_output", "call_id": cid, "output": "12:00"}

    hi = {"role": "user", "content": "hi"}
    refused = {"input.1": [hi, output("c9")], "input.3": [hi, call("c1"), output("c1"), output("c1")],
               "input.1 ": [hi, output("c1"), call("c1")]}
    taken = [[hi, call("c1")], [hi, call("c1"), output("c1"), call("c1"), output("c1")],
             [hi, call("c1"), call("c2"), output("c2"), output("c1")]]

    async def fn(orch, c):
        body = {"model": orch.model_id, "tools": [{"type": "function", "name": "now"}], "max_output_tokens": 2,
                "tool_choice": "none"}
        out = [(param, (await c.post("/v1/responses", json={**body, "input": items})))
               for param, items in refused.items()]
        return out, [(await c.post("/v1/responses", json={**body, "input": items})).status_code for items in taken]

    refusals, statuses = _run(api, fn)
    for param, r in refusals:
        assert r.status_code == 400 and r.json()["error"]["param"] == param.strip(), r.text
    assert "No tool call found for function call output with call_id c9." in refusals[0][1].json()["error"]["message"]
    assert "Duplicate function_call_output for call_id c1" in refusals[1][1].json()["error"]["message"]
    assert statuses == [200, 200, 200]


def test_max_tool_calls_beside_function_tools_is_refused(api):
    """OpenAI's ``max_tool_calls`` counts calls to built-in tools only (its API reference), so beside function tools
    it would limit nothing: a 400 naming it and saying what does (``parallel_tool_calls: false``). Without tools it
    changes nothing and is taken (test_s35_responses). Before: taken beside function tools and ignored."""
    async def fn(orch, c):
        body = {"model": orch.model_id, "input": "hi", "max_output_tokens": 2, "max_tool_calls": 1}
        return (await c.post("/v1/responses", json={**body, "tools": [{"type": "function", "name": "now"}]}),
                await c.post("/v1/responses", json=body))

    with_tools, without = _run(api, fn)
    assert with_tools.status_code == 400 and with_tools.json()["error"]["param"] == "max_tool_calls"
    assert "built-in tools" in with_tools.json()["error"]["message"] and "parallel_tool_calls: false" in \
        with_tools.json()["error"]["message"]
    assert without.status_code == 200 and without.json()["max_tool_calls"] == 1


def test_a_template_with_its_own_call_format_gets_calls_in_it(api, scripted, monkeypatch):
    """Llama 3.1's template (``{"name": ..., "parameters": ...}``, one call a message) and Mistral's
    (``[TOOL_CALLS][...]``): ``auto``'s grammar is the template's format, not Hermes ``<tool_call>`` (refused); a reply
    in it comes back as ``tool_calls`` (chat and Responses, streamed too); the forced reply uses the format's key;
    sent back, the template renders the call (Mistral: call ids of 9 characters, as its template demands); two calls
    in one message, which Llama's template refuses, are a 400 naming ``messages``, not a 500. Before: Hermes markers
    were the only call the grammar allowed, and ``"parameters"`` came back as content."""
    llama_call = '{"name":"get_weather","parameters":{"city":"Rome","days":2}}'
    mistral_call = f'[TOOL_CALLS][{CALL},{{"name":"now","arguments":{{}}}}]'

    async def fn(orch, c):
        out = {}
        for name, template, script in (("llama", LLAMA31, llama_call), ("mistral", MISTRAL, mistral_call)):
            monkeypatch.setattr(orch.tokenizer, "chat_template", template)
            body = {"model": orch.model_id, "messages": MSGS, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
            scripted(orch.tokenizer, script)
            chat = (await c.post("/v1/chat/completions", json=body)).json()
            stream = _events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
            resp = (await c.post("/v1/responses", json={
                "model": orch.model_id, "input": MSGS, "max_output_tokens": 200, "temperature": 0,
                "tools": [{"type": "function", **t["function"]} for t in TOOLS]})).json()
            scripted(orch.tokenizer, TAGGED)  # Hermes: not this template's calls, so text (the marker refused)
            hermes = (await c.post("/v1/chat/completions", json=body)).json()
            scripted(orch.tokenizer, llama_call if name == "llama" else CALL)
            forced = (await c.post("/v1/chat/completions", json={**body, "tool_choice": "required",
                                                                  "parallel_tool_calls": False})).json()
            calls = chat["choices"][0]["message"]["tool_calls"] or []
            back = await c.post("/v1/chat/completions", json={
                **body, "max_tokens": 1, "tool_choice": "none", "messages": MSGS + [
                    chat["choices"][0]["message"], *({"role": "tool", "tool_call_id": k["id"], "content": "sunny"}
                                                     for k in calls)]})
            two = [{"id": f"c{i}", "type": "function", "function": {"name": "now", "arguments": "{}"}}
                   for i in range(2)]
            refused = await c.post("/v1/chat/completions", json={**body, "messages": MSGS + [
                {"role": "assistant", "content": None, "tool_calls": two}]})
            out[name] = chat, stream, resp, hermes, forced, back, refused
        return out

    for name, (chat, stream, resp, hermes, forced, back, refused) in _run(api, fn).items():
        want = [("get_weather", {"city": "Rome", "days": 2})] + ([("now", {})] if name == "mistral" else [])
        choice = chat["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (name, choice)
        assert [(k["function"]["name"], json.loads(k["function"]["arguments"]))
                for k in choice["message"]["tool_calls"]] == want
        starts = [tc["function"]["name"] for e in stream if e.get("choices")
                  for tc in e["choices"][0]["delta"].get("tool_calls") or [] if tc.get("id")]
        assert starts == [n for n, _ in want], (name, stream)
        assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in resp["output"]] == \
            [("function_call", n, a) for n, a in want], resp
        text = hermes["choices"][0]["message"]  # a Hermes block is text here: Llama's calls start '{"name":'
        assert "tool_calls" not in text and (text["content"] == TAGGED if name == "mistral" else
                                             TAGGED.startswith(text["content"]) and '{"name":' not in text["content"])
        (call,) = forced["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": "Rome", "days": 2}, forced
        assert back.status_code == 200, back.text
        if name == "llama":
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
            assert "single tool-calls" in refused.json()["error"]["message"]
        else:
            assert refused.status_code == 200, refused.text


def test_call_format_from_the_template_and_mistral_s_special_token(tiny_model_factory):
    """The format is read from the template's text; a tokenizer with ``[TOOL_CALLS]`` as a special token gets it
    as that token in the grammar (decoded text starts with ``[{"name":``, which a text reply may not hold), and the
    reply read back from the decoded text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_factory("llama", num_layers=2))
    assert call_format(tok).name == "hermes"  # the tiny model's template takes no tools: Hermes rendering
    for template, name in ((LLAMA31, "llama3_json"), (MISTRAL, "mistral"), ("{{ tools }}<tool_call>", "hermes"),
                           ("{{ tools }}", "hermes"), ({"default": "x", "tool_use": LLAMA31}, "llama3_json")):
        tok.chat_template = template
        assert call_format(tok).name == name, template
    tok.chat_template = MISTRAL
    assert call_format(tok).opening == ""
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    special = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    fmt = call_format(tok)
    assert fmt.opening == f"<[{special}]>" and fmt.marker == '[{"name":'
    ts = parse_tools(TOOLS, None, None).in_format(fmt)
    lltok = structured.ll_tokenizer(tok, len(tok), [tok.eos_token_id])

    def matches(ids):
        m = llguidance.LLMatcher(lltok, ts.spec().grammar_text(), log_level=0)
        return all(m.consume_token(t) for t in ids) and m.is_accepting()

    body = tok.encode(f"[{CALL}]", add_special_tokens=False)
    assert matches([special] + body) and not matches(body) and matches(tok.encode("plain", add_special_tokens=False))
    text = tok.decode([special] + body, skip_special_tokens=True)
    scanner = CallScanner(ts.layout, fmt)
    scanner.feed(text)
    scanner.finish()
    assert scanner.is_calls and [(k.name, k.complete) for k in scanner.calls] == [("get_weather", True)]


def test_the_conversation_in_mistral_s_template_has_its_call_ids():
    """Call ids sent back in any shape render through Mistral's template (which raises on ids not of 9 letters or
    digits), the call and its result the same id."""
    conv = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12"}]
    seen = {}

    class Tok:
        chat_template = MISTRAL

        def encode(self, text, add_special_tokens=False):
            return [1, 2]  # [TOOL_CALLS] is text for it

        def apply_chat_template(self, messages, tools=None, **kw):
            seen["messages"] = messages
            return [1]

    class Orch:
        tokenizer = Tok()

    encode_conversation(Orch(), conv, parse_tools(TOOLS, None, None))
    call_id = seen["messages"][1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and seen["messages"][2]["tool_call_id"] == call_id


def test_a_refused_client_s_schema_is_checked_not_compiled(api, monkeypatch):
    """A client past its in-flight cap gets its 429 once its request is found valid; its schema is checked
    (llguidance's validation, no tokenizer) but not compiled: a valid one gets the 429 without a compile, an invalid
    one its 400 (400 before 429 still). Before: every such schema was compiled first."""
    from petals_chain.orchestrator import api as api_module
    from petals_chain.orchestrator.auth import ANONYMOUS

    compiled = []
    real = api_module.compile_spec_async

    async def counting(spec, *a):
        compiled.append(spec.kind)
        return await real(spec, *a)

    monkeypatch.setattr(api_module, "compile_spec_async", counting)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def fmt(s):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}

    async def fn(orch, c):
        body = {"model": orch.model_id, "messages": MSGS, "max_tokens": 4}
        admitted = await c.post("/v1/chat/completions", json={**body, "response_format": fmt(schema)})
        limits = c._transport.app.state.limits
        limits.limits.client_max_inflight = 1
        limits.by_client[ANONYMOUS] = 1  # one request of this client runs: every new one is refused
        try:
            return admitted, [await c.post("/v1/chat/completions", json={**body, "response_format": fmt(s)})
                              for s in (schema, {"type": "foo"}, {"type": "string", "minLength": 5, "maxLength": 2})]
        finally:
            limits.by_client.pop(ANONYMOUS, None)

    admitted, (valid, bad, unsatisfiable) = _run(api, fn)
    assert admitted.status_code == 200 and compiled == ["json_schema"], admitted.text
    assert valid.status_code == 429 and valid.json()["error"]["code"] == "client_inflight_limit", valid.text
    for r in (bad, unsatisfiable):
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    assert compiled == ["json_schema"], compiled


def test_a_draft_model_drafts_under_the_grammar(api, tiny_model_factory):
    """Under a structured output the draft model takes the most likely token the grammar allows: every draft is one
    the grammar takes whole (drafted unconstrained, the random tiny model's drafts are refused from their first
    token); the sequence's own state does not move (a fork took the draft), its CPU is charged to its budget.
    Before: drafts ignored the grammar, and the decode loop cut them where the grammar refused them."""
    import asyncio

    from petals_chain.orchestrator.drafting import DraftModel, DraftState

    orch = api[0]
    tok = orch.tokenizer
    spec = structured.StructuredSpec("json_schema", json.dumps({
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}), "response_format")
    grammar = structured.compile_spec(spec, tok, orch.vocab_size, orch._eos)  # its tokenizer built once, as the API's
    drafter = DraftModel.load(tiny_model_factory("llama", num_layers=2), "self")
    context = tok.encode("Weather as JSON:", add_special_tokens=False)

    async def main():
        out = {}
        for constrained in (True, False):
            drafter.constrained = constrained
            state = grammar.state()
            state.replay(tok.encode('{"city":"R', add_special_tokens=False))
            before = (state.consumed, state.cpu_s)
            draft = await drafter.draft(DraftState(), context + [1], 6, state)
            after = (state.consumed, state.cpu_s)
            out[constrained] = (draft, state.valid_prefix(draft), before, after)
        return out

    try:
        out = asyncio.run(main())
    finally:
        drafter.close()
    draft, valid, before, after = out[True]
    assert len(draft) == 6 and valid == 6, draft
    assert after[0] == before[0] and after[1] > before[1]  # not moved; charged
    draft, valid, before, after = out[False]
    assert len(draft) == 6 and valid < 6 and after == before, (draft, valid)
