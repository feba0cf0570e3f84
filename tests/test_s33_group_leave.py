"""A stopping orchestrator leaves its HERD group at once (GroupCoordinator.leave, called as the drain begins).

Before, a draining orchestrator kept refreshing its group entry for the whole grace (5 s), so its peers forwarded
requests to it and left its servers to it until ttl_s after its process had gone: 12 rounds (s) here."""

import asyncio
from types import SimpleNamespace

from test_failover_units import record
from test_herd_groups import _group_world

from petals_chain.orchestrator.forward import forward_target
from petals_chain.swarm.records import EPOCH_MAX, GroupRecord

NO_CHAIN = SimpleNamespace(chains=[], max_queue=None, queue_length=0)


def _world(n_servers: int = 4, **kwargs):
    seen = {f"s{i}": record(f"s{i}") for i in range(n_servers)}
    entries: dict = {}
    now = [0.0]
    coordinator, rounds = _group_world(seen, entries, now, **kwargs)  # ttl_s = 6, rounds a second apart
    return seen, entries, coordinator, rounds


async def _two(coordinator, rounds):
    a, b = coordinator("A", "B"), coordinator("B", "A")
    a.http_url, b.http_url = (lambda: "http://a:1"), (lambda: "http://b:1")
    await rounds(10, a, b)
    assert a.live() == b.live() == ["A", "B"] and len(a.members()) == len(b.members()) == 2
    return a, b


def test_the_leader_leaves_and_the_other_takes_its_servers_and_the_lead_in_one_round():
    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)  # A leads (smallest peer id)
        assert forward_target(SimpleNamespace(groups=b, dispatch=NO_CHAIN)) == "http://a:1"
        mine, epoch = a.members(), b.epoch
        assert await a.leave() is True
        assert a.planner.group == mine  # its servers stay planned until the split that hands them over is read
        assert entries["A"].epoch == EPOCH_MAX and entries["A"].http_url == "" and not entries["A"].groups
        await rounds(1, a, b)
        assert b.live() == ["B"] and b.leader == "B" and b.members() == set(seen) and b.epoch == epoch + 1
        assert forward_target(SimpleNamespace(groups=b, dispatch=NO_CHAIN)) is None  # nothing forwarded to A
        assert [o["peer_id"] for o in b.json()["orchestrators"] if o["live"]] == ["B"]
        await rounds(1, a, b)
        assert a.members() == set() and a.planner.group == set() and a.json()["leaving"]
        for _ in range(10):  # the grace goes on: A publishes nothing more, B stays the only one, no epoch churn
            await rounds(1, a, b)
            assert entries["A"].epoch == EPOCH_MAX and b.live() == ["B"] and b.epoch == epoch + 1

    asyncio.run(main())


def test_a_follower_leaves_and_the_leader_takes_its_servers_in_one_round():
    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)
        assert await b.leave() is True
        await rounds(1, a, b)
        assert a.live() == ["A"] and a.leader == "A" and a.members() == set(seen)
        await rounds(1, a, b)
        assert b.members() == set() and b.planner.group == set()

    asyncio.run(main())


def test_three_orchestrators_split_the_leavers_servers_and_forward_only_between_them():
    seen, entries, coordinator, rounds = _world(6)

    async def main():
        cs = {o: coordinator(o, "") for o in "ABC"}
        for o, c in cs.items():
            c.peers = set(cs) - {o}
            c.http_url = (lambda o=o: f"http://{o.lower()}:1")
        await rounds(12, *cs.values())
        assert all(c.live() == ["A", "B", "C"] and len(c.members()) == 2 for c in cs.values())
        assert await cs["B"].leave()
        await rounds(2, *cs.values())
        a, c = cs["A"], cs["C"]
        assert a.live() == c.live() == ["A", "C"] and a.members() | c.members() == set(seen)
        assert not a.members() & c.members() and cs["B"].members() == set()
        assert forward_target(SimpleNamespace(groups=c, dispatch=NO_CHAIN)) == "http://a:1"

    asyncio.run(main())


def test_an_older_peer_ignores_the_leave_and_drops_the_leaver_after_ttl_as_before():
    """An older peer drops every entry at EPOCH_MAX as it reads (so does this version before it looks for leaves):
    the leave is no heartbeat, the leaver is dropped ttl_s after its last entry (a crash's handling), and meanwhile
    the leaver keeps planning its servers (none idles). The leave is a value the DHT's schema takes."""
    from petals_chain.swarm.records import _GroupValueV1

    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)
        fetch = b.dht.afetch_groups

        async def older(prefix, peers):  # what HEAD's step kept of a read
            return {o: rec for o, rec in (await fetch(prefix, peers)).items() if rec.epoch < EPOCH_MAX}
        b.dht.afetch_groups = older
        mine, epoch = a.members(), b.epoch
        await a.leave()
        value = entries["A"].to_value()
        assert _GroupValueV1.parse_obj(value).dict() == value and GroupRecord.from_value(value).epoch == EPOCH_MAX
        took = None
        for k in range(1, 12):
            await rounds(1, a, b)
            if b.live() == ["A", "B"]:
                assert a.members() == mine and a.planner.group == mine and b.epoch == epoch
            elif took is None:
                took = k
        assert took is not None and 5 <= took <= 8, took  # ttl_s (6) after A's last entry, as for a crash
        assert b.members() == set(seen) and a.members() == set() and b.epoch == epoch + 1

    asyncio.run(main())


def test_a_round_under_way_when_the_leave_comes_never_stores_its_entry_after_it():
    """The drain's leave runs beside the group loop: a round that was reading or splitting then published a normal
    entry after the leave, which made the leaver live again for the others."""
    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)
        store, gate, waiting = a.dht.apublish_group, asyncio.Event(), asyncio.Event()

        async def slow(prefix, rec, ttl):
            if rec.epoch < EPOCH_MAX:  # a round's entry: held in the DHT call until the leave has begun
                waiting.set()
                await gate.wait()
            return await store(prefix, rec, ttl)
        a.dht.apublish_group = slow
        a._published_at = -float("inf")  # this round publishes
        round_ = asyncio.ensure_future(a.step())
        await waiting.wait()
        leave = asyncio.ensure_future(a.leave())
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(round_, leave)
        assert entries["A"].epoch == EPOCH_MAX
        # and a round that begins after the leave stores nothing
        gate.clear()
        waiting.clear()
        a._published_at = -float("inf")
        await asyncio.wait_for(a.step(), 5)
        assert entries["A"].epoch == EPOCH_MAX and not waiting.is_set()
        await rounds(1, b)
        assert b.live() == ["B"] and b.members() == set(seen)

    asyncio.run(main())


def test_a_round_splitting_when_the_leave_comes_stores_nothing_after_it():
    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)  # A leads: each round of it splits (from its cache)
        split, gate, waiting = a.compute_split, asyncio.Event(), asyncio.Event()

        async def slow(live):
            waiting.set()
            await gate.wait()
            return await split(live)
        a.compute_split = slow
        a._published_at = -float("inf")  # this round publishes
        round_ = asyncio.ensure_future(a.step())
        await waiting.wait()
        assert await a.leave() is True
        gate.set()
        await round_
        assert entries["A"].epoch == EPOCH_MAX
        await rounds(1, b)
        assert b.live() == ["B"] and b.members() == set(seen)

    asyncio.run(main())


def test_a_leave_the_dht_refuses_or_fails_is_a_warning_and_a_second_leave_stores_nothing(caplog):
    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)
        calls = []

        async def broken(prefix, rec, ttl):
            calls.append(rec)
            raise ConnectionError("dht process gone")
        a.dht.apublish_group = broken
        assert await a.leave() is False and len(calls) == 1
        assert await a.leave() is False and len(calls) == 1  # once
        await rounds(3, a, b)  # no entry of A stored since: B drops it ttl_s after its last one, as for a crash
        assert len(calls) == 1 and b.live() == ["A", "B"]
        await rounds(6, a, b)
        assert b.live() == ["B"] and b.members() == set(seen)

        c = _world()[2]("A", "B")

        async def refused(prefix, rec, ttl):
            return False
        c.dht.apublish_group = refused
        assert await c.leave() is False

    caplog.set_level("WARNING", logger="petals_chain.orchestrator.groups")
    asyncio.run(main())
    msgs = [r.getMessage() for r in caplog.records if r.name == "petals_chain.orchestrator.groups"]
    assert any("ConnectionError: dht process gone" in m for m in msgs), msgs
    assert any("did not store" in m for m in msgs), msgs


def test_an_orchestrator_restarted_after_leaving_is_live_again_though_a_replica_still_holds_its_leave():
    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)
        await a.leave()
        leave = entries["A"]
        await rounds(2, a, b)
        assert b.live() == ["B"]
        a2 = coordinator("A", "B")  # the same identity, restarted
        flip = [0]
        fetch = b.dht.afetch_groups

        async def replicas(prefix, peers):  # one replica still answers the leave, the other the new entries
            flip[0] += 1
            got = await fetch(prefix, peers)
            return {**got, "A": leave} if flip[0] % 2 else got
        b.dht.afetch_groups = replicas
        await rounds(3, a2, b)
        for _ in range(12):
            await rounds(1, a2, b)
            assert b.live() == ["A", "B"]
        assert len(a2.members()) == len(b.members()) == 2 and not a2.members() & b.members()

    asyncio.run(main())


def test_a_peer_reads_a_leave_another_process_wrote_and_drops_it_in_one_round():
    """The reader's side alone (the leaver is another process, another version's reader is this one): a leave
    entry read once drops its writer, and its leader splits at once."""
    seen, entries, coordinator, rounds = _world()

    async def main():
        a, b = await _two(coordinator, rounds)
        entries["A"] = GroupRecord(orchestrator_peer_id="A", epoch=EPOCH_MAX, timestamp=entries["A"].timestamp + 1)
        await rounds(1, b)
        assert b.live() == ["B"] and b.leader == "B" and b.members() == set(seen)

    asyncio.run(main())


def test_a_leave_replaces_the_last_entry_in_a_real_dht():
    """On hivemind (two nodes on loopback): the leave passes the swarm's schema and signature validators and
    replaces the orchestrator's last entry (a subkey keeps the value of latest expiration), for its peers to read."""
    import time

    from petals_chain.orchestrator.groups import GroupCoordinator
    from petals_chain.swarm.dht import SwarmDHT

    prefix = "leave-test"
    a = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix=prefix)
    try:
        b = SwarmDHT.create(initial_peers=a.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix=prefix)
        try:
            async def main():
                g = GroupCoordinator(dht=a, prefix=prefix, peers=[b.peer_id], planner=SimpleNamespace(group=None),
                                     http_url=lambda: "http://a:1", ttl_s=30.0)
                beat = GroupRecord(orchestrator_peer_id=a.peer_id, http_url="http://a:1", epoch=3,
                                   groups={a.peer_id: ["s0"], b.peer_id: ["s1"]})
                assert await a.apublish_group(prefix, beat, 30.0)
                assert await g.leave() is True
                deadline, got = time.monotonic() + 30, None
                while time.monotonic() < deadline:
                    got = (await b.afetch_groups(prefix, [a.peer_id])).get(a.peer_id)
                    if got is not None and got.epoch == EPOCH_MAX:
                        break
                    await asyncio.sleep(0.2)
                assert got is not None and got.epoch == EPOCH_MAX and not got.groups and got.http_url == ""

            asyncio.run(main())
        finally:
            b.shutdown()
    finally:
        a.shutdown()
