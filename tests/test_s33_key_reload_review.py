"""Review of the watched ``--api-keys`` file (auth.KeyFile): a poll never stalls the event loop (a hung NFS stat, a
large file), a file that is not a key file is refused unread, a Kubernetes Secret mount's update is picked up, a
request keeps the limits of the key it was admitted with, and ``--api-keys-reload-s`` with a pipe is a usage error."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import pytest

from petals_chain.orchestrator import auth

A, B = "a" * 20, "b" * 20
OLD_NS = 1_000_000_000 * 1_000_000_000  # a modification time long past: not "just modified"


def _write(path, text: str, mtime_ns: int | None = None):
    path.write_text(text)
    os.chmod(path, 0o600)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


async def _until(check, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_a_hung_file_system_does_not_stall_look_ups(tmp_path, monkeypatch):
    """The key file on an NFS mount whose server stopped answering: the due poll's stat hangs. A look-up (every
    request's) answers from the keys loaded last meanwhile, and the edit is loaded once the stat returns."""
    path = _write(tmp_path / "keys", f"alice {A}\n")
    clock = [0.0]
    keys = auth.KeyFile(path, reload_s=1.0, clock=lambda: clock[0])
    _write(path, f"alice {A}\nbob {B}\n", mtime_ns=OLD_NS)
    entered, release = threading.Event(), threading.Event()
    inside = threading.Event()
    real_stat = os.stat

    def hung_stat(p, *args, **kwargs):
        if str(p) == str(path) and not release.is_set():
            entered.set()
            inside.set()
            try:
                release.wait(5.0)  # the old code waited here on the event loop: the look-up took 5 s
            finally:
                inside.clear()
        return real_stat(p, *args, **kwargs)

    async def main():
        clock[0] += 1.0  # a poll is due
        monkeypatch.setattr(os, "stat", hung_stat)
        try:
            found = keys.lookup(A)  # starts the poll; answers from the keys loaded last
            assert entered.wait(10.0), "the due poll did not stat the file"
            stalled = inside.is_set()  # the look-up came back while the stat still hangs
            assert keys.lookup(B) is None  # not loaded yet
            release.set()
            await _until(lambda: keys.lookup(B) is not None, "the edit was not loaded once the stat returned")
        finally:
            release.set()
            monkeypatch.setattr(os, "stat", real_stat)
        return found, stalled

    found, stalled = asyncio.run(main())
    assert found is not None and found.name == "alice"
    assert stalled, "the look-up waited for the hung stat (on the event loop)"
    assert keys.reloads == 1


def test_a_hung_poll_is_not_started_twice(tmp_path, monkeypatch):
    """While a stat hangs, later due polls join it instead of piling up threads."""
    path = _write(tmp_path / "keys", f"alice {A}\n")
    clock = [0.0]
    keys = auth.KeyFile(path, reload_s=1.0, clock=lambda: clock[0])
    release = threading.Event()
    calls = []
    real_stat = os.stat

    def hung_stat(p, *args, **kwargs):
        if str(p) == str(path) and not release.is_set():
            calls.append(p)
            release.wait(2.0)  # the old code: on the event loop, once per look-up
        return real_stat(p, *args, **kwargs)

    async def main():
        monkeypatch.setattr(os, "stat", hung_stat)
        try:
            for _ in range(3):
                clock[0] += 1.0  # due again
                assert keys.lookup(A).name == "alice"
                await asyncio.sleep(0.05)
        finally:
            release.set()
            monkeypatch.setattr(os, "stat", real_stat)
        started = len(calls)
        await keys.poll_async()  # the hung one's thread ends
        return started

    assert asyncio.run(main()) == 1


def test_a_file_larger_than_a_key_file_is_refused_unread(tmp_path, monkeypatch, caplog):
    """A key file replaced by something huge (a log copied over it): refused with a clear error, at start and at a
    reload (the keys loaded before stay), without reading it whole into memory."""
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(16 * 2**20 + 1)  # sparse: cheap
    os.chmod(big, 0o600)
    with pytest.raises(auth.KeyFileError, match=r"larger than 16 MiB: not a key file"):
        auth.KeyFile(big)
    path = _write(tmp_path / "keys", f"alice {A}\n")
    keys = auth.KeyFile(path, reload_s=1.0, clock=lambda: 0.0)
    monkeypatch.setattr(auth, "MAX_KEY_FILE_BYTES", 64)
    _write(path, f"alice {A}\n" + "# " + "x" * 100 + "\n", mtime_ns=OLD_NS)
    assert not keys.poll()
    assert keys.lookup(A).name == "alice" and keys.failures == 1
    assert "larger than" in caplog.text and "keeping the 1 API keys loaded before" in caplog.text


def _k8s_version(mount, name: str, text: str) -> None:
    """What the kubelet does to update a Secret volume: a new timestamped directory, then ``..data`` (a symlink)
    swapped to it by a rename, then the old directory removed; ``keys`` itself is a symlink to ``..data/keys``."""
    version = mount / name
    version.mkdir()
    _write(version / "keys", text, mtime_ns=OLD_NS)  # same times for every version: only the inode tells
    tmp = mount / "..data_tmp"
    os.symlink(name, tmp)
    old = os.readlink(mount / "..data") if (mount / "..data").is_symlink() else None
    os.replace(tmp, mount / "..data")
    if old is not None:
        for f in (mount / old).iterdir():
            f.unlink()
        (mount / old).rmdir()


def test_a_kubernetes_secret_mount_update_is_picked_up(tmp_path):
    """A Secret mounted as a volume (how most operators deploy): the path is a symlink whose own inode never
    changes; the file behind it is followed (stat, not lstat), so the swapped version is loaded, by the watch."""
    mount = tmp_path / "secret"
    mount.mkdir()
    _k8s_version(mount, "..2026_01_01_00_00_00.1", f"alice {A}\n")
    os.symlink("..data/keys", mount / "keys")
    keys = auth.KeyFile(mount / "keys", reload_s=0.05)
    assert keys.watching and keys.lookup(A).name == "alice"

    async def main():
        task = asyncio.ensure_future(keys.watch())
        try:
            _k8s_version(mount, "..2026_01_01_00_05_00.2", f"bob {B}\n")
            await _until(lambda: keys.reloads == 1, "the Secret's new version was not loaded")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert keys.lookup(B).name == "bob" and keys.lookup(A) is None
    assert keys.failures == 0


def test_a_request_keeps_the_limits_of_the_key_it_was_admitted_with(tmp_path):
    """A request under way while the file is reloaded (its key's deadline changed, or the key removed) keeps its
    key's deadline and limits: the reload applies to the next request ("changed limits apply to the next
    request"); the old code read the new ring half-way through the request."""
    from prometheus_client import CollectorRegistry

    from petals_chain.orchestrator.limits import AdmissionLimits, LimitsConfig

    path = _write(tmp_path / "keys", f"alice {A} deadline_ms=5000 max_sessions=3\n")
    keys = auth.KeyFile(path, reload_s=1.0, clock=lambda: 0.0)
    seen: list = []

    async def main():
        reading = asyncio.Event()

        async def app(scope, receive, send):
            await reading.wait()  # the request reads its body while the file is edited
            lim = limits.limits
            seen.append((lim.deadline_defaults(auth.CLIENT.get()), lim.session_limit(auth.CLIENT.get())))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        orch = SimpleNamespace(sessions={}, stats=SimpleNamespace(registry=CollectorRegistry()),
                               dispatch=SimpleNamespace(chains=[]))
        limits = AdmissionLimits(app, orch, LimitsConfig(keys=keys))
        sent: list = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        scope = {"type": "http", "method": "GET", "path": "/v1/models",
                 "headers": [(b"authorization", f"Bearer {A}".encode())]}
        request = asyncio.ensure_future(limits(scope, receive, send))
        await asyncio.sleep(0.05)
        _write(path, f"alice {A} deadline_ms=100 max_sessions=1\n", mtime_ns=OLD_NS)  # tightened
        assert keys.poll()
        reading.set()
        await request
        after = limits.limits.deadline_defaults("alice")  # the next request: the new limits
        reading.clear()
        _write(path, f"bob {B}\n")  # alice removed while her next request runs
        request = asyncio.ensure_future(limits(scope, receive, send))
        await asyncio.sleep(0.05)
        assert keys.poll()
        reading.set()
        await request
        return after

    after = asyncio.run(main())
    assert seen[0] == ((5000, None), 3), "the request under way took the edited key's limits"
    assert after == (100, None)
    assert seen[1] == ((100, None), 1), "the request of a key removed under way lost its key's limits"


def test_the_reload_interval_with_a_pipe_is_a_usage_error(tiny_model_dir, monkeypatch, capsys):
    """``--api-keys <(...) --api-keys-reload-s 5``: a pipe is read once, so the interval asked for would be ignored
    silently (the operator believes edits apply); a usage error now. Without the flag, or with 0, it starts."""
    import petals_chain.orchestrator.__main__ as cli

    async def fake_serve(cfgs, *args, **kwargs):
        return None

    monkeypatch.setattr(cli, "serve", fake_serve)

    def run(*extra: str):
        r, w = os.pipe()
        try:
            os.write(w, f"alice {A}\n".encode())
            os.close(w)
            w = -1
            return cli.main(["--model", str(tiny_model_dir), "--api-keys", f"/dev/fd/{r}", *extra])
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)

    with pytest.raises(SystemExit) as e:
        run("--api-keys-reload-s", "5")
    assert e.value.code == 2
    assert "--api-keys-reload-s needs a regular --api-keys file" in capsys.readouterr().err
    assert run("--api-keys-reload-s", "0") == 0 and run() == 0
