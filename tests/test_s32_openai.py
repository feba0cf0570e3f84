"""The official ``openai`` package against the API: what it parses out of our replies, which of our refusals it
retries (it retries every 429 and 5xx unless ``x-should-retry: false``), and the OpenAI fields it sends."""

from __future__ import annotations

import asyncio
import json
import typing

import httpx
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.api import create_app
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport of the openai package installed here

KEY = "k" * 24


def _with_openai(model_path, tmp_path, fn, **cfg_kwargs):
    """``fn(orch, client, requests)`` with an ``AsyncOpenAI`` (default retries) over an in-process orchestrator (no
    servers) whose one key may use 50 tokens a minute; ``requests``: the HTTP requests the client sent."""
    keys = tmp_path / "keys"
    keys.write_text(f"alice {KEY} tokens_per_minute=50\n")
    keys.chmod(0o600)

    async def main():
        orch = Orchestrator(OrchestratorConfig(model=str(model_path), max_length=64, port=0, api_keys=str(keys),
                                               **cfg_kwargs))
        orch.load_model()
        await orch.start()
        try:
            requests: list[str] = []

            async def count(request):
                requests.append(request.url.path)

            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(orch)), base_url="http://orch",
                                      event_hooks={"request": [count]})
            async with openai.AsyncOpenAI(base_url="http://orch/v1", api_key=KEY, http_client=http) as client:
                return await fn(orch, client, requests)
        finally:
            await orch.stop()

    return asyncio.run(main())


def test_the_openai_package_does_not_retry_a_refusal_a_retry_cannot_cure(tiny_model_dir, tmp_path):
    """More tokens than the key's budget per minute (a 429 however idle the swarm) was sent three times by the openai
    package (its default two retries, ~1.5 s of backoff): the 429 had no Retry-After, but the package retries every
    429 and 5xx unless told ``x-should-retry: false``. A 504 for a deadline that passed while the request waited (for
    a chain, behind a burst) is the swarm's state then, not the request's: sent again, it is served once a chain is
    free, so it is left to the client's retries (here one: ``max_retries=1``), as a timeout is."""
    async def fn(orch, client, requests):
        out = {}
        for name, kw in (("budget", {"max_tokens": 60}), ("budget streamed", {"max_tokens": 60, "stream": True}),
                         ("deadline", {"max_tokens": 2, "extra_body": {"deadline_ms": 300}}),
                         ("deadline streamed", {"max_tokens": 2, "stream": True, "extra_body": {"deadline_ms": 300}})):
            requests.clear()
            with pytest.raises(openai.APIStatusError) as e:
                retries = client.with_options(max_retries=1) if name.startswith("deadline") else client
                await retries.completions.create(model=orch.model_id, prompt="hi", **kw)
            out[name] = (type(e.value), e.value.status_code, e.value.code, len(requests),
                         e.value.response.headers.get("x-should-retry"))
        return out

    out = _with_openai(tiny_model_dir, tmp_path, fn, no_chain_wait_s=30.0)
    assert out == {"budget": (openai.RateLimitError, 429, "tokens_per_minute", 1, "false"),
                   "budget streamed": (openai.RateLimitError, 429, "tokens_per_minute", 1, "false"),
                   "deadline": (openai.InternalServerError, 504, "deadline_exceeded", 2, None),
                   # held back by the limits middleware, which answers it (no chain ever came)
                   "deadline streamed": (openai.InternalServerError, 504, "deadline_exceeded", 2, None)}


# ---- a real swarm --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def swarm(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory("llama", num_layers=4)
    with LocalSwarm(path, [LocalServer("a", memory_for(path, 128, 4, 8), tau_p=0.001)], max_length=128,
                    arrival_rate=1.0, log_dir=tmp_path_factory.mktemp("logs")) as sw:
        sw.wait_ready(timeout=150)
        yield sw


def _type_errors(parsed, raw, where="") -> list[str]:
    """Where the openai package's parse of ``raw`` (its ``model_dump()``) lost a field or holds another value."""
    if isinstance(raw, dict):
        if not isinstance(parsed, dict):
            return [f"{where}: {type(parsed).__name__}, sent an object"]
        return [e for k, v in raw.items()
                for e in ([f"{where}.{k}: dropped"] if k not in parsed else _type_errors(parsed[k], v, f"{where}.{k}"))]
    if isinstance(raw, list):
        if not isinstance(parsed, list) or len(parsed) != len(raw):
            return [f"{where}: {parsed!r}, sent {raw!r}"]
        return [e for i, (p, r) in enumerate(zip(parsed, raw)) for e in _type_errors(p, r, f"{where}[{i}]")]
    return [] if type(parsed) is type(raw) and parsed == raw else [f"{where}: {parsed!r}, sent {raw!r}"]


def _finish_reasons(model: type) -> tuple:
    """The ``finish_reason`` values the openai package's type admits."""
    annotation = model.model_fields["finish_reason"].annotation
    return tuple(a for arg in (typing.get_args(annotation) or (annotation,)) for a in typing.get_args(arg) or (arg,))


def test_the_openai_package_parses_every_reply_of_a_real_swarm(swarm):
    """Each reply, streamed or not, with n > 1, logprobs, echo, stop, seed, user and logit_bias, parses into the
    package's types without a field lost or changed. Two fields the package types that we do as asked were refused
    as unsupported: ``stream_options.include_obfuscation: false`` (no padding in the events) and chat's
    ``safety_identifier`` (informational, as ``user``). A deadline an idle swarm misses was sent three times."""
    from openai.types import Completion, CompletionChoice
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion import Choice

    oa = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key="none")
    models = oa.models.list()
    model = models.data[0].id
    assert oa.models.retrieve(model).id == model and isinstance(models.data[0].created, int)
    bodies = {
        "completions": {"prompt": "hello there", "max_tokens": 4, "n": 2, "logprobs": 2, "echo": True,
                        "stop": ["zz"], "seed": 3, "user": "u1", "logit_bias": {"5": 1}},
        "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
                             "logprobs": True, "top_logprobs": 2, "stop": "zz", "seed": 1, "user": "u1",
                             "safety_identifier": "u1", "logit_bias": {"5": 2}},
    }
    for path, body in bodies.items():
        chat = path == "chat/completions"
        resource = oa.chat.completions if chat else oa.completions
        allowed = _finish_reasons(Choice if chat else CompletionChoice)
        reply = resource.with_raw_response.create(model=model, **body)
        parsed = reply.parse()
        assert _type_errors(parsed.model_dump(), json.loads(reply.http_response.text)) == []
        assert {c.finish_reason for c in parsed.choices} <= set(allowed) and len(parsed.choices) == 2
        assert isinstance(parsed.id, str) and isinstance(parsed.created, int)
        if chat:
            assert all(isinstance(t.bytes, list) for c in parsed.choices for e in c.logprobs.content
                       for t in e.top_logprobs)
        # a stream's events as sent, and as the package parses those very bytes
        sent = {"model": model, **body, "stream": True, "stream_options": {"include_usage": True}}
        raw = httpx.post(f"{swarm.url}/v1/{path}", json=sent, timeout=60)
        events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
        response = httpx2.Response(200, content=raw.content, request=httpx2.Request("POST", f"{swarm.url}/v1/{path}"))
        chunks = list(openai.Stream(cast_to=ChatCompletionChunk if chat else Completion, response=response,
                                    client=oa))
        assert len(chunks) == len(events) > 4
        assert [e for c, event in zip(chunks, events) for e in _type_errors(c.model_dump(), event)] == []
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens > 0
        assert {c.choices[0].finish_reason for c in chunks[:-1]} <= {None, *allowed}
        # the package's own stream, with the stream option it types that we do as asked (no padding)
        streamed = list(resource.create(model=model, **body, stream=True,
                                        stream_options={"include_usage": True, "include_obfuscation": False}))
        assert streamed[-1].choices == [] and streamed[-1].usage.prompt_tokens == usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="include_obfuscation"):
        oa.completions.create(model=model, prompt="hi", max_tokens=1, stream=True,
                              stream_options={"include_obfuscation": True})
    requests = []
    counted = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key="none",
                            http_client=httpx2.Client(event_hooks={"request": [requests.append]}))
    with pytest.raises(openai.RateLimitError) as e:  # 100 tokens in 50 ms: no swarm does that
        counted.completions.create(model=model, prompt="hi", max_tokens=100, extra_body={"deadline_ms": 50})
    assert e.value.code == "deadline_infeasible" and len(requests) == 1
