"""Planning cost at swarm scale: GCA re-solves only what an allocation changed, the c search computes each distinct
placement once, the unserved-index placement does not recompute unchanged models, and the model placer's search
runs off the event loop. Counts of work, not wall time (the CPUs are shared)."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time

import numpy as np

import petals_chain.algorithms.gca  # noqa: F401 - the module, for its _RoutingDAG (the package exports gca())
import petals_chain.algorithms.multimodel as mm
import petals_chain.algorithms.tuning  # noqa: F401
from petals_chain.algorithms import gbp_cr, gca, response_time_bounds, tune_capacity
from petals_chain.algorithms.bounds import response_time_lower_bound
from petals_chain.algorithms.multimodel import ServedModel, Volunteer, estimate_model, place_by_unserved_index
from petals_chain.model import ModelSpec, ServerSpec

gca_mod = sys.modules["petals_chain.algorithms.gca"]
tuning_mod = sys.modules["petals_chain.algorithms.tuning"]

SMOL = ModelSpec(30, 14160384.0, 3145728.0)  # SmolLM2-135M fp32 bytes: block, KV slot at 2048 tokens


def mixed_swarm(J: int, model: ModelSpec, seed: int = 0) -> list[ServerSpec]:
    """Volunteer GPUs of mixed memory and speed (bytes, seconds)."""
    rng = random.Random(seed)
    base = 0.002 * model.num_blocks / 30
    return [ServerSpec(f"s{j}", rng.choice([4, 8, 12, 16, 24, 40, 48, 80]) * 1e9 * rng.uniform(0.5, 0.9),
                       rng.uniform(0.005, 0.1), base / rng.choice([0.5, 1, 2, 4])) for j in range(J)]


def arrays(servers: list[ServerSpec], model: ModelSpec, c: int):
    placement = gbp_cr(servers, model, c, 1e9, use_all_servers=True)
    placed = [s for s in servers if s.name in placement]
    a = np.array([placement[s.name][0] for s in placed])
    m = np.array([placement[s.name][1] for s in placed])
    slots = np.array([s.residual_slots(model, placement[s.name][1]) for s in placed])
    return a, m, slots, np.array([s.tau_c for s in placed]), np.array([s.tau_p for s in placed])


def full_dp_chains(a, m, slots, tau_c, tau_p, L):
    """GCA with the full DP for every chain (a fresh routing DAG each time): the reference."""
    slots = np.array(slots, dtype=np.int64)
    out = []
    while True:
        found = gca_mod._RoutingDAG(a, m, slots, tau_c, tau_p, L).shortest_path()
        if found is None:
            return out
        _, hops = found
        cap = min(int(slots[j]) // (end - start) for j, start, end in hops)
        for j, start, end in hops:
            slots[j] -= (end - start) * cap
        T = 0.0
        for j, start, end in hops:
            T += float(tau_c[j]) + float(tau_p[j]) * (end - start)
        out.append((hops, cap, T))


def test_gca_re_solves_only_the_boundaries_an_allocation_changed(monkeypatch):
    servers = mixed_swarm(300, SMOL, seed=300)
    a, m, slots, tau_c, tau_p = arrays(servers, SMOL, 200)
    groups = len(np.unique(a + m))
    calls = []
    real = np.argmin

    class CountingNumpy:  # the module's numpy, counting the per-boundary minimum (one per group solved)
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def argmin(*args, **kw):
            calls.append(1)
            return real(*args, **kw)

    monkeypatch.setattr(gca_mod, "np", CountingNumpy())
    chains = gca_mod.gca_indices(a, m, slots, tau_c, tau_p, SMOL.num_blocks)
    monkeypatch.undo()
    assert len(chains) > 100 and groups >= 20
    # the full DP solves every group for every chain (an O(groups x servers) numpy pass each: 0.2 s per GCA here,
    # seconds in a c search); the allocations here leave most boundaries as they were
    assert len(calls) < (len(chains) + 1) * groups / 3, (len(calls), len(chains), groups)
    assert chains == full_dp_chains(a, m, slots, tau_c, tau_p, SMOL.num_blocks)


def test_gca_incremental_paths_equal_the_full_dp_on_random_placements():
    rng = np.random.default_rng(7)
    for _ in range(150):
        L = int(rng.integers(1, 25))
        J = int(rng.integers(1, 40))
        m = rng.integers(1, L + 1, J)
        a = np.array([rng.integers(0, L - k + 1) for k in m])
        slots = rng.integers(0, 6, J) * rng.integers(1, 4, J) if rng.random() < 0.5 else rng.integers(0, 100, J)
        if rng.random() < 0.5:  # many ties
            tau_c, tau_p = rng.integers(0, 3, J) * 0.01, rng.integers(1, 3, J) * 0.01
        else:
            tau_c, tau_p = rng.uniform(0, 0.1, J), rng.uniform(0.001, 0.05, J)
        assert gca_mod.gca_indices(a, m, slots, tau_c, tau_p, L) == full_dp_chains(a, m, slots, tau_c, tau_p, L)


def test_a_dag_whose_slots_grow_again_is_solved_afresh():
    a, m = np.array([0, 0, 2]), np.array([4, 2, 2])
    tau_c, tau_p = np.array([0.0, 0.0, 0.0]), np.array([0.1, 0.01, 0.01])
    dag = gca_mod._RoutingDAG(a, m, np.array([5, 5, 5]), tau_c, tau_p, 4)
    assert [j for j, _, _ in dag.shortest_path()[1]] == [1, 2]
    dag.slots[2] = 0
    assert [j for j, _, _ in dag.shortest_path()[1]] == [1, 0]
    dag.slots[2] = 5  # not GCA's use, but a caller may: the full DP again
    assert [j for j, _, _ in dag.shortest_path()[1]] == [1, 2]


def test_the_c_search_builds_one_routing_dag_per_distinct_placement(monkeypatch):
    servers = mixed_swarm(300, SMOL)
    built = []

    class CountingDAG(gca_mod._RoutingDAG):
        def __init__(self, *args, **kw):
            built.append(1)
            super().__init__(*args, **kw)

    monkeypatch.setattr(tuning_mod, "_RoutingDAG", CountingDAG)
    c, placement, chains, table = tune_capacity(servers, SMOL, 15.0, 0.7, "lower", return_table=True)
    monkeypatch.undo()
    # thousands of c intervals (each server's m(c) steps 30 times) place the few servers GBP-CR visits the same way:
    # one relaxation each, not one per interval
    assert len(table) > 1000 and len(built) < len(table) / 4, (len(built), len(table))
    assert chains == gca(servers, SMOL, gbp_cr(servers, SMOL, c, 15.0, 0.7))
    assert table[c] == response_time_bounds([(ch.rate, ch.capacity) for ch in chains], 15.0)[0]


def test_tuned_plans_equal_gbp_cr_and_gca_at_the_chosen_c_on_random_swarms():
    rng = np.random.default_rng(3)
    for i in range(12):
        model = ModelSpec(int(rng.integers(2, 20)), 1.0, float(rng.uniform(0.05, 0.5)))
        servers = [ServerSpec(f"s{j}", float(rng.choice([4.0, 8.0, 11.5, 16.0, 40.0])),
                              float(rng.integers(0, 3)) * 0.01, float(rng.integers(1, 3)) * 0.01)
                   for j in range(int(rng.integers(5, 40)))]
        lam, every = float(rng.choice([0.05, 1.0, 10.0])), bool(i % 2)
        try:
            c, placement, chains, table = tune_capacity(servers, model, lam, 0.7, "lower", return_table=True,
                                                        use_all_servers=every)
        except ValueError:
            continue
        want = gbp_cr(servers, model, c, lam, 0.7, use_all_servers=every)
        if dict(placement) == dict(want):  # (use_all_servers may return the paper's walk instead)
            assert chains == gca(servers, model, want)
            assert table[c] == response_time_bounds([(ch.rate, ch.capacity) for ch in chains], lam)[0]


def test_the_lower_bound_alone_is_the_same_number():
    rng = np.random.default_rng(5)
    for _ in range(200):
        chains = [(float(rng.uniform(0.01, 5)), int(rng.integers(0, 2000))) for _ in range(int(rng.integers(0, 6)))]
        lam = float(rng.choice([0.0, 0.1, 3.0, 200.0]))
        assert response_time_lower_bound(chains, lam) == response_time_bounds(chains, lam)[0]


def volunteers_and_models(J: int, K: int):
    rng = random.Random(1)
    vols = [Volunteer(f"v{j}", rng.choice([8, 16, 24, 40]) * 1e9 * 0.8, rng.choice([0.5, 1, 2, 4]),
                      rng.uniform(0.005, 0.1)) for j in range(J)]
    models = [ServedModel("smol", 30, 14160384.0, 3145728.0, 0.002, rate=2.0),
              ServedModel("m32", 32, 4e8, 5e5, 0.01, rate=1.0),
              ServedModel("m40", 40, 6e8, 8e5, 0.015, rate=0.3)][:K]
    return vols, models


def test_the_unserved_index_placement_computes_each_models_chains_once_per_group(monkeypatch):
    vols, models = volunteers_and_models(30, 3)
    calls = []
    real = mm.model_chains

    def counting(servers, model):
        calls.append(model.name)
        return real(servers, model)

    monkeypatch.setattr(mm, "model_chains", counting)
    plan = place_by_unserved_index(vols, models, horizon_s=600.0)
    monkeypatch.undo()
    # a round changes one model's servers: the others' estimates (a GBP-CR + GCA each) are the same as before
    assert len(plan) == 30 and len(calls) <= 2 * len(vols) + 2 * len(models), len(calls)

    def fresh(groups):  # no memo: every model's estimate recomputed at every call
        return {m.name: estimate_model(m, real(groups.get(m.name, ()), m), 600.0) for m in models}

    assert plan == place_by_unserved_index(vols, models, horizon_s=600.0, evaluate=fresh)
    for rule in ("most_unserved", "largest_gain"):
        assert place_by_unserved_index(vols, models, horizon_s=600.0, rule=rule) == \
            place_by_unserved_index(vols, models, horizon_s=600.0, rule=rule, evaluate=fresh)


def test_an_analytic_re_placement_searches_off_the_event_loop():
    from types import SimpleNamespace

    from petals_chain.orchestrator.placement import ModelPlacer
    from petals_chain.orchestrator.planner import RateEstimator, ServerView
    from petals_chain.swarm.records import ServerRecord

    GB = 2**30

    class FakeDHT:
        peer_id = "orch"

        async def apublish_placement(self, prefix, record, expiration_s):
            return True

    def planner(spec):
        return SimpleNamespace(seen={}, servers={}, rates=RateEstimator(), plan=None, placed=None,
                               measured_tau_p=lambda v: None, tau_p=lambda v: float(v.record.tau_p),
                               tau_c=lambda v: 0.01, _model_spec=lambda: spec)

    orchs = {}
    for name, blocks in (("alpha", 4), ("beta", 2)):
        spec = ModelSpec(num_blocks=blocks, block_size=0.1 * GB, cache_size=0.01 * GB)
        orchs[name] = SimpleNamespace(model_id=name, prefix=f"{name}-prefix", planner=planner(spec), dht=FakeDHT(),
                                      stats=SimpleNamespace(history=[]), model_spec=lambda spec=spec: spec)
    prefixes = [o.prefix for o in orchs.values()]
    for peer in ("s0", "s1", "s2", "s3"):
        for o in orchs.values():
            rec = ServerRecord(peer_id=peer, state="joining", memory_bytes=GB // 2, tau_p=0.5, num_blocks=0,
                               models=prefixes, serving=orchs["alpha"].prefix)
            o.planner.seen[peer] = rec
            o.planner.servers[peer] = ServerView(peer_id=peer, record=rec)
    now = time.monotonic()
    for i in range(15):  # traffic on alpha and no plan yet: a re-placement (analytic index, the default)
        orchs["alpha"].planner.rates.arrive(now - 10.0 + i * 10.0 / 15)
    placer = ModelPlacer(list(orchs.values()), window_s=30.0, reload_s=1.0, min_arrivals=10, interval_s=1000.0)
    loop_ran = threading.Event()
    waited: list[bool] = []
    decide = placer._decide

    def blocking_decide(*args):
        # set by a task of the loop: only if this search runs off it (on it, the loop waits for the search)
        waited.append(loop_ran.wait(5.0))
        return decide(*args)

    placer._decide = blocking_decide

    async def main():
        async def other_work():
            loop_ran.set()

        task = asyncio.create_task(other_work())
        await placer.round()
        await task

    asyncio.run(main())
    assert waited == [True] and len(placer.replans) == 1


def test_the_planners_searches_run_off_the_event_loop(monkeypatch):
    """A full re-plan takes seconds with hundreds of servers (4 s at 300 in the default mode): it ran on the event
    loop, so every request and stream stalled meanwhile. The initial plan and a re-plan's searches (incremental,
    joint, full) now run in a thread while the loop goes on."""
    import types

    from petals_chain.orchestrator.planner import Planner, ServerView
    from petals_chain.swarm.records import ServerRecord

    def record(name: str, tau_p: float, **kw) -> ServerRecord:
        return ServerRecord(**{"peer_id": name, "public_name": name, "state": "joining", "memory_bytes": 300,
                               "tau_p": tau_p, "max_length": 64, "kv_cache": "slots", **kw})

    dht = types.SimpleNamespace(peer_id="orch", publish_assignment=lambda prefix, rec, exp: None)
    model = ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0)
    pl = Planner(dht=dht, prefix="x", client=None, max_length=64, on_chains=lambda chains: None, arrival_rate=0.5,
                 model_spec_fallback=lambda: model, use_all_servers=True, replan_interval_s=0.0)
    for name, tau_p in (("A", 0.1), ("B", 0.2)):
        pl.servers[name] = ServerView(peer_id=name, record=record(name, tau_p))
    pl.last_change = -1e9  # settled
    ran_meanwhile: list[str] = []
    ticks = {"n": 0}

    def slow(name, fn):
        def wrapped(*args, **kwargs):
            before = ticks["n"]
            time.sleep(0.3)  # a long search: the loop ticks meanwhile only if it runs elsewhere
            if ticks["n"] > before:
                ran_meanwhile.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(pl, "full_plan", slow("full", pl.full_plan))
    monkeypatch.setattr(pl, "_search_joins", slow("joins", pl._search_joins))

    async def ticker(stop: asyncio.Event):
        while not stop.is_set():
            ticks["n"] += 1
            await asyncio.sleep(0.01)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(stop))
        await asyncio.sleep(0)
        await pl._decide([], [])  # the initial plan
        assert pl.plan is not None
        pl.servers["C"] = ServerView(peer_id="C", record=record("C", 0.4))  # a join, and a re-plan due
        await pl._decide([], [])
        stop.set()
        await task

    asyncio.run(main())
    assert ran_meanwhile == ["full", "full", "joins"], ran_meanwhile  # a re-plan sizes joins at the full plan's c
