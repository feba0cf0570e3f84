"""Review of the thirty-first session's draft-model timeout: a slow but working draft model is not a hung one."""

from __future__ import annotations

import asyncio
import time

import torch
from test_s31_spec import HeldForward, held_draft_forward

from petals_chain.orchestrator.drafting import DraftModel, DraftState


def test_a_long_prompt_on_a_slow_draft_model_is_drafted_not_given_up(tiny_model_factory):
    """The timeout bounded a whole draft call, and a generation's first call feeds its whole prompt: SmolLM2-135M as
    the draft took 31 s for a 2k-token prompt on a loaded 2-core CPU (the 10 s default), so every long prompt gave up
    drafting for its generation, after computing the prefill, and every other generation got [] while it ran. Only a
    draft model that finishes no forward within ``timeout_s`` is taken for hung now, and a long context is fed in
    pieces. The model here costs 2 ms per token fed: 2.4 s for the prompt, at most 0.3 s per forward."""
    drafter = DraftModel.load(tiny_model_factory("llama", num_layers=2), "slow")
    drafter.timeout_s = 2.0
    forward = drafter.model.forward
    fed: list[int] = []

    def slow(*args, **kwargs):
        n = int(kwargs["input_ids"].shape[1])
        fed.append(n)
        time.sleep(0.002 * n)
        return forward(*args, **kwargs)

    context = [int(t) for t in torch.randint(3, 200, (1200,), generator=torch.Generator().manual_seed(0))]

    async def run() -> None:
        state = DraftState()
        out = await asyncio.wait_for(drafter.draft(state, context, 3), 60)
        assert len(out) == 3 and not state.failed and drafter.failures == 0, (out, drafter.failures)
        assert sum(fed) == len(context) + 2 and max(fed) < 600, fed  # the prompt in pieces, then a token a forward
        drafter.model.forward = forward
        fresh = await drafter.draft(DraftState(), context, 3)  # what the whole prompt in one forward drafts
        assert out == fresh, (out, fresh)

    drafter.model.forward = slow
    try:
        asyncio.run(run())
    finally:
        drafter.model.forward = forward
        drafter.close()


def test_a_cancelled_generation_drops_its_queued_draft_and_the_drafter_goes_on(tiny_model_factory):
    """A client that disconnects cancels its generation's draft call: queued, it never runs; running, it ends in the
    worker and nobody is given up; the next draft works."""
    drafter = DraftModel.load(tiny_model_factory("llama", num_layers=2), "cancel")

    async def run(held: HeldForward) -> None:
        first = asyncio.ensure_future(drafter.draft(DraftState(), [5, 6, 7], 2))  # runs, held in its forward
        await asyncio.get_running_loop().run_in_executor(None, held.entered.wait, 30)
        queued = asyncio.ensure_future(drafter.draft(DraftState(), [9, 9, 9, 9], 2))  # behind it
        await asyncio.sleep(0)
        queued.cancel()
        first.cancel()
        for task in (first, queued):
            try:
                await task
            except asyncio.CancelledError:
                pass
        held.release.set()
        drafter.model.forward = held.forward
        state = DraftState()
        for _ in range(100):  # the running call ends in the worker; the queued one never starts
            if await asyncio.wait_for(drafter.draft(state, [5, 6, 7, 8], 2), 30):
                break
            await asyncio.sleep(0.05)
        assert len(await drafter.draft(state, [5, 6, 7, 8, 9], 2)) == 2
        assert held.calls == [3] and drafter.failures == 0 and not state.failed, (held.calls, drafter.failures)

    try:
        with held_draft_forward(drafter, wait_s=30) as held:
            asyncio.run(run(held))
    finally:
        drafter.close()
