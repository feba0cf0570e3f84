"""Follow-ups in the orchestrator's entry point, core, stream reruns, the DHT module, the dashboard and the client.

* ``/metrics`` had no draft-model failures: ``Stats.watch_drafter`` existed but the orchestrator never called it.
* The Python client's sessions turned a read timeout at an orchestrator that is up into 503 ``unavailable`` where
  ``Client.complete`` / ``Client.stream`` give 504 ``timeout``.
* Each rerun of a cut forwarded stream read the CA bundle on the event loop.
* A second Ctrl-C while the orchestrator started left the DHT node's temporary identity file (a private key).
* An orchestrator or dashboard whose DHT process died ran on blind for ever; SIGHUP ended them at once, their DHT
  process and p2pd left running.
* ``--records-lost-s`` and ``--draft-timeout-s``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest


def _metric(registry, name: str) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_the_orchestrators_draft_model_failures_show_in_its_metrics(tiny_model_factory, monkeypatch):
    """``petals_chain_speculative_draft_failures`` read 0 whatever the draft model did: ``load_model`` never handed
    the drafter to the statistics."""
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=64,
                                           port=0, draft_model="self"))
    drafter = SimpleNamespace(failures=0, name="self", layers=2, close=lambda: None)
    monkeypatch.setattr(orch, "_load_drafter", lambda: drafter)
    orch.load_model()
    assert orch.drafter is drafter
    assert _metric(orch.stats.registry, "petals_chain_speculative_draft_failures") == 0
    drafter.failures = 2  # two generations went on without drafts
    assert _metric(orch.stats.registry, "petals_chain_speculative_draft_failures") == 2


class _SlowOrchestrator:
    """A stand-in orchestrator on a thread: ``/healthz`` and opening a session answer at once, a session's turn after
    ``turn_s`` (longer than the client's timeout)."""

    def __init__(self, turn_s: float) -> None:
        import http.server
        import json
        import threading

        done = threading.Event()
        self.done = done

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send({"status": "ok"})

            def do_DELETE(self) -> None:
                self._send({})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path == "/api/v1/sessions":
                    return self._send({"session_id": "s1", "max_length": 64})
                done.wait(turn_s)  # the turn takes longer than the client waits (ended early at close())
                try:
                    self._send({})
                except OSError:  # the client has gone
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.done.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_a_session_turn_that_outlasts_the_timeout_of_a_live_orchestrator_is_a_504_timeout():
    """``Client(timeout=1)`` and an orchestrator that is up but answers a turn later: a one-shot request gave 504
    ``timeout`` (it would take as long anywhere) and a session's ``complete`` or ``stream`` 503 ``unavailable``."""
    from petals_chain.client import Client, ClientError

    orch = _SlowOrchestrator(turn_s=60.0)
    try:
        with Client(orch.url, timeout=1, model="m") as client:
            with pytest.raises(ClientError) as one_shot:
                client.complete("hi")
            assert (one_shot.value.status, one_shot.value.code) == (504, "timeout")
            with client.session() as s:
                with pytest.raises(ClientError) as turn:
                    s.complete("hi")
                assert (turn.value.status, turn.value.code) == (504, "timeout"), turn.value
                with pytest.raises(ClientError) as streamed:
                    list(s.stream("hi"))
                assert (streamed.value.status, streamed.value.code) == (504, "timeout"), streamed.value
    finally:
        orch.close()


def test_reruns_of_a_cut_stream_share_one_tls_context(monkeypatch):
    """Each rerun of a cut forwarded stream at another orchestrator made an httpx client with its own TLS context,
    reading and parsing the CA bundle on the event loop (~20 ms of CPU each, for every try). Now the one context the
    forwards use (``client_tls``, made once): two reruns load the bundle at most once."""
    import asyncio
    import json
    import ssl
    import time

    from dashboard_helpers import serve_app
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    import petals_chain.orchestrator.forward as fw
    import petals_chain.orchestrator.resume as rs

    def event(text: str, finish=None) -> bytes:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return f"data: {json.dumps({'id': 'c1', 'created': 1, 'choices': [choice]})}\n\n".encode()

    tries = []

    async def complete(request):
        tries.append(await request.body())
        if len(tries) == 1:  # that group has no chain yet: the rerun tries again
            return JSONResponse({"error": {"code": "no_chain", "message": "no chain"}}, status_code=503)
        return Response(event("Hi") + event("!", "length") + b"data: [DONE]\n\n", media_type="text/event-stream")

    record = rs.StreamRecord({"prompt": [1, 2], "stream": True, "temperature": 0}, time.monotonic())
    assert record.take(event("Hi")) is not None
    monkeypatch.setattr(rs, "RESUME_PAUSE_S", 0.0)
    loaded = []
    real = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda self, *a, **kw: loaded.append(a) or real(self, *a, **kw))
    with serve_app(Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])) as url:
        async def main():
            return [e async for e in rs.finish(record, "/v1/completions", {}, lambda refused: (url, False),
                                               lambda u: True, "http://lost")]
        out = asyncio.run(main())
    assert len(tries) == 2 and b'"!"' in b"".join(out) and record.finished_by == url
    assert len(loaded) <= 1, loaded
    assert getattr(fw, "client_tls", None) is getattr(rs, "client_tls", None)  # the forwards' context, the same


_STOP_WHILE_JOINING = """
import signal, sys, threading
import petals_chain.swarm.dht as d
from petals_chain.orchestrator.__main__ import _stop_now

joining = threading.Event()
class Hanging:  # the DHT process's start that never ends (an unreachable --initial-peers)
    def __init__(self, identity_path, **kw):
        print(identity_path, flush=True)
        joining.set()
        threading.Event().wait()
d._DHTProcess = Hanging
threading.Thread(target=d.SwarmDHT.create, daemon=True).start()
joining.wait()
_stop_now(signal.SIGINT)  # the second Ctrl-C while starting
"""


def test_a_stop_at_once_while_the_dht_node_starts_leaves_no_identity_file(tmp_path):
    """A second Ctrl-C while the orchestrator joined the DHT exited at once (``_stop_now``), and the node's temporary
    identity file, a private key the start deletes only once it is over, stayed in the temporary directory."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _STOP_WHILE_JOINING], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr[-3000:]
    key = proc.stdout.strip()
    assert key.startswith(str(tmp_path / "petals-chain-identity-")), proc.stdout
    assert not os.path.exists(key) and list(tmp_path.iterdir()) == []


class _FakeOrchestrator:
    """What ``orchestrator.__main__`` needs of an Orchestrator; its start runs the test's ``scenario(self)``."""

    scenario = None
    started: list = []

    def __init__(self, cfg) -> None:
        self.cfg, self.prefix, self.model_id, self.dht, self.initial_peers = cfg, "s31fake", "m", None, []
        self.http_url = self.local_url = ""
        self.stopped = False

    def load_model(self) -> None:
        pass

    async def start(self, shared=None) -> None:
        import asyncio
        import signal

        self.dht = SimpleNamespace(peer_id="fake-peer")
        _FakeOrchestrator.started.append(self)
        # a stop that did not come stops it all the same a while later (then exit 0): the test fails, not hangs
        # (the timer goes with the loop once the orchestrator has stopped)
        asyncio.get_running_loop().call_later(30, signal.raise_signal, signal.SIGTERM)
        self.scenario_task = asyncio.ensure_future(self._scenario())
        if type(self).scenario_during_start:
            await self.scenario_task

    async def _scenario(self) -> None:
        import signal

        try:
            await type(self).scenario(self)
        except BaseException:
            if not type(self).scenario_during_start:  # (else the start fails with it)
                signal.raise_signal(signal.SIGTERM)  # stopped, the test sees the failure
            raise

    async def stop(self) -> None:
        self.stopped = True


def _kill_dht_process() -> None:
    """The DHT process of this process's node dies: :func:`swarm.dht._watch_dht_process` sees its sentinel end (a
    pipe here), as for ``kill -9``."""
    import os
    import threading

    from petals_chain.swarm.dht import _watch_dht_process

    r, w = os.pipe()
    sd = SimpleNamespace(dht=SimpleNamespace(sentinel=r, pid=0), _closing=False, lost=False)
    watch = threading.Thread(target=_watch_dht_process, args=(sd,), daemon=True)
    watch.start()
    os.close(w)
    watch.join(30)
    os.close(r)
    assert sd.lost


def _run_orchestrator_main(monkeypatch, tmp_path, scenario, during_start: bool, *args: str) -> tuple[int, list]:
    """``orchestrator.__main__.main`` with stand-in orchestrators and app; signal handlers restored after."""
    import signal

    import petals_chain.orchestrator.api as api
    import petals_chain.orchestrator.core as core
    from petals_chain.orchestrator.__main__ import main

    async def app(scope, receive, send):
        pass

    monkeypatch.setattr(core, "Orchestrator", _FakeOrchestrator)
    monkeypatch.setattr(api, "create_app", lambda orch, ledger=None: app)
    monkeypatch.setattr(_FakeOrchestrator, "scenario", staticmethod(scenario), raising=False)
    monkeypatch.setattr(_FakeOrchestrator, "scenario_during_start", during_start, raising=False)
    monkeypatch.setattr(_FakeOrchestrator, "started", [])
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = main(["--model", "m", "--port", "0", "--ready-file", str(tmp_path / "ready.json"), *args])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return code, _FakeOrchestrator.started


def _scenario_ok(orch: _FakeOrchestrator) -> bool:
    """The test's scenario did not fail (it may have been cancelled as the orchestrator's loop closed)."""
    return orch.scenario_task.cancelled() or orch.scenario_task.exception() is None


async def _ready(path) -> None:
    """Wait until the orchestrator wrote its ready file (it serves from then on)."""
    import asyncio
    import time

    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, "never served"
        await asyncio.sleep(0.02)


def test_an_orchestrator_whose_dht_process_dies_stops_and_exits_1(monkeypatch, tmp_path, capsys):
    """It ran on blind (no server records read, no plan published), for ever. Now it stops, whether serving or still
    starting, says why and exits 1 for its supervisor to start it again; the callback is unregistered after."""
    import asyncio

    import petals_chain.swarm.dht as dht

    async def while_serving(orch):
        await _ready(tmp_path / "ready.json")
        await asyncio.to_thread(_kill_dht_process)

    code, started = _run_orchestrator_main(monkeypatch, tmp_path, while_serving, during_start=False)
    assert _scenario_ok(started[0])
    assert code == 1 and [o.stopped for o in started] == [True]
    assert "the orchestrator's DHT process died" in capsys.readouterr().err and dht._on_lost is None

    async def while_starting(orch):
        await asyncio.to_thread(_kill_dht_process)

    (tmp_path / "ready.json").unlink(missing_ok=True)
    code, started = _run_orchestrator_main(monkeypatch, tmp_path, while_starting, during_start=True)
    assert code == 1 and [o.stopped for o in started] == [True] and not (tmp_path / "ready.json").exists()
    assert "the orchestrator's DHT process died" in capsys.readouterr().err and dht._on_lost is None


def test_sighup_stops_the_orchestrator_as_sigterm_does_unless_nohup(monkeypatch, tmp_path, capsys):
    """SIGHUP (its terminal closed) ended the orchestrator at once, its DHT process and p2pd left running: it now
    stops as on SIGTERM (exit 0). Under ``nohup`` (SIGHUP ignored) it is still ignored."""
    import asyncio
    import signal

    async def hang_up(orch):
        await _ready(tmp_path / "ready.json")
        # a handler of ours, not SIGHUP's default (which would end the test run itself)
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)
        signal.raise_signal(signal.SIGHUP)

    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        code, started = _run_orchestrator_main(monkeypatch, tmp_path, hang_up, during_start=False)
        assert code == 0 and [o.stopped for o in started] == [True] and _scenario_ok(started[0])

        async def nohup(orch):
            await _ready(tmp_path / "ready.json")
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # left alone
            await asyncio.sleep(0)
            signal.raise_signal(signal.SIGTERM)

        (tmp_path / "ready.json").unlink(missing_ok=True)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        code, started = _run_orchestrator_main(monkeypatch, tmp_path, nohup, during_start=False)
        assert code == 0 and [o.stopped for o in started] == [True] and _scenario_ok(started[0])
    finally:
        signal.signal(signal.SIGHUP, before)


def _dashboard_serving(action, failures: list):
    """Run ``dashboard.__main__._serve`` with a tiny app on a free port; once it answers, ``action()`` in a thread
    (an AssertionError is put in ``failures`` and SIGTERM stops the dashboard). Returns ``_serve``'s result."""
    import contextlib
    import os
    import signal
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from petals_chain.dashboard import __main__ as dash

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    done = threading.Event()

    def when_serving(url: str) -> None:
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            done.wait(0.05)
        else:
            return
        try:
            action()
        except AssertionError as e:
            failures.append(e)
            os.kill(os.getpid(), signal.SIGTERM)  # the dashboard's own handler (checked above it)

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, dash._interrupt)  # as main() installs it
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            helper = threading.Thread(target=when_serving, args=(f"http://127.0.0.1:{sock.getsockname()[1]}/",))
            helper.start()
            try:
                return dash._serve(uvicorn, app, sock, *action.serve_args)
            finally:
                done.set()
                helper.join()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_dashboard_whose_dht_process_dies_stops():
    """The dashboard's page went stale for ever once its DHT process died, the process running on. Its ``_serve`` now
    stops and says so (``_run`` then exits 1), also for a DHT process that died before serving began."""
    import petals_chain.swarm.dht as dht

    def kill():
        _kill_dht_process()

    failures: list = []
    kill.serve_args = (SimpleNamespace(lost=False),)
    assert _dashboard_serving(kill, failures) is True and not failures and dht._on_lost is None

    def nothing():  # it stops by itself at once
        pass

    nothing.serve_args = (SimpleNamespace(lost=True),)
    assert _dashboard_serving(nothing, failures) is True and not failures and dht._on_lost is None


def test_sighup_stops_the_dashboard_unless_nohup():
    import signal

    def hang_up():
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)  # else it ends the test run
        signal.raise_signal(signal.SIGHUP)

    def nohup():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.raise_signal(signal.SIGTERM)

    failures: list = []
    before = signal.getsignal(signal.SIGHUP)
    try:
        for action, handler in ((hang_up, signal.SIG_DFL), (nohup, signal.SIG_IGN)):
            signal.signal(signal.SIGHUP, handler)
            action.serve_args = ()
            assert _dashboard_serving(action, failures) is False and not failures
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.parametrize("args", [["--records-lost-s", "-1"], ["--records-lost-s", "nan"], ["--records-lost-s", "inf"],
                                  ["--records-lost-s", "x"], ["--draft-timeout-s", "0"],
                                  ["--draft-timeout-s", "nan"], ["--draft-timeout-s", "inf"],
                                  ["--draft-timeout-s", "5"]])  # without a draft model
def test_bad_records_lost_and_draft_timeouts_are_usage_errors(args, capsys):
    from petals_chain.orchestrator.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "m", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and args[0] in err and "unrecognized" not in err, err


def test_records_lost_and_draft_timeout_flags_reach_the_orchestrator(monkeypatch, tmp_path):
    """``--records-lost-s`` (the planner's ``records_lost_s``, for servers with a larger ``--refresh-s``) and
    ``--draft-timeout-s`` (``DraftModel.timeout_s``) had no flag; the defaults stay 90 and 10 s."""
    import signal

    from petals_chain.orchestrator.core import OrchestratorConfig
    from petals_chain.orchestrator.drafting import DRAFT_TIMEOUT_S
    from petals_chain.orchestrator.planner import SERVER_RECORD_TTL_S

    async def stop(orch):
        signal.raise_signal(signal.SIGTERM)

    code, started = _run_orchestrator_main(monkeypatch, tmp_path, stop, False, "--records-lost-s", "270",
                                           "--draft-model", "self", "--draft-timeout-s", "2.5")
    assert code == 0 and (started[0].cfg.records_lost_s, started[0].cfg.draft_timeout_s) == (270.0, 2.5)
    (tmp_path / "ready.json").unlink(missing_ok=True)
    code, started = _run_orchestrator_main(monkeypatch, tmp_path, stop, False, "--records-lost-s", "0")
    assert code == 0 and started[0].cfg.records_lost_s == 0  # 0: an empty read is everyone leaving, at once
    assert (OrchestratorConfig(model="m").records_lost_s, OrchestratorConfig(model="m").draft_timeout_s) == \
        (SERVER_RECORD_TTL_S, DRAFT_TIMEOUT_S) == (90.0, 10.0)


def test_the_orchestrator_gives_its_planner_and_draft_model_the_configured_times(tiny_model_factory, monkeypatch):
    import asyncio

    import petals_chain.orchestrator.core as core

    orch = core.Orchestrator(core.OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)),
                                                     max_length=64, port=0, draft_model="self", draft_timeout_s=2.5,
                                                     records_lost_s=270.0))
    with pytest.raises(ValueError, match="--records-lost-s"):
        core.Orchestrator(core.OrchestratorConfig(model=orch.cfg.model, records_lost_s=float("nan")))
    with pytest.raises(ValueError, match="--draft-timeout-s"):
        core.Orchestrator(core.OrchestratorConfig(model=orch.cfg.model, draft_timeout_s=0.0))
    orch.load_model()
    try:
        assert orch.drafter.timeout_s == 2.5
        planned = {}

        class Planned(Exception):
            pass

        def planner(**kwargs):
            planned.update(kwargs)
            raise Planned

        async def replicate_p2p():
            return SimpleNamespace()

        monkeypatch.setattr(core, "Planner", planner)
        shared = SimpleNamespace(dht=SimpleNamespace(replicate_p2p=replicate_p2p))  # another model's DHT node
        with pytest.raises(Planned):
            asyncio.run(orch.start(shared=shared))
        assert planned["records_lost_s"] == 270.0
    finally:
        orch.drafter.close()


def test_the_orchestrator_hashes_its_weights_while_loading_not_on_the_event_loop(tiny_model_factory):
    """The full-byte fingerprint was first computed in ``start()``, on the event loop (with several models, one
    model's hash stalled the others' planners and the starting-phase signal handler): ``load_model`` (run in a
    thread) computes it now."""
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=64, port=0))
    vars(orch.source).pop("fingerprint", None)  # sources are shared by path: another test may have computed it
    orch.load_model()
    assert "fingerprint" in vars(orch.source)  # functools.cached_property: computed
