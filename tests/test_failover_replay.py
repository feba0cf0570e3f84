"""Failover replays only the failed hop (real orchestrator and servers as processes, LocalSwarm).

Four servers of four blocks each form two chains over an 8-block model, so every span has a second server. A
server is SIGKILLed mid-generation: the job keeps its chain lease and its other hop, the dead hop's span moves to
the other server holding it, which replays the hop's stored inputs; greedy output stays token-exact.
"""

from __future__ import annotations


import httpx
import pytest
import torch

from conftest import kill_hop_during
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

MAX_LENGTH = 192


def test_killed_hop_replays_only_its_span(tiny_model_factory, tmp_path, scaled):
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("llama", num_layers=8)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    n_new = 150
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    mem = memory_for(model, MAX_LENGTH, 4, 2)
    # 10 ms emulated per hop: the 150-token job lasts seconds, so it is still running when its hop is killed even on
    # a fast machine (a stress run once saw it finish first: no failover to count)
    servers = [LocalServer(name, mem, tau_p=0.002, emulate_rtt_ms=10.0) for name in ("a1", "b1", "a2", "b2")]
    sw = LocalSwarm(model, servers, max_length=MAX_LENGTH, arrival_rate=1.0, log_dir=tmp_path,
                    orchestrator_args=["--replan-interval-s", "3600"])
    sw.start(timeout=scaled(120))
    try:
        sw.wait_ready(timeout=scaled(150))
        # a server that joined after the first plan's settle time (a slow start on a loaded machine) is in the
        # next plan: the first one can have one chain (CI saw it once)
        sw.wait_until(lambda st: len(st["chains"]) >= 2 and all(len(ch["names"]) == 2 for ch in st["chains"]),
                      scaled(120), "two chains of two servers")
        # the job holds its chain for 150 tokens; some tokens first, so the replay has a prefix to re-feed
        comp, chain = kill_hop_during(
            sw, lambda: sw.client(timeout=scaled(240)).complete(prompt, max_tokens=n_new, ignore_eos=True), 1,
            find_s=scaled(30), settle_s=0.5, join_s=scaled(240))
        victim, kept = chain["names"][1], chain["names"][0]
        assert comp.token_ids == expected
        assert comp.failovers == 1
        relay = sw.swarm()["relay"]
        metrics = httpx.get(f"{sw.url}/metrics", timeout=10).text
        names = {s["peer_id"]: s["public_name"] for s in sw.swarm()["servers"]}
        served_by = [names.get(p, p) for p in comp.chain]
        print(f"killed {victim} of {chain['names']}; served by {served_by}; relay {relay}")
        replaced = [p for p in sw.swarm()["plans"] if p["kind"] == "placement" and p["epoch"] >= 2]
        if replaced and relay["replays_full"] == 1:
            # The planner re-placed blocks when the victim left (a better placement for the servers left) and the
            # twin that held the dead hop's span moved: no server had that span any more, so the job replayed on a
            # whole chain. Legitimate, and still token-exact (above); the partial replay is not testable this run.
            assert relay["replays_partial"] == 0, relay
            return
        assert served_by[0] == kept and served_by[1] not in (victim, kept)  # the job kept its first hop
        assert relay["replays_full"] == 0 and relay["replays_partial"] == 1, relay
        tokens = relay["replayed_tokens_partial"]
        assert len(prompt) <= tokens < len(prompt) + n_new  # the prefix up to the failure, not more
        assert relay["replayed_token_blocks_partial"] == 4 * tokens  # through the dead hop's 4 blocks only
        assert 'petals_chain_failover_replays_total{kind="partial"} 1.0' in metrics
        assert "petals_chain_replay_cache_bytes" in metrics
        cache = relay["replay_cache"]
        assert cache["bytes"] == 0 and cache["budget_bytes"] > 0  # the finished job's inputs were released
    finally:
        sw.stop()
