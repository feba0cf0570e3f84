"""A client-fair queue keeps room for light clients on a real swarm: two heavy clients' bursts against ``--max-queue``.

One orchestrator process with API keys (``--fairness`` auto = dlpm) and one server process holding the whole tiny
model with two cache slots; ``--max-queue 6``. Before the share rule the heavy bursts filled the queue and the light
client's one request was refused (429 ``queue_full``) while the heavy clients kept five places each."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

KEYS = {"heavy1": "heavy1-secret-0123456789", "heavy2": "heavy2-secret-0123456789",
        "light": "light-secret-01234567890"}
MAX_QUEUE, BURST = 6, 8


def post(sw, name: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": sw.swarm()["model"], "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    return httpx.post(f"{sw.url}/v1/completions", headers={"Authorization": f"Bearer {KEYS[name]}"}, json=body,
                      timeout=300)


def test_heavy_bursts_leave_the_light_client_a_place(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama", num_layers=4)
    keys = tmp_path / "api-keys"
    keys.write_text("".join(f"{name} {secret}\n" for name, secret in KEYS.items()))
    server = LocalServer("a", memory_for(path, 128, 4, 2), tau_p=0.001, extra_args=["--kv-cache", "slots"])
    with LocalSwarm(path, [server], max_length=128, arrival_rate=1.0, log_dir=tmp_path / "logs",
                    orchestrator_args=["--api-keys", str(keys), "--max-queue", str(MAX_QUEUE)]) as sw:
        sw.wait_ready(timeout=150)
        state = sw.swarm()
        assert state["fairness"]["policy"] == "dlpm" and sum(ch["capacity"] for ch in state["chains"]) == 2
        alone = post(sw, "light", 8)
        assert alone.status_code == 200, alone.text
        with ThreadPoolExecutor(2 * BURST) as pool:
            # long heavy jobs: the bursts stay queued while the light requests come, also on a loaded machine
            heavy = [pool.submit(post, sw, name, 96) for name in ("heavy1", "heavy2") for _ in range(BURST)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in heavy) < 2 * BURST - 2 - MAX_QUEUE:  # refusals answered at once
                assert time.monotonic() < deadline, "the heavy bursts were never refused"
                time.sleep(0.05)
            waiting = sw.swarm()["queue_length"]
            assert 0 < waiting < MAX_QUEUE, waiting  # places left over
            light = post(sw, "light", 8, stream=True)  # streamed: a refusal would be a 429 before any event
            assert light.status_code == 200, light.text
            assert '"text"' in light.text and "[DONE]" in light.text
            again = post(sw, "light", 8)
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
            replies = [f.result(300) for f in heavy]
    refused = [r for r in replies if r.status_code == 429]
    served = [r for r in replies if r.status_code == 200]
    assert len(refused) + len(served) == len(replies), [r.text for r in replies if r.status_code not in (200, 429)]
    assert refused and len(served) >= 2 + 2  # each heavy client ran and queued some
    assert any(r.json()["error"]["code"] == "client_queue_share" for r in refused)
    for r in refused:
        err = r.json()["error"]
        # the dispatcher's share rule, or the early check of a burst not yet decided (only for a client already
        # holding requests: the light client's first request always reaches the dispatcher)
        assert err["code"] in ("client_queue_share", "queue_full"), err
        assert err["code"] == "queue_full" or "kept for other clients" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
    assert len({r.json()["choices"][0]["text"] for r in served}) == 1  # greedy, same prompt: token-exact
