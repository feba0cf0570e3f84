"""Soak in rounds: drive an orchestrator with API keys, a small ``--max-queue`` and two servers with every kind of
request a user sends, and after each round (once traffic has stopped and settled) measure what could leak.

Measured per round: every dict, list, set and deque reachable from the orchestrator, the servers and their RPC
handlers, by attribute path (``orch.dispatch._waiters``), the process's open fds, threads and RSS, the asyncio tasks
on each role's loop, the ``/metrics`` series, and on each server the sessions open and the KV pages held (reserved,
cached). The kinds: plain, streamed, streams cut after the first event, ``n`` = 2, chat with stop strings, requests
given up while queued, 429s of a full queue, deadline refusals, bad input, a wrong key (401), sessions closed,
abandoned and cut mid-turn, the Responses API cut mid-stream; each request under one of several API key names. The
roles run in this process, each on its event loop in a thread; the two servers each hold the whole model (or one
block each: ``--blocks-per-server 1``, one chain of two hops, e.g. for ``--relay push``).

The verdict: a container that grew by more than ``--tolerance`` entries per 1,000 requests from the first measured
round to the last, and still grew in the last round, is a leak: the run exits 1 and names it (so ``--rounds`` is 2
or more: from the warm-up, every cache filling for the first time read as a leak). Containers bounded by a time
window (arrival rates 300 s, per-client usage and the fairness meter 60 s) grow in a run shorter than their window,
those bounded by a size (maxlen, a capacity) until they fill: more rounds tell them apart (a bounded one levels
off). ``--tracemalloc`` adds the largest growth by allocation site.

    PETALS_CHAIN_LAUNCH=exec python scripts/soak.py --rounds 3 --requests 600
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import tracemalloc
import types
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared helpers
from _args import nonnegative_float, output_file, positive_int  # noqa: E402

NAMES = ("alice", "bob", "carol")
BURST = 10  # requests a burst sends at once (past --max-queue)
KINDS = ("plain", "stream", "stream_cut", "n2", "chat_stop", "give_up", "burst", "deadline", "bad", "wrong_key",
         "session", "session_abandoned", "session_cut", "responses_cut")


_SKIP_MODULES = ("asyncio", "logging", "threading", "prometheus_client", "hivemind", "concurrent", "multiaddr",
                 "torch", "transformers", "tokenizers", "httpx", "uvicorn", "starlette", "fastapi", "pydantic",
                 "safetensors", "numpy", "weakref", "_weakrefset")
_CONTAINERS = (dict, list, set, frozenset, collections.deque)
_ATOMS = (str, bytes, int, float, bool, type(None), type, types.FunctionType, types.MethodType, types.ModuleType)


def container_sizes(root: Any, name: str, depth: int = 5) -> dict[str, int]:
    """``{attribute path: len}`` of every dict, list, set and deque reachable from ``root`` through attributes (and
    through the first few values of containers, paths ending ``[]``), ``depth`` levels deep; each object once."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, left: int) -> None:
        # a dead weakref.proxy raises ReferenceError on isinstance or attribute access (its own type is safe)
        if left < 0 or id(obj) in seen or type(obj) in weakref.ProxyTypes:
            return
        seen.add(id(obj))
        if isinstance(obj, _CONTAINERS):
            out[path] = max(out.get(path, 0), len(obj))
            values = obj.values() if isinstance(obj, dict) else () if isinstance(obj, (set, frozenset)) else obj
            for v in list(values)[:3]:
                walk(v, f"{path}[]", left - 1)
            return
        if isinstance(obj, _ATOMS) or type(obj).__module__.split(".")[0] in _SKIP_MODULES:
            return
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            return
        for k, v in list(attrs.items()):
            walk(v, f"{path}.{k}", left - 1)

    walk(root, name, depth)
    return out


def growth(rounds: list[dict[str, int]], requests: int, tolerance: float) -> dict[str, dict[str, float]]:
    """The containers of ``rounds`` (sizes after each round, the warm-up first, ``requests`` per measured round) that
    grew by more than ``tolerance`` entries per 1,000 requests from the first measured round to the last (from the
    warm-up with one measured round) and still grew in the last round: what a bounded cache, levelled off, does not."""
    if len(rounds) < 2:
        raise ValueError("growth compares the sizes after the warm-up and after at least one measured round")
    first_at = 1 if len(rounds) >= 3 else 0
    first, before_last, last = rounds[first_at], rounds[-2], rounds[-1]
    per_k = 1000.0 / (requests * (len(rounds) - 1 - first_at))
    grew = {}
    for path, n in sorted(last.items()):
        rate = (n - first.get(path, 0)) * per_k
        if rate > tolerance and n > before_last.get(path, 0):
            grew[path] = {"first": first.get(path, 0), "before_last": before_last.get(path, 0), "last": n,
                          "per_1000": round(rate, 1)}
    return grew


class LoopThread:
    """An event loop running in a daemon thread; ``call(coro)`` runs a coroutine there and returns its result."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.loop.add_signal_handler = lambda *a, **k: None  # the roles' signal handlers belong to a main thread
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and close it (its selector's and self-pipe's fds)."""
        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                self.call(_cancel_all(), timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)


def _listen() -> socket.socket:
    """The API's listening socket on a free loopback port."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _best_effort(what: str, stop: Any, *args: Any) -> None:
    """Run one step of the shutdown; a failure is said and the other steps still run (and the run's own error,
    if any, is the one raised)."""
    try:
        stop(*args)
    except Exception as e:  # noqa: BLE001 - reported, the cleanup goes on
        print(f"warning: stopping {what} failed: {type(e).__name__}: {e}", file=sys.stderr)


def _stop_server(sl: LoopThread, server: Any, run: Any) -> None:
    sl.loop.call_soon_threadsafe(server._on_signal)  # (its stop event belongs to its loop)
    run.result(60)


def _stop_web(web: Any, serving: Any) -> None:
    web.should_exit = True
    serving.result(30)  # uvicorn closes its connections and the listening server


def _key(name: str) -> str:
    return f"soak-key-{name}-0123456789"


async def _one(c: Any, i: int, model: str, tokens: int) -> str:
    """Request ``i`` of the mix; returns its kind and status."""
    import httpx

    kind = KINDS[i % len(KINDS)]
    name = NAMES[(i // len(KINDS)) % len(NAMES)]
    h = {"Authorization": f"Bearer {_key(name)}"}
    prompt = f"soak request {i} " + "x " * (i % 5)
    body = {"model": model, "prompt": prompt, "max_tokens": tokens}
    status: Any = "-"
    if kind == "plain":
        status = (await c.post("/v1/completions", json=body, headers=h)).status_code
    elif kind in ("stream", "stream_cut"):
        async with c.stream("POST", "/v1/completions", headers=h,
                            json={**body, "max_tokens": 12, "stream": True, "ignore_eos": True}) as r:
            status = r.status_code
            async for _ in r.aiter_lines():
                if kind == "stream_cut":
                    break
    elif kind == "n2":
        status = (await c.post("/v1/completions", json={**body, "n": 2, "temperature": 0.8}, headers=h)).status_code
    elif kind == "chat_stop":
        status = (await c.post("/v1/chat/completions", headers=h, json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "stop": ["a"]})).status_code
    elif kind == "give_up":  # the client's timeout runs out while its request waits or runs
        try:
            status = (await c.post("/v1/completions", json={**body, "max_tokens": 32, "ignore_eos": True},
                                   headers=h, timeout=0.05)).status_code
        except httpx.TimeoutException:
            status = "gave_up"
    elif kind == "burst":  # a burst past --max-queue: some 429
        rs = await asyncio.gather(*(c.post("/v1/completions", json={**body, "max_tokens": 16, "ignore_eos": True},
                                           headers=h) for _ in range(BURST)))
        status = ",".join(sorted({str(r.status_code) for r in rs}))
    elif kind == "deadline":
        status = (await c.post("/v1/completions", json={**body, "max_tokens": 32, "deadline_ms": 1.0},
                               headers=h)).status_code
    elif kind == "bad":
        status = (await c.post("/v1/completions", json={**body, "max_tokens": -1}, headers=h)).status_code
    elif kind == "wrong_key":
        status = (await c.post("/v1/completions", json=body,
                               headers={"Authorization": f"Bearer wrong-key-{i:012d}"})).status_code
    elif kind == "responses_cut":  # the Responses API, streamed, the client leaving after the first event
        async with c.stream("POST", "/v1/responses", headers=h, json={
                "model": model, "input": prompt, "max_output_tokens": 12, "stream": True}) as r:
            status = r.status_code
            async for _ in r.aiter_lines():
                break
    else:
        r = await c.post("/api/v1/sessions", json={"max_length": 48}, headers=h)
        status = r.status_code
        sid = r.json().get("session_id") if r.status_code == 200 else None
        if sid and kind == "session_cut":  # a turn's stream left after its first event, then the session closed
            async with c.stream("POST", f"/api/v1/sessions/{sid}/generate", headers=h,
                                json={"prompt": prompt, "max_tokens": 12, "stream": True}) as r2:
                status = r2.status_code
                async for _ in r2.aiter_lines():
                    break
            await c.delete(f"/api/v1/sessions/{sid}", headers=h)
        elif sid:
            status = (await c.post(f"/api/v1/sessions/{sid}/generate", json={"prompt": prompt, "max_tokens": tokens},
                                   headers=h)).status_code
            if kind == "session":
                await c.delete(f"/api/v1/sessions/{sid}", headers=h)
    return f"{kind}:{status}"


async def _drive(port: int, model: str, first: int, count: int, concurrency: int, tokens: int) -> dict[str, int]:
    import httpx

    seen: collections.Counter = collections.Counter()
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with sem:
            try:
                seen[await _one(c, i, model, tokens)] += 1
            except Exception as e:  # noqa: BLE001 - counted: the soak measures growth, not answers
                seen[f"error:{type(e).__name__}"] += 1

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        await asyncio.gather(*(run(i) for i in range(first, first + count)))
    return dict(sorted(seen.items()))


def _proc_stats() -> dict[str, Any]:
    """This process's fds, threads, RSS and Python objects, and each child's (the DHT processes, p2pd)."""
    import psutil

    me = psutil.Process()
    children = {}
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            children[f"{p.pid}:{p.name()}"] = [p.num_fds(), p.num_threads(), p.memory_info().rss >> 20]
    return {"fds": me.num_fds(), "threads": me.num_threads(), "rss_mb": me.memory_info().rss >> 20,
            "gc_objects": len(gc.get_objects()), "children_fds_threads_rss": children}


def _types() -> collections.Counter:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _server_stats(server: Any) -> dict[str, int]:
    service = server.service
    runner = getattr(service, "runner", None)
    pool = getattr(runner, "pool", None)
    out = {"sessions": len(getattr(service, "sessions", {}) or {})}
    if pool is not None:
        out.update(pages_free=pool.pages_free, pages_reserved=pool.reserved, pages_cached=pool.pages_cached,
                   pages_total=pool.num_pages)
    return out


def _settle(loop: LoopThread, orch: Any, quiet_s: float, timeout: float = 60.0) -> None:
    """Wait until nothing runs or waits and the reapers have run (traffic stopped), then collect garbage."""
    async def idle() -> bool:
        return orch.dispatch.running == 0 and orch.dispatch.queue_length == 0

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not loop.call(idle()):
        time.sleep(0.2)
    time.sleep(quiet_s)
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="measured rounds after the warm-up round (2 or more: the verdict compares two)")
    ap.add_argument("--requests", type=positive_int, default=600, help="requests per measured round")
    ap.add_argument("--warmup", type=positive_int, default=None,
                    help="requests of the warm-up round (default: --requests)")
    ap.add_argument("--concurrency", type=positive_int, default=10)
    ap.add_argument("--tokens", type=positive_int, default=4, help="max_tokens of most requests")
    ap.add_argument("--max-queue", type=positive_int, default=6)
    ap.add_argument("--relay", choices=("orchestrator", "push"), default="orchestrator")
    ap.add_argument("--blocks-per-server", type=int, choices=(1, 2), default=2,
                    help="2: each server holds the whole (2-block) model; 1: one chain of two hops (for --relay push)")
    ap.add_argument("--session-idle-s", type=nonnegative_float, default=2.0,
                    help="--session-idle-timeout-s (the reaper closes abandoned sessions after it)")
    ap.add_argument("--tolerance", type=nonnegative_float, default=5.0,
                    help="growth per 1,000 requests above which a container that still grows is a leak")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="compare tracemalloc snapshots after the first measured round and the last (slower)")
    ap.add_argument("--json", type=lambda t: Path(output_file(t)), default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.rounds < 2:  # (and --tracemalloc's snapshots are taken after measured round 1 and the last)
        ap.error(f"--rounds {args.rounds}: the verdict compares the first measured round with the last, so it needs "
                 "--rounds 2 or more (growth from the warm-up is every cache filling, not a leak)")
    if args.warmup is None:
        args.warmup = args.requests
    logging.basicConfig(level=logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    try:  # the tiny model's files and the key file go with the run, whatever ends it
        return _soak(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _soak(args: argparse.Namespace, work: Path) -> int:
    """The soak of :func:`main` with the tiny model under ``work``. What was started is stopped whatever ends the
    run (a start that fails midway, a swarm that never becomes ready, an interrupt), in the reverse order."""
    import httpx
    import uvicorn

    from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.api import create_app
    from petals_chain.server.config import ServerConfig
    from petals_chain.server.server import Server
    from petals_chain.swarm.local import memory_for
    from petals_chain.swarm.rpc import PetalsChainBlocks
    from petals_chain.swarm.tiny_model import build_tiny_model

    model = str(build_tiny_model(work / "model", num_layers=2, num_shards=1))
    keys = work / "keys"
    keys.write_text("".join(f"{n} {_key(n)} max_sessions=4\n" for n in NAMES))
    keys.chmod(0o600)
    max_length = 64
    cfg = OrchestratorConfig(model=model, port=0, max_length=max_length, settle_s=0.5, arrival_rate=1.0,
                             session_idle_timeout_s=args.session_idle_s, max_queue=args.max_queue,
                             api_keys=str(keys), relay=args.relay)
    out: dict[str, Any] = {"requests": args.requests, "warmup": args.warmup, "rounds": []}
    snap0 = snap1 = None
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: tracemalloc.is_tracing() and tracemalloc.stop())  # (an interrupted run left it on)
        orch = Orchestrator(cfg)
        orch.load_model()
        ol = LoopThread("orchestrator")
        stack.callback(_best_effort, "the orchestrator's loop", ol.stop)
        # before start(): a start that fails midway (its DHT node up, say) is stopped too
        stack.callback(_best_effort, "the orchestrator", lambda: ol.call(orch.stop(), timeout=60))
        ol.call(orch.start())
        sock = _listen()
        stack.callback(sock.close)
        port = sock.getsockname()[1]
        web = uvicorn.Server(uvicorn.Config(create_app(orch), log_level="error", lifespan="off"))
        serving = asyncio.run_coroutine_threadsafe(web.serve(sockets=[sock]), ol.loop)
        stack.callback(_best_effort, "the API", _stop_web, web, serving)
        servers, loops, runs = [], [], []
        for k in range(2):
            sl = LoopThread(f"server{k}")
            stack.callback(_best_effort, f"server {k}'s loop", sl.stop)
            server = Server(ServerConfig(
                model=model, initial_peers=orch.initial_peers, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                memory_bytes=memory_for(model, max_length, args.blocks_per_server, 6), public_name=f"soak{k}",
                tau_p=0.002, max_length=max_length, refresh_s=2.0, assignment_poll_s=0.3, progress=False))
            run = asyncio.run_coroutine_threadsafe(server.run(), sl.loop)
            stack.callback(_best_effort, f"server {k}", _stop_server, sl, server, run)
            servers.append(server)
            loops.append(sl)
            runs.append(run)
        deadline = time.monotonic() + 180
        while not (orch.ready and len(orch.dispatch.chains) >= args.blocks_per_server):
            if any(r.done() for r in runs) or time.monotonic() > deadline:
                print("error: the swarm did not become ready", file=sys.stderr)
                return 1
            time.sleep(0.3)
        handlers = [o for o in gc.get_objects() if type(o) not in weakref.ProxyTypes and isinstance(o, PetalsChainBlocks)]
        quiet = 2 * args.session_idle_s + 4
        prev_types: collections.Counter = collections.Counter()
        t0 = time.monotonic()
        for rnd in range(args.rounds + 1):
            t = time.monotonic()
            first = 0 if rnd == 0 else args.warmup + (rnd - 1) * args.requests
            seen = ol.call(_drive(port, orch.model_id, first, args.warmup if rnd == 0 else args.requests,
                                  args.concurrency, args.tokens))
            run_s = time.monotonic() - t
            _settle(ol, orch, quiet)
            sizes = container_sizes(orch, "orch")
            for k, s in enumerate(servers):
                sizes.update(container_sizes(s, f"server{k}"))
            for k, h in enumerate(handlers):
                sizes.update(container_sizes(h, f"handler{k}"))
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            row = {"round": rnd, "run_s": round(run_s, 1), "seen": seen, **_proc_stats(),
                   "orch_tasks": len(ol.call(_tasks())),
                   "server_tasks": [len(sl.call(_tasks())) for sl in loops],
                   "metrics_series": sum(1 for line in metrics.splitlines() if line and not line.startswith("#")),
                   "servers": [_server_stats(s) for s in servers], "sizes": sizes}
            if args.tracemalloc and rnd == 1:
                tracemalloc.start(8)
                snap0 = tracemalloc.take_snapshot()
            elif snap0 is not None and rnd == args.rounds:
                snap1 = tracemalloc.take_snapshot()
                tracemalloc.stop()
            kinds = _types()
            if prev_types:
                row["types_grew"] = dict((kinds - prev_types).most_common(12))
            prev_types = kinds
            out["rounds"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "sizes"}), flush=True)
        out["total_s"] = round(time.monotonic() - t0, 1)
    if snap1 is not None:  # the largest growth by where it was allocated
        stats = snap1.compare_to(snap0, "traceback")
        out["tracemalloc_top"] = [{"kib": round(st.size_diff / 1024, 1), "blocks": st.count_diff,
                                   "where": [str(fr) for fr in st.traceback[-8:]]} for st in stats[:12]]
        print(json.dumps(out["tracemalloc_top"], indent=1))
    sizes_by_round = [r["sizes"] for r in out["rounds"]]
    out["grew"] = growth(sizes_by_round, args.requests, args.tolerance)
    out["containers"] = len(sizes_by_round[-1])
    print(json.dumps(out["grew"], indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    print(f"{len(out['grew'])} container(s) grew by more than {args.tolerance:g} per 1,000 requests and still grew "
          f"in the last round (of {out['containers']} measured)")
    return 1 if out["grew"] else 0


async def _tasks() -> set:
    return {t for t in asyncio.all_tasks() if not t.done()}


if __name__ == "__main__":
    sys.exit(main())
