"""Several orchestrators on one swarm (issue 18, HERD groups): the split of servers into groups (pure), and two real
orchestrators sharing four servers, one of them killed: the other takes its group over and nothing fails."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from petals_chain.algorithms.herd import (GroupServer, assign_server_groups, brute_force_server_groups,
                                          group_burst_tolerance, solve_server_groups, split_score)
from petals_chain.swarm.local import signal_role


def _servers(n: int, blocks: int = 4, throughput: float = 10.0) -> list[GroupServer]:
    return [GroupServer(f"s{i}", blocks, throughput) for i in range(n)]


def _sizes(split: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in split.values():
        out[o] = out.get(o, 0) + 1
    return out


def test_one_orchestrator_takes_every_server():
    split = assign_server_groups(_servers(3), {"A": 0.0}, num_blocks=4)
    assert split == {"s0": "A", "s1": "A", "s2": "A"}
    assert assign_server_groups(_servers(3), {}, num_blocks=4) == {}


def test_equal_demand_splits_evenly_and_demand_weights_the_split():
    assert _sizes(assign_server_groups(_servers(4), {"A": 1.0, "B": 1.0}, 4)) == {"A": 2, "B": 2}
    # A receives three times B's jobs: HERD's max-min burst tolerance gives it three of the four servers
    assert _sizes(assign_server_groups(_servers(4), {"A": 3.0, "B": 1.0}, 4)) == {"A": 3, "B": 1}


def test_servers_stay_in_their_group_and_a_lost_orchestrators_group_moves():
    servers = _servers(4)
    previous = {"s0": "A", "s1": "B", "s2": "A", "s3": "B"}
    assert assign_server_groups(servers, {"A": 1.0, "B": 1.0}, 4, previous) == previous  # nothing gains
    assert assign_server_groups(servers, {"B": 1.0}, 4, previous) == {s: "B" for s in previous}


def test_a_group_without_a_complete_copy_gets_one():
    # 6 half-model servers (2 blocks of 4) all in A: B gets two of them, a whole copy, though moves are capped
    servers = _servers(6, blocks=2)
    split = assign_server_groups(servers, {"A": 1.0, "B": 1.0}, 4, {s.peer_id: "A" for s in servers}, max_moves=0)
    assert _sizes(split) == {"A": 4, "B": 2}
    # ... but not when A would lose its own: 3 half-model servers cannot make two copies
    split = assign_server_groups(servers[:3], {"A": 1.0, "B": 1.0}, 4, {s.peer_id: "A" for s in servers[:3]})
    assert _sizes(split) == {"A": 3}


def test_burst_tolerance_counts_only_complete_copies():
    assert group_burst_tolerance(_servers(1, blocks=3), 1.0, 4) == 0.0
    assert group_burst_tolerance(_servers(2, blocks=2, throughput=8.0), 2.0, 4) == pytest.approx(16 / 4 / 2)


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.integers(1, 6), min_size=0, max_size=9), rates=st.lists(st.floats(0, 5), min_size=1,
       max_size=3), prev=st.lists(st.integers(0, 3), min_size=9, max_size=9), L=st.integers(1, 6))
def test_split_properties(blocks, rates, prev, L):
    """Every server lands in a live group; rebalancing moves never lower the worst group's burst tolerance."""
    orchs = ["ABC"[i] for i in range(len(rates))]
    demand = dict(zip(orchs, rates))
    servers = [GroupServer(f"s{i}", b, b / (0.1 + 0.05 * b)) for i, b in enumerate(blocks)]
    previous = {s.peer_id: "ABCD"[prev[i]] for i, s in enumerate(servers)}  # D: a lost orchestrator
    split = assign_server_groups(servers, demand, L, previous)
    assert set(split) == {s.peer_id for s in servers} and set(split.values()) <= set(orchs)
    floor = max([v for v in rates if v > 0], default=1.0) * 0.05

    def worst(sp):
        by = {o: [s for s in servers if sp[s.peer_id] == o] for o in orchs}
        return min(group_burst_tolerance(by[o], max(demand[o], floor), L) for o in orchs)

    assert worst(split) >= worst(assign_server_groups(servers, demand, L, previous, max_moves=0)) - 1e-12


@settings(max_examples=120, deadline=None)
@given(blocks=st.lists(st.integers(0, 6), min_size=1, max_size=6), thr=st.lists(st.floats(0.5, 20), min_size=6,
       max_size=6), rates=st.lists(st.sampled_from([0.0, 0.3, 1.0, 2.5]), min_size=1, max_size=3),
       L=st.integers(1, 6))
# HiGHS (scipy 1.17.1's 1.12.0) called t = 16.0 optimal with presolve on and off (its root cuts cut off 16.2:
# A = s1 s2 s4, B = s3, C = s0 s5; some other random seeds find it), and in the second 16.0 for 16.2 under 26 of 80
# seed x presolve settings (both found by Hypothesis, session 36)
@example(blocks=[1, 1, 1, 2, 1, 0], thr=[0.5, 20.0, 1.5, 8.0, 19.0, 16.5625], rates=[2.5, 0.0, 1.0], L=1)
@example(blocks=[1, 1, 4, 4, 1, 3], thr=[0.5, 20.0, 1.5, 10.0, 18.5, 17.5], rates=[2.5, 0.0, 1.0], L=1)
# and, after the reseed, 38.5 for 40.5 here (the old code 40.0): splits this small are now searched exactly
@example(blocks=[1, 1, 4, 4, 1, 3], thr=[0.5, 20.0, 1.5, 10.0, 18.5, 17.5], rates=[1.0, 0.0, 0.3], L=1)
def test_the_ilp_split_equals_brute_force(blocks, thr, rates, L):
    """HERD's ILP over server splits: as many groups with a complete copy as any split has, then the same worst
    burst tolerance (within the solver's relative gap), never worse than the greedy split."""
    servers = [GroupServer(f"s{i}", b, thr[i]) for i, b in enumerate(blocks)]
    demand = {"ABC"[i]: r for i, r in enumerate(rates)}
    split = solve_server_groups(servers, demand, L)
    assert split is not None and set(split) == {s.peer_id for s in servers}
    (covered, t), (want_covered, want_t) = split_score(servers, demand, L, split), brute_force_server_groups(
        servers, demand, L)
    assert covered == want_covered and t == pytest.approx(want_t, rel=1e-3)
    g_covered, g_t = split_score(servers, demand, L, assign_server_groups(servers, demand, L))
    assert (covered, t * (1 + 1e-3)) >= (g_covered, g_t)


@pytest.mark.parametrize("blocks, thr, demand, L", [
    # HiGHS's presolve called a split 9 % below the best optimal here (6.28 vs 6.91), found by a random draw
    ([3, 5, 2, 0, 6, 5], [11.763720859461085, 1.5, 2.2663437067503756, 11.067329097766201, 16.00339815688969,
                          10.220301368273322], {"A": 1.0, "B": 2.5, "C": 0.0}, 2),
    # and threw ValueError("vector::reserve") here (only two of three groups can hold the model: u_j stay)
    ([3, 4, 3, 1], [16.410890274961083, 1.5, 1.5, 1.5], {"A": 2.5, "B": 1.162130985644869, "C": 0.0}, 4),
    # and ended the max-t solve in "solve error" under every setting with the big-M link (two copies, three groups)
    ([5, 1, 3], [1.5, 13.1, 1.5], {"A": 0.0, "B": 2.5, "C": 0.0}, 2),
    # and called t = 10.0 optimal on a fixed cover of all three groups (no u_j), where 10.25 is (the property test)
    ([2, 2, 2, 2, 0, 3], [0.5, 3.625, 20.0, 0.5, 19.0, 3.75], {"A": 1.0, "B": 0.3, "C": 0.3}, 2),
    # and with presolve off, t = 0.919 (scaled) called optimal where presolve on finds 0.980 (a random search)
    ([4, 4, 4, 1, 5, 3], [11.125, 2.541783727924325, 10.082801722012414, 0.5, 20.0, 18.375], {"A": 1.0, "B": 0.3}, 1),
    # and called a split 4 % below the best optimal both ways (14.425 vs 15.025; root cuts under random seed 0:
    # a neighbour of the property's explicit example, session 36), and 16.0 for 16.4, and 40.0 for 40.5
    ([1, 1, 1, 2, 1, 0], [0.5, 1.5, 13.0, 8.0, 19.0, 16.5625], {"A": 2.5, "B": 0.0, "C": 1.0}, 1),
    ([1, 1, 1, 1, 1, 3], [0.5, 20.0, 1.5, 8.0, 19.0, 16.5625], {"A": 2.5, "B": 0.0, "C": 1.0}, 1),
    ([1, 3, 1, 2, 1, 0], [0.5, 20.0, 1.5, 8.0, 19.0, 16.5625], {"A": 1.0, "B": 0.0, "C": 0.3}, 1),
    # and 38.5 for 40.5 with the t rows divided and a third seed (40.0 without): the one those left wrong
    ([1, 1, 4, 4, 1, 3], [0.5, 20.0, 1.5, 10.0, 18.5, 17.5], {"A": 1.0, "B": 0.0, "C": 0.3}, 1),
])
def test_the_ilp_split_equals_brute_force_where_highs_failed(blocks, thr, demand, L):
    servers = [GroupServer(f"s{i}", b, thr[i]) for i, b in enumerate(blocks)]
    split = solve_server_groups(servers, demand, L)
    assert split_score(servers, demand, L, split) == pytest.approx(brute_force_server_groups(servers, demand, L))


def test_the_ilp_moves_few_servers_and_scales():
    import random

    rng = random.Random(0)
    servers = [GroupServer(f"s{i}", rng.randint(1, 8), rng.uniform(0.5, 20)) for i in range(40)]
    demand = {"A": 1.0, "B": 2.0, "C": 0.5}
    first = solve_server_groups(servers, demand, 24)
    assert split_score(servers, demand, 24, first)[0] == 3
    # the same inputs again: nobody moves; one orchestrator fewer: only its servers move
    assert solve_server_groups(servers, demand, 24, first) == first
    second = solve_server_groups(servers, {"A": 1.0, "B": 2.0}, 24, first)
    assert all(second[s] == first[s] for s in first if first[s] != "C")
    big = [GroupServer(f"s{i}", rng.randint(1, 8), rng.uniform(0.5, 20)) for i in range(100)]
    t0 = time.process_time()
    split = solve_server_groups(big, {f"o{j}": rng.uniform(0.1, 5) for j in range(5)}, 24, time_limit_s=1.0)
    assert split is not None and time.process_time() - t0 < 5.0  # the time limit holds (plus model building)


def test_forward_target_only_when_this_group_cannot_take_a_request():
    from types import SimpleNamespace

    from petals_chain.orchestrator.forward import forward_target

    orchs = [{"peer_id": "me", "http_url": "http://me", "arrival_rate": 1.0, "servers": 0, "live": True},
             {"peer_id": "busy", "http_url": "http://busy", "arrival_rate": 9.0, "servers": 2, "live": True},
             {"peer_id": "calm", "http_url": "http://calm", "arrival_rate": 1.0, "servers": 2, "live": True},
             {"peer_id": "dead", "http_url": "http://dead", "arrival_rate": 0.0, "servers": 5, "live": False}]
    groups = SimpleNamespace(me="me", json=lambda: {"orchestrators": orchs})
    no_chain = SimpleNamespace(chains=[], max_queue=None, queue_length=0)
    orch = SimpleNamespace(groups=groups, dispatch=no_chain)
    assert forward_target(orch) == "http://calm"  # the most servers per request arriving, never a silent one
    orch.dispatch = SimpleNamespace(chains=["c"], max_queue=4, queue_length=3)
    assert forward_target(orch) is None  # its own group takes it
    orch.dispatch = SimpleNamespace(chains=["c"], max_queue=4, queue_length=4)
    assert forward_target(orch) == "http://calm"  # its queue is full
    assert forward_target(SimpleNamespace(groups=None, dispatch=no_chain)) is None  # one orchestrator
    for o in orchs[1:3]:
        o["servers"] = 0
    assert forward_target(SimpleNamespace(groups=groups, dispatch=no_chain)) is None  # nobody can


# ---- two orchestrators, one swarm --------------------------------------------------------------------------------
class _GroupsDHT:
    """The DHT's groups key and servers key, shared by the coordinators of a test (and its planner)."""

    def __init__(self, records: dict, me: str = "orch", entries: dict | None = None):
        self.records, self.peer_id, self.entries = records, me, ({} if entries is None else entries)

    async def afetch_servers(self, prefix):
        return dict(self.records)

    def publish_assignment(self, *args):
        pass

    async def afetch_groups(self, prefix, peers):
        return {k: v for k, v in self.entries.items() if k in peers}

    async def apublish_group(self, prefix, rec, ttl):
        self.entries[rec.orchestrator_peer_id] = rec
        return True


def _group_world(seen: dict, entries: dict, now: list, **kwargs):
    """``coordinator(me, peer)`` over a planner seeing the records ``seen`` and a DHT whose groups key is
    ``entries``, on the clock ``now[0]``; ``rounds(n, *coordinators)``: n steps of each, a second apart."""
    from test_failover_units import MODEL

    from petals_chain.model import ServerSpec
    from petals_chain.orchestrator.groups import GroupCoordinator
    from petals_chain.orchestrator.planner import ServerView

    class Planner:
        plan, arrival_rate, group, refreshes = None, 1.0, None, 1
        view = None  # the records this planner read, when not ``seen``

        def _model_spec(self):
            return MODEL

        def all_views(self):
            return [ServerView(peer_id=p, record=r) for p, r in (seen if self.view is None else self.view).items()]

        def specs(self, views):
            return [ServerSpec(v.peer_id, float(v.record.memory_bytes), 0.01, 0.01) for v in views]

    def coordinator(me, peer):
        return GroupCoordinator(dht=_GroupsDHT(seen, me, entries), prefix="x", peers=[peer], planner=Planner(),
                                http_url=lambda: "u", clock=lambda: now[0], ilp_time_s=0.5, **kwargs)

    async def rounds(n, *coordinators):
        for _ in range(n):
            now[0] += 1.0
            for c in coordinators:
                await c.step()

    return coordinator, rounds

def _servers_world(n: int = 4, entries: dict | None = None, **kwargs):
    """``n`` servers' records ``s0``.. (each a whole copy of the model), the DHT groups key ``entries`` (default
    empty), the clock ``now`` at 0 and :func:`_group_world` over them: ``(seen, entries, now, coordinator,
    rounds)``."""
    from test_failover_units import record

    seen = {f"s{i}": record(f"s{i}") for i in range(n)}
    entries = {} if entries is None else entries
    now = [0.0]
    return (seen, entries, now, *_group_world(seen, entries, now, **kwargs))



def test_a_server_the_leader_banned_stays_in_the_split_and_banned():
    """Banned servers stay in the split: left out, a banned server was in no group, the leader's planner dropped
    its view with its ban, and the next round planned it again (an audit's permanent ban undone every round)."""
    import asyncio

    from test_failover_units import MODEL, FakeClient, record

    from petals_chain.orchestrator.groups import GroupCoordinator
    from petals_chain.orchestrator.planner import Planner

    async def main(permanent):
        now = [1000.0]
        dht = _GroupsDHT({n: record(n) for n in "abc"}, me="orchA")
        pl = Planner(dht=dht, prefix="x", client=FakeClient(), max_length=64, on_chains=lambda c: None,
                     arrival_rate=1.0, model_spec_fallback=lambda: MODEL, settle_s=0.0, clock=lambda: now[0],
                     ban_base_s=60.0)
        g = GroupCoordinator(dht=dht, prefix="x", peers=["orchB"], planner=pl, http_url=lambda: "http://a",
                             ilp_time_s=0.5, ttl_s=1e-9)  # alone: no other to hear before it splits
        for _ in range(3):
            await g.step()
            await pl.refresh()
        pl.report_failure("a", "test", permanent=permanent)
        epoch = g.epoch
        for _ in range(5):  # the clock stands still: the ban holds
            await g.step()
            await pl.refresh()
            assert "a" in g.split and pl.servers["a"].banned and g.epoch == epoch

    for permanent in (False, True):
        asyncio.run(main(permanent))


def test_a_leader_that_restarts_continues_above_the_epoch_its_followers_hold():
    """A leader restarted before its follower takes over starts at epoch 0 again; it continues above what its
    follower holds (followers publish it) instead of publishing splits the follower ignores until the old epoch
    is passed: meanwhile both planned some servers and nobody others."""
    import asyncio

    from test_failover_units import record


    seen, entries, now, coordinator, rounds = _servers_world()

    async def main():
        leader, follower = coordinator("A", "B"), coordinator("B", "A")
        await rounds(8, leader, follower)  # a leader splits once it heard the others for ttl_s
        for i in range(4, 8):  # servers join: the split changes, its epoch grows
            seen[f"s{i}"] = record(f"s{i}")
            await rounds(2, leader, follower)
        assert follower.epoch > 2
        leader = coordinator("A", "B")  # restarted within the entries' time to live
        seen["s8"], seen["s9"] = record("s8"), record("s9")
        await rounds(8, leader, follower)
        assert leader.epoch == follower.epoch and leader.members().isdisjoint(follower.members())
        assert leader.members() | follower.members() == set(seen)

    asyncio.run(main())


def _identity(path) -> str:
    from hivemind.p2p import P2P, PeerID

    P2P.generate_identity(str(path))
    return PeerID.from_identity(path.read_bytes()).to_base58()


def test_two_orchestrators_split_the_swarm_and_one_takes_over_when_the_other_dies(tiny_model_factory, tmp_path,
                                                                                  scaled):
    from petals_chain.client import Client
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

    model = tiny_model_factory("llama", 4)
    mem = memory_for(model, 160, 4, 4)
    id_a, id_b = tmp_path / "a.id", tmp_path / "b.id"
    pa, pb = _identity(id_a), _identity(id_b)
    if pa > pb:  # a (the one killed) is the leader: the survivor must take the lead and the split over
        (id_a, pa), (id_b, pb) = (id_b, pb), (id_a, pa)
    group_args = ["--group-ttl-s", "3"]
    a = LocalSwarm(model, [LocalServer(f"s{i}", mem, tau_p=0.01, emulate_rtt_ms=5) for i in range(4)],
                   max_length=160, log_dir=tmp_path / "a", server_args=["--trust-orchestrator", pa, pb],
                   orchestrator_args=["--identity-path", str(id_a), "--group-with", pb, *group_args])
    b = None
    try:
        a.start()
        b = LocalSwarm(model, [], max_length=160, log_dir=tmp_path / "b",
                       orchestrator_args=["--identity-path", str(id_b), "--group-with", pa, *group_args,
                                          "--initial-peers", *a.initial_peers])
        b.start()

        def chained(sw) -> set[str]:
            return {n for ch in sw.swarm()["chains"] for n in ch["names"]}

        def split_ok(_state=None) -> bool:
            ga, gb = chained(a), chained(b)
            return len(ga) == 2 and len(gb) == 2 and not ga & gb

        a.wait_until(lambda s: split_ok(), scaled(120), "two groups of two servers, each with its chains")
        groups = b.swarm()["groups"]
        assert groups["leader"] == pa and {o["peer_id"] for o in groups["orchestrators"]} == {pa, pb}
        prompt = [5, 6, 7, 8, 9]
        want = Client(a.url).complete(prompt, max_tokens=24, ignore_eos=True)
        assert Client(b.url).complete(prompt, max_tokens=24, ignore_eos=True).token_ids == want.token_ids

        results, errors = [], []
        stop = threading.Event()

        def load(urls):
            client = Client(urls, timeout=120)
            while not stop.is_set():
                try:
                    results.append(client.complete(prompt, max_tokens=24, ignore_eos=True).token_ids)
                except Exception as e:  # noqa: BLE001 - every failure is reported below
                    errors.append(f"{urls}: {e!r}")

        def replies(n: int) -> None:  # until n replies (or errors: reported below) came in all
            until = time.monotonic() + scaled(60)
            while len(results) + len(errors) < n and time.monotonic() < until:
                time.sleep(0.05)

        threads = [threading.Thread(target=load, args=(u,), daemon=True) for u in ([b.url], [a.url, b.url])]
        for t in threads:
            t.start()
        replies(4)  # the load runs (each client's next request is in flight at the kill)
        signal_role(a.orchestrator.popen.pid, signal.SIGKILL)
        killed = time.monotonic()
        b.wait_until(lambda s: len(chained(b)) == 4, scaled(60), "the survivor serving all four servers")
        took = time.monotonic() - killed
        replies(len(results) + len(errors) + 4)  # and goes on with the survivor alone
        stop.set()
        for t in threads:
            t.join(timeout=scaled(120))
        print(f"group moved to the survivor {took:.1f} s after the kill; {len(results)} requests, none failed")
        assert not errors, errors
        assert results and all(r == want.token_ids for r in results)
        assert took <= scaled(30), f"the group moved after {took:.1f} s"
        assert b.swarm()["groups"]["leader"] == pb
    finally:
        if b is not None:
            b.stop()
        a.stop()


def test_an_orchestrator_without_servers_forwards_to_the_one_with_them(tiny_model_factory, tmp_path, scaled):
    """One server, two orchestrators: one group is empty, and what its orchestrator receives is served by the
    other's group (one-shot and streamed, chat and sessions too), token-identical; a forwarded request is not
    forwarded back; and a forwarded stream whose serving orchestrator is killed is finished by the survivor for a client
    that knows no other orchestrator."""
    import httpx

    from petals_chain.client import Client
    from petals_chain.orchestrator.forward import FORWARDED_HEADER, SERVED_BY_HEADER
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

    model = tiny_model_factory("llama", 4)
    id_a, id_b = tmp_path / "a.id", tmp_path / "b.id"
    pa, pb = _identity(id_a), _identity(id_b)
    # the leader splits once it heard the other for the TTL, and the survivor takes the group a TTL after the kill:
    # 3 s as in the take-over test above (the default 6 s waited 6 s more)
    group_args = ["--group-ttl-s", "3"]
    a = LocalSwarm(model, [LocalServer("s0", memory_for(model, 160, 4, 4), tau_p=0.01, emulate_rtt_ms=20)],
                   max_length=160, log_dir=tmp_path / "a", server_args=["--trust-orchestrator", pa, pb],
                   orchestrator_args=["--identity-path", str(id_a), "--group-with", pb, *group_args])
    b = None
    try:
        a.start()
        b = LocalSwarm(model, [], max_length=160, log_dir=tmp_path / "b",
                       orchestrator_args=["--identity-path", str(id_b), "--group-with", pa, *group_args,
                                          "--initial-peers", *a.initial_peers])
        b.start()

        def serving(sw) -> bool:
            return bool(sw.swarm()["chains"])

        a.wait_until(lambda s: serving(a) or serving(b), scaled(120), "one group to have its chain")
        full, empty = (a, b) if serving(a) else (b, a)
        empty.wait_until(lambda s: any(o["servers"] for o in (s["groups"] or {}).get("orchestrators", [])
                                       if o["peer_id"] != s["groups"]["me"] and o["live"]),
                         scaled(60), "the empty orchestrator to know the other's group")
        prompt, name = [5, 6, 7, 8, 9], full.swarm()["model"]
        want = Client(full.url).complete(prompt, max_tokens=12, ignore_eos=True)
        r = httpx.post(f"{empty.url}/v1/completions", timeout=120,
                       json={"model": name, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.headers[SERVED_BY_HEADER] == full.url
        assert r.json()["petals_chain"][0]["token_ids"] == want.token_ids
        pieces = list(Client(empty.url, timeout=120).stream(prompt, max_tokens=12, ignore_eos=True))
        assert "".join(pieces) == want.text
        chat = httpx.post(f"{empty.url}/v1/chat/completions", timeout=120,
                          json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.headers[SERVED_BY_HEADER] == full.url
        assert empty.swarm()["groups"]["forwarded"] == 3
        # already forwarded once: the empty orchestrator keeps it (and answers it from its queue's rules)
        again = httpx.post(f"{empty.url}/v1/completions", timeout=30, headers={FORWARDED_HEADER: "someone"},
                           json={"model": name, "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                                 "deadline_ms": 500})
        assert SERVED_BY_HEADER not in again.headers and again.status_code != 200
        # a session opened through the empty orchestrator lives on the other, its turns too (it never ran)
        with Client(empty.url, timeout=120).session() as sess:
            assert sess.complete(input_ids=prompt, max_tokens=12, ignore_eos=True).token_ids == want.token_ids
        # the orchestrator the stream was forwarded to dies mid-stream: an OpenAI client of the survivor (it knows
        # no other URL) gets the whole text once, the survivor finishing the stream itself when it has the group
        from openai import OpenAI

        long = Client(full.url).complete(prompt, max_tokens=80, ignore_eos=True)
        oai = OpenAI(base_url=f"{empty.url}/v1", api_key="none", max_retries=0, timeout=120)
        stream = iter(oai.completions.create(model=name, prompt=prompt, max_tokens=80, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True}))
        pieces = [next(stream).choices[0].text]
        signal_role(full.orchestrator.popen.pid, signal.SIGKILL)
        chunks = list(stream)
        pieces.extend(c.choices[0].text for c in chunks if c.choices)
        assert "".join(pieces) == long.text and chunks[-1].choices[0].finish_reason == "length"
        assert empty.swarm()["groups"]["resumed"] == 1 and empty.swarm()["measured"]["completed"] >= 1
    finally:
        if b is not None:
            b.stop()
        a.stop()


def test_a_restarted_leader_splits_nothing_away_before_it_sees_the_servers():
    """A leader restarted while the follower serves: before its planner reads any server record it published a
    split of no servers (the follower's group emptied, its requests cut), then took the servers for itself. It now
    splits only once it has read the records, keeps servers its young view lacks where they are, and drops a
    server missing from its view only after ``ttl_s``."""
    import asyncio


    seen, entries, now, coordinator, rounds = _servers_world()

    async def main():
        leader, follower = coordinator("A", "B"), coordinator("B", "A")
        await rounds(8, leader, follower)
        before = dict(follower.split)
        assert set(before) == set(seen) and follower.members() and leader.members()
        entries.pop("A")  # the leader dies: its entry expires, the follower leads and takes every server
        await rounds(8, follower)
        assert follower.members() == set(seen)
        before = dict(follower.split)
        leader = coordinator("A", "B")  # restarted, smallest peer id: it leads again
        leader.planner.refreshes, leader.planner.view = 0, {}
        await rounds(3, leader, follower)
        assert follower.split == before and follower.members() == set(seen)
        leader.planner.refreshes, leader.planner.view = 1, {"s0": seen["s0"]}  # a first view, partial
        await rounds(3, leader, follower)
        assert follower.members() | leader.members() == set(seen)
        leader.planner.view = {k: v for k, v in seen.items() if k != "s3"}  # s3 is gone for good
        await rounds(8, leader, follower)
        assert "s3" not in follower.split and follower.members() | leader.members() == {"s0", "s1", "s2"}

    asyncio.run(main())


def test_a_restarted_leader_continues_from_the_split_its_follower_follows():
    """One copy of the model, served by the follower since the leader died: the leader restarts (smallest peer id,
    it leads again), reads nobody's entry for a while (its DHT node joining), then reads the split from the
    follower's entry (followers published none, so it solved from nothing and moved the only copy to itself, cutting
    what ran on it)."""
    import asyncio


    seen, entries, now, coordinator, rounds = _servers_world(1)

    async def main():
        leader, follower = coordinator("A", "B"), coordinator("B", "A")
        await rounds(3, leader, follower)
        entries.pop("A")
        await rounds(8, follower)
        assert follower.members() == {"s0"}
        leader = coordinator("A", "B")
        fetch, island = leader.dht.afetch_groups, [3]

        async def joining(prefix, peers):  # its DHT node still joining: it reads its own entry only, others its
            island[0] -= 1
            return {k: v for k, v in (await fetch(prefix, peers)).items() if k == "A" or island[0] < 0}
        leader.dht.afetch_groups = joining
        await rounds(12, leader, follower)
        assert leader.leader == "A" and follower.members() == {"s0"} and leader.epoch == follower.epoch

    asyncio.run(main())


def test_a_leader_back_from_a_silence_rebalances_the_split():
    """A leader silent past the entries' time to live loses its servers to the other orchestrator; back, it adopted
    that split and its own split cache (same orchestrators, servers and demand) answered with it ever after: its
    group stayed empty for good. It solves afresh and the split is even again."""
    import asyncio



    seen, entries, now, coordinator, rounds = _servers_world(ttl_s=3.0)

    async def main():
        a, b = coordinator("A", "B"), coordinator("B", "A")
        await rounds(5, a, b)
        assert len(a.members()) == len(b.members()) == 2
        entries.pop("A")  # A is silent for longer than the time to live: B takes every server
        await rounds(5, b)
        assert len(b.members()) == 4
        await rounds(6, a, b)
        assert a.leader == "A" and len(a.members()) == len(b.members()) == 2, (a.members(), b.members())

    asyncio.run(main())


def test_forwarding_passes_replies_whole_takes_sessions_along_and_gives_up_on_a_silent_orchestrator(
        tiny_model_factory):
    """The API of an orchestrator whose group has no chain, forwarding to another one (a fake on loopback): its
    replies come back with their headers (Retry-After, SSE's no-cache); a session opened through the forward lives
    there and its later calls here go there (it was opened here, where no chain would ever serve it); a request
    is forwarded even when this queue is full; and a forward to an orchestrator that stopped refreshing its group
    record (hung, its host gone with the connection open) is served here instead of waiting for ever."""
    import asyncio
    import threading
    from types import SimpleNamespace

    import httpx
    from dashboard_helpers import serve_app
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    calls: list = []
    hang = threading.Event()

    async def complete(request):
        calls.append(("complete", request.headers.get("x-petals-chain-forwarded-by")))
        while hang.is_set():  # hung until the test is over: a sleep of an hour held uvicorn's shutdown (10 s)
            await asyncio.sleep(0.05)
        return JSONResponse({"error": {"message": "slow down"}}, status_code=429, headers={"Retry-After": "77"})

    async def open_session(request):
        calls.append(("open",))
        return JSONResponse({"session_id": "far-1", "max_length": 64, "model": "m"})

    async def session(request):
        sid = request.path_params["sid"]
        calls.append((request.method, sid))
        return JSONResponse({"session_id": sid, "closed": request.method == "DELETE"})

    other = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]),
                              Route("/api/v1/sessions", open_session, methods=["POST"]),
                              Route("/api/v1/sessions/{sid}", session, methods=["GET", "DELETE"])])

    model = tiny_model_factory("llama", num_layers=4)
    with serve_app(other) as other_url:
        live = [True]

        async def main():
            cfg = OrchestratorConfig(model=str(model), max_length=64, port=0, no_chain_wait_s=1.0, max_queue=0)
            orch = Orchestrator(cfg)
            orch.load_model()
            await orch.start()
            orch.groups = SimpleNamespace(me="me", forwarded=0, session_owners=__import__(
                "petals_chain.orchestrator.forward", fromlist=["SessionOwners"]).SessionOwners(),
                json=lambda: {"orchestrators": [
                    {"peer_id": "me", "http_url": "http://me", "arrival_rate": 0.0, "servers": 0, "live": True},
                    {"peer_id": "o", "http_url": other_url, "arrival_rate": 0.0, "servers": 2, "live": live[0]}]})
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)),
                                             base_url="http://orch", timeout=60) as c:
                    body = {"model": orch.model_id, "prompt": [1, 2, 3], "max_tokens": 2}
                    # the queue is "full" (max_queue 0): forwarded all the same, the other's reply whole
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 429 and r.headers["retry-after"] == "77", (r.status_code, r.headers)
                    assert r.headers["x-petals-chain-served-by"] == other_url and calls[-1] == ("complete", "me")
                    s = (await c.post("/api/v1/sessions", json={})).json()
                    assert s["session_id"] == "far-1" and calls[-1] == ("open",)
                    assert (await c.get("/api/v1/sessions/far-1")).json()["session_id"] == "far-1"
                    assert (await c.delete("/api/v1/sessions/far-1")).json()["closed"] is True
                    assert calls[-2:] == [("GET", "far-1"), ("DELETE", "far-1")]
                    assert "far-1" not in orch.groups.session_owners
                    # the other orchestrator hangs, then its group record expires: answered here (the queue is full)
                    hang.set()
                    asyncio.get_running_loop().call_later(1.5, lambda: live.__setitem__(0, False))
                    t0 = asyncio.get_running_loop().time()
                    r = await c.post("/v1/completions", json=body)
                    took = asyncio.get_running_loop().time() - t0
                    assert r.status_code == 429 and "x-petals-chain-served-by" not in r.headers and took < 15, (
                        r.status_code, took, r.text)
            finally:
                await orch.stop()

        try:
            asyncio.run(main())
        finally:
            hang.clear()


def test_one_copy_for_two_orchestrators_stays_where_it_is():
    """With fewer complete copies than orchestrators, the groups without one forward their requests to those with
    one: a copy serves every orchestrator's demand wherever it is. Scored on its own group's demand alone, the one
    copy went to the orchestrator receiving least and moved each time the two demands crossed (its chains dropped,
    requests forwarded back and forth)."""
    from petals_chain.algorithms.herd import covered_demand

    one = [GroupServer("s0", 4, 10.0)]
    for holder in ("A", "B"):
        for demand in ({"A": 0.469, "B": 0.398}, {"A": 0.398, "B": 0.469}, {"A": 2.0, "B": 0.1}):
            assert solve_server_groups(one, demand, 4, previous={"s0": holder}) == {"s0": holder}
            assert split_score(one, demand, 4, {"s0": "A"}) == split_score(one, demand, 4, {"s0": "B"})
    assert covered_demand({"A": 1.0, "B": 2.0, "C": 3.0}, ["A", "B"]) == {"A": 2.5, "B": 3.5}


def test_a_forward_waits_for_a_long_one_shot_reply_and_closes_a_cut_stream(monkeypatch):
    """In-process, the other orchestrator a mock: (a) a one-shot reply's head comes only when its generation ends, so
    a forward that gave up after the queue timeout redid long generations here (the other still live); (b) a relayed
    stream the other orchestrator cuts off closes its response and client (the background task that closed them runs
    only after a clean end), and ends with an error event when it samples without a seed."""
    import asyncio
    from types import SimpleNamespace as NS

    import httpx
    from starlette.requests import Request

    import petals_chain.orchestrator.forward as fw

    url, closed = "http://other:8000", []
    real_client = httpx.AsyncClient

    def client_for(handler):
        class Client(real_client):
            def __init__(self, **kw):
                super().__init__(transport=httpx.MockTransport(handler), **kw)

            async def aclose(self):
                closed.append("client")
                await super().aclose()
        return Client

    orch = NS(cfg=NS(queue_timeout_s=0.5), dispatch=NS(chains=[], max_queue=None, queue_length=0),
              groups=NS(me="me", forwarded=0, session_owners=fw.SessionOwners(), json=lambda: {"orchestrators": [
                  {"peer_id": "other", "http_url": url, "live": True, "servers": 3, "arrival_rate": 0.0}]}))

    def request(body: bytes):
        sent = [False]

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "asgi": {"version": "3.0"}}
        return Request(scope, receive), scope, receive

    async def slow(req):
        await asyncio.sleep(2.0)  # admitted at once, generating 4x the queue timeout: the head comes now
        return httpx.Response(200, json={"choices": [{"text": "done"}]})

    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"x":1}\n\n'
            raise httpx.ReadError("the other orchestrator was lost")

        async def aclose(self):
            closed.append("upstream")

    async def cut(req):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Cut())

    async def main():
        monkeypatch.setattr(fw.httpx, "AsyncClient", client_for(slow))
        r = await fw.maybe_forward(orch, request(b'{"prompt":"x"}')[0])
        assert r is not None and r.status_code == 200  # not None: "serve it here"
        monkeypatch.setattr(fw.httpx, "AsyncClient", client_for(cut))
        closed.clear()
        req, scope, receive = request(b'{"prompt":"x","stream":true}')
        resp = await fw.maybe_forward(orch, req)

        got = bytearray()

        async def send(message):
            got.extend(message.get("body", b""))
        await resp(scope, receive, send)  # sampled without a seed: it cannot be finished elsewhere, and says so
        assert sorted(closed) == ["client", "upstream"]
        assert b'"code":"stream_cut"' in got and got.endswith(b"data: [DONE]\n\n")

    asyncio.run(main())


def _chat_events(cid: str, pieces: list[str], end: bool = True) -> bytes:
    import json

    def ev(obj):
        return f"data: {json.dumps(obj)}\n\n".encode()
    out = ev({"id": cid, "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "finish_reason": None}]})
    for p in pieces:
        out += ev({"id": cid, "created": 1, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]})
    if end:
        out += ev({"id": cid, "created": 1, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        out += b"data: [DONE]\n\n"
    return out


@pytest.mark.parametrize("case", ["resumed", "resumed_after_a_refusal", "mismatch", "sampled"])
def test_a_forwarded_stream_cut_off_is_finished_here_without_repeating_text(monkeypatch, case):
    """In-process, the orchestrators mocks: the one a chat stream was forwarded to dies in its third piece of text; a
    reproducible stream is run again where a chain is (here: ``local_url``; first refused with 503 in one case) and
    the client gets each piece once, under the first run's id, ending with [DONE]; a rerun that gives another text
    ends with an error event rather than a corrupted one; an unseeded sampled stream ends with an error event."""
    import asyncio
    import json
    from types import SimpleNamespace as NS

    import httpx
    from starlette.requests import Request

    import petals_chain.orchestrator.forward as fw
    import petals_chain.orchestrator.resume as resume

    other, here = "http://other:8000", "http://127.0.0.1:9000"
    real_client, calls = httpx.AsyncClient, []
    full = ["Hel", "lo", " wor", "ld"]

    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            data = _chat_events("chatcmpl-first", full[:3], end=False)
            yield data[:40]
            yield data[40:-7]  # the third piece's event is cut off before its end
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    class Whole(httpx.AsyncByteStream):
        def __init__(self, data: bytes):
            self.data = data

        async def __aiter__(self):
            for k in range(0, len(self.data), 50):
                yield self.data[k:k + 50]

    def handler(req: httpx.Request):
        calls.append((str(req.url.copy_with(path="/")), dict(req.headers)))
        if req.url.host == "other":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Cut())
        if case == "resumed_after_a_refusal" and len(calls) == 2:
            return httpx.Response(503, json={"error": {"message": "no chain"}})
        pieces = ["Hel", "LO", " wor", "ld"] if case == "mismatch" else full
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Whole(_chat_events("chatcmpl-rerun", pieces)))

    class Client(real_client):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(handler), **kw)

    monkeypatch.setattr(fw.httpx, "AsyncClient", Client)
    monkeypatch.setattr(resume, "RESUME_PAUSE_S", 0.0)
    orch = NS(dispatch=NS(chains=["a chain"], max_queue=None, queue_length=0), local_url=here,
              groups=NS(me="me", forwarded=0, resumed=0, session_owners=fw.SessionOwners(), json=lambda: {"orchestrators": [
                  {"peer_id": "other", "http_url": other, "live": True, "servers": 3, "arrival_rate": 0.0}]}))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4,
            **({"temperature": 0.7} if case == "sampled" else {"temperature": 0})}
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.sleep(3600)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer k")],
             "asgi": {"version": "3.0"}}
    got = bytearray()

    async def send(message):
        got.extend(message.get("body", b""))

    async def main():
        orch.dispatch.chains = []  # no chain here when the request comes: forwarded
        resp = await fw.maybe_forward(orch, Request(scope, receive))
        orch.dispatch.chains = ["a chain"]  # this group has one by the time the other dies
        await resp(scope, receive, send)

    asyncio.run(main())
    events = [e for e in bytes(got).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-1]]
    if case == "sampled":
        assert objs[-1]["error"]["code"] == "stream_cut" and len(calls) == 1
        return
    if case == "mismatch":
        assert objs[-1]["error"]["code"] == "resume_mismatch" and objs[-1]["error"]["status"] == 502
        assert "".join(o["choices"][0]["delta"].get("content", "") for o in objs[:-1]) == "Hello"
        return
    text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs)
    assert text == "".join(full)  # " wor" came cut off, so was not relayed before the cut: sent once, by the rerun
    assert [o["choices"][0]["delta"].get("role") for o in objs].count("assistant") == 1
    assert {o["id"] for o in objs} == {"chatcmpl-first"}
    assert objs[-1]["choices"][0]["finish_reason"] == "length"
    reruns = calls[1:]
    assert all(url == here + "/" for url, _ in reruns) and len(reruns) == (2 if case == "resumed_after_a_refusal" else 1)
    assert all(h[fw.FORWARDED_HEADER] == "me" and resume.is_resume(h) and h["authorization"] == "Bearer k"
               for _, h in reruns)
    assert not resume.is_resume({resume.RESUME_HEADER: "guessed"}) and orch.groups.resumed == 1


def test_a_request_to_an_orchestrator_that_has_not_read_the_split_yet_waits_for_a_target(monkeypatch, scaled):
    """Just restarted, an orchestrator knows no group with a chain: a request it queued waited for its own group's
    chain (up to --no-chain-wait-s, then 503) while the other group served. It now waits briefly for a target to be
    known (forwarded), or for a chain of its own (served here), never past the request's deadline; once it knows
    the split it does not wait."""
    import asyncio
    from types import SimpleNamespace as NS

    import httpx
    from starlette.requests import Request

    import petals_chain.orchestrator.forward as fw

    real_client, sent = httpx.AsyncClient, []

    class Client(real_client):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(
                lambda req: sent.append(str(req.url)) or httpx.Response(200, json={"choices": []})), **kw)

    monkeypatch.setattr(fw.httpx, "AsyncClient", Client)
    known: list = []
    orch = NS(dispatch=NS(chains=[], max_queue=None, queue_length=0),
              groups=NS(me="me", forwarded=0, session_owners=fw.SessionOwners(), epoch=0,
                        json=lambda: {"orchestrators": list(known)}))

    def request(body: bytes = b'{"prompt": "x"}'):
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                        "headers": [(b"content-type", b"application/json")]}, receive)

    async def later(s, fn):
        await asyncio.sleep(s)
        fn()

    async def main():
        t0 = time.monotonic()
        asyncio.ensure_future(later(0.6, lambda: known.append(
            {"peer_id": "other", "http_url": "http://other:1", "live": True, "servers": 1, "arrival_rate": 0.0})))
        r = await fw.maybe_forward(orch, request())
        assert r is not None and sent == ["http://other:1/v1/completions"] and 0.5 < time.monotonic() - t0 < 3
        known.clear()
        t0 = time.monotonic()
        asyncio.ensure_future(later(0.6, lambda: orch.dispatch.chains.append("a chain")))
        assert await fw.maybe_forward(orch, request()) is None and time.monotonic() - t0 < 3  # served here
        orch.dispatch.chains.clear()
        # nothing becomes known: a request with a deadline waits no longer than its nearer deadline (then handled
        # here, which drops it at once), not the 10 s a request without one waits
        t0 = time.monotonic()
        assert await fw.maybe_forward(orch, request(b'{"prompt": "x", "deadline_ms": 5000, "ttft_deadline_ms": 400}'
                                                     )) is None
        # (the upper bounds are load's allowance, scaled, but well under the 10 s wait they rule out)
        assert 0.35 < time.monotonic() - t0 < min(scaled(1.5), 5.0) and sent == ["http://other:1/v1/completions"]
        orch.groups.epoch = 3  # it knows the split: no group has a chain, nothing to wait for
        t0 = time.monotonic()
        assert await fw.maybe_forward(orch, request()) is None and time.monotonic() - t0 < scaled(0.2)

    asyncio.run(main())
