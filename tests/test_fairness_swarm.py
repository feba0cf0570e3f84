"""Fair sharing on a real swarm (seed 002): a heavy client's burst does not starve a light client under dlpm.

One orchestrator process with API keys (``--fairness`` auto = dlpm) and one server process holding the whole
tiny model with two cache slots: the chain runs two jobs at once, so a burst queues at the orchestrator.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

HEAVY, LIGHT = "heavy-secret-0123456789", "light-secret-0123456789"
BURST = 10


@pytest.fixture(scope="module")
def swarm(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory("llama", num_layers=4)
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"heavy {HEAVY}\nlight {LIGHT}\n")
    # slots: the chain's capacity stays 2 jobs (a paged server's would follow the learnt job length)
    server = LocalServer("a", memory_for(path, 128, 4, 2), tau_p=0.001, extra_args=["--kv-cache", "slots"])
    with LocalSwarm(path, [server], max_length=128, arrival_rate=1.0, log_dir=tmp_path_factory.mktemp("logs"),
                    orchestrator_args=["--api-keys", str(keys), "--fairness-quantum", "10"]) as sw:
        sw.wait_ready(timeout=150)
        yield sw


def complete(sw, key: str, done: list, lock: threading.Lock, max_tokens: int = 24) -> dict:
    r = httpx.post(f"{sw.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                   json={"model": sw.swarm()["model"], "prompt": "hello there", "max_tokens": max_tokens,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    with lock:
        done.append(key)
    return r.json()


def test_light_client_is_not_starved_by_a_heavy_burst(swarm):
    state = swarm.swarm()
    assert state["fairness"]["policy"] == "dlpm" and state["fairness"]["quantum_mode"] == "fixed"
    assert sum(ch["capacity"] for ch in state["chains"]) == 2
    done: list[str] = []
    lock = threading.Lock()
    with ThreadPoolExecutor(BURST + 1) as pool:
        # long heavy jobs, so the burst stays queued while the light request arrives, also on a loaded machine
        heavy = [pool.submit(complete, swarm, HEAVY, done, lock, 64) for _ in range(BURST)]
        deadline = time.monotonic() + 60
        # queue_max is exact (the most jobs ever queued), so a slow poll cannot miss the burst
        while swarm.swarm()["queue_max"] < BURST - 4:  # the burst is queued behind the two running jobs
            assert time.monotonic() < deadline, "the heavy burst never queued"
            time.sleep(0.05)
        light = pool.submit(complete, swarm, LIGHT, done, lock)
        light_reply = light.result(300)
        heavy_replies = [f.result(300) for f in heavy]
    # FCFS would start the light request after every heavy one (it arrived last): at most one heavy job, started
    # beside it, could finish after it. DLPM gives the light client the next free slot.
    after = len(done) - 1 - done.index(LIGHT)
    assert after >= 3, done
    light_wait = light_reply["petals_chain"][0]["wait_s"]
    heavy_waits = sorted(r["petals_chain"][0]["wait_s"] for r in heavy_replies)
    assert light_wait < heavy_waits[-3], (light_wait, heavy_waits)
    fair = swarm.swarm()["fairness"]
    clients = fair["clients"]
    assert clients["heavy"]["requests"] == BURST and clients["light"]["requests"] == 1
    # service units: w_e per prompt token computed + w_q (2) per generated token
    assert clients["light"]["service"] >= 2 * 24
    assert clients["heavy"]["service"] >= BURST * 2 * 24
    assert clients["light"]["wait_max_s"] < clients["heavy"]["wait_max_s"]
    # Jain's index compares the clients backlogged through the window (sampled each second); the light one waited
    # once, so it is not among them
    assert "light" not in fair["jain_clients"] and (fair["jain_index"] is None) == (len(fair["jain_clients"]) < 2)
    metrics = httpx.get(f"{swarm.url}/metrics").text
    assert 'petals_chain_client_service_units_total{client="light"}' in metrics
    assert "petals_chain_fairness_jain_index" in metrics and LIGHT not in metrics


def test_speculative_drafts_are_not_charged_to_the_client(swarm):
    """A request with prompt-lookup drafts cost its client the drafted tokens as input (169 units where the same
    request without drafts cost 106): the drafts are the system's guesses; the accepted ones are output."""
    auth = {"Authorization": f"Bearer {LIGHT}"}
    model = swarm.swarm()["model"]
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 13, 5]  # repeats: n-gram drafts have something to copy

    def cost(speculative: str) -> tuple[float, dict]:
        before = swarm.swarm()["fairness"]["clients"]["light"]["service"]
        r = httpx.post(f"{swarm.url}/v1/completions", headers=auth, timeout=300,
                       json={"model": model, "prompt": prompt, "max_tokens": 48, "ignore_eos": True,
                             "temperature": 0, "speculative": speculative})
        assert r.status_code == 200, r.text
        return swarm.swarm()["fairness"]["clients"]["light"]["service"] - before, r.json()["usage"]

    drafted_before = swarm.swarm()["relay"]["speculative"]["drafted_tokens"]
    plain, usage = cost("none")
    spec, _ = cost("ngram")
    assert swarm.swarm()["relay"]["speculative"]["drafted_tokens"] > drafted_before  # drafts were verified
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert plain == computed + 2 * usage["completion_tokens"]
    assert spec == plain, (spec, plain)
