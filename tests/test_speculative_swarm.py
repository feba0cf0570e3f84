"""Speculative decoding and push relay through a real chain (server processes over hivemind P2P): greedy output
with ``ngram`` or draft-model drafts, relayed by the orchestrator or pushed from server to server (``relay:
push``), equals plain relaying and transformers; drafts are both kept and rejected (the servers' KV rolled back);
a push without the session's token is refused; a server killed mid-generation fails over without changing a
token; the counters (drafts, passes, critical legs) reach the API. 3-hop push chains, the middle hop forwarding
the route, run on the real model (test_real_model.py)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from conftest import hf_greedy_from
from petals_chain.orchestrator.sampling import SamplingParams
from petals_chain.swarm.local import memory_for

MAX_LENGTH = 128
NEW = 48
# A tiny model with small weights (initializer range 0.05): its greedy continuations fall into repetitive spans,
# prompt lookup's case, so that about half of the drafts are kept and half are not (measured offline: 19-25 of
# 30-46 drafts for random 10-token prompts).
INIT_RANGE = 0.05
PROMPTS = [torch.randint(3, 700, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in (0, 1)]


def _params(mode: str, n: int = NEW, relay: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=mode, relay=relay)


@pytest.fixture(scope="module")
def swarm(tiny_model_factory, tmp_path_factory):
    from inprocess import InProcessSwarm

    model_path = tiny_model_factory("llama", 4, initializer_range=INIT_RANGE)
    # the draft model: the served model's first 3 of 4 layers (self-speculative; measured offline: its greedy
    # choice is the full model's about half of the time on these prompts)
    sw = InProcessSwarm(model_path, tmp_path_factory.mktemp("spec"), max_length=MAX_LENGTH, arrival_rate=1.0,
                        speculative="none", draft_model="self", draft_layers=3)
    try:
        sw.start()
        mem = memory_for(model_path, MAX_LENGTH, 2, 4)
        for name in "abcd":  # at most 2 blocks each: two 2-hop chains, each hop replaceable by the other chain's
            sw.add_server(name, mem, "--max-blocks", "2")
        sw.wait_until(lambda st: st["ready"] and len(st["chains"]) == 2
                      and all(s["state"] == "online" for s in st["servers"]), 240, "two 2-hop chains")
        yield sw
    finally:
        sw.stop()


def test_ngram_greedy_equals_plain_and_transformers(swarm):
    before = swarm.state()["relay"]["speculative"]
    for prompt in PROMPTS:
        want = hf_greedy_from(swarm.model_path, prompt, NEW)
        plain = swarm.call(lambda o, p=prompt: o.generate(p, _params("none")))
        spec = swarm.call(lambda o, p=prompt: o.generate(p, _params("ngram")))
        assert plain.token_ids == want
        assert spec.token_ids == want
    sp = swarm.state()["relay"]["speculative"]
    passes, drafted, accepted = (sp[k] - (before[k] or 0) for k in ("passes", "drafted_tokens", "accepted_tokens"))
    assert passes > 0 and drafted > 0
    assert 0 < accepted < drafted, sp  # kept drafts (fewer relay steps) and rejected ones (KV rolled back)
    assert sp["default"] == "none" and 0 < sp["acceptance_rate"] < 1


def test_push_greedy_equals_orchestrator_relay_and_transformers(swarm):
    before = swarm.state()["relay"]
    for prompt in PROMPTS:
        want = hf_greedy_from(swarm.model_path, prompt, NEW)
        for mode in ("none", "ngram", "draft"):
            out = swarm.call(lambda o, p=prompt, m=mode: o.generate(p, _params(m, relay="push")))
            assert out.token_ids == want, mode
    st = swarm.state()["relay"]
    assert st["mode"] == "orchestrator"  # the default; requests asked for push
    push_passes = st["passes"]["push"] - before["passes"]["push"]
    assert push_passes >= NEW * len(PROMPTS)
    # 2 hops: 3 legs per pass pushed, 4 relayed
    assert st["critical_legs"]["push"] - before["critical_legs"]["push"] == 3 * push_passes
    relay_passes = st["passes"]["orchestrator"] - before["passes"]["orchestrator"]
    assert st["critical_legs"]["orchestrator"] - before["critical_legs"]["orchestrator"] == 4 * relay_passes
    # servers push on their own; the orchestrator pushes only where a push broke (rare, on a loaded host)
    assert st["push_rescues"] - before["push_rescues"] <= 2


def test_a_push_without_the_token_is_refused(swarm):
    """A peer that is not on the route cannot feed a session: wrong token, unknown session."""
    import asyncio

    from hivemind.p2p import P2P

    from petals_chain.swarm.rpc import push_step, serialize_chunks

    peer = swarm.state()["servers"][0]["peer_id"]
    hidden = torch.zeros(1, 1, swarm.call(_hidden_size), dtype=torch.float32)

    async def forge():
        p2p = await P2P.create(initial_peers=swarm.initial_peers)
        try:
            errors = []
            for sid in ("no-such-session", "x" * 8):
                for attempt in range(10):  # a fresh daemon may not have found the server's address yet
                    try:
                        await push_step(p2p, {"peer": peer, "session_id": sid, "token": "0" * 32}, 0, 1, [],
                                        serialize_chunks(hidden), timeout_s=20)
                    except ConnectionError:
                        if attempt == 9:
                            raise
                        await asyncio.sleep(1.0)
                        continue
                    except RuntimeError as e:
                        errors.append(str(e))
                    break
            return errors
        finally:
            await p2p.shutdown()

    errors = asyncio.run(forge())
    assert len(errors) == 2 and all("untrusted" in e for e in errors), errors


def test_a_closed_push_session_takes_no_more_pushes_and_its_id_opens_again(swarm):
    """Closing a session that takes pushes drops its mailbox with it: a push for it (right token, trusted peer) is
    refused, and the same session id can be opened again with a new token. (The mailbox outlived a close: it kept
    taking pushes, held up to 4 hidden states, and refused the id's next open as "already open".)"""
    from petals_chain.swarm.rpc import push_step, serialize_chunks

    chain = swarm.state()["chains"][0]
    peer, (start, end) = chain["servers"][0], chain["spans"][0]

    async def probe(orch):
        hidden = torch.zeros(1, 1, int(orch.config.hidden_size), dtype=torch.float32)
        client = orch.client
        sess = await client.open_session(peer, "closed-box", start, end, MAX_LENGTH, push_token="ab" * 16)
        await sess.close()
        try:
            await push_step(client.p2p, {"peer": peer, "session_id": "closed-box", "token": "ab" * 16}, 0, 1, [],
                            serialize_chunks(hidden), timeout_s=20)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        again = await client.open_session(peer, "closed-box", start, end, MAX_LENGTH, push_token="cd" * 16)
        await again.close()
        return refused

    refused = swarm.call(probe, timeout=60)
    assert refused is not None and "no open session takes this push" in refused, refused


async def _hidden_size(orch) -> int:
    return int(orch.config.hidden_size)


def test_draft_model_greedy_equals_plain_and_transformers(swarm):
    before = swarm.state()["relay"]["speculative"]
    assert before["draft_model"] == {"name": "self", "layers": 3}
    for prompt in PROMPTS:
        want = hf_greedy_from(swarm.model_path, prompt, NEW)
        out = swarm.call(lambda o, p=prompt: o.generate(p, _params("draft")))
        assert out.token_ids == want
    sp = swarm.state()["relay"]["speculative"]
    drafted = sp["drafted_tokens"] - before["drafted_tokens"]
    accepted = sp["accepted_tokens"] - before["accepted_tokens"]
    assert 0 < accepted < drafted, sp  # the draft model's tokens kept and rejected (its own cache rolled back too)


def test_draft_model_sampling_gives_the_plain_seeded_tokens(swarm):
    """Sampled with drafts: verification samples each position with the uniform plain decoding would draw, so a
    seeded request gives the same tokens with drafts as without (the drafts are kept and rejected along the way),
    and every token is one the model could sample (no draft leaks through unverified)."""
    prompt = PROMPTS[1]
    params = dict(temperature=1.0, top_k=3, max_tokens=24, ignore_eos=True, seed=7)
    before = swarm.state()["relay"]["speculative"]
    plain = swarm.call(lambda o: o.generate(prompt, SamplingParams(**params, speculative="none")))
    spec = swarm.call(lambda o: o.generate(prompt, SamplingParams(**params, speculative="draft")))
    ngram = swarm.call(lambda o: o.generate(prompt, SamplingParams(**params, speculative="ngram")))
    assert spec.token_ids == plain.token_ids == ngram.token_ids and len(spec.token_ids) == 24
    sp = swarm.state()["relay"]["speculative"]
    assert sp["accepted_tokens"] > before["accepted_tokens"], sp  # drafts were verified, and some kept
    hf = _hf(swarm.model_path)
    ids = list(prompt)
    for tok in spec.token_ids:  # top_k=3: every kept token is among the model's 3 likeliest at its position
        with torch.no_grad():
            top = torch.topk(hf(torch.tensor([ids])).logits[0, -1], 3).indices.tolist()
        assert tok in top
        ids.append(tok)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_ngram_push_survives_a_server_killed_mid_generation(swarm, scaled):
    """Drafts and pushes while the chain's last hop dies: the hop moves to the other chain's server (replaying its
    inputs), and where a push can no longer arrive the orchestrator delivers it; no token changes."""
    prompt = PROMPTS[0]
    n = MAX_LENGTH - len(prompt) - 2
    want = hf_greedy_from(swarm.model_path, prompt, n)
    st0 = swarm.state()
    fut = swarm.submit(lambda o: o.generate(prompt, _params("ngram", n, relay="push")))
    deadline = time.monotonic() + scaled(60)
    busy = []
    while not busy:  # the chain serving it
        assert time.monotonic() < deadline and not fut.done(), "the generation never showed up on a chain"
        busy = [ch for ch in swarm.state()["chains"] if ch["active"] > 0]
        time.sleep(0.02)
    victim = busy[0]["names"][-1]
    swarm.servers[victim].kill()
    out = fut.result(scaled(240))
    assert out.token_ids == want
    assert out.failovers >= 1 or swarm.state()["relay"]["failovers"] > st0["relay"]["failovers"]


def test_speculative_field_and_metrics_over_http(swarm):
    """The API takes ``speculative`` per request (and refuses other values), and /metrics counts passes."""
    from petals_chain.orchestrator.api import create_app

    async def talk(orch):
        app = create_app(orch)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orch",
                                     timeout=120) as c:
            body = {"model": orch.model_id, "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True}
            a = await c.post("/v1/completions", json={**body, "speculative": "ngram"})
            b = await c.post("/v1/completions", json={**body, "speculative": "none"})
            bad = await c.post("/v1/completions", json={**body, "speculative": "eagle"})
            draft = await c.post("/v1/completions", json={**body, "speculative": "draft"})
            metrics = (await c.get("/metrics")).text
            return a, b, bad, draft, metrics

    a, b, bad, draft, metrics = swarm.call(talk)
    assert a.status_code == 200 and b.status_code == 200 and draft.status_code == 200, (a.text, b.text, draft.text)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"] == draft.json()["choices"][0]["text"]
    assert bad.status_code == 400 and "speculative" in bad.text
    assert "petals_chain_speculative_passes_total" in metrics
    assert "petals_chain_speculative_accepted_tokens_total" in metrics
