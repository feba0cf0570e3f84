"""Soak for unbounded growth: drive a tiny-model swarm with thousands of requests (cancels, client disconnects, bad
requests, sessions closed and abandoned, n > 1) and say which containers of the orchestrator and of the server grew
between the end of a warm-up and the end of the run.

The orchestrator and one server run in this process (each on its event loop in a thread), so that every dict, list,
set and deque reachable from them is measured by attribute path (``orch.dispatch._waiters``); what grows with the
requests (``grew`` > ``--tolerance`` entries per 1,000 requests) is a leak. ``tracemalloc``'s largest growth by
source line is printed too (``--tracemalloc``: it slows everything down ~3x). Containers bounded by time windows
(arrival rates 300 s, per-client usage and the fairness meter 60 s) show as growing in a run shorter than their
window, those bounded by a size (maxlen, a capacity) until they fill: read them against their bound.

    PETALS_CHAIN_LAUNCH=exec python scripts/soak_growth.py --requests 2000
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
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, positive_int  # noqa: E402

_SKIP_MODULES = ("asyncio", "logging", "threading", "prometheus_client", "hivemind", "concurrent", "multiaddr",
                 "torch", "transformers", "tokenizers", "httpx", "uvicorn", "starlette", "fastapi", "pydantic",
                 "safetensors", "numpy", "weakref", "_weakrefset")
_CONTAINERS = (dict, list, set, frozenset, collections.deque)


def container_sizes(root: Any, name: str, depth: int = 5) -> dict[str, int]:
    """``{attribute path: len}`` of every dict, list, set and deque reachable from ``root`` through attributes (and
    through the first few values of containers, paths ending ``[]``), ``depth`` levels deep; each object once."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, left: int) -> None:
        if left < 0 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, _CONTAINERS):
            out[path] = max(out.get(path, 0), len(obj))
            values = obj.values() if isinstance(obj, dict) else () if isinstance(obj, (set, frozenset)) else obj
            for v in list(values)[:3]:
                walk(v, f"{path}[]", left - 1)
            return
        if isinstance(obj, (str, bytes, int, float, bool, type(None), type, types.FunctionType, types.MethodType,
                            types.ModuleType)):
            return
        if type(obj).__module__.split(".")[0] in _SKIP_MODULES:
            return
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            return
        for k, v in list(attrs.items()):
            walk(v, f"{path}.{k}", left - 1)

    walk(root, name, depth)
    return out


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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _one(c: Any, i: int, model: str, tokens: int) -> str:
    """Request ``i`` of the mix; returns what kind it was."""
    import httpx

    kind = ("plain", "stream_cut", "give_up", "bad", "session", "session_abandoned", "n2", "chat_stop")[i % 8]
    prompt = f"soak request {i} " + "x " * (i % 5)
    if kind == "plain":
        await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": tokens})
    elif kind == "stream_cut":  # the client leaves after the first event
        async with c.stream("POST", "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                             "stream": True, "ignore_eos": True}) as r:
            async for _ in r.aiter_lines():
                break
    elif kind == "give_up":  # the client's timeout runs out while its request waits or runs
        with contextlib.suppress(httpx.TimeoutException):
            await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 32,
                                                  "ignore_eos": True}, timeout=0.05)
    elif kind == "bad":
        await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": -1})
    elif kind in ("session", "session_abandoned"):
        r = await c.post("/api/v1/sessions", json={"max_length": 48})
        sid = r.json().get("session_id")
        if sid:
            await c.post(f"/api/v1/sessions/{sid}/generate", json={"prompt": prompt, "max_tokens": tokens})
            if kind == "session":
                await c.delete(f"/api/v1/sessions/{sid}")
    elif kind == "n2":
        await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": tokens, "n": 2,
                                              "temperature": 0.8})
    else:
        await c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": prompt}],
                                                   "max_tokens": tokens, "stop": ["a"]})
    return kind


async def _drive(port: int, model: str, first: int, count: int, concurrency: int, tokens: int) -> dict[str, int]:
    import httpx

    kinds: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with sem:
            try:
                kinds[await _one(c, i, model, tokens)] += 1
            except Exception as e:  # noqa: BLE001 - counted: the soak measures growth, not answers
                failures[type(e).__name__] += 1

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        await asyncio.gather(*(run(i) for i in range(first, first + count)))
    return {**kinds, **{f"error:{k}": v for k, v in failures.items()}}


def _settle(orch_loop: LoopThread, orch: Any, timeout: float = 30.0) -> None:
    """Wait until nothing runs or waits (cancelled requests unwind), so that two snapshots compare like states."""
    async def idle() -> bool:
        return orch.dispatch.running == 0 and orch.dispatch.queue_length == 0

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not orch_loop.call(idle()):
        time.sleep(0.2)
    time.sleep(1.0)
    gc.collect()


def _snapshot(orch: Any, server: Any, handlers: list) -> dict[str, int]:
    sizes = container_sizes(orch, "orch")
    if server is not None:
        sizes.update(container_sizes(server, "server"))
    for k, h in enumerate(handlers):
        sizes.update(container_sizes(h, f"handler{k}"))
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=2000, help="requests after the warm-up")
    ap.add_argument("--warmup", type=positive_int, default=400, help="requests before the first snapshot")
    ap.add_argument("--concurrency", type=positive_int, default=8)
    ap.add_argument("--tokens", type=positive_int, default=4, help="max_tokens of most requests")
    ap.add_argument("--session-idle-s", type=nonnegative_float, default=2.0,
                    help="--session-idle-timeout-s (the reaper closes abandoned sessions after it)")
    ap.add_argument("--tolerance", type=nonnegative_float, default=5.0,
                    help="growth per 1,000 requests below which a container is not reported")
    ap.add_argument("--tracemalloc", action="store_true", help="also compare tracemalloc snapshots (slower)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="soak-growth-"))
    try:  # the tiny model's files go with the run (each run left its own directory under /tmp)
        return _soak(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _soak(args: argparse.Namespace, work: Path) -> int:
    """The soak of :func:`main` with the tiny model under ``work``; the roles are stopped whatever happens."""
    from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.api import create_app
    from petals_chain.server.config import ServerConfig
    from petals_chain.server.server import Server
    from petals_chain.swarm.local import memory_for
    from petals_chain.swarm.rpc import PetalsChainBlocks
    from petals_chain.swarm.tiny_model import build_tiny_model

    import uvicorn

    model = str(build_tiny_model(work / "model", num_layers=2, num_shards=1))
    max_length = 64
    cfg = OrchestratorConfig(model=model, port=0, max_length=max_length, settle_s=0.5, arrival_rate=1.0,
                             session_idle_timeout_s=args.session_idle_s)
    orch = Orchestrator(cfg)
    orch.load_model()
    ol = LoopThread("orchestrator")
    ol.call(orch.start())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(create_app(orch), log_level="error", lifespan="off"))
    ol.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(web.serve(sockets=[sock])))

    sl = LoopThread("server")
    server = Server(ServerConfig(model=model, initial_peers=orch.initial_peers, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                                 memory_bytes=memory_for(model, max_length, 2, 8), public_name="soak", tau_p=0.002,
                                 max_length=max_length, refresh_s=2.0, assignment_poll_s=0.3, progress=False))
    serving = asyncio.run_coroutine_threadsafe(server.run(), sl.loop)
    out: dict[str, Any] = {"requests": args.requests, "warmup": args.warmup}
    try:
        deadline = time.monotonic() + 180
        while not (orch.ready and orch.dispatch.chains):
            if serving.done() or time.monotonic() > deadline:
                print("error: the swarm did not become ready", file=sys.stderr)
                return 1
            time.sleep(0.3)
        handlers = [o for o in gc.get_objects() if isinstance(o, PetalsChainBlocks)]
        t0 = time.monotonic()
        out["warmup_kinds"] = ol.call(_drive(port, orch.model_id, 0, args.warmup, args.concurrency, args.tokens))
        _settle(ol, orch, 30 + 2 * args.session_idle_s)
        time.sleep(2 * args.session_idle_s + 5)  # the reaper closes the warm-up's abandoned sessions
        if args.tracemalloc:
            tracemalloc.start(5)
        before = _snapshot(orch, server, handlers)
        snap0 = tracemalloc.take_snapshot() if args.tracemalloc else None
        t1 = time.monotonic()
        out["kinds"] = ol.call(_drive(port, orch.model_id, args.warmup, args.requests, args.concurrency, args.tokens))
        out["run_s"] = round(time.monotonic() - t1, 1)
        _settle(ol, orch, 30 + 2 * args.session_idle_s)
        time.sleep(2 * args.session_idle_s + 5)
        after = _snapshot(orch, server, handlers)
        per_k = 1000.0 / args.requests
        grew = {k: {"before": before.get(k, 0), "after": n, "per_1000": round((n - before.get(k, 0)) * per_k, 1)}
                for k, n in after.items() if (n - before.get(k, 0)) * per_k > args.tolerance}
        out["grew"] = grew
        out["containers"] = len(after)
        if snap0 is not None:
            stats = tracemalloc.take_snapshot().compare_to(snap0, "lineno")
            out["tracemalloc_top"] = [{"where": str(s.traceback[0]), "kib": round(s.size_diff / 1024, 1),
                                       "blocks": s.count_diff} for s in stats[:15]]
            tracemalloc.stop()
        out["total_s"] = round(time.monotonic() - t0, 1)
    finally:
        with contextlib.suppress(Exception):
            server._on_signal()
            serving.result(60)
        web.should_exit = True
        with contextlib.suppress(Exception):
            ol.call(orch.stop(), timeout=60)
        ol.stop()
        sl.stop()
    print(json.dumps(out, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    print(f"{len(out.get('grew', {}))} container(s) grew by more than {args.tolerance:g} per 1,000 requests "
          f"(of {out.get('containers', 0)} measured)")
    return 1 if out.get("grew") else 0


if __name__ == "__main__":
    sys.exit(main())
