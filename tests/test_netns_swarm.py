"""Swarms across hosts: the orchestrator and every server in a network namespace of their own (NetnsSwarm on
scripts/netns_swarm.py's lab), so peers dial each other's addresses on a bridge rather than 127.0.0.1.

* the real model on 1 orchestrator + 4 servers (5 hosts), token-exact, through a host dying mid-request and a
  new host joining;
* a volunteer behind NAT (a masquerading router, no inbound connections) joins through the orchestrator as a
  circuit relay, is planned and serves.

Needs root, iproute2 and nftables (scripts/setup.sh installs nftables); skips with the reason elsewhere."""

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import hf_greedy_from, kill_hop_during
from test_real_model import reference_no_stop
from petals_chain.swarm.local import LocalServer, memory_for, model_memory

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "netns_swarm.py"
_spec = importlib.util.spec_from_file_location("_netns_swarm", SCRIPT)
nl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nl
_spec.loader.exec_module(nl)

pytestmark = pytest.mark.slow


@pytest.fixture
def lab():
    ok, why = nl.available()
    if not ok:
        pytest.skip(why)
    ok, why = nl.nat_available()
    if not ok:
        pytest.skip(why)
    with nl.NetnsLab(tag="pytest") as lab:
        yield lab


def _server(st: dict, name: str) -> dict:
    return next(s for s in st["servers"] if s["public_name"] == name)


def test_nat_volunteer_joins_through_the_relay_and_serves(lab, tiny_model_dir, tmp_path, scaled):
    from petals_chain.swarm.netns import NetnsSwarm

    mem = memory_for(tiny_model_dir, 64, blocks=2, slots_per_block=4)  # each holds half of the 4 blocks
    with NetnsSwarm(lab, tiny_model_dir, [LocalServer("public", mem, tau_p=0.01)], max_length=64,
                    log_dir=tmp_path) as swarm:
        swarm.add_server(LocalServer("home", mem, tau_p=0.01), nat=True)
        st = swarm.wait_until(lambda st: st["ready"] and _server(st, "home")["state"] == "online"
                              if any(s["public_name"] == "home" for s in st["servers"]) else False,
                              scaled(180), "the NAT'd server to serve")
        home, public = _server(st, "home"), _server(st, "public")
        assert (home["reachability"], public["reachability"]) == ("relayed", "direct")
        assert home["assigned"] and all("/p2p-circuit" in m for m in home["maddrs"])
        assert all(swarm.orchestrator_host.ip in m for m in home["maddrs"])  # the orchestrator relays
        assert all(lab.host("public").ip in m for m in public["maddrs"])
        log = (tmp_path / "server-home.log").read_text()
        assert "NOT REACHABLE" in log and lab.host("home").ip in log  # its private address was tried first
        prompt = [1, 4, 8, 15, 16, 23, 42]
        c = swarm.client().complete(prompt, max_tokens=8)
        assert c.token_ids == hf_greedy_from(tiny_model_dir, prompt, 8)
        assert home["peer_id"] in c.chain and public["peer_id"] in c.chain


def test_real_model_on_five_hosts_survives_a_dead_host_and_takes_a_new_one(lab, smollm2_path, request, tmp_path,
                                                                           scaled):
    import torch

    from petals_chain.swarm.netns import NetnsSwarm
    from petals_chain.swarm.sources import resolve_source

    max_length, new_tokens = 256, 16
    n_layers, s_m, s_c = model_memory("smollm2-135m", max_length)
    mem = 15 * s_m + 48 * s_c  # at most half the model each: every chain has 2 hops or more
    servers = [LocalServer(f"s{i}", mem, tau_p=0.1, extra_args=["--max-blocks", "15"]) for i in range(4)]
    tokenizer = resolve_source("smollm2-135m").load_tokenizer()
    questions = ["What is the capital of France?", "Name three colours of the rainbow.",
                 "Why do cats purr? Answer briefly."]

    def ids(q: str) -> list[int]:
        out = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        return list(getattr(out, "input_ids", out))

    long_tokens = 48  # the request whose hop is killed: long enough to be mid-generation under any load

    # every volunteer gets blocks (--spare-servers use), whatever the plan predicts for this light load
    with NetnsSwarm(lab, "smollm2-135m", servers, max_length=max_length, arrival_rate=2.0, log_dir=tmp_path,
                    orchestrator_args=["--replan-interval-s", "3600", "--spare-servers", "use"]) as swarm:
        # the reference (loaded here if no test did yet) and its answers while the servers start and plan: before
        # the swarm, they added their whole time (the load alone is ~17 s of CPU) to the test's
        smollm2_reference = request.getfixturevalue("smollm2_reference")
        with torch.no_grad():
            expected = {q: smollm2_reference.generate(torch.tensor([ids(q)]), max_new_tokens=new_tokens,
                                                      do_sample=False, pad_token_id=tokenizer.eos_token_id
                                                      )[0, len(ids(q)):].tolist() for q in questions}
        long_expected = reference_no_stop(smollm2_reference, ids(questions[1]), long_tokens)
        st = swarm.wait_until(lambda st: st["ready"] and len(st["servers"]) == 4 and all(
            s["state"] == "online" and s["assigned"] for s in st["servers"]), scaled(400), "four servers with blocks")
        hosts = {s["public_name"]: s["maddrs"] for s in st["servers"]}
        assert all(s["reachability"] == "direct" for s in st["servers"])
        for name, maddrs in hosts.items():  # every server is dialed at its own host's address
            assert maddrs and all(lab.host(name).ip in m for m in maddrs), (name, maddrs)
        client = swarm.client()
        c = client.chat_completion([{"role": "user", "content": questions[0]}], max_tokens=new_tokens, relay="push")
        assert c.token_ids == expected[questions[0]]  # servers pushing to each other across hosts

        def ask():
            return client.chat_completion([{"role": "user", "content": questions[1]}], max_tokens=long_tokens,
                                          ignore_eos=True)

        got, chain = kill_hop_during(swarm, ask, 1, find_s=scaled(60), settle_s=0.5, join_s=scaled(300))
        assert got.token_ids == long_expected
        assert got.failovers >= 1, chain  # the dead host's hop was replaced mid-request

        # a new host joins mid-run: dialed at its own address; whether the plan gives it blocks now depends on
        # what the planner predicts for the servers left (it may keep the chains it has), so that is not asked
        swarm.add_server(LocalServer("s4", mem, tau_p=0.1, extra_args=["--max-blocks", "15"]))
        st = swarm.wait_until(lambda st: st["ready"] and any(s["public_name"] == "s4" and s["reachability"] == "direct"
                                                             for s in st["servers"]), scaled(300), "the new host")
        assert all(lab.host("s4").ip in m for m in _server(st, "s4")["maddrs"])
        for q in questions:
            assert client.chat_completion([{"role": "user", "content": q}], max_tokens=new_tokens).token_ids == expected[q]
