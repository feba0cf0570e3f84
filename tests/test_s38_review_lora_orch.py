"""Review of 144d63b (LoRA adapters, orchestrator side). Units on DispatchManager (no processes) and the API over fake
chains in this process: a request of an adapter with n > 1 is admitted on the slots of the chains serving the adapter
only (all chains were counted, and its later choices then queued past --max-queue); flex and mlfq pause a job only
where the adapter's job can take the slot (they paused one on a chain without the adapter, for nothing); its
deadline is judged on those chains; /v1/embeddings with an adapter's id runs on its chains and names it as the
response's model; the 503 of an adapter no chain serves has the documented code; an adapter's waiting jobs take a
freed slot in the queue's order (deadlines with edf, the oldest job of a fair queue), keep to the share rule and
take a slot their request holds after a failover; two models' adapters (or a model and an adapter) under one name
are refused at start, and the router's 404 names the adapters."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import (DeadlineUnreachable, DispatchJob, DispatchManager,
                                                NoAdapterChain, QueueNeverFits, RequestPlaces)
from test_queue_bound_siblings import _submit as submit  # acquire in a task of its own, with a ticket as its place

SERVES = {"a": {"fr"}, "b": set(), "c": {"de"}}


def chain(server: str, T: float, cap: int) -> Chain:
    return Chain(servers=(server,), blocks=(4,), service_time=T, capacity=cap, spans=((0, 4),))


def manager(chains: list[Chain], **kw) -> DispatchManager:
    dm = DispatchManager(**kw)
    dm.serves_adapter = lambda ch, adapter: all(adapter in SERVES[s] for s in ch.servers)
    dm.set_chains(chains)
    return dm


def test_n_choices_of_an_adapter_count_only_the_slots_of_its_chains():
    """One chain serves fr (1 slot), another 3 free slots without it, --max-queue 1: n=4 of fr never fits (1 slot +
    1 place). It was admitted on the 4 free slots of every chain, and its 3 later choices queued for the fr chain:
    3 waiting of a bound of 1. n=2 fits (a slot and a place) and is held within the bound."""
    async def main():
        dm = manager([chain("a", 1.0, 1), chain("b", 0.5, 3)], max_queue=1)
        tickets = RequestPlaces().expect(4)
        first = await submit(dm, DispatchJob("r0", siblings=3, adapter="fr"), tickets[0])
        assert first.done() and isinstance(first.exception(), QueueNeverFits), first
        assert "1 slots of the chains serving its LoRA adapter" in str(first.exception())
        assert dm.queue_length == 0 and dm.running == 0
        assert dm.most_jobs_admissible("fr") == 2 and dm.most_jobs_admissible() == 5

        tickets = RequestPlaces().expect(2)
        first = await submit(dm, DispatchJob("s0", siblings=1, adapter="fr"), tickets[0])
        assert first.done() and first.result().chain.servers == ("a",) and dm.places_held == 1
        second = await submit(dm, DispatchJob("s1", checked=True, adapter="fr"), tickets[1])
        assert not second.done() and dm.queue_length == 1 and dm.queue_max <= dm.max_queue
        dm.release(first.result())
        lease = await second
        assert lease.chain.servers == ("a",)
        dm.release(lease)
        # no chain serves it: the 503, not "more than the chains' 0 slots" (ask for fewer)
        with pytest.raises(NoAdapterChain):
            await (await submit(dm, DispatchJob("t0", siblings=3, adapter="de"), RequestPlaces().expect(4)[0]))

    asyncio.run(main())


def test_an_adapters_job_back_after_a_failover_takes_the_slot_its_request_holds():
    """n=2 of fr admitted with the queue full (a de job waits): the second choice's slot is held on the fr chain. The
    first job's hop fails, it gives its slot back (a base job takes it) and comes again: it waited for a slot while
    the one its own request held idled (its second choice waits for its prefill); a base job takes that slot."""
    async def main():
        dm = manager([chain("a", 1.0, 2), chain("c", 1.0, 1)], max_queue=1)
        de = await dm.acquire(DispatchJob("d0", adapter="de"))
        waiting = await submit(dm, DispatchJob("d1", adapter="de"))
        tickets = RequestPlaces().expect(2)
        first = await submit(dm, DispatchJob("f0", siblings=1, adapter="fr"), tickets[0])
        assert first.result().chain.servers == ("a",) and dm.slots_held == 1
        dm.release(first.result())  # its hop failed
        base = await dm.acquire(DispatchJob("b0"))
        assert base.chain.servers == ("a",)
        back = await submit(dm, DispatchJob("f0", adapter="fr", requeue=True), tickets[0])
        assert back.done() and back.result().chain.servers == ("a",) and dm.slots_held == 0
        tickets[1].drop()
        for lease in (back.result(), base, de):
            dm.release(lease)
        dm.release(await waiting)

    asyncio.run(main())


def _urgent(name: str, adapter: str = "", ttft_ms: float = 300) -> DispatchJob:
    return DispatchJob(name, adapter=adapter, deadline=RequestDeadline.from_ms("x", None, ttft_ms), output_tokens=16)


def test_flex_pauses_a_job_only_on_a_chain_serving_the_adapter():
    """Both chains run a job without a deadline; a fr job with a TTFT deadline comes. flex paused the job on the
    chain without fr (the first it looked at): its slot went to nobody who could use it, the fr job kept waiting."""
    async def main():
        dm = manager([chain("b", 1.7, 1), chain("a", 1.7, 1)], schedule="flex", steps_per_job=lambda: 17.0)
        on_b = await dm.acquire(DispatchJob("vb", expected_output=200))
        on_a = await dm.acquire(DispatchJob("va", expected_output=200))
        urgent = await submit(dm, _urgent("d", "fr"))
        assert not urgent.done() and on_a.preempt and not on_b.preempt and dm.flex_preemptions == 1
        dm.release(on_a)  # the paused job steps: the fr job takes its slot
        await asyncio.sleep(0)
        assert urgent.done() and urgent.result().chain.servers == ("a",)
        for x in (on_b, urgent.result()):
            dm.release(x)

    asyncio.run(main())


def test_mlfq_pauses_a_job_only_on_a_chain_serving_the_adapter():
    """--schedule mlfq: a fr job (level 0) waits while both chains run jobs further down; it paused the lowest one,
    on the chain without fr: a pause for nobody, and the fr job, counted as promised a slot, waited on."""
    async def main():
        dm = manager([chain("b", 1.0, 1), chain("a", 1.0, 1)], schedule="mlfq")
        on_b = await dm.acquire(DispatchJob("jb", sched=dm.new_priority_job("jb", "m")))
        on_a = await dm.acquire(DispatchJob("ja", sched=dm.new_priority_job("ja", "m")))
        for lease, steps in ((on_b, 40), (on_a, 10)):  # both far below level 0, the one on b the lowest
            dm.kv_kept(lease, True)
            for _ in range(steps):
                dm.charge(lease, 0.1)
        assert on_b.job.sched.level > on_a.job.sched.level > 0
        fr = await submit(dm, DispatchJob("fr", adapter="fr", sched=dm.new_priority_job("fr", "m")))
        assert not fr.done() and on_a.preempt and not on_b.preempt
        dm.release(on_a)
        await asyncio.sleep(0)
        assert fr.done() and fr.result().chain.servers == ("a",)
        for x in (on_b, fr.result()):
            dm.release(x)

    asyncio.run(main())


def test_an_adapters_deadline_is_judged_on_the_chains_serving_it():
    """The chain without fr is free, the fr chain runs a long job that has no deadline pausing for (edf): a fr job
    with a TTFT deadline cannot be served in time. It was admitted (judged by the free chain it could not take) and
    waited past its deadline; now it is refused at once, 429 deadline_unreachable. A base job starts on the free
    chain as before."""
    async def main():
        dm = manager([chain("b", 1.7, 1), chain("a", 1.7, 1)], schedule="edf", steps_per_job=lambda: 17.0)
        on_a = await dm.acquire(DispatchJob("va", adapter="fr", expected_output=200,
                                            deadline=RequestDeadline.from_ms("x", 60_000, None), output_tokens=200))
        assert on_a.chain.servers == ("a",)
        late = await submit(dm, _urgent("d", "fr"))
        assert late.done() and isinstance(late.exception(), DeadlineUnreachable), late
        base = await submit(dm, _urgent("e"))
        assert base.done() and base.result().chain.servers == ("b",)
        for x in (on_a, base.result()):
            dm.release(x)

    asyncio.run(main())


def test_with_edf_a_deadline_job_goes_before_an_adapters_job_without_one():
    """--schedule edf: a fr job without a deadline waits for the one chain; a job with a deadline comes after it and
    is admitted by a prediction that counts the jobs with earlier deadlines ahead of it (none). The freed slot went
    to the fr job (it came first), against the queue's order and the prediction."""
    async def main():
        dm = manager([chain("a", 1.7, 1)], schedule="edf", steps_per_job=lambda: 17.0)
        running = await dm.acquire(DispatchJob("r", output_tokens=4, expected_output=4))
        fr = await submit(dm, DispatchJob("fr", adapter="fr"))
        await asyncio.sleep(0.01)  # a later arrival
        urgent = await submit(dm, DispatchJob("u", output_tokens=4, deadline=RequestDeadline.from_ms("x", 5000, None)))
        assert not urgent.done() and not fr.done()
        dm.release(running)
        await asyncio.sleep(0)
        assert urgent.done() and not fr.done()
        dm.release(urgent.result())
        dm.release(await fr)

    asyncio.run(main())


def _fair_manager(max_queue: int) -> DispatchManager:
    """vtc with clients told apart (the queue keeps its last places for clients with nothing waiting), one chain a."""
    from prometheus_client import CollectorRegistry

    from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy
    from petals_chain.orchestrator.fairness import ClientShares

    shares = ClientShares(FairPolicy("vtc", FairnessConfig(quantum=50.0)), registry=CollectorRegistry(), keyed=True)
    return manager([chain("a", 1.0, 1)], policy="jffc", shares=shares, max_queue=max_queue)


def test_with_a_fair_queue_adapters_jobs_wait_their_turn_and_share():
    """--fairness vtc: its queue cannot say its head, and an adapter's job took every freed slot of its chain before
    the fair queue's jobs, even one of the heaviest client that came last; and the share rule (one client holds at
    most 4x the places left free after it) was not applied to adapters' jobs: one client's fr jobs took every place
    and the next client was refused."""
    async def main():
        dm = _fair_manager(max_queue=8)
        running = await dm.acquire(DispatchJob("h0", client="heavy"))
        light = await submit(dm, DispatchJob("l1", client="light"))
        await asyncio.sleep(0.01)  # a later arrival
        heavy = await submit(dm, DispatchJob("h1", client="heavy", adapter="fr"))
        dm.release(running)
        await asyncio.sleep(0)
        assert light.done() and not heavy.done()
        dm.release(light.result())
        lease = await heavy
        dm.release(lease)

        dm = _fair_manager(max_queue=4)
        running = await dm.acquire(DispatchJob("x0", client="A"))
        mine = [await submit(dm, DispatchJob(f"x{i}", client="A", adapter="fr")) for i in range(1, 5)]
        assert [t.done() for t in mine] == [False, False, False, True] and dm.share_refused == 1
        assert type(mine[-1].exception()).__name__ == "QueueShareFull"
        other = await submit(dm, DispatchJob("b", client="B"))
        assert not other.done() and dm.queue_length == 4  # the place kept for another client
        for t in (*mine[:3], other):
            t.cancel()
        await asyncio.gather(*mine[:3], other, return_exceptions=True)
        assert dm.queue_length == 0
        dm.release(running)

    asyncio.run(main())


def test_an_adapter_name_is_one_model_id_across_models():
    """With several models, an adapter named as another model, or as another model's adapter: the router sent the
    name to one of them (the other's adapter listed by /v1/models, never served). Refused at start, naming it."""
    from petals_chain.orchestrator.adapters import split_adapter_args
    from petals_chain.swarm.lora import AdapterError

    with pytest.raises(AdapterError, match="the name 'fr' is an adapter of chat"):
        split_adapter_args(["chat:fr=/x", "code:fr=/y"], ["chat", "code"])
    with pytest.raises(AdapterError, match="the name 'code' is a model's"):
        split_adapter_args(["chat:code=/x"], ["chat", "code"])
    assert split_adapter_args(["chat:fr=/x", "code:de=/y"], ["chat", "code"]) == {"chat": ["fr=/x"],
                                                                                 "code": ["de=/y"]}


def test_the_routers_404_names_the_adapters_too():
    """With several models, a name served by none: the 404 listed the models only ("serves 'chat', 'code'"), though
    the adapters are model ids too (a one-model orchestrator's 404 lists them)."""
    import json
    import types

    from petals_chain.orchestrator.models import ModelRouter

    def orch(name: str, adapters: dict) -> types.SimpleNamespace:
        return types.SimpleNamespace(model_id=name, prefix=f"p-{name}", cfg=types.SimpleNamespace(model=name),
                                     adapters=adapters)

    async def unrouted(scope, receive, send):
        raise AssertionError("a name no model serves reached a model's API")

    async def main():
        router = ModelRouter({"chat": unrouted, "code": unrouted},
                             {"chat": orch("chat", {"fr": None, "de": None}), "code": orch("code", {})})
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        await router({"type": "http", "method": "GET", "path": "/v1/models/frr", "headers": [], "query_string": b""},
                     receive, send)
        return sent[0]["status"], json.loads(sent[1]["body"])["error"]

    status, error = asyncio.run(main())
    assert status == 404 and error["code"] == "model_not_found"
    assert error["message"].endswith("this swarm serves 'chat' (and its LoRA adapters 'fr', 'de'), 'code'")


@pytest.fixture(scope="module")
def adapter_api(tiny_model_factory, tmp_path_factory):
    """(orchestrator, app) over fake chains (identity hops), serving the adapter fr, --max-queue 1."""
    from lora_helpers import write_adapter
    from test_s33_api_envelope import fake_chain_app

    model = tiny_model_factory("llama", num_layers=2)
    path = write_adapter(tmp_path_factory.mktemp("fr"), model, seed=3)
    with pytest.MonkeyPatch.context() as mp:
        yield from fake_chain_app(tiny_model_factory, mp, adapters=[f"fr={path}"], max_queue=1, max_length=32)


def test_embeddings_of_an_adapter_run_on_its_chains_and_name_it(adapter_api):
    """POST /v1/embeddings with "model": "fr": the response named the base model. Its 4 inputs run on the fr chain
    only (1 slot), as many at a time as the base model's on one chain of one slot (its slot and the queue's one
    place): with every chain's slots counted, 4 ran at once and 3 of them waited in a queue bounded at 1. With no
    chain serving fr: 503 no_adapter_chain."""
    import httpx

    orch, app = adapter_api

    async def main():
        dm = orch.dispatch
        dm.serves_adapter = lambda ch, adapter: ch.servers == ("a",)  # "a" serves fr (named by its fingerprint)
        dm.set_chains([chain("a", 0.1, 1), chain("b", 0.05, 3)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=60) as c:
            inputs = [[5, 6, 7], [9], [7, 8], [10, 11]]
            r = await c.post("/v1/embeddings", json={"model": "fr", "input": inputs})
            queue_max, dm.queue_max = dm.queue_max, 0
            # the same inputs of the base model on one chain of one slot: as many wait at most
            dm.set_chains([chain("b", 0.05, 1)])
            base = await c.post("/v1/embeddings", json={"model": orch.model_id, "input": inputs})
            base_queue_max = dm.queue_max
            dm.set_chains([chain("b", 0.05, 3)])  # no chain serves fr
            none = await c.post("/v1/completions", json={"model": "fr", "prompt": [5, 6], "max_tokens": 2})
        return r, base, (queue_max, base_queue_max), none

    r, base, (queue_max, base_queue_max), none = asyncio.run(main())
    # the code the docs name (it came as swarm_unavailable, the code of a 503 that names none)
    assert none.status_code == 503 and none.json()["error"]["code"] == "no_adapter_chain", none.text
    assert "Retry-After" in none.headers
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "fr" and len(body["data"]) == 4
    assert all(e["chain"] == ["a"] for e in body["petals_chain"]), body["petals_chain"]
    assert queue_max <= base_queue_max <= 2, (queue_max, base_queue_max)
    assert base.status_code == 200 and base.json()["model"] == orch.model_id
