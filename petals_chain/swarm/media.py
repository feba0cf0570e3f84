"""HTTP media types as both ends read them: the client and the orchestrator's stream relay (which may not import
each other). Standard library only: the client imports it."""

from __future__ import annotations

from typing import Any


def is_event_stream(headers: Any) -> bool:
    """Whether ``headers`` (any mapping with ``get``; httpx's is case-insensitive) name a Content-Type of
    ``text/event-stream``: a media type is case-insensitive and may carry parameters (a proxy in front of an
    orchestrator may send ``Text/Event-Stream; charset=UTF-8``)."""
    return (headers.get("content-type") or "").split(";", 1)[0].strip().lower() == "text/event-stream"
