"""Push routes and a session's push mailbox (``swarm/push.py``): tokens, route validation, steps matched by id."""

from __future__ import annotations

import asyncio

import pytest
import torch

from petals_chain.swarm.push import MAX_PENDING_PUSHES, PushBox, RouteError, check_route, check_token

TOKEN = "ab" * 16


def test_tokens_and_routes_are_validated():
    assert check_token(TOKEN) == TOKEN
    for bad in (None, 5, "short", "x" * 129):
        with pytest.raises(RouteError):
            check_token(bad)
    hop = {"peer": "QmPeer", "session_id": "s1", "token": TOKEN}
    assert check_route(None) == [] and check_route([hop]) == [hop]
    for bad in ("x", [hop] * 65, [5], [{**hop, "peer": ""}], [{**hop, "session_id": "s" * 257}],
                [{**hop, "token": "t"}], [{"peer": "QmPeer", "session_id": "s1"}]):
        with pytest.raises(RouteError):
            check_route(bad)
    # extra fields are not passed on
    assert check_route([{**hop, "note": "x"}]) == [hop]


def test_box_matches_steps_by_id_in_either_order():
    async def run():
        box = PushBox(TOKEN)
        assert box.accepts(TOKEN) and not box.accepts("cd" * 16) and not box.accepts(None)
        x1, x2 = torch.ones(1, 1, 4), torch.full((1, 2, 4), 2.0)
        box.put(1, 10, x1, [])  # pushed before the step awaits it
        pos, hidden, route = await box.take(1, timeout_s=1)
        assert pos == 10 and hidden is x1 and route == []
        waiter = asyncio.ensure_future(box.take(2, timeout_s=5))  # awaited before the push arrives
        await asyncio.sleep(0.01)
        box.put(2, 11, x2, [{"peer": "p", "session_id": "s", "token": TOKEN}])
        pos, hidden, route = await waiter
        assert pos == 11 and hidden is x2 and route[0]["peer"] == "p"
        # a repeated push of an old step is never taken for a later one
        box.put(2, 11, x2, [])
        box.put(3, 13, x1, [])
        pos, hidden, _ = await box.take(3, timeout_s=1)
        assert pos == 13
        with pytest.raises(asyncio.TimeoutError):
            await box.take(4, timeout_s=0.05)
        # bounded: the oldest waiting pushes are dropped
        for step in range(10, 10 + MAX_PENDING_PUSHES + 3):
            box.put(step, step, x1, [])
        with pytest.raises(asyncio.TimeoutError):
            await box.take(10, timeout_s=0.05)
        pos, _, _ = await box.take(10 + MAX_PENDING_PUSHES + 2, timeout_s=1)
        assert pos == 10 + MAX_PENDING_PUSHES + 2
        # closing wakes a waiter and refuses every token from then on
        waiter = asyncio.ensure_future(box.take(99, timeout_s=5))
        await asyncio.sleep(0.01)
        box.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not box.accepts(TOKEN)

    asyncio.run(run())
