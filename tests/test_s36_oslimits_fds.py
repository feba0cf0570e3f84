"""Open-files limits (``ulimit -n``): a role raises its soft limit to the hard one and refuses a limit too low to
work; the orchestrator caps its HTTP connections below the limit (503 ``too_many_connections``, not every P2P call
failing with EMFILE and every server banned); asyncio's "out of descriptors" is logged once per period, not a
traceback per accept try (43,000 log lines in 8 s before)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket

import pytest

from petals_chain.swarm import launch


def _fake_limits(monkeypatch, soft: int, hard: int) -> list:
    calls: list = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append(limits))
    return calls


def test_the_soft_limit_is_raised_to_the_hard_one(monkeypatch):
    calls = _fake_limits(monkeypatch, 1024, 524288)
    assert launch.raise_open_files_limit("server") == launch.MAX_RAISED_OPEN_FILES
    assert calls == [(launch.MAX_RAISED_OPEN_FILES, 524288)]
    calls = _fake_limits(monkeypatch, 256, 4096)
    assert launch.raise_open_files_limit("server") == 4096 and calls == [(4096, 4096)]


@pytest.mark.parametrize("role", ["orchestrator", "server"])
def test_a_limit_too_low_to_work_is_refused_at_start_naming_ulimit(monkeypatch, capsys, role):
    _fake_limits(monkeypatch, 100, 100)
    if role == "orchestrator":
        from petals_chain.orchestrator.__main__ import main
    else:
        from petals_chain.server.__main__ import main
    assert main(["--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert "ulimit -n" in err and "is 100" in err and f"needs at least {launch.MIN_OPEN_FILES}" in err, err


def test_out_of_descriptors_is_logged_once_per_period(caplog):
    loop = asyncio.new_event_loop()
    try:
        launch.quiet_descriptor_exhaustion(loop, 256, period_s=3600)
        sock = socket.socket()
        try:
            context = {"message": "socket.accept() out of system resource", "socket": sock,
                       "exception": OSError(errno.EMFILE, "Too many open files")}
            with caplog.at_level(logging.WARNING):
                for _ in range(2048):  # one accept loop's tries (uvicorn's backlog)
                    loop.call_exception_handler(context)
                loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
        finally:
            sock.close()
    finally:
        loop.close()
    warnings = [r for r in caplog.records if r.name == "petals_chain.swarm.launch"]
    assert len(warnings) == 1 and "ulimit -n" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert any("something else" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def _request(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    return s


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), 0)
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_connections_past_the_cap_get_503_and_hold_no_descriptor():
    import uvicorn

    from petals_chain.orchestrator.__main__ import capped_http_protocol, max_http_connections

    # at ulimit -n 256 the HTTP side (let in + being refused) leaves the reserve and a P2P stream per hop of 2
    cap = max_http_connections(256)
    assert 2 * cap + 2 * cap + launch.RESERVED_OPEN_FILES <= 256

    release = asyncio.Event()

    async def app(scope, receive, send):
        if scope["path"] == "/hold":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                               http=capped_http_protocol(2)))
        task = asyncio.create_task(server.serve(sockets=[listener]))
        held = []
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            for _ in range(2):  # two requests running: the cap (an idle keep-alive connection would make room)
                s = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 10)
                held.append(s)
                await asyncio.to_thread(s.sendall, b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
            for _ in range(1000):  # both reach the app
                if len(server.server_state.tasks) == 2:
                    break
                await asyncio.sleep(0.01)
            s = await asyncio.to_thread(_request, port)
            reply = await asyncio.to_thread(_read_response, s)
            assert await asyncio.to_thread(s.recv, 1) == b""  # closed by the orchestrator
            s.close()
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), reply
            error = json.loads(body)["error"]
            assert error["code"] == "too_many_connections" and "ulimit -n" in error["message"]
            assert len(server.server_state.connections) == 2
            release.set()
            for s in held:
                assert (await asyncio.to_thread(_read_response, s)).startswith(b"HTTP/1.1 200")
                s.close()
            held.clear()
            for _ in range(500):  # the closes reach the server
                if not server.server_state.connections:
                    break
                await asyncio.sleep(0.01)
            s = await asyncio.to_thread(_request, port)
            held.append(s)
            assert (await asyncio.to_thread(_read_response, s)).startswith(b"HTTP/1.1 200")
        finally:
            for s in held:
                s.close()
            release.set()
            server.should_exit = True
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
