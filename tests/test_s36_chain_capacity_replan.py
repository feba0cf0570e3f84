"""A re-plan that re-splits a chain (same servers, spans moved by a block) must not free its running jobs' places.

The real-model demo showed chain ``t4 -> laptop -> 3090`` (capacity 1) serving two questions at once: the plan
mid-burst composed that chain with its split one block over, a new chain key, so the job still running on the old
split was counted nowhere and JFFC started the queued job on the "empty" new chain of the same servers.
"""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager


def _chain(servers, spans, cap, service):
    return Chain(servers=tuple(servers), blocks=tuple(b - a for a, b in spans), service_time=service, capacity=cap,
                 spans=tuple(spans))


FAST = _chain(["a100", "3090"], [(0, 18), (18, 30)], 6, 1.94)
SLOW = _chain(["t4", "laptop", "3090"], [(0, 10), (10, 18), (18, 30)], 1, 2.97)
SLOW_RESPLIT = _chain(["t4", "laptop", "3090"], [(0, 10), (10, 17), (17, 30)], 1, 2.9)


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_resplit_chain_keeps_counting_its_running_job():
    async def run():
        m = DispatchManager()
        m.set_chains([FAST, SLOW])
        leases = [await m.acquire(DispatchJob(job_id=f"j{i}")) for i in range(7)]
        spider = next(lease for lease in leases if lease.index == 1)
        fruit = asyncio.ensure_future(m.acquire(DispatchJob(job_id="fruit")))
        await _settle()
        assert not fruit.done() and m.queue_length == 1
        m.set_chains([FAST, SLOW_RESPLIT])  # measured speeds move the slow chain's split by one block
        await _settle()
        # before the fix: fruit started on the re-split chain at once (8 running on 7 places, 2 on capacity 1)
        assert not fruit.done(), "a job started on a chain whose servers still run the re-planned job"
        assert m.running == 7 and m.active(1) == 1 and m.peak_active(1) <= 1
        assert spider.chain == SLOW  # it still runs on its own hops
        m.release(spider)
        await _settle()
        assert fruit.done() and fruit.result().index == 1 and fruit.result().chain == SLOW_RESPLIT
        assert m.active(1) == 1 and m.peak_active(1) == 1
        m.release(fruit.result())
        for lease in leases:
            m.release(lease)
        assert m.running == 0 and m.active(0) == 0 and m.active(1) == 0
    asyncio.run(run())


def test_jobs_over_a_lowered_capacity_take_the_next_freed_slots():
    """A re-plan that lowers a re-split chain's capacity below its running jobs: the ones without a place take the
    next slots that free there, before a waiting job does."""
    wide = _chain(["t4", "laptop", "3090"], [(0, 10), (10, 18), (18, 30)], 2, 2.97)
    narrow = _chain(["t4", "laptop", "3090"], [(0, 10), (10, 17), (17, 30)], 1, 2.9)

    async def run():
        m = DispatchManager()
        m.set_chains([wide])
        a = await m.acquire(DispatchJob(job_id="a"))
        b = await m.acquire(DispatchJob(job_id="b"))
        m.set_chains([narrow])
        waiting = asyncio.ensure_future(m.acquire(DispatchJob(job_id="new")))
        await _settle()
        # before the fix: the new job started at once next to the two still running (3 jobs, capacity 1)
        assert not waiting.done() and m.active(0) == 1
        m.release(a)  # whichever of a, b was counted: the slot goes to the other one, not to the waiting job
        await _settle()
        assert not waiting.done() and m.active(0) == 1
        m.release(b)
        await _settle()
        assert waiting.done() and m.active(0) == 1 and m.peak_active(0) == 1
        m.release(waiting.result())
        assert m.running == 0 and m.active(0) == 0
    asyncio.run(run())


def test_a_chain_sharing_no_server_is_not_charged():
    """A dropped chain's job counts only against chains that share blocks of its servers."""
    other = _chain(["x", "y"], [(0, 15), (15, 30)], 1, 1.0)

    async def run():
        m = DispatchManager()
        m.set_chains([SLOW])
        old = await m.acquire(DispatchJob(job_id="old"))
        m.set_chains([other, SLOW_RESPLIT])
        assert m.active(0) == 0 and m.active(1) == 1
        new = await asyncio.wait_for(m.acquire(DispatchJob(job_id="new")), 1.0)
        assert new.index == 0
        m.release(old)
        m.release(new)
        assert m.running == 0
    asyncio.run(run())


class _Swarm:
    """What the real-model demo uses of a LocalSwarm: one chain whose most jobs at once the orchestrator gives."""

    def __init__(self, peak: int):
        self.url, self.initial_peers, self.stopped = "http://127.0.0.1:1", ["/ip4/127.0.0.1/tcp/1/p2p/Qm"], False
        self.chains = [{"id": 1, "capacity": 1, "max_active": peak, "service_time": 2.9, "names": ["t4", "3090"],
                        "spans": [[0, 10], [10, 30]]}]

    def start(self):
        return self

    def wait_ready(self, timeout=0):
        return self.swarm()

    def swarm(self):
        return {"epoch": 1, "c": 1, "arrival_rate": 0.5, "rho_bar": 0.7, "predicted_response_s": None,
                "servers": [], "chains": self.chains, "measured": {"mean_wait_s": 0.0, "mean_service_s": 0.1}}

    def client(self):
        from contextlib import nullcontext

        answer = SimpleNamespace(wait_s=0.0, service_s=0.1, token_ids=[1], chain=["t4", "3090"], text="Paris",
                                 tokens_per_s=10.0, failovers=0)
        session = SimpleNamespace(chat=lambda *a, **k: answer)
        return SimpleNamespace(chat_completion=lambda *a, **k: answer, session=lambda: nullcontext(session))

    def stop(self, server_timeout: float = 5.0) -> None:
        self.stopped = True

    def leftover_processes(self, wait_s: float = 5.0) -> list[int]:
        return []


@pytest.mark.parametrize("peak, code", [(1, 0), (2, 1)])
def test_real_demo_says_each_chains_most_jobs_at_once(monkeypatch, tmp_path, capsys, peak, code):
    """The real-model demo printed the burst's timeline and nothing of the chains' counts: a chain of capacity 1
    that seemed to serve two questions at once went unchecked. It now reads each chain's most jobs at once from the
    orchestrator, as ``--tiny`` does, and a chain over its capacity fails the demo."""
    from petals_chain import demo
    from petals_chain.swarm import checkpoint, local

    swarms: list[_Swarm] = []
    monkeypatch.setattr(local, "LocalSwarm", lambda *a, **k: swarms.append(_Swarm(peak)) or swarms[-1])
    monkeypatch.setattr(local, "model_memory", lambda model, max_length, dtype=None: (30, 1000, 100))
    monkeypatch.setattr(checkpoint, "load_config", lambda model: SimpleNamespace(max_position_embeddings=2048))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        assert demo.main(["--model", "not-in-the-registry", "--work-dir", str(tmp_path)]) == code
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    out = capsys.readouterr().out
    assert f"most at once/capacity: #1 {peak}/1" in out, out
    assert ("ERROR: a chain ran more jobs at once" in out) == (peak > 1)
    assert swarms[-1].stopped


def test_a_carried_jobs_steps_teach_nothing_of_the_chain_it_counts_against():
    """Its steps run on its own (dropped) hops: the deadline predictions of the new chain learn only its own jobs."""
    async def run():
        m = DispatchManager()
        m.set_chains([SLOW])
        old = await m.acquire(DispatchJob(job_id="old"))
        m.set_chains([SLOW_RESPLIT])
        assert getattr(old, "carried", True) and old.index == 0
        for _ in range(5):
            m.charge(old, 9.0)
        planned = SLOW_RESPLIT.service_time / m._steps_per_job()
        assert m.step_times.step_s(m.chain_ids[0], 1, planned) == planned
        m.release(old)
        assert m.running == 0 and m.active(0) == 0
    asyncio.run(run())
