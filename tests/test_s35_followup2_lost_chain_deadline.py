"""A job that held a chain and lost it (or gave it back) waits for another at most until its deadline: past
``deadline_ms`` (and past ``ttft_deadline_ms`` while no token went out) it ends with the 504 ``deadline_exceeded`` a
queued job gets. It was exempt from the drop, waited ``--queue-timeout-s`` and ended 503. In-process: the real
ChainHolder, ChainSession and dispatcher over a fake server client; one streamed request through the API."""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest
import torch

from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import DEADLINE, DeadlineBook, RequestDeadline
from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchManager
from petals_chain.orchestrator.errors import RequestError, Unavailable
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.replay import ReplayCache
from petals_chain.orchestrator.stats import Stats

H = 8
QUEUE_TIMEOUT_S = 6.0  # what the old code waited before its 503; every drop here comes well before it
CHAIN = Chain(servers=("a",), blocks=(2,), service_time=0.1, capacity=1, spans=((0, 2),))


class Server:
    """One hop ``a`` whose steps fail (a dead server) once ``dead`` is set."""

    def __init__(self):
        self.dead = False

    async def open_session(self, peer, **kw):
        server = self

        class Session:
            cached_tokens = 0
            prefix_cache = False

            async def step(self, x, position, **_):
                if server.dead:
                    raise ConnectionError("server a is gone")
                return torch.zeros_like(x)

            async def close(self, **_):
                pass

        return Session()


def make_orch(server: Server):
    async def embed(ids):
        return torch.zeros(1, len(ids), H)

    dm = DispatchManager(policy="jffc")
    dm.set_chains([CHAIN])
    orch = types.SimpleNamespace(
        dispatch=dm, stats=Stats(), prefix_directory=ChainPrefixes(), chain_sessions=set(), shares=None, planner=None,
        replay_cache=ReplayCache(1 << 20), client=server, observe_hop=None, model_id="m", auditor=None,
        deadlines=DeadlineBook(),
        cfg=types.SimpleNamespace(queue_timeout_s=QUEUE_TIMEOUT_S, output_reserve_tokens=0, max_failovers=3,
                                  relay="orchestrator", open_wait_max_s=1.0, hold_sessions=False, no_chain_wait_s=5.0),
        batcher=types.SimpleNamespace(embed=embed), replacement_servers=lambda s, e: [])
    orch.server_failed = lambda e: dm.set_chains([])  # the only chain leaves the plan with its server
    orch._background = asyncio.ensure_future
    return orch


async def lose_chain(dl: RequestDeadline, first_token: bool, back_after_s: float | None = None):
    """Prefill on the only chain, (send the first token,) lose the chain at the next step; the chain comes back
    after ``back_after_s`` (None: never). Returns (the error the next feed raised or None, seconds it took)."""
    DEADLINE.set(dl)
    server = Server()
    orch = make_orch(server)
    holder = ChainHolder(orch, "j", 64)
    await holder.feed([1, 2, 3])
    if first_token:
        dl.first_token()
    server.dead = True

    async def come_back():
        await asyncio.sleep(back_after_s)
        server.dead = False
        orch.dispatch.set_chains([CHAIN])

    back = asyncio.ensure_future(come_back()) if back_after_s is not None else None
    t0 = time.monotonic()
    error = None
    try:
        await holder.feed([4])
    except (RequestError, Unavailable) as e:
        error = e
    took = time.monotonic() - t0
    if back is not None:
        await back
    await holder.close()
    assert orch.dispatch.running == 0
    return error, took


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_job_that_lost_its_chain_after_its_first_token_is_dropped_at_deadline_ms():
    """deadline_ms 600, the chain lost after the first token: 504 deadline_exceeded at 0.6 s, outcome missed (it
    ran). Before: 503 ``no chain became available`` after --queue-timeout-s (6 s here, 60 s by default)."""
    dl = RequestDeadline.from_ms("x", 600, None)
    error, took = run(lose_chain(dl, first_token=True))
    assert isinstance(error, RequestError), repr(error)
    assert (error.status, error.code) == (504, "deadline_exceeded")
    assert took < QUEUE_TIMEOUT_S - 1 and time.monotonic() >= dl.deadline
    assert dl.outcome == "missed"


def test_before_its_first_token_the_ttft_deadline_drops_it_after_it_only_deadline_ms():
    """ttft_deadline_ms 300 with deadline_ms 20 s: the chain lost during the prefill (no token out) ends at the TTFT
    deadline; lost after the first token it waits on, and goes on when the chain comes back at 1 s."""
    dl = RequestDeadline.from_ms("x", 20_000, 300)
    error, took = run(lose_chain(dl, first_token=False))
    assert isinstance(error, RequestError) and error.status == 504, repr(error)
    assert took < QUEUE_TIMEOUT_S - 1 and time.monotonic() >= dl.ttft_deadline
    dl = RequestDeadline.from_ms("x", 20_000, 300)
    error, took = run(lose_chain(dl, first_token=True, back_after_s=1.0))
    assert error is None and took >= 1.0 and dl.outcome is None


@pytest.mark.parametrize("case", ["best_effort", "before_deadline"])
def test_best_effort_and_a_chain_back_before_the_deadline_are_unchanged(case):
    """best_effort: never dropped, the chain that comes back after its deadline serves it (it would otherwise wait
    --queue-timeout-s as before). A chain back before the deadline: served, nothing settled."""
    dl = RequestDeadline.from_ms("x", 300 if case == "best_effort" else 5000, None, best_effort=case == "best_effort")
    error, took = run(lose_chain(dl, first_token=True, back_after_s=0.8))
    assert error is None and took >= 0.8 and dl.outcome is None


def test_a_streamed_request_whose_only_chain_dies_ends_with_504_at_its_deadline(tiny_model_factory):
    """What a user sees: a stream with deadline_ms 1500 gets its first tokens, then its only chain dies. It ends
    with the error event 504 deadline_exceeded at about 1.5 s; before it ended 503 swarm_unavailable after
    --queue-timeout-s."""
    import httpx

    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import HeadBatcher, Orchestrator, OrchestratorConfig

    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=128,
                                           port=0, queue_timeout_s=QUEUE_TIMEOUT_S))
    orch.load_model()
    app = create_app(orch)
    steps = [0]

    class Client:
        async def open_session(self, peer, **kw):
            class Session:
                cached_tokens = 0
                prefix_cache = False

                async def step(self, x, position, **_):
                    steps[0] += 1
                    if steps[0] > 5:  # the prefill and four decode steps, then the server is gone
                        raise ConnectionError("server a is gone")
                    return torch.zeros_like(x)

                async def close(self, **_):
                    pass

            return Session()

    orch.client = Client()
    orch.server_failed = lambda e: orch.dispatch.set_chains([])

    async def main():
        orch.batcher = HeadBatcher(orch.head, window_s=orch.cfg.head_window_s)
        orch.dispatch.set_chains([CHAIN])
        body = {"model": orch.model_id, "prompt": [5, 6, 7], "max_tokens": 20, "stream": True, "deadline_ms": 1500,
                "seed": 7}
        t0 = time.monotonic()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                          if line.startswith("data: {")]
        took = time.monotonic() - t0
        texts = [e for e in events if "choices" in e]
        # its first tokens went out: five sampled tokens make at least one text event (a token ending inside a
        # UTF-8 character is held for the next one, so two tokens can make one event)
        assert texts and any(c["text"] for e in texts for c in e["choices"]), events
        err = events[-1].get("error")
        assert err is not None and (err["status"], err["code"]) == (504, "deadline_exceeded"), events[-1]
        assert 1.4 <= took < QUEUE_TIMEOUT_S - 1, took

    asyncio.run(asyncio.wait_for(main(), 30))
