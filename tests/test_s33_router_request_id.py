"""The multi-model orchestrator's own answers carry an x-request-id, and --sse-keepalive-s reaches the config."""

import asyncio

import httpx
import pytest

from petals_chain.orchestrator.__main__ import build_parser
from petals_chain.orchestrator.models import ModelRouter
from petals_chain.orchestrator.request_id import RequestIds
from tests.test_model_router import orch, stand_in


def test_the_routers_own_404_names_its_request():
    seen: list = []
    app = RequestIds(ModelRouter({"chat": stand_in("chat", seen)}, {"chat": orch("chat", "Tiny-Chat")}))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            r = await c.post("/v1/completions", json={"model": "gpt-4"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert r.headers["x-request-id"].startswith("req_")
            mine = await c.post("/v1/completions", json={"model": "gpt-4"}, headers={"X-Request-Id": "trace-7"})
            assert mine.headers.get_list("x-request-id") == ["trace-7"]

    asyncio.run(main())


@pytest.mark.parametrize("value", ["-1", "nan", "x"])
def test_a_bad_keepalive_interval_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--model", "m", "--sse-keepalive-s", value])
    assert e.value.code == 2 and "--sse-keepalive-s" in capsys.readouterr().err


def test_the_keepalive_interval_is_parsed():
    assert build_parser().parse_args(["--model", "m", "--sse-keepalive-s", "0"]).sse_keepalive_s == 0.0
    assert build_parser().parse_args(["--model", "m"]).sse_keepalive_s == 15.0


def test_the_routers_healthz_says_when_it_is_stopping():
    """A multi-model orchestrator draining for a stop answers ``/healthz`` 503 with ``shutting_down`` at the top, as a
    one-model one does (the Python client skips a stopping orchestrator by it; it read as "no chain yet": up)."""
    import json as _json

    from petals_chain.client import Client

    def health(status: int, body: dict):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": _json.dumps(body).encode()})
        return app

    router = ModelRouter({"chat": health(503, {"ok": False, "shutting_down": True}),
                          "code": health(200, {"ok": True})},
                         {"chat": orch("chat", "Tiny-Chat"), "code": orch("code", "Tiny-Code")})

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x") as c:
            return await c.get("/healthz")

    r = asyncio.run(main())
    assert r.status_code == 503 and r.json()["shutting_down"] is True
    assert r.json()["models"]["chat"]["shutting_down"] is True
    c = Client("http://x")
    c._https[0] = httpx.Client(base_url="http://x", transport=httpx.MockTransport(
        lambda req: httpx.Response(r.status_code, json=r.json())))
    assert not c._answers(0)
