"""Session 35's sampler fixes through the API (a tiny model, chain sessions faked: every step's hidden state is 0, so
the logits are flat and a seeded draw depends on its generator alone): a request whose logits have no token to sample
fails alone with a clear error, and the choices of a seeded request are not the first choices of the next seeds."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from test_s31_queue_api import _fake_chains, _orch

from petals_chain.model import Chain

BAD_PROMPT = [5, 6, 7]  # the request whose logits the head turns to NaN


@pytest.fixture(scope="module")
def world(tiny_model_factory):
    """An orchestrator on the tiny model whose head returns NaN logits for the rows of ``BAD_PROMPT`` (marked by
    the faked chain: hidden state 1 instead of 0), and one chain of 4 slots.
    ``meet["on"]``: each prefill waits for the next one, so that the two requests' first tokens share a batch."""
    from petals_chain.orchestrator import failover

    orch = _orch(str(tiny_model_factory("llama", num_layers=2)))
    hidden = int(orch.config.hidden_size)
    meet: dict = {"on": False, "waiting": None}

    async def forward(self, x, position, budget, tokens):
        if meet["on"]:
            if meet["waiting"] is None:
                meet["waiting"] = asyncio.Event()
                await meet["waiting"].wait()
            else:
                meet["waiting"].set()
                meet["waiting"] = None
        mark = 1.0 if list(tokens[:3]) == BAD_PROMPT else 0.0
        return torch.full((1, len(tokens) - position, hidden), mark, dtype=orch.head.dtype)

    logits = orch.head.logits

    def nan_where_marked(h):
        out = logits(h)
        return torch.where(h[..., :1] == 1.0, torch.full_like(out, float("nan")), out)

    with pytest.MonkeyPatch.context() as mp:
        _fake_chains(mp, orch)
        mp.setattr(failover.ChainHolder, "_forward", forward)
        mp.setattr(orch.head, "logits", nan_where_marked)
        yield orch, meet


def _serve(orch, requests, window_s: float = 0.0) -> tuple[list[httpx.Response], list[int]]:
    """The responses to ``requests`` (lists of bodies, each list sent at once) and the head's batch sizes; the head
    waits ``window_s`` for the rows of a batch."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.relay import HeadBatcher

    rows: list[int] = []

    async def main():
        orch.batcher = HeadBatcher(orch.head, window_s=window_s)
        orch.batcher.on_batch = rows.append
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=1.0, capacity=4, spans=((0, 2),))])
        out = []
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://x",
                                         timeout=60) as c:
                for bodies in requests:
                    out += await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
        finally:
            orch.batcher.close()
        return out

    return asyncio.run(main()), rows


@pytest.mark.parametrize("params", [{}, {"top_p": 0.9}])
def test_a_request_whose_logits_are_nan_fails_alone_with_a_clear_error(world, params):
    """Two requests whose first tokens share the head's batch, one with NaN logits. Before, a top-p batch failed both
    with "internal error (RuntimeError)" (torch.bincount's) and an unfiltered one gave the bad request a 200 with NaN's
    position as its token. Now the bad one is a 500 ``invalid_logits`` saying why (streamed: its error event), and
    the other is served."""
    orch, meet = world
    body = {"model": orch.model_id, "max_tokens": 1, "ignore_eos": True, "seed": 1, **params}
    meet["on"] = True
    try:
        (bad, good, bad_s, good_s), rows = _serve(orch, [
            [{**body, "prompt": BAD_PROMPT}, {**body, "prompt": [9, 9, 9]}],
            [{**body, "prompt": BAD_PROMPT, "stream": True}, {**body, "prompt": [9, 9, 9], "stream": True}]],
            window_s=0.2)
    finally:
        meet["on"] = False
    assert good.status_code == 200 and len(good.json()["choices"][0]["text"]) > 0, good.text
    assert good_s.status_code == 200 and "error" not in good_s.text and good_s.text.endswith("[DONE]\n\n"), good_s.text
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["code"] == "invalid_logits" and "no next token can be sampled" in err["message"], err
    assert "NaN" in err["message"], err
    assert "invalid_logits" in bad_s.text and "no next token can be sampled" in bad_s.text, bad_s.text
    assert rows == [2, 2], rows  # each pair's first tokens shared a batch of the head


def test_the_choices_of_a_seed_are_not_the_next_seeds_first_choices(world):
    """n = 3 with seed 1: choice 0 is what seed 1 with n = 1 gives (unchanged), and the same request gives the same
    choices again; but choices 1 and 2 are no longer what seeds 2 and 3 give alone (they were, token for token)."""
    orch, _ = world
    body = {"model": orch.model_id, "max_tokens": 8, "ignore_eos": True, "prompt": [9, 9, 9]}
    (many, again, one1, one2, one3), _ = _serve(orch, [[{**body, "seed": 1, "n": 3}], [{**body, "seed": 1, "n": 3}],
                                                       [{**body, "seed": s} for s in (1, 2, 3)]])
    texts = [c["text"] for c in sorted(many.json()["choices"], key=lambda c: c["index"])]
    assert texts == [c["text"] for c in sorted(again.json()["choices"], key=lambda c: c["index"])]
    alone = [r.json()["choices"][0]["text"] for r in (one1, one2, one3)]
    assert texts[0] == alone[0]
    assert texts[1] != alone[1] and texts[2] != alone[2], (texts, alone)
    assert len(set(texts)) == 3
