"""The orchestrator's process and HERD forwarding: defects found by the thirty-first session's hunt."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT
from test_hunt_herd_leftovers import _signal_handlers_restored  # noqa: F401 - a fixture




# A process serving with an orchestrator whose DHT join never ends; it starts a child in a session of its own as the
# DHT process does (which then starts p2pd), prints its pid, and waits.
_JOIN_FOR_EVER = textwrap.dedent("""
    import asyncio, logging, subprocess, sys, threading
    from types import SimpleNamespace
    from petals_chain.orchestrator import __main__ as cli
    from petals_chain.orchestrator import core

    class Joining:
        def __init__(self, cfg):
            self.cfg, self.model_id, self.prefix, self.dht = cfg, "m", "m", None

        def load_model(self):
            pass

        async def start(self, shared=None):
            def join():
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                         start_new_session=True)
                print("joining", child.pid, flush=True)
                threading.Event().wait(300)
            await asyncio.to_thread(join)

        async def stop(self):
            pass

    logging.basicConfig(level=logging.INFO)
    core.Orchestrator = Joining
    cfg = SimpleNamespace(host="127.0.0.1", port=0, ssl_certfile=None, ssl_keyfile=None, public_ip=None,
                          public_url=None, model="m")
    asyncio.run(cli.serve([cfg]))
    print("returned", flush=True)
""")


def test_a_second_ctrl_c_while_the_dht_node_joins_stops_at_once():
    """A second Ctrl-C while the orchestrator started (its model loading, its DHT node joining: minutes over a slow
    network) was ignored: the process waited for the join to end. Now it exits at once with 130, no traceback, its
    children (the DHT process and p2pd, in a session of their own) killed."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", _JOIN_FOR_EVER], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    child, out = None, []
    try:
        for line in proc.stdout:  # the stop handler is in place before the model loads, so before the join
            out.append(line)
            if line.startswith("joining"):
                child = psutil.Process(int(line.split()[1]))
                proc.send_signal(signal.SIGINT)
            elif "stopping once" in line:
                proc.send_signal(signal.SIGINT)
                break
        assert child is not None, "".join(out)
        try:
            rc = proc.wait(60)  # the old code waited for the join (300 s here)
        except subprocess.TimeoutExpired:
            pytest.fail("a second Ctrl-C while joining did not stop the orchestrator:\n" + "".join(out))
        out.append(proc.stdout.read())
        text = "".join(out)
        assert rc == 130 and "Traceback" not in text and "returned" not in text, (rc, text)
        assert "stopped at once" in text
        assert _gone(child, 10), f"the DHT stand-in (pid {child.pid}) outlived the orchestrator"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None:
            try:
                child.kill()
            except psutil.Error:
                pass
        proc.stdout.close()


def _gone(proc, timeout_s: float) -> bool:
    """Whether ``proc`` (a psutil process, not ours) ends, or is a zombie left to init, within ``timeout_s``."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_while_the_cli_imports_is_exit_130_without_a_traceback(monkeypatch, capsys):
    """``python -m petals_chain.orchestrator`` imported torch (placement -> planner) at the top of its module: a
    Ctrl-C in those seconds printed a traceback. Now the module imports no torch, and a Ctrl-C while main() imports
    and checks is exit 130 with one line."""
    from petals_chain.orchestrator import __main__ as cli

    code = "import sys, petals_chain.orchestrator.__main__; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["--model", "m"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted while starting"


@pytest.mark.usefixtures("_signal_handlers_restored")
def test_a_dht_node_that_cannot_join_is_an_error_message_not_a_traceback(tiny_model_dir, monkeypatch, capsys):
    """Unreachable ``--initial-peers`` (hivemind's P2PDaemonError "failed to connect to bootstrap peers") or a
    corrupt ``--identity-path`` file (protobuf's DecodeError) ended the orchestrator with a traceback. Now: exit 1,
    one line naming the peers and the identity file."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from petals_chain.orchestrator import __main__ as cli
    from petals_chain.swarm import dht

    def create(**kwargs):
        raise P2PDaemonError("Daemon failed to start: failed to connect to bootstrap peers")

    monkeypatch.setattr(dht.SwarmDHT, "create", staticmethod(create))
    peer = "/ip4/192.0.2.1/tcp/31337/p2p/QmQgdjt9iPVP9jb5szMQcYWhLoTtF3q2QV4fVCpCckwE9o"
    assert cli.main(["--model", str(tiny_model_dir), "--port", "0", "--initial-peers", peer,
                     "--identity-path", "/tmp/some-key"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"error: the DHT node could not start via ['{peer}'] with --identity-path /tmp/some-key: P2PDaemonError: "
        "Daemon failed to start: failed to connect to bootstrap peers")


def test_forwards_read_no_ca_bundle_on_the_event_loop(monkeypatch):
    """Every forwarded request made an httpx client with its own TLS context, reading and parsing the CA bundle
    (~20 ms of CPU, on the event loop, under the load that makes requests be forwarded), and the first one also
    imported httpx's transport. Now both happen once, when the group coordinator starts."""
    import ssl
    from types import SimpleNamespace as NS

    from dashboard_helpers import serve_app
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    import petals_chain.orchestrator.forward as fw

    code = ("import sys; from types import SimpleNamespace as NS; from petals_chain.orchestrator.groups import "
            "GroupCoordinator; GroupCoordinator(dht=NS(peer_id='me'), prefix='p', peers=['o'], planner=NS(), "
            "http_url=lambda: ''); print('httpcore' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "True"

    async def complete(request):
        return JSONResponse({"choices": [{"text": "there"}]})

    fw.warm_up()
    loaded = []
    real = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda self, *a, **kw: loaded.append(a) or real(self, *a, **kw))
    with serve_app(Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])) as url:
        orch = NS(dispatch=NS(chains=[], max_queue=None, queue_length=0),
                  groups=NS(me="me", forwarded=0, session_owners=fw.SessionOwners(), json=lambda: {"orchestrators": [
                      {"peer_id": "other", "http_url": url, "live": True, "servers": 3, "arrival_rate": 0.0}]}))

        def request() -> Request:
            async def receive():
                return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}
            return Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                            "headers": [(b"content-type", b"application/json")]}, receive)

        async def main():
            for _ in range(2):
                r = await fw.maybe_forward(orch, request())
                assert r is not None and r.status_code == 200 and r.headers[fw.SERVED_BY_HEADER] == url
                body = b"".join([chunk async for chunk in r.body_iterator])
                await r.background()
                assert b"there" in body
        asyncio.run(main())
    assert orch.groups.forwarded == 2 and loaded == []


def test_the_per_client_limits_say_what_a_client_is_without_api_keys():
    """``--client-max-inflight`` and ``--client-max-sessions`` said a client is its "API key, else IP"; without
    ``--api-keys`` every request is the one client ``anonymous`` (auth.py, DESIGN.md), forwarded ones too."""
    from petals_chain.orchestrator.__main__ import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "else IP" not in text and text.count("without --api-keys every request is one anonymous client") == 2


def test_an_api_key_file_that_is_not_utf8_is_an_error_message(tmp_path, capsys):
    """A binary (or Latin-1) ``--api-keys`` file ended the orchestrator with a UnicodeDecodeError traceback; now it is
    exit 2 with a line naming the file, as for the other key file errors."""
    from petals_chain.orchestrator.__main__ import main
    from petals_chain.orchestrator.auth import KeyFileError, KeyRing

    keys = tmp_path / "keys"
    keys.write_bytes(b"alice \xff\xfeabcdefghijklmnopqrstuvwxyz\n")
    with pytest.raises(KeyFileError, match="is not UTF-8 text"):
        KeyRing.from_file(keys)
    assert main(["--model", "m", "--api-keys", str(keys)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: the API key file {keys} is not UTF-8 text (invalid start byte "
                                               "at byte 6)")


@pytest.mark.parametrize("url", ["http://host:port", "http://[bad", "http://host:99999"])
def test_a_public_url_no_client_can_use_is_a_usage_error(url, capsys):
    """``--public-url http://host:port`` (a placeholder left in) passed the check and went into the group record:
    every request another orchestrator forwarded there failed (a 500, httpx's InvalidURL). Now exit 2."""
    from petals_chain.orchestrator.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "m", "--public-url", url])
    assert e.value.code == 2 and f"--public-url {url!r}: " in capsys.readouterr().err


def test_a_bad_url_in_another_orchestrators_group_record_is_served_here():
    """A group record's ``http_url`` httpx cannot parse (``http://host:port``, from an orchestrator started before
    the check above) made each forward there a 500; now the request is served here, as when that one is down."""
    from types import SimpleNamespace as NS

    from starlette.requests import Request

    import petals_chain.orchestrator.forward as fw

    # epoch 1: a split is known (a request waits for a target only before that), and that URL is never one
    orch = NS(dispatch=NS(chains=[], max_queue=None, queue_length=0),
              groups=NS(me="me", epoch=1, forwarded=0, session_owners=fw.SessionOwners(),
                        json=lambda: {"orchestrators": [{"peer_id": "other", "http_url": "http://host:port",
                                                         "live": True, "servers": 3, "arrival_rate": 0.0}]}))

    async def receive():
        return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                       "headers": [(b"content-type", b"application/json")]}, receive)
    assert asyncio.run(fw.maybe_forward(orch, request)) is None and orch.groups.forwarded == 0


def test_a_url_that_is_not_an_orchestrators_is_a_client_error():
    """A client pointed at a URL that answers with a web page (another service, a login portal) raised a bare
    JSONDecodeError from every call, and its stream() yielded nothing, as for an empty completion. Now each is a
    ClientError 502 ``bad_reply`` naming the URL and what it sent."""
    import httpx

    from petals_chain.client import Client, ClientError

    def page(request):
        return httpx.Response(200, text="<html>welcome</html>", headers={"content-type": "text/html"})

    c, bare = Client("http://portal", model="m"), Client("http://portal")  # bare: asks for the model's name
    c._https[0] = bare._https[0] = httpx.Client(base_url="http://portal", transport=httpx.MockTransport(page))
    calls = {"complete": lambda: c.complete("hi"), "stream": lambda: list(c.stream("hi")), "swarm": c.swarm,
             "session": c.session, "model": lambda: bare.model}
    for name, call in calls.items():
        with pytest.raises(ClientError) as e:
            call()
        assert (e.value.status, e.value.code) == (502, "bad_reply"), name
        assert "http://portal/" in str(e.value) and "text/html" in str(e.value), (name, str(e.value))
