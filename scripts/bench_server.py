"""Benchmark one server hop on loopback; prints JSON.

Measured in the same run, from this process to two helper processes on 127.0.0.1:
* ``bare_unary_rtt_ms``  — a bare hivemind unary protobuf RPC that echoes a ``[1, 1, hidden]`` tensor;
* ``bare_stream_rtt_ms`` — the same echo on a bidirectional hivemind stream (what our sessions ride on);
* ``hop_step_ms``        — one decode step (1 token) of an open session through a real
  ``python -m petals_chain.server`` hosting ``--hop-blocks`` blocks (compute included);
* ``local_step_ms``      — the same blocks run locally (BlockRunner) for the same step;
* ``ratio_step_vs_bare_unary`` = hop_step / bare_unary (issue 3's goal: <= 1.3), and
  ``overhead_vs_bare_unary`` = (hop_step - local_step) / bare_unary (protocol cost without compute);
* per-token time of greedy-style decoding through the server vs the same layers run locally.

Usage: python scripts/bench_server.py [--model DIR] [--hidden-size 256] [--num-layers 4] [--steps 200]
       python scripts/bench_server.py --batching [--sessions 16] [--json]   (runs scripts/bench_batching.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_int, positive_int  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- bare echo server (helper process)

import hivemind.compression.base  # noqa: E402
from hivemind.p2p import P2P, P2PContext, ServicerBase  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402

hivemind.compression.base.USE_LEGACY_BFLOAT16 = False


class BareEcho(ServicerBase):
    """The baseline: a hivemind handler that returns the request's tensors untouched."""

    async def rpc_echo(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=request.tensors)

    async def rpc_echo_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                              ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for request in requests:
            yield runtime_pb2.ExpertResponse(tensors=request.tensors)


def run_echo_server(initial_peers: list[str]) -> None:
    async def main():
        # Connected straight to the benchmark's peer, as the server is through the DHT's bootstrap.
        p2p = await P2P.create(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        await BareEcho().add_p2p_handlers(p2p)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        print("ECHO", p2p.peer_id.to_base58(), " ".join(maddrs), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await p2p.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------- benchmark

def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def bench(args) -> dict:
    from hivemind.p2p import PeerID

    from petals_chain.server.runner import BlockRunner
    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.dht import SwarmDHT
    from petals_chain.swarm.records import AssignmentRecord
    from petals_chain.swarm.rpc import ServerClient, serialize_chunks

    workdir = Path(tempfile.mkdtemp(prefix="bench-server-"))
    if args.model:
        model = Path(args.model)
    else:
        from petals_chain.swarm.tiny_model import build_tiny_model

        model = build_tiny_model(workdir / "model", family="llama", num_layers=args.num_layers,
                                 hidden_size=args.hidden_size, num_attention_heads=max(1, args.hidden_size // 64))
    config = load_config(model)
    hidden_size, num_layers = int(config.hidden_size), int(config.num_hidden_layers)
    hop_blocks = min(args.hop_blocks or num_layers, num_layers)
    max_length = args.prefill + args.steps + 8

    orch = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix="bench")
    # Same intra-op thread count on both sides (OpenMP spinning on an oversubscribed box distorts both).
    torch.set_num_threads(args.threads)
    env = dict(os.environ, PETALS_CHAIN_CACHE_DIR=str(workdir / "cache"), OMP_NUM_THREADS=str(args.threads))
    echo = subprocess.Popen([sys.executable, __file__, "--echo-server", *orch.visible_maddrs()], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    server = subprocess.Popen(
        [sys.executable, "-m", "petals_chain.server", "--model", str(model), "--initial-peers",
         *orch.visible_maddrs(), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--dht-prefix", "bench",
         "--memory-bytes", str(args.memory_mb << 20), "--assignment-poll-s", "0.3", "--tau-p", "0.01",
         "--no-progress", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, env=env)
    try:
        echo_line = echo.stdout.readline().split()
        echo_peer = PeerID.from_base58(echo_line[1])
        line = ""
        while not line.startswith("PEER_ID"):
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                raise RuntimeError("server exited")
        peer = line.split()[1]
        orch.publish_assignment("bench", AssignmentRecord(epoch=1, max_length=max_length,
                                                          orchestrator_peer_id=orch.peer_id,
                                                          assignments={peer: [0, hop_blocks]}), 300)
        deadline = time.time() + 120
        while time.time() < deadline:
            rec = orch.fetch_servers("bench").get(peer)
            if rec is not None and rec.state == "online":
                break
            time.sleep(0.2)
        else:
            raise TimeoutError("server did not come online")

        local = BlockRunner(model, 0, hop_blocks, num_slots=hop_blocks, max_length=max_length, dtype="float32")
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randn(1, args.prefill, hidden_size, generator=gen)
        token = torch.randn(1, 1, hidden_size, generator=gen)

        async def measure():
            p2p = await orch.replicate_p2p()
            try:
                stub = BareEcho.get_stub(p2p, echo_peer)
                request = runtime_pb2.ExpertRequest(tensors=serialize_chunks(token))
                unary, streamed = [], []
                for i in range(args.warmup + args.steps):
                    t0 = time.perf_counter()
                    await stub.rpc_echo(request)
                    if i >= args.warmup:
                        unary.append(time.perf_counter() - t0)
                queue: asyncio.Queue = asyncio.Queue()

                async def requests():
                    while True:
                        item = await queue.get()
                        if item is None:
                            return
                        yield item

                responses = await stub.rpc_echo_stream(requests())
                for i in range(args.warmup + args.steps):
                    t0 = time.perf_counter()
                    queue.put_nowait(request)
                    await responses.__anext__()
                    if i >= args.warmup:
                        streamed.append(time.perf_counter() - t0)
                queue.put_nowait(None)

                # Remote and local phases are separate: OpenMP workers spin after each op and would steal
                # the other process's cores if the two were interleaved step by step.
                client = ServerClient(p2p)
                hop, local_t = [], []
                for rep in range(2):  # rep 0 warms up
                    sess = await client.open_session(peer, f"bench{rep}", 0, hop_blocks, max_length)
                    await sess.step(prompt, 0)
                    for i in range(args.steps):
                        t0 = time.perf_counter()
                        await sess.step(token, args.prefill + i)
                        if rep == 1:
                            hop.append(time.perf_counter() - t0)
                    await sess.close()
                await asyncio.sleep(0.5)
                for rep in range(2):
                    local.allocate(f"bench{rep}", 0, hop_blocks)
                    local.forward(f"bench{rep}", prompt, 0)
                    for i in range(args.steps):
                        t0 = time.perf_counter()
                        local.forward(f"bench{rep}", token, args.prefill + i)
                        if rep == 1:
                            local_t.append(time.perf_counter() - t0)
                    local.release(f"bench{rep}")
                return unary, streamed, hop, local_t
            finally:
                await p2p.shutdown()

        unary, streamed, hop, local_t = asyncio.run(measure())
    finally:
        _kill_group(server)
        _kill_group(echo)
        orch.shutdown()

    bare, step, loc = _median_ms(unary), _median_ms(hop), _median_ms(local_t)
    return {
        "model": str(model), "hidden_size": hidden_size, "hop_blocks": hop_blocks, "steps": args.steps,
        "prefill_tokens": args.prefill, "payload_bytes": hidden_size * 4,
        "bare_unary_rtt_ms": round(bare, 3), "bare_stream_rtt_ms": round(_median_ms(streamed), 3),
        "hop_step_ms": round(step, 3), "local_step_ms": round(loc, 3),
        "ratio_step_vs_bare_unary": round(step / bare, 3),
        "overhead_vs_bare_unary": round((step - loc) / bare, 3),
        "per_token_ms_through_server": round(sum(hop) / len(hop) * 1e3, 3),
        "per_token_ms_local": round(sum(local_t) / len(local_t) * 1e3, 3),
        "p90_hop_step_ms": round(sorted(hop)[int(0.9 * len(hop))] * 1e3, 3),
        "p90_bare_unary_rtt_ms": round(sorted(unary)[int(0.9 * len(unary))] * 1e3, 3),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }


def main() -> int:
    if "--batching" in sys.argv[1:]:  # issue 7: batched vs unbatched decode throughput (scripts/bench_batching.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_batching import main as batching_main

        batching_main([a for a in sys.argv[1:] if a != "--batching"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--echo-server", nargs="*", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="HF-format model directory (default: a tiny Llama)")
    ap.add_argument("--hidden-size", type=positive_int, default=256)
    ap.add_argument("--num-layers", type=positive_int, default=4)
    ap.add_argument("--hop-blocks", type=positive_int, default=None, help="blocks on the server (default: all)")
    ap.add_argument("--steps", type=positive_int, default=200)
    ap.add_argument("--warmup", type=nonnegative_int, default=20)
    ap.add_argument("--prefill", type=positive_int, default=16)
    ap.add_argument("--memory-mb", type=positive_int, default=512)
    ap.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads, here and in the server")
    args = ap.parse_args()
    if args.echo_server is not None:
        run_echo_server(args.echo_server)
        return 0
    print(json.dumps(bench(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
