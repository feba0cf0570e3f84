"""Routed dispatch (PETALS / BPRR baselines in the orchestrator): routes over exact live free-slot counts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from petals_chain.model import ModelSpec, ServerSpec
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager
from petals_chain.orchestrator.routed import RoutedDispatch, make_dispatch


class FakePlanner:
    """Two whole-model servers: 'a' (fast) and 'b' (slow), each with room for 2 jobs (2 x 4 slots)."""

    def __init__(self):
        self.model_spec = ModelSpec(num_blocks=4, block_size=1.0, cache_size=0.1)
        self.assignment = {"a": (0, 4), "b": (0, 4)}
        self.steps_per_job = 10.0
        self.views = [SimpleNamespace(peer_id=n, rtt_s=0.01, record=SimpleNamespace(slots_total=8, memory_bytes=10))
                      for n in ("a", "b")]
        self.tp = {"a": 0.1, "b": 0.15}  # b: cheaper than waiting behind a full a (WS-RR)

    def online_views(self):
        return list(self.views)

    def tau_c(self, v):
        return 0.1

    def tau_p(self, v):
        return self.tp[v.peer_id]

    def specs(self, views):
        return [ServerSpec(name=v.peer_id, memory=10.0, tau_c=self.tau_c(v), tau_p=self.tau_p(v)) for v in views]


@pytest.mark.parametrize("policy", ["petals", "bprr"])
def test_routes_follow_free_slots_and_release(policy):
    async def main():
        d = make_dispatch(policy, wait_s=5.0)
        assert isinstance(d, RoutedDispatch)
        d.attach(FakePlanner())
        leases = []
        for i in range(4):
            leases.append(await d.acquire(DispatchJob(job_id=str(i))))
        names = [ls.hops[0][0] for ls in leases]
        # the fast server first; once it lacks slots, the slow one; the fifth job fits nowhere and goes to the
        # cheapest server counting the penalty/expected wait (it waits there, no central queue)
        assert names[:2] == ["a", "a"] and names[2:] == ["b", "b"]
        assert all(ls.hops == [(n, 0, 4)] for ls, n in zip(leases, names))
        assert d.free_slots() == {"a": 0, "b": 0} and d.running == 4 and d.queue_length == 0
        leases[3].job.idle = True  # a session's lease held between turns: not work in flight (model placement)
        assert d.stepping == 3
        leases[3].job.idle = False
        assert all(ls.wait_s == 5.0 for ls in leases)
        extra = await d.acquire(DispatchJob(job_id="x"))
        assert extra.hops[0][0] in ("a", "b")
        d.release(leases[0])
        d.release(leases[0])  # idempotent
        d.release(extra)
        assert d.free_slots()["a"] == 4
        nxt = await d.acquire(DispatchJob(job_id="y"))
        assert nxt.hops == [("a", 0, 4)]

    asyncio.run(main())


def test_no_route_until_planned_and_other_policies_unchanged():
    async def main():
        d = RoutedDispatch("petals")
        d.attach(SimpleNamespace(model_spec=None))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(d.acquire(DispatchJob(job_id="j")), 0.5)
        assert d.running == 0

    asyncio.run(main())
    assert isinstance(make_dispatch("jffc"), DispatchManager)
    with pytest.raises(ValueError):
        RoutedDispatch("jffc")
