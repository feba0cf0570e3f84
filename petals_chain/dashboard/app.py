"""The standalone dashboard's FastAPI app (the page itself is :mod:`petals_chain.swarm.webpage`).

* :func:`create_app` — the standalone dashboard's app: page + ``GET /api/v1/swarm`` + ``GET /healthz``
  from a callable that returns the current contracts-E view (see :mod:`petals_chain.dashboard.source`).
"""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from petals_chain.swarm.jsonsafe import json_safe  # in swarm/: the orchestrator publishes with it too
from petals_chain.swarm.webpage import mount_dashboard, page_headers, page_html, page_response

__all__ = ["create_app", "json_safe", "mount_dashboard", "page_headers", "page_html", "page_response"]


def create_app(
    get_view: Callable[[], dict],
    health: Optional[Callable[[], tuple[bool, dict]]] = None,
    title: str = "petals-chain dashboard",
) -> FastAPI:
    """The standalone dashboard app: ``/`` (page), ``GET /api/v1/swarm`` (``get_view()``), ``GET /healthz``.

    ``health()`` returns ``(ok, details)``; ``/healthz`` answers 200 if ok else 503.
    """
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/api/v1/swarm")
    def swarm() -> JSONResponse:
        return JSONResponse(json_safe(get_view()), headers={"Cache-Control": "no-store"})

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ok, details = health() if health is not None else (True, {})
        return JSONResponse({"ok": bool(ok), **json_safe(details)}, status_code=200 if ok else 503)

    mount_dashboard(app)
    return app
