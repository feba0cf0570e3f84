"""Review of 4e9dd32 (rows with no token to sample): a prompt scored for ``echo`` + ``logprobs`` whose logits are NaN,
+inf or all -inf fails its request with 500 ``invalid_logits``, as sampling from such logits does. Its logprobs were
NaN: a 500 "internal error (ValueError)" unstreamed, and streamed a 200 whose JSON held ``NaN`` (invalid JSON)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from test_s35_sampling_api import BAD_PROMPT, world  # noqa: F401 -- the fixture: NaN logits for BAD_PROMPT's rows

from petals_chain.model import Chain
from petals_chain.orchestrator import sampling as S

VOCAB = 300
_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
def test_a_prompt_row_with_no_distribution_is_an_invalid_logits_error(bad):
    """prompt_logprobs raises a SamplingError naming the prompt token and what is wrong (it returned NaN logprobs)."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[1, :] = -_INF if bad == "all -inf" else logits[1, :]
    if bad != "all -inf":
        logits[1, 7] = _NAN if bad == "nan" else _INF
    with pytest.raises(S.SamplingError) as err:
        S.prompt_logprobs(logits, [5, 6, 7, 8], 2)
    word = {"nan": "NaN at 1 of 300", "+inf": "+inf at 1 of 300", "all -inf": "every token's logit is -inf"}[bad]
    msg = str(err.value)
    assert "the prompt cannot be scored" in msg and "token 2 (counted from 0)" in msg and word in msg, msg
    assert err.value.status == 500 and err.value.code == "invalid_logits" and err.value.row == 1


def test_masked_tokens_and_an_unscored_last_row_still_score():
    """Some -inf logits are a distribution (a prompt token the model excludes scores -inf); the last row, which
    predicts the token after the prompt, is not scored, so its NaN is for the sampler to refuse, not the scoring."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[0, :100] = -_INF
    logits[2, :] = _NAN
    out = S.prompt_logprobs(logits, [1, 50, 200], 3)
    assert out[0] is None and out[1].logprob == S.MIN_LOGPROB and len(out[1].top_logprobs) == 3
    assert out[2].token == 200 and torch.isfinite(torch.tensor(out[2].logprob))


def _serve(orch, bodies: list[dict]) -> tuple[list[httpx.Response], int]:
    """The responses to ``bodies`` (one after another; an app error is a 500 response, as a client sees it) and the
    jobs still holding a chain once their chains are given back (polled, 10 s at most)."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.relay import HeadBatcher

    async def main():
        orch.batcher = HeadBatcher(orch.head)
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=1.0, capacity=4, spans=((0, 2),))])
        out = []
        try:
            transport = httpx.ASGITransport(app=create_app(orch), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://x", timeout=60) as c:
                for body in bodies:
                    out.append(await c.post("/v1/completions", json=body))
            for _ in range(200):
                if not orch.dispatch.running:
                    break
                await asyncio.sleep(0.05)
            return out, orch.dispatch.running
        finally:
            orch.batcher.close()

    return asyncio.run(main())


def _strict_json(text: str) -> dict:
    """JSON as a client parses it: NaN and Infinity are not JSON (Python's json reads them by default)."""
    def refuse(word: str):
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def test_echo_logprobs_of_a_prompt_with_nan_logits_fail_with_invalid_logits(world):  # noqa: F811
    """``max_tokens: 0`` and 2, streamed or not: a 500 ``invalid_logits`` naming the prompt token (streamed: its error
    event, and no event of NaN logprobs before it); the chain is given back; a good prompt is still scored."""
    orch, _ = world
    body = {"model": orch.model_id, "ignore_eos": True, "seed": 1, "echo": True, "logprobs": 2,
            "prompt": BAD_PROMPT + [4]}
    bodies = [{**body, "max_tokens": m, **s} for m in (0, 2) for s in ({}, {"stream": True})]
    (*rs, good), running = _serve(orch, bodies + [{**body, "prompt": [9, 9, 9, 4], "max_tokens": 0}])
    for r in rs[0::2]:
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "invalid_logits", r.text
        assert "the prompt cannot be scored" in r.json()["error"]["message"], r.text
    for r in rs[1::2]:
        events = [_strict_json(e[len("data: "):]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert events and all("error" in e for e in events), r.text
        assert events[-1]["error"]["code"] == "invalid_logits", r.text
    assert good.status_code == 200, good.text
    assert len(good.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4
    assert running == 0
