"""The HTTP API (thirty-first session): a streamed session turn's usage chunk, booleans inside lists and objects,
errors about the body itself (an in-process orchestrator without servers; a turn is faked where one must run)."""

from __future__ import annotations

import json

import pytest

from test_api import run_with_api


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def test_a_streamed_session_turn_sends_the_usage_chunk_when_asked(model_path):
    """``stream_options.include_usage`` was ignored on a streamed session turn (taken, never honoured) while
    ``/v1/chat/completions`` sends it: now the turn's last event is a chunk with ``choices: []`` and the usage the
    turn's last event reports (its whole context as the prompt, the part the chain held as cached); not asked, none."""
    from petals_chain.orchestrator.generation import Generation
    from petals_chain.orchestrator.sampling import TokenChoice

    async def fn(orch, c):
        async def fake_turn(s, target, params, *, explicit_max_tokens=True, emit=None, messages=None, based_on=None):
            toks = orch.encode(" red fox", add_special_tokens=False)
            async with s.lock:
                for t in toks:
                    await emit(orch.decode([t]), [TokenChoice(t, -1.0, None)])
                cached = len(s.history)  # as a chain holding the session's earlier turns reports it
                s.history, s.turns = [*target, *toks], s.turns + 1
                return Generation(token_ids=toks, text=orch.decode(toks), finish_reason="length",
                                  prompt_tokens=len(target), wait_s=0.0, service_s=0.0, chain=[], failovers=0,
                                  cached_tokens=cached)

        async def events(sid: str, body: dict) -> list:
            out = []
            async with c.stream("POST", f"/api/v1/sessions/{sid}/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        out.append(line[6:])
            assert out[-1] == "[DONE]"
            return [json.loads(e) for e in out[:-1]]

        orch.session_generate = fake_turn
        sid = (await c.post("/api/v1/sessions", json={"max_length": 48})).json()["session_id"]
        first = await events(sid, {"input_ids": [1, 2, 3], "max_tokens": 4})
        assert all("usage" not in e or e["finish_reason"] for e in first)  # not asked: the last event's alone
        asked = await events(sid, {"input_ids": [4, 5], "max_tokens": 4, "stream_options": {"include_usage": True}})
        last = asked[-1]
        ended = [e for e in asked if e.get("finish_reason")]
        assert len(ended) == 1 and asked[-2] is ended[0]
        prompt = 3 + len(first) - 1 + 2  # the turn's whole context: the first turn, its tokens, the new input
        assert last["choices"] == [] and last["session_id"] == sid and not last.get("text"), last
        assert last["usage"] == ended[0]["usage"], (last, ended[0])
        assert last["usage"]["prompt_tokens"] == prompt == len(orch.get_session(sid).history) - (len(asked) - 2)
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 2
        assert last["usage"]["completion_tokens"] == len(asked) - 2

    run_with_api(model_path, fn)


def test_booleans_are_not_numbers_inside_lists_and_objects(model_path):
    """``stop_token_ids: [true]`` was token 1, ``prompt: [[true]]`` a prompt of token 1, ``logit_bias`` values
    ``true`` a bias of 1 and a session's ``input_ids: [true]`` token 1: each a 400 naming the item now, before any
    work; numbers there are taken as before."""
    async def fn(orch, c):
        m = orch.model_id
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        cases = [("/v1/completions", {"model": m, "prompt": "x", "stop_token_ids": [3, True]}, "stop_token_ids.1"),
                 ("/v1/completions", {"model": m, "prompt": [[True]]}, "prompt.0.0"),
                 ("/v1/completions", {"model": m, "prompt": [[1, 2], [3, False]]}, "prompt.1.1"),
                 ("/v1/completions", {"model": m, "prompt": [True, 2]}, "prompt.0"),
                 ("/v1/completions", {"model": m, "prompt": "x", "logit_bias": {"5": True}}, "logit_bias.5"),
                 ("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "x"}],
                                           "stop_token_ids": [False]}, "stop_token_ids.0"),
                 (f"/api/v1/sessions/{sid}/generate", {"input_ids": [True]}, "input_ids.0"),
                 (f"/api/v1/sessions/{sid}/generate", {"input_ids": [2], "stop_token_ids": [True]},
                  "stop_token_ids.0")]
        for path, body, param in cases:
            r = await c.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, r.text)
            assert f"{param} must be a number, not " in err["message"], r.text
        assert orch.get_session(sid).turns == 0
        # numbers where numbers go, and booleans where anything goes, stay taken (the latter refused for what it is)
        r = await c.post("/v1/completions", json={"model": m, "prompt": [[1, 2]], "max_tokens": 0, "echo": True,
                                                  "stop_token_ids": [3], "logit_bias": {"5": -1}})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/chat/completions", json={"model": m, "messages": [{"role": "user", "content": "x"}],
                                                       "tools": [True]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0", r.text

    run_with_api(model_path, fn)


def test_errors_about_the_body_itself_say_so_and_others_name_their_parameter(model_path):
    """A body that is not a JSON object was "body: Input should be a valid dictionary or object to extract fields
    from", an empty one "body: Field required", and a refusal by a model validator "body: top_logprobs needs
    logprobs: true" (``param`` right, the text naming "body"): now the body's kind is said, and the rest name
    the parameter alone."""
    async def fn(orch, c):
        m = orch.model_id
        msgs = [{"role": "user", "content": "x"}]
        headers = {"Content-Type": "application/json"}
        for path in ("/v1/completions", "/v1/chat/completions", "/api/v1/sessions", "/api/v1/sessions/x/generate"):
            for raw, kind in ((b"[]", "an array"), (b'"x"', "a string"), (b"1", "a number"), (b"null", "null"),
                              (b"true", "true"), (b"", "nothing")):
                if path == "/api/v1/sessions" and raw in (b"", b"null"):
                    continue  # opening a session takes no body
                r = await c.post(path, content=raw, headers=headers)
                err = r.json()["error"]
                assert r.status_code == 400 and err["code"] == "invalid_json", (path, raw, r.text)
                assert err["message"] == f"the request body must be a JSON object, not {kind}", (path, raw, r.text)
        cases = [("/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
                 ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
                 ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
                 ("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "yaml"}},
                  "response_format.type"),
                 ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "max_completion_tokens": 3},
                  "max_completion_tokens")]
        for path, body, param in cases:
            r = await c.post(path, json={"model": m, **body})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, r.text)
            assert err["message"].startswith("invalid request: ") and param in err["message"], r.text
            assert "body" not in err["message"], r.text
        r = await c.post("/v1/completions", json={"model": m, "prompt": "x", "max_tokens": -1})
        assert r.json()["error"]["message"].startswith("invalid request: max_tokens: "), r.text  # as before

    run_with_api(model_path, fn)


def test_a_tool_result_message_is_refused_as_one(model_path):
    """A conversation with a tool's result (role ``tool``, as an OpenAI client resends it) was "unsupported
    parameter(s): messages.1.tool_call_id", its role refused only once that was dropped: now a 400 saying that tool
    results are not supported, naming the message's role, on a chat session (chat completions take them: tool
    calling, test_s36_tools_api.py; the legacy role ``function`` stays refused there)."""
    async def fn(orch, c):
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        for role, extra in (("tool", {"tool_call_id": "call_1"}), ("function", {"name": "f"})):
            msgs = [{"role": "user", "content": "x"}, {"role": role, "content": "42", **extra}]
            paths = [(f"/api/v1/sessions/{sid}/generate", {})]
            paths += [("/v1/chat/completions", {"model": orch.model_id})] if role == "function" else []
            for path, body in paths:
                r = await c.post(path, json={**body, "messages": msgs})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "messages.1.role", r.text
                assert f'role "{role}"' in err["message"], r.text
                assert "offers no tools" in err["message"] or path.startswith("/v1/"), r.text

    run_with_api(model_path, fn)
