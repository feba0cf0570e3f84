"""Session endpoints of an in-process orchestrator without servers (the sessions/multi-model hunt): a chat turn
without messages, a turn naming a model, a prompt tokenized while another turn ended, a close while a turn runs."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.api import create_app


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def run_with_api(model_path, fn, **cfg_kwargs):
    async def main():
        cfg = OrchestratorConfig(model=str(model_path), max_length=64, port=0, **cfg_kwargs)
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        try:
            app = create_app(orch)
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is an answer here
            async with httpx.AsyncClient(transport=transport, base_url="http://orch", timeout=60) as c:
                return await fn(orch, c)
        finally:
            await orch.stop()

    return asyncio.run(main())


def test_a_turns_model_messages_and_prompt_are_checked_against_the_session(model_path):
    """``messages: []`` on a session was a 500 (the chat template had no conversation to render); now a 400 naming
    ``messages``. A turn naming the session's own model (as OpenAI clients send ``model`` on every call) was a 400
    "unsupported parameter", as was one naming another model; now the first runs and the second is a 400 saying
    whose session it is. A text prompt tokenized while another turn of the session ended chose its BOS on the
    session before that turn (a first turn's BOS in mid-conversation) and ran: now a 409 as for ``input_ids``."""
    async def fn(orch, c):
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        url = f"/api/v1/sessions/{sid}/generate"
        r = await c.post(url, json={"messages": [], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        r = await c.post(url, json={"input_ids": [1, 2], "max_tokens": 1, "model": "another"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "session_model", r.text
        assert repr(orch.model_id) in r.json()["error"]["message"]
        for name in (orch.model_id, orch.prefix):  # taken: the turn waits for a chain (none here)
            r = await c.post(url, json={"input_ids": [1, 2], "max_tokens": 1, "model": name})
            assert r.status_code == 503 and r.json()["error"]["code"] == "swarm_unavailable", r.text
        s = orch.get_session(sid)
        encode = orch.encode

        def meanwhile(text, **kw):
            s.history, s.turns = [9, 9, 7], s.turns + 1  # another call's turn ended while this prompt was tokenized
            return encode(text, **kw)

        orch.encode = meanwhile
        r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"prompt": "hello", "max_tokens": 1})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
        assert s.history == [9, 9, 7] and s.turns == 1

    run_with_api(model_path, fn, no_chain_wait_s=0.5)


def test_closing_a_session_ends_its_running_turn(model_path):
    """A DELETE of a session whose turn runs waited for the turn to end (for the whole generation, the chain
    computing for a closed session); here the turn waits for a chain that never comes, so it only ended at
    ``no_chain_wait_s`` with a 503. Now the close cancels it: the turn's caller gets 404 ``session_not_found``,
    streamed or not, and the close returns at once."""
    async def fn(orch, c):
        queued = asyncio.Event()
        acquire = orch.dispatch.acquire

        async def noted(job):
            queued.set()  # the turn waits for a chain now
            return await acquire(job)

        orch.dispatch.acquire = noted
        for stream in (False, True):
            queued.clear()
            sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
            body = {"input_ids": [1, 2], "max_tokens": 4, "stream": stream}
            turn = asyncio.ensure_future(c.post(f"/api/v1/sessions/{sid}/generate", json=body))
            await queued.wait()
            closed = await c.delete(f"/api/v1/sessions/{sid}")
            assert closed.status_code == 200, closed.text
            r = await turn
            # a stream ended before its first event is answered with the error's status (limits.py holds it)
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
            assert sid not in orch.sessions

    run_with_api(model_path, fn, no_chain_wait_s=5.0)


def test_a_turn_sent_as_the_last_ones_client_leaves_runs_and_a_raced_one_is_refused(model_path):
    """A client that breaks off a streamed turn and sends its next turn at once got 409 ``session_busy`` in 4 of 8
    tries (the orchestrator had not yet noticed it leave, or was giving the chain back): the next turn now waits
    for the running one to end. It runs if that turn ended without a turn done (cut, failed), and is still a 409 if
    another turn completed meanwhile (two turns sent at once)."""
    from types import SimpleNamespace

    async def fn(orch, c):
        async def fake_turn(s, target, params, *, explicit_max_tokens=True, emit=None, messages=None,
                            based_on=None):
            async with s.lock:
                s.history, s.turns = [*target, 7], s.turns + 1
                return SimpleNamespace(text="ok", token_ids=[7], finish_reason="stop", cached_tokens=0,
                                       prompt_tokens=len(target), wait_s=0.0, service_s=0.0, chain=[], failovers=0)

        orch.session_generate = fake_turn
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        s = orch.get_session(sid)
        looked_up = asyncio.Event()
        get_session = orch.get_session

        def noted(session_id):
            looked_up.set()  # the request found the session
            return get_session(session_id)

        orch.get_session = noted
        url = f"/api/v1/sessions/{sid}/generate"
        for completed in (False, True):
            looked_up.clear()
            await s.lock.acquire()  # a turn runs
            r = asyncio.ensure_future(c.post(url, json={"input_ids": [1, 2], "max_tokens": 1}))
            await looked_up.wait()  # and it ran on to its check of a running turn: no await between them
            if completed:
                s.turns += 1  # that turn ran to its end: the request raced it
            s.lock.release()
            r = await r
            if completed:
                assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
            else:
                assert r.status_code == 200 and r.json()["token_ids"] == [7], r.text

    run_with_api(model_path, fn)
