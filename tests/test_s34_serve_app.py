"""The threaded test HTTP server (``dashboard_helpers.serve_app``) stops when its block ends, hung handlers or not."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from dashboard_helpers import serve_app
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


def _new_threads(before: set) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


def test_a_handler_the_client_gave_up_on_is_cancelled_and_the_server_thread_ends():
    """A stand-in whose handler hangs (a client timed out on it) held uvicorn's shutdown for ever: the helper's join
    gave up after 10 s and left the server thread running. Now the handler is cancelled and the thread ends."""
    started, cancelled = threading.Event(), threading.Event()

    async def hang(request):
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return JSONResponse({})

    before = set(threading.enumerate())
    with serve_app(Starlette(routes=[Route("/hang", hang)])) as url:
        threads = _new_threads(before)
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(f"{url}/hang", timeout=httpx.Timeout(5.0, read=0.3))
        assert started.is_set()
    assert cancelled.is_set() and threads and not [t for t in threads if t.is_alive()]


def test_a_handler_that_ignores_cancellation_is_reported_as_a_leak():
    """A server thread that cannot stop (its handler swallows the cancellation) is an error, not a silent leak."""
    release, started = threading.Event(), threading.Event()

    async def stubborn(request):
        started.set()
        while not release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue  # as a handler that catches too much would
        return JSONResponse({})

    before = set(threading.enumerate())
    try:
        with pytest.raises(RuntimeError, match="did not stop"):
            with serve_app(Starlette(routes=[Route("/stubborn", stubborn)]), grace_s=0.2, stop_s=0.5) as url:
                threads = _new_threads(before)
                with pytest.raises(httpx.ReadTimeout):
                    httpx.get(f"{url}/stubborn", timeout=httpx.Timeout(5.0, read=0.3))
                assert started.is_set()
    finally:
        release.set()
    for t in threads:
        t.join(timeout=30)
    assert not [t for t in threads if t.is_alive()]
