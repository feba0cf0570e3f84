"""The Python client's read timeout on a streamed request, against small HTTP servers on loopback: an orchestrator
that is up (its ``/healthz`` answers) but sends no event within ``timeout`` is a ClientError 504 ``timeout``, as a
one-shot request's is, not a stream sent again to the next orchestrator; a hung one is passed for the next."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from petals_chain.client import Client, ClientError

TIMEOUT_S = 2.0  # long enough for the "good" orchestrator on a loaded machine
KEEPALIVE_S = 0.3  # the "keepalive" orchestrator's comments: far more often than TIMEOUT_S
LATE_S = 12.0  # when it sends its text at last: far past TIMEOUT_S


class _Orchestrator:
    """An HTTP server on loopback that plays an orchestrator: ``mode`` ``"slow"`` holds streams before their first
    event, ``"stalls"`` after one event, both answering ``/healthz``; ``"hung"`` answers nothing at all;
    ``"good"`` streams "hello" at once; ``"keepalive"`` sends only ``: keepalive`` comments (as a stream waiting in
    an orchestrator's queue gets them), every :data:`KEEPALIVE_S`, then "late" after :data:`LATE_S`, and opens
    sessions. Held requests are let go when the test ends."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.posts: list[str] = []
        self.release = threading.Event()
        orch = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if orch.mode == "hung":
                    orch.release.wait()
                    return
                self._send(200, "application/json", [json.dumps({"ok": True}).encode()])

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                orch.posts.append(self.path)
                if self.path == "/api/v1/sessions":
                    return self._send(200, "application/json",
                                      [json.dumps({"session_id": "s1", "max_length": 64}).encode()])
                if orch.mode == "keepalive":
                    return self._keepalives()
                if orch.mode in ("hung", "slow"):
                    orch.release.wait()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(_event("hel"))
                self.wfile.flush()
                if orch.mode == "stalls":
                    orch.release.wait()
                    return
                self.wfile.write(_event("lo") + b"data: [DONE]\n\n")

            def _keepalives(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                until = time.monotonic() + LATE_S
                try:
                    while time.monotonic() < until and not orch.release.wait(KEEPALIVE_S):
                        self.wfile.write(b": keepalive\n\n")
                        self.wfile.flush()
                    late = {"choices": [{"index": 0, "text": "late", "finish_reason": "length"}], "text": "late"}
                    self.wfile.write(f"data: {json.dumps(late)}\n\ndata: [DONE]\n\n".encode())
                except OSError:  # the client gave up (as it should, at its timeout)
                    pass

            def _send(self, status: int, ctype: str, body: list[bytes]) -> None:
                data = b"".join(body)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _event(text: str) -> bytes:
    return ("data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]}) + "\n\n").encode()


@pytest.fixture
def orchestrators() -> Iterator:
    started: list[_Orchestrator] = []

    def start(*modes: str) -> list[_Orchestrator]:
        started.extend(_Orchestrator(m) for m in modes)
        return started[-len(modes):]

    yield start
    for o in started:
        o.close()


def test_a_stream_with_no_event_within_the_timeout_at_an_orchestrator_that_is_up_is_a_timeout(orchestrators):
    up, other = orchestrators("slow", "good")
    client = Client([up.url, other.url], timeout=TIMEOUT_S, model="m", retry_s=0)
    got: list[str] = []
    with pytest.raises(ClientError) as e:
        for piece in client.stream("x", max_tokens=4):
            got.append(piece)
    assert e.value.status == 504 and e.value.code == "timeout" and f"{up.url} is up" in e.value.message
    assert other.posts == [], "the stream was sent again to the next orchestrator"
    assert got == [] and client.url == up.url
    client.close()


def test_a_reproducible_stream_that_stalls_mid_way_is_resumed_at_the_next(orchestrators):
    """Text already came: a stall is a stream cut off (resumed elsewhere when its output is reproducible, as
    before), not a generation that takes longer (a 504 there said the orchestrator "sent no answer": review)."""
    up, other = orchestrators("stalls", "good")
    client = Client([up.url, other.url], timeout=TIMEOUT_S, model="m", retry_s=0)
    assert "".join(client.stream("x", max_tokens=4)) == "hello"
    assert other.posts == ["/v1/completions"] and client.url == other.url
    client.close()


def test_a_stream_at_a_hung_orchestrator_goes_to_the_next(orchestrators):
    hung, good = orchestrators("hung", "good")
    client = Client([hung.url, good.url], timeout=TIMEOUT_S, model="m", retry_s=0)
    assert "".join(client.stream("x", max_tokens=4)) == "hello"
    assert hung.posts == ["/v1/completions"] and good.posts == ["/v1/completions"] and client.url == good.url
    client.close()


@pytest.mark.parametrize("call", ["stream", "session_stream"])
def test_keepalive_comments_do_not_hold_a_stream_past_its_timeout(orchestrators, call):
    """Before: each ``: keepalive`` comment (sent every 15 s while a stream waits in an orchestrator's queue) reset
    httpx's read timeout, so a stream with ``timeout=2`` waited the whole 12 s for its text here (a queued one, as
    long as it queued); now no event within ``timeout`` is the documented ClientError 504 ``timeout``."""
    (up,) = orchestrators("keepalive")
    client = Client(up.url, timeout=TIMEOUT_S, model="m", retry_s=0)
    t0 = time.monotonic()
    with pytest.raises(ClientError) as e:
        list(client.stream("x") if call == "stream" else client.session().stream("x"))
    assert e.value.status == 504 and e.value.code == "timeout" and f"{up.url} is up" in e.value.message
    assert time.monotonic() - t0 < LATE_S - 2, "it waited for the late text"
    client.close()
