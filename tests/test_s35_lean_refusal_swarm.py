"""The lean first-step refusal -> wait path on real processes where every hop has a prefix cache (session 35).
test_s34_lean_step_refusal's chain has a hop without one, to which no prefix is named since abbc50d, so it no longer
drives this path. Here both hops cache, in pages of different sizes: the hops hold different lengths of a prompt,
the chain starts at the shorter match, and the hop holding more, its pool full, opened lean on its match and
refuses that first step for want of pages. The job gives the chain back and re-opens it naming no prefix (a
preemption; the open queued at the server until pages free up): no failover, no 503, transformers' greedy output."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory

pytestmark = pytest.mark.slow

MAX_LENGTH = 128
SYSTEM = list(range(3, 67))  # a 64-token system prompt: 4 pages of ``a`` (16 tokens), 1 page of ``b`` (64 tokens)
WARM = SYSTEM + [250]
HELD = SYSTEM + list(range(100, 140))  # a held session's history: both hops hold its first 64 tokens
SHORT = SYSTEM[:48] + [200, 300]  # 48 tokens of the prompt: 3 of a's pages, none of b's (a page names 64 tokens)


def test_a_lean_first_step_refused_on_hops_that_all_cache_is_a_wait(tiny_model_factory, tmp_path, scaled):
    """``a`` has 24 pages for its 2 blocks. A request caches SYSTEM (a: 4 pages per block, b: one 64-token page);
    a held session (--hold-sessions) on SYSTEM + 40 tokens starts at 64 and keeps those 8 pages pinned, its own 8
    taken: 8 free. A request on SHORT (50 + 16 tokens: 5 pages per block): a matches 48 tokens, b none, so the chain
    starts at 0; a cannot reserve 10 pages and opens lean (4) on its match; the first step needs 6 more under the
    match, 4 are free and the matched pages are the session's too: refused no_capacity. A preemption: the job
    re-opens naming no prefix, that open waits at ``a`` until the session closes, and the request completes."""
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("llama", num_layers=4)
    _, s_m, s_c = model_memory(model, MAX_LENGTH)
    servers = [LocalServer("a", 2 * s_m + 3 * s_c, tau_p=0.002, extra_args=["--max-blocks", "2"]),
               LocalServer("b", 2 * s_m + 40 * s_c, tau_p=0.002, extra_args=["--max-blocks", "2", "--page-size", "64"])]
    sw = LocalSwarm(model, servers, max_length=MAX_LENGTH, arrival_rate=1.0, log_dir=tmp_path,
                    orchestrator_args=["--replan-interval-s", "3600", "--job-tokens", "16",
                                       "--output-reserve-tokens", "16", "--hold-sessions"])
    sw.start(timeout=scaled(120))
    try:
        # the reference outputs while the servers start up (their joins and the first plan wait on the DHT)
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        with torch.no_grad():
            expected = {name: hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
                        [0, len(p):].tolist() for name, p, n in (("warm", WARM, 12), ("held", HELD, 1),
                                                                 ("short", SHORT, 16))}
        sw.wait_ready(timeout=scaled(150))
        sw.wait_until(lambda st: any(len(ch["names"]) == 2 for ch in st["chains"]), scaled(120), "a chain of two")
        client = sw.client(timeout=scaled(120))
        assert client.complete(WARM, max_tokens=12, ignore_eos=True).token_ids == expected["warm"]
        session = client.session()
        ex = concurrent.futures.ThreadPoolExecutor(1)
        try:
            assert session.complete(input_ids=HELD, max_tokens=1, ignore_eos=True).token_ids == expected["held"]
            short = ex.submit(client.complete, SHORT, max_tokens=16, ignore_eos=True)  # a 503 raises
            # the refusal happened (a preemption; the job's full open then waits at a): else this tested nothing
            sw.wait_until(lambda st: st["job_tokens"]["preemptions"] >= 1 or short.done(), scaled(60),
                          "the lean first step refused")
            assert not short.done(), f"ended before the session closed: {short.exception() or 'never refused'}"
            session.close()  # its pages go back: the waiting open is served
            comp = short.result(timeout=scaled(60))
        finally:
            session.close()  # before the wait for the request's thread: its open may wait for these pages
            ex.shutdown(wait=True)
        state = sw.swarm()
        print("job_tokens", state["job_tokens"], "relay", state["relay"])
        assert comp.token_ids == expected["short"]
        assert comp.failovers == 0
        assert state["relay"]["failovers"] == 0 and state["relay"]["replays_full"] == 0
        assert state["job_tokens"]["preemptions"] == 1, state["job_tokens"]
        by_name = {s["public_name"]: s for s in state["servers"]}
        assert by_name["a"]["prefix_cache"] and by_name["b"]["prefix_cache"], by_name  # every hop caches
    finally:
        sw.stop()
