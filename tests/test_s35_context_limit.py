"""At the context limit, through every endpoint (an in-process orchestrator without servers: the refusals come before
any chain is taken). A prompt that leaves no room, or an output limit past the context, is refused with 400
``context_length_exceeded`` (OpenAI's behaviour, never clamped), naming the body field the request sent.

Found by the session-35 hunt with SmolLM2 at ``--max-length 2048``: chat, the Responses API and session turns named
``param: "prompt"``, a field none of them has (OpenAI names ``messages`` and ``input``); a prompt of exactly the
context read "the prompt has 2048 tokens, but this model's maximum context length is 2048 tokens"; a session turn that
added 4 tokens to a session holding 60 (of 64) read "the prompt has 64 tokens"."""

from __future__ import annotations

import pytest

from test_api import run_with_api

MAX_LENGTH = 64  # run_with_api's --max-length


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def _chat_len(orch, content: str, instructions: str | None = None) -> int:
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
        {"role": "user", "content": content}]
    return len(orch.encode_chat(messages))


def _content_of(orch, tokens: int, instructions: str | None = None) -> str:
    """User content whose templated conversation has exactly ``tokens`` tokens."""
    for k in range(tokens + 1):
        content = "go" + " a" * k
        n = _chat_len(orch, content, instructions)
        if n == tokens:
            return content
        if n > tokens:
            break
    raise AssertionError(f"no content templates to {tokens} tokens")


def test_context_errors_name_the_field_sent_and_what_does_not_fit(model_path):
    async def fn(orch, c):
        model = orch.model_id
        full, over = _content_of(orch, MAX_LENGTH), _content_of(orch, MAX_LENGTH + 1)

        async def err(path, body):
            r = await c.post(path, json={"model": model, **body})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", (body, r.text)
            return r.json()["error"]

        # chat: the messages, at exactly the context and one over; then an output limit one past what fits
        for content, why in ((full, "no room is left for a completion"),
                             (over, "2 too many, at most 63 leave room for a completion")):
            for stream in (False, True):
                e = await err("/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                       "stream": stream})
                assert e["param"] == "messages", e
                n = _chat_len(orch, content)
                assert f"there are {n} tokens in the messages" in e["message"] and why in e["message"], e
                assert f"maximum context length is {MAX_LENGTH} tokens" in e["message"], e
        almost = _content_of(orch, MAX_LENGTH - 3)
        for field in ("max_tokens", "max_completion_tokens"):
            e = await err("/v1/chat/completions", {"messages": [{"role": "user", "content": almost}], field: 4})
            assert e["param"] == field and f"{field} is 4: at most 3 fit" in e["message"], e
        # the Responses API: its input (instructions counted), and max_output_tokens
        rules = "Answer briefly."
        e = await err("/v1/responses", {"input": _content_of(orch, MAX_LENGTH, rules), "instructions": rules})
        assert e["param"] == "input" and "no room is left for a completion" in e["message"], e
        e = await err("/v1/responses", {"input": _content_of(orch, MAX_LENGTH - 2), "max_output_tokens": 3})
        assert e["param"] == "max_output_tokens" and "max_output_tokens is 3: at most 2 fit" in e["message"], e
        # completions: a prompt of the whole context is refused unless nothing is generated (echo scoring)
        ids = [5] * MAX_LENGTH
        e = await err("/v1/completions", {"prompt": ids})
        assert e["param"] == "prompt" and "there are 64 tokens in the prompt: no room is left" in e["message"], e
        r = await c.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 0, "echo": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_LENGTH, r.text
        e = await err("/v1/completions", {"prompt": ids + [5], "max_tokens": 0, "echo": True})
        assert e["param"] == "prompt" and "1 too many" in e["message"], e
        # several prompts: the one that does not fit is named by its place (review of 0497ed7: "the prompt")
        e = await err("/v1/completions", {"prompt": [[5] * 3, ids + [5, 5], [5]]})
        assert e["param"] == "prompt" and "there are 66 tokens in the prompt at index 1: 3 too many" in e["message"], e
        e = await err("/v1/completions", {"prompt": ids[:-1], "max_tokens": 2})
        assert e["param"] == "max_tokens" and "max_tokens is 2: at most 1 fit" in e["message"], e
    run_with_api(model_path, fn)


def test_a_session_turn_past_its_max_length_says_what_the_session_holds(model_path):
    """The session's own tokens and this turn's are told apart, the turn's field is named, and the session is left
    as it was. (Its history is set directly: generating it would need a chain.)"""
    async def fn(orch, c):
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        s = orch.get_session(sid)
        s.history = [5] * 28
        gen = f"/api/v1/sessions/{sid}/generate"
        cases = [({"input_ids": [5] * 4}, "input_ids", "it would hold 32 (28 before it): no room is left"),
                 ({"input_ids": [5] * 5, "max_tokens": 1}, "input_ids", "it would hold 33 (28 before it): 2 too many"),
                 ({"prompt": " a a a a a a"}, "prompt", "too many"),
                 ({"input_ids": [5] * 2, "max_tokens": 3}, "max_tokens",
                  "with this turn's input_ids it would hold 30 (28 before it), and max_tokens is 3: at most 2 fit")]
        for body, param, said in cases:
            r = await c.post(gen, json=body)
            e = r.json()["error"]
            assert r.status_code == 400 and e["code"] == "context_length_exceeded", (body, r.text)
            assert e["param"] == param and said in e["message"], (body, e)
            assert "this session's max_length is 32 tokens" in e["message"], e
        info = (await c.get(f"/api/v1/sessions/{sid}")).json()
        assert info["tokens"] == 28 and info["turns"] == 0 and not info["busy"], info
        s.history = [5] * 32  # full: only a new session helps
        e = (await c.post(gen, json={"input_ids": [5]})).json()["error"]
        assert ("it would hold 33 (32 before it): 2 too many, at most 31 leave room for a completion "
                "(the session is full: open a new one)") in e["message"], e
        # a chat session: its templated conversation, named as messages
        chat = (await c.post("/api/v1/sessions", json={"max_length": 24})).json()["session_id"]
        r = await c.post(f"/api/v1/sessions/{chat}/generate",
                         json={"messages": [{"role": "user", "content": _content_of(orch, 24)}]})
        e = r.json()["error"]
        assert r.status_code == 400 and e["param"] == "messages", r.text
        assert "with this turn's messages it would hold 24 (0 before it): no room is left" in e["message"], e
    run_with_api(model_path, fn)
