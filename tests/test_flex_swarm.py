"""``--schedule flex`` on a real swarm (issue 18, seed 003's best-effort lane on chains): a request with a deadline
that would miss behind two running requests without one takes the slot of one of them, paused between two steps;
the paused one resumes (reusing its cached KV) and both long outputs stay token-identical to their runs alone.

One orchestrator process and one server process holding the whole tiny model with two cache slots (paged KV with
the prefix cache, so a paused request's KV stays on the server as a cached prefix)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

LONG = 96


@pytest.fixture(scope="module")
def swarm(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory("llama", num_layers=4)
    # 20 ms per hop (emulated link): a 96-token request lasts seconds, whatever the machine's load
    server = LocalServer("a", memory_for(path, 128, 4, 2), tau_p=0.001, emulate_rtt_ms=20.0)
    with LocalSwarm(path, [server], max_length=128, arrival_rate=1.0, log_dir=tmp_path_factory.mktemp("logs"),
                    orchestrator_args=["--schedule", "flex"]) as sw:
        sw.wait_ready(timeout=150)
        yield sw


def post(sw, prompt: str, timeout: float = 300, **body) -> httpx.Response:
    return httpx.post(f"{sw.url}/v1/completions", timeout=timeout,
                      json={"model": sw.swarm()["model"], "prompt": prompt, "ignore_eos": True, "temperature": 0,
                            **body})


def test_a_deadline_request_pauses_one_without_and_both_stay_exact(swarm, scaled):
    state = swarm.swarm()
    assert state["deadlines"]["schedule"] == "flex" and sum(ch["capacity"] for ch in state["chains"]) == 2
    prompts = ["the long story of a", "once upon a time in"]
    t0 = time.monotonic()
    alone = [post(swarm, p, max_tokens=LONG).json()["petals_chain"][0]["token_ids"] for p in prompts]
    long_s = (time.monotonic() - t0) / len(prompts)  # how long a long request lasts on this machine now
    with ThreadPoolExecutor(2) as pool:
        long = [pool.submit(post, swarm, p, max_tokens=LONG) for p in prompts]
        until = time.monotonic() + scaled(60)
        while sum(ch["active"] for ch in swarm.swarm()["chains"]) < 2:  # both hold their slots (a lasting state)
            assert time.monotonic() < until, "the long requests never ran together"
            time.sleep(0.05)
        # a first token within 1 s: behind the two long requests it would wait for a slot, so it is doomed by the
        # prediction (edf refuses it); flex pauses one of them instead and serves it at once. On a loaded machine
        # (whose predicted first token comes later) more, as long as it stays well under a long request's time
        ttft_s = max(1.0, min(scaled(1.0), long_s / 3))
        t0 = time.monotonic()
        r = post(swarm, "quick", max_tokens=4, ttft_deadline_ms=round(ttft_s * 1000))
        served_s = time.monotonic() - t0
        assert r.status_code == 200, r.text
        report = r.json()["deadline"]
        assert report["outcome"] in ("met", "missed"), report  # met on a quiet machine; timing is not the point
        done_before = sum(f.done() for f in long)
        replies = [f.result(300) for f in long]
    assert done_before == 0, "the deadline request waited for a long one to finish"
    for reply, want in zip(replies, alone):
        assert reply.status_code == 200, reply.text
        assert reply.json()["petals_chain"][0]["token_ids"] == want  # the paused one resumed exactly
    dl = swarm.swarm()["deadlines"]
    assert dl["paused"] == 1 and dl["refused"] == 0, dl
    metrics = httpx.get(f"{swarm.url}/metrics", timeout=30).text
    assert "petals_chain_flex_pauses_total 1.0" in metrics
    print(f"flex: the deadline request ({ttft_s:.2f} s to its first token) was served in {served_s:.2f} s ({report}) "
          f"while two long ones ({long_s:.2f} s each alone) ran")
