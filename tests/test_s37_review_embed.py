"""Review of ``/v1/embeddings`` and ``/tokenize`` (session 37): defects found, each shown failing before its fix.
Over the real API, limits and dispatcher on fake chains whose hops return their input (test_s37_embeddings.py's
fixture: the tiny Llama's head, API keys)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

import test_s37_embeddings as embeddings_tests
from test_s37_embeddings import expected, run

api = embeddings_tests.api  # its module-scoped fixture (an orchestrator over fake chains), one for this module

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_tokenize_messages_without_a_chat_template_are_the_tokens_chat_completions_feed(api):
    """A tokenizer without a chat template: chat completions feed the plain rendering tokenized with its special
    tokens (the BOS), and ``/tokenize`` of the same messages left them out by default (one token short, the first
    one wrong). Now the default is what chat completions do; ``add_special_tokens: false`` still leaves them out."""
    orch = api[0]
    tok = orch.tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        async def fn(orch, c):
            out = {"tokenize": await c.post("/tokenize", json={"messages": MSGS}),
                   "bare": await c.post("/tokenize", json={"messages": MSGS, "add_special_tokens": False}),
                   "chat": await c.post("/v1/chat/completions", json={"model": orch.model_id, "messages": MSGS,
                                                                      "max_tokens": 1})}
            return {k: (r.status_code, r.json()) for k, r in out.items()}

        out = run(api, fn)
        fed = orch.encode_chat(MSGS)
    finally:
        tok.chat_template = saved
    assert out["chat"][0] == out["tokenize"][0] == 200, out
    assert fed[0] == tok.bos_token_id  # what this tokenizer adds: the case at hand
    assert out["tokenize"][1]["tokens"] == fed
    assert out["tokenize"][1]["count"] == out["chat"][1]["usage"]["prompt_tokens"] == len(fed)
    assert out["bare"][1]["tokens"] == fed[1:]


def test_a_float_answer_is_encoded_while_the_event_loop_runs(api, monkeypatch):
    """2048 inputs as floats are millions of numbers: the answer was encoded on the event loop (FastAPI's
    jsonable_encoder, then one json.dumps: seconds at SmolLM2's 576 dimensions, every stream's relay held with it).
    Now it is encoded in a worker thread, a vector at a time: the event loop runs a callback while a vector is being
    encoded (it could not, and the encoding waited 5 s in vain for it). The answer is the same."""
    from petals_chain.orchestrator import embeddings

    real = embeddings.encoded
    waited: list[bool] = []

    async def fn(orch, c):
        loop = asyncio.get_running_loop()

        def encoded(vector, encoding_format):
            if not waited:  # the first vector waits for a callback of the event loop
                ran = threading.Event()
                loop.call_soon_threadsafe(ran.set)
                waited.append(ran.wait(5))
            return real(vector, encoding_format)

        monkeypatch.setattr(embeddings, "encoded", encoded)
        return await c.post("/v1/embeddings", json={"model": orch.model_id, "input": [[5, 6], [7], [8, 9, 10]],
                                                    "deadline_ms": 60000})

    r = run(api, fn)
    assert waited == [True]
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    body = r.json()
    assert list(body) == ["object", "model", "data", "usage", "petals_chain", "deadline"]
    assert body["object"] == "list" and body["model"] == api[0].model_id and body["deadline"]["outcome"] == "met"
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6} and len(body["petals_chain"]) == 3
    for i, (ids, d) in enumerate(zip([[5, 6], [7], [8, 9, 10]], body["data"])):
        assert d["object"] == "embedding" and d["index"] == i
        assert np.allclose(d["embedding"], expected(api[0], ids), atol=1e-5)


def test_a_swarm_that_never_holds_max_choices_jobs_at_once_runs_the_inputs_in_fewer(api):
    """One chain of one slot and ``--max-queue 4`` (its client-fair queue keeps places: one client holds at most 3):
    the request's window was ``--max-choices`` (8) whatever the swarm could hold, so every request of 5 inputs or more
    was refused for ever, 429 ``exceeds_capacity`` "this request's 8 completions (prompts x n) ...: ask for fewer"
    (the client sent 12 inputs, not 8 completions, and the window is the orchestrator's choice). Now the window is
    what the swarm admits (4 here): every input is embedded, each in its order."""
    from test_s33_api_envelope import _chain

    async def fn(orch, c):
        orch.dispatch.set_chains([_chain(1)])
        bound, orch.dispatch.max_queue = orch.dispatch.max_queue, 4
        try:
            return await c.post("/v1/embeddings", json={"model": orch.model_id, "input": [[i + 5] for i in range(12)]})
        finally:
            orch.dispatch.max_queue = bound

    r = run(api, fn)
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == list(range(12))
    for i, d in enumerate(r.json()["data"]):
        assert np.allclose(d["embedding"], expected(api[0], [i + 5]), atol=1e-5)


def test_most_jobs_admissible_is_the_slots_and_the_queue_bound():
    """Without a client-fair queue: the chains' slots plus ``--max-queue``; no chain yet or no bound: None."""
    from test_s33_api_envelope import _chain

    from petals_chain.orchestrator.dispatch import DispatchManager

    bounded, unbounded = DispatchManager(max_queue=4), DispatchManager()
    assert bounded.most_jobs_admissible() is None
    bounded.set_chains([_chain(1), _chain(2)])
    unbounded.set_chains([_chain(1)])
    assert bounded.most_jobs_admissible() == 3 + 4 and unbounded.most_jobs_admissible() is None
