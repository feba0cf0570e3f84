"""Today's ``openai`` package (3.x) against the API, as its users call it: the chat parameters it types (prompt
caching, verbosity, moderation), the assistant messages its ``.parse()``/``.stream()`` helpers hand back for the next
turn, and its calls of endpoints this server does not have. The orchestrator runs in this process over fake chains
(test_s33_api_envelope's ``api``, here ``envelope``): no server process, no DHT."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import test_s33_api_envelope as _envelope
from test_s33_api_envelope import KEYS, _chain

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport of the openai package installed here
envelope = _envelope.api  # the fixture: (orchestrator, app) over fake chains, keys alice and bob


def _with_sdk(envelope, fn):
    """``fn(orch, client)`` with an ``AsyncOpenAI`` (no retries) over the app, one chain up."""
    orch, app = envelope

    async def main():
        orch.dispatch.set_chains([_chain(2)])
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://orch", timeout=60)
        async with openai.AsyncOpenAI(base_url="http://orch/v1", api_key=KEYS["bob"], http_client=http,
                                      max_retries=0) as client:
            return await fn(orch, client)

    return asyncio.run(main())


async def _refusal(call) -> tuple:
    with pytest.raises(openai.BadRequestError) as e:
        await call
    return e.value.param, e.value.code, e.value.message


def test_every_chat_parameter_the_openai_package_types_is_taken_as_null_and_cache_hints_change_nothing(envelope):
    """openai 3.x types ``prompt_cache_key`` (what replaces ``user``), ``prompt_cache_retention``,
    ``prompt_cache_options``, text parts' ``prompt_cache_breakpoint``, ``verbosity`` and ``moderation``: each was
    "unsupported parameter(s): ...", even sent as null (the package sends a parameter given as None as null). The
    cache hints are taken (the servers' prefix caches need none: the same tokens come out), verbosity at OpenAI's
    default; what would change the output is refused, naming the parameter."""
    from openai.resources.chat.completions import AsyncCompletions

    skip = {"self", "messages", "model", "stream", "extra_headers", "extra_query", "extra_body", "timeout"}
    names = [p for p in inspect.signature(AsyncCompletions.create).parameters if p not in skip]

    async def fn(orch, client):
        base = {"model": orch.model_id, "max_completion_tokens": 3, "temperature": 0}
        hi = [{"role": "user", "content": "hi"}]
        refused_null = {}
        for name in names:
            try:
                await client.chat.completions.create(messages=hi, **{**base, name: None})
            except openai.BadRequestError as e:
                refused_null[name] = e.message
        plain = await client.chat.completions.create(messages=hi, **base)
        hinted = await client.chat.completions.create(
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                    "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]}],
            prompt_cache_key="user-42", prompt_cache_retention="24h",
            prompt_cache_options={"mode": "explicit", "ttl": "30m"}, verbosity="medium", **base)
        refused = {
            "verbosity": await _refusal(client.chat.completions.create(messages=hi, verbosity="low", **base)),
            "moderation": await _refusal(client.chat.completions.create(
                messages=hi, moderation={"model": "omni-moderation-latest"}, **base)),
            "retention": await _refusal(client.chat.completions.create(
                messages=hi, extra_body={"prompt_cache_retention": "forever"}, **base)),
        }
        return refused_null, plain, hinted, refused

    refused_null, plain, hinted, refused = _with_sdk(envelope, fn)
    assert len(names) > 30 and refused_null == {}
    assert [c.message.content for c in hinted.choices] == [c.message.content for c in plain.choices]
    assert hinted.model_extra["petals_chain"][0]["token_ids"] == plain.model_extra["petals_chain"][0]["token_ids"]
    assert hinted.usage.prompt_tokens == plain.usage.prompt_tokens and hinted.usage.completion_tokens == 3
    assert refused["verbosity"][:2] == ("verbosity", "invalid_value") and "'low'" in refused["verbosity"][2]
    assert refused["moderation"][:2] == ("moderation", "invalid_value")
    assert "moderation is not supported" in refused["moderation"][2]
    assert refused["retention"][0] == "prompt_cache_retention"


def test_a_message_the_openai_package_parsed_is_taken_back_in_the_next_turn(envelope):
    """``client.chat.completions.parse()`` (and ``.stream()``) return a ParsedChatCompletionMessage, which carries
    ``parsed``; appended to the conversation as the package's guides do, the next turn was refused: "unsupported
    parameter(s): messages.1.parsed". Taken back when empty (all this server can return: no response_format); a
    message that did parse something is refused, naming it."""
    async def fn(orch, client):
        eos = orch.tokenizer.eos_token_id
        first = [{"role": "user", "content": "hi"}]
        # the end of text at once: finish_reason "stop" (parse() raises on "length")
        done = await client.chat.completions.parse(model=orch.model_id, messages=first, max_completion_tokens=3,
                                                   temperature=0, logit_bias={str(eos): 100})
        message = done.choices[0].message
        turn = [*first, message, {"role": "user", "content": "and then?"}]
        nxt = await client.chat.completions.create(model=orch.model_id, messages=turn, max_completion_tokens=2)
        with_parsed = [*first, {"role": "assistant", "content": "{}", "parsed": {"a": 1}}, turn[-1]]
        refused = await _refusal(client.chat.completions.create(model=orch.model_id, messages=with_parsed,
                                                                max_completion_tokens=2))
        return message, done.choices[0].finish_reason, nxt, refused

    from openai.types.chat import ParsedChatCompletionMessage

    message, finish, nxt, refused = _with_sdk(envelope, fn)
    assert isinstance(message, ParsedChatCompletionMessage) and finish == "stop" and message.parsed is None
    assert nxt.usage.completion_tokens == 2 and nxt.choices[0].finish_reason == "length"
    assert refused[0] == "messages.1.parsed" and "a message's parsed is not supported" in refused[2]


def test_an_openai_endpoint_this_server_lacks_says_which_it_has(envelope):
    """``client.responses.create`` (the package's newest API) and ``client.embeddings.create`` got a bare "Not
    Found", which reads as a wrong base_url or model: the error now names the URL asked for and the endpoints
    served."""
    async def fn(orch, client):
        out = {}
        for name, call in (("responses", client.responses.create(model=orch.model_id, input="hi")),
                           ("embeddings", client.embeddings.create(model=orch.model_id, input="hi"))):
            with pytest.raises(openai.NotFoundError) as e:
                await call
            out[name] = (e.value.code, e.value.body["message"])
        return out

    out = _with_sdk(envelope, fn)
    assert out["responses"][0] == out["embeddings"][0] == "not_found"
    assert out["responses"][1].startswith("Invalid URL (POST /v1/responses)")
    assert out["embeddings"][1].startswith("Invalid URL (POST /v1/embeddings)")
    assert "POST /v1/chat/completions" in out["responses"][1]
