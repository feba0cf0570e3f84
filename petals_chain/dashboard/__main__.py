"""``python -m petals_chain.dashboard --initial-peers MADDR [--port 8080]``: a public swarm dashboard anyone can host.

Joins the swarm's DHT in client mode, reads the signed server records and the trusted orchestrator's signed
summary every ``--poll-interval`` seconds, and serves the page at ``/``, the JSON at ``/api/v1/swarm`` and
``/healthz``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

logger = logging.getLogger("petals_chain.dashboard")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m petals_chain.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                   help="multiaddrs of swarm peers, e.g. the orchestrator's /ip4/.../tcp/.../p2p/Qm...")
    p.add_argument("--dht-prefix", default=None,
                   help="the swarm's DHT prefix (default: derived from --model, as the orchestrator does)")
    p.add_argument("--model", default=None, help="model name or path the swarm serves (used to derive the prefix)")
    p.add_argument("--trust-orchestrator", nargs="+", default=None, metavar="PEER_ID",
                   help="peer ids whose signed summary is believed (default: the peer ids in --initial-peers)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0 to serve the public)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between DHT reads (default 2)")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"],
                   help="libp2p listen multiaddrs of this DHT client")
    p.add_argument("--identity-path", default=None, help="RSA identity file (default: a fresh temporary one)")
    p.add_argument("--log-level", default="INFO")
    return p


def resolve_prefix(args: argparse.Namespace) -> str:
    """The DHT prefix from ``--dht-prefix`` or ``--model``; raises ValueError with a clear message otherwise."""
    from petals_chain.swarm.keys import check_prefix, default_dht_prefix

    if args.dht_prefix:
        return check_prefix(args.dht_prefix)
    if args.model:
        return default_dht_prefix(args.model)
    raise ValueError("give --dht-prefix (printed by the orchestrator) or --model (the model the swarm serves)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.poll_interval > 0):
        parser.error("--poll-interval must be positive")
    if not (0 < args.port < 65536):
        parser.error("--port must be in 1..65535")
    try:
        prefix = resolve_prefix(args)
    except ValueError as e:
        parser.error(str(e))

    import uvicorn

    from petals_chain.dashboard.app import create_app
    from petals_chain.dashboard.source import DhtSwarmSource
    from petals_chain.swarm.dht import SwarmDHT, peer_ids_from_maddrs

    trusted = args.trust_orchestrator or peer_ids_from_maddrs(args.initial_peers)
    if not trusted:
        logger.warning("no trusted orchestrator peer id (none in --initial-peers, no --trust-orchestrator): "
                       "only server records will be shown, no chains or queue")
    try:
        sd = SwarmDHT.create(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs,
                             identity_path=args.identity_path, client_mode=True, prefix=prefix)
    except Exception as e:  # noqa: BLE001 - bad multiaddrs or unreachable peers: say so and exit
        print(f"error: could not join the DHT via {args.initial_peers}: {e}", file=sys.stderr)
        return 2
    source = DhtSwarmSource(sd, prefix, trusted, interval_s=args.poll_interval, initial_peers=args.initial_peers)
    try:
        source.start()
        app = create_app(source.view, source.health)
        print(f"dashboard for DHT prefix {prefix!r} (trusting orchestrator {', '.join(trusted) or 'none'})", flush=True)
        print(f"dashboard: http://{args.host}:{args.port}/", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        source.stop()
        sd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
