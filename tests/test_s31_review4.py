"""Review of the orchestrator's process, the Python client, the DHT watch and forwarding (thirty-first session).

* The client refused an event stream whose Content-Type a proxy wrote in another case (``Text/Event-Stream``): a
  media type is case-insensitive. The forward's relay and resume read such a stream as plain bytes (not resumable).
* Another orchestrator's group record naming a URL no request can go to (``http://host:port``, a port out of range:
  from an orchestrator started before ``--public-url`` was checked) stayed the forward target: a warning for each
  request served here instead, a 500 for a port out of range, a cut stream's rerun there ended without an error
  event, and another live orchestrator that could serve was passed over. ``--public-url`` with port 0 was taken.
* A process leaving without shutting its SwarmDHT down logged "the DHT process exited unexpectedly" (an ERROR) at
  exit, as multiprocessing ended that process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace as NS

import httpx
import pytest

_SSE = (b'data: {"choices": [{"text": "Hi", "index": 0, "finish_reason": null}]}\n\n'
        b'data: {"choices": [{"text": "!", "index": 0, "finish_reason": "length"}]}\n\ndata: [DONE]\n\n')
_SESSION_SSE = (b'data: {"text": "Hi", "token_ids": [1]}\n\n'
                b'data: {"text": "!", "token_ids": [2], "finish_reason": "length", "usage": {}}\n\ndata: [DONE]\n\n')


@pytest.mark.parametrize("kind", ["Text/Event-Stream", "TEXT/EVENT-STREAM;charset=UTF-8",
                                  "text/event-stream; charset=utf-8", None])
def test_the_client_reads_an_event_stream_whatever_the_case_of_its_content_type(kind):
    """A proxy in front of the orchestrator that sends ``Text/Event-Stream`` (media types are case-insensitive) made
    every stream a ClientError 502 ``bad_reply``; a stream without a Content-Type is read as before."""
    from petals_chain.client import Client

    def reply(request: httpx.Request) -> httpx.Response:
        headers = {} if kind is None else {"content-type": kind}
        if request.url.path == "/api/v1/sessions":
            return httpx.Response(200, json={"session_id": "s1", "max_length": 64})
        if request.method == "DELETE":
            return httpx.Response(200, json={})
        return httpx.Response(200, content=_SESSION_SSE if "/sessions/" in request.url.path else _SSE,
                              headers=headers)

    with Client("http://proxy", model="m") as c:
        c._https[0] = httpx.Client(base_url="http://proxy", transport=httpx.MockTransport(reply))
        assert list(c.stream("hi")) == ["Hi", "!"]
        with c.session() as s:
            assert list(s.stream("hi")) == ["Hi", "!"] and s.last.token_ids == [1, 2]


def test_the_client_still_refuses_a_reply_that_is_not_an_event_stream():
    from petals_chain.client import Client, ClientError

    def page(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_SSE, headers={"content-type": "Text/HTML"})

    with Client("http://portal", model="m") as c:
        c._https[0] = httpx.Client(base_url="http://portal", transport=httpx.MockTransport(page))
        with pytest.raises(ClientError) as e:
            list(c.stream("hi"))
        assert (e.value.status, e.value.code) == (502, "bad_reply")


def test_a_forwarded_stream_is_resumable_whatever_the_case_of_its_content_type():
    """The relay took a completion stream another orchestrator (behind a proxy) sent as ``Text/Event-Stream`` for
    plain bytes: a cut was not finished elsewhere and did not end with an error event."""
    from petals_chain.orchestrator.resume import StreamRecord

    body = json.dumps({"prompt": [1, 2], "stream": True, "temperature": 0}).encode()
    for kind in ("Text/Event-Stream; charset=UTF-8", "text/event-stream"):
        record = StreamRecord.of("POST", "/v1/completions", body, 200, httpx.Headers({"content-type": kind}),
                                 time.monotonic())
        assert record is not None, kind
    assert StreamRecord.of("POST", "/v1/completions", body, 200, httpx.Headers({"content-type": "text/plain"}),
                           time.monotonic()) is None


def _orch(peers: list[dict]) -> NS:
    """What forward.py reads of an orchestrator with groups: no chain here, these other orchestrators."""
    import petals_chain.orchestrator.forward as fw

    return NS(dispatch=NS(chains=[], max_queue=None, queue_length=0),
              groups=NS(me="me", epoch=1, forwarded=0, session_owners=fw.SessionOwners(),
                        json=lambda: {"orchestrators": peers}))


def _peer(peer_id: str, url: str, servers: int) -> dict:
    return {"peer_id": peer_id, "http_url": url, "live": True, "servers": servers, "arrival_rate": 0.0}


@pytest.mark.parametrize("bad", ["http://host:port", "http://127.0.0.1:99999", "ftp://o:8000"])
def test_an_orchestrator_whose_url_cannot_be_used_is_no_forward_target(bad, caplog):
    """A rival whose group record names a URL no request can go to (the most servers, so the best target) took
    every forward and rerun: each request was served here after a warning (``http://host:port``), or was a 500
    (port 99999: an ExceptionGroup out of the connect), while another live orchestrator could serve it. Now such a
    URL is never a target, and it is warned about once."""
    from dashboard_helpers import serve_app
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    import petals_chain.orchestrator.forward as fw

    if hasattr(fw, "_usable_url"):  # warned about once per URL: from this test's first look on
        fw._usable_url.cache_clear()
    caplog.set_level(logging.WARNING, logger=fw.logger.name)
    assert fw._best_peer(_orch([_peer("bad", bad, 9)])) is None
    assert fw._best_peer(_orch([_peer("bad", bad, 9), _peer("ok", "http://127.0.0.1:1", 1)])) == "http://127.0.0.1:1"

    async def complete(request):
        return JSONResponse({"choices": [{"text": "there"}]})

    def request() -> Request:
        async def receive():
            return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                        "headers": [(b"content-type", b"application/json")]}, receive)

    with serve_app(Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])) as url:
        orch = _orch([_peer("bad", bad, 9), _peer("ok", url, 1)])

        async def main():
            for _ in range(3):
                r = await fw.maybe_forward(orch, request())
                assert r is not None and r.headers[fw.SERVED_BY_HEADER] == url
                assert b"there" in b"".join([chunk async for chunk in r.body_iterator])
                await r.background()
        asyncio.run(main())
    assert orch.groups.forwarded == 3
    warned = [r for r in caplog.records if r.name == fw.logger.name and bad in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]


_EXIT_WITH_A_NODE = """
import multiprocessing, threading, time
from types import SimpleNamespace
import petals_chain.swarm.dht as d

if __name__ == "__main__":
    dht = multiprocessing.Process(target=time.sleep, args=(300,), daemon=True)  # a DHT process (hivemind's: daemon)
    dht.start()
    sd = SimpleNamespace(dht=dht, _closing=False, lost=False)
    threading.Thread(target=d._watch_dht_process, args=(sd,), daemon=True).start()
    print("exiting without shutdown()", flush=True)
"""


def test_a_process_that_exits_without_stopping_its_node_logs_no_lost_dht_process(tmp_path):
    """A process leaving with a SwarmDHT it did not shut down (a script, a test session, a role's error path): at
    exit multiprocessing ends the DHT process, and the watch thread logged "the DHT process exited unexpectedly"
    (an ERROR) after whatever really happened."""
    import os
    import subprocess
    import sys

    from conftest import REPO_ROOT

    script = tmp_path / "exit_with_a_node.py"
    script.write_text(_EXIT_WITH_A_NODE)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0 and "exiting without shutdown()" in proc.stdout, proc.stderr[-3000:]
    assert "exited unexpectedly" not in proc.stderr, proc.stderr[-3000:]


def test_a_public_url_with_port_0_is_a_usage_error(capsys):
    """``--public-url http://host:0`` passed the port check and went into the group record, a URL the other
    orchestrators never forward to: exit 2 now, as for the other ports no client can use."""
    from petals_chain.orchestrator.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "m", "--public-url", "http://host:0/"])
    assert e.value.code == 2 and "--public-url 'http://host:0/': port 0" in capsys.readouterr().err
