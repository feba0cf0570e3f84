"""Draft models (``orchestrator/drafting.py``) the hunt broke: a sliding-window draft model rolling rejected drafts
back past its window, and a draft model that fails."""

from __future__ import annotations

import asyncio
import random

import torch

from petals_chain.orchestrator.drafting import DraftModel, DraftState


def _greedy_without_cache(model: torch.nn.Module, context: list[int], k: int) -> list[int]:
    ids, out = list(context), []
    with torch.no_grad():
        for _ in range(k):
            tok = int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def test_a_sliding_window_draft_model_rolls_back_past_its_window(tiny_model_factory):
    """A Mistral draft with a 16-token window: once the sequence passes the window, rolling rejected drafts back
    raised RuntimeError (transformers keeps only the window, so ``crop`` could not restore the rest) and failed the
    request; every draft now equals the model's greedy continuation computed without a cache."""
    path = tiny_model_factory("mistral", num_layers=2, initializer_range=0.05, sliding_window=16)
    drafter = DraftModel.load(path, "swa")
    rng = random.Random(1)

    async def run() -> None:
        state = DraftState()
        context = [rng.randrange(3, 700) for _ in range(10)]
        for _ in range(12):  # reaches 30+ tokens: past the window, with drafts rejected along the way
            k = rng.randint(2, 5)
            draft = await drafter.draft(state, context, k)
            assert draft == _greedy_without_cache(drafter.model, context, k), len(context)
            context = context + draft[:rng.randint(0, k - 1)] + [rng.randrange(3, 700)]
        assert len(context) > 16 and drafter.failures == 0

    try:
        asyncio.run(run())
    finally:
        drafter.close()


def test_a_failing_draft_model_leaves_the_generation_without_drafts(tiny_model_factory):
    """A draft model that raises (out of memory, a bug) failed the request it drafted for; drafts are guesses, so
    the generation now goes on without them (the draft returns [], the model is not called again for it), and
    another generation drafts as before."""
    drafter = DraftModel.load(tiny_model_factory("llama", num_layers=2), "flaky")
    forward = drafter.model.forward
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("CUDA out of memory")

    async def run() -> None:
        state = DraftState()
        drafter.model.forward = broken
        assert await drafter.draft(state, [5, 6, 7], 3) == []
        assert await drafter.draft(state, [5, 6, 7, 8], 3) == [] and len(calls) == 1
        assert drafter.failures == 1 and state.failed
        drafter.model.forward = forward
        assert len(await drafter.draft(DraftState(), [5, 6, 7], 3)) == 3

    try:
        asyncio.run(run())
    finally:
        drafter.close()
