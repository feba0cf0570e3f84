"""The model placer's decisions (orchestrator/placement.py) over fake orchestrators: which servers are flexible,
where a joining server goes, moves under a traffic shift, a departed server's placement kept, the planners' filter,
and the placement record the servers read (signed schema)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from petals_chain.algorithms.chainsim import StepCost
from petals_chain.model import ModelSpec
from petals_chain.orchestrator.dispatch import DispatchJob
from petals_chain.orchestrator.placement import ModelPlacer
from petals_chain.orchestrator.planner import RateEstimator, ServerView
from petals_chain.swarm.records import PlacementRecord, ServerRecord, SwarmSchemaV1, _PlacementValueV1

GB = 2**30


class FakePlanner:
    def __init__(self, spec: ModelSpec):
        self.seen: dict[str, ServerRecord] = {}
        self.servers: dict[str, ServerView] = {}
        self.rates = RateEstimator()
        self.plan = None
        self.spec = spec
        self.placed = None

        self.measured: dict[str, float] = {}  # peer -> compute per block per job delivered (observed steps)

    def measured_tau_p(self, v: ServerView) -> float | None:
        return self.measured.get(v.peer_id)

    def tau_p(self, v: ServerView) -> float:
        return self.measured.get(v.peer_id, float(v.record.tau_p))

    def tau_c(self, v: ServerView) -> float:
        return 0.01

    def _model_spec(self) -> ModelSpec:
        return self.spec


class FakeDHT:
    peer_id = "orch"

    def __init__(self):
        self.stored: dict[str, PlacementRecord] = {}

    async def apublish_placement(self, prefix: str, record: PlacementRecord, expiration_s: float) -> bool:
        self.stored[prefix] = record
        return True


def fake_orch(name: str, blocks: int, dht: FakeDHT) -> SimpleNamespace:
    spec = ModelSpec(num_blocks=blocks, block_size=0.1 * GB, cache_size=0.01 * GB)
    return SimpleNamespace(model_id=name, prefix=f"{name}-prefix", planner=FakePlanner(spec), dht=dht,
                           stats=SimpleNamespace(history=[]), model_spec=lambda: spec)


def record(peer: str, prefixes: list[str], serving: str, *, tau_p: float = 0.5, blocks: int = 0) -> ServerRecord:
    return ServerRecord(peer_id=peer, state="online" if blocks else "joining", memory_bytes=GB // 2, tau_p=tau_p,
                        num_blocks=blocks, models=prefixes, serving=serving)


def announce(orchs, peer: str, offered: list[str], serving: str, *, blocks: int = 0) -> None:
    """The server's records under each offered model's prefix, as the server publishes them."""
    prefixes = [orchs[n].prefix for n in offered]
    for n in offered:
        o = orchs[n]
        rec = record(peer, prefixes, serving, blocks=blocks if serving == o.prefix else 0)
        o.planner.seen[peer] = rec
        o.planner.servers[peer] = ServerView(peer_id=peer, record=rec)


@pytest.fixture
def swarm():
    dht = FakeDHT()
    orchs = {n: fake_orch(n, b, dht) for n, b in (("alpha", 4), ("beta", 2))}
    return orchs, dht


def placer_for(orchs, **kw) -> ModelPlacer:
    kw.setdefault("interval_s", 1000.0)
    return ModelPlacer(list(orchs.values()), window_s=30.0, reload_s=1.0, min_arrivals=10, **kw)


def arrivals(orch, n: int, now: float, span_s: float = 10.0) -> None:
    for i in range(n):
        orch.planner.rates.arrive(now - span_s + span_s * i / n)


def test_joining_servers_cover_every_model_and_planners_see_only_theirs(swarm):
    orchs, dht = swarm
    placer = placer_for(orchs)
    for peer in ("s0", "s1", "s2"):
        announce(orchs, peer, ["alpha", "beta"], orchs["alpha"].prefix)
    announce(orchs, "only-beta", ["beta"], orchs["beta"].prefix)
    asyncio.run(placer.round())
    assert set(placer.placement) == {"s0", "s1", "s2"}  # the single-model server is not the placer's
    counts = placer.json()["servers_per_model"]
    assert counts["alpha"] >= 1 and sum(counts.values()) == 3  # alpha had no chain: it got a server first
    # each planner's filter: flexible servers by the placement, the single-model one where it serves
    for name, o in orchs.items():
        mine = {p for p, r in o.planner.seen.items() if o.planner.placed(p, r)}
        assert mine == {p for p, m in placer.placement.items() if m == name} | ({"only-beta"} if name == "beta" else set())
    # published under both prefixes, the servers' peer ids mapped to DHT prefixes, valid for the DHT schema
    assert set(dht.stored) == {"alpha-prefix", "beta-prefix"}
    rec = dht.stored["alpha-prefix"]
    assert rec.placement == {p: orchs[m].prefix for p, m in placer.placement.items()}
    _PlacementValueV1.parse_obj(rec.to_value())  # what hivemind's schema validator checks (strict types)
    assert PlacementRecord.model_validate(rec.to_value()) == rec
    assert "placement" in SwarmSchemaV1.__fields__


def test_a_server_holding_blocks_keeps_them_and_a_departed_server_keeps_its_model(swarm):
    orchs, _ = swarm
    placer = placer_for(orchs, forget_s=5.0)
    announce(orchs, "s0", ["alpha", "beta"], orchs["beta"].prefix, blocks=2)  # holds beta's blocks (restart)
    asyncio.run(placer.round())
    assert placer.placement == {"s0": "beta"}
    for o in orchs.values():  # s0 leaves
        o.planner.seen.pop("s0")
    asyncio.run(placer.round())
    assert placer.placement == {"s0": "beta"}  # kept while it may come back
    announce(orchs, "s0", ["alpha", "beta"], orchs["alpha"].prefix)  # restarted: serves its first model, no blocks
    asyncio.run(placer.round())
    assert placer.placement == {"s0": "beta"} and placer.moves == 0
    for o in orchs.values():
        o.planner.seen.pop("s0")
    asyncio.run(placer.round())
    assert placer.placement == {"s0": "beta"}
    placer.clock = lambda: time.monotonic() + 10.0
    asyncio.run(placer.round())
    assert placer.placement == {}  # forgotten after forget_s


def test_traffic_shift_moves_servers_to_the_busy_model(swarm):
    orchs, _ = swarm
    placer = placer_for(orchs)
    for peer in ("s0", "s1", "s2", "s3"):
        announce(orchs, peer, ["alpha", "beta"], orchs["alpha"].prefix)
    now = time.monotonic()
    arrivals(orchs["alpha"], 15, now)  # 1.5 req/s on alpha: one chain of 2 slots (1 job/s) is not enough
    asyncio.run(placer.round())
    first = placer.json()["servers_per_model"]
    assert first["alpha"] >= 2, placer.json()
    for o in orchs.values():
        o.planner.rates.arrivals.clear()
    placer.clock = lambda: time.monotonic() + 40.0  # the alpha arrivals left the window
    arrivals(orchs["beta"], 50, time.monotonic() + 40.0)  # beta's traffic; alpha has none left (idle: any gain pays)
    asyncio.run(placer.round())
    after = placer.json()["servers_per_model"]
    assert after["beta"] > first["beta"] and after["alpha"] >= 1, placer.json()
    assert placer.moves >= 1 and any("pays" in m["why"] for m in placer.json()["recent"])


def test_a_drift_replan_is_followed_by_one_on_a_window_of_new_traffic_only(swarm):
    """A drift is noticed while the window still mixes the traffic from before it, so the re-plan it triggers sees
    rates of neither regime: one more re-plan follows ``window_s`` later (here the mix then stays put while beta
    grows fivefold, which the drift detector alone would leave to the 1000 s interval). Six servers: alpha needs
    two for a chain, and no move leaves it without one while it has traffic."""
    orchs, _ = swarm
    placer = placer_for(orchs)  # window 30 s
    for peer in ("s0", "s1", "s2", "s3", "s4", "s5"):
        announce(orchs, peer, ["alpha", "beta"], orchs["alpha"].prefix)
    base, now = time.monotonic(), [0.0]
    placer.clock = lambda: base + now[0]
    replans: list[tuple[float, dict]] = []

    def advance(until: float, rate_alpha: float, rate_beta: float, step: float = 2.0) -> None:
        while now[0] < until:
            t0 = now[0]
            now[0] += step
            for name, rate in (("alpha", rate_alpha), ("beta", rate_beta)):
                n = round(rate * step)
                for i in range(n):
                    orchs[name].planner.rates.arrive(base + t0 + step * (i + 0.5) / n)
            planned = placer.planned_at
            asyncio.run(placer.round())
            if placer.planned_at != planned:
                replans.append((now[0], dict(placer.json()["servers_per_model"])))

    advance(60, 2, 2)
    advance(100, 1, 3)  # the mix shifts: a drift re-plan once the window has moved enough
    drift_at = next(t for t, _ in replans if t > 60)
    assert placer.trigger.settle_at == pytest.approx(base + drift_at + 30.0)
    assert placer.json()["settle_in_s"] == pytest.approx(drift_at + 30.0 - now[0], abs=0.1)
    before = dict(placer.placement)
    advance(drift_at + 28, 15, 60)  # the same mix, 5x the rate: no drift, no interval
    assert [t for t, _ in replans if t > drift_at] == [] and placer.placement == before
    advance(drift_at + 30, 15, 60)
    t, counts = replans[-1]
    assert t == drift_at + 30 and placer.trigger.settle_at is None
    assert counts["beta"] > sum(1 for m in before.values() if m == "beta"), counts
    assert any(m["why"].startswith("settling after a drift") for m in placer.json()["recent"])


def test_a_model_whose_servers_left_gets_one_at_once_not_at_the_interval(swarm):
    """The servers placed on a model with traffic leave: a flexible server is moved to it within a drift window,
    not when the re-placement interval ends (up to an hour; 1000 s here), the mix being unchanged."""
    orchs, _ = swarm
    placer = placer_for(orchs)  # window 30 s
    for peer in ("s0", "s1", "s2", "s3"):
        announce(orchs, peer, ["alpha", "beta"], orchs["alpha"].prefix)
    base, now = time.monotonic(), [0.0]
    placer.clock = lambda: base + now[0]

    def advance(seconds: float) -> None:
        end = now[0] + seconds
        while now[0] < end:
            now[0] += 2.0
            for o in orchs.values():
                o.planner.rates.arrive(base + now[0] - 1.0)  # 0.5 req/s each, a steady mix
            asyncio.run(placer.round())

    advance(60)
    on_beta = [p for p, m in placer.placement.items() if m == "beta"]
    assert on_beta and len(on_beta) < 4
    for peer in on_beta:  # they leave the swarm
        for o in orchs.values():
            o.planner.seen.pop(peer, None)
            o.planner.servers.pop(peer, None)
    advance(32)
    assert any(m == "beta" for p, m in placer.placement.items() if p not in on_beta), placer.placement
    assert now[0] - (placer.planned_at - base) < 40 and placer.interval.interval > 100


def test_even_never_moves_and_static_moves_once_for_the_first_traffic(swarm):
    orchs, _ = swarm
    for policy in ("even", "static"):
        for o in orchs.values():
            o.planner.seen.clear()
            o.planner.servers.clear()
            o.planner.rates.arrivals.clear()
        placer = placer_for(orchs, policy=policy)
        for peer in ("s0", "s1", "s2", "s3"):
            announce(orchs, peer, ["alpha", "beta"], orchs["alpha"].prefix)
        asyncio.run(placer.round())
        before = dict(placer.placement)
        if policy == "even":
            assert sorted(before.values()) == ["alpha", "alpha", "beta", "beta"]
        now = time.monotonic()
        arrivals(orchs["alpha"], 15, now)  # the first traffic: alpha-heavy
        asyncio.run(placer.round())
        first = dict(placer.placement)
        if policy == "static":
            assert placer.estimate is not None  # its one re-placement, for this traffic
        else:
            assert first == before and placer.moves == 0
        for o in orchs.values():
            o.planner.rates.arrivals.clear()
        placer.clock = lambda: time.monotonic() + 5000.0  # the traffic shifts to beta, intervals pass
        arrivals(orchs["beta"], 50, time.monotonic() + 5000.0)
        moves = placer.moves
        asyncio.run(placer.round())
        assert placer.placement == first and placer.moves == moves  # never again


def test_placement_needs_two_models_and_a_known_policy(swarm):
    orchs, _ = swarm
    with pytest.raises(ValueError, match="two models"):
        ModelPlacer([orchs["alpha"]])
    with pytest.raises(ValueError, match="unknown placement policy"):
        ModelPlacer(list(orchs.values()), policy="random")


def test_a_models_block_time_is_what_its_servers_delivered_not_what_the_others_advertise(swarm):
    """Six servers offer both models and advertise 0.5 s per block per job; the one serving beta delivered 5 s (a
    real model slower than advertised). Beta's reference time is the delivered 5 s, not the median of six adverts
    (0.5 s): with it the placer saw beta as fast and left it one server at 3 req/s. A server's speed compares like
    with like (delivered with delivered)."""
    orchs, _ = swarm
    placer = placer_for(orchs)
    for i in range(6):
        announce(orchs, f"s{i}", ["alpha", "beta"], orchs["beta" if i == 0 else "alpha"].prefix, blocks=2)
    orchs["beta"].planner.measured["s0"] = 5.0
    for i in range(1, 6):
        orchs["alpha"].planner.measured[f"s{i}"] = 0.5 if i < 5 else 1.0
    volunteers, models, _ = placer.snapshot(placer._records(), time.monotonic())
    by_name = {m.name: m for m in models}
    assert by_name["beta"].block_time == pytest.approx(5.0) and by_name["alpha"].block_time == pytest.approx(0.5)
    speed = {v.name: v.speed for v in volunteers}
    assert speed["s0"] == pytest.approx(1.0) and speed["s1"] == pytest.approx(1.0)
    assert speed["s5"] == pytest.approx(0.5)  # it delivered alpha at half the others' speed
    # before anything was measured, adverts against adverts
    for o in orchs.values():
        o.planner.measured.clear()
    volunteers, models, _ = placer.snapshot(placer._records(), time.monotonic())
    assert {m.name: m.block_time for m in models} == {"alpha": 0.5, "beta": 0.5}
    assert all(v.speed == pytest.approx(1.0) for v in volunteers)


def completed(orch, arrivals_s: list[float], cost, *, wall: float, mono: float, seed: int = 0) -> None:
    """``orch`` served requests arriving ``arrivals_s`` seconds ago (the planner's arrivals and the stats' history,
    as the orchestrator records them), each taking what ``cost`` says for its lengths and batch."""
    rng = random.Random(seed)
    orch.planner.rates.t0 = mono - 300
    shapes = [(rng.choice((5, 50)), rng.randint(20, 40), rng.choice((1, 2, 3))) for _ in arrivals_s]
    per_step = sum(i for i, _, _ in shapes) / sum(o for _, o, _ in shapes)  # the others' prompts in each step
    for ago, (inp, out, batch) in zip(arrivals_s, shapes):
        orch.planner.rates.arrive(mono - ago)
        service = cost.request_s(inp, out, batch, per_step)
        orch.stats.history.append({"t": wall - ago + service, "response_s": service, "wait_s": 0.0,
                                   "service_s": service, "prompt_tokens": inp, "tokens": out, "batch": batch})


def test_the_simulated_index_replays_recent_requests_and_gives_a_burst_the_servers_it_needs():
    """Six servers hold beta (restarted); alpha then gets 60 requests in a 3 s burst and beta 1 req/s, about 2 and
    1 req/s over the 30 s window. The M/M/C index sees only those rates (alpha: 1 server; a second one would cut
    its L_N by less than MIN_LN_GAIN, which pays no reload); the simulated one
    (the seed's) replays the requests with the step cost fitted from them, sees the burst miss its SLO on two
    servers and gives alpha five (beta keeps one). Beta's waiting jobs are replayed too."""
    cost = StepCost(a=0.05, b=0.001, d=0.01)
    got = {}
    for index in ("analytic", "simulated"):
        dht = FakeDHT()
        orchs = {n: fake_orch(n, 2, dht) for n in ("alpha", "beta")}
        waiting = [DispatchJob(job_id=f"w{i}", arrival=time.monotonic() - 1.0, input_tokens=5, expected_output=500)
                   for i in range(3)]
        orchs["beta"].dispatch = SimpleNamespace(waiting_jobs=lambda: waiting)
        placer = placer_for(orchs, index=index)
        for i in range(6):
            announce(orchs, f"s{i}", ["alpha", "beta"], orchs["beta"].prefix, blocks=2)
        asyncio.run(placer.round())
        assert placer.json()["servers_per_model"] == {"alpha": 0, "beta": 6}  # they hold beta's blocks: kept
        wall, mono = time.time(), time.monotonic()
        completed(orchs["alpha"], [10 - 3 * k / 60 for k in range(60)], cost, wall=wall, mono=mono)
        completed(orchs["beta"], [59.5 - k for k in range(60)], cost, wall=wall, mono=mono, seed=1)
        asyncio.run(placer.round())
        j = placer.json()
        got[index] = j["servers_per_model"]
        replan = j["replans"][-1]
        assert replan["index"] == index and j["index"] == index
        assert replan["rule"] == ("largest_gain" if index == "simulated" else "most_unserved")
    assert got["analytic"] == {"alpha": 1, "beta": 5}, got
    assert got["simulated"]["alpha"] >= 4 and got["simulated"]["beta"] >= 1, got
    # the alpha burst (60) and beta's requests of the window (30 s, or the time since the last plan if longer)
    # plus its 3 waiting jobs
    assert replan["replayed"] == 60 + 30 + 3
    history, _ = placer.history(*placer.snapshot(placer._records(), time.monotonic())[:2], {}, time.monotonic())
    assert sorted(r.output for r in history.requests if r.model == "beta")[-3:] == [40, 40, 40]  # 500 declared:
    # a waiting job is replayed for at most the longest output seen
    for fitted in replan["step_cost"].values():
        assert fitted == pytest.approx([cost.a, cost.b, cost.d], rel=1e-3)


def test_the_simulated_index_falls_back_to_the_analytic_one_until_it_can_replay():
    dht = FakeDHT()
    orchs = {n: fake_orch(n, 2, dht) for n in ("alpha", "beta")}
    placer = placer_for(orchs, index="simulated")
    for i in range(4):
        announce(orchs, f"s{i}", ["alpha", "beta"], orchs["alpha"].prefix)
    asyncio.run(placer.round())
    mono, wall = time.monotonic(), time.time()
    arrivals(orchs["alpha"], 15, mono)  # traffic seen, nothing completed yet
    asyncio.run(placer.round())
    assert placer.json()["replans"][-1]["index"] == "analytic (0 recent requests, fewer than 40)"
    completed(orchs["alpha"], [5.0] * 4, StepCost(), wall=wall, mono=mono)  # too few to fit a step cost on
    assert placer.history(*placer.snapshot(placer._records(), mono)[:2], {}, mono) == (
        None, "no step cost for alpha yet (4 completed requests)")
    with pytest.raises(ValueError, match="unknown placement index"):
        placer_for(orchs, index="exact")
    with pytest.raises(ValueError, match="unknown placement rule"):
        placer_for(orchs, rule="random")


def test_the_simulated_index_reaches_back_for_enough_requests_and_keeps_a_quiet_model_served():
    """A window may hold no request of a bursty model (it is between bursts): the replay reaches back until
    ``min_replay`` requests are in, and a model with completions kept but none in the window keeps its rate over
    them, so no plan strips its last chain (a real run placed every server on the other model between bursts)."""
    cost = StepCost(a=0.05, b=0.001, d=0.01)
    dht = FakeDHT()
    orchs = {n: fake_orch(n, 2, dht) for n in ("alpha", "beta")}
    placer = placer_for(orchs, index="simulated")  # window 30 s, min_replay 40
    for i in range(4):
        announce(orchs, f"s{i}", ["alpha", "beta"], orchs["alpha" if i < 2 else "beta"].prefix, blocks=2)
    asyncio.run(placer.round())
    assert placer.json()["servers_per_model"] == {"alpha": 2, "beta": 2}
    wall, mono = time.time(), time.monotonic()
    completed(orchs["alpha"], [100 - k for k in range(30)], cost, wall=wall, mono=mono)  # 100-71 s ago
    completed(orchs["beta"], [10 - k / 2 for k in range(10)], cost, wall=wall, mono=mono, seed=1)  # in the window
    volunteers, models, _ = placer.snapshot(placer._records(), mono)
    history, _ = placer.history(volunteers, models, dict(placer.placement), mono)
    assert len(history.requests) == 40 and history.span_s == pytest.approx(100, abs=0.5)  # back to alpha's first
    assert history.rate_floor["alpha"] == pytest.approx(30 / 100, rel=0.02)
    # beta keeps arriving, alpha is quiet: beta gets what it needs, alpha keeps a chain
    completed(orchs["beta"], [5 - k / 10 for k in range(50)], cost, wall=wall, mono=mono, seed=2)
    asyncio.run(placer.round())
    replan = placer.json()["replans"][-1]
    assert replan["index"] == "simulated" and replan["rates"]["alpha"] == 0.0
    assert placer.json()["servers_per_model"]["alpha"] >= 1, replan


def test_no_move_leaves_a_model_with_traffic_without_a_chain(swarm):
    """Four servers; alpha needs two of them for a chain (beta one). As beta's traffic grows to four times
    alpha's, the unserved index aims at a plan that swaps servers between them, and only one side of the swap
    pays: before, that move was made and left alpha one server and no chain while its users kept asking (the
    drift test's sequence on four servers). No move may strand a model with traffic."""
    orchs, _ = swarm
    placer = placer_for(orchs)
    for peer in ("s0", "s1", "s2", "s3"):
        announce(orchs, peer, ["alpha", "beta"], orchs["alpha"].prefix)
    base, now = time.monotonic(), [0.0]
    placer.clock = lambda: base + now[0]
    lowest = 4
    for until, rate_alpha, rate_beta in ((60, 2, 2), (100, 1, 3), (160, 15, 60)):
        while now[0] < until:
            t0 = now[0]
            now[0] += 2.0
            for name, rate in (("alpha", rate_alpha), ("beta", rate_beta)):
                n = round(rate * 2.0)
                for i in range(n):
                    orchs[name].planner.rates.arrive(base + t0 + 2.0 * (i + 0.5) / n)
            asyncio.run(placer.round())
            lowest = min(lowest, placer.json()["servers_per_model"]["alpha"])
    assert placer.moves >= 1 and lowest >= 2, placer.json()["replans"]


def test_a_model_with_requests_in_flight_is_not_idle(swarm):
    """A model whose one long request arrived before the window read rate 0 (idle: any gain paid for moving the
    server under it; the next arrival moved one back: two reloads and a cut stream). Its requests in flight count."""
    orchs, _ = swarm
    placer = placer_for(orchs)
    now = time.monotonic()
    orchs["alpha"].planner.rates.t0 = now - 100.0
    orchs["alpha"].dispatch = SimpleNamespace(stepping=0, queue_length=0)
    assert placer._rate("alpha", now) == 0.0
    orchs["alpha"].dispatch = SimpleNamespace(stepping=1, queue_length=2)
    assert placer._rate("alpha", now) == pytest.approx(3 / 30.0)
    arrivals(orchs["alpha"], 6, now)  # arrivals in the window that are also the ones in flight: not counted twice
    assert placer._rate("alpha", now) == pytest.approx(6 / 30.0)


def test_sessions_held_between_turns_are_not_in_flight(swarm):
    """A model whose traffic had ended but with one chat session held between turns read one request per window in
    flight (a session holds its lease): the placer refused to move its servers to a model with traffic."""
    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    orchs, _ = swarm
    placer = placer_for(orchs)
    now = time.monotonic()
    orchs["alpha"].planner.rates.t0 = now - 100.0

    async def held(k: int) -> DispatchManager:
        dm = DispatchManager(schedule="fcfs")
        dm.set_chains([Chain(servers=("x",), blocks=(4,), service_time=1.0, capacity=8, spans=((0, 4),))])
        for i in range(k):
            lease = await dm.acquire(DispatchJob(f"s{i}"))
            lease.job.idle = i > 0  # the first one is stepping
        return dm

    orchs["alpha"].dispatch = asyncio.run(held(4))
    assert orchs["alpha"].dispatch.running == 4 and orchs["alpha"].dispatch.stepping == 1
    assert placer._rate("alpha", now) == pytest.approx(1 / 30.0)
