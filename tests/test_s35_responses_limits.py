"""``/v1/responses`` under the admission limits chat has (limits.py): a key's tokens per minute, and a stream that
fails before the dispatcher took it answered with the failure's HTTP status (not a 200 stream of an error). The
orchestrator runs in this process over fake chains (test_s33_api_envelope's ``api``)."""

from __future__ import annotations

import asyncio

import pytest
import test_s33_api_envelope as _envelope
from test_s33_api_envelope import KEYS

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")
envelope = _envelope.api  # keys alice (tokens_per_minute=50) and bob


def test_a_response_is_held_to_its_keys_limits_as_a_chat_completion(envelope):
    """A response that may use more tokens than alice's 50 a minute was served (the limits took /v1/responses for
    no generation: no budget, no in-flight cap, no early queue_full); now a 429 naming ``max_output_tokens``, sent
    once. With no chain, a stream is a 503 with Retry-After, as chat's, not a 200 stream of events."""
    orch, app = envelope

    async def main():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app, raise_app_exceptions=False),
                                  base_url="http://orch", timeout=60)
        out = {}
        async with openai.AsyncOpenAI(base_url="http://orch/v1", api_key=KEYS["alice"], http_client=http,
                                      max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as e:  # no chain needed: refused before any generation
                await client.responses.create(model=orch.model_id, input="hi", max_output_tokens=60)
            out["budget"] = e.value.code, e.value.param, e.value.response.headers.get("x-should-retry")
            with pytest.raises(openai.InternalServerError) as e:
                await client.responses.create(model=orch.model_id, input="hi", max_output_tokens=2, stream=True)
            out["no chain"] = e.value.status_code, e.value.code, "retry-after" in e.value.response.headers
        return out

    out = asyncio.run(main())
    assert out == {"budget": ("tokens_per_minute", "max_output_tokens", "false"),
                   "no chain": (503, "swarm_unavailable", True)}, out
