"""IPv6 addresses on the command lines: the URLs the orchestrator prints and announces, ``--host [::1]``, the server's
default listen addresses (IPv6 too, where the host has it) and the hint for an initial peer of an IP version this
host cannot reach."""

from __future__ import annotations

import errno
import socket
from types import SimpleNamespace

import pytest

from petals_chain.swarm.reachability import listen_and_announce


def _can_listen_on_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _can_listen_on_ipv6(), reason="this test host cannot listen on IPv6")


def test_the_orchestrators_urls_bracket_an_ipv6_host():
    """``--host ::1`` printed ``HTTP API: http://::1:PORT/v1``, wrote it to the ready file and announced it to the
    other orchestrators (``--group-with``), which forwarded nothing there: httpx and browsers refuse it."""
    from petals_chain.orchestrator.__main__ import _http_urls

    def urls(host: str, public_ip: str | None = None, public_url: str | None = None) -> tuple[str, str]:
        return _http_urls(SimpleNamespace(host=host, public_ip=public_ip, public_url=public_url), "http", 8000)

    assert urls("::1") == ("http://[::1]:8000", "http://[::1]:8000")
    assert urls("fd00:36::1") == ("http://[fd00:36::1]:8000", "http://[fd00:36::1]:8000")
    assert urls("::", "2001:db8::5") == ("http://[2001:db8::5]:8000", "http://[::1]:8000")
    assert urls("::") == ("http://127.0.0.1:8000", "http://[::1]:8000")  # (:: takes IPv4 too)
    assert urls("0.0.0.0", "203.0.113.7") == ("http://203.0.113.7:8000", "http://127.0.0.1:8000")
    assert urls("::1", public_url="https://swarm.example.org")[0] == "https://swarm.example.org"
    import httpx

    for url in urls("::1") + urls("::", "2001:db8::5"):
        assert httpx.URL(url).port == 8000  # a URL a client accepts


def test_host_may_be_written_in_brackets():
    """``--host [::1]`` (as in the URL) failed to bind: "cannot listen on [::1]:8000: Name or service not known"."""
    from petals_chain.dashboard.__main__ import build_parser as dashboard_parser
    from petals_chain.orchestrator.__main__ import build_parser as orchestrator_parser

    assert orchestrator_parser().parse_args(["--model", "m", "--host", "[::1]"]).host == "::1"
    assert dashboard_parser().parse_args(["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--host", "[::1]"]).host == "::1"
    assert orchestrator_parser().parse_args(["--model", "m", "--host", "0.0.0.0"]).host == "0.0.0.0"
    with pytest.raises(SystemExit):
        orchestrator_parser().parse_args(["--model", "m", "--host", "[]"])


@needs_ipv6
def test_a_server_listens_on_ipv6_too_by_default():
    """A server's default was /ip4/0.0.0.0/tcp/0 only: on an IPv6-only host it announced 127.0.0.1, failed the
    dial-back ("NOT REACHABLE ... Open or forward the TCP port") and served through the orchestrator's relay though
    its IPv6 address was open. ``--p2p-port`` alone (a port opened in a firewall) listened on IPv4 only too."""
    from petals_chain.server.__main__ import build_parser

    args = build_parser().parse_args(["--model", "m"])
    host, announce = listen_and_announce(args.host_maddrs, args.announce_maddrs, args.public_ip, args.p2p_port)
    assert host == ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"] and announce == []
    with socket.socket(socket.AF_INET6) as s:  # a port free on both
        s.bind(("::", 0))
        port = s.getsockname()[1]
    assert listen_and_announce(["/ip4/127.0.0.1/tcp/0"], [], None, port) == (
        [f"/ip4/0.0.0.0/tcp/{port}", f"/ip6/::/tcp/{port}"], [])
    # what the user wrote stays as written; --public-ip keeps to its own IP version
    assert listen_and_announce(["/ip4/127.0.0.1/tcp/0"], [], None, 0)[0] == ["/ip4/127.0.0.1/tcp/0"]
    assert listen_and_announce(None, [], "2001:db8::5", port) == ([f"/ip6/::/tcp/{port}"],
                                                                  [f"/ip6/2001:db8::5/tcp/{port}"])


def test_no_route_to_the_initial_peers_ip_version_is_said(monkeypatch):
    """An IPv6-only host given the orchestrator's /ip4/ address exited with "cannot join the swarm via [...]: Daemon
    failed to start: failed to connect to bootstrap peers", nothing about why; now a line says which address this
    host has no route to and to give the peer's /ip6/ address."""
    from petals_chain.swarm.reachability import join_hint, unroutable

    peer = "/p2p/QmeSdGfdrKz27nP6oufSiEE7TkxB5PD2GakwF8Xp8WRvmd"
    v4, v6 = f"/ip4/192.0.2.9/tcp/31337{peer}", f"/ip6/2001:db8::9/tcp/31337{peer}"
    real = socket.socket

    class NoIPv4(real):  # the kernel's answer on a host without IPv4 routes (no packet is sent either way)
        def connect(self, address):
            if self.family == socket.AF_INET:
                raise OSError(errno.ENETUNREACH, "Network is unreachable")
            return None

    monkeypatch.setattr(socket, "socket", NoIPv4)
    assert unroutable([v4, v6, v4]) == ["192.0.2.9"]
    hint = join_hint([v4])
    assert "no route to 192.0.2.9" in hint and "/ip6/" in hint
    assert join_hint([v4, v6]) == ""  # one of them is reachable: the failure is something else
    assert join_hint(["/dns4/example.org/tcp/1"]) == "" and join_hint([]) == ""


def test_a_cors_origin_with_an_ipv6_host_matches_the_browsers_spelling():
    """A browser sends ``Origin: http://[::1]:3000`` (compressed, lower case): ``--cors-origins`` written another way
    (``[0:0:0:0:0:0:0:1]``, upper-case hex) never matched before; a bracket that holds no IPv6 address is refused."""
    from petals_chain.orchestrator.api import cors_origins

    assert cors_origins("http://[0:0:0:0:0:0:0:1]:3000,https://[FD00:36::0001]") == [
        "http://[::1]:3000", "https://[fd00:36::1]"]
    assert cors_origins("http://[::1]:80") == ["http://[::1]"]  # the scheme's port dropped, as for names
    with pytest.raises(ValueError, match="not an IPv6 address"):
        cors_origins("http://[1:2:3]:3000")
