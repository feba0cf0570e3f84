"""Failover and untrusted-server rules without processes: the planner's ban backoff, one leave per graceful stop,
tau_p by what a server delivers, and the replay cache's byte budget."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from petals_chain.model import ModelSpec
from petals_chain.swarm.records import ServerRecord

MODEL = ModelSpec(num_blocks=4, block_size=10.0, cache_size=1.0)


def record(name: str, state: str = "online", tau_p: float = 0.01, **kw) -> ServerRecord:
    return ServerRecord(peer_id=name, state=state, memory_bytes=60, tau_p=tau_p, public_name=name, max_length=64,
                        **{"timestamp": time.time(), **kw})


class FakeDHT:
    peer_id = "orch"

    def __init__(self, records: dict):
        self.records = records

    async def afetch_servers(self, prefix):
        return dict(self.records)

    def publish_assignment(self, prefix, rec, expiration):
        pass


class FakeClient:
    def __init__(self):
        self.dead: set[str] = set()

    async def ping(self, peer_id):
        if peer_id in self.dead:
            raise ConnectionError("unreachable")
        return 0.001


def planner(records: dict, **attrs):
    from petals_chain.orchestrator.planner import Planner

    pl = Planner(dht=FakeDHT(records), prefix="x", client=FakeClient(), max_length=64, on_chains=lambda c: None,
                 arrival_rate=1.0, model_spec_fallback=lambda: MODEL, settle_s=0.0)
    for k, v in attrs.items():  # clock and ban knobs (constructor arguments too)
        setattr(pl, k, v)
    return pl


def test_failed_server_banned_with_exponential_backoff():
    now = [1000.0]
    records = {n: record(n) for n in "abc"}
    pl = planner(records, clock=lambda: now[0], ban_base_s=5.0, ban_max_s=20.0, ban_reset_s=60.0)
    refresh = lambda: asyncio.run(pl.refresh())  # noqa: E731
    refresh()
    a = pl.servers["a"]
    assert a.usable and pl.plan is not None

    def fail_and_time_ban() -> float:
        pl.report_failure("a")
        assert not a.usable
        start = now[0]
        records["a"] = record("a", timestamp=time.time() + 2)  # a newer record: it used to lift the ban at once
        while not a.usable:
            now[0] += 0.5
            refresh()
            assert now[0] - start < 100
        return now[0] - start

    bans = [fail_and_time_ban() for _ in range(4)]
    assert bans == [5.0, 10.0, 20.0, 20.0], bans  # doubling, capped at ban_max_s
    assert a.strikes == 4
    pl.report_failure("a")
    entry = next(s for s in pl.server_json() if s["peer_id"] == "a")
    assert entry["banned"] and entry["strikes"] == 5 and entry["banned_for_s"] == 20.0 and entry["state"] == "failed"
    now[0] += 20.0
    refresh()
    now[0] += 60.0  # served well for ban_reset_s: the next ban starts small again
    assert fail_and_time_ban() == 5.0 and a.strikes == 1
    # A ban is not lifted while the server does not answer pings (it is dead, not just unlucky).
    pl.client.dead.add("a")
    pl.report_failure("a")
    now[0] += 30.0
    refresh()
    refresh()
    assert not a.usable
    pl.client.dead.clear()
    refresh()
    assert a.usable


def test_graceful_stop_is_one_leave(caplog):
    records = {n: record(n) for n in "abc"}
    pl = planner(records)
    asyncio.run(pl.refresh())
    changed = pl.last_change
    records["b"] = record("b", state="offline")  # announced at shutdown; lingers in the DHT until it expires
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.planner"):
        for _ in range(5):
            asyncio.run(pl.refresh())
        del records["b"]  # expired
        asyncio.run(pl.refresh())
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("server left: b ") for m in lines) == 1, lines
    assert not any(m.startswith("server joined: b ") for m in lines), lines
    assert pl.last_change == changed  # a leave does not restart the settle time: re-planned at once
    assert "b" not in pl.servers and "b" not in pl.assignment


def test_tau_p_planned_by_what_a_server_delivers_and_flagged():
    from petals_chain.orchestrator.planner import TAU_P_MIN_OBS, TAU_P_SUSPECT_RATIO, ServerView

    pl = planner({})
    steps = pl.steps_per_job
    liar = pl.servers["liar"] = ServerView(peer_id="liar", record=record("liar", tau_p=0.001))
    honest = pl.servers["honest"] = ServerView(peer_id="honest", record=record("honest", tau_p=0.001))
    for i in range(TAU_P_MIN_OBS):
        assert pl.tau_p(liar) == 0.001 and not pl.tau_p_suspect(liar)  # too few observations: as advertised
        # per decode step and block: the liar computes 3x what it claims, the honest one 1.5x (noise, load)
        pl.observe_hop("liar", 1, 2, seconds=0.05, compute_s=2 * 3 * 0.001 / steps)
        pl.observe_hop("honest", 1, 2, seconds=0.05, compute_s=2 * 1.5 * 0.001 / steps)
    assert pl.measured_tau_p(liar) == pytest.approx(0.003)
    assert pl.tau_p(liar) == pytest.approx(0.003) and pl.tau_p_suspect(liar)  # planned by what it delivers
    assert pl.tau_p(honest) == pytest.approx(0.0015) and not pl.tau_p_suspect(honest)  # within the ratio
    assert 1.5 < TAU_P_SUSPECT_RATIO < 3
    assert pl.specs([liar])[0].tau_p == pytest.approx(0.003)
    entry = {s["peer_id"]: s for s in pl.server_json()}
    assert entry["liar"]["tau_p_suspect"] is True and entry["liar"]["tau_p_measured"] == pytest.approx(0.003)
    assert entry["liar"]["tau_p_advertised"] == 0.001
    assert entry["honest"]["tau_p_suspect"] is False
    assert pl._speed_changed == ["liar"]  # the next refresh re-plans with the measured value


def test_replay_cache_budget_evicts_oldest_jobs():
    from petals_chain.orchestrator.replay import ReplayCache

    row = 16 * 4  # bytes of one position (hidden 16, float32)
    cache = ReplayCache(budget_bytes=25 * row)
    old, mid, new = cache.new(), cache.new(), cache.new()
    for store in (old, mid):
        store.append(4, torch.randn(1, 10, 16), 0)
    assert cache.bytes == 20 * row and cache.jobs == 2
    new.append(4, torch.randn(1, 8, 16), 0)  # over budget: the oldest job's inputs go
    assert old.get(4, 10) is None and mid.get(4, 10) is not None and cache.bytes == 18 * row
    assert cache.evictions == 1
    old.append(4, torch.randn(1, 1, 16), 10)  # positions 0..9 are gone: a later step cannot be kept
    assert old.length(4) == 0 and cache.bytes == 18 * row
    x = torch.randn(1, 3, 16)
    mid.append(4, x, 10)
    assert torch.equal(mid.get(4, 13)[0, 10:], x[0]) and mid.length(4) == 13
    mid.truncate(11)  # a rolled-back turn
    assert mid.length(4) == 11 and cache.bytes == 19 * row
    sliced = torch.randn(1, 40, 16)[:, 39:]  # a view pinning 40 rows: stored as a copy of its one row
    new.append(4, sliced, 8)
    assert new.get(4, 9)[0, 8].untyped_storage().nbytes() <= 9 * row
    for store in (old, mid, new):
        store.close()
    assert cache.bytes == 0 and cache.jobs == 0


def test_banned_server_keeps_its_blocks_and_rejoins_with_them():
    """A ban (e.g. one invalid reply) must not unassign the server: it would unload and reload its span (minutes on
    a real model). It stays assigned, out of the chains while banned, and is back in them once the ban is over;
    only a server whose record is gone loses its span. (Failed on the previous main: the span went at once.)"""
    now = [1000.0]
    records = {n: record(n, slots_total=4, slots_free=4) for n in "abc"}
    pl = planner(records, clock=lambda: now[0], ban_base_s=5.0, use_all_servers=True)  # as --spare-servers use
    refresh = lambda: asyncio.run(pl.refresh())  # noqa: E731
    refresh()
    assert pl.plan is not None and set(pl.assignment) == set("abc"), pl.assignment
    for n, (start, count) in pl.assignment.items():  # the servers load their spans
        records[n] = record(n, start_block=start, num_blocks=count, slots_total=4, slots_free=4, epoch=pl.epoch)
    refresh()
    in_chains = lambda name: any(name in ch.servers for ch in pl.current.chains)  # noqa: E731
    assert in_chains("a")
    span, epoch, placements = pl.assignment["a"], pl.epoch, sum(e["kind"] == "placement" for e in pl.plan_log)

    pl.report_failure("a", "invalid reply")
    assert not in_chains("a")
    while not pl.servers["a"].usable:
        now[0] += 1.0
        refresh()
        assert pl.assignment.get("a") == span, "a banned server lost its span: it would unload and reload"
        assert now[0] < 1100
    assert pl.epoch == epoch and sum(e["kind"] == "placement" for e in pl.plan_log) == placements
    assert in_chains("a")  # back with the blocks it kept

    pl.report_failure("a", "dead")
    del records["a"]  # its record expired: it is gone, and so is its span
    refresh()
    assert "a" not in pl.assignment


def test_a_server_banned_for_good_stays_out_even_after_its_record_expires():
    """Audits ban a liar for good: out of the chains, its span planned around, and a record that expires and comes
    back (a restart under the same identity) does not make it usable again."""
    now = [1000.0]
    records = {n: record(n, slots_total=4, slots_free=4) for n in "abc"}
    pl = planner(records, clock=lambda: now[0], ban_base_s=5.0, ban_max_s=10.0, use_all_servers=True)
    refresh = lambda: asyncio.run(pl.refresh())  # noqa: E731
    refresh()
    for n, (start, count) in pl.assignment.items():
        records[n] = record(n, start_block=start, num_blocks=count, slots_total=4, slots_free=4, epoch=pl.epoch)
    refresh()
    pl.report_failure("a", "audits found wrong hidden states", permanent=True)
    in_chains = lambda name: any(name in ch.servers for ch in pl.current.chains)  # noqa: E731
    assert not in_chains("a") and pl.servers["a"].distrusted
    for _ in range(30):  # far beyond ban_max_s
        now[0] += 1.0
        refresh()
    assert not in_chains("a") and not pl.servers["a"].usable
    assert "a" not in pl.held_spans()
    del records["a"]
    refresh()
    records["a"] = record("a", slots_total=4, slots_free=4)  # back under the same peer id
    refresh()
    now[0] += 100.0
    refresh()
    assert pl.servers["a"].distrusted and not in_chains("a")
    entry = {s["peer_id"]: s for s in pl.server_json()}["a"]
    assert entry["distrusted"] and entry["banned_for_s"] is None


def test_a_job_cancelled_while_its_chain_closes_gives_the_slot_back_after_the_close():
    """The chain's close (a round trip per hop, up to its timeout on a silent server) runs to its end when the job
    is cancelled meanwhile (its client left), and the slot goes back then. (The release came after an await that
    the cancellation skipped: the slot was lost for good, through re-plans too.)"""
    import types

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchJob, DispatchManager
    from petals_chain.orchestrator.failover import ChainHolder

    closing = asyncio.Event()

    class SlowChainSession:
        prefix_cache, peers_used = True, ()

        async def close(self, named=b""):
            await closing.wait()

    async def main():
        dm = DispatchManager(policy="jffc")
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        cfg = types.SimpleNamespace(output_reserve_tokens=0, hold_sessions=False)
        orch = types.SimpleNamespace(dispatch=dm, cfg=cfg,
                                     model_id="m", prefix_directory=ChainPrefixes(), chain_sessions=set(), auditor=None,
                                     stats=types.SimpleNamespace(add_pause=lambda: None),
                                     replay_cache=types.SimpleNamespace(new=lambda: types.SimpleNamespace(
                                         clear=lambda: None, close=lambda: None)))
        holder = ChainHolder(orch, "job1", 64)
        holder.lease = await dm.acquire(DispatchJob("job1"))
        holder.cs = SlowChainSession()
        pausing = asyncio.ensure_future(holder._pause())
        await asyncio.sleep(0.05)
        pausing.cancel()
        await asyncio.gather(pausing, return_exceptions=True)
        nxt = asyncio.ensure_future(dm.acquire(DispatchJob("next")))
        await asyncio.sleep(0.05)
        assert not nxt.done() and dm.running == 1  # the servers still hold the session: the slot is not free yet
        closing.set()
        lease = await asyncio.wait_for(nxt, 2.0)
        dm.release(lease)
        assert dm.running == 0 and dm.queue_length == 0

    asyncio.run(main())


def test_a_server_that_leaves_and_comes_back_is_planned_at_once_each_time():
    """A server considered once and gone is fresh when it comes back with the same peer id (it waited for the
    periodic re-plan, from its second return on: the ids of servers considered were kept for ever)."""
    records = {n: record(n) for n in "abc"}
    pl = planner(records, use_all_servers=True)
    asyncio.run(pl.refresh())
    assert sorted(pl.assignment) == ["a", "b", "c"]
    for _ in range(2):
        del records["c"]
        asyncio.run(pl.refresh())
        assert "c" not in pl.assignment and "c" not in pl._considered
        records["c"] = record("c")
        asyncio.run(pl.refresh())
        assert "c" in pl.assignment


def test_a_new_servers_reachability_check_goes_before_re_checks_of_unreachable_ones():
    """Re-checks of unreachable servers (anyone can announce addresses that never answer) run one at a time and
    only while no first check waits: a joining server was left "pending", unplanned, behind them."""
    class Prober:
        def __init__(self):
            self.calls: list[str] = []

        async def dial(self, peer_id, maddrs):
            self.calls.append(peer_id)
            await asyncio.sleep(0.01)
            ok = not peer_id.startswith("bad")
            return ok, maddrs[0] if ok else "", "" if ok else "refused"

    def announcing(name: str) -> ServerRecord:
        return record(name, maddrs=[f"/ip4/10.0.0.1/tcp/{4000 + len(name)}"])

    async def main():
        records = {n: announcing(n) for n in ("a", "bad1", "bad2")}
        pl = planner(records, prober=Prober(), reach_recheck_s=0.0)
        await pl.refresh()
        await asyncio.sleep(0.1)
        assert sorted(pl.prober.calls) == ["a", "bad1", "bad2"] and pl.servers["bad1"].reachability == "unreachable"
        pl.prober.calls.clear()
        await pl.refresh()  # both bad ones are due again: one re-check at a time
        await pl.refresh()
        assert len(pl.prober.calls) == 1 and pl.prober.calls[0].startswith("bad")
        await asyncio.sleep(0.1)
        pl.prober.calls.clear()
        records["new"] = announcing("new")
        await pl.refresh()  # a first check waits: no re-check now
        assert pl.prober.calls == ["new"]
        await asyncio.sleep(0.1)
        assert pl.servers["new"].reachability == "direct"

    asyncio.run(main())


def test_a_feed_of_all_positions_names_the_tokens_held_before_it_for_the_prefix_cache():
    """A speculative verify (``all_positions``) that must take a chain again (paused, preempted, failed over) may
    resume on the servers' prefix caches for the tokens held before its new ones, and never inside them. (It named
    nothing: every paused speculative job recomputed its whole history.)"""
    import types

    from petals_chain.orchestrator.dispatch import DispatchManager
    from petals_chain.orchestrator.failover import ChainHolder

    seen = []

    class Stop(Exception):
        pass

    async def ensure_chain(prompt=None, need=0):
        seen.append((prompt, need))
        raise Stop

    orch = types.SimpleNamespace(dispatch=DispatchManager(policy="jffc"),
                                 cfg=types.SimpleNamespace(output_reserve_tokens=0, max_failovers=3),
                                 replay_cache=types.SimpleNamespace(new=lambda: None))
    for held, new, all_positions, named in [(list(range(40)), [7, 8, 9], True, list(range(40)) + [7]),
                                            (list(range(40)), [7, 8, 9], False, list(range(40)) + [7, 8, 9]),
                                            ([], [1, 2, 3], True, [1])]:  # prompt logprobs: no cached prefix
        holder = ChainHolder(orch, "job", 64)
        holder.kv_ids = list(held)
        holder._ensure_chain = ensure_chain
        with pytest.raises(Stop):
            asyncio.run(holder.feed(new, all_positions=all_positions))
        assert seen.pop() == (named, len(held) + len(new))


def test_a_sessions_next_turn_is_a_new_request_and_only_completed_jobs_teach_the_service_time():
    """A session that gave its chain back between turns kept ``admitted``: every later turn took the re-queue
    lane (before the whole queue, never refused, never dropped at its deadline). One that holds its chain is idle
    (flex and db do not pause it) until its next turn, which carries that turn's own deadline. And ``--schedule
    db``: a refused or failed job taught its service an execution time of 0 s (``L̂_s`` fell to nothing)."""
    import types

    from petals_chain.model import Chain
    from petals_chain.orchestrator.deadlines import DEADLINE, RequestDeadline
    from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchJob, DispatchManager
    from petals_chain.orchestrator.failover import ChainHolder

    class HeldSession:
        peers_used = ()

        def __init__(self, prefix_cache):
            self.prefix_cache = prefix_cache

        async def close(self, named=b""):
            pass

    async def main(hold):
        dm = DispatchManager(schedule="db", classes=1)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        cfg = types.SimpleNamespace(output_reserve_tokens=0, hold_sessions=hold, queue_timeout_s=60.0)
        orch = types.SimpleNamespace(dispatch=dm, cfg=cfg, model_id="m", prefix_directory=ChainPrefixes(),
                                     chain_sessions=set(), auditor=None,
                                     replay_cache=types.SimpleNamespace(new=lambda: types.SimpleNamespace(
                                         clear=lambda: None, close=lambda: None)))
        holder = ChainHolder(orch, "s-1", 64)
        holder.priority = dm.new_priority_job("s-1", "m")
        holder.lease = await dm.acquire(DispatchJob("s-1", sched=holder.priority))
        holder.cs, holder.admitted = HeldSession(prefix_cache=True), True
        released = await holder.release_chain()
        if not hold:
            assert released and not holder.admitted and dm.running == 0
        else:
            assert not released and holder.admitted and holder.lease.job.idle
            dl = RequestDeadline.from_ms("x", 60_000, None)
            token = DEADLINE.set(dl)
            try:
                await holder._ensure_chain(need=8)  # the next turn, on the chain it holds
            finally:
                DEADLINE.reset(token)
            assert not holder.lease.job.idle and holder.lease.job.deadline is dl and not holder.lease.job.preemptible
        stats = dm.priorities.monitor["m"]
        before = stats.count
        await holder.close()  # the turn never completed: not an execution time
        assert stats.count == before
        done = ChainHolder(orch, "r-1", 64)
        done.priority, done.completed = dm.new_priority_job("r-1", "m"), True
        done.priority.used = 2.0
        await done.close()
        assert stats.count == before + 1

    asyncio.run(main(hold=False))
    asyncio.run(main(hold=True))


def test_a_sessions_next_turn_starts_a_fresh_priority_record():
    """db/mlfq: a session's record spanned its turns, so a short later turn kept the low level its earlier turns had
    reached, and its execution time was observed once, at close, for the whole session."""
    import types

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchJob, DispatchManager
    from petals_chain.orchestrator.failover import ChainHolder

    async def main():
        dm = DispatchManager(schedule="mlfq")
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        orch = types.SimpleNamespace(dispatch=dm, model_id="m", prefix_directory=ChainPrefixes(), chain_sessions=set(),
                                     cfg=types.SimpleNamespace(output_reserve_tokens=0, hold_sessions=True),
                                     auditor=None, replay_cache=types.SimpleNamespace(new=lambda: None))
        holder = ChainHolder(orch, "s-1", 64)
        holder.lease = await dm.acquire(DispatchJob("s-1", sched=holder.priority))
        for _ in range(40):
            dm.charge(holder.lease, 0.1)  # a long first turn: several levels down
        first = holder.priority
        assert first.level > 2
        holder.completed = True
        count = dm.priorities.monitor["m"].count
        holder.next_turn()
        assert dm.priorities.monitor["m"].count == count + 1  # the first turn's time, observed once
        assert holder.priority is not first and holder.priority.level == 0 and holder.lease.job.sched is holder.priority
        assert not holder.completed
        dm.release(holder.lease)

    asyncio.run(main())
