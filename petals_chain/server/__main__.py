"""``python -m petals_chain.server``: run a volunteer server (see ``server/README.md``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import sys
import threading
from typing import Any, Optional, Sequence

from petals_chain.server.admission import DEFAULT_MAX_KV_SHARE_PER_STRANGER, DEFAULT_MAX_KV_SHARE_STRANGERS
from petals_chain.swarm.logs import log_level, one_line
from petals_chain.swarm.version import build_version, version_asked

logger = logging.getLogger("petals_chain.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m petals_chain.server",
        description="Join a petals-chain swarm: announce memory and speed, load the blocks the orchestrator "
                    "assigns, serve inference sessions.")
    p.add_argument("--version", action="version", version=build_version(),
                   help="print the build this server runs (as its record announces it) and exit")
    p.add_argument("--model", required=True, action="append", metavar="MODEL",
                   help="the orchestrator's model: a short name (smollm2-135m), a .gguf file, an HF-format directory "
                        "or a hub name (NAME=SOURCE as given to the orchestrator works too). Repeat to offer several "
                        "models: the server holds one at a time, the one an orchestrator serving them places it on (the "
                        "first until then, or after 30 s without an orchestrator for it the first another serves)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter (a directory in peft's format: adapter_config.json and "
                        "adapter_model.safetensors) beside the model's weights; clients pick it per request by the "
                        "name the orchestrator gives it. Repeatable (at most 8 per model). With several --model: "
                        "MODEL:NAME=PATH names the model (its DHT prefix); NAME=PATH goes to every model it fits")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                   help="multiaddrs of swarm peers, e.g. the orchestrator's /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
    p.add_argument("--dht-prefix", default=None, help="DHT key prefix (default: derived from the model name)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--memory-gb", type=float, default=None, help="memory budget M_j in GiB for blocks + KV cache")
    mem.add_argument("--memory-bytes", type=int, default=None, help="memory budget M_j in bytes")
    p.add_argument("--max-blocks", type=int, default=0, metavar="N",
                   help="host at most N blocks (like PETALS' --num_blocks; 0: as many as --memory-gb allows)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quant", default="none", choices=["none", "int8", "nf4"], help="weight quantization (CUDA only)")
    p.add_argument("--public-name", default="",
                   help="name shown on the dashboard (one line of printable characters, at most 128)")
    p.add_argument("--host-maddrs", nargs="*", default=None, metavar="MADDR",
                   help="where to listen (default: all interfaces, IPv4 and IPv6 where this host has it, a random "
                        "TCP port: /ip4/0.0.0.0/tcp/0 /ip6/::/tcp/0)")
    p.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR",
                   help="the addresses other peers should dial (behind a port forward, e.g. /ip4/1.2.3.4/tcp/31337); "
                        "default: the addresses the daemon listens on")
    p.add_argument("--public-ip", default=None, metavar="IP",
                   help="shorthand: listen on all interfaces at --p2p-port and announce IP there")
    p.add_argument("--p2p-port", type=int, default=0, metavar="PORT",
                   help="TCP port for peer-to-peer traffic (default: a random one; with --public-ip: picked once)")
    p.add_argument("--nat-relay", choices=["auto", "always", "never"], default="auto",
                   help="auto: if the orchestrator cannot dial this server at its addresses, join through a relay "
                        "(the orchestrator) instead; always: relay from the start; never: announce the addresses "
                        "as they are (the server is not given blocks while the orchestrator cannot dial it)")
    p.add_argument("--identity-path", default=None,
                   help="RSA identity file: keeps the peer id across restarts (created if missing)")
    p.add_argument("--client-mode", action="store_true", help="join the DHT without accepting DHT requests")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per session the KV slots are sized for (default: the assignment's max_length)")
    p.add_argument("--trust-orchestrator", nargs="*", default=[], metavar="PEER_ID",
                   help="peer ids whose assignments are followed and whose sessions are served "
                        "(default: the peer ids in --initial-peers)")
    p.add_argument("--allow-any-client", action="store_true",
                   help="serve sessions from any peer (open swarms); assignments still need a trusted orchestrator")
    p.add_argument("--max-kv-share-per-stranger", type=_share, default=DEFAULT_MAX_KV_SHARE_PER_STRANGER,
                   metavar="F",
                   help="with --allow-any-client: the part of the KV cache one peer that is not a trusted "
                        "orchestrator may hold, its queued opens included (at least one session over the whole "
                        "span at the server's max length), and the part of --max-waiters its queued opens may fill "
                        "(at least 1); 0 < F <= 1, refused past it with stranger_quota")
    p.add_argument("--max-kv-share-strangers", type=_share, default=DEFAULT_MAX_KV_SHARE_STRANGERS, metavar="F",
                   help="with --allow-any-client: the part of the KV cache (and of --max-waiters) all untrusted peers "
                        "together may hold (at least one session of the whole span), the rest kept for the trusted "
                        "orchestrators; peer ids cost a stranger nothing, so this is what bounds many of them "
                        "(0 < F <= 1)")
    p.add_argument("--emulate-rtt-ms", type=float, default=0.0,
                   help="emulated extra round-trip time per request/reply (half each way; testbeds only)")
    p.add_argument("--emulate-compute-scale", type=float, default=1.0,
                   help="emulate a slower device: compute takes this many times longer (>= 1; testbeds only)")
    p.add_argument("--emulate-step-ms", type=float, default=0.0,
                   help="emulated per-job overhead t_o (ms per block), added to a session's first step (testbeds only)")
    p.add_argument("--emulate-prefill-ms-per-token", type=float, default=0.0,
                   help="emulated prefill time t_I (ms per block per token) for multi-token steps (testbeds only)")
    p.add_argument("--emulate-decode-ms", type=float, default=0.0,
                   help="emulated decode time t_O (ms per block per token) for one-token steps (testbeds only)")
    p.add_argument("--emulate-reply-fault", default="none", choices=["none", "nan", "shape", "noise", "push"],
                   help="chaos runs only: corrupt a fraction of step replies with NaN (last token), a wrong shape "
                        "(hidden size one short) or noise (plausible but wrong hidden states, which only an audit "
                        "catches), or (push) the outputs pushed to the next hop while replies stay right; the "
                        "server's own state stays right")
    p.add_argument("--emulate-reply-fault-rate", type=float, default=0.0, metavar="P",
                   help="fraction of step replies --emulate-reply-fault corrupts (0..1, evenly spread)")
    p.add_argument("--emulate-faulty-rate", type=float, default=None, metavar="P",
                   help="tests only: add noise to a fraction P of step replies (same as --emulate-reply-fault noise "
                        "--emulate-reply-fault-rate P); shown in the record")
    p.add_argument("--emulate-tau-p-lie", type=float, default=1.0, metavar="X",
                   help="chaos runs only: announce a tau_p X times better than measured (compute stays real)")
    p.add_argument("--cache-tokens-per-block", type=int, default=0,
                   help="cap the KV cache at this many tokens per hosted block, as PETALS' fixed attention cache "
                        "(0: every byte left after the blocks, Eq. 3)")
    p.add_argument("--kv-cache", choices=["paged", "slots"], default="paged",
                   help="paged: KV pages of --page-size tokens, a session reserves what its declared length needs "
                        "and takes pages as it grows; slots: one max_length slot per block per session (the "
                        "paper's Eq. 3 model, for the Table 1 reproduction)")
    p.add_argument("--page-size", type=int, default=16, metavar="TOKENS", help="tokens per KV page (paged mode)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="free a finished session's pages instead of keeping them for later prompts that start with "
                        "the same tokens (the prefix cache needs paged mode and a --page-size multiple of 16)")
    p.add_argument("--decode-graph", choices=["off", "cuda", "eager"], default="off",
                   help="cuda: replay one session's one-token decode step over the span as a CUDA graph (one launch "
                        "instead of ~50 kernels per block; needs --device cuda); eager: the same static-shape step "
                        "without capture, on any device (to check it)")
    p.add_argument("--no-batching", action="store_true",
                   help="run each session's step alone instead of batching concurrent sessions (for comparisons)")
    p.add_argument("--max-waiters", type=int, default=256,
                   help="opens that may wait for slots at once (opens with wait_s > 0; FIFO)")
    p.add_argument("--max-wait-s", type=float, default=600.0, help="longest wait for slots an open may ask for")
    p.add_argument("--tau-p", type=float, default=None,
                   help="skip profiling and announce this tau_p (seconds per block per job, before emulation)")
    p.add_argument("--profile-l-in", type=int, default=128, help="prefill tokens of the tau_p reference workload")
    p.add_argument("--profile-l-out", type=int, default=16, help="output tokens of the tau_p reference workload")
    p.add_argument("--profile-cache", default=None,
                   help="tau_p cache file (default ~/.cache/petals-chain/tau_p.json, under $XDG_CACHE_HOME where set)")
    p.add_argument("--refresh-s", type=float, default=30.0, help="server record refresh period (expires after 3x)")
    p.add_argument("--assignment-poll-s", type=float, default=3.0, help="how often to read the assignment")
    p.add_argument("--idle-timeout-s", type=float, default=120.0, help="close a session silent for this long")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="on reassignment or shutdown, wait this long for open sessions before closing them")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--log-level", default="INFO")
    return p


def _share(text: str) -> float:
    """argparse type of a fraction in (0, 1] (a bad value exits 2 with the flag named)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:  # NaN included
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the server handles signals (imports, reading the model): no traceback
        print("interrupted before joining the swarm", file=sys.stderr)
        return 130


def _main(argv: Optional[Sequence[str]]) -> int:
    if version_asked(argv):  # before build_parser's imports
        print(build_version())
        return 0
    from petals_chain.swarm.console import check_working_directory

    try:  # before the imports of torch and transformers, which die without one
        check_working_directory("server")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=log_level(parser, args.log_level), format="%(asctime)s [%(levelname)s] %(name)s: %(message)s",
                        stream=sys.stderr)
    from petals_chain.swarm.launch import check_shared_memory, raise_open_files_limit

    try:  # else the descriptors ran out under load (each session and P2P stream takes one): sessions refused
        raise_open_files_limit("server")
        check_shared_memory("server")  # before hivemind's import makes its locks there
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from petals_chain.server.server import Server, ServerConfig
    from petals_chain.swarm.sources import split_model_arg

    models = [split_model_arg(v)[1] for v in args.model]  # NAME=SOURCE as the orchestrator takes it: the name unused

    memory_bytes = args.memory_bytes
    if args.memory_gb is not None:
        if not 0 < args.memory_gb < math.inf:
            print("error: --memory-gb must be a positive number", file=sys.stderr)
            return 2
        memory_bytes = int(args.memory_gb * (1 << 30))
        if memory_bytes <= 0:  # under one byte: name the flag given, not --memory-bytes
            print(f"error: --memory-gb {args.memory_gb} is under one byte; give at least {1 / (1 << 30):.3g}",
                  file=sys.stderr)
            return 2
    if memory_bytes is not None and memory_bytes <= 0:
        print("error: --memory-bytes must be positive", file=sys.stderr)
        return 2
    from petals_chain.swarm.records import PUBLIC_NAME_MAX

    if len(args.public_name) > PUBLIC_NAME_MAX or one_line(args.public_name) != args.public_name:
        print(f"error: --public-name must be at most {PUBLIC_NAME_MAX} printable characters on one line, got "
              f"{args.public_name!r}", file=sys.stderr)
        return 2
    if args.emulate_faulty_rate is not None and not 0 <= args.emulate_faulty_rate <= 1:  # NaN included
        print(f"error: --emulate-faulty-rate must be in [0, 1], got {args.emulate_faulty_rate}", file=sys.stderr)
        return 2
    # A cache that could never be written was found after the model had loaded and been profiled (a warning, and
    # profiled again at every start); with --tau-p it is not used. An existing file is only read until a miss: a
    # prepared read-only cache stays usable.
    if args.profile_cache is not None and args.tau_p is None and not os.path.isfile(args.profile_cache):
        from petals_chain.swarm.paths import output_file_problem

        problem = output_file_problem(args.profile_cache, make_dirs=True, replace=True)
        if problem:
            print(f"error: --profile-cache {args.profile_cache}: {problem}", file=sys.stderr)
            return 2
    from petals_chain.server.memory import check_device_budget

    try:
        check_device_budget(args.device, memory_bytes)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from petals_chain.swarm.reachability import listen_and_announce, to_multiaddr

    try:
        for maddr in args.initial_peers:  # else the DHT's daemon refused it after the server had started
            try:
                to_multiaddr(maddr)
            except ValueError as e:
                raise ValueError(f"--initial-peers {maddr!r}: {e}") from None
        host_maddrs, announce_maddrs = listen_and_announce(args.host_maddrs, args.announce_maddrs, args.public_ip,
                                                           args.p2p_port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = ServerConfig(
            model=models[0], extra_models=tuple(models[1:]), initial_peers=args.initial_peers, dht_prefix=args.dht_prefix, memory_bytes=memory_bytes,
            device=args.device, dtype=args.dtype, quant=args.quant, public_name=args.public_name,
            host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, nat_relay=args.nat_relay,
            identity_path=args.identity_path, client_mode=args.client_mode,
            emulate_rtt_ms=args.emulate_rtt_ms, emulate_compute_scale=args.emulate_compute_scale,
            max_length=args.max_length, trust_orchestrator=args.trust_orchestrator,
            allow_any_client=args.allow_any_client, max_kv_share_per_stranger=args.max_kv_share_per_stranger,
            max_kv_share_strangers=args.max_kv_share_strangers, tau_p=args.tau_p, profile_l_in=args.profile_l_in,
            profile_l_out=args.profile_l_out, profile_cache=args.profile_cache, refresh_s=args.refresh_s,
            assignment_poll_s=args.assignment_poll_s, idle_timeout_s=args.idle_timeout_s,
            drain_timeout_s=args.drain_timeout_s, progress=False if args.no_progress else None,
            emulate_step_ms=args.emulate_step_ms, emulate_prefill_ms_per_token=args.emulate_prefill_ms_per_token,
            emulate_decode_ms=args.emulate_decode_ms, cache_tokens_per_block=args.cache_tokens_per_block,
            emulate_reply_fault="noise" if args.emulate_faulty_rate is not None else args.emulate_reply_fault,
            emulate_reply_fault_rate=(args.emulate_faulty_rate if args.emulate_faulty_rate is not None
                                      else args.emulate_reply_fault_rate),
            emulate_tau_p_lie=args.emulate_tau_p_lie, batching=not args.no_batching, max_blocks=args.max_blocks,
            max_waiters=args.max_waiters, max_wait_s=args.max_wait_s, kv_cache=args.kv_cache, page_size=args.page_size,
            prefix_cache=not args.no_prefix_cache, decode_graph=args.decode_graph, adapters=tuple(args.adapter))
        server = Server(cfg, memory_flag="--memory-gb" if args.memory_gb is not None else "--memory-bytes")
        _hash_weights(server)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from petals_chain.server.server import JoinError

    lost = threading.Event()
    try:
        code = asyncio.run(_serve(server, lost))
    except JoinError as e:
        from petals_chain.swarm.reachability import join_hint

        hint = join_hint(args.initial_peers)  # an IPv6-only host given the orchestrator's /ip4/ address
        print(f"error: {e}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
        return 1
    if lost.is_set():
        print("error: the server's DHT process died (killed, or out of memory), so it could no longer announce "
              "itself or follow assignments: stopped; start it again", file=sys.stderr)
        return 1
    return code


def _hash_weights(server: Any) -> None:
    """Every offered model's fingerprint (each weight byte hashed once per file, then cached), before the event loop
    runs: a model offered but not served was hashed when its first record was published, on the loop (about 0.7 s
    per GB here from the page cache, more from disk: a 14 GB model stalled every RPC for tens of seconds)."""
    for hosted in server.hosted:
        hosted.fingerprint  # noqa: B018 - a cached property: computed here


def _on_sighup(server: Any) -> None:
    """SIGHUP: stop as on SIGTERM, saying why (a tool that sends it to reload a configuration sees the server stop)."""
    logger.warning("SIGHUP (a closed terminal or ssh session, or a request to reload): stopping. The server has no "
                   "configuration to reload: restart it to change its options; run it under nohup to ignore SIGHUP")
    server._on_signal()


async def _serve(server: Any, lost: Optional[threading.Event] = None) -> int:
    """``server.run()``, with SIGHUP (its terminal closed, an ssh session ended) stopping it as SIGTERM does: by
    default it ended the server at once, without the ``offline`` record. Under ``nohup`` (SIGHUP ignored) it is
    still ignored.

    ``lost``: set when the DHT process dies under the running server, which then stops (it kept running, unseen,
    every DHT call failing). Not when it was stopping already: systemd's control-group stop kills both at once."""
    loop = asyncio.get_running_loop()
    import resource

    from petals_chain.swarm.launch import MAX_RAISED_OPEN_FILES, quiet_descriptor_exhaustion

    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # p2pd's streams reach hivemind's listener here
    quiet_descriptor_exhaustion(loop, MAX_RAISED_OPEN_FILES if open_files == resource.RLIM_INFINITY else open_files)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        loop.add_signal_handler(signal.SIGHUP, _on_sighup, server)
    if lost is None:
        return await server.run()
    from petals_chain.swarm.dht import on_dht_lost

    def dht_lost() -> None:
        if not server._stop.is_set():
            lost.set()
            server._on_signal()

    def from_watch_thread(sd: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the server has stopped
            loop.call_soon_threadsafe(dht_lost)

    on_dht_lost(from_watch_thread)
    try:
        return await server.run()
    finally:
        on_dht_lost(None)


def _skip_exit_collection() -> None:
    """Spare the interpreter's exit its full garbage collections (three, of the ~450,000 objects torch,
    transformers and hivemind made at import: 1.9-4.4 s on a busy 2-core host after a shutdown that took 0.1 s,
    which a ``systemctl stop``, a Ctrl-C or a swarm's stop waited out). Only at a script's exit: called in-process
    (the tests), the caller's objects would never be collected again.

    Everything else the exit does still runs: other threads joined, atexit handlers (multiprocessing's joins of the
    DHT process, logging's flush), modules torn down and objects freed by their reference counts. What is skipped is
    the search for garbage in reference cycles, which the process's end frees anyway; the server's own cleanup (the
    ``offline`` record, the DHT process and p2pd stopped) is done before :func:`main` returns."""
    gc.freeze()  # objects tracked now move to the permanent generation, which no collection scans


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:  # a crash too: its traceback is printed all the same
        _skip_exit_collection()
