"""Reachability: can other peers dial a server at the addresses it announces, directly or through a relay?

A server behind NAT (or announcing a wrong address) still reaches the orchestrator -- it dialed out -- so every
RPC the orchestrator makes rides that connection and the server looks healthy, until the connection drops or
another server must push activations to it. So reachability is checked by a *fresh* dial from a peer that has
no connection to the server yet: the orchestrator's :class:`Prober`, a separate libp2p daemon.

Wire protocol (handler class ``PetalsChainFrontdoor``, served by the orchestrator):
``rpc_dial_back`` request metadata ``{"maddrs": [str, ...]}`` -> ``{"ok": true, "reachable": bool, "maddr":
the address that worked or "", "error": str}``. The peer to dial is the caller itself (``context.remote_id``):
the orchestrator dials nobody else on request, and a handshake proves the peer id at the other end.

Relayed servers announce ``<relay maddr>/p2p-circuit`` addresses (libp2p circuit relay v2, the orchestrator
being the relay). hivemind's multiaddr library encodes ``/p2p/<id>`` of current peer ids as a CID, which the
daemon cannot parse, so :func:`to_multiaddr` writes those components itself.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections import OrderedDict
from typing import Any, AsyncIterator, Iterable, Optional, Sequence

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.multiaddr import Multiaddr

from petals_chain.swarm.aio import LINGER_S, bound_stream_messages, hold_after_reply

logger = logging.getLogger(__name__)
bound_stream_messages()  # the dial-back service answers any peer: its requests are read bounded

MAX_DIAL_MADDRS = 8  # addresses one dial-back may try
MAX_MADDR_CHARS = 300
DIAL_TIMEOUT_S = 5.0
MAX_PENDING_DIAL_BACKS = 16  # dial-backs running or queued at once; more are answered "busy"
MAX_DIAL_BACK_PEERS = 4096  # callers whose last dial-back time is kept (for the per-peer rate limit)
DIAL_BACK_INTERVAL_S = 1.0  # a peer's dial-backs are served at most this often
_P2P_CODE, _CIRCUIT_CODE = 421, 290

REACHABILITY = ("unknown", "direct", "relayed", "unreachable")  # as records and the dashboard show it


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def to_multiaddr(maddr: str) -> Multiaddr:
    """A multiaddr from its text, with ``/p2p/<id>`` written as the raw multihash the p2p daemon expects.

    Raises ValueError on malformed text."""
    text = str(maddr).strip()
    if not text.startswith("/") or len(text) > MAX_MADDR_CHARS:
        raise ValueError(f"not a multiaddr: {text[:80]!r}")
    parts = text.split("/")[1:]
    if parts and not parts[-1]:
        parts.pop()  # one trailing slash, as written by hand
    if not parts or "" in parts:  # "/" parsed as an empty address, and a server announced it
        raise ValueError(f"not a multiaddr: {text[:80]!r}")
    out, plain = bytearray(), []

    def flush() -> None:
        if plain:
            out.extend(Multiaddr("/" + "/".join(plain)).to_bytes())
            plain.clear()

    i = 0
    while i < len(parts):
        part = parts[i]
        if part in ("p2p", "ipfs"):
            if i + 1 >= len(parts):
                raise ValueError(f"{text!r}: /p2p without a peer id")
            flush()
            digest = PeerID.from_base58(parts[i + 1]).to_bytes()
            out.extend(_varint(_P2P_CODE) + _varint(len(digest)) + digest)
            i += 2
        elif part == "p2p-circuit":
            flush()
            out.extend(_varint(_CIRCUIT_CODE))
            i += 1
        else:
            plain.append(part)
            i += 1
    try:
        flush()
        addr = Multiaddr(bytes(out))
        str(addr)  # a /p2p/ part that is no multihash parses, and fails only when written out
        return addr
    except Exception as e:  # noqa: BLE001 - the library raises several types for garbage
        raise ValueError(f"not a multiaddr: {text[:80]!r} ({e})") from None


def without_peer(maddr: str, peer_id: str) -> str:
    """``maddr`` without a trailing ``/p2p/<peer_id>`` (the daemon takes the peer id separately)."""
    suffix = f"/p2p/{peer_id}"
    return maddr[: -len(suffix)] if maddr.endswith(suffix) else maddr


def is_circuit(maddr: str) -> bool:
    return "/p2p-circuit" in maddr


def is_loopback(maddr: str) -> bool:
    """Whether the address is only good on this host (127.0.0.0/8, ::1)."""
    parts = maddr.split("/")
    for proto, value in zip(parts[1::2], parts[2::2]):
        if proto in ("ip4", "ip6"):
            try:
                return ipaddress.ip_address(value).is_loopback
            except ValueError:
                return False
    return False


def circuit_maddrs(relay_maddrs: Iterable[str]) -> list[str]:
    """The addresses a peer holding a reservation on these relays is reached at (``<relay>/p2p-circuit``)."""
    return [f"{m.rstrip('/')}/p2p-circuit" for m in relay_maddrs if "/p2p/" in m and not is_circuit(m)]


def has_ipv6() -> bool:
    """Whether this host can listen on IPv6 (a kernel with IPv6 off, or ``ipv6.disable=1``, cannot)."""
    import socket

    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
        return True
    except OSError:
        return False


def all_interfaces(port: int = 0) -> list[str]:
    """Listen multiaddrs for every interface at TCP ``port``: IPv4 and, where this host has it, IPv6. (IPv4 alone
    left a volunteer on an IPv6-only host announcing nothing but 127.0.0.1: the dial-back failed, and the server
    served through the orchestrator's relay though its IPv6 address was open.) p2pd listens on ``/ip6/::`` for IPv6
    only, so both may take the same port."""
    return [f"/ip4/0.0.0.0/tcp/{int(port)}"] + ([f"/ip6/::/tcp/{int(port)}"] if has_ipv6() else [])


def listen_and_announce(host_maddrs: Optional[Sequence[str]], announce_maddrs: Sequence[str],
                        public_ip: Optional[str], p2p_port: int) -> tuple[list[str], list[str]]:
    """``(host_maddrs, announce_maddrs)`` from the command line: ``--public-ip`` (with ``--p2p-port``, or a free
    port picked now) listens on every interface at that port and announces ``public_ip`` there; ``--p2p-port``
    alone, or ``host_maddrs`` None, listens on every interface of both IP versions (:func:`all_interfaces`).

    Raises ValueError for a bad IP or port, or a port 0 in an announced address (peers cannot dial port 0)."""
    host, announce = (all_interfaces() if host_maddrs is None else list(host_maddrs)), list(announce_maddrs)
    if not 0 <= int(p2p_port) < 65536:
        raise ValueError(f"--p2p-port must be in 0..65535, got {p2p_port}")
    if public_ip:
        try:
            ip = ipaddress.ip_address(public_ip)
        except ValueError:
            raise ValueError(f"--public-ip: {public_ip!r} is not an IP address") from None
        port = int(p2p_port) or _free_port(ip.version)
        proto = "ip4" if ip.version == 4 else "ip6"
        host = [f"/{proto}/{'0.0.0.0' if ip.version == 4 else '::'}/tcp/{port}"]
        announce = announce + [f"/{proto}/{ip}/tcp/{port}"]
    elif p2p_port:
        host = all_interfaces(int(p2p_port))
    for flag, maddrs in (("--announce-maddrs", announce), ("--host-maddrs", host)):
        for m in maddrs:
            try:
                to_multiaddr(m)
            except ValueError as e:  # else p2pd refused it after the server had started, or bind() raised
                raise ValueError(f"{flag} {m!r}: {e}") from None
    for m in announce:
        if m.rstrip("/").endswith("/tcp/0") or "/tcp/0/" in m:
            raise ValueError(f"--announce-maddrs {m}: give the real port (peers cannot dial port 0)")
    for m in host:
        _check_port_free(m)
    return host, announce


_LISTEN = re.compile(r"^/(ip4|ip6)/([^/]+)/tcp/(\d+)")


def _check_port_free(maddr: str) -> None:
    """ValueError if something listens on ``maddr``'s TCP port already. p2pd binds with SO_REUSEPORT, so a second
    server or orchestrator given the same port started without a word and the kernel split incoming connections
    between the two processes."""
    import errno
    import socket

    m = _LISTEN.match(maddr)
    if m is None or int(m.group(3)) == 0:
        return
    family = socket.AF_INET if m.group(1) == "ip4" else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; a listener is not
        try:
            s.bind((m.group(2), int(m.group(3))))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"TCP port {m.group(3)} is in use on this host (another server or orchestrator "
                                 f"listens there?): give another --p2p-port or --host-maddrs") from None


def unroutable(maddrs: Iterable[str]) -> list[str]:
    """The IP addresses in ``maddrs`` this host has no route to (an IPv4 address on an IPv6-only host, or the other
    way round): asked of the kernel by a UDP ``connect``, which sends nothing. DNS names are left out."""
    import errno
    import socket

    out: list[str] = []
    for maddr in maddrs:
        m = _LISTEN.match(str(maddr))
        if m is None or m.group(2) in out:
            continue
        family = socket.AF_INET if m.group(1) == "ip4" else socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((m.group(2), int(m.group(3)) or 9))
        except OSError as e:  # EAFNOSUPPORT: this IP version is off altogether
            if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EAFNOSUPPORT):
                out.append(m.group(2))
    return out


def join_hint(initial_peers: Sequence[str]) -> str:
    """A sentence to add to a failed join when this host has no route to any of ``initial_peers`` (else "")."""
    ips = [str(m) for m in initial_peers if _LISTEN.match(str(m))]
    blocked = unroutable(ips)
    if not ips or len(blocked) < len({_LISTEN.match(m).group(2) for m in ips}):
        return ""
    versions = {m.split("/")[1] for m in ips}
    if len(versions) > 1:
        return f"this host has no route to {', '.join(blocked)}: is it on a network?"
    mine, other = ("IPv4", "/ip6/") if versions == {"ip4"} else ("IPv6", "/ip4/")
    return (f"this host has no route to {', '.join(blocked)} (no {mine} network here?): give --initial-peers the "
            f"peer's {other} address (the orchestrator prints every address it listens on)")


def _free_port(version: int) -> int:
    import socket

    with socket.socket(socket.AF_INET if version == 4 else socket.AF_INET6) as s:
        s.bind(("0.0.0.0" if version == 4 else "::", 0))
        return int(s.getsockname()[1])


_STATIC_RELAYS_MODE = "client-static-relays"


def relayed_p2p_kwargs(relay_maddrs: Sequence[str]) -> dict:
    """Keyword arguments of ``hivemind.DHT`` / ``P2P.create`` for a peer reachable only through ``relay_maddrs``.

    The daemon reserves a slot on those relays at once only with relay *discovery* off (its static-relays mode);
    with discovery on it waits for candidates from its DHT and, measured here, had no reservation after a minute.
    hivemind has no argument for that daemon flag, so it rides on a DHT mode of our own (a client of the
    daemon's DHT, discovery off)."""
    P2P.DHT_MODE_MAPPING.setdefault(_STATIC_RELAYS_MODE, {"dhtClient": 1, "relayDiscovery": False})
    return {"use_auto_relay": True, "force_reachability": "private", "trusted_relays": list(relay_maddrs),
            "dht_mode": _STATIC_RELAYS_MODE}


def clean_maddrs(maddrs: Any) -> list[str]:
    """The well-formed entries of an untrusted list of multiaddr strings (at most MAX_DIAL_MADDRS)."""
    if not isinstance(maddrs, (list, tuple)):
        raise ValueError("maddrs must be a list of multiaddr strings")
    out = []
    for m in maddrs[:MAX_DIAL_MADDRS]:
        if not isinstance(m, str):
            raise ValueError("maddrs must be a list of multiaddr strings")
        to_multiaddr(m)  # raises ValueError
        out.append(m)
    return out


class _DialOnlyP2P(P2P):
    """A daemon without the libp2p DHT: it dials only the addresses it is given. (With a DHT it would look the
    peer up when those fail and connect at whatever address the peer listens on, proving nothing.)"""

    DHT_MODE_MAPPING = {**P2P.DHT_MODE_MAPPING, "none": {}}


class Prober:
    """Dials peers afresh from a libp2p daemon of its own, started for each check.

    A daemon that dialed a peer before remembers its addresses (and backs off failed ones), so the next check
    would prove nothing: each check gets a new one (~0.3 s to start), at most ``parallel`` at a time."""

    def __init__(self, timeout_s: float = DIAL_TIMEOUT_S, parallel: int = 2):
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(parallel)
        self.checks = 0

    async def dial(self, peer_id: str, maddrs: Sequence[str]) -> tuple[bool, str, str]:
        """Connect to ``peer_id`` at ``maddrs`` only: ``(reachable, the address that worked, error)``."""
        try:
            peer = PeerID.from_base58(peer_id)
            addrs = [(m, to_multiaddr(without_peer(m, peer_id))) for m in maddrs]
        except Exception as e:  # noqa: BLE001
            return False, "", f"bad address: {e}"
        if not addrs:
            return False, "", "no address announced"
        errors = []
        async with self._slots:
            self.checks += 1
            # a check takes at most 3 timeouts in all, however many addresses it tries (a slot is shared)
            give_up = time.monotonic() + 3 * self.timeout_s
            # one address at a time (a relayed one last), so that the one that worked is known; a daemon per
            # address, as a failed dial leaves a backoff on the peer that would fail the next address at once
            for text, addr in sorted(addrs, key=lambda a: is_circuit(a[0])):
                left = min(self.timeout_s, give_up - time.monotonic())
                if left <= 0:
                    errors.append(f"{text}: not tried (the check's time was spent)")
                    continue
                p2p = await _DialOnlyP2P.create(host_maddrs=[], no_listen=True, dht_mode="none", auto_nat=False,
                                                nat_port_map=False)
                try:
                    await asyncio.wait_for(p2p._client.connect(peer, [addr]), left)
                except Exception as e:  # noqa: BLE001 - refused, timed out, no route, wrong peer at that address
                    errors.append(f"{text}: {_short(e)}")
                    continue
                finally:
                    await _quietly(p2p.shutdown())
                return True, text, ""
        return False, "", "; ".join(errors)


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except Exception:  # noqa: BLE001
        logger.debug("prober shutdown failed", exc_info=True)


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, asyncio.TimeoutError):
        text = "timed out"
    return " ".join(text.split())[:300]


class PetalsChainFrontdoor(ServicerBase):
    """The orchestrator's RPC for servers: ``rpc_dial_back`` (``await frontdoor.add_p2p_handlers(p2p)``)."""

    def __init__(self, prober: Prober, *, interval_s: float = DIAL_BACK_INTERVAL_S,
                 max_pending: int = MAX_PENDING_DIAL_BACKS):
        self.prober = prober
        self.interval_s = interval_s
        self.max_pending = max_pending
        self._last: OrderedDict[str, float] = OrderedDict()  # peer id -> its last dial-back, oldest first
        self._pending = 0  # dials running or queued for the prober's slots

    async def rpc_dial_back(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer_id = context.remote_id.to_base58()
        now = time.monotonic()
        if now - self._last.get(peer_id, -1e9) < self.interval_s:
            yield _reply({"ok": False, "code": "busy", "error": f"one dial-back per {self.interval_s} s"})
            await hold_after_reply(LINGER_S)  # the reply must not be lost to a stream closed under it
            return
        if self._pending >= self.max_pending:
            # each new peer id (free to make) queued a dial of up to 3 timeouts behind the prober's few slots: a
            # hundred of them made every honest server's check time out, and held a stream each meanwhile
            yield _reply({"ok": False, "code": "busy", "error": f"{self._pending} dial-backs pending, try again later"})
            await hold_after_reply(LINGER_S)
            return
        self._last[peer_id] = now
        self._last.move_to_end(peer_id)
        while len(self._last) > MAX_DIAL_BACK_PEERS:  # forget the oldest callers (new ids grew it without bound)
            self._last.popitem(last=False)
        try:
            meta = MSGPackSerializer.loads(request.metadata[:1 << 16]) if request.metadata else {}
            maddrs = clean_maddrs(meta.get("maddrs") if isinstance(meta, dict) else None)
        except Exception as e:  # noqa: BLE001 - whatever the bytes were
            yield _reply({"ok": False, "code": "invalid", "error": str(e)[:300]})
            await hold_after_reply(LINGER_S)
            return
        # The caller leaving (its stream closed: a server killed or timed out) cancels this handler; a dial cancelled
        # while its daemon starts would leave that daemon running, owned by nobody, so the dial runs to its end.
        self._pending += 1
        dialing = asyncio.ensure_future(self.prober.dial(peer_id, maddrs))
        dialing.add_done_callback(self._dial_done)
        reachable, maddr, error = await asyncio.shield(dialing)
        yield _reply({"ok": True, "reachable": reachable, "maddr": maddr, "error": public_dial_error(error)})
        await hold_after_reply(LINGER_S)

    def _dial_done(self, task: asyncio.Future) -> None:
        self._pending -= 1
        _retrieved(task)


def _retrieved(task: asyncio.Future) -> None:
    """Done callback of a task nobody may await any more: its failure is logged here, not "never retrieved"."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("dial-back failed: %s", _short(task.exception()))


def public_dial_error(error: str) -> str:
    """What a failed dial tells others (the peer that asked, the public summary): that it failed, not how. Per
    address, refused / timed out / handshake failed reads as a port scan of the orchestrator's network at
    addresses anyone may announce; the details stay in the orchestrator's log."""
    return "none of the announced addresses answered a dial from the orchestrator" if error else ""


def _reply(meta: dict) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(meta))


async def ask_dial_back(p2p: P2P, orchestrator: str, maddrs: Sequence[str],
                        timeout_s: float = DIAL_TIMEOUT_S * MAX_DIAL_MADDRS + 5) -> tuple[bool, str, str]:
    """Ask the orchestrator to dial us at ``maddrs``: ``(reachable, address that worked, error)``.

    Raises ConnectionError when the orchestrator does not answer (or runs no dial-back service)."""
    stub = PetalsChainFrontdoor.get_stub(p2p, PeerID.from_base58(orchestrator))
    request = runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps({"maddrs": list(maddrs)[:MAX_DIAL_MADDRS]}))

    async def call() -> dict:
        async for reply in await stub.rpc_dial_back(request):
            return MSGPackSerializer.loads(reply.metadata)
        raise ConnectionError("the stream ended without a reply")

    try:
        meta = await asyncio.wait_for(call(), timeout_s)
    except Exception as e:  # noqa: BLE001
        raise ConnectionError(f"dial-back from {orchestrator[:12]}: {_short(e)}") from e
    if not isinstance(meta, dict) or not meta.get("ok"):
        raise ConnectionError(f"dial-back refused: {meta.get('error') if isinstance(meta, dict) else meta!r}")
    return bool(meta.get("reachable")), str(meta.get("maddr", "")), str(meta.get("error", ""))
