"""The standalone dashboard's FastAPI app (the page itself is :mod:`petals_chain.swarm.webpage`).

* :func:`create_app` — the standalone dashboard's app: page + ``GET /api/v1/swarm`` + ``GET /healthz``
  from a callable that returns the current contracts-E view (see :mod:`petals_chain.dashboard.source`).
"""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from petals_chain.dashboard.source import ModelsNotKnownYet, SwarmNotReadYet
from petals_chain.swarm.httpedge import HeadAsGet
from petals_chain.swarm.jsonsafe import json_safe  # in swarm/: the orchestrator publishes with it too
from petals_chain.swarm.webpage import mount_dashboard, page_headers, page_html, page_response

__all__ = ["create_app", "json_safe", "mount_dashboard", "page_headers", "page_html", "page_response"]


def _model_not_found(e: LookupError) -> JSONResponse:
    """The orchestrator's answer to a ``?model=`` it does not serve (orchestrator/models.py ``ModelRouter``); a 503
    while the models served are not known yet (:class:`~petals_chain.dashboard.source.ModelsNotKnownYet`)."""
    message = str(e.args[0]) if e.args else "no such model"
    if isinstance(e, ModelsNotKnownYet):
        return JSONResponse({"error": {"message": message, "type": "server_error", "param": "model",
                                       "code": "models_not_known_yet"}}, status_code=503,
                            headers={"Retry-After": "2", "Cache-Control": "no-store"})
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": "model",
                                   "code": "model_not_found"}}, status_code=404)


def _not_read_yet(e: SwarmNotReadYet) -> JSONResponse:
    """A 503 while the swarm has not been read (the page shows the message and polls on)."""
    message = str(e.args[0]) if e.args else "the swarm has not been read yet"
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": "swarm_not_read_yet"}}, status_code=503,
                        headers={"Retry-After": "2", "Cache-Control": "no-store"})


def create_app(
    get_view: Callable[[], dict],
    health: Optional[Callable[[], tuple[bool, dict]]] = None,
    title: str = "petals-chain dashboard",
    model_view: Optional[Callable[[str], dict]] = None,
) -> FastAPI:
    """The standalone dashboard app: ``/`` (page), ``GET /api/v1/swarm`` (``get_view()``), ``GET /healthz``.

    ``health()`` returns ``(ok, details)``; ``/healthz`` answers 200 if ok else 503. ``model_view(name)``, if
    given, answers ``?model=NAME`` on the page and the API (several models; LookupError: a 404 ``model_not_found``
    with its message); without it ``?model=`` is ignored. Either raising
    :class:`~petals_chain.dashboard.source.SwarmNotReadYet` is a 503 with Retry-After on the API.
    """
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/api/v1/swarm")
    def swarm(model: Optional[str] = None) -> JSONResponse:
        try:
            view = model_view(model) if model and model_view is not None else get_view()
        except LookupError as e:
            return _model_not_found(e)
        except SwarmNotReadYet as e:
            return _not_read_yet(e)
        return JSONResponse(json_safe(view), headers={"Cache-Control": "no-store"})

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ok, details = health() if health is not None else (True, {})
        return JSONResponse({"ok": bool(ok), **json_safe(details)}, status_code=200 if ok else 503)

    if model_view is not None:
        page_html()  # fail at startup, not on the first visitor, if the assets are broken

        # the page of a model not served is a 404, as the orchestrator's (its polls would only ever get 404s)
        def page(model: Optional[str] = None):
            if model:
                try:
                    model_view(model)
                except (ModelsNotKnownYet, SwarmNotReadYet):
                    pass  # the page polls until the models are known
                except LookupError as e:
                    return _model_not_found(e)
            return page_response()

        for path in ("/", "/index.html"):
            app.add_api_route(path, page, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)
    else:
        mount_dashboard(app)
    app.add_middleware(HeadAsGet)  # HEAD / and /healthz (curl -I, uptime monitors) were 405
    return app
