"""The chain simulator's KV as the servers' paged cache holds it (petals_chain/algorithms/chainsim.py): a request is
admitted only when its whole reservation (prompt + declared output, page-rounded) fits beside the running ones', so
a chain's KV never exceeds ``kv_tokens``; paused KV is cached and evicted for reservations; a request no chain can
hold is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from petals_chain.algorithms import chainsim as cs
from petals_chain.algorithms import multimodel as mm
from petals_chain.algorithms.chainsim import MMRequest, MultiModelSim, exec_alone, simulate
from petals_chain.algorithms.multimodel import ServedModel, Volunteer
from petals_chain.sim import multimodel as ms

COST = cs.MM_COST
PAGE = 16


def _req(rid: int, model: str, t: float, inp: int, out: int, **kw) -> MMRequest:
    return MMRequest(rid, model, t, inp, out, exec_alone(inp, out, COST), **kw)


def _pages(r: MMRequest) -> int:
    """What a server reserves for ``r``, computed here from the request alone."""
    return math.ceil((r.input + r.output) / PAGE) * PAGE


class CheckedSim(MultiModelSim):
    """Asserts after every batch choice and every step that no chain's KV exceeds its pages."""

    checks = 0

    def _check(self) -> None:
        for w in self.workers.values():
            assert w.kv_used <= w.kv_tokens, (self.now, w.key, w.kv_used, w.kv_tokens)
            batch_kv = sum(_pages(j.key) for j in w.batch)
            assert batch_kv <= w.kv_tokens, (self.now, w.key, batch_kv, w.kv_tokens)
            self.checks += 1

    def _start_step(self, w) -> None:
        super()._start_step(w)
        self._check()

    def _end_step(self, w, dt: float) -> None:
        super()._end_step(w, dt)
        self._check()


def _workload(seed: int, n: int, models: tuple[str, ...], rate: float) -> list[MMRequest]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [_req(i, models[int(rng.integers(len(models)))], float(t[i]), int(rng.integers(1, 900)),
                 int(rng.integers(1, 150))) for i in range(n)]


@pytest.mark.parametrize("schedule,pauses", [("db", "runtime"), ("db", "seed"), ("fcfs", "runtime"),
                                             ("mlfq", "runtime")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_chains_kv_never_exceeds_its_pages_on_random_workloads(schedule, pauses, seed):
    """Overload (about 2x a chain's throughput) on 2000 KV tokens: before, running requests' decode growth went
    past kv_tokens (4834 of 4000 tokens in the reproducer); now every step stays within, every request finishes,
    under either pause rule."""
    reqs = _workload(seed, 250, ("a", "b"), 40.0)
    models = [ServedModel(n, 1, 1.0, 0.01, 1.0, rate=10.0, c=16) for n in "ab"]
    vols = [Volunteer(f"s{i}", 100.0) for i in range(3)]
    sim = CheckedSim(models, vols, {"s0": "a", "s1": "a", "s2": "b"}, schedule=schedule, cost=COST, max_batch=16,
                     kv_tokens=2000, monitor_priors={"a": (1.0, 0.5), "b": (1.0, 0.5)},
                     sched_kw=cs.sched_kwargs(schedule, COST, reqs, 16), pauses=pauses)
    o = sim.run(reqs)
    assert sim.checks > 500 and o.unfinished == 0
    assert all(r.done == r.output and r.arrival <= r.first_token <= r.finished for r in o.requests)
    if schedule == "db":  # paused KV was kept, and reservations evicted some of it (recomputed on resume)
        assert sum(r.preemptions for r in o.requests) > 0 and sum(r.recomputes for r in o.requests) > 0


def test_kv_stays_within_pages_when_chains_time_share_models_and_servers_move():
    """The seed's shared groups (one step runs one LLM) and re-placement (requests migrate without their KV)."""
    reqs = _workload(7, 200, ("a", "b"), 30.0)
    models = [ServedModel("shared", 1, 1.0, 0.01, 1.0, rate=10.0, c=16)]
    vols = [Volunteer(f"s{i}", 100.0) for i in range(2)]
    flips = iter(range(10**6))

    def replan(sim: MultiModelSim, now: float):
        return ({"s1": "shared"} if next(flips) % 2 else {}), now + 1.0

    sim = CheckedSim(models, vols, {"s0": "shared", "s1": "shared"}, schedule="db", cost=COST, max_batch=8,
                     kv_tokens=1500, group_of={"a": "shared", "b": "shared"}, reload_s=0.5, replan=replan,
                     replan_first=0.5, monitor_priors={"a": (1.0, 0.5), "b": (1.0, 0.5)})
    o = sim.run(reqs)
    assert o.unfinished == 0 and sim.checks > 200


def test_a_request_waits_until_its_whole_reservation_fits():
    """5 pages (80 tokens): A reserves 3 pages, B 1; C's prompt alone (10 tokens) would fit, its reservation (2 pages)
    does not until B finishes. Before, C was admitted at once on its prompt."""
    models = [ServedModel("m", 1, 1.0, 0.01, 1.0, rate=1.0, c=8)]
    a, b, c = _req(0, "m", 0.0, 10, 30), _req(1, "m", 0.0, 10, 5), _req(2, "m", 0.001, 10, 10)
    o = simulate([a, b, c], models, [Volunteer("v", 100.0)], {"v": "m"}, "fcfs", cost=COST, max_batch=8,
                 kv_tokens=80)
    a, b, c = o.requests
    assert o.unfinished == 0 and o.refused == 0
    assert c.admitted >= b.finished > b.admitted > a.admitted == 0.0 and a.finished > c.admitted
    # a declared max_tokens above the output reserves for the declaration: C (10 + 54 = 4 pages) waits for A
    c2 = _req(2, "m", 0.001, 10, 10, max_tokens=54)
    o = simulate([_req(0, "m", 0.0, 10, 30), _req(1, "m", 0.0, 10, 5), c2], models, [Volunteer("v", 100.0)],
                 {"v": "m"}, "fcfs", cost=COST, max_batch=8, kv_tokens=80)
    a, b, c = o.requests
    assert c.max_tokens == 54 and c.admitted >= max(a.finished, b.finished)


def test_paused_kv_is_cached_and_a_reservation_evicts_it():
    """DB pauses a long request (304 tokens reserved) for a short one (112): the long one's KV stays as cached pages
    and, with room, it resumes without recomputing. A short request declaring 300 tokens (400 reserved) then fits
    in 432 tokens only by evicting that cache: the long request recomputes its prompt and tokens once."""
    models = [ServedModel("m", 1, 1.0, 0.01, 1.0, rate=1.0, c=1)]

    def run(kv_tokens: int) -> MMRequest:
        reqs = [_req(0, "m", 0.0, 100, 200, service="long"), _req(1, "m", 0.5, 100, 3, service="short"),
                _req(2, "m", 0.51, 100, 3, service="short", max_tokens=300)]
        o = simulate(reqs, models, [Volunteer("v", 100.0)], {"v": "m"}, "db", cost=COST, max_batch=1,
                     kv_tokens=kv_tokens)
        assert o.unfinished == 0 and all(r.done == r.output for r in o.requests)
        return o.requests[0]

    roomy = run(4000)
    assert roomy.preemptions > 0 and roomy.recomputes == 0
    tight = run(432)
    assert tight.preemptions > 0 and tight.recomputes == 1


def test_the_reservation_is_what_a_paged_server_reserves():
    from petals_chain.server.kv_cache import pages_for
    from petals_chain.swarm.memory import DEFAULT_PAGE_SIZE, slot_tokens

    assert cs.PAGE_SIZE == DEFAULT_PAGE_SIZE
    for inp, out, mt in [(1, 1, None), (10, 6, None), (10, 7, None), (1000, 129, None), (5, 3, 40), (0, 16, None)]:
        r = _req(0, "m", 0.0, inp, out, max_tokens=mt)
        n = inp + (out if mt is None else mt)
        assert r.reservation() == pages_for(n, DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
        if n >= DEFAULT_PAGE_SIZE:
            assert r.reservation() == slot_tokens("paged", n, DEFAULT_PAGE_SIZE)
    assert _req(0, "m", 0.0, 10, 7).reservation(page_size=4) == 20


def test_a_request_no_chain_can_hold_is_refused_and_the_rest_run():
    """Before, it ran alone on an empty chain with 2x the chain's KV."""
    models = [ServedModel("m", 1, 1.0, 0.01, 1.0, rate=1.0, c=4)]
    reqs = [_req(0, "m", 0.0, 50, 10), _req(1, "m", 0.1, 900, 200), _req(2, "m", 0.2, 50, 10)]
    o = simulate(reqs, models, [Volunteer("v", 100.0)], {"v": "m"}, "db", cost=COST, max_batch=4, kv_tokens=512)
    big = o.requests[1]
    assert o.refused == 1 and o.unfinished == 1 and big.refused and big.done == 0 and math.isnan(big.finished)
    assert all(r.done == r.output for r in o.requests if r is not big)
    assert ms.summarize(o.requests)["requests"] == 2


def test_bad_kv_settings_and_declarations_are_refused_clearly():
    models = [ServedModel("m", 1, 1.0, 0.01, 1.0, rate=1.0, c=4)]
    for kw in ({"kv_tokens": 0}, {"page_size": 0}, {"kv_tokens": 10.5}):
        with pytest.raises(ValueError, match="positive integer"):
            MultiModelSim(models, [Volunteer("v", 100.0)], {"v": "m"}, **kw)
    with pytest.raises(ValueError, match="max_tokens 5 < its output 10"):
        _req(0, "m", 0.0, 10, 10, max_tokens=5)
    r = _req(3, "m", 1.0, 10, 10, max_tokens=30)
    assert cs.fresh([r])[0].max_tokens == 30 and ms._rebased([r])[0].max_tokens == 30


def test_choosing_a_batch_sums_the_reservations_ahead_once_not_per_waiting_request():
    """A chain whose pages are full and whose queue is long: select asks ``fits`` about every waiting request while a
    batch place is free. Before, each ask summed the reservations of the requests ahead of it again (200 waiting
    beside 4 running: 800 lookups a step, the db simulation 1.9x slower than before the KV reservations); now the
    sum grows with the batch."""

    class Counting(dict):
        reads = 0

        def __getitem__(self, k):
            Counting.reads += 1
            return super().__getitem__(k)

    for pauses in ("runtime", "seed"):
        sched = mm.make_scheduler("db", mm.ServiceMonitor({"m": (1.0, 0.0)}), pauses=pauses, starve_factor=None)
        w = cs.ChainWorker("k", "m", ("v",), COST, 1.0, 8, sched, kv_tokens=4 * 64)
        w.reserved = Counting()
        reqs = [_req(i, "m", 0.0, 40, 20) for i in range(204)]  # 64 tokens reserved each: 4 fill the pages
        for r in reqs:
            r.job = cs.Job(r, "m", r.arrival)
            sched.arrive(r.job, 0.0)
        first = w.choose(0.0)
        assert [j.key.rid for j in first] == [0, 1, 2, 3] and w.kv_reserved == 256
        w.batch = first
        Counting.reads = 0
        assert w.choose(0.1) == first and w.kv_used == 256
        assert Counting.reads < 40, (pauses, Counting.reads)

