"""Review of ``x-should-retry``: a refusal another orchestrator answered is passed on as it said (in-process, no
swarm)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from dashboard_helpers import serve_app
from petals_chain.orchestrator import forward as fw
from petals_chain.orchestrator.limits import AdmissionLimits, LimitsConfig


def test_a_forwarded_refusal_that_never_fits_is_not_told_to_come_back():
    """The orchestrator a request was forwarded to refused it as never fitting (429 ``x-should-retry: false``, no
    ``Retry-After``): the forwarding one's limits took it for its own admitted request's 429 and added
    ``Retry-After: 1``, so a client that honours Retry-After sent back what can never be admitted."""
    async def other(request):
        return JSONResponse({"error": {"message": "9 completions never fit", "code": "exceeds_capacity"}},
                            status_code=429, headers={"x-should-retry": "false"})

    async def busy(request):  # a refusal that can be cured: Retry-After is added as before
        return JSONResponse({"error": {"message": "the queue is full", "code": "queue_full"}}, status_code=429)

    with serve_app(Starlette(routes=[Route("/v1/completions", other, methods=["POST"]),
                                     Route("/v1/chat/completions", busy, methods=["POST"])])) as url:
        peer = {"peer_id": "other", "http_url": url, "live": True, "servers": 1, "arrival_rate": 0.0}
        orch = NS(dispatch=NS(chains=[], max_queue=None, queue_length=0, keeps_places=False),
                  groups=NS(me="me", epoch=1, forwarded=0, session_owners=fw.SessionOwners(),
                            json=lambda: {"orchestrators": [peer]}),
                  stats=NS(measured=lambda: {}))

        async def here(request):
            return await fw.maybe_forward(orch, request)

        app = AdmissionLimits(Starlette(routes=[Route("/v1/completions", here, methods=["POST"]),
                                                Route("/v1/chat/completions", here, methods=["POST"])]),
                              orch, LimitsConfig())

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://here") as c:
                return (await c.post("/v1/completions", json={"prompt": "hi", "n": 9}),
                        await c.post("/v1/chat/completions", json={"messages": []}))

        never, busy_reply = asyncio.run(main())
    assert never.status_code == 429 and never.headers[fw.SERVED_BY_HEADER] == url
    assert never.headers.get("x-should-retry") == "false"
    assert "retry-after" not in never.headers
    assert busy_reply.status_code == 429 and int(busy_reply.headers["retry-after"]) >= 1
    assert "x-should-retry" not in busy_reply.headers


def test_a_cut_streams_rerun_refused_for_good_ends_with_that_refusal(monkeypatch):
    """A cut forwarded stream's rerun refused as never fitting (429 exceeds_capacity, ``x-should-retry: false``) was
    sent again every pause until ``RESUME_S`` (60 s) and the stream ended as 503 ``stream_cut``; it now ends at once
    with the other orchestrator's own refusal."""
    import time

    from petals_chain.orchestrator import resume

    hits = []

    async def other(request):
        hits.append(time.monotonic())
        return JSONResponse({"error": {"message": "never fits", "code": "exceeds_capacity"}}, status_code=429,
                            headers={"x-should-retry": "false"})

    monkeypatch.setattr(resume, "RESUME_S", 4.0)  # the old code sends it again until then
    with serve_app(Starlette(routes=[Route("/v1/completions", other, methods=["POST"])])) as url:
        body = b'{"prompt": [1, 2], "stream": true, "temperature": 0, "n": 9}'
        record = resume.StreamRecord.of("POST", "/v1/completions", body, 200,
                                        httpx.Headers({"content-type": "text/event-stream"}), time.monotonic())

        async def main():
            return [x async for x in resume.finish(record, "/v1/completions", {}, lambda refused: (url, False),
                                                   lambda u: True, "http://lost")]

        out = asyncio.run(main())
    assert len(hits) == 1, hits
    assert b"exceeds_capacity" in out[-1] and b"stream_cut" not in out[-1], out[-1][:300]
