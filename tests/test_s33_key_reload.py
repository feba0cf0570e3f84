"""The ``--api-keys`` file is reloaded when it changes, without a restart (auth.KeyFile): new keys work, removed ones
get 401 and their sessions close, changed limits apply to the next request; a bad edit or a file gone keeps the
old keys and is logged once. The command line reads the file once and shares it among every model's API."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from types import SimpleNamespace

import httpx
import pytest

from petals_chain.orchestrator import auth

A, B, C = "a" * 20, "b" * 20, "c" * 20
OLD_NS = 1_000_000_000 * 1_000_000_000  # a modification time long past (2001): not "just modified"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _write(path, text: str, mode: int = 0o600, mtime_ns: int | None = None):
    path.write_text(text)
    os.chmod(path, mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def _replace(path, text: str, mtime_ns: int | None = None) -> None:
    """An editor's save: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    _write(tmp, text, mtime_ns=mtime_ns)
    os.replace(tmp, path)


def _scope(key: str) -> dict:
    return {"headers": [(b"authorization", f"Bearer {key}".encode())]}


def _records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == auth.__name__ and r.levelno == level]


def test_an_edit_is_loaded_at_the_next_poll_and_logged_by_name(tmp_path, caplog):
    from petals_chain.orchestrator.limits import LimitsConfig, client_of

    path = _write(tmp_path / "keys", f"alice {A} max_concurrent=2\nbob {B}\n")
    clock = Clock()
    keys = auth.KeyFile(path, reload_s=2.0, clock=clock)
    limits = LimitsConfig(keys=keys)
    assert client_of(_scope(A), keys) == "alice" and limits.inflight_limit("alice") == 2
    _write(path, f"alice {A} max_concurrent=5\ncarol {C}\n")
    with caplog.at_level(logging.INFO, logger=auth.__name__):
        assert client_of(_scope(C), keys) is None  # not due yet: polled every reload_s, not at every request
        clock.t += 2.0
        assert client_of(_scope(C), keys) == "carol"  # added: works at once
        assert client_of(_scope(B), keys) is None  # removed: its next request is refused
        assert limits.inflight_limit("alice") == 5 and len(keys) == 2  # changed limits: the next request's
        clock.t += 2.0
        assert not keys.poll_if_due()  # nothing changed since: nothing logged again
        os.utime(path)  # touched, same text: no reload
        clock.t += 2.0
        assert not keys.poll_if_due()
    lines = _records(caplog, logging.INFO)
    assert lines == [f"API keys reloaded from {path}: 2 keys (+carol, -bob, ~alice)"]
    assert not any(k in caplog.text for k in (A, B, C))  # names only, never keys
    assert (keys.reloads, keys.failures) == (1, 0)


def test_a_bad_edit_keeps_the_old_keys_and_is_logged_once_per_change(tmp_path, caplog):
    path = _write(tmp_path / "keys", f"alice {A}\n")
    keys = auth.KeyFile(path, reload_s=1.0, clock=Clock())
    with caplog.at_level(logging.INFO, logger=auth.__name__):
        _write(path, f"alice {A}\nbob short\n")
        for _ in range(5):  # polled again and again: said once
            assert not keys.poll()
        assert keys.lookup(A).name == "alice" and keys.lookup(B) is None
        errors = _records(caplog, logging.ERROR)
        assert len(errors) == 1 and f"{path}:2" in errors[0] and "shorter than 16" in errors[0]
        assert "keeping the 1 API keys loaded before" in errors[0]
        _write(path, f"alice {A}\nbob {B} max_sessions=0\n")  # another bad version: said again, once
        keys.poll()
        keys.poll()
        assert len(_records(caplog, logging.ERROR)) == 2
        _write(path, f"alice {A}\nbob {B}\n")  # fixed
        assert keys.poll() and keys.lookup(B).name == "bob"
    assert (keys.reloads, keys.failures) == (1, 2)


def test_a_rename_over_the_file_is_picked_up_and_a_vanished_file_keeps_the_keys(tmp_path, caplog):
    """An editor's replace-by-rename: same size, same time, only the inode differs; and one that deletes first."""
    path = _write(tmp_path / "keys", f"alice {A}\n", mtime_ns=OLD_NS)
    keys = auth.KeyFile(path, reload_s=1.0, clock=Clock())
    _replace(path, f"bobby {B}\n", mtime_ns=OLD_NS)
    assert keys.poll() and keys.lookup(B).name == "bobby" and keys.lookup(A) is None
    with caplog.at_level(logging.INFO, logger=auth.__name__):
        path.unlink()
        assert not keys.poll() and not keys.poll()
        assert keys.lookup(B).name == "bobby"
        errors = _records(caplog, logging.ERROR)
        assert len(errors) == 1 and "cannot be read" in errors[0] and "keeping the 1 API keys" in errors[0]
        _write(path, f"bobby {B}\n")  # back: read again (the same keys)
        keys.poll()
    assert _records(caplog, logging.INFO) == [f"API keys reloaded from {path}: 1 keys (no key changed)"]
    assert (keys.reloads, keys.failures) == (2, 1)


def test_reload_interval_zero_and_a_pipe_are_read_once(tmp_path):
    path = _write(tmp_path / "keys", f"alice {A}\n")
    keys = auth.KeyFile(path, reload_s=0, clock=Clock())
    _write(path, f"bob {B}\n")
    assert not keys.watching and not keys.poll() and keys.lookup(A).name == "alice"
    r, w = os.pipe()
    try:
        os.write(w, f"alice {A}\n".encode())
        os.close(w)
        w = -1
        piped = auth.KeyFile(f"/dev/fd/{r}", reload_s=1.0, clock=Clock())
        assert not piped.watching and not piped.poll() and piped.lookup(A).name == "alice"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_watch_reloads_an_idle_orchestrators_keys(tmp_path):
    """Without a request (no look-up polls), the watch loop the command line runs reloads the edit."""
    path = _write(tmp_path / "keys", f"alice {A}\n")
    keys = auth.KeyFile(path, reload_s=0.05)

    async def main():
        task = asyncio.ensure_future(keys.watch())
        try:
            _replace(path, f"bob {B}\n")
            deadline = time.monotonic() + 10
            while keys.reloads == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return keys.reloads

    assert asyncio.run(main()) == 1 and keys.lookup(B).name == "bob"


def test_a_key_file_its_group_may_write_is_warned_about(tmp_path, monkeypatch, caplog):
    """A group member can add a key of their own: warned as for other users (group-readable alone is not)."""
    monkeypatch.setattr(auth, "_warned", set())
    path = _write(tmp_path / "keys", f"alice {A}\n", mode=0o620)
    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        auth.KeyRing.from_file(path)
    assert f"(mode 0620) lets members of its group write it: chmod 600 {path}" in caplog.text
    caplog.clear()
    os.chmod(path, 0o664)
    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        auth.KeyRing.from_file(path)
    assert "lets other users of this host read it and members of its group write it" in caplog.text


def test_a_removed_keys_sessions_close_once_their_turn_ends(tmp_path):
    """A removed key's session waits for its running turn, then is closed; metrics count the reload."""
    from prometheus_client import CollectorRegistry, generate_latest

    from petals_chain.orchestrator.limits import AdmissionLimits, LimitsConfig

    path = _write(tmp_path / "keys", f"alice {A}\nbob {B}\n")
    keys = auth.KeyFile(path, reload_s=1.0, clock=Clock())

    class Session:
        def __init__(self) -> None:
            self.lock = asyncio.Lock()

        async def wait_turn_end(self, timeout: float) -> bool:
            try:
                await asyncio.wait_for(self.lock.acquire(), timeout)
            except asyncio.TimeoutError:
                return False
            self.lock.release()
            return True

    async def main():
        closed: list[str] = []
        orch = SimpleNamespace(sessions={"s1": Session(), "s2": Session()},
                               stats=SimpleNamespace(registry=CollectorRegistry()))

        async def close_session(sid):
            orch.sessions.pop(sid)
            closed.append(sid)

        orch.close_session = close_session
        lim = AdmissionLimits(None, orch, LimitsConfig(keys=keys))
        lim.sessions_of.update({"alice": {"s1"}, "bob": {"s2"}})
        await orch.sessions["s1"].lock.acquire()  # alice's turn is running
        _write(path, f"bob {B}\n")
        assert keys.poll()
        await asyncio.sleep(0.05)
        assert closed == []  # the running turn finishes first
        orch.sessions["s1"].lock.release()
        for _ in range(200):
            if closed:
                break
            await asyncio.sleep(0.01)
        return closed, lim.snapshot(), generate_latest(orch.stats.registry).decode()

    closed, snap, metrics = asyncio.run(main())
    assert closed == ["s1"]  # bob's stays
    assert snap["api_keys"] == 1 and snap["api_keys_reloads"] == 1 and snap["api_keys_reload_failures"] == 0
    assert 'petals_chain_api_key_reloads_total{outcome="loaded"} 1.0' in metrics
    assert "petals_chain_api_keys 1.0" in metrics


def test_the_command_line_reads_the_key_file_once_for_every_model(tiny_model_dir, tiny_model_factory, tmp_path,
                                                                  monkeypatch, capsys):
    """``--api-keys <(...)`` with two models: read once, at start, and the same reloading ring handed to both."""
    import petals_chain.orchestrator.__main__ as cli

    seen = {}

    async def fake_serve(cfgs, *args, **kwargs):
        seen["rings"] = [c.api_key_ring for c in cfgs]

    monkeypatch.setattr(cli, "serve", fake_serve)
    m, m2 = str(tiny_model_dir), str(tiny_model_factory("llama", num_layers=2))  # two models: two DHT prefixes
    r, w = os.pipe()
    try:
        os.write(w, f"alice {A}\n".encode())
        os.close(w)
        w = -1
        assert cli.main(["--model", f"a={m}", "--model", f"b={m2}", "--api-keys", f"/dev/fd/{r}"]) == 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    rings = seen["rings"]
    assert len(rings) == 2 and rings[0] is rings[1] and rings[0].lookup(A).name == "alice"
    assert not rings[0].watching  # a pipe: read once
    assert "API keys: 1 from /dev/fd/" in capsys.readouterr().out
    path = _write(tmp_path / "keys", f"alice {A}\n")
    assert cli.main(["--model", m, "--api-keys", str(path), "--api-keys-reload-s", "0.5"]) == 0
    assert seen["rings"][0].watching and seen["rings"][0].reload_s == 0.5
    assert f"API keys: 1 from {path} (reloaded when it changes: checked every 0.5 s)" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--api-keys-reload-s", "-1"], "expected a finite number of seconds >= 0, got -1"),
    (["--api-keys-reload-s", "nan"], "expected a finite number of seconds >= 0, got nan"),
    (["--api-keys-reload-s", "1"], "--api-keys-reload-s needs --api-keys"),
])
def test_bad_reload_intervals_are_usage_errors(tiny_model_dir, capsys, args, message):
    from petals_chain.orchestrator.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_model_dir), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_through_the_api_an_added_key_works_and_a_removed_one_gets_401(tiny_model_dir, tmp_path):
    """An orchestrator's API (no servers): the file edited as an editor saves it; within a few seconds the new key
    is served, the removed one refused, its session closed, and the changed limit applies."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    path = _write(tmp_path / "keys", f"alice {A}\nbob {B} max_sessions=5\n")

    def auth_header(key: str) -> dict:
        return {"authorization": f"Bearer {key}"}

    async def main():
        cfg = OrchestratorConfig(model=str(tiny_model_dir), max_length=64, port=0, api_keys=str(path))
        cfg.api_keys_reload_s = 0.1
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        try:
            transport = httpx.ASGITransport(app=create_app(orch))
            async with httpx.AsyncClient(transport=transport, base_url="http://orch") as c:
                assert (await c.get("/v1/models", headers=auth_header(C))).status_code == 401
                r = await c.post("/api/v1/sessions", json={}, headers=auth_header(A))
                assert r.status_code == 200, r.text
                assert len(orch.sessions) == 1
                _replace(path, f"bob {B} max_sessions=1\ncarol {C}\n")
                deadline = time.monotonic() + 10
                while (await c.get("/v1/models", headers=auth_header(C))).status_code != 200:
                    assert time.monotonic() < deadline, "the added key was not accepted within 10 s"
                    await asyncio.sleep(0.05)
                removed = (await c.get("/v1/models", headers=auth_header(A))).status_code
                while orch.sessions and time.monotonic() < deadline:  # alice's session: closed
                    await asyncio.sleep(0.05)
                sessions = len(orch.sessions)
                opened = [(await c.post("/api/v1/sessions", json={}, headers=auth_header(B))).status_code
                          for _ in range(2)]
                limits = (await c.get("/api/v1/limits")).json()
                return removed, sessions, opened, limits
        finally:
            await orch.stop()

    removed, sessions, opened, limits = asyncio.run(main())
    assert removed == 401
    assert opened == [200, 429] and sessions == 0  # bob's max_sessions=1, from the edit
    assert limits["api_keys"] == 2 and limits["api_keys_reloads"] == 1



def test_a_request_whose_key_is_removed_while_it_runs_is_counted_under_its_client(tiny_model_dir, tmp_path):
    """``petals_chain_api_requests`` counts a request under the client it was admitted as. One refused before its
    generation (here a body that is not JSON, sent slowly) whose key was removed meanwhile went uncounted: the end
    of the request looked its key up again. One that waited for a chain (a 503) was and is counted."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.auth import CLIENT
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    path = _write(tmp_path / "keys", f"alice {A}\nbob {B}\n")

    async def main():
        cfg = OrchestratorConfig(model=str(tiny_model_dir), max_length=64, port=0, api_keys=str(path))
        cfg.api_keys_reload_s, cfg.no_chain_wait_s = 0.1, 1.5
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        ended: list[tuple[str, str]] = []  # alice's state is dropped after her last request: seen as counted
        end_request = orch.stats.end_request

        def counted(outcome: str, client: str | None = None) -> None:
            ended.append((outcome, CLIENT.get() if client is None else client))
            end_request(outcome, client)

        orch.stats.end_request = counted
        try:
            app = create_app(orch)
            removed = asyncio.Event()
            sent: list = []

            async def receive():
                await removed.wait()  # the body comes after the key was removed
                return {"type": "http.request", "body": b"{not json", "more_body": False}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                     "root_path": "", "headers": [(b"authorization", f"Bearer {A}".encode()),
                                                  (b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("orch", 80)}
            slow = asyncio.ensure_future(app(scope, receive, send))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://orch", timeout=30) as c:
                waiting = asyncio.ensure_future(c.post("/v1/completions", json={"model": orch.model_id, "prompt": "hi",
                                                                                   "max_tokens": 2},
                                                       headers={"authorization": f"Bearer {A}"}))
                await asyncio.sleep(0.3)
                _replace(path, f"bob {B}\n")
                deadline = time.monotonic() + 10
                while (await c.get("/v1/models", headers={"authorization": f"Bearer {A}"})).status_code != 401:
                    assert time.monotonic() < deadline, "the removal was not loaded within 10 s"
                    await asyncio.sleep(0.05)
                removed.set()
                await slow
                r = await waiting
            status = next(m["status"] for m in sent if m["type"] == "http.response.start")
            alice = sorted(e for e in ended if e[1] == "alice")
            return status, r.status_code, alice, orch.stats.request_totals("alice")
        finally:
            await orch.stop()

    slow, waited, counted, totals = asyncio.run(main())
    assert slow == 400 and waited == 503, (slow, waited)
    assert counted == [("failed", "alice"), ("invalid", "alice")], counted
    assert not any(totals.values()), totals  # then dropped with its name (test_s33_client_state.py)
