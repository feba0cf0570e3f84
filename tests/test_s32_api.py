"""The API's leftovers of OpenAI strictness (in process, no servers): numbers sent as strings, bodies nested past
what JSON parsing can read, and the event-stream check the client shares with the stream relay."""

from __future__ import annotations

import asyncio

import httpx
import pydantic
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig, api
from petals_chain.orchestrator.api import create_app


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def run_with_api(model_path, fn, **cfg):
    async def main():
        orch = Orchestrator(OrchestratorConfig(model=str(model_path), max_length=64, port=0, **cfg))
        orch.load_model()
        await orch.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)),
                                         base_url="http://orch") as c:
                return await fn(orch, c)
        finally:
            await orch.stop()

    return asyncio.run(main())


def test_numbers_sent_as_strings_are_400s_naming_the_field(model_path):
    """Pydantic's lax mode read ``"n": "2"`` as 2, ``"temperature": "0.5"`` as 0.5, a logit bias of ``"1"``, a
    stop token id ``"5"`` and a token prompt ``["1", 2]`` as numbers (OpenAI: "expected an integer, but got a string
    instead"). Now each is a 400 naming the field (a request let through answers 503 here: no servers)."""
    async def fn(orch, c):
        m = orch.model_id
        comp = {"model": m, "prompt": "x", "max_tokens": 1}
        chat = {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        sid = (await c.post("/api/v1/sessions", json={})).json()["session_id"]
        bad = [("/v1/completions", {**comp, k: v}, p) for k, v, p in (
            ("n", "2", "n"), ("max_tokens", "1", "max_tokens"), ("seed", "3", "seed"), ("logprobs", "2", "logprobs"),
            ("top_k", "5", "top_k"), ("temperature", "0.5", "temperature"), ("top_p", "1", "top_p"),
            ("presence_penalty", "0", "presence_penalty"), ("logit_bias", {"5": "1"}, "logit_bias.5"),
            ("stop_token_ids", [3, "5"], "stop_token_ids.1"), ("prompt", ["1", 2], "prompt.0"),
            ("prompt", [[1], ["2"]], "prompt.1.0"), ("deadline_ms", "500", "deadline_ms"))]
        bad += [("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
                ("/v1/chat/completions", {**chat, "max_completion_tokens": "1"}, "max_completion_tokens"),
                (f"/api/v1/sessions/{sid}/generate", {"input_ids": [1, "2"], "max_tokens": 1}, "input_ids.1"),
                (f"/api/v1/sessions/{sid}/generate", {"prompt": "x", "logprobs": "1"}, "logprobs"),
                ("/api/v1/sessions", {"max_length": "32"}, "max_length")]
        return [(p, await c.post(path, json=body)) for path, body, p in bad]

    for param, r in run_with_api(model_path, fn, no_chain_wait_s=0.2):
        assert r.status_code == 400, (param, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (param, err)
        assert "must be a number, not \"" in err["message"], (param, err)


def test_integral_floats_and_ints_for_floats_are_still_read_as_numbers():
    """What lax parsing did right stays: ``2.0`` for an integer is 2 (2.5 refused), ``1`` for a float is 1.0, a
    list of strings is a list of prompts and a logit bias keeps its string key."""
    body = {"model": "m", "prompt": "x", "n": 2.0, "max_tokens": 1.0, "seed": 3.0, "logprobs": 2.0, "temperature": 1,
            "top_p": 1, "logit_bias": {"5": 1}}
    req = api.CompletionRequest.model_validate(body)
    assert (req.n, req.max_tokens, req.seed, req.logprobs, req.temperature, req.logit_bias) == (2, 1, 3, 2, 1.0,
                                                                                                {"5": 1.0})
    assert type(req.n) is int and type(req.temperature) is float
    for prompt in (["1", "2"], [[1, 2], [3]], [1, 2], "12"):
        assert api.CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
    chat = api.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                           "logprobs": True, "top_logprobs": 1.0, "max_completion_tokens": 4.0})
    assert (chat.top_logprobs, chat.max_completion_tokens) == (1, 4)
    with pytest.raises(pydantic.ValidationError, match="fractional part"):
        api.CompletionRequest.model_validate({**body, "n": 2.5})


def test_bodies_nested_past_the_parser_are_400s_with_a_code(model_path):
    """A body nested 1000 deep or more (in a value, in a message's content, in logit_bias) raised RecursionError in
    the JSON parser: FastAPI's 400 "There was an error parsing the body" with ``code: null``; a body that is not
    UTF-8 the same. Now ``invalid_json`` saying why; shallower ones stay 400s naming the field."""
    async def fn(orch, c):
        m = orch.model_id
        out = []
        for depth in (100, 1000, 10**4, 10**5):
            arr, obj = "[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth
            for path, body in (
                    ("/v1/completions", '{"model": "%s", "prompt": "x", "max_tokens": 1, "stop": %s}' % (m, arr)),
                    ("/v1/completions", '{"model": "%s", "prompt": %s, "max_tokens": 1}' % (m, arr)),
                    ("/v1/completions", '{"model": "%s", "prompt": "x", "logit_bias": {"5": %s}}' % (m, arr)),
                    ("/v1/completions", '{"model": "%s", "prompt": "x", "logit_bias": %s}' % (m, obj)),
                    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": %s}]}'
                     % (m, arr)),
                    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": [%s]}]}'
                     % (m, obj)),
                    ("/v1/completions", arr)):
                r = await c.post(path, content=body.encode(), headers={"content-type": "application/json"})
                out.append((depth, r))
        utf8 = await c.post("/v1/completions", content=b'{"model": "\xff", "prompt": "x"}',
                            headers={"content-type": "application/json"})
        return out, utf8

    out, utf8 = run_with_api(model_path, fn)
    for depth, r in out:
        assert r.status_code == 400, (depth, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] is not None, (depth, err)
        if depth >= 1000:
            assert err["code"] == "invalid_json" and "nest" in err["message"], (depth, err)
    err = utf8.json()["error"]
    assert utf8.status_code == 400 and err["code"] == "invalid_json" and "UTF-8" in err["message"], err


def test_the_client_and_the_stream_relay_read_an_event_stream_with_one_function():
    """The client's ``_is_event_stream`` was a copy of resume.py's ``is_event_stream`` (the client may not import
    the orchestrator): both now use ``petals_chain.swarm.media.is_event_stream``."""
    import petals_chain.client as client
    from petals_chain.orchestrator import resume
    from petals_chain.swarm.media import is_event_stream

    assert client.is_event_stream is is_event_stream and resume.is_event_stream is is_event_stream
    assert not hasattr(client, "_is_event_stream")
    for kind, want in (("text/event-stream", True), ("Text/Event-Stream; charset=UTF-8", True),
                       (" text/event-stream ;x=1", True), ("application/json", False), ("", False),
                       ("text/event-streams", False)):
        assert is_event_stream({"content-type": kind}) is want, kind
        assert is_event_stream(httpx.Headers({"Content-Type": kind})) is want, kind
    assert is_event_stream({}) is False
