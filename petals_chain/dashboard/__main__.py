"""``python -m petals_chain.dashboard --initial-peers MADDR [--port 8080]``: a public swarm dashboard anyone can host.

Joins the swarm's DHT in client mode, finds the swarm in the directory the trusted orchestrator signs (unless
``--dht-prefix`` or ``--model`` names it), reads the signed server records and the orchestrator's signed summary
every ``--poll-interval`` seconds, and serves the page at ``/``, the JSON at ``/api/v1/swarm`` and ``/healthz``.
An orchestrator serving several models lists them all in its summary: each is read too, and ``?model=NAME`` (or
its DHT prefix) on the page and the JSON shows that one, as on the orchestrator's own page; ``/`` shows the swarm
the dashboard started on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional, Sequence

from petals_chain.swarm.console import check_working_directory, say
from petals_chain.swarm.logs import log_level
from petals_chain.swarm.version import build_version, version_asked

logger = logging.getLogger("petals_chain.dashboard")


def _peer_id(text: str) -> str:
    """A libp2p peer id in base58 (a typo trusted nobody: every summary was ignored, the page stayed empty)."""
    from petals_chain.swarm.dht import peer_id_arg

    return peer_id_arg(text)


def build_parser() -> argparse.ArgumentParser:
    from petals_chain.swarm.webpage import host_arg

    p = argparse.ArgumentParser(prog="python -m petals_chain.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=build_version(), help="print its build and exit")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                   help="multiaddrs of swarm peers, e.g. the orchestrator's /ip4/.../tcp/.../p2p/Qm...")
    p.add_argument("--dht-prefix", default=None,
                   help="the swarm's DHT prefix (default: from --model, else the swarm the trusted orchestrator "
                        "announces in the DHT directory)")
    p.add_argument("--model", default=None, help="model name or path the swarm serves (used to derive the prefix)")
    p.add_argument("--trust-orchestrator", nargs="+", default=None, metavar="PEER_ID", type=_peer_id,
                   help="peer ids whose signed summary is believed (default: the peer ids in --initial-peers)")
    p.add_argument("--host", default="127.0.0.1", type=host_arg,
                   help="HTTP bind address (0.0.0.0 to serve the public; :: for IPv6 and IPv4)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between DHT reads (default 2)")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"],
                   help="libp2p listen multiaddrs of this DHT client")
    p.add_argument("--identity-path", default=None, help="RSA identity file (default: a fresh temporary one)")
    p.add_argument("--discover-timeout", type=float, default=30.0,
                   help="seconds to wait for the orchestrator's directory entry when no prefix is given (default 30)")
    p.add_argument("--log-level", default="INFO")
    return p


def resolve_prefix(args: argparse.Namespace) -> Optional[str]:
    """The DHT prefix from ``--dht-prefix`` or ``--model`` (ValueError if invalid); None: discover it."""
    from petals_chain.swarm.keys import check_prefix, default_dht_prefix

    if args.dht_prefix:
        return check_prefix(args.dht_prefix)
    if args.model:
        return default_dht_prefix(_model_name(args.model))
    return None


def _model_name(model: str) -> str:
    """What the orchestrator names ``model`` when it exists here (its DHT prefix derives from it): the registry's
    short name, a .gguf file's stem; the raw path gave another prefix (an empty swarm on the page, no error)."""
    from pathlib import Path

    from petals_chain.swarm.registry import REGISTRY

    if model in REGISTRY or Path(model).expanduser().exists():
        from petals_chain.swarm.sources import resolve_source

        return resolve_source(model).name
    return model


def discover_prefix(sd, trusted: Sequence[str], timeout_s: float, poll_s: float = 1.0) -> str:
    """The DHT prefix of the swarm a trusted orchestrator announces (the newest entry); LookupError if none."""
    deadline = time.monotonic() + timeout_s
    say(f"looking for the swarm a trusted orchestrator announces (up to {timeout_s:g} s)")
    while True:
        entries = sd.fetch_directory(trusted)
        if entries:
            others = sorted({e.dht_prefix for e in entries[1:]} - {entries[0].dht_prefix})
            if others:
                logger.warning("trusted orchestrators announce several swarms; showing %r (others: %s; "
                               "choose with --dht-prefix)", entries[0].dht_prefix, ", ".join(others))
            return entries[0].dht_prefix
        if time.monotonic() >= deadline:
            raise LookupError(f"no swarm announced by a trusted orchestrator within {timeout_s:g} s; "
                              "give --dht-prefix (printed by the orchestrator) or --model")
        time.sleep(poll_s)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if version_asked(argv):  # before build_parser's imports (the web page's)
        print(build_version())
        return 0
    try:  # before the imports of torch and transformers, which die without one
        check_working_directory("dashboard")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=log_level(parser, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (0 < args.poll_interval <= 3600):  # inf: the poller died after one read, /healthz said fresh for ever
        parser.error("--poll-interval must be in (0, 3600] seconds")
    if not (0 < args.port < 65536):
        parser.error("--port must be in 1..65535")
    if not (args.discover_timeout >= 0):
        parser.error("--discover-timeout must be >= 0")
    try:
        prefix = resolve_prefix(args)
    except (ValueError, OSError) as e:  # a path that is no model: a usage error, not a traceback
        parser.error(str(e))
    from petals_chain.swarm.dht import peer_ids_from_maddrs

    trusted = args.trust_orchestrator or peer_ids_from_maddrs(args.initial_peers)
    if not trusted and prefix is None:
        parser.error("give --dht-prefix or --model: there is no trusted orchestrator (no peer id in --initial-peers, "
                     "no --trust-orchestrator) whose swarm directory entry could name the swarm")
    if args.identity_path is not None:  # else "could not join the DHT via [peers]": the peers were blamed
        from petals_chain.swarm.dht import check_identity_path

        try:
            check_identity_path(os.path.expanduser(args.identity_path))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from petals_chain.swarm.webpage import listen_http

    try:
        sock = listen_http(args.host, args.port)
    except OSError as e:
        parser.error(e.strerror or str(e))
    # SIGTERM (and SIGHUP, unless ignored: nohup) before serving (joining the DHT, finding the swarm) unwinds as
    # Ctrl-C does: it ended the process at once, its DHT process and p2pd left running
    main_thread = threading.current_thread() is threading.main_thread()
    unwound = [sig for sig in _stop_signals() if sig != signal.SIGINT]  # (SIGINT is a KeyboardInterrupt already)
    previous = {sig: signal.signal(sig, _interrupt) for sig in unwound} if main_thread else {}
    try:
        return _run(args, prefix, trusted, sock)
    except KeyboardInterrupt:  # stopped before serving: as a stop while serving, no traceback
        return 0
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        sock.close()


def _stop_signals() -> tuple[signal.Signals, ...]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session: its default ended the process at once, the DHT
    process and p2pd left running), unless SIGHUP is ignored (``nohup``)."""
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, prefix: Optional[str], trusted: list[str], sock: socket.socket) -> int:
    import uvicorn

    from petals_chain.dashboard.app import create_app
    from petals_chain.dashboard.source import DhtSwarmSource
    from petals_chain.swarm.dht import SwarmDHT

    if not trusted:
        logger.warning("no trusted orchestrator peer id (none in --initial-peers, no --trust-orchestrator): "
                       "only server records will be shown, no chains or queue")
    try:
        sd = SwarmDHT.create(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs,
                             identity_path=args.identity_path, client_mode=True, prefix=prefix)
    except Exception as e:  # noqa: BLE001 - bad multiaddrs or unreachable peers: say so and exit
        from petals_chain.swarm.reachability import join_hint

        hint = join_hint(args.initial_peers)  # an IPv6-only host given the orchestrator's /ip4/ address
        print(f"error: could not join the DHT via {args.initial_peers}: {e}" + (f"\n{hint}" if hint else ""),
              file=sys.stderr)
        return 2
    try:
        if prefix is None:
            try:
                prefix = discover_prefix(sd, trusted, args.discover_timeout)
            except LookupError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        source = DhtSwarmSource(sd, prefix, trusted, interval_s=args.poll_interval, initial_peers=args.initial_peers)
        try:
            source.start()
            app = create_app(source.view, source.health, model_view=source.view)
            say(f"dashboard for DHT prefix {prefix!r} (trusting orchestrator {', '.join(trusted) or 'none'})")
            from petals_chain.swarm.webpage import local_host, url_host

            # a wildcard host (0.0.0.0, ::) is no address to open: the loopback one, and every address said
            shown = local_host(args.host)
            everywhere = f" (listening on every address: --host {args.host})" if shown != args.host else ""
            say(f"dashboard: http://{url_host(shown)}:{args.port}/{everywhere}")
            lost = _serve(uvicorn, app, sock, sd)
        finally:
            source.stop()
    finally:
        sd.shutdown()
    if lost:
        print("error: the dashboard's DHT process died (killed, or out of memory), so it could no longer read the "
              "swarm's records: stopped; start it again", file=sys.stderr)
        return 1
    return 0


def _serve(uvicorn: Any, app: Any, sock: socket.socket, sd: Any = None) -> bool:
    """Serve until SIGINT, SIGTERM or SIGHUP (unless ignored: ``nohup``), then return (so the caller stops its DHT):
    uvicorn's own handlers re-raise the signal once it has shut down, and SIGTERM's default action then ended the
    process before the cleanup, leaving the DHT process and p2pd running.

    ``sd``: the dashboard's SwarmDHT; it also stops once that node's DHT process has died (the page went stale for
    ever, and its supervisor never restarted it). Returns whether it did."""
    from petals_chain.swarm.dht import on_dht_lost

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.install_signal_handlers = lambda: None
    lost = threading.Event()
    stop_signals = _stop_signals()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in stop_signals:
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

        def dht_lost() -> None:
            if not server.should_exit:  # not when stopping already (a systemd stop kills both at once)
                lost.set()
                server.should_exit = True

        def from_watch_thread(_: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: stopped already
                loop.call_soon_threadsafe(dht_lost)

        if sd is not None:
            on_dht_lost(from_watch_thread)
            if sd.lost:  # died before (joining, finding the swarm)
                dht_lost()
        await server.serve(sockets=[sock])

    before = {sig: signal.getsignal(sig) for sig in stop_signals}
    try:
        asyncio.run(run())
    finally:  # the loop's close set SIGTERM to its default: a second one killed the cleanup, leaving the DHT running
        if sd is not None:
            on_dht_lost(None)
        for sig, handler in before.items():
            if handler is not None:
                signal.signal(sig, handler)
    return lost.is_set()


if __name__ == "__main__":
    sys.exit(main())
