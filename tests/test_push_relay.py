"""``--relay push`` through real server processes over hivemind P2P: servers forward each step to the next hop
over routes only the orchestrator can make. Greedy output equals the orchestrator relay and transformers (with
and without speculative drafts, whose rejected tokens servers overwrite), a hop killed mid-generation fails over
without changing a token, a push without the session's token is refused before its tensor is read, and the
counters (passes, critical legs, rescues) reach the API."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from conftest import hf_greedy_from
from petals_chain.orchestrator.sampling import SamplingParams
from petals_chain.swarm.local import memory_for

MAX_LENGTH = 128
NEW = 24
PROMPTS = [torch.randint(3, 700, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in (3, 4)]


def _params(relay: str, n: int = NEW, speculative: str = "none") -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, relay=relay, speculative=speculative)


@pytest.fixture(scope="module")
def swarm(tiny_model_factory, tmp_path_factory):
    from inprocess import InProcessSwarm

    # 3 blocks, at most 1 per server: every chain has 3 hops (the first, a middle one that forwards the route, and
    # the last), and every hop has a replacement on the other chain
    model_path = tiny_model_factory("llama", 3, initializer_range=0.05)
    sw = InProcessSwarm(model_path, tmp_path_factory.mktemp("push"), max_length=MAX_LENGTH, arrival_rate=1.0,
                        relay="push")
    try:
        sw.start()
        mem = memory_for(model_path, MAX_LENGTH, 1, 4)
        for name in "abcdef":
            sw.add_server(name, mem, "--max-blocks", "1")
        sw.wait_until(lambda st: st["ready"] and len(st["chains"]) == 2 and all(len(ch["names"]) == 3 for ch in
                                                                               st["chains"])
                      and all(s["state"] == "online" for s in st["servers"]), 240, "two 3-hop chains")
        yield sw
    finally:
        sw.stop()


def test_push_greedy_equals_orchestrator_relay_and_transformers(swarm):
    before = swarm.state()["relay"]
    for prompt in PROMPTS:
        want = hf_greedy_from(swarm.model_path, prompt, NEW)
        pushed = swarm.call(lambda o, p=prompt: o.generate(p, _params("push")))
        relayed = swarm.call(lambda o, p=prompt: o.generate(p, _params("orchestrator")))
        assert pushed.token_ids == want
        assert relayed.token_ids == want
    st = swarm.state()["relay"]
    assert st["mode"] == "push"
    push_passes = st["passes"]["push"] - before["passes"]["push"]
    relay_passes = st["passes"]["orchestrator"] - before["passes"]["orchestrator"]
    assert push_passes >= len(PROMPTS) * NEW and relay_passes >= len(PROMPTS) * NEW
    # 3 hops: 4 legs per pass pushed, 6 relayed
    assert st["critical_legs"]["push"] - before["critical_legs"]["push"] == 4 * push_passes
    assert st["critical_legs"]["orchestrator"] - before["critical_legs"]["orchestrator"] == 6 * relay_passes
    # servers push on their own; the orchestrator pushes only where a push broke (rare, on a loaded host)
    assert st["push_rescues"] - before["push_rescues"] <= 2


def test_push_with_speculative_drafts_equals_plain(swarm):
    prompt = PROMPTS[0]
    want = hf_greedy_from(swarm.model_path, prompt, 48)
    before = swarm.state()["relay"]["speculative"]
    out = swarm.call(lambda o: o.generate(prompt, _params("push", 48, speculative="ngram")))
    assert out.token_ids == want
    sp = swarm.state()["relay"]["speculative"]
    drafted = sp["drafted_tokens"] - before["drafted_tokens"]
    accepted = sp["accepted_tokens"] - before["accepted_tokens"]
    assert 0 < accepted < drafted, sp  # kept drafts and rejected ones (overwritten on every hop)


def test_a_push_without_the_token_is_refused(swarm):
    """A peer that is not the route's previous hop cannot feed a session: wrong token, unknown session."""
    from hivemind.p2p import P2P

    from petals_chain.swarm.rpc import push_step, serialize_chunks

    st = swarm.state()
    peer = st["servers"][0]["peer_id"]
    hidden = torch.zeros(1, 1, swarm.call(lambda o: _hidden_size(o)), dtype=torch.float32)

    async def forge():
        p2p = await P2P.create(initial_peers=swarm.initial_peers)
        try:
            errors = []
            for sid in ("no-such-session", "x" * 8):
                try:
                    await push_step(p2p, {"peer": peer, "session_id": sid, "token": "0" * 32}, 0, 1, [],
                                    serialize_chunks(hidden), timeout_s=20)
                except RuntimeError as e:
                    errors.append(str(e))
            return errors
        finally:
            await p2p.shutdown()

    errors = asyncio.run(forge())
    assert len(errors) == 2 and all("untrusted" in e for e in errors), errors


async def _hidden_size(orch) -> int:
    return int(orch.config.hidden_size)


def test_push_survives_a_middle_hop_killed_mid_generation(swarm, scaled):
    prompt = PROMPTS[1]
    n = MAX_LENGTH - len(prompt) - 2
    want = hf_greedy_from(swarm.model_path, prompt, n)
    st0 = swarm.state()
    fut = swarm.submit(lambda o: o.generate(prompt, _params("push", n)))
    deadline = time.monotonic() + scaled(60)
    busy = []
    while not busy:  # the chain serving it
        assert time.monotonic() < deadline and not fut.done(), "the generation never showed up on a chain"
        busy = [ch for ch in swarm.state()["chains"] if ch["active"] > 0]
        time.sleep(0.02)
    time.sleep(0.3)  # some steps pushed first
    victim = busy[0]["names"][1]
    swarm.servers[victim].kill()
    out = fut.result(scaled(240))
    assert out.token_ids == want
    st = swarm.state()["relay"]
    assert out.failovers >= 1 or st["failovers"] > st0["relay"]["failovers"]
    if st["replays_partial"] > st0["relay"]["replays_partial"]:
        # the hop moved to another server mid-step: the next hop, waiting for a push the dead server never sent,
        # got it from the orchestrator
        assert st["push_rescues"] > st0["relay"]["push_rescues"]
    assert st["passes"]["push"] - st0["relay"]["passes"]["push"] >= n // 2  # kept pushing after the failover
