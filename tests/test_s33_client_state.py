"""Per-client state is bounded: the state of a name removed from the ``--api-keys`` file (or renamed, as a daily
rotation ``alice-YYYYMMDD`` does) is dropped once its last request ended: statistics, fair-sharing counters and its
Prometheus series. Before, every name ever seen was kept for ever (365 rotations: 365 entries in each per-client
dict and 9,125 series in ``/metrics``). Forgetting an idle client leaves the others' counters and dispatch order as
they were (VTC's counters and DLPM's deficits are relative)."""

from __future__ import annotations

import asyncio
from collections import deque
import os
import random
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from petals_chain.algorithms.fairness import (FAIRNESS_POLICIES, FairDispatcher, FairnessConfig, FairPolicy,
                                              FairRequest, ServiceMeter)
from petals_chain.orchestrator.auth import CLIENT
from petals_chain.orchestrator.fairness import ClientShares
from petals_chain.orchestrator.stats import Stats

A, B = "a" * 20, "b" * 20


class Job:
    def __init__(self, n: int, client: str, tokens: int, matched: dict | None = None):
        self.n, self.client, self.tokens, self.matched = n, client, tokens, matched or {}


def describe(job: Job) -> FairRequest:
    return FairRequest(item=job, client=job.client, input_tokens=job.tokens, matched=job.matched,
                       expected_output=4)


def _series(registry, client: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if f'client="{client}"' in line]


def _record(stats: Stats, client: str, ok: bool = True) -> None:
    token = CLIENT.set(client)
    try:
        stats.record(wait_s=0.1, service_s=0.5, tokens=5, prompt_tokens=3, ok=ok)
    finally:
        CLIENT.reset(token)


class _Started:
    """A dispatch job as ClientShares sees it."""

    def __init__(self, client: str, tokens: int = 30, wait_s: float = 0.2):
        self.client, self.input_tokens, self.matched, self.expected_output = client, tokens, {}, 4
        self.wait_s, self.requeue, self.checked = wait_s, False, False


# ---- the pure policies ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", FAIRNESS_POLICIES)
def test_forget_drops_everything_a_policy_keeps_of_a_client(policy):
    d = FairDispatcher([(2.0, 1), (1.0, 1)], FairPolicy(policy, FairnessConfig(quantum=40.0, worker_quantum=50.0)),
                       describe, workers=["w0", "w1"])
    running = []
    for n, c in enumerate("axbxaxbx"):
        job = Job(n, c, 10 + n, matched={"w0": 5})
        k = d.arrive(job)
        if k is not None:
            running.append((k, job))
    while running:
        k, job = running.pop(0)
        d.policy.output(job.client, d.workers[k], 2)
        nxt = d.complete(k)
        if nxt is not None:
            running.append((k, nxt))
    p = d.policy
    assert "x" in p.service and p.admitted_requests["x"] == 4
    before = p.snapshot()
    p.forget("x")
    after = p.snapshot()
    assert "x" not in p.service and "x" not in p.admitted_requests and "x" not in p._rr_client
    assert not p.worker_credit.of("x") and all(k[0] != "x" for k in p.worker_credit)
    assert all("x" not in counters for counters in after["counters"].values())
    # the others' counters are untouched
    assert after["service"] == {c: v for c, v in before["service"].items() if c != "x"}
    assert after["counters"] == {w: {c: v for c, v in cs.items() if c != "x"} for w, cs in before["counters"].items()}
    p.forget("x")  # again, and a client never seen: nothing to do
    p.forget("nobody")
    assert p.snapshot() == after


@pytest.mark.parametrize("policy", ["vtc", "d-vtc"])
def test_vtc_forgetting_the_last_admitted_client_keeps_the_floor_an_arrival_is_lifted_to(policy):
    """VTC lifts a client arriving with nobody queued to the counter of the client admitted last. That client
    forgotten, the floor stays its counter: dropped with it, the floor fell to 0 and the arrival banked every unit
    served since its own counter (here 500 of x's)."""
    def run(forget: bool) -> dict:
        d = FairDispatcher([(1.0, 1)], FairPolicy(policy, FairnessConfig()), describe)
        assert d.arrive(Job(0, "a", 10)) == 0  # a: 10
        d.policy.output("a", 0, 5)
        assert d.complete(0) is None
        assert d.arrive(Job(1, "x", 500)) == 0  # x: lifted to a's 20, then +500
        assert d.complete(0) is None  # x idle: nothing of it waits or runs
        if forget:
            d.policy.forget("x")
        assert d.arrive(Job(2, "a", 10)) == 0  # a, with nobody queued: lifted to x's counter
        return d.policy.snapshot()["counters"]

    kept, forgotten = run(False), run(True)
    assert {w: {c: v for c, v in cs.items() if c != "x"} for w, cs in kept.items()} == forgotten
    assert forgotten[next(iter(forgotten))]["a"] == 530.0


def _scenario(policy: str, seed: int, forget: bool) -> tuple[list[int], dict]:
    """Clients a, b and x share three chains; x stops sending and, once nothing of it waits or runs (and it was the
    last client admitted), is forgotten or not; a and b go on. Returns the jobs in start order and the counters."""
    rng = random.Random(seed)
    d = FairDispatcher([(3.0, 2), (2.0, 1), (1.0, 1)],
                       FairPolicy(policy, FairnessConfig(quantum=60.0, worker_quantum=80.0)), describe,
                       workers=["w0", "w1", "w2"])
    order: list[int] = []
    running: list[tuple[int, Job]] = []
    n = 0

    def arrive(client: str) -> None:
        nonlocal n
        job = Job(n, client, rng.randint(5, 60), matched={rng.choice(["w0", "w1", "w2"]): rng.randint(0, 20)})
        n += 1
        k = d.arrive(job)
        if k is not None:
            running.append((k, job))
            order.append(job.n)

    def complete_one() -> None:
        k, job = running.pop(rng.randrange(len(running)))
        d.policy.output(job.client, d.workers[k], rng.randint(1, 8))
        nxt = d.complete(k)
        if nxt is not None:
            running.append((k, nxt))
            order.append(nxt.n)

    for _ in range(40):  # phase 1: all three
        if running and rng.random() < 0.45:
            complete_one()
        else:
            arrive(rng.choice("abx"))
    while running:  # drain, then x's last request alone: the last one admitted
        complete_one()
    arrive("x")
    while running:
        complete_one()
    if forget:
        d.policy.forget("x")
    for _ in range(60):  # phase 2: a and b
        if running and rng.random() < 0.5:
            complete_one()
        else:
            arrive(rng.choice("ab"))
    while running:
        complete_one()
    snap = d.policy.snapshot()
    counters = {w: {c: v for c, v in cs.items() if c != "x"} for w, cs in snap["counters"].items()}
    return order, {"counters": counters, "service": {c: v for c, v in snap["service"].items() if c != "x"},
                   "credit": {k: v for k, v in d.policy.worker_credit.items() if k[0] != "x"}}


@pytest.mark.parametrize("policy", FAIRNESS_POLICIES)
def test_forgetting_an_idle_client_does_not_change_the_others_order_nor_counters(policy):
    for seed in range(6):
        kept_order, kept = _scenario(policy, seed, forget=False)
        order, state = _scenario(policy, seed, forget=True)
        assert order == kept_order, (policy, seed)
        assert state == kept, (policy, seed)


def test_the_meter_forgets_a_client_and_jain_is_that_of_the_others():
    m = ServiceMeter(window_s=60.0)
    for t in range(10):
        m.sample(float(t), ["a", "b", "x"])
        m.served(float(t), "a", 10.0)
        m.served(float(t), "b", 10.0)
        m.served(float(t), "x", 100.0)
    assert m.saturated(10.0) == ["a", "b", "x"] and m.jain(10.0) < 0.6
    m.forget("x")
    assert m.rates(10.0) == {"a": pytest.approx(100 / 60), "b": pytest.approx(100 / 60)}
    assert m.backlogged(10.0) == ["a", "b"] and m.saturated(10.0) == ["a", "b"]
    assert m.jain(10.0) == pytest.approx(1.0)
    assert all("x" not in clients for _, clients in m._samples) and all(c != "x" for _, c, _ in m._events)


# ---- the orchestrator's side -----------------------------------------------------------------------------------

def test_stats_forget_a_client_its_totals_window_and_series():
    s = Stats()
    for client in ("alice", "bob"):
        _record(s, client)
        _record(s, client, ok=False)
        s.m_deadlines.labels(client, "met").inc()
    assert s.tokens_last_minute("alice") == 16 and _series(s.registry, "alice")
    bob_before = (s.client_totals("bob"), _series(s.registry, "bob"))
    s.forget_client("alice")
    assert "alice" not in s._totals and "alice" not in s._request_totals and "alice" not in s._window
    assert s.tokens_last_minute("alice") == 0 and _series(s.registry, "alice") == []
    assert (s.client_totals("bob"), _series(s.registry, "bob")) == bob_before
    assert (s.completed, s.failed) == (2, 2)  # the totals over every client keep what it did
    _record(s, "anonymous")
    s.forget_client("anonymous")  # the client of every keyless request: never forgotten
    assert s.client_totals("anonymous")["completed"] == 1 and _series(s.registry, "anonymous")


def test_series_are_removed_without_remove_by_labels(monkeypatch):
    """prometheus_client before 0.22 has no remove_by_labels (setup.cfg asks for >= 0.19)."""
    from prometheus_client.metrics import MetricWrapperBase

    monkeypatch.delattr(MetricWrapperBase, "remove_by_labels", raising=False)
    s = Stats()
    shares = ClientShares(FairPolicy("dlpm", FairnessConfig(quantum=10.0)), registry=s.registry, keyed=True)
    for client in ("alice", "bob"):
        _record(s, client)
        shares.started(_Started(client), ("w",), queued=True)
        shares.output(client, ("w",), 3)
    s.forget_client("alice")
    shares.forget("alice")
    assert _series(s.registry, "alice") == [] and len(_series(s.registry, "bob")) > 20


def test_client_shares_forget_a_client_and_the_swarm_state_no_longer_lists_it():
    reg = CollectorRegistry()
    shares = ClientShares(FairPolicy("dlpm", FairnessConfig(quantum=10.0)), registry=reg, keyed=True)
    for client in ("alice", "bob", "anonymous"):
        job = _Started(client)
        shares.describe(job)
        shares.started(job, ("w",), queued=True)
        shares.prompt(job, ("w",), 30)
        shares.output(client, ("w",), 3)
        shares.abandoned(_Started(client), 1.0)
    assert set(shares.json()["clients"]) == {"alice", "bob", "anonymous"}
    bob = shares.json()["clients"]["bob"]
    shares.forget("alice")
    shares.forget("anonymous")  # never forgotten
    state = shares.json()
    assert set(state["clients"]) == {"bob", "anonymous"} and state["clients"]["bob"] == bob
    assert "alice" not in shares.waits and "alice" not in shares.policy.service
    assert _series(reg, "alice") == [] and _series(reg, "bob") and _series(reg, "anonymous")


def test_a_daily_rotation_keeps_the_state_of_the_names_in_use_only():
    """365 names, one a day, each forgotten when the next replaces it: the dicts and /metrics hold one name."""
    s = Stats()
    shares = ClientShares(FairPolicy("vtc", FairnessConfig()), registry=s.registry, keyed=True)
    for day in range(365):
        name = f"alice-{day:08d}"
        _record(s, name)
        shares.started(_Started(name), ("w",), queued=True)
        shares.output(name, ("w",), 5)
        if day:
            s.forget_client(f"alice-{day - 1:08d}")
            shares.forget(f"alice-{day - 1:08d}")
    kept = [s._totals, s._request_totals, s._window, shares.waits, shares.policy.service,
            shares.policy.admitted_requests, shares.policy.local(None).counter, shares.meter._sums]
    assert [list(d) for d in kept] == [["alice-00000364"]] * len(kept)
    text = generate_latest(s.registry).decode()
    assert {line.split('client="')[1].split('"')[0] for line in text.splitlines() if 'client="' in line} == \
        {"alice-00000364"}


# ---- through the API (a key file reloaded) ----------------------------------------------------------------------

def _write(path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")  # an editor's save: a new file renamed over the old one
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def test_through_the_api_a_removed_names_series_go_once_its_last_request_ended(tiny_model_dir, tmp_path):
    """An orchestrator's API (no servers): alice's requests put her in /metrics; her key removed while one of her
    requests is under way, her series stay until it ends, then go; bob's stay. (Needs the reload hook in limits.py:
    ClientLedger.retire / sweep.)"""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    path = tmp_path / "keys"
    _write(path, f"alice {A}\nbob {B}\n")

    async def main():
        cfg = OrchestratorConfig(model=str(tiny_model_dir), max_length=64, port=0, api_keys=str(path))
        cfg.api_keys_reload_s, cfg.no_chain_wait_s = 0.1, 0.2
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        try:
            app = create_app(orch)
            body = {"model": orch.model_id, "prompt": "hi", "max_tokens": 2}
            go = asyncio.Event()
            sent: list = []

            async def receive():
                await go.wait()  # alice's request under way until the test lets its body come
                return {"type": "http.request", "body": b"{not json", "more_body": False}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                     "root_path": "", "headers": [(b"authorization", f"Bearer {A}".encode()),
                                                  (b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("orch", 80)}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orch",
                                         timeout=30) as c:
                for key in (A, B):  # no chain: each waits no_chain_wait_s, then 503
                    r = await c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
                    assert r.status_code == 503, r.text
                metrics = (await c.get("/metrics")).text
                assert 'client="alice"' in metrics and 'client="bob"' in metrics
                slow = asyncio.ensure_future(app(scope, receive, send))
                await asyncio.sleep(0.2)
                _write(path, f"bob {B}\n")
                deadline = time.monotonic() + 10
                while (await c.get("/api/v1/limits")).json().get("api_keys_reloads", 0) < 1:
                    assert time.monotonic() < deadline, "the removal was not loaded within 10 s"
                    await asyncio.sleep(0.05)
                during = (await c.get("/metrics")).text
                go.set()
                await slow
                after = (await c.get("/metrics")).text
                state = (await c.get("/api/v1/swarm")).json()
            status = next(m["status"] for m in sent if m["type"] == "http.response.start")
            return status, during, after, state, orch
        finally:
            await orch.stop()

    status, during, after, state, orch = asyncio.run(main())
    assert status == 400
    assert 'client="alice"' in during  # its request under way: kept
    assert 'client="alice"' not in after and 'client="bob"' in after
    assert "alice" not in state["fairness"]["clients"] and "bob" in state["fairness"]["clients"]
    assert "alice" not in orch.stats._totals and "alice" not in orch.stats._request_totals
    assert "alice" not in orch.shares.waits and "alice" not in orch.shares.policy.service


def test_the_ledger_forgets_a_removed_name_once_nothing_of_it_runs_and_never_a_name_added_back():
    """ClientLedger.retire / sweep (the reload hook in limits.py): a name with a request under way or a session open
    is kept until they end; one added back meanwhile is kept for good; anonymous is never retired."""
    from types import SimpleNamespace

    from petals_chain.orchestrator.limits import ClientLedger

    stats = Stats()
    shares = ClientShares(FairPolicy("dlpm", FairnessConfig(quantum=10.0)), registry=stats.registry, keyed=True)
    orch = SimpleNamespace(stats=stats, shares=shares, sessions={"s1": object()},
                           dispatch=SimpleNamespace(waiting_jobs=lambda: []))
    ledger = ClientLedger([orch])
    for name in ("alice", "bob", "carol", "anonymous"):
        _record(stats, name)
        shares.started(_Started(name), ("w",), queued=True)
    ledger.active["alice"] = 1  # a request under way
    ledger.sessions_of["bob"] = {"s1"}  # a session open
    ledger.retire({"alice", "bob", "carol", "anonymous"}, set())
    assert ledger.retired == {"alice", "bob"}
    assert "carol" not in stats._totals and "carol" not in shares.waits  # idle: forgotten at once
    assert {"alice", "bob", "anonymous"} <= set(stats._totals) and "anonymous" in shares.waits
    ledger.retire(set(), {"bob"})  # bob is back in the key file: kept for good
    ledger.active.clear()
    ledger.sweep()
    assert ledger.retired == set() and "alice" not in stats._totals and "alice" not in shares.policy.service
    orch.sessions.clear()
    ledger.sweep()
    assert "bob" in stats._totals and "bob" in shares.waits and _series(stats.registry, "bob")


# ---- review of the above (session 33): cost of a reload that removes many names, goodput ------------------------

class _CountedIter(deque):
    """A deque that counts the passes over the fair-sharing window's service events (3-tuples) in it."""

    passes = 0

    def __iter__(self):
        if self and len(self[0]) == 3:
            type(self).passes += 1
        return super().__iter__()


def _no_scan(monkeypatch) -> None:
    """Make a pass over every series of a metric (a collect, remove_by_labels' scan) fail the test."""
    from prometheus_client.metrics import MetricWrapperBase

    def scan(self, *args, **kwargs):
        raise AssertionError(f"{self._name}: every client's series read to forget one")

    monkeypatch.setattr(MetricWrapperBase, "collect", scan)
    monkeypatch.setattr(MetricWrapperBase, "remove_by_labels", scan, raising=False)


def test_forgetting_a_client_reads_only_its_own_series(monkeypatch):
    """Each forget collected every series of 6 metrics (O(all clients' series)): with 2,000 clients 0.2 s per name,
    and a reload removing 1,000 names blocked the event loop for 227 s. Each series is now removed by its labels."""
    s = Stats()
    shares = ClientShares(FairPolicy("dlpm", FairnessConfig(quantum=10.0)), registry=s.registry, keyed=True)
    for client in ("alice", "bob"):
        _record(s, client)
        _record(s, client, ok=False)
        s.end_request("invalid", client)
        s.m_deadlines.labels(client, "missed").inc()
        shares.started(_Started(client), ("w",), queued=True)
        shares.output(client, ("w",), 3)
    token = CLIENT.set("alice")
    try:
        s.record(wait_s=0.0, service_s=0.0, tokens=0, prompt_tokens=0, ok=False, served=False)  # an unserved job
    finally:
        CLIENT.reset(token)
    bob = _series(s.registry, "bob")
    with monkeypatch.context() as m:
        _no_scan(m)
        s.forget_client("alice")
        shares.forget("alice")
    assert _series(s.registry, "alice") == [] and _series(s.registry, "bob") == bob


def test_a_reload_removing_many_names_reads_the_queue_and_the_window_once(monkeypatch):
    """1,000 of 2,000 names removed in one reload: the sweep read every waiting job and live session once per name
    (1,000 reads of the queue) and passed over the fair-sharing window once per name. Now once for them all; the
    names still in use (a job waiting, a session open, a request under way) keep everything."""
    from types import SimpleNamespace

    from petals_chain.orchestrator.limits import ClientLedger

    stats = Stats()
    shares = ClientShares(FairPolicy("vtc", FairnessConfig()), registry=stats.registry, keyed=True)
    names = [f"k{i:04d}" for i in range(2000)]
    for name in names:
        stats._charge(name, 5, "completed")
        shares.started(_Started(name), ("w",), queued=True)
        shares.output(name, ("w",), 2)
    monkeypatch.setattr("petals_chain.algorithms.fairness.deque", _CountedIter)  # the window's rebuilt deques too
    shares.meter._events = _CountedIter(shares.meter._events)
    reads = []
    waiting = [SimpleNamespace(client=n) for n in names[:500:5]]  # some removed names still have a job waiting

    def waiting_jobs():
        reads.append(1)
        return waiting

    orch = SimpleNamespace(stats=stats, shares=shares, sessions={"s1": object()},
                           dispatch=SimpleNamespace(waiting_jobs=waiting_jobs))
    ledger = ClientLedger([orch])
    ledger.sessions_of[names[1]] = {"s1"}
    ledger.active[names[2]] = 1
    busy = {j.client for j in waiting} | {names[1], names[2]}
    _CountedIter.passes = 0
    with monkeypatch.context() as m:
        _no_scan(m)
        ledger.retire(set(names[:1000]), set())
    assert len(reads) == 1 and _CountedIter.passes <= 2, (len(reads), _CountedIter.passes)
    assert ledger.retired == busy
    kept = set(stats._totals)
    assert kept == busy | set(names[1000:]) and set(shares.policy.service) == kept
    assert set(shares.meter._sums) == kept and {c for _, c, _ in shares.meter._events} == kept
    assert {line.split('client="')[1].split('"')[0] for line in generate_latest(stats.registry).decode().splitlines()
            if 'client="' in line} == kept


def test_a_forgotten_clients_on_time_completions_stay_in_the_goodput_of_all():
    """The swarm's goodput (petals_chain_goodput_per_second, /api/v1/swarm) counts every on-time completion of the
    last minute: forgetting a removed name dropped its own at once (here from 5 to 2 a minute)."""
    from petals_chain.orchestrator.deadlines import DeadlineBook, RequestDeadline

    book = DeadlineBook(window_s=60.0)
    for client, n in (("alice", 3), ("bob", 2)):
        for i in range(n):
            dl = RequestDeadline(client=client, arrival=100.0, deadline=110.0)
            dl.first_token(101.0)
            book.settle(dl, now=102.0 + i)
    assert book.goodput(now=120.0) == pytest.approx(5 / 60)
    book.forget("alice")
    assert book.goodput(now=120.0) == pytest.approx(5 / 60)
    assert book.goodput(now=120.0, client="bob") == pytest.approx(2 / 60)
    assert book.goodput(now=120.0, client="alice") == 0.0
    state = book.json(now=120.0)
    assert "alice" not in state["clients"] and state["met"] == 5 and state["goodput_per_s"] == pytest.approx(5 / 60)
    assert book.goodput(now=163.5) == pytest.approx(1 / 60)  # alice's leave the window as they would have
    assert book.goodput(now=200.0) == 0.0 and book._former_met == []
