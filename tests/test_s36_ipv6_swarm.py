"""A swarm over IPv6 loopback, as a user starts it: orchestrator ``--host ::1 --host-maddrs /ip6/::1/tcp/0``, a
server on ``/ip6/::1``, requests at the URL the orchestrator prints."""

from __future__ import annotations

import socket

import pytest


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this test host has no IPv6 loopback (::1)")
def test_a_swarm_on_ipv6_loopback_answers_at_the_url_it_prints(tiny_model_dir, tmp_path, scaled):
    """The ready file (and the printed line) said ``http://::1:PORT``: no client could use it (httpx: "Invalid
    port"). Now ``http://[::1]:PORT``, and the swarm there serves transformers' greedy tokens."""
    import httpx

    from petals_chain.client import Client
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for
    from conftest import hf_greedy_from

    v6 = ["--host-maddrs", "/ip6/::1/tcp/0"]
    with LocalSwarm(tiny_model_dir, [LocalServer("s6", memory_for(tiny_model_dir, 64, 4, 4), tau_p=0.01)],
                    max_length=64, log_dir=tmp_path, orchestrator_args=["--host", "::1", *v6], server_args=v6,
                    settle_s=0.5) as swarm:
        assert swarm.url.startswith("http://[::1]:"), swarm.url
        assert httpx.URL(swarm.url).port  # a URL a client accepts
        state = swarm.wait_ready(scaled(60))
        assert state["http_url"] == swarm.url
        assert all(m.startswith("/ip6/::1/") for m in swarm.initial_peers)
        assert [s["maddrs"][0].split("/")[1] for s in state["servers"]] == ["ip6"]
        prompt = [5, 6, 7, 8]
        got = Client(swarm.url, timeout=scaled(60)).complete(prompt, max_tokens=6, ignore_eos=True, temperature=0)
        assert got.token_ids == hf_greedy_from(tiny_model_dir, prompt, 6)
