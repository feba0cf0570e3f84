"""Review of the dispatch commit that counts a re-planned job against a new chain sharing its servers.

A job whose chain a re-plan dropped still holds a slot on each of its servers: it must take a place on a chain through
each of them that the plan still uses, not on one chain only; a job running on a chain the plan kept keeps its place
before any carried job takes it; a freed slot goes to a carried job in O(hops), not by a scan of every carried job.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager
from petals_chain.orchestrator.fairness import ClientShares

L = 6  # blocks of the random models


def _chain(servers, spans, cap, service=1.0):
    return Chain(servers=tuple(servers), blocks=tuple(b - a for a, b in spans), service_time=service, capacity=cap,
                 spans=tuple(spans))


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_job_of_a_chain_split_over_two_new_chains_takes_a_place_on_each():
    """The plan composed s1 -> s3 and s4 -> s2 (capacity 1 each) after s1 -> s2: the old job still holds s1 and s2.
    Before: it was counted on s1 -> s3 only, and a new job started at once on s4 -> s2 (two jobs on s2's one slot)."""
    async def run():
        m = DispatchManager()
        m.set_chains([_chain(["s1", "s2"], [(0, 15), (15, 30)], 1)])
        old = await m.acquire(DispatchJob(job_id="old"))
        m.set_chains([_chain(["s1", "s3"], [(0, 15), (15, 30)], 1), _chain(["s4", "s2"], [(0, 15), (15, 30)], 1, 2.0)])
        new = asyncio.ensure_future(m.acquire(DispatchJob(job_id="new")))
        await _settle()
        assert not new.done(), f"started on {new.result().chain.servers} while the old job holds s1 and s2"
        assert (m.active(0), m.active(1)) == (1, 1)
        m.release(old)  # both places free: the new job takes the fastest
        await _settle()
        assert new.done() and new.result().index == 0 and (m.active(0), m.active(1)) == (1, 0)
        m.release(old)  # a second release frees nothing
        m.release(new.result())
        assert m.running == 0 and (m.active(0), m.active(1)) == (0, 0)
    asyncio.run(run())


def test_a_job_of_a_kept_chain_keeps_its_place_before_a_carried_one():
    """Chains X and Y over the same servers; the plan keeps X (capacity 1) and drops Y. Before: Y's job, earlier in
    the running order, took X's place, and X's own job was left uncounted, then taken as carried (its steps ignored)."""
    X = _chain(["s1", "s2"], [(0, 15), (15, 30)], 1)
    Y = _chain(["s1", "s2"], [(0, 10), (10, 30)], 1, 0.5)  # the faster: the first job starts there

    async def run():
        m = DispatchManager()
        m.set_chains([Y, X])
        y = await m.acquire(DispatchJob(job_id="y"))
        x = await m.acquire(DispatchJob(job_id="x"))
        assert y.chain == Y and x.chain == X
        m.set_chains([X])
        assert x.generation == m.generation and x.index == 0 and not x.carried
        assert y.generation != m.generation  # waits for X's next free slot
        waiting = asyncio.ensure_future(m.acquire(DispatchJob(job_id="w")))
        await _settle()
        m.release(x)  # X's slot goes to y (it still holds s1, s2), not to the waiting job
        await _settle()
        assert not waiting.done() and y.generation == m.generation and y.carried and m.active(0) == 1
        m.release(y)
        await _settle()
        assert waiting.done() and m.active(0) == 1
        m.release(waiting.result())
        assert m.running == 0 and m.active(0) == 0
    asyncio.run(run())


def test_a_freed_slot_finds_its_carried_job_without_a_scan(monkeypatch):
    """A re-plan lowering 100 re-split chains' capacities left 900 jobs waiting for a place: before, every release
    scanned all of them, each against every chain (900 releases blocked the event loop ~5 s)."""
    def plan(shift, cap):
        return [_chain([f"s{i}a", f"s{i}b", f"s{i}c"], [(0, 10 + shift), (10 + shift, 20), (20, 30)], cap,
                       1.0 + i / 100) for i in range(100)]

    async def run():
        m = DispatchManager()
        m.set_chains(plan(0, 10))
        leases = [await m.acquire(DispatchJob(job_id=f"j{i}")) for i in range(1000)]
        m.set_chains(plan(1, 1))
        scans = []
        monkeypatch.setattr(m, "_by_overlap", lambda chain: scans.append(chain) or [])
        for lease in leases[:900]:  # chain k ran jobs 10k .. 10k + 9: each release hands its place to the next one
            m.release(lease)
        assert not scans
        assert [m.active(k) for k in range(100)] == [0] * 90 + [1] * 10 and m.running == 100
        assert len(m._carried) == 90
        for lease in leases[900:]:
            m.release(lease)
        assert m.running == 0 and all(m.active(k) == 0 for k in range(100))
    asyncio.run(run())


# ---- randomized: acquire / release / re-plan against a brute-force model of the servers' places --------------------

def _random_chain(rng: random.Random, servers: list[str]) -> Chain:
    cuts = sorted(rng.sample(range(1, L), rng.randint(0, 2)))
    bounds = [0, *cuts, L]
    names = rng.sample(servers, len(bounds) - 1)
    return _chain(names, list(zip(bounds, bounds[1:])), rng.randint(0, 2), rng.uniform(0.5, 3.0))


def _resplit(rng: random.Random, ch: Chain) -> Chain:
    """The same servers with an inner boundary moved by a block (a new chain key), capacity redrawn."""
    spans = [list(s) for s in ch.spans]
    i = rng.randrange(len(spans) - 1)
    cut = spans[i][1] + rng.choice((-1, 1))
    if not spans[i][0] < cut < spans[i + 1][1]:
        return _chain(ch.servers, ch.spans, rng.randint(0, 2), ch.service_time)
    spans[i][1] = spans[i + 1][0] = cut
    return _chain(ch.servers, [tuple(s) for s in spans], rng.randint(0, 2), ch.service_time)


def _plan(rng: random.Random, chains: list[Chain], servers: list[str]) -> list[Chain]:
    new = []
    for ch in chains:
        r = rng.random()
        if r < 0.4 and len(ch.servers) > 1:
            new.append(_resplit(rng, ch))
        elif r < 0.7:
            new.append(ch)
    while len(new) < 1 or rng.random() < 0.3:
        new.append(_random_chain(rng, servers))
    unique = {(ch.servers, tuple(ch.spans)): ch for ch in new}
    return list(unique.values())


def _admitted(chains: list[Chain]) -> dict[str, int]:
    """Places each server has: the capacities of the chains through it (GCA sizes them on its slots)."""
    places: dict[str, int] = {}
    for ch in chains:
        for server in ch.servers:
            places[server] = places.get(server, 0) + int(ch.capacity)
    return places


def _shares(policy: str) -> ClientShares | None:
    if policy == "jffc":
        return None
    return ClientShares(FairPolicy(policy, FairnessConfig()), registry=CollectorRegistry(), keyed=True)


@pytest.mark.parametrize("policy", ["jffc", "d2lpm", "d-vtc"])
def test_random_replans_never_start_a_job_on_a_server_without_a_place(policy):
    """Random acquire / release / re-plan (chains re-split, dropped, new, capacities redrawn): whenever a job starts,
    each of its servers holds no more running jobs than the chains through it admit; each chain's count is the jobs
    counted on it, within its capacity at every start; a release frees only the places it took."""
    servers = [f"s{i}" for i in range(5)]

    async def run(seed: int) -> int:
        rng = random.Random(seed)
        m = DispatchManager(shares=_shares(policy))
        m.set_chains(_plan(rng, [_random_chain(rng, servers) for _ in range(3)], servers))
        tasks: list[asyncio.Future] = []
        released: set = set()
        checked = 0

        def check(before: set) -> None:
            nonlocal checked
            running = list(m._running.values())
            held: dict[str, int] = {}
            for lease in running:
                for server in lease.chain.servers:
                    held[server] = held.get(server, 0) + 1
            places = _admitted(m.chains)
            counted: dict[int, int] = {}
            for lease in running:
                if lease.generation == m.generation:
                    for k in (lease.index, *getattr(lease, "also", ())):
                        counted[k] = counted.get(k, 0) + 1
            for k in range(len(m.chains)):
                assert m.active(k) == counted.get(k, 0), (seed, k, m.active(k), counted)
            for lease in running:
                if lease.job in before:
                    continue
                checked += 1  # it started in this step
                assert lease.generation == m.generation and not lease.carried
                for server in lease.chain.servers:
                    assert held[server] <= places.get(server, 0), (seed, server, held, places, lease.chain)
                assert m.active(lease.index) <= int(m.chains[lease.index].capacity), seed

        for _ in range(60):
            before = set(m._running)
            op = rng.random()
            if op < 0.45:
                job = DispatchJob(job_id=f"j{len(tasks)}", client=rng.choice(("a", "b")))
                tasks.append(asyncio.ensure_future(m.acquire(job)))
            elif op < 0.85:
                live = [t.result() for t in tasks if t.done() and t.result() not in released]
                if live:
                    lease = rng.choice(live)
                    released.add(lease)
                    m.release(lease)
                    if rng.random() < 0.2:
                        m.release(lease)  # twice: frees nothing more
            else:
                chains = _plan(rng, m.chains, servers)
                m.set_chains(chains)
            await _settle()
            check(before)
        for t in tasks:  # drain: every job ends, every count goes back to zero
            if not t.done():
                t.cancel()
        await _settle()
        for t in tasks:
            if not t.cancelled() and t.result() not in released:
                released.add(t.result())
                m.release(t.result())
        await _settle()
        assert m.running == 0 and not m._carried and not getattr(m, "_carried_on", None), seed
        assert all(m.active(k) == 0 for k in range(len(m.chains))), seed
        return checked

    starts = sum(asyncio.run(run(seed)) for seed in range(40))
    assert starts > 200  # the sequences did start jobs across re-plans
