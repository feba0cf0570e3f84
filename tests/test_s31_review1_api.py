"""Review of the thirty-first session's API change (booleans inside lists, body errors, tool results): what it left."""

from __future__ import annotations

import pydantic
import pytest

from petals_chain.orchestrator import api
from test_api import run_with_api


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def _nested(depth: int) -> list:
    out: list = [1]
    for _ in range(depth):
        out = [out]
    return out


def test_an_array_where_a_boolean_or_a_content_type_goes_is_a_400_however_deep():
    """``echo: [[[...]]]`` quoted the value with ``json.dumps``, which raised RecursionError past ~900 levels (the
    JSON parser takes a little more): a 500 "internal error" for a bad parameter. The same for a content part's
    ``type``. An array or object is now named by its kind."""
    deep = _nested(5000)
    cases = [(api.CompletionRequest, {"model": "m", "prompt": "x", "echo": deep}, "echo must be true or false"),
             (api.CompletionRequest, {"model": "m", "prompt": "x", "stream": {"a": deep}}, "stream must be true"),
             (api.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": deep}]}]},
              "only text content parts are supported, not an array")]
    for model, body, text in cases:
        with pytest.raises(pydantic.ValidationError) as e:
            model.model_validate(body)
        assert text in str(e.value), str(e.value)[:300]
    with pytest.raises(pydantic.ValidationError, match='echo must be true or false, not "yes"'):
        api.CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": "yes"})  # scalars quoted as before


def test_the_boolean_check_of_nested_lists_reads_the_annotation_once_per_level(monkeypatch):
    """A prompt of many one-token lists (``[[1], [2], ...]``) took the union apart again for every inner list: 100k
    of them cost more than pydantic's whole validation of the body, on the event loop. Counted, not timed."""
    calls = []
    members = api._members
    monkeypatch.setattr(api, "_members", lambda a: calls.append(a) or members(a))
    plan = getattr(api, "_item_plan", None)
    if plan is not None:
        plan.cache_clear()
    ann = api.CompletionRequest.model_fields["prompt"].annotation
    assert api._bool_for_number([[i] for i in range(2000)], ann) is None
    assert api._bool_for_number([[1, 2]] * 50 + [[3, True]], ann) == [50, 1, True]  # still found
    assert len(calls) <= 20, len(calls)


def test_an_assistant_tool_call_sent_back_is_refused_for_its_call(model_path):
    """An OpenAI client resends the assistant's tool call as ``{"role": "assistant", "content": null, "tool_calls":
    [...]}``: refused as "messages.1.content: Input should be a valid string; ... a valid list" (the tool_calls check
    runs only once content passed). Now refused for the tool call, naming it; with content, as before. Chat
    completions take tool calls now (tool calling, test_s36_tools_api.py): there only the legacy function_call is
    refused."""
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]

    async def fn(orch, c):
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        for name, value, extra in (("tool_calls", call, {"content": None}), ("tool_calls", call, {}),
                                   ("function_call", call[0]["function"], {"content": None}),
                                   ("tool_calls", call, {"content": "ok"})):
            msgs = [{"role": "user", "content": "x"}, {"role": "assistant", name: value, **extra}]
            paths = [(f"/api/v1/sessions/{sid}/generate", {})]
            paths += [("/v1/chat/completions", {"model": orch.model_id})] if name == "function_call" else []
            for path, body in paths:
                r = await c.post(path, json={**body, "messages": msgs})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == f"messages.1.{name}", (msgs, r.text)
                assert f"a message's {name} is not supported" in err["message"], r.text
        assert orch.get_session(sid).turns == 0

    run_with_api(model_path, fn)
