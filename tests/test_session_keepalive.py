"""Server idle timeouts, keepalives and session leases agree (real server processes, real P2P on loopback).

Servers here drop a session stream silent for 2 s (``--idle-timeout-s 2``). On the wire: only valid messages reset
that timer (garbage does not hold slots), the ``keepalive`` op does, and an untrusted peer is refused before it
sends anything. Through the orchestrator: a multi-turn session idle far longer than the servers' timeout keeps its
server sessions (keepalives), and one whose servers dropped it anyway fails over transparently (each hop re-opened
and its inputs replayed), with output equal to the same history generated fresh.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.local import memory_for
from petals_chain.swarm.rpc import PetalsChainBlocks, RemoteError, ServerClient, _pack, _unpack

pytestmark = pytest.mark.slow

IDLE_S = 2.0
MAX_LENGTH = 64
PREFIX = "keepalive"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


# ---------------------------------------------------------------- the wire: one server, a trusted and a rogue peer

@pytest.fixture(scope="module")
def idle_server(model_path, tmp_path_factory):
    from conftest import assigned_server

    with assigned_server(model_path, memory_for(model_path, MAX_LENGTH, 2, 4), tmp_path_factory.mktemp("idle"),
                         PREFIX, MAX_LENGTH, ["--idle-timeout-s", str(IDLE_S)]) as env:
        yield env


async def _with_p2p(dht: SwarmDHT, fn):
    p2p = await dht.replicate_p2p()
    try:
        return await fn(p2p)
    finally:
        await p2p.shutdown()


async def _slots_free(client: ServerClient, peer: str) -> int:
    return int((await client.info(peer))["slots_free"])


def test_garbage_does_not_reset_the_idle_timer(idle_server, scaled):
    """A trusted peer that opens a session and then sends only invalid messages loses it ``idle_timeout_s`` after
    its last valid message, however often it sends garbage."""
    orch, peer = idle_server["orch"], idle_server["peer"]

    async def main(p2p):
        client = ServerClient(p2p)
        stub = PetalsChainBlocks.get_stub(p2p, PeerID.from_base58(peer))
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({"op": "open", "session_id": "garbage",
                                                                    "start_block": 0, "end_block": 2,
                                                                    "max_length": MAX_LENGTH})))

        async def requests():
            while True:
                yield await queue.get()

        stream = await stub.rpc_session(requests())
        opened = _unpack((await stream.__anext__()).metadata)
        t0 = time.monotonic()
        assert opened["ok"]
        assert await _slots_free(client, peer) == 6
        codes = []
        while time.monotonic() - t0 < scaled(3 * IDLE_S):
            queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({"op": "dance"})))
            try:
                reply = _unpack((await asyncio.wait_for(stream.__anext__(), scaled(5))).metadata)
            except StopAsyncIteration:
                break
            codes.append(reply.get("code"))
            if reply.get("code") == "idle_timeout":
                break
            await asyncio.sleep(0.2)
        closed_after = time.monotonic() - t0
        return codes, closed_after, await _slots_free(client, peer)

    codes, closed_after, free = asyncio.run(_with_p2p(orch, main))
    print(f"closed {closed_after:.1f}s after open; replies {codes}")
    assert codes[-1] == "idle_timeout" and set(codes[:-1]) == {"invalid"}, codes
    assert closed_after < IDLE_S + scaled(1.5)
    assert free == 8


def test_keepalive_op_holds_a_session(idle_server, scaled):
    orch, peer = idle_server["orch"], idle_server["peer"]

    async def main(p2p):
        client = ServerClient(p2p, step_timeout_s=scaled(30))
        sess = await client.open_session(peer, "held", 0, 2, MAX_LENGTH)
        assert sess.idle_timeout_s == IDLE_S
        await sess.step(torch.randn(1, 3, 64), 0)
        alive = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * IDLE_S:
            await asyncio.sleep(IDLE_S / 3)
            alive.append(await sess.keepalive())
        out = await sess.step(torch.randn(1, 1, 64), 3)  # the KV of the 3 tokens is still there
        await sess.close()
        return alive, out.shape

    alive, shape = asyncio.run(_with_p2p(orch, main))
    assert all(alive) and len(alive) >= 5 and tuple(shape) == (1, 1, 64)


def test_untrusted_peer_refused_before_it_sends_anything(idle_server, scaled):
    rogue, peer = idle_server["rogue"], idle_server["peer"]

    async def main(p2p):
        stub = PetalsChainBlocks.get_stub(p2p, PeerID.from_base58(peer))

        async def silent():
            await asyncio.Event().wait()
            yield runtime_pb2.ExpertRequest()

        t0 = time.monotonic()
        stream = await stub.rpc_session(silent())
        reply = _unpack((await asyncio.wait_for(stream.__anext__(), scaled(10))).metadata)
        waited = time.monotonic() - t0
        with pytest.raises(RemoteError) as err:  # and through the client: refused, nothing allocated
            await ServerClient(p2p).open_session(peer, "rogue", 0, 2, MAX_LENGTH)
        return reply, waited, err.value.code, await _slots_free(ServerClient(p2p), peer)

    reply, waited, code, free = asyncio.run(_with_p2p(rogue, main))
    assert reply.get("code") == "untrusted" and code == "untrusted"
    assert waited < IDLE_S  # answered within UNTRUSTED_READ_S, not held until the idle timeout
    assert free == 8


# ---------------------------------------------------------------- through the orchestrator

@pytest.fixture
def swarm(model_path, tmp_path, request):
    from inprocess import InProcessSwarm

    sw = InProcessSwarm(model_path, tmp_path, max_length=MAX_LENGTH, arrival_rate=1.0, **getattr(request, "param", {}))
    try:
        sw.start()
        for name in ("a", "b"):  # one chain of two hops
            sw.add_server(name, memory_for(model_path, MAX_LENGTH, 2, 4), "--max-blocks", "2", "--idle-timeout-s",
                          str(IDLE_S))
        yield sw
    finally:
        sw.stop()


HELD = {"hold_sessions": True}  # these tests are about server sessions held idle between turns


def _two_turns(swarm, model_path, scaled, turn1: tuple[int, ...] = (3, 14, 15, 92, 65), between=None
               ) -> tuple[list[int], list[int], object, dict]:
    """Turn 1, an idle pause of 3x the servers' idle timeout (or ``between()``), turn 2; returns the turns' tokens,
    the expected ones (a fresh greedy generation of the whole history), the session holder and the relay
    counters."""
    from transformers import AutoModelForCausalLM

    from petals_chain.orchestrator.sampling import SamplingParams

    swarm.wait_until(lambda st: st["ready"] and len(st["chains"][0]["names"]) == 2, scaled(120), "the chain")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    turn1, turn2 = list(turn1), [35, 89, 79]

    async def first(orch):
        s = orch.open_session()
        return s, await orch.session_generate(s, turn1, params)

    s, g1 = swarm.call(first)
    if between is None:
        time.sleep(3 * IDLE_S)
    else:
        between()
    history = turn1 + g1.token_ids + turn2
    g2 = swarm.call(lambda orch: orch.session_generate(s, list(history), params))
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([history]), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)[0, len(history):].tolist()
    return g2.token_ids, expected, s.holder, swarm.state()["relay"]


def test_released_session_reuses_its_cached_prefix(swarm, model_path, scaled):
    """By default the chain goes back between turns and its servers keep the KV as cached prefixes: the next turn,
    after the servers' idle timeout (nothing held, nothing to keep alive), reuses it and stays exact."""
    turn1 = tuple(range(3, 40))  # 37 tokens + 7 fed of the 8 generated: 2 full pages of 16
    got, expected, holder, relay = _two_turns(swarm, model_path, scaled, turn1)
    print(f"failovers {holder.failovers}; relay {relay}")
    assert got == expected
    assert holder.failovers == 0 and holder.cs is None  # released again after turn 2
    assert relay["prompt_cached_tokens"] == 32 and relay["prefix_hits"] == 1 and relay["preferred_starts"] == 1


def test_evicted_prefix_is_recomputed_exactly(swarm, model_path, scaled):
    """Between the turns other jobs' cached prefixes fill the servers' memory and evict the session's pages: the
    next turn recomputes what is gone, with the same output."""
    from petals_chain.orchestrator.sampling import SamplingParams

    def other_jobs():
        # each 62-token job caches 3 pages per block (6 of a server's 32 pages): by the fifth the pool is out of
        # free pages and reclaims the least recently used ones, the session's first
        for j in range(6):
            prompt = [100 + 7 * j + i for i in range(60)]
            swarm.call(lambda orch: orch.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                                         ignore_eos=True)))

    turn1 = tuple(range(3, 40))
    got, expected, holder, relay = _two_turns(swarm, model_path, scaled, turn1, between=other_jobs)
    print(f"failovers {holder.failovers}; relay {relay}")
    assert got == expected and holder.failovers == 0
    assert relay["prompt_cached_tokens"] < 32  # turn 2 found less than its 2 pages (the others share nothing)


@pytest.mark.parametrize("swarm", [HELD], indirect=True)
def test_idle_session_kept_alive_past_server_timeout(swarm, model_path, scaled):
    arrived = len(swarm.orch.planner.rates.arrivals)
    got, expected, holder, relay = _two_turns(swarm, model_path, scaled)
    print(f"failovers {holder.failovers}; relay {relay}")
    assert got == expected
    assert holder.failovers == 0  # the servers never dropped the held sessions
    # each turn is an arrival (the planner's rate, the model placement's), the session held between turns is not
    # work in flight (a model with idle sessions alone read as busy, and kept servers another model needed)
    assert len(swarm.orch.planner.rates.arrivals) == arrived + 2
    assert swarm.orch.dispatch.running == 1 and swarm.orch.dispatch.stepping == 0


@pytest.mark.parametrize("swarm", [{"keepalive_tick_s": 0, **HELD}], indirect=True)
def test_session_dropped_by_servers_fails_over_transparently(swarm, model_path, scaled):
    """Keepalives off: both servers drop the session while it idles; the next turn re-opens each hop on its own
    server and replays that hop's inputs (no new chain, no error)."""
    got, expected, holder, relay = _two_turns(swarm, model_path, scaled)
    print(f"failovers {holder.failovers}; relay {relay}")
    assert got == expected
    assert holder.failovers >= 1
    assert relay["replays_full"] == 0 and relay["replays_partial"] == holder.failovers, relay


@pytest.mark.parametrize("swarm", [{"keepalive_tick_s": 0, "replay_cache_mb": 0, **HELD}], indirect=True)
def test_without_kept_inputs_the_whole_prefix_is_replayed(swarm, model_path, scaled):
    """No budget for hop inputs (``--replay-cache-mb 0``): a hop past the first cannot be replayed alone, so the
    job falls back to replaying its whole prefix on a chain from the dispatcher; still exact, still no error."""
    got, expected, holder, relay = _two_turns(swarm, model_path, scaled)
    print(f"failovers {holder.failovers}; relay {relay}")
    assert got == expected
    assert relay["replays_full"] >= 1 and relay["replay_cache"]["bytes"] == 0 == relay["replay_cache"]["evictions"]


def test_prefill_failing_after_a_reused_prefix_replays_exactly(model_path, tmp_path, scaled, monkeypatch):
    """A job reuses a cached prefix on one chain, a hop fails during its prefill (the hop's inputs for the cached
    positions were never relayed, so the job replays on another chain), and the chain it gets has nothing
    cached: the replay computes the whole prompt from position 0 with its own embeddings (a regression: it
    re-sent the first attempt's embeddings of the uncached part only)."""
    from inprocess import InProcessSwarm
    from transformers import AutoModelForCausalLM

    from petals_chain.orchestrator import relay
    from petals_chain.orchestrator.sampling import SamplingParams

    sw = InProcessSwarm(model_path, tmp_path, max_length=MAX_LENGTH, arrival_rate=1.0)
    try:
        sw.start()
        for name, tau in (("a1", 0.001), ("b1", 0.001), ("a2", 0.003), ("b2", 0.003)):  # two chains, "1" faster
            sw.add_server(name, memory_for(model_path, MAX_LENGTH, 2, 4), "--max-blocks", "2", tau_p=tau)
        sw.wait_until(lambda st: st["ready"] and len(st["chains"]) == 2, scaled(120), "two chains")
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        real_step = relay.ChainSession.step
        # On a loaded machine a re-plan (by measured speed) may land between the two requests and send the second
        # to a chain that holds no prefix yet: then nothing was reused and the case is not exercised. Try again
        # with a fresh prefix (never otherwise); every attempt's output must be exact anyway.
        for attempt in range(3):
            shared = [3 + attempt] + list(range(4, 38))  # 35 tokens: 2 cached pages of 16
            sw.call(lambda orch: orch.generate(shared + [40, 41], params))  # on the faster chain: caches the prefix
            prompt = shared + [50, 51, 52]
            injected = []

            async def failing_step(self, i, hidden, position):
                if not injected and i == 1 and position > 0:  # hop 2 of the reused prefill: the server "dies"
                    injected.append((self.hops[i][0], position))
                    raise relay.HopFailure(self.hops[i][0], ConnectionError("injected failure"), hop=i)
                return await real_step(self, i, hidden, position)

            monkeypatch.setattr(relay.ChainSession, "step", failing_step)
            before = sw.state()["relay"]
            g = sw.call(lambda orch: orch.generate(prompt, params))
            monkeypatch.setattr(relay.ChainSession, "step", real_step)
            with torch.no_grad():
                expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                       pad_token_id=0)[0, len(prompt):].tolist()
            relay_state = sw.state()["relay"]
            print(f"attempt {attempt}: injected {injected}; failovers {g.failovers}; cached {g.cached_tokens}; "
                  f"relay {relay_state}")
            assert g.token_ids == expected
            if injected and injected[0][1] == 32:  # the failure hit the prefill after the 32 reused tokens
                assert g.failovers == 1 and relay_state["replays_full"] == before["replays_full"] + 1
                break
            time.sleep(1.0)  # a re-plan was settling
        else:
            pytest.fail("the second request never reused the cached prefix in 3 attempts")
    finally:
        sw.stop()
