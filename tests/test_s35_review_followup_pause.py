"""Review of 6f4286e (a moved hop updates whether its chain keeps prefixes): a job marked to pause for priority
(``--schedule db|mlfq``) while its step moved a hop onto a server without a prefix cache no longer pauses: its
pause would recompute its whole history, which is why such a chain is never chosen to pause. Before, the mark
stood: the job gave its chain back at its next step and recomputed every token. In-process: the real ChainHolder,
ChainSession and dispatcher over a fake server client."""

from __future__ import annotations

import asyncio

import torch
from test_s34_lean_refusal_bounds import PROMPT, make_orch, run

from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager
from petals_chain.orchestrator.failover import ChainHolder

AB = Chain(servers=("a", "b"), blocks=(2, 2), service_time=0.5, capacity=1, spans=((0, 2), (2, 4)))


class Servers:
    """``a`` and ``b`` keep prefixes, ``e`` none. ``b``'s first session stalls at its second step until ``gate`` is
    set, then dies (its span moves to ``e``)."""

    def __init__(self, gate: asyncio.Event):
        self.gate, self.opens, self.b_sessions = gate, [], 0

    async def open_session(self, peer, **kw):
        gate, has = self.gate, peer != "e"
        self.opens.append(peer)
        dies = peer == "b" and self.b_sessions == 0
        self.b_sessions += peer == "b"

        class Session:
            cached_tokens = 0
            prefix_cache = has
            steps = 0

            async def step(self, x, position, **_):
                if dies and self.steps == 1:
                    await gate.wait()
                    raise ConnectionError("b died")
                self.steps += 1
                return torch.zeros_like(x)

            async def close(self, **_):
                pass

        return Session()


def test_a_pause_for_priority_marked_before_a_hop_moved_onto_a_no_cache_server_is_taken_back():
    async def body():
        gate = asyncio.Event()
        servers = Servers(gate)
        orch = make_orch(servers)
        orch.dispatch = dm = DispatchManager(schedule="db", classes=1)
        dm.set_chains([AB])
        orch.replacement_servers = lambda start, end: ["e"]
        job = ChainHolder(orch, "A", 128)
        await job.feed(PROMPT)
        for _ in range(3):
            dm.charge(job.lease, 1.0)  # its budget spent: a new job goes before it
        stepping = asyncio.ensure_future(job.feed([7]))  # b stalls
        await asyncio.sleep(0.05)
        new = asyncio.ensure_future(dm.acquire(DispatchJob("N", sched=dm.new_priority_job("N", "m"))))
        for _ in range(100):
            if job.lease.preempt:
                break
            await asyncio.sleep(0.01)
        assert job.lease.preempt and dm.priority_preemptions == 1  # marked while every hop kept prefixes
        gate.set()
        await stepping  # b died: its span moved to e, which keeps none
        assert job.chain_names == ["a", "e"] and not job.lease.keeps_kv
        assert not job.lease.preempt and dm.priority_preemptions == 0
        opens = len(servers.opens)
        await job.feed([8])  # runs on: nothing given back, nothing recomputed
        assert len(servers.opens) == opens and orch.stats.pauses == 0 and job.reused_tokens == len(PROMPT) + 1
        assert not new.done()
        await job.close()
        lease = await asyncio.wait_for(new, 5)  # the slot goes to the new job once the job is done
        dm.release(lease)

    run(body)
