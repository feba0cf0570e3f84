"""A job whose every chain open failed never ran: when its deadline passes while it waits for another chain it is
``dropped`` (deadlines.py: ``missed`` is for a job that had run), and fair sharing does not count it as one more
job that gave up waiting (it was counted as started; it is not abandoned). It counted as ``missed`` and in
``gave_up``. In-process: the real ChainHolder, ChainSession and dispatcher over a fake server client."""

from __future__ import annotations

import asyncio
import time
import types

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import DEADLINE, DeadlineBook, RequestDeadline
from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchManager
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.fairness import ClientShares
from petals_chain.orchestrator.replay import ReplayCache
from petals_chain.orchestrator.stats import Stats

CHAIN = Chain(servers=("a",), blocks=(2,), service_time=0.1, capacity=1, spans=((0, 2),))


class DeadServer:
    """Hop ``a`` accepts no session: every open fails as a dead server's does."""

    async def open_session(self, peer, **kw):
        raise ConnectionError("server a is gone")


def make_orch(shares: ClientShares):
    dm = DispatchManager(policy="jffc", shares=shares)
    dm.set_chains([CHAIN])
    orch = types.SimpleNamespace(
        dispatch=dm, stats=Stats(), prefix_directory=ChainPrefixes(), chain_sessions=set(), shares=shares,
        planner=None, replay_cache=ReplayCache(1 << 20), client=DeadServer(), observe_hop=None, model_id="m",
        auditor=None, deadlines=DeadlineBook(),
        cfg=types.SimpleNamespace(queue_timeout_s=30.0, output_reserve_tokens=0, max_failovers=3,
                                  relay="orchestrator", open_wait_max_s=1.0, hold_sessions=False, no_chain_wait_s=5.0))
    orch.server_failed = lambda e: dm.set_chains([])  # the only chain leaves the plan with its server
    return orch


def test_a_job_whose_open_failed_and_that_is_dropped_at_its_deadline_is_dropped_not_missed():
    async def main():
        shares = ClientShares(FairPolicy("fcfs"), registry=CollectorRegistry(), keyed=True)
        orch = make_orch(shares)
        dl = RequestDeadline.from_ms("c", 400, None)
        DEADLINE.set(dl)
        holder = ChainHolder(orch, "j", 64)
        holder.client = "c"
        with pytest.raises(RequestError) as err:
            await holder._ensure_chain([1, 2, 3], 3)
        assert (err.value.status, err.value.code) == (504, "deadline_exceeded")
        assert time.monotonic() >= dl.deadline
        counts = orch.deadlines.json()["clients"]["c"]
        row = shares.json()["clients"]["c"]
        # was: ("missed", 1 gave up): one job counted as started and as given up
        assert (dl.outcome, row["started"], row["gave_up"]) == ("dropped", 1, 0), (counts, row)
        assert counts["dropped"] == 1 and counts["missed"] == 0, counts
        assert holder.admitted and not holder.ran  # it held a lease, and never an open chain
        assert orch.dispatch.running == 0 and orch.dispatch.requeued == 0

    asyncio.run(asyncio.wait_for(main(), 20))
