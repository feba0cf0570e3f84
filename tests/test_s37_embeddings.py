"""``POST /v1/embeddings``, ``POST /tokenize`` and ``POST /detokenize`` over the real API, limits and dispatcher, in
this process over fake chains whose hops return their input (so an input's embedding is its last token's embedding,
through the final norm, L2-normalized). The real swarm (server processes, transformers' reference, SmolLM2): in
test_s37_embeddings_swarm.py."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch

import test_s33_api_envelope as envelope
from test_s33_api_envelope import FakeChainSession, _chain

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport of the openai package installed here

KEYS = envelope.KEYS


class CountingSession(FakeChainSession):
    """A fake chain session that counts opens, closes and the steps inside at once; with ``gate`` set, a step
    waits until ``gate`` steps are inside together (or 30 s: a failure then, not a hang)."""

    opened = closed = inside = peak = 0
    gate = 0
    event: asyncio.Event | None = None

    async def open(self, fork_from=None, fork_length=0, named=b""):
        CountingSession.opened += 1

    async def close(self, named=b""):
        CountingSession.closed += 1

    async def step(self, i, x, position):
        cls = CountingSession
        cls.inside += 1
        cls.peak = max(cls.peak, cls.inside)
        try:
            if cls.gate:
                if cls.inside >= cls.gate:
                    cls.event.set()
                await asyncio.wait_for(cls.event.wait(), 30)
            await asyncio.sleep(0)  # a step is never instantaneous: the others get in meanwhile
            return x.clone()
        finally:
            cls.inside -= 1

    @classmethod
    def reset(cls, gate: int = 0) -> None:
        cls.opened = cls.closed = cls.inside = cls.peak = 0
        cls.gate, cls.event = gate, asyncio.Event()


@pytest.fixture(scope="module")
def api(tiny_model_factory, tmp_path_factory):
    """(orchestrator, app) over fake chains (:class:`CountingSession`), keys alice (tokens_per_minute=40) and bob."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"alice {KEYS['alice']} tokens_per_minute=40\nbob {KEYS['bob']}\n")
    keys.chmod(0o600)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(failover, "ChainSession", CountingSession)
        orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=32,
                                               port=0, api_keys=str(keys), no_chain_wait_s=0.2))
        orch.load_model()
        orch.batcher = HeadBatcher(orch.head)
        try:
            yield orch, create_app(orch)
        finally:
            orch.batcher.close()


def run(api, fn, gate: int = 0):
    """``fn(orch, client)`` in a fresh event loop, one chain of 8 slots up, the counts reset."""
    orch, app = api

    async def main():
        CountingSession.reset(gate)
        orch.dispatch.set_chains([_chain(8)])
        async with envelope._client(app) as c:
            c.headers["Authorization"] = f"Bearer {KEYS['bob']}"
            return await fn(orch, c)

    return asyncio.run(main())


def expected(orch, ids: list[int]) -> np.ndarray:
    """What the identity chain's embedding of ``ids`` is: the last token's embedding, final norm, unit length."""
    with torch.no_grad():
        h = orch.head.norm(orch.head.embed(torch.tensor([[ids[-1]]]))[0, 0]).float()
    return torch.nn.functional.normalize(h, dim=-1).numpy()


def test_embeddings_in_every_input_shape_float_and_base64(api):
    """A string, a list of strings, token ids and lists of token ids: one embedding per input, in order, each the
    pooled last hidden state (unit length); base64 is the same floats (little-endian float32); usage counts the
    inputs' tokens; every server session the request opened is closed when it answers (no KV held)."""
    async def fn(orch, c):
        m = orch.model_id
        out = {}
        for name, body in (("text", {"input": "hello world"}),
                           ("texts", {"input": ["hello", "a b c", "world"], "encoding_format": "float"}),
                           ("ids", {"input": [5, 6, 7]}),
                           ("lists", {"input": [[5, 6, 7], [9], [7, 8, 10, 11]], "user": "u-1"}),
                           ("b64", {"input": [[5, 6, 7], [9], [7, 8, 10, 11]], "encoding_format": "base64"})):
            r = await c.post("/v1/embeddings", json={"model": m, **body})
            assert r.status_code == 200, (name, r.text)
            out[name] = r.json()
        return out, CountingSession.opened, CountingSession.closed

    out, opened, closed = run(api, fn)
    orch = api[0]
    for name, body in out.items():
        assert body["object"] == "list" and body["model"] == orch.model_id
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        assert all(d["object"] == "embedding" for d in body["data"])
    texts = ["hello", "a b c", "world"]
    text_ids = [orch.encode(t) for t in texts]
    assert out["texts"]["usage"] == {"prompt_tokens": sum(map(len, text_ids)), "total_tokens": sum(map(len, text_ids))}
    for ids, d in zip(text_ids, out["texts"]["data"]):
        assert np.allclose(d["embedding"], expected(orch, ids), atol=1e-5)
    assert np.allclose(out["text"]["data"][0]["embedding"], expected(orch, orch.encode("hello world")), atol=1e-5)
    assert np.allclose(out["ids"]["data"][0]["embedding"], expected(orch, [5, 6, 7]), atol=1e-5)
    lists = [[5, 6, 7], [9], [7, 8, 10, 11]]
    assert out["lists"]["usage"]["prompt_tokens"] == 8
    for ids, d, b in zip(lists, out["lists"]["data"], out["b64"]["data"]):
        assert len(d["embedding"]) == orch.config.hidden_size
        assert abs(np.linalg.norm(d["embedding"]) - 1) < 1e-5
        assert np.allclose(d["embedding"], expected(orch, ids), atol=1e-5)
        assert np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4").tolist() == d["embedding"]
    assert [len(e["chain"]) for e in out["lists"]["petals_chain"]] == [1, 1, 1]
    assert opened == closed == 1 + 3 + 1 + 3 + 3  # one job per input, each closed


def test_the_openai_package_embeds_with_its_default_base64_and_floats(api):
    """``client.embeddings.create`` sends ``encoding_format: "base64"`` unless told otherwise and decodes it itself:
    its vectors equal the floats asked for, and its usage is the inputs' tokens."""
    async def fn(orch, c):
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=api[1]), base_url="http://orch")
        sent = []

        async def record(request):
            sent.append(request.content)
        http.event_hooks["request"].append(record)
        async with openai.AsyncOpenAI(base_url="http://orch/v1", api_key=KEYS["bob"], http_client=http,
                                      max_retries=0) as client:
            plain = await client.embeddings.create(model=orch.model_id, input=["one", "two three"])
            floats = await client.embeddings.create(model=orch.model_id, input=["one", "two three"],
                                                    encoding_format="float")
            ids = await client.embeddings.create(model=orch.model_id, input=[[5, 6], [7]], dimensions=64)
            with pytest.raises(openai.BadRequestError) as e:
                await client.embeddings.create(model=orch.model_id, input="x", dimensions=16)
        return plain, floats, ids, e.value, sent

    plain, floats, ids, refused, sent = run(api, fn)
    assert b'"encoding_format":"base64"' in sent[0].replace(b" ", b"") and b"float" in sent[1]
    assert [d.embedding for d in plain.data] == [d.embedding for d in floats.data]
    assert all(isinstance(x, float) for x in plain.data[0].embedding) and len(plain.data[0].embedding) == 64
    assert plain.usage.prompt_tokens == plain.usage.total_tokens > 2
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 3  # dimensions equal to the model's: taken
    assert refused.param == "dimensions" and "64 dimensions" in refused.message


def test_several_inputs_run_as_concurrent_jobs_at_most_max_choices_at_once(api):
    """The inputs of one request are jobs running at once, not one after another: three inputs are all in a step
    together (the fake chain lets no step through until three are). Ten inputs with ``--max-choices`` 4 run at
    most four at a time, each its own job, and come back in their order."""
    orch = api[0]

    async def fn(orch, c):
        three = await c.post("/v1/embeddings", json={"model": orch.model_id, "input": [[5], [6], [7]]})
        peak_three = CountingSession.peak
        CountingSession.reset(4)
        orch.cfg.max_n = 4
        try:
            ten = await c.post("/v1/embeddings", json={"model": orch.model_id,
                                                       "input": [[i + 5] for i in range(10)]})
        finally:
            orch.cfg.max_n = 8
        return three, peak_three, ten, CountingSession.peak, CountingSession.opened

    three, peak_three, ten, peak_ten, opened_ten = run(api, fn, gate=3)
    assert three.status_code == 200, three.text
    assert peak_three == 3
    assert ten.status_code == 200, ten.text
    assert peak_ten == 4 and opened_ten == 10
    for i, d in enumerate(ten.json()["data"]):
        assert np.allclose(d["embedding"], expected(orch, [i + 5]), atol=1e-5)


def test_bad_input_is_a_400_naming_its_parameter(api):
    """Every refusal names its field in ``param``; nothing reaches the swarm."""
    def big(n):
        return [[5]] * n

    cases = {
        "empty list": ({"input": []}, 400, "input"), "empty text": ({"input": ""}, 400, "input"),
        "an empty one": ({"input": ["a", ""]}, 400, "input"), "empty ids": ({"input": [[5], []]}, 400, "input"),
        "a number": ({"input": 5}, 400, "input"), "a mix": ({"input": [[5], "a"]}, 400, "input"),
        "a bool id": ({"input": [True]}, 400, "input.0"), "a string id": ({"input": [[5, "6"]]}, 400, "input.0.1"),
        "too many": ({"input": big(2049)}, 400, "input"),
        "past the context": ({"input": [5] * 33}, 400, "input"),
        "past the vocabulary": ({"input": [[5], [10**6]]}, 400, "input.1"),
        "dimensions": ({"input": "x", "dimensions": 3}, 400, "dimensions"),
        "format": ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        "unknown field": ({"input": "x", "truncate": 3}, 400, "truncate"),
        "model": ({"input": "x", "model": "other"}, 404, "model"),
        "no input": ({"input": None}, 400, "input"),
    }

    async def fn(orch, c):
        out = {}
        for name, (body, _, _) in cases.items():
            r = await c.post("/v1/embeddings", json={"model": orch.model_id, **body})
            out[name] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"])
        return out, CountingSession.opened

    out, opened = run(api, fn)
    assert {k: v[:2] for k, v in out.items()} == {k: v[1:] for k, v in cases.items()}, out
    assert "at most 2048 inputs" in out["too many"][2]
    assert "maximum context length is 32 tokens" in out["past the context"][2]
    assert out["past the vocabulary"][2].startswith("token id 1000000 is outside the vocabulary")
    assert opened == 0


def test_keys_token_budget_fair_share_deadline_and_metrics_apply(api):
    """An embeddings request is a request like any other: no key is a 401 (``/tokenize`` and ``/detokenize`` too),
    its tokens count against its key's tokens per minute (more than the budget: 429 saying so, never retried; the
    rest of the budget: used up by what ran), they are its client's input service for fair sharing, its steps are
    sampled for audits, a deadline is reported, and ``/metrics`` counts it by endpoint."""
    orch = api[0]

    async def fn(orch, c):
        m = orch.model_id
        out = {"service0": orch.shares.policy.service.get("bob", 0.0)}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api[1]), base_url="http://x") as anon:
            for path, body in (("/v1/embeddings", {"model": m, "input": "x"}), ("/tokenize", {"prompt": "x"}),
                               ("/detokenize", {"tokens": [5]})):
                out[path] = (await anon.post(path, json=body)).status_code
        sampled, rate = orch.auditor.counts["sampled"], orch.auditor.rate
        orch.auditor.rate = 1.0  # --audit-rate 1: every hop step
        try:
            out["bob"] = await c.post("/v1/embeddings", json={"model": m, "input": [[5] * 10, [6] * 7],
                                                              "deadline_ms": 60000})
        finally:
            orch.auditor.rate = rate
        out["audited"] = orch.auditor.counts["sampled"] - sampled
        out["service1"] = orch.shares.policy.service.get("bob", 0.0)
        alice = {"Authorization": f"Bearer {KEYS['alice']}"}
        out["over"] = await c.post("/v1/embeddings", json={"model": m, "input": [[5] * 30, [6] * 11]}, headers=alice)
        out["first"] = await c.post("/v1/embeddings", json={"model": m, "input": [[5] * 30]}, headers=alice)
        out["second"] = await c.post("/v1/embeddings", json={"model": m, "input": [[5] * 11]}, headers=alice)
        out["metrics"] = (await c.get("/metrics")).text
        return out

    out = run(api, fn)
    assert out["/v1/embeddings"] == out["/tokenize"] == out["/detokenize"] == 401
    assert out["bob"].status_code == 200, out["bob"].text
    assert out["bob"].json()["deadline"]["outcome"] == "met"
    assert out["audited"] == 2  # each input's prefill step, sampled for an audit as any step is
    assert out["service1"] - out["service0"] == pytest.approx(17 * orch.cfg.fairness_w_e)
    over = out["over"]
    assert over.status_code == 429 and over.json()["error"]["code"] == "tokens_per_minute"
    assert "41 tokens (its inputs)" in over.json()["error"]["message"] and over.headers["x-should-retry"] == "false"
    assert out["first"].status_code == 200
    assert out["second"].status_code == 429 and "30 of its 40" in out["second"].json()["error"]["message"]
    samples = envelope._samples(out["metrics"], "petals_chain_endpoint_requests_total")
    assert samples[("/v1/embeddings", "completed")] >= 2 and samples[("/v1/embeddings", "refused")] >= 2
    assert samples[("/tokenize", "invalid")] >= 1  # the 401 (no client to count it for elsewhere)
    api_requests = envelope._samples(out["metrics"], "petals_chain_api_requests_total")
    assert api_requests[("alice", "completed")] >= 1 and api_requests[("alice", "refused")] >= 2


def test_tokenize_and_detokenize(api):
    """vLLM's shapes: a prompt (special tokens added unless told not to) or messages in the chat template (with the
    assistant's turn opened unless told not to: the tokens a chat completion is fed), ``count`` and
    ``max_model_len``; ``/detokenize`` gives the text back. Bad input is a 400 naming its field."""
    async def fn(orch, c):
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
        out = {
            "prompt": await c.post("/tokenize", json={"prompt": "hello world"}),
            "bare": await c.post("/tokenize", json={"model": orch.model_id, "prompt": "hello world",
                                                    "add_special_tokens": False, "return_token_strs": True}),
            "chat": await c.post("/tokenize", json={"messages": msgs}),
            "no turn": await c.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}),
            "continued": await c.post("/tokenize", json={"messages": msgs + [{"role": "assistant",
                                                                             "content": "Hel"}],
                                                         "continue_final_message": True}),
        }
        out["back"] = await c.post("/detokenize", json={"tokens": out["bare"].json()["tokens"]})
        bad = {"both": {"prompt": "x", "messages": msgs}, "neither": {}, "model": {"model": "zz", "prompt": "x"},
               "turn on a prompt": {"prompt": "x", "add_generation_prompt": False},
               "tool": {"messages": [{"role": "tool", "content": "1", "tool_call_id": "c"}]},
               "continue a user": {"messages": msgs, "continue_final_message": True},
               "surrogate": '{"prompt": "a\\ud800"}'}  # JSON's escape of a lone surrogate (no UTF-8 has one)
        refused = {}
        for name, body in bad.items():
            r = await (c.post("/tokenize", json=body) if isinstance(body, dict) else
                       c.post("/tokenize", content=body, headers={"content-type": "application/json"}))
            refused[name] = (r.status_code, r.json()["error"]["param"])
        for name, tokens in (("negative", [-1]), ("past", [10**6]), ("text", ["a"])):
            r = await c.post("/detokenize", json={"tokens": tokens})
            refused[name] = (r.status_code, r.json()["error"]["param"])
        return msgs, {k: v.json() for k, v in out.items()}, refused

    msgs, out, refused = run(api, fn)
    orch = api[0]
    assert out["prompt"] == {"count": len(orch.encode("hello world")), "max_model_len": 32,
                             "tokens": orch.encode("hello world"), "token_strs": None}
    bare = orch.encode("hello world", add_special_tokens=False)
    assert out["bare"]["tokens"] == bare and out["bare"]["token_strs"] == orch.tokenizer.convert_ids_to_tokens(bare)
    assert out["back"] == {"prompt": "hello world"}
    assert out["chat"]["tokens"] == orch.encode_chat(msgs)  # what /v1/chat/completions feeds the chain
    assert out["no turn"]["count"] < out["chat"]["count"]
    assert out["no turn"]["tokens"] == out["chat"]["tokens"][:out["no turn"]["count"]]
    assert orch.tokenizer.decode(out["continued"]["tokens"]).endswith("Hel")
    assert refused == {"both": (400, "prompt"), "neither": (400, "prompt"), "model": (404, "model"),
                       "turn on a prompt": (400, "add_generation_prompt"), "tool": (400, "messages.0"),
                       "continue a user": (400, "continue_final_message"), "surrogate": (400, "prompt"),
                       "negative": (400, "tokens"), "past": (400, "tokens"), "text": (400, "tokens.0")}


def test_several_models_route_each_endpoint_by_its_model_field():
    """Behind one orchestrator serving several models, ``/v1/embeddings``, ``/tokenize`` and ``/detokenize`` go to
    the model their body names (any of its names; the first model without one), an unknown model is a 404 naming
    the models served, as for the other endpoints."""
    from test_model_router import orch as stand_in_orch, stand_in

    from petals_chain.orchestrator.models import ModelRouter

    seen: list = []
    router = ModelRouter({"chat": stand_in("chat", seen), "code": stand_in("code", seen)},
                         {"chat": stand_in_orch("chat", "Tiny-Chat"), "code": stand_in_orch("code", "Tiny-Code")})

    async def main():
        out = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x",
                                     headers={"Authorization": "Bearer k"}) as c:
            for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
                for model in ("code", "Tiny-Code", "chat", None, "gpt-4"):
                    r = await c.post(path, json={} if model is None else {"model": model})
                    out[path, model] = r.json().get("served_by") or r.json()["error"]["code"]
        return out

    out = asyncio.run(main())
    for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
        assert [out[path, m] for m in ("code", "Tiny-Code", "chat", None, "gpt-4")] == \
            ["code", "code", "chat", "chat", "model_not_found"], path
