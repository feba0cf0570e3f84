"""A session's close racing a turn (review of the sessions hunt): a turn that reaches ``session_generate`` while a
DELETE is closing its session's chain is told the session is gone, not that it is busy."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.orchestrator.core import RequestError
from petals_chain.orchestrator.sampling import SamplingParams
from petals_chain.orchestrator.sessions import UserSession
from test_hunt_sessions_turns import Orch


def test_a_turn_racing_a_close_is_a_404_not_a_409():
    """A turn waiting out the running one (the 5 s grace) resumed while the close held the session's lock to close
    its chain (a round trip per hop) and got 409 ``session_busy``: a client told to retry a session already gone."""
    async def main():
        orch = Orch(None)
        s = UserSession(orch, 64)
        orch.sessions[s.id] = s
        closing, release = asyncio.Event(), asyncio.Event()

        async def slow_close():
            closing.set()  # the chain's close is under way, the session's lock held
            await release.wait()

        s.holder.close = slow_close
        close = asyncio.ensure_future(orch.close_session(s.id))
        await closing.wait()
        try:
            with pytest.raises(RequestError) as e:
                await orch.session_generate(s, [1, 2], SamplingParams(max_tokens=1))
            assert (e.value.status, e.value.code) == (404, "session_not_found")
        finally:
            release.set()
            await close

    asyncio.run(main())
