"""A server that opened a job lean on its cached prefix and then refused its first step for want of pages (the
chain's other hop matched less) is full for now, not failed: the job re-opens its chain and waits its turn (real
orchestrator and servers as processes, LocalSwarm)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory

pytestmark = pytest.mark.slow

MAX_LENGTH = 128
SYSTEM = list(range(3, 51))  # a shared system prompt of 3 pages of 16 tokens
JOBS = 6


def test_lean_first_step_refused_is_a_wait_not_a_failover(tiny_model_factory, tmp_path, scaled):
    """Server ``a`` (a prefix cache, 24 pages) and ``b`` (--no-prefix-cache) form the one chain, so every chain
    session starts at 0 and ``a``'s sessions opened lean on the cached system prompt need its pages at their first
    step. Six concurrent requests sharing the prompt: some steps were refused no_capacity. Each refusal was handled
    as a failed server (a failover, a full replay, and after --max-failovers of them the request failed 503); then
    it was a preemption and the job re-opened naming no prefix (a full reservation, queued at the server). Now no
    prefix is named to a chain with a hop that has no prefix cache: nothing is refused (the refusal's handling is
    test_s34_lean_refusal_bounds')."""
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("llama", num_layers=4)
    prompts = [SYSTEM + [200 + i, 300 + i] for i in range(JOBS)]
    _, s_m, s_c = model_memory(model, MAX_LENGTH)
    # a: 3 slots of 128 tokens = 24 pages (a job declares 50 + 16 tokens: 5 pages in each of its 2 blocks)
    servers = [LocalServer("a", 2 * s_m + 3 * s_c, tau_p=0.002, extra_args=["--max-blocks", "2"]),
               LocalServer("b", 2 * s_m + 40 * s_c, tau_p=0.002, extra_args=["--max-blocks", "2", "--no-prefix-cache"])]
    # --job-tokens 16: the chain admits many jobs at once (their opens wait or go lean at the server)
    sw = LocalSwarm(model, servers, max_length=MAX_LENGTH, arrival_rate=1.0, log_dir=tmp_path,
                    orchestrator_args=["--replan-interval-s", "3600", "--job-tokens", "16",
                                       "--output-reserve-tokens", "16"])
    sw.start(timeout=scaled(120))
    try:
        # the reference outputs while the servers start up (their joins and the first plan wait on the DHT)
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        with torch.no_grad():
            expected = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):]
                        .tolist() for p in prompts]
        sw.wait_ready(timeout=scaled(150))
        sw.wait_until(lambda st: any(len(ch["names"]) == 2 for ch in st["chains"]), scaled(120), "a chain of two")
        client = sw.client(timeout=scaled(120))
        assert client.complete(prompts[0], max_tokens=12, ignore_eos=True).token_ids == expected[0]  # cached now

        def one(i: int):
            return client.complete(prompts[i], max_tokens=12, ignore_eos=True)

        with concurrent.futures.ThreadPoolExecutor(JOBS) as ex:
            comps = list(ex.map(one, range(JOBS)))
        state = sw.swarm()
        print("failovers", [c.failovers for c in comps], "job_tokens", state["job_tokens"])
        assert [c.token_ids for c in comps] == expected
        assert [c.failovers for c in comps] == [0] * JOBS
        assert state["relay"]["failovers"] == 0 and state["relay"]["replays_full"] == 0
        # b announces no prefix cache, so no prefix is named to the chain (it starts at 0 whatever a holds): a never
        # opens lean, and no step is refused (named, a run preempted 1-3 jobs: a second open each; session 35)
        assert state["job_tokens"]["preemptions"] == 0, state["job_tokens"]
        assert [s["prefix_offered_tokens"] for s in state["servers"] if s["public_name"] == "a"] == [0]
    finally:
        sw.stop()
