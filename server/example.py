"""Runnable example: a volunteer server joins a (local) swarm, loads its assigned blocks and serves a step.

    python server/example.py                # builds a tiny model, everything on loopback, ~20 s on a laptop
    python server/example.py --model DIR    # your own HF-format model directory

What it does, in the order a real deployment does it:
1. a stand-in orchestrator starts the DHT (in a real swarm: ``python -m petals_chain.orchestrator``), and
   prints its multiaddrs, which are the swarm's initial peers;
2. the volunteer runs exactly the command from server/README.md:
       python -m petals_chain.server --model DIR --initial-peers MADDR --memory-gb 0.05 --public-name example
3. the server announces itself (state joining), the orchestrator publishes a signed assignment,
   the server loads its blocks and goes online with floor((M_j - s_m m_j) / s_c) cache slots;
4. the orchestrator opens a session, relays one step through the server and checks the result;
5. SIGTERM: the server drains, announces offline and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF-format model directory (default: build a tiny Llama)")
    ap.add_argument("--memory-gb", default="0.05")
    args = ap.parse_args()

    from petals_chain.swarm.dht import SwarmDHT
    from petals_chain.swarm.keys import default_dht_prefix
    from petals_chain.swarm.records import AssignmentRecord
    from petals_chain.swarm.rpc import ServerClient

    workdir = Path(tempfile.mkdtemp(prefix="petals-chain-example-"))
    if args.model is None:
        from petals_chain.swarm.tiny_model import build_tiny_model

        model = str(build_tiny_model(workdir / "tiny-llama", family="llama", num_layers=4))
        print(f"built a tiny Llama in {model}")
    else:
        model = args.model
    prefix = default_dht_prefix(model)

    orchestrator = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial_peers = orchestrator.visible_maddrs()
    print("stand-in orchestrator; initial peers:", " ".join(initial_peers))

    cmd = [sys.executable, "-m", "petals_chain.server", "--model", model, "--initial-peers", *initial_peers,
           "--memory-gb", args.memory_gb, "--public-name", "example", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
           "--assignment-poll-s", "0.5", "--no-progress"]
    print("volunteer runs:", " ".join(cmd[1:]))
    log = open(workdir / "server.log", "wb")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # 1. wait for the server's record (state "joining", tau_p measured)
        deadline = time.time() + 120
        peer = None
        while time.time() < deadline and peer is None:
            for pid, rec in orchestrator.fetch_servers(prefix).items():
                if rec.public_name == "example" and rec.tau_p > 0:
                    peer = pid
            if server.poll() is not None:
                raise RuntimeError(f"server exited early:\n{(workdir / 'server.log').read_text()}")
            time.sleep(0.3)
        if peer is None:
            raise TimeoutError("the server never announced itself")
        rec = orchestrator.fetch_servers(prefix)[peer]
        print(f"server {peer} announced: state={rec.state} M_j={rec.memory_bytes} tau_p={rec.tau_p:.4f}s")

        # 2. publish a signed assignment: the whole (tiny) model on this server
        from petals_chain.swarm.checkpoint import load_config

        num_layers = int(load_config(model).num_hidden_layers)
        orchestrator.publish_assignment(prefix, AssignmentRecord(
            epoch=1, max_length=128, orchestrator_peer_id=orchestrator.peer_id,
            assignments={peer: [0, num_layers]}), expiration_s=300)
        while time.time() < deadline:
            rec = orchestrator.fetch_servers(prefix)[peer]
            if rec.state == "online":
                break
            time.sleep(0.3)
        print(f"server online: blocks [{rec.start_block}, {rec.start_block + rec.num_blocks}), "
              f"{rec.slots_total} slots of {rec.s_c_bytes} bytes (s_m = {rec.s_m_bytes} bytes)")
        expected_slots = (rec.memory_bytes - rec.s_m_bytes * rec.num_blocks) // rec.s_c_bytes
        assert rec.slots_total == expected_slots, (rec.slots_total, expected_slots)

        # 3. one relayed step
        async def one_step():
            p2p = await orchestrator.replicate_p2p()
            try:
                client = ServerClient(p2p)
                rtt = await client.ping(peer)
                sess = await client.open_session(peer, "example-job", 0, num_layers, 128)
                hidden = torch.randn(1, 4, rec_hidden(model))
                out = await sess.step(hidden, 0)
                await sess.close()
                return rtt, out
            finally:
                await p2p.shutdown()

        rtt, out = asyncio.run(one_step())
        print(f"ping {rtt * 1e3:.1f} ms; step output {tuple(out.shape)}, finite={bool(torch.isfinite(out).all())}")

        # 4. clean shutdown
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        state = orchestrator.fetch_servers(prefix)[peer].state
        print(f"server exited with {code}; its record says {state}")
        if code == 0 and state == "offline":
            print("EXAMPLE OK")
            return 0
        return 1
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
        orchestrator.shutdown()


def rec_hidden(model: str) -> int:
    from petals_chain.swarm.checkpoint import load_config

    return int(load_config(model).hidden_size)


if __name__ == "__main__":
    sys.exit(main())
