"""Fair queue disciplines (seed 002) as dispatchers: contract, ordering, charges, state across re-plans."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.algorithms.fairness import (FAIRNESS_POLICIES, FairDispatcher, FairnessConfig, FairPolicy,
                                              FairRequest, jain_index, service_bound)


class Job:
    def __init__(self, client: str, tokens: int = 10, matched: dict | None = None, out: int = 0):
        self.client, self.tokens, self.matched, self.out = client, tokens, matched or {}, out

    def __repr__(self) -> str:
        return f"Job({self.client}, {self.tokens})"


def describe(job: Job) -> FairRequest:
    return FairRequest(item=job, client=job.client, input_tokens=job.tokens, matched=job.matched,
                       expected_output=job.out)


def make(policy: str, chains=((1.0, 1),), workers=None, **cfg) -> FairDispatcher:
    return FairDispatcher(list(chains), FairPolicy(policy, FairnessConfig(**cfg)), describe, workers=workers)


@pytest.mark.parametrize("policy", FAIRNESS_POLICIES)
def test_every_policy_runs_every_job_once_and_never_idles_a_chain(policy):
    d = make(policy, chains=[(2.0, 2), (1.0, 1), (1.0, 0)], quantum=30.0)
    jobs = [Job(c, 5 + i % 7, matched={i % 2: 3}) for i, c in enumerate("aabacbbcaacb" * 3)]
    running: list[tuple[int, Job]] = []
    started = []
    for job in jobs:
        k = d.arrive(job)
        if k is not None:
            running.append((k, job))
            started.append(job)
    assert d.queue_length == len(jobs) - 3  # capacities 2 + 1 (+ 0): three start at once
    while running:
        k, job = running.pop(0)
        d.policy.output(job.client, d.workers[k], 3)
        nxt = d.complete(k)
        if nxt is not None:
            running.append((k, nxt))
            started.append(nxt)
        # work conservation: a chain with a free slot never coexists with a waiting job
        assert d.queue_length == 0 or d.free_chains() == 0
    assert sorted(map(id, started)) == sorted(map(id, jobs))
    assert d.queue_length == 0 and d.occupancy == [0, 0, 0]
    assert sum(d.policy.admitted_requests.values()) == len(jobs)


def test_fcfs_and_lpm_orders():
    d = make("fcfs")
    first = Job("a")
    assert d.arrive(first) == 0
    j1, j2 = Job("b", matched={0: 1}), Job("c", matched={0: 8})
    d.arrive(j1), d.arrive(j2)
    assert d.complete(0) is j1
    d = make("lpm")
    d.arrive(Job("a"))
    d.arrive(j1), d.arrive(j2)
    assert d.complete(0) is j2  # the longest cached prefix on chain 0 first


def test_vtc_serves_the_client_with_least_service_and_lifts_newcomers():
    d = make("vtc")
    a0 = Job("a", 100)
    d.arrive(a0)  # a is charged 100
    a1, a2, b1 = Job("a", 100), Job("a", 100), Job("b", 10)
    d.arrive(a1), d.arrive(a2), d.arrive(b1)
    # b arrives with nothing queued: lifted to the least counter among queued clients (a: 100)
    assert d.policy.local(None).counter["b"] == 100
    assert d.complete(0) is a1  # tie 100 vs 100 -> by name
    assert d.complete(0) is b1  # a now at 200, b at 100
    assert d.complete(0) is a2


def test_dlpm_keeps_a_clients_prefix_run_until_its_credit_is_spent():
    # Q^u = 20 service units; a's requests extend 8 tokens (2 of 10 cached on chain 0), b's 10.
    d = make("dlpm", quantum=20.0)
    d.arrive(Job("x", 1))  # occupies the chain
    for _ in range(4):
        d.arrive(Job("a", 10, matched={0: 2}))
    for _ in range(4):
        d.arrive(Job("b", 10))
    order = []
    while (nxt := d.complete(0)) is not None:
        order.append(nxt.client)
    # round 1: a (longer match) runs 20 -> 12 -> 4 -> -4, then b 20 -> 10 -> 0; round 2: a 16 -> 8, b 20 -> 10 -> 0
    assert "".join(order) == "aaabbabb"


def test_adaptive_quantum_is_one_median_request_without_reuse_and_rises_to_four_with_it():
    """Auto ``Q^u``: 1x the median full request cost when no prompt finds a cached prefix (deficit round robin),
    ``1 + 3h`` times it when a share ``h`` of the input tokens is found cached where the requests run."""
    def quantum_after(matched_tokens: int) -> float:
        policy = FairPolicy("dlpm", FairnessConfig())
        assert policy.quantum.value == 2048.0  # the prior, before any request
        for i in range(9):
            req = FairRequest(item=i, client=f"c{i % 3}", input_tokens=100 + i, matched={0: matched_tokens},
                              expected_output=10)
            policy.admit(req, 0)
        return policy.quantum.value

    median = 1.0 * 104 + 2.0 * 10  # w_e * median input + w_q * output
    assert quantum_after(0) == pytest.approx(median)
    assert quantum_after(1000) == pytest.approx(4 * median)  # every input token cached
    reuse = sum(50 for _ in range(9)) / sum(100 + i for i in range(9))
    assert quantum_after(50) == pytest.approx((1 + 3 * reuse) * median)
    assert FairPolicy("dlpm", FairnessConfig(quantum=7.0)).quantum.value == 7.0  # a fixed quantum stays


def test_dlpm_deficits_stay_in_the_theorem_range():
    cfg = FairnessConfig(quantum=40.0)
    d = FairDispatcher([(1.0, 2)], FairPolicy("dlpm", cfg), describe)
    running = []
    for i in range(60):
        job = Job("abc"[i % 3] if i % 4 else "a", tokens=5 + (i * 7) % 30, matched={0: (i * 3) % 5})
        k = d.arrive(job)
        if k is not None:
            running.append(job)
    u = service_bound(cfg, 0, 35, 2) / 2  # U = w_e L_input + w_q M
    loc = d.policy.local(None)
    while running:
        job = running.pop(0)
        d.policy.output(job.client, 0, 4)
        nxt = d.complete(0)
        if nxt is not None:
            running.append(nxt)
        assert all(-u - 8 < q <= cfg.quantum for q in loc.deficit.values()), loc.deficit


def test_dlpm_refill_in_one_pass_equals_refilling_round_by_round():
    """CheckRefill's rounds computed at once give the deficits and the round count of the round-by-round loop (which
    took debt/quantum x clients steps: seconds on the event loop for a client deep in debt)."""
    import random

    from petals_chain.algorithms.fairness import _DLPM

    def by_rounds(deficit, queued, q_u):
        d, rounds = dict(deficit), 0
        while not any(d[c] > 0 for c in queued):
            for c, q in d.items():
                if q <= 0:
                    d[c] = q + q_u
            rounds += 1
        return d, rounds

    rng = random.Random(3)
    for _ in range(300):
        q_u = rng.choice([1.0, 7.5, 300.0, 1234.5])
        deficit = {f"c{i}": rng.choice([rng.uniform(-20 * q_u, q_u), -q_u * rng.randint(0, 5), 0.0])
                   for i in range(rng.randint(1, 6))}
        queued = set(rng.sample(sorted(deficit), rng.randint(1, len(deficit))))
        policy = _DLPM(lambda q_u=q_u: q_u)
        policy.deficit = dict(deficit)
        policy._check_refill(queued)
        expected, rounds = by_rounds(deficit, queued, q_u)
        assert policy.refills == rounds
        assert policy.deficit == pytest.approx(expected, rel=1e-9, abs=1e-9)
    policy = _DLPM(lambda: 1.0)
    policy.deficit = {"deep": -5e8, "other": -3.0}
    policy._check_refill({"deep"})  # 500 million rounds
    assert policy.refills == 500_000_001 and policy.deficit == {"deep": 1.0, "other": 1.0}


@pytest.mark.parametrize("policy", ["vtc", "dlpm", "d2lpm", "d-vtc"])
def test_a_start_that_served_nothing_is_refunded_whole(policy):
    """A job whose chain refused or failed its open four times, then ran, leaves every counter as one clean start
    does. (The refund corrected the service to 0 but left VTC's counter and D2LPM's worker credit charged and
    counted the request five times.)"""
    import asyncio

    from prometheus_client import CollectorRegistry

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, chain_key
    from petals_chain.orchestrator.fairness import ClientShares

    async def run(failures):
        shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=1000.0)), registry=CollectorRegistry())
        dm = DispatchManager(policy="jffc", shares=shares)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        for attempt in range(failures + 1):  # as ChainHolder._ensure_chain: the open fails, the job queues again
            job = DispatchJob("x", client="alice", input_tokens=1000, requeue=attempt > 0)
            lease = await dm.acquire(job)
            if attempt < failures:
                shares.refund(job, chain_key(lease.chain))
            dm.release(lease)
        return shares.policy.snapshot(), dict(shares.policy.worker_credit)

    assert asyncio.run(run(4)) == asyncio.run(run(0))


def test_d2lpm_binds_to_the_chain_holding_the_prefix_while_credit_lasts():
    cfg = FairnessConfig(worker_quantum=50.0, quantum=1000.0)
    d = FairDispatcher([(1.0, 1), (1.0, 1)], FairPolicy("d2lpm", cfg), describe, workers=["w0", "w1"])
    d.arrive(Job("z", 1)), d.arrive(Job("z", 1))  # both chains busy
    jobs = [Job("a", 20, matched={"w1": 15}) for _ in range(4)]
    for j in jobs:
        assert d.arrive(j) is None
    reqs = [d.request_of(j) for j in jobs]
    # credit 50 on each chain; w1 holds the prefix and keeps a while a has credit there (50 -> 30 -> 10 -> -10)
    assert [r.worker for r in reqs] == ["w1", "w1", "w1", "w0"]
    # a freed chain with nothing bound to it takes work bound elsewhere (work conservation), credit moves along
    d2 = FairDispatcher([(1.0, 1), (1.0, 1)], FairPolicy("d2lpm", cfg), describe, workers=["w0", "w1"])
    d2.arrive(Job("z", 1)), d2.arrive(Job("z", 1))
    j = Job("a", 20, matched={"w1": 15})
    d2.arrive(j)
    assert d2.request_of(j).worker == "w1"
    assert d2.complete(0) is j
    assert d2.policy.worker_credit[("a", "w1")] == pytest.approx(50.0)
    assert d2.policy.worker_credit[("a", "w0")] == pytest.approx(30.0)


def test_counters_survive_a_new_dispatcher_over_the_same_chains_and_drop_gone_ones():
    policy = FairPolicy("d2lpm", FairnessConfig(quantum=10.0))
    d = FairDispatcher([(1.0, 1), (1.0, 1)], policy, describe, workers=["A", "B"])
    d.arrive(Job("a", 30)), d.arrive(Job("b", 5))
    before = dict(policy.worker_credit)
    assert before
    FairDispatcher([(1.0, 1), (1.0, 1)], policy, describe, workers=["A", "B"])
    assert policy.worker_credit == before
    FairDispatcher([(1.0, 1)], policy, describe, workers=["A"])
    assert all(w == "A" for _, w in policy.worker_credit)
    assert policy.service["a"] == 30 and policy.service["b"] == 5


def test_prompt_correction_and_output_charges():
    policy = FairPolicy("dlpm", FairnessConfig(quantum=100.0))
    d = FairDispatcher([(1.0, 1)], policy, describe)
    job = Job("a", 50, matched={0: 20})
    d.arrive(job)
    req = d.started
    assert policy.service["a"] == 30  # w_e * extend estimated from the directory
    policy.prompt(req, 0, 50)  # the server had nothing cached after all
    assert policy.service["a"] == 50
    policy.output("a", 0, 3)
    assert policy.service["a"] == 56  # w_q = 2 per output token
    assert policy.local(None).deficit["a"] == 100 - 56  # refilled once as it started (its deficit was 0)


def test_remove_and_bad_input():
    d = make("dlpm")
    a, b = Job("a"), Job("b")
    d.arrive(a), d.arrive(b)
    assert d.remove_job(b) and not d.remove_job(b)
    assert d.queue_length == 0
    with pytest.raises(ValueError):
        FairPolicy("wfq")
    with pytest.raises(ValueError):
        FairnessConfig(quantum=0)
    with pytest.raises(ValueError):
        FairnessConfig(w_e=0, w_q=0)
    with pytest.raises(ValueError):
        make("fcfs").complete(0)
    with pytest.raises(ValueError):
        FairDispatcher([(1.0, 1)], FairPolicy(), describe, workers=["a", "b"])


def test_jain_index():
    assert jain_index([3, 3, 3]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        jain_index([])


def test_dispatch_manager_keeps_fair_counters_across_re_plans_and_charges_once():
    import asyncio

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, chain_key
    from petals_chain.orchestrator.fairness import ClientShares

    def chain(name: str, cap: int) -> Chain:
        return Chain(servers=[name], spans=[(0, 4)], blocks=[4], service_time=1.0, capacity=cap)

    async def run():
        shares = ClientShares(FairPolicy("dlpm", FairnessConfig(quantum=5.0)))
        dm = DispatchManager(shares=shares)
        a, b = chain("a", 1), chain("b", 1)
        dm.set_chains([a])
        first = await dm.acquire(DispatchJob("h0", client="heavy", input_tokens=20))
        waiting = [asyncio.ensure_future(dm.acquire(DispatchJob(f"h{i}", client="heavy", input_tokens=20)))
                   for i in range(1, 4)]
        light = asyncio.ensure_future(dm.acquire(DispatchJob("l", client="light", input_tokens=20)))
        await asyncio.sleep(0)
        assert dm.queue_length == 4
        # a client whose every request waits (the one a starving policy would hide) has its row
        light_row = shares.json(dm.waiting_jobs())["clients"]["light"]
        assert light_row["waiting"] == 1 and light_row["started"] == 0 and light_row["backlogged"]
        local = shares.policy.local(None)
        assert local.deficit == {"heavy": 5.0 - 20.0, "light": 0.0}  # refilled once as h0 started
        dm.set_chains([a, b])  # a re-plan adds a chain: the queue re-arrives, the counters stay
        await asyncio.sleep(0)
        assert shares.policy.local(None) is local and dm.running == 2
        # one refill round (Q^u = 5): heavy keeps its debt, light gets credit and is admitted
        assert local.deficit == {"heavy": -10.0, "light": 5.0 - 20.0}
        # heavy is in debt (20 units), light is not: light takes the new chain ahead of heavy's older jobs
        assert light.done() and light.result().chain == b
        shares.output("heavy", chain_key(a), 3)
        dm.release(first)
        await asyncio.sleep(0)
        assert sum(f.done() for f in waiting) == 1
        assert shares.policy.service == {"heavy": 46.0, "light": 20.0}
        assert shares.policy.admitted_requests == {"heavy": 2, "light": 1}
        info = shares.json(dm.waiting_jobs())
        assert info["clients"]["heavy"]["waiting"] == 2 and info["clients"]["light"]["started"] == 1
        for f in waiting:
            f.cancel()

    asyncio.run(run())


def test_service_meter_takes_negative_corrections():
    from petals_chain.algorithms.fairness import ServiceMeter

    m = ServiceMeter(window_s=1.0)
    m.served(0.0, "a", 100)
    m.served(0.1, "a", -99)  # the chain held more cached prefix than estimated
    m.served(0.2, "a", 4)
    m.waited(0.2, "a")
    assert m.rates(0.5)["a"] == pytest.approx(5.0)
    assert m.rates(5.0) == {} and m.jain(5.0) is None  # everything left the window, no KeyError


@pytest.mark.parametrize("policy", ["vtc", "d-vtc"])
def test_vtc_counters_of_clients_waiting_through_a_re_plan_are_not_lifted(policy):
    """A re-plan re-queues the waiting jobs: VTC's lift (a client newly backlogged starts at the least counter of
    the queued ones) fired for clients that had been waiting all along, raising the one owed service to the counter
    of the heavy one whose job is older, which then went first."""
    pol = FairPolicy(policy, FairnessConfig())
    d = FairDispatcher([(1.0, 1)], pol, describe, workers=["w"])
    d.arrive(Job("x", 1))  # takes the only slot
    d.arrive(Job("heavy", 10))
    d.arrive(Job("light", 10))
    pol.output("heavy", "w", 500)  # heavy was served much (an earlier job of its)
    before = dict(pol.local("w" if pol.distributed else None).counter)
    items = d.drain()
    d = FairDispatcher([(1.0, 1)], pol, describe, workers=["w"])
    d.adopt(0, "running")
    assert d.arrive_all(items) == []
    assert dict(pol.local("w" if pol.distributed else None).counter) == before
    assert before["light"] < before["heavy"]
    assert d.complete(0).client == "light"


def test_d2lpm_bindings_are_not_charged_again_by_re_plans_or_cancels():
    policy = FairPolicy("d2lpm", FairnessConfig(worker_quantum=100.0))
    d = FairDispatcher([(1.0, 1)], policy, describe, workers=["w"])
    d.arrive(Job("z", 1))
    job = Job("a", 30)
    d.arrive(job)
    assert policy.worker_credit[("a", "w")] == pytest.approx(70.0)
    for _ in range(3):  # re-plans over the same chain
        items = d.drain()
        d = FairDispatcher([(1.0, 1)], policy, describe, workers=["w"])
        d.adopt(0, "running")
        assert d.arrive_all(items) == []
        assert policy.worker_credit[("a", "w")] == pytest.approx(70.0)
    assert d.remove_job(job)  # cancelled before it started: the binding's credit comes back
    assert policy.worker_credit[("a", "w")] == pytest.approx(100.0)


def test_jobs_that_came_while_no_chain_existed_arrive_as_new_after_the_outage():
    """Not waiting all along: VTC lifts their idle client as any newly backlogged one (it banked the service it
    did not use, and took the chains for itself after the outage)."""
    pol = FairPolicy("vtc", FairnessConfig())
    local = pol.local(None)
    local.counter.update({"old": 10.0, "busy": 1000.0})
    local._last = "busy"  # the last client admitted: a client back from idle is lifted to its counter
    d = FairDispatcher([(1.0, 1)], pol, describe)
    d.adopt(0, "running")
    jobs = [Job("busy", 10), Job("old", 10)]
    assert d.arrive_all(jobs, fresh=set(jobs)) == []
    assert local.counter["old"] >= 1000.0


def _shares_on_one_chain(policy="dlpm"):
    from prometheus_client import CollectorRegistry

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchManager
    from petals_chain.orchestrator.fairness import ClientShares

    reg = CollectorRegistry()
    shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=1000.0)), registry=reg)
    dm = DispatchManager(policy="jffc", shares=shares)
    dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
    return shares, dm, reg


def test_the_service_counter_counts_what_the_json_says_after_refunds_and_corrections():
    """/metrics kept every provisional admission charge (three refused opens and an 80 % cache hit: 4000 where the
    JSON said 200), a Prometheus counter cannot go down: the input is counted once the chain says what it held."""
    import asyncio

    from petals_chain.orchestrator.dispatch import DispatchJob, chain_key

    async def main():
        shares, dm, reg = _shares_on_one_chain()
        for attempt in range(4):  # as ChainHolder._ensure_chain: three refused opens, then the job runs
            job = DispatchJob("x", client="alice", input_tokens=1000, requeue=attempt > 0)
            lease = await dm.acquire(job)
            if attempt < 3:
                shares.refund(job, chain_key(lease.chain))
            else:
                shares.prompt(job, chain_key(lease.chain), 200)  # 800 of the 1000 tokens were cached there
            dm.release(lease)
        shares.output("alice", chain_key(lease.chain), 5)
        row = shares.json()["clients"]["alice"]
        counted = reg.get_sample_value("petals_chain_client_service_units_total", {"client": "alice"})
        assert row["service"] == counted == 210.0
        assert row["requests"] == 1 and row["started"] == 4  # one request, re-admitted after each refusal

    asyncio.run(main())
    # the adaptive quantum samples a request once: a re-admission (failover, pause) halved it (1400 -> 800)
    pol = FairPolicy("dlpm", FairnessConfig())
    pol.admit(FairRequest(item=None, client="a", input_tokens=1000, expected_output=200), "w")
    for _ in range(3):
        pol.admit(FairRequest(item=None, client="a", input_tokens=0, expected_output=200, again=True), "w")
    assert pol.quantum.value == 1400.0 and pol.admitted_requests == {"a": 1}


@pytest.mark.parametrize("policy", ["dlpm", "vtc", "fcfs"])
@pytest.mark.parametrize("cancel_first", [True, False])
def test_a_client_gone_in_the_turn_its_job_was_picked_is_not_charged(policy, cancel_first):
    import asyncio

    from petals_chain.orchestrator.dispatch import DispatchJob

    async def main():
        shares, dm, _ = _shares_on_one_chain(policy)
        first = await dm.acquire(DispatchJob("h", client="heavy", input_tokens=10))
        gone = asyncio.ensure_future(dm.acquire(DispatchJob("x", client="alice", input_tokens=5000)))
        await asyncio.sleep(0)  # queued
        if cancel_first:  # its client disconnects, and in the same turn the chain frees; or the other way round
            gone.cancel()
        dm.release(first)
        gone.cancel()
        await asyncio.sleep(0)
        assert gone.cancelled() and dm.running == 0
        row = shares.json()["clients"].get("alice", {"service": 0.0, "requests": 0})  # fcfs: never charged
        assert row["service"] == 0.0 and row["requests"] == 0

    asyncio.run(main())


class _HangingSession:
    """A chain session whose open never ends (the servers queue it until pages free)."""

    def __init__(self, *a, **k):
        self.wait_s, self.cached_tokens, self.prefix_cache = 0.0, 0, True

    async def open(self, **k):
        await asyncio.sleep(3600)

    async def close(self, **k):
        pass


def _holder(dm, shares, monkeypatch, **cfg):
    import types

    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.auth import CLIENT
    from petals_chain.orchestrator.dispatch import ChainPrefixes
    from petals_chain.orchestrator.replay import ReplayCache

    monkeypatch.setattr(failover, "ChainSession", _HangingSession)
    cfg = types.SimpleNamespace(**{"queue_timeout_s": 60.0, "output_reserve_tokens": 0, "relay": "orchestrator",
                                   "no_chain_wait_s": 10.0, "open_wait_max_s": 5.0, "max_failovers": 2, **cfg})
    orch = types.SimpleNamespace(cfg=cfg, dispatch=dm, replay_cache=ReplayCache(1 << 20), shares=shares,
                                 prefix_directory=ChainPrefixes(), deadlines=None, client=None, observe_hop=None,
                                 chain_sessions=set(), stats=None, auditor=None, planner=None, model_id="m")
    CLIENT.set("alice")
    return failover.ChainHolder(orch, "r-1", 4096)


def test_a_request_gone_during_its_chains_open_is_refunded(monkeypatch):
    """The open may wait long for pages; a client gone meanwhile kept its admission charged (and the JSON and
    /metrics disagreed: prompt() never ran)."""
    async def main():
        shares, dm, reg = _shares_on_one_chain()
        t = asyncio.ensure_future(_holder(dm, shares, monkeypatch).feed(list(range(3000))))
        await asyncio.sleep(0.05)
        assert dm.running == 1
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        row = shares.json()["clients"]["alice"]
        assert dm.running == 0 and row["service"] == 0.0 and row["requests"] == 0
        assert reg.get_sample_value("petals_chain_client_service_units_total", {"client": "alice"}) is None

    asyncio.run(main())


def test_a_client_that_gives_up_waiting_shows_its_wait_once_per_request(monkeypatch):
    """A starved client whose requests time out had no wait on record (under fcfs no row); and a request that
    waited out a re-plan and then ran is not one that gave up."""
    from petals_chain.model import Chain
    from petals_chain.orchestrator.core import Unavailable
    from petals_chain.orchestrator.dispatch import DispatchJob

    async def main():
        shares, dm, reg = _shares_on_one_chain("fcfs")
        busy = await dm.acquire(DispatchJob("h", client="heavy", input_tokens=10))
        for _ in range(2):
            with pytest.raises(Unavailable):
                await _holder(dm, shares, monkeypatch, queue_timeout_s=0.05).feed([1, 2, 3])
        row = shares.json()["clients"]["alice"]
        assert row["gave_up"] == 2 and row["started"] == 0 and row["wait_max_s"] >= 0.04
        assert reg.get_sample_value("petals_chain_client_wait_seconds_count", {"client": "alice"}) == 2
        dm.release(busy)
        # a re-plan: no chain for a while; one comes, an earlier job takes it, the request's wait for a chain ends
        # (it queues again: not giving up) and it runs when that job is done
        shares2, dm2, _ = _shares_on_one_chain("dlpm")
        dm2.set_chains([])
        other = asyncio.ensure_future(dm2.acquire(DispatchJob("o", client="bob", input_tokens=10)))
        await asyncio.sleep(0)
        t = asyncio.ensure_future(_holder(dm2, shares2, monkeypatch, no_chain_wait_s=0.1).feed([1, 2, 3]))
        await asyncio.sleep(0.05)
        dm2.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        await asyncio.sleep(0.2)  # past the no-chain wait
        dm2.release(other.result())
        await asyncio.sleep(0.05)
        row = shares2.json()["clients"]["alice"]
        assert dm2.running == 1 and row["started"] == 1 and row["gave_up"] == 0
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    asyncio.run(main())


def test_d2lpm_refills_a_deep_debt_in_one_pass(scaled):
    """One round of Q^w a loop: 6 s of the event loop for a 16-token prompt at w_e 1e6, Q^w 1 (an hour for 8k)."""
    import time

    pol = FairPolicy("d2lpm", FairnessConfig(w_e=1e6, worker_quantum=1.0))
    r = FairRequest(item=None, client="a", input_tokens=8192)
    pol.bound(r, "w", [r])  # the client's credit on w: -8.2e9
    t0 = time.perf_counter()
    assert pol.choose_worker(FairRequest(item=None, client="a", input_tokens=1), ["w"], lambda w: 0.0) == "w"
    assert time.perf_counter() - t0 < scaled(0.5) and 0 < pol.worker_credit[("a", "w")] <= 1.0
    # as the rounds one by one: every candidate refilled until the first has credit
    pol.bound(r, "w", [r])
    assert pol.choose_worker(FairRequest(item=None, client="a", input_tokens=1), ["w", "v"], lambda w: 0.0) == "v"
    assert pol.worker_credit[("a", "v")] == 1.0 and pol.worker_credit[("a", "w")] < -8e9


def test_jain_compares_the_clients_backlogged_through_the_window():
    """Every client that waited once in the window was compared: a light client served at once when it asked
    (service 100 against a backlogged client's 1000) made the index 0.52 though it got all it wanted."""
    from petals_chain.algorithms.fairness import ServiceMeter

    m = ServiceMeter(window_s=60.0)
    for t in range(60):
        m.sample(float(t), ["heavy", "other"] if t != 30 else ["heavy", "other", "light"])
        m.served(float(t), "heavy", 20.0)
        m.served(float(t), "other", 19.0 if t % 2 else 21.0)
    m.served(30.0, "light", 100.0)
    assert m.saturated(59.0) == ["heavy", "other"] and "light" in m.backlogged(59.0)
    assert m.jain(59.0) == pytest.approx(1.0)
    # one saturated client, or too few samples: nothing to compare
    m2 = ServiceMeter(window_s=60.0)
    for t in range(3):
        m2.sample(float(t), ["a", "b"])
    assert m2.jain(3.0) is None
    for t in range(3, 10):
        m2.sample(float(t), ["a"])
    assert m2.saturated(10.0) == ["a"] and m2.jain(10.0) is None
    # an idle lead-in (a swarm up for a while before the load) is no one's share
    m4 = ServiceMeter(window_s=60.0)
    for t in range(60):
        m4.sample(float(t), [] if t < 40 else ["a", "b"])
    assert m4.saturated(59.5) == ["a", "b"]
    # a client starved in the queue is compared with the one served
    m3 = ServiceMeter(window_s=10.0)
    for t in range(10):
        m3.sample(float(t), ["a", "b"])
        m3.served(float(t), "a", 10.0)
    assert m3.jain(9.5) == pytest.approx(0.5)


@pytest.mark.parametrize("policy", ["lpm", "dlpm"])
def test_a_waiting_job_sees_a_prefix_its_chain_gained_while_it_waited(policy):
    """The queue was ordered by each job's prefix match as it was at arrival: a chain that gained a shared system
    prompt meanwhile (the group's first request closing there) did not draw the group's waiting requests."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchJob, DispatchManager
    from petals_chain.orchestrator.fairness import ClientShares
    from petals_chain.swarm.prefix import prefix_hashes

    system, other = list(range(100, 164)), list(range(500, 564))

    def job(prefixes, name, prompt):  # as ChainHolder._ensure_chain builds it
        named = prefix_hashes(prompt[:-1])
        return DispatchJob(name, client="c", input_tokens=len(prompt), matched=prefixes.live_match(named))

    async def main():
        prefixes = ChainPrefixes()
        shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=1e6)), registry=CollectorRegistry())
        dm = DispatchManager(policy="jffc", shares=shares)
        ch = Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))
        dm.set_chains([ch])
        first = await dm.acquire(job(prefixes, "g0", system + [1, 2]))
        older = asyncio.ensure_future(dm.acquire(job(prefixes, "o1", other + [3])))
        newer = asyncio.ensure_future(dm.acquire(job(prefixes, "g1", system + [4])))
        await asyncio.sleep(0)
        prefixes.add(ch, prefix_hashes(system + [1, 2]))  # g0 closes: the chain was given the system prompt
        dm.release(first)
        await asyncio.sleep(0)
        assert newer.done() and not older.done()
        older.cancel()
        await asyncio.gather(older, return_exceptions=True)

    asyncio.run(main())


def test_the_choices_of_one_request_are_one_request():
    """``n`` = 2 read as two requests of its client (its charges were right: the prompt once)."""
    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob

    async def main():
        shares, dm, _ = _shares_on_one_chain()
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=2, spans=((0, 4),))])
        await dm.acquire(DispatchJob("c0", client="alice", input_tokens=100, expected_output=8))
        await dm.acquire(DispatchJob("c1", client="alice", input_tokens=0, expected_output=8, checked=True))
        row = shares.json()["clients"]["alice"]
        assert row["requests"] == 1 and row["started"] == 2 and row["service"] == 100.0

    asyncio.run(main())


async def _fill(dm, jobs):
    """``acquire`` each job in turn (each decided at once: started, queued or refused); the queued ones' tasks and
    the refusals."""
    from petals_chain.orchestrator.dispatch import QueueFull

    tasks, refused = [], []
    for job in jobs:
        task = asyncio.ensure_future(dm.acquire(job))
        await asyncio.sleep(0)
        if task.done() and isinstance(task.exception(), QueueFull):
            refused.append(task.exception())
        else:
            tasks.append(task)
    return tasks, refused


@pytest.mark.parametrize("policy", ["vtc", "dlpm", "d2lpm"])
def test_heavy_clients_cannot_fill_a_fair_queue_against_a_light_one(policy):
    """Three clients sending without pause filled ``--max-queue`` and a light client's one request got a 429: a
    client-fair queue keeps places for clients with nothing waiting (its heavy clients get ``client_queue_share``
    refusals first), and the bound holds."""
    from prometheus_client import CollectorRegistry

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, QueueShareFull
    from petals_chain.orchestrator.fairness import ClientShares

    async def main():
        shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=1000.0)), registry=CollectorRegistry(),
                              keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=12)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        heavy = [DispatchJob(f"h{c}.{i}", client=f"heavy{c}", input_tokens=10) for i in range(10) for c in range(3)]
        tasks, refused = await _fill(dm, heavy)
        assert refused and all(isinstance(e, QueueShareFull) and e.code == "client_queue_share" for e in refused)
        assert "this client already has" in str(refused[0]) and dm.queue_length < 12
        light, light_refused = await _fill(dm, [DispatchJob("l", client="light", input_tokens=10)])
        assert not light_refused and dm.queue_length <= 12
        for task in tasks + light:
            task.cancel()
        await asyncio.gather(*tasks, *light, return_exceptions=True)

    asyncio.run(main())


def test_one_client_alone_keeps_most_of_a_fair_queue_and_fifo_keeps_all():
    """The share rule leaves a lone sender 80 % of the bound (the last places stay for others); ``--fairness fcfs``
    (the paper's FIFO) and ``lpm`` are not client-fair, and without API keys every request is one client: they keep
    the plain bound; no chain yet (jobs waiting for a first plan) counts the same."""
    from prometheus_client import CollectorRegistry

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, QueueFull, QueueShareFull
    from petals_chain.orchestrator.fairness import ClientShares

    async def queued_alone(policy, chains=True, keyed=True):
        shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=1000.0)), registry=CollectorRegistry(),
                              keyed=keyed)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=100)
        if chains:
            dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        tasks, refused = await _fill(dm, [DispatchJob(f"j{i}", client="solo") for i in range(120)])
        kinds = {type(e) for e in refused}
        queued = dm.queue_length
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return queued, kinds

    assert asyncio.run(queued_alone("dlpm")) == (80, {QueueShareFull})  # admitted while q < 4 (100 - q - 1)
    assert asyncio.run(queued_alone("dlpm", chains=False)) == (80, {QueueShareFull})
    assert asyncio.run(queued_alone("fcfs")) == (100, {QueueFull})
    assert asyncio.run(queued_alone("lpm")) == (100, {QueueFull})  # prefix locality, not client shares
    assert asyncio.run(queued_alone("dlpm", keyed=False)) == (100, {QueueFull})  # no keys: "anonymous" alone


def test_the_choices_of_one_request_are_given_their_places_when_it_is_admitted():
    """A request's later choices come after its first's prefill and are never refused: one heavy client's ``n`` = 4
    requests took the queue past its bound and refused a light client (429) that had nothing waiting. The first choice
    now needs places for those of its choices the free slots cannot start."""
    from prometheus_client import CollectorRegistry

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, QueueFull, QueueShareFull
    from petals_chain.orchestrator.fairness import ClientShares

    async def main():
        shares = ClientShares(FairPolicy("dlpm", FairnessConfig(quantum=1000.0)), registry=CollectorRegistry(),
                              keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=6)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])

        def choices(name, client, n):
            return [DispatchJob(f"{name}{i}", client=client, siblings=n - 1 if i == 0 else 0, checked=i > 0)
                    for i in range(n)]

        first = await dm.acquire(choices("a", "heavy", 4)[0])  # starts on the free slot
        later, refused = await _fill(dm, choices("a", "heavy", 4)[1:])  # after its prefill: queued, never refused
        assert first and not refused and dm.queue_length == 3
        tasks, refused = await _fill(dm, choices("b", "heavy", 4)[:1])  # 4 more places: 7 > 6
        assert [type(e) for e in refused] == [QueueFull] and "this request's 4 completions" in str(refused[0])
        tasks, refused = await _fill(dm, choices("c", "heavy", 2)[:1])  # 2 places fit the bound, not the share
        assert [type(e) for e in refused] == [QueueShareFull] and "need 2 places" in str(refused[0])
        light, refused = await _fill(dm, [DispatchJob("l", client="light")])
        assert not refused and dm.queue_length == 4 <= dm.max_queue
        for task in later + light:
            task.cancel()
        await asyncio.gather(*later, *light, return_exceptions=True)

    asyncio.run(main())


def test_the_early_check_lets_a_client_with_nothing_waiting_here_reach_the_dispatcher(tmp_path):
    """Requests not yet decided count in the early check (``inflight``), so it may say "full" while the queue has
    room: a client with nothing waiting in this model's queue goes on to the exact decision, whatever it runs here or
    on another model of the process (the bypass first looked at its requests in flight across every model)."""
    import json
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager
    from petals_chain.orchestrator.fairness import ClientShares
    from petals_chain.orchestrator.limits import AdmissionLimits, ClientLedger, KeyRing, LimitsConfig

    secret = "light-secret-01234567890"
    keys = tmp_path / "keys"
    keys.write_text(f"light {secret}\nheavy heavy-secret-0123456789\n")

    def orch(dispatch):
        return SimpleNamespace(dispatch=dispatch, sessions={}, groups=None,
                               stats=SimpleNamespace(registry=None, tokens_last_minute=lambda c: 0,
                                                     usage_window=lambda c: []))

    async def post(lim):
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"authorization", f"Bearer {secret}".encode()), (b"content-length", b"2")]}
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(m):
            sent.append(m)

        await lim(scope, receive, send)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        status = next(m for m in sent if m["type"] == "http.response.start")["status"]
        return status, json.loads(body).get("error", {}).get("code") if body else None

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main(keyed):
        shares = ClientShares(FairPolicy("dlpm", FairnessConfig(quantum=1000.0)), registry=CollectorRegistry(),
                              keyed=keyed)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=4)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        running = await dm.acquire(DispatchJob("h0", client="heavy"))
        waiting = asyncio.ensure_future(dm.acquire(DispatchJob("h1", client="heavy")))
        await asyncio.sleep(0)
        a, b = orch(dm), orch(SimpleNamespace(queue_length=0, chains=[]))
        ledger = ClientLedger([a, b])
        lim = AdmissionLimits(app, a, LimitsConfig(max_queue=4, keys=KeyRing.from_file(str(keys))), ledger)
        lim._metric = None
        lim.inflight = 5  # 1 running + 1 queued + 3 heavy requests still reading their bodies: >= 1 + max_queue
        ledger.by_client["light"] = 1  # the light client runs a request on the other model
        got = await post(lim)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        dm.release(running)
        return got

    assert asyncio.run(main(keyed=True)) == (200, None)
    assert asyncio.run(main(keyed=False)) == (429, "queue_full")  # one client: nothing kept, the early check holds
