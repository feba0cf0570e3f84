"""Review of fce63fc (tool calling on the chat API): text a request sends that the tokenizer cannot take (a tool's
description or parameters with a lone surrogate) is a 400 naming the field, not a 500;
a session's turn that sends tools is told where tools are taken, not "unsupported parameter(s)"."""

from __future__ import annotations

import json

import test_s36_tools_api as base
from test_s36_tools_api import MSGS, TOOLS, _run

api = base.api  # the fixture: orchestrator and app over fake chains on the tiny model

BAD = "x\ud800"  # a lone surrogate: JSON's "\ud800" escape decodes to it


def test_text_the_tokenizer_cannot_take_is_a_400_naming_its_field(api):
    """Before, a tool's description or parameters with ``\\ud800`` were a TypeError from the tokenizer (the Hermes
    tools prompt, or a chat template that renders tools): a 500 "internal error"."""
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "f", "description": BAD}}]},
         "tools.0.function.description"),
        ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "description": BAD}}}}}]},
         "tools.1.function.parameters"),
    ]

    async def fn(orch, c):
        out = []
        for extra, param in cases:
            body = json.dumps({"model": orch.model_id, "messages": MSGS, "max_tokens": 2, **extra})
            r = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            out.append((param, r.status_code, r.json()["error"]))
        return out

    for param, status, err in _run(api, fn):
        assert (status, err["param"]) == (400, param) and "surrogate" in err["message"], (param, status, err)


def test_a_session_turn_with_tools_says_where_tools_are_taken(api):
    """Before: "unsupported parameter(s): tools" (the chat API takes them now: it reads as if this server did not)."""
    async def fn(orch, c):
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        out = []
        for extra in ({"tools": TOOLS}, {"tool_choice": "required"},
                      {"messages": [{"role": "tool", "tool_call_id": "c", "content": "1"}]}):
            r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"messages": MSGS, **extra})
            out.append((r.status_code, r.json()["error"]))
        r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"messages": MSGS, "tools": [],
                                                                     "tool_choice": "none", "max_tokens": 1})
        out.append((r.status_code, r.json()))
        return out

    *refused, plain = _run(api, fn)
    for (status, err), param in zip(refused, ("tools", "tool_choice", "messages.0.role")):
        assert status == 400 and err["param"] == param, err
        assert "offers no tools" in err["message"] and "/v1/chat/completions" in err["message"], err
    assert plain[0] == 200, plain  # no tools, as OpenAI clients send them: what a plain turn is
