"""The swarm dashboard page, shared by the orchestrator (``/``) and the standalone dashboard.

* :func:`page_html` — the single-page dashboard (HTML with its CSS and JS inlined; no CDN, no build step).
  It polls the *relative* URL ``api/v1/swarm`` (contracts E), so the same page works under the
  orchestrator at ``/`` and under the standalone dashboard.
* :func:`mount_dashboard` — adds ``GET /`` (the page) to an existing FastAPI app.
* :func:`listen_http` — the HTTP socket either role serves on, bound before anything else starts.

It lives in ``swarm/`` because two roles serve it; neither role imports the other.
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import socket
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

STATIC_PACKAGE = "petals_chain.swarm"


def _static_text(name: str) -> str:
    return resources.files(STATIC_PACKAGE).joinpath("static", name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _page_and_csp() -> tuple[str, str]:
    html = _static_text("index.html")
    css = _static_text("dashboard.css")
    js = _static_text("dashboard.js")
    if "</script" in js.lower() or "</style" in css.lower():  # would end the inline element early
        raise RuntimeError("dashboard assets must not contain closing script/style tags")
    for marker in ("<!--DASHBOARD_CSS-->", "<!--DASHBOARD_JS-->"):
        if html.count(marker) != 1:
            raise RuntimeError(f"index.html must contain {marker} exactly once")
    page = html.replace("<!--DASHBOARD_CSS-->", f"<style>{css}</style>").replace(
        "<!--DASHBOARD_JS-->", f"<script>{js}</script>"
    )

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"

    # Only our own inline script/style (by hash) may run; the page talks to its own origin only.
    csp = (
        f"default-src 'none'; script-src {digest(js)}; style-src {digest(css)}; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return page, csp


def page_html() -> str:
    """The complete dashboard page (HTML with inlined CSS and JS)."""
    return _page_and_csp()[0]


def page_headers() -> dict[str, str]:
    """HTTP headers to send with :func:`page_html` (a hash-based Content-Security-Policy, no caching)."""
    return {
        "Content-Security-Policy": _page_and_csp()[1],
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


def page_response() -> HTMLResponse:
    """The page as a FastAPI response (for apps that route it themselves)."""
    return HTMLResponse(page_html(), headers=page_headers())


def mount_dashboard(app: FastAPI, path: str = "/") -> None:
    """Serve the dashboard page at ``path`` (default ``/``) of ``app``.

    The page fetches ``api/v1/swarm`` relative to its own URL, so ``app`` must serve the contracts-E JSON
    at ``GET /api/v1/swarm`` when ``path`` is ``/`` (the orchestrator does).
    """
    if not path.startswith("/"):
        raise ValueError(f"path must start with '/', got {path!r}")
    page_html()  # fail at startup, not on the first visitor, if the assets are broken

    async def dashboard_page() -> HTMLResponse:
        return page_response()

    app.add_api_route(path, dashboard_page, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)
    if path == "/":
        app.add_api_route("/index.html", dashboard_page, methods=["GET"], include_in_schema=False,
                          response_class=HTMLResponse)


def host_arg(text: str) -> str:
    """``--host``: an address or name to bind; an IPv6 literal may be written as in a URL (``[::1]``), which the
    socket took for a host name ("Name or service not known")."""
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise argparse.ArgumentTypeError(f"not a host to listen on: {text!r}")
    return host


def url_host(host: str) -> str:
    """``host`` as written in a URL: an IPv6 literal in brackets (``http://::1:8000`` is no URL)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def local_host(host: str) -> str:
    """Where this machine reaches what listens on ``host``: the loopback address for a wildcard (``0.0.0.0``,
    ``::``: every address, itself none to open), else ``host``."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def listen_http(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket on ``host``:``port`` (an IPv6 literal: AF_INET6), for uvicorn's
    ``serve(sockets=...)``. Bound before the role joins the DHT or loads anything, so a port in use is said at
    once: OSError naming the address and the flags to change (uvicorn found it later, as its own log line)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port; a listener still refuses
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e} (give another --port or --host)"
                      ) from None
    return sock
