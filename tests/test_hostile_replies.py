"""Servers whose step replies are invalid (NaN, wrong shape, wrong dtype, absurd chunking): real processes, real
hivemind P2P on loopback. A bad reply is a hop failure for its session only: it never reaches the batched LM
head, the other sessions of the batch keep exact output, and the bad server's session fails over."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from petals_chain.swarm.local import memory_for

pytestmark = pytest.mark.slow

MAX_LENGTH = 64
MODES = ("nan", "shape", "dtype", "chunks")  # the order tests/hostile_server.py --mode cycle uses


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def test_client_refuses_each_invalid_reply_at_once(model_path, tmp_path, scaled):
    """RemoteSession.step against the hostile server, one session per mode: each raises InvalidReply (a
    ConnectionError: the server is faulty) at once, without waiting for the chunks a reply announces."""
    import subprocess
    import sys

    from conftest import REPO_ROOT
    from petals_chain.swarm.dht import SwarmDHT
    from petals_chain.swarm.rpc import ServerClient

    orch = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    log = tmp_path / "hostile.log"
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "hostile_server.py"), "--model", str(model_path),
                             "--initial-peers", *orch.visible_maddrs(), "--memory-bytes", "1000000", "--mode", "cycle"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + scaled(60)
        while "PEER_ID" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        peer = log.read_text().split("PEER_ID ", 1)[1].split()[0]

        async def main():
            p2p = await orch.replicate_p2p()
            try:
                client = ServerClient(p2p, step_timeout_s=scaled(30))
                out = {}
                for k, mode in enumerate(MODES):
                    sess = await client.open_session(peer, f"{mode}-{k}", 0, 2, MAX_LENGTH)
                    t0 = time.monotonic()
                    try:
                        got = await sess.step(torch.randn(1, 3, 64), 0)
                        out[mode] = ("returned", got.dtype, list(got.shape), bool(torch.isfinite(got).all()))
                    except Exception as e:  # noqa: BLE001
                        out[mode] = (type(e).__name__, isinstance(e, ConnectionError), time.monotonic() - t0)
                    assert sess.closed or out[mode][0] == "returned"
                return out
            finally:
                await p2p.shutdown()

        out = asyncio.run(main())
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        orch.shutdown()
    print(out)
    for mode in MODES:
        assert out[mode][:2] == ("InvalidReply", True), (mode, out)
        assert out[mode][2] < scaled(5), (mode, out)  # not the step timeout


@pytest.fixture
def swarm(model_path, tmp_path):
    from inprocess import InProcessSwarm

    # job_tokens=MAX_LENGTH: chain capacities stay in max_length slots (not learnt from the requests' lengths), so
    # that each round's burst of 12 fills every chain
    sw = InProcessSwarm(model_path, tmp_path, max_length=MAX_LENGTH, arrival_rate=1.0, ban_base_s=1.0, ban_max_s=1.0,
                        replan_interval_s=2.0, job_tokens=MAX_LENGTH)
    try:
        sw.start()
        sw.add_server("whole", memory_for(model_path, MAX_LENGTH, 4, 8), tau_p=0.01)
        # The hostile server claims the whole model and a speed no honest server has: the planner puts it on the
        # fastest chain (alone: its replies go straight to the batched LM head), again after every ban (it keeps
        # its span while banned). Each round writes the mode it corrupts with to hostile.mode.
        sw.add_hostile("hostile", memory_for(model_path, MAX_LENGTH, 4, 4), "--tau-p", "0.00001", "--slots", "16",
                       "--mode-file", str(tmp_path / "hostile.mode"))
        yield sw
    finally:
        sw.stop()


def _hostile_in_chain(st: dict) -> bool:
    return any("hostile" in ch["names"] for ch in st["chains"]) and all(
        s["state"] == "online" for s in st["servers"] if s["public_name"] == "whole")


def test_bad_replies_fail_over_and_never_reach_the_head(swarm, model_path, tmp_path, scaled):
    """Round by round (one bad-reply mode each), a burst of greedy requests fills every chain while the hostile
    server is on the fastest one: every request is token-exact, the hostile server's sessions fail over."""
    from transformers import AutoModelForCausalLM

    from petals_chain.orchestrator.sampling import SamplingParams

    ref_model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    prompts = [[1 + (7 * i + j) % 200 for j in range(5 + i % 6)] for i in range(12)]  # 12: every chain slot
    with torch.no_grad():
        refs = [ref_model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):]
                .tolist() for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    rounds = []
    for mode in MODES:
        (tmp_path / "hostile.mode").write_text(mode)
        st = swarm.wait_until(_hostile_in_chain, scaled(120), f"the hostile server back in a chain ({mode} round)")
        assert sum(ch["capacity"] for ch in st["chains"]) <= len(prompts)  # the burst fills the hostile chain too
        bad_before = swarm.log("hostile").count(f"BAD_REPLY {mode} ")
        failovers_before = swarm.orch.stats.failovers
        futures = [swarm.submit(lambda orch, p=p: orch.generate(p, params)) for p in prompts]
        results = [f.result(scaled(240)) for f in futures]
        bad = swarm.log("hostile").count(f"BAD_REPLY {mode} ") - bad_before
        got = [r.token_ids for r in results]
        rounds.append({"mode": mode, "bad_replies": bad, "failovers": swarm.orch.stats.failovers - failovers_before,
                       "exact": sum(g == r for g, r in zip(got, refs))})
        assert bad >= 1, rounds  # the hostile server did serve (and corrupt) this round
        assert got == refs, rounds
        assert rounds[-1]["failovers"] >= bad, rounds
    st = swarm.state()
    hostile = next(s for s in st["servers"] if s["public_name"] == "hostile")
    print(rounds, st["relay"])
    assert hostile["strikes"] >= len(MODES)
    assert swarm.orch.stats.failed == 0
