"""Today's ``openai`` package (3.x) against the API, as its users call it: the chat parameters it types (prompt
caching, verbosity, moderation), the assistant messages its ``.parse()``/``.stream()`` helpers hand back for the next
turn, its calls of endpoints this server does not have (or with a base_url lacking /v1), and the errors it retries
or shows. The orchestrator runs in this process over fake chains (test_s33_api_envelope's ``api``, here
``envelope``): no server process, no DHT."""

from __future__ import annotations

import asyncio
import inspect

import pydantic
import pytest
import test_s33_api_envelope as _envelope
from test_s33_api_envelope import KEYS, _chain

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport of the openai package installed here
envelope = _envelope.api  # the fixture: (orchestrator, app) over fake chains, keys alice and bob


def _with_sdk(envelope, fn, max_retries: int = 0, base_url: str = "http://orch/v1"):
    """``fn(orch, client)`` with an ``AsyncOpenAI`` (no retries unless asked) over the app, one chain up."""
    orch, app = envelope

    async def main():
        orch.dispatch.set_chains([_chain(2)])
        # a bug's exception reaches the transport after its 500 went out (Starlette re-raises it): the reply is kept
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app, raise_app_exceptions=False),
                                  base_url="http://orch", timeout=60)
        async with openai.AsyncOpenAI(base_url=base_url, api_key=KEYS["bob"], http_client=http,
                                      max_retries=max_retries) as client:
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
    """``client.moderations.create`` and ``client.images.generate`` got a bare "Not Found", which reads as a wrong
    base_url or model: the error now names the URL asked for and the endpoints served (``/v1/embeddings`` is served
    since session 37)."""
    async def fn(orch, client):
        out = {}
        for name, call in (("moderations", client.moderations.create(model=orch.model_id, input="hi")),
                           ("images", client.images.generate(model=orch.model_id, prompt="hi"))):
            with pytest.raises(openai.NotFoundError) as e:
                await call
            out[name] = (e.value.code, e.value.body["message"])
        return out

    out = _with_sdk(envelope, fn)
    assert out["moderations"][0] == out["images"][0] == "not_found"
    assert out["moderations"][1].startswith("Invalid URL (POST /v1/moderations)")
    assert out["images"][1].startswith("Invalid URL (POST /v1/images/generations)")
    assert "POST /v1/chat/completions" in out["moderations"][1] and "POST /v1/embeddings" in out["moderations"][1]


def test_values_openai_packages_type_for_no_effect_here_are_taken():
    """``prompt_cache_retention: "in-memory"`` (what the openai packages typed until they followed the API's
    ``in_memory``) and ``reasoning_effort: "none"`` (no reasoning: what every reply here is) were 400s, for a cache
    hint and an "off" value; an effort that asks for reasoning is still refused, naming it."""
    from petals_chain.orchestrator.api import ChatRequest

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for field, value in (("prompt_cache_retention", "in-memory"), ("prompt_cache_retention", "in_memory"),
                         ("reasoning_effort", "none")):
        assert getattr(ChatRequest.model_validate({**base, field: value}), field) == value
    with pytest.raises(pydantic.ValidationError, match="reasoning_effort is not supported"):
        ChatRequest.model_validate({**base, "reasoning_effort": "low"})


def test_an_image_part_is_refused_for_itself_alone(envelope):
    """An image part (an openai package user's vision message) was refused as "messages.0.content: Input should be
    a valid string; messages.0.content.0: only text content parts are supported, not "image_url"": the first clause
    pydantic's try of the union's other member. Now the part alone, named in ``param`` too; content that is neither a
    string nor an array says it should be one of them, without the union's tags."""
    async def fn(orch, client):
        image = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                              {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        return (await _refusal(client.chat.completions.create(model=orch.model_id, messages=image)),
                await _refusal(client.chat.completions.create(model=orch.model_id,
                                                              messages=[{"role": "user", "content": None}])))

    image, null = _with_sdk(envelope, fn)
    assert image[:2] == ("messages.0.content.1", "invalid_value"), image
    assert image[2].endswith(' - invalid request: messages.0.content.1: only text content parts are supported, '
                             'not "image_url"'), image  # nothing else: the SDK puts "Error code: 400" ahead
    assert null[0] == "messages.0.content" and "valid string" not in null[2], null
    assert null[2].endswith("content is required (null only in an assistant message with tool_calls)"), null


def test_a_bug_is_not_sent_again_by_the_openai_package(envelope, monkeypatch):
    """A bug's 500 came without ``x-should-retry: false``, so the openai package sent the request 3 times (its
    default ``max_retries=2``, 0.5-8 s apart) for the same error. Now it is answered once; a host's OSError (out of
    file descriptors, a connection), which may pass, is left to the client's retries."""
    calls = []

    def broken(exc):
        def encode_chat(messages):
            calls.append(type(exc).__name__)
            raise exc
        return encode_chat

    async def fn(orch, client):
        out = {}
        for exc, retries in ((KeyError("bug"), 2), (OSError(24, "Too many open files"), 0)):
            monkeypatch.setattr(orch, "encode_chat", broken(exc))
            with pytest.raises(openai.InternalServerError) as e:
                await client.with_options(max_retries=retries).chat.completions.create(
                    model=orch.model_id, messages=[{"role": "user", "content": "hi"}])
            out[type(exc).__name__] = e.value.response.headers.get("x-should-retry"), e.value.code
        return out

    out = _with_sdk(envelope, fn)
    assert calls == ["KeyError", "OSError"], calls  # the bug's request sent once, not 3 times
    assert out == {"KeyError": ("false", "internal_error"), "OSError": (None, "internal_error")}, out


def test_a_base_url_without_v1_is_told_so(envelope):
    """``AsyncOpenAI(base_url="http://host:8000")`` (no ``/v1``: the commonest setup mistake) got a bare "Not
    Found" for every call; now the 404 says the API is under /v1."""
    async def fn(orch, client):
        out = []
        for call in (client.chat.completions.create(model=orch.model_id, messages=[{"role": "user", "content": "hi"}]),
                     client.completions.create(model=orch.model_id, prompt="hi"), client.models.list()):
            with pytest.raises(openai.NotFoundError) as e:
                await call
            out.append(e.value.body["message"])
        return out

    chat, completions, models = _with_sdk(envelope, fn, base_url="http://orch")
    assert chat.startswith("Invalid URL (POST /chat/completions): this server's OpenAI API is under /v1 "
                           "(POST /v1/chat/completions)"), chat
    assert completions.startswith("Invalid URL (POST /completions)") and "(POST /v1/completions)" in completions
    assert models.startswith("Invalid URL (GET /models)") and "(GET /v1/models)" in models, models
