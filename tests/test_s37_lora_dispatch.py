"""Dispatch of LoRA adapters' jobs (DispatchManager, no processes): JFFC over the chains whose every server serves the
job's adapter, first come first served with the other jobs for a freed slot, a 503 refusal when the plan has no such
chain, and re-plans, failovers and cancellations that keep the bound and the counts."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, NoAdapterChain, QueueFull

SERVES = {"a": {"fr", "de"}, "b": {"fr"}, "c": set()}


def chain(server: str, T: float, cap: int) -> Chain:
    return Chain(servers=(server,), blocks=(4,), service_time=T, capacity=cap, spans=((0, 4),))


def manager(*chains: Chain, max_queue: int = 8) -> DispatchManager:
    dm = DispatchManager(policy="jffc", max_queue=max_queue)
    dm.serves_adapter = lambda ch, adapter: all(adapter in SERVES[s] for s in ch.servers)
    dm.set_chains(list(chains))
    return dm


def run(coro):
    return asyncio.run(coro)


def test_an_adapter_job_runs_only_on_chains_serving_it_fastest_first():
    async def main():
        dm = manager(chain("c", 0.5, 2), chain("b", 1.0, 1), chain("a", 2.0, 1))
        de = await dm.acquire(DispatchJob("de1", adapter="de"))
        assert de.chain.servers == ("a",)  # the only chain serving it, though two faster ones are free
        fr = await dm.acquire(DispatchJob("fr1", adapter="fr"))
        assert fr.chain.servers == ("b",)  # the fastest chain serving fr with a free slot
        base = await dm.acquire(DispatchJob("base1"))
        assert base.chain.servers == ("c",)
        # fr waits for a slot of a or b although c has one; the base job takes c's
        fr2 = asyncio.create_task(dm.acquire(DispatchJob("fr2", adapter="fr")))
        await asyncio.sleep(0)
        assert not fr2.done() and dm.queue_length == 1
        base2 = await dm.acquire(DispatchJob("base2"))
        assert base2.chain.servers == ("c",)
        dm.release(de)  # a frees: fr2 (waiting) takes it
        lease = await fr2
        assert lease.chain.servers == ("a",) and dm.queue_length == 0
        assert [dm.active(k) for k in range(3)] == [2, 1, 1]
        for x in (fr, base, base2, lease):
            dm.release(x)
        assert [dm.active(k) for k in range(3)] == [0, 0, 0]
    run(main())


def test_a_freed_slot_goes_to_whoever_came_first():
    async def main():
        dm = manager(chain("b", 1.0, 1))
        first = await dm.acquire(DispatchJob("base0"))
        base = asyncio.create_task(dm.acquire(DispatchJob("base1")))
        await asyncio.sleep(0.01)
        fr = asyncio.create_task(dm.acquire(DispatchJob("fr1", adapter="fr")))
        await asyncio.sleep(0)
        assert dm.queue_length == 2
        dm.release(first)
        second = await base  # it came first
        assert not fr.done()
        dm.release(second)
        third = await fr
        assert third.job.job_id == "fr1"
        dm.release(third)
    run(main())


def test_no_chain_serving_the_adapter_is_refused_and_the_bound_holds():
    async def main():
        dm = manager(chain("c", 0.5, 1), chain("b", 1.0, 1), max_queue=1)
        with pytest.raises(NoAdapterChain, match="serving this LoRA adapter"):
            await dm.acquire(DispatchJob("de1", adapter="de"))
        assert dm.queue_length == 0 and not dm._waiters
        held = await dm.acquire(DispatchJob("fr1", adapter="fr"))
        waiting = asyncio.create_task(dm.acquire(DispatchJob("fr2", adapter="fr")))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):  # the bound counts adapters' waiting jobs as any
            await dm.acquire(DispatchJob("fr3", adapter="fr"))
        waiting.cancel()  # its client went away: out of the queue
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert dm.queue_length == 0
        # a job back after a failover waits even past the bound, and takes the next slot of a chain serving it
        back = asyncio.create_task(dm.acquire(DispatchJob("fr1", adapter="fr", requeue=True)))
        await asyncio.sleep(0)
        assert not back.done() and dm.queue_length == 0 and len(dm.waiting_jobs()) == 1
        dm.release(held)
        lease = await back
        assert lease.chain.servers == ("b",)
        dm.release(lease)
    run(main())


def test_waiting_adapter_jobs_follow_a_replan():
    async def main():
        dm = manager(chain("b", 1.0, 1))
        held = await dm.acquire(DispatchJob("fr0", adapter="fr"))
        waiting = asyncio.create_task(dm.acquire(DispatchJob("x", adapter="fr")))
        await asyncio.sleep(0)
        dm.set_chains([chain("b", 1.0, 1), chain("a", 2.0, 1)])  # a chain serving fr joins: the job starts there
        lease = await waiting
        assert lease.chain.servers == ("a",)
        dm.release(lease)
        dm.release(held)
        # a job that came while no chain existed: refused once a plan comes without a chain serving its adapter
        dm.set_chains([])
        early = asyncio.create_task(dm.acquire(DispatchJob("de", adapter="de")))
        await asyncio.sleep(0)
        dm.set_chains([chain("b", 1.0, 1)])
        with pytest.raises(NoAdapterChain):
            await early
        assert dm.queue_length == 0 and not dm._waiters
    run(main())


def test_the_operators_adapter_arguments(tiny_model_dir, tmp_path):
    """--adapter per model, names that clash with the model's or each other's, one adapter under two names; the
    router of several models sends an adapter's name to its model."""
    import types

    from lora_helpers import write_adapter

    from petals_chain.orchestrator.adapters import load_adapters, split_adapter_args
    from petals_chain.orchestrator.models import ModelRouter
    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.lora import AdapterError

    assert split_adapter_args(["fr=/x"], ["chat"]) == {"chat": ["fr=/x"]}
    assert split_adapter_args(["code:fr=/x", "chat:de=/y"], ["chat", "code"]) == {"chat": ["de=/y"],
                                                                                 "code": ["fr=/x"]}
    with pytest.raises(AdapterError, match="MODEL:NAME=PATH"):
        split_adapter_args(["fr=/x"], ["chat", "code"])
    with pytest.raises(AdapterError, match="no model 'other'"):
        split_adapter_args(["other:fr=/x"], ["chat", "code"])
    config = load_config(tiny_model_dir)
    a, b = write_adapter(tmp_path / "a", tiny_model_dir, seed=1), write_adapter(tmp_path / "b", tiny_model_dir, seed=2)
    loaded = load_adapters([f"fr={a}", f"de={b}"], config, reserved=("tiny",))
    assert set(loaded) == {"fr", "de"} and loaded["fr"].name == "fr"
    for values, needle in (([f"tiny={a}"], "taken"), ([f"fr={a}", f"fr={b}"], "taken"),
                           ([f"fr={a}", f"de={a}"], "the same adapter as fr")):
        with pytest.raises(AdapterError, match=needle):
            load_adapters(values, config, reserved=("tiny",))

    def orch(name: str, adapters: dict) -> types.SimpleNamespace:
        return types.SimpleNamespace(model_id=name, prefix=f"p-{name}", cfg=types.SimpleNamespace(model=name),
                                     adapters=adapters)

    router = ModelRouter({"chat": None, "code": None}, {"chat": orch("chat", loaded), "code": orch("code", {})})
    assert router.aliases["fr"] == "chat" and router.aliases["de"] == "chat" and router.aliases["code"] == "code"
