"""What the thirty-sixth session left in the limits (limits.py, models.py): a held-back ``tokens_per_minute`` refusal
of a request larger than the whole per-minute budget said "retry later" (with ``Retry-After``) and only the retry,
once the minute had passed, heard that it never fits; it says so at once. And the model router's own 413 (a chunked
body past every model's ``--max-body-bytes``) was counted nowhere; it is counted in the default model's
``rejected`` (as a 413 for a ``Content-Length`` past the cap, which that model's limits answer)."""

from __future__ import annotations

import pytest
from test_s36_limits_body_once import run_api


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=2)


def test_a_request_over_the_whole_budget_never_fits_at_once_and_the_routers_413_is_counted(model_path, tmp_path):
    """One orchestrator behind the model router (an orchestrator's start is the cost here): both leftovers."""
    async def fn(orch, c, limits):
        await _tokens_per_minute(orch, c, limits)
        await _routers_413(orch, c, limits)

    run_api(model_path, tmp_path, fn, router=True)


async def _tokens_per_minute(orch, c, limits):
    limits.limits.tokens_per_minute = lambda client: 100  # k's budget (the context holds 64 tokens)
    limits.reserved["k"] = 100  # all of it held by requests under way: every request is refused early
    # 40 tokens x 4 choices: over the whole budget, however long the client waits
    m = orch.model_id
    for path, payload, field in (("/v1/completions", {"model": m, "prompt": "hi", "max_tokens": 40, "n": 4},
                                  "max_tokens"),
                                 ("/v1/chat/completions", {"model": m, "stream": True, "n": 4,
                                                           "max_completion_tokens": 40,
                                                           "messages": [{"role": "user", "content": "hi"}]},
                                  "max_completion_tokens")):
        r = await c.post(path, json=payload)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        # was: "this client used its 100 tokens per minute; retry later", Retry-After, and the retry once the
        # minute passed got the never-fits answer below
        assert err["code"] == "tokens_per_minute" and err["param"] == field, err
        assert "more than this client's 100 tokens per minute" in err["message"], err
        assert "retry-after" not in r.headers and r.headers.get("x-should-retry") == "false", r.headers
    # a request that fits the budget once it frees up is still told to come back
    r = await c.post("/v1/completions", json={"model": m, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and "retry later" in r.json()["error"]["message"], r.text
    assert int(r.headers["retry-after"]) >= 1 and "x-should-retry" not in r.headers
    assert limits.rejected == {"tokens_per_minute": 3}
    assert limits.checking == {} and limits.reserved == {"k": 100}  # nothing reserved by the refused ones
    del limits.limits.tokens_per_minute
    limits.reserved.clear()


async def _routers_413(orch, c, limits):
    limits.limits.max_body_bytes = 2_000  # the router's cap is the largest model's: this one's

    async def chunked():  # no Content-Length: the router reads it, up to its cap
        for _ in range(3):
            yield b" " * 1_000

    r = await c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert "2000 bytes" in r.json()["error"]["message"]
    # was: not counted (the router answered for itself)
    assert limits.rejected == {"tokens_per_minute": 3, "body_too_large": 1}
    assert orch.stats.registry.get_sample_value("petals_chain_rejected_requests_total",
                                                {"reason": "body_too_large"}) == 1
    # with a Content-Length past the cap the model's limits answer: the same count
    r = await c.post("/v1/completions", content=b" " * 3_000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and limits.rejected["body_too_large"] == 2
