"""Review of the OS-limits commit: at the orchestrator's HTTP connection cap, a connection that runs no request (idle
between keep-alive requests, or silent since it opened) makes room for a new one (one client's idle pool, or sockets
that never send, locked every other client out with 503s); pings that fail for want of open files in the
orchestrator itself ban no server (each was banned in turn, as if dead)."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

from petals_chain.swarm import launch
from test_load_deadline import Swarm, record
from test_s36_oslimits_fds import _read_response


def _closed_by_server(s: socket.socket, wait_s: float = 10.0) -> bool:
    """Whether the server closed ``s`` (EOF within ``wait_s``; an open idle connection just times out)."""
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionError:
        return True


class CappedServer:
    """uvicorn on loopback with the orchestrator's protocol capped at 2 connections; ``/hold`` answers once
    ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.socks: list[socket.socket] = []

    async def run(self, check) -> None:
        import uvicorn

        from petals_chain.orchestrator.__main__ import capped_http_protocol

        async def app(scope, receive, send):  # a plain function: uvicorn takes a bound method for ASGI 2
            if scope["path"] == "/hold":
                await self.release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.setblocking(False)
        self.port = listener.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    http=capped_http_protocol(2)))
        task = asyncio.create_task(self.server.serve(sockets=[listener]))
        try:
            while not self.server.started:
                await asyncio.sleep(0.01)
            await check(self)
        finally:
            for s in self.socks:
                s.close()
            self.release.set()
            self.server.should_exit = True
            await asyncio.wait_for(task, 10)

    async def connect(self) -> socket.socket:
        s = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", self.port), 10)
        self.socks.append(s)
        return s

    async def get(self, path: str = "/") -> tuple[socket.socket, bytes]:
        """A request on a new connection, and its reply (none waited for on ``/hold``)."""
        s = await self.connect()
        await asyncio.to_thread(s.sendall, f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        return s, b"" if path == "/hold" else await asyncio.to_thread(_read_response, s)

    async def until(self, done) -> None:
        for _ in range(1000):
            if done():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the server did not get there")


def test_an_idle_keep_alive_connection_makes_room_at_the_cap():
    async def check(sv: CappedServer) -> None:
        # two keep-alive connections idle after their request (a client's pool): a new client gets in, and the
        # one idle longest is closed for it (before: 503 too_many_connections while they stayed open)
        idle = [(await sv.get())[0] for _ in range(2)]
        _, reply = await sv.get()
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert await asyncio.to_thread(_closed_by_server, idle[0])
        assert not await asyncio.to_thread(_closed_by_server, idle[1], 0.3)
        for s in sv.socks:
            s.close()
        sv.socks.clear()
        await sv.until(lambda: not sv.server.server_state.connections)

        # requests running are never closed for another: past them, 503 as before
        running = [(await sv.get("/hold"))[0] for _ in range(2)]
        await sv.until(lambda: len(sv.server.server_state.tasks) == 2)
        _, reply = await sv.get()
        assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply, reply
        sv.release.set()
        for s in running:
            assert (await asyncio.to_thread(_read_response, s)).startswith(b"HTTP/1.1 200")

    asyncio.run(CappedServer().run(check))


def test_a_connection_silent_since_it_opened_makes_room_at_the_cap(monkeypatch):
    import petals_chain.orchestrator.__main__ as orch_main

    async def check(sv: CappedServer) -> None:
        # sockets that never send: within SILENT_CONNECTION_S they keep their place, past it one makes room
        monkeypatch.setattr(orch_main, "SILENT_CONNECTION_S", 3600.0, raising=False)
        silent = [await sv.connect() for _ in range(2)]
        await sv.until(lambda: len(sv.server.server_state.connections) == 2)
        _, reply = await sv.get()
        assert reply.startswith(b"HTTP/1.1 503"), reply
        monkeypatch.setattr(orch_main, "SILENT_CONNECTION_S", 0.0, raising=False)
        _, reply = await sv.get()
        assert reply.startswith(b"HTTP/1.1 200"), reply  # before: 503 for as long as they stayed open
        assert await asyncio.to_thread(_closed_by_server, silent[0])

    asyncio.run(CappedServer().run(check))


def test_pings_failing_for_want_of_open_files_here_ban_no_server(caplog):
    sw = Swarm({n: record(n) for n in "ABC"})
    sw.refresh()
    for name in "ABC":
        sw.load(name)
    sw.refresh(1.0)
    chains = sw.chains()
    assert chains

    async def out_of_files(peer_id):  # as ServerClient.ping raises it (checked with a real P2P at a low limit)
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as e:
            raise ConnectionError(f"rpc_ping {peer_id}: OSError: {e}") from e

    sw.pl.client.ping = out_of_files
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.planner"):
        for _ in range(3):
            sw.refresh(1.0)
    assert sw.chains() == chains
    assert all(v.failed_at is None and not v.ping_failures for v in sw.pl.servers.values())
    said = [r.getMessage() for r in caplog.records if "open files" in r.getMessage()]
    assert len(said) == 1 and "ulimit -n" in said[0], said  # once a minute, not once per server and ping

    async def dead(peer_id):  # a server that does not answer is still banned
        raise ConnectionError(f"rpc_ping {peer_id}: TimeoutError")

    sw.pl.client.ping = dead
    sw.refresh(1.0)
    sw.refresh(1.0)
    assert all(v.failed_at is not None for v in sw.pl.servers.values())


def test_out_of_descriptors_is_told_through_wrapping():
    def wrapped(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except OSError:
                raise ConnectionError("rpc_ping x")  # implicit context, as a bare raise in an except block
        except ConnectionError as e:
            return e

    assert launch.out_of_descriptors(wrapped(OSError(errno.EMFILE, "Too many open files")))
    assert launch.out_of_descriptors(OSError(errno.ENFILE, "Too many open files in system"))
    assert not launch.out_of_descriptors(wrapped(OSError(errno.ECONNREFUSED, "refused")))
    assert not launch.out_of_descriptors(ConnectionError("unreachable"))


def test_a_hop_failing_for_want_of_open_files_here_bans_no_server():
    """The request path's twin of the pings': a hop whose open failed with this orchestrator's EMFILE (under the
    RPC's ConnectionError) reported its server to the planner, which banned it; a real failure still does."""
    from petals_chain.orchestrator.core import Orchestrator
    from petals_chain.orchestrator.relay import HopFailure

    reported: list[str] = []
    orch = Orchestrator.__new__(Orchestrator)
    orch.planner = type("P", (), {"report_failure": lambda self, peer, reason: reported.append(peer)})()
    try:
        raise ConnectionError("rpc_open: OSError") from OSError(errno.EMFILE, "Too many open files")
    except ConnectionError as e:
        orch.server_failed(HopFailure("A", e))
    assert reported == []
    orch.server_failed(HopFailure("B", ConnectionError("connection reset by peer")))
    assert reported == ["B"]
