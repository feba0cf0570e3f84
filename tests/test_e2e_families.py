"""Greedy output through a real two-server swarm equals transformers' generate for Mistral and Qwen2 (GQA).

The Mistral swarm mixes the two KV caches in one chain: one server keeps slots (``--kv-cache slots``), the other
pages of 4 tokens (steps cross page boundaries all the time); the Qwen2 swarm runs the default (paged, 16)."""

from __future__ import annotations

import pytest
from conftest import hf_greedy_from

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

MAX_LENGTH = 128


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_greedy_equals_transformers(family, tiny_model_factory, tmp_path):
    from transformers import AutoTokenizer

    path = tiny_model_factory(family, num_layers=6)
    # Neither server can hold the whole model: every chain has two hops.
    mem = memory_for(path, MAX_LENGTH, 4, 2)
    kv = {"x": ["--kv-cache", "slots"], "y": ["--page-size", "4"]} if family == "mistral" else {"x": [], "y": []}
    servers = [LocalServer("x", mem, tau_p=0.001, extra_args=kv["x"]),
               LocalServer("y", mem, tau_p=0.001, emulate_rtt_ms=1, extra_args=kv["y"])]
    tok = AutoTokenizer.from_pretrained(str(path))
    with LocalSwarm(path, servers, max_length=MAX_LENGTH, arrival_rate=1.0, log_dir=tmp_path) as sw:
        st = sw.wait_ready(timeout=150)
        assert all(len(ch["servers"]) == 2 for ch in st["chains"])
        kinds = {s["public_name"]: (s["kv_cache"], s["page_size"]) for s in st["servers"]}
        want = {"x": ("slots", MAX_LENGTH), "y": ("paged", 4)} if family == "mistral" else \
            {"x": ("paged", 16), "y": ("paged", 16)}
        assert kinds == want
        assert all(s["cache_tokens_free"] == s["cache_tokens_total"] > 0 for s in st["servers"])
        client = sw.client()
        for prompt in ["The quick brown fox", "What is two plus two?"]:
            ref = hf_greedy_from(path, tok(prompt)["input_ids"], 20)
            comp = client.complete(prompt, max_tokens=20)
            assert comp.token_ids == ref, (family, prompt)
            assert len(comp.chain) == 2
    assert sw.leftover_processes() == []
