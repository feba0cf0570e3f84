"""Forwarding between the orchestrators of one swarm (``--group-with``): a request this orchestrator's group cannot
take now (no chain, or the queue at ``--max-queue``) goes to another orchestrator's group instead of failing.

A forwarded request carries :data:`FORWARDED_HEADER` and is never forwarded again (no loops); its reply, streamed
or not, is passed back as the other orchestrator sent it, with :data:`SERVED_BY_HEADER` naming it. If the other
orchestrator cannot be reached, this one handles the request itself (and answers 503 or 429 as it would have).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse

from petals_chain.orchestrator.dispatch import note_admission

logger = logging.getLogger(__name__)

FORWARDED_HEADER = "x-petals-chain-forwarded-by"  # value: the peer id of the orchestrator that forwarded it
SERVED_BY_HEADER = "x-petals-chain-served-by"  # value: the URL of the orchestrator that served it
_PASSED_HEADERS = ("authorization", "content-type", "accept", "x-api-key")


def forward_target(orch: Any) -> Optional[str]:
    """The URL of the orchestrator to send a request to now, or None to handle it here: only with groups, only when
    this group has no chain or a full queue, and only to a live orchestrator whose group has servers (the most
    servers per request arriving at it first)."""
    groups = orch.groups
    if groups is None:
        return None
    dispatch = orch.dispatch
    full = dispatch.max_queue is not None and dispatch.queue_length >= dispatch.max_queue
    if dispatch.chains and not full:
        return None
    peers = [o for o in groups.json()["orchestrators"]
             if o["peer_id"] != groups.me and o["live"] and o["servers"] > 0 and o["http_url"]]
    if not peers:
        return None
    best = max(peers, key=lambda o: (o["servers"] / (o["arrival_rate"] + 0.1), o["peer_id"]))
    return best["http_url"]


async def maybe_forward(orch: Any, request: Request) -> Optional[StreamingResponse]:
    """The other orchestrator's reply to this request when :func:`forward_target` names one and it answers;
    None: handle the request here."""
    if FORWARDED_HEADER in request.headers:
        return None
    url = forward_target(orch)
    if url is None:
        return None
    headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
    headers[FORWARDED_HEADER] = orch.groups.me
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
    try:
        upstream = await client.send(client.build_request("POST", url.rstrip("/") + request.url.path,
                                                          content=await request.body(), headers=headers), stream=True)
    except httpx.TransportError as e:
        await client.aclose()
        logger.warning("could not forward %s to %s (%s): serving it here", request.url.path, url, e)
        return None
    orch.groups.forwarded += 1
    # the other orchestrator decides admission: pass its reply through as it comes (the API holds a streamed reply
    # until our dispatcher decides, which for a forwarded request it never does: the whole stream was held)
    note_admission(True)

    async def relay():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await client.aclose()

    return StreamingResponse(relay(), status_code=upstream.status_code,
                             media_type=upstream.headers.get("content-type"), headers={SERVED_BY_HEADER: url})
