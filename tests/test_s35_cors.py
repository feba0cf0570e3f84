"""``--cors-origins``: a web page of another origin calls the API from a browser. Without it, a preflight was a 401
(with keys) or 405 and no reply carried an allow header, so a page could not call the API at all. One real
orchestrator process (a tiny model, no servers: the preflight and the API's own replies need no chain)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]  # the orchestrator process runs this checkout's code
KEY = "bob-secret-0123456789ab"
PAGE = "https://app.example"


def _orchestrator(model: Path, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    ready = tmp_path / "ready.json"
    keys = tmp_path / "keys"
    keys.write_text(f"bob {KEY}\n")
    log = open(tmp_path / "orch.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "petals_chain.orchestrator", "--model", str(model), "--port", "0",
                             "--host", "127.0.0.1", "--ready-file", str(ready), "--api-keys", str(keys), *args],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"the orchestrator did not start:\n{(tmp_path / 'orch.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["http_url"]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:  # its DHT process and p2pd run in its session's groups: none outlives the test
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=10)


def test_a_page_of_a_listed_origin_calls_the_api_and_others_do_not(tiny_model_factory, tmp_path):
    """A listed origin's preflight is answered 200 without a key (methods, the headers the openai package sends,
    the origin allowed, no credentials); its POST's reply (an error's too) carries the allow header and exposes
    ``x-request-id``, ``retry-after`` and ``x-should-retry``. An origin not listed gets no allow header."""
    proc, url = _orchestrator(tiny_model_factory("llama", num_layers=2), tmp_path, "--cors-origins",
                              f"{PAGE}, http://localhost:3000/")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            asked = {"Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type, x-request-id"}
            pre = c.options("/v1/responses", headers={"Origin": PAGE, **asked})
            pre_local = c.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000", **asked})
            post = c.post("/v1/responses", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"},
                          json={"model": "nope", "input": "hi"})
            other_pre = c.options("/v1/responses", headers={"Origin": "https://evil.example", **asked})
            other = c.post("/v1/responses", json={"model": "nope", "input": "hi"},
                           headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
            keyless = c.get("/v1/models", headers={"Origin": PAGE})
    finally:
        _stop(proc)
    assert pre.status_code == 200 and pre_local.status_code == 200, (pre.text, pre_local.text)
    assert pre.headers["access-control-allow-origin"] == PAGE
    assert pre_local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert {"GET", "POST", "DELETE", "OPTIONS"} <= set(pre.headers["access-control-allow-methods"].split(", "))
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-request-id"} <= allowed
    assert "access-control-allow-credentials" not in pre.headers
    assert post.status_code == 404 and post.json()["error"]["code"] == "model_not_found"  # the API answered
    assert post.headers["access-control-allow-origin"] == PAGE and post.headers["x-request-id"]
    exposed = {h.strip() for h in post.headers["access-control-expose-headers"].split(",")}
    assert exposed == {"x-request-id", "retry-after", "x-should-retry"}
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == PAGE  # readable
    assert "access-control-allow-origin" not in other_pre.headers and other_pre.status_code == 400
    assert "access-control-allow-origin" not in other.headers and other.status_code == 404


def test_an_origin_a_browser_never_sends_is_refused_naming_it():
    """``--cors-origins`` takes what a browser sends as ``Origin`` (a trailing slash dropped); a path or no scheme
    would never match, silently: refused naming it."""
    from petals_chain.orchestrator.api import cors_origins

    assert cors_origins("https://a.example/, http://[::1]:8080,*") == ["https://a.example", "http://[::1]:8080", "*"]
    # a browser leaves its scheme's default port out of Origin: given with it, the origin never matched
    assert cors_origins("https://A.example:443,http://b.example:80,https://c.example:4433") == [
        "https://a.example", "http://b.example", "https://c.example:4433"]
    for bad in ("https://a.example/app", "a.example", "", "ftp://a.example"):
        with pytest.raises(ValueError, match="origin"):
            cors_origins(bad)


def test_a_preflight_with_the_headers_of_openais_javascript_package_is_answered():
    """The openai package for JavaScript (``dangerouslyAllowBrowser``) sends its own headers (``x-stainless-os``,
    ``-lang``, ``-retry-count``, ...): their preflight was a 400 "Disallowed CORS headers" (a fixed list of allowed
    headers), so a page using that package could not call the API at all; now each is allowed, still without
    credentials. In this process (the middleware over a bare app)."""
    import asyncio

    from petals_chain.orchestrator.api import cors_origins, with_cors

    async def app(scope, receive, send):  # the API behind: never reached by a preflight
        raise AssertionError(f"the preflight reached the app: {scope['method']} {scope['path']}")

    asked = ("authorization, content-type, x-stainless-lang, x-stainless-package-version, x-stainless-os, "
             "x-stainless-arch, x-stainless-runtime, x-stainless-runtime-version, x-stainless-retry-count, "
             "x-stainless-timeout, openai-organization, openai-project")

    async def main():
        transport = httpx.ASGITransport(app=with_cors(app, cors_origins(PAGE)))
        async with httpx.AsyncClient(transport=transport, base_url="http://orch") as c:
            return await c.options("/v1/responses", headers={
                "Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked})

    pre = asyncio.run(main())
    assert pre.status_code == 200, pre.text
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in asked.split(",")} <= allowed
    assert pre.headers["access-control-allow-origin"] == PAGE and "access-control-allow-credentials" not in pre.headers
