"""LoRA adapters end to end: an orchestrator serving two adapters of a tiny Llama (and one no server has) beside the
base model, two real server processes (one with both adapters, one with one) on loopback. Each adapter's greedy
output equals transformers' with the adapter merged into the weights by hand, token for token, while the base and
both adapters run in the same batches; jobs of an adapter run only on chains that serve it; /v1/models lists the
adapters with their parent; unknown names are 404, an adapter no chain serves 503; sessions, streaming, n and seeds
and the Python client work as for the base model."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from lora_helpers import greedy, merged_reference, write_adapter

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for
from petals_chain.swarm.lora import read_adapter

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [300, 12, 77, 5]]
N = 8


@pytest.fixture(scope="module")
def lora_swarm(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama", num_layers=4)
    root = tmp_path_factory.mktemp("adapters")
    paths = {"fr": write_adapter(root / "fr", model, seed=11),
             "de": write_adapter(root / "de", model, seed=12, r=2, alpha=4, rslora=True,
                                 targets=("k_proj", "o_proj", "gate_proj", "up_proj"), layers=[1, 2, 3]),
             "ghost": write_adapter(root / "ghost", model, seed=13)}
    mem = memory_for(model, 64, 4, 4)
    servers = [LocalServer("both", mem, tau_p=0.01, extra_args=["--adapter", f"fr={paths['fr']}",
                                                                 "--adapter", f"de={paths['de']}"]),
               LocalServer("fr-only", mem, tau_p=0.01, extra_args=["--adapter", f"fr={paths['fr']}"])]
    sw = LocalSwarm(model, servers, max_length=64, log_dir=tmp_path_factory.mktemp("logs"),
                    orchestrator_args=["--placement", "whole-model", "--no-chain-wait-s", "2",
                                       *[a for n, p in paths.items() for a in ("--adapter", f"{n}={p}")]])
    sw.start()
    try:
        sw.wait_until(lambda st: len(st["chains"]) == 2, timeout=240, what="a chain per server")
        yield sw, model, paths
    finally:
        sw.stop()


def complete(sw, model: str, prompt, **body) -> httpx.Response:
    return httpx.post(f"{sw.url}/v1/completions", timeout=300,
                      json={"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0,
                            "ignore_eos": True, **body})


@pytest.fixture(scope="module")
def references(lora_swarm):
    _, model, paths = lora_swarm
    refs = {None: merged_reference(model, None), "fr": merged_reference(model, paths["fr"]),
            "de": merged_reference(model, paths["de"])}
    return {name: [greedy(m, p, N) for p in PROMPTS] for name, m in refs.items()}


def test_each_adapter_is_token_exact_in_mixed_batches(lora_swarm, references):
    sw, model, paths = lora_swarm
    assert references["fr"] != references[None] and references["de"] != references[None]
    jobs = [(name, i) for _ in range(2) for name in (model_name(sw), "fr", "de") for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # at once: the servers batch them together
        replies = list(pool.map(lambda job: complete(sw, job[0], PROMPTS[job[1]]), jobs))
    rows = {}
    for (name, i), r in zip(jobs, replies):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == name
        key = None if name == model_name(sw) else name
        assert body["petals_chain"][0]["token_ids"] == references[key][i], (name, i)
        rows.setdefault(name, set()).add(tuple(body["petals_chain"][0]["chain"]))
    both = peer_of(sw, "both")
    assert all(chain == (both,) for chain in rows["de"])  # only the chain whose server serves it
    server_rows = {s["public_name"]: s for s in sw.swarm()["servers"]}
    fr, de = read_adapter(paths["fr"]).fingerprint, read_adapter(paths["de"]).fingerprint
    assert server_rows["both"]["adapters"] == {fr: "fr", de: "de"} and server_rows["fr-only"]["adapters"] == {fr: "fr"}


def test_models_listing_and_refusals(lora_swarm):
    sw, model, paths = lora_swarm
    base = model_name(sw)
    data = {m["id"]: m for m in httpx.get(f"{sw.url}/v1/models", timeout=30).json()["data"]}
    assert set(data) == {base, "fr", "de", "ghost"}
    assert data["fr"]["parent"] == base and "parent" not in data[base]
    assert data["fr"]["adapter_fingerprint"] == read_adapter(paths["fr"]).fingerprint
    assert httpx.get(f"{sw.url}/v1/models/de", timeout=30).json()["id"] == "de"
    r = complete(sw, "es", PROMPTS[0])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'fr'" in r.json()["error"]["message"]
    r = complete(sw, "ghost", PROMPTS[0])  # known here, served by no chain
    assert r.status_code == 503 and "serving this LoRA adapter" in r.json()["error"]["message"], r.text
    with httpx.stream("POST", f"{sw.url}/v1/completions", timeout=120,
                      json={"model": "ghost", "prompt": PROMPTS[0], "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 503  # a stream too: refused before it starts


def test_sessions_streams_choices_and_the_python_client(lora_swarm, references):
    from petals_chain.client import Client

    sw, _, _ = lora_swarm
    # a session of an adapter: opened naming it, every turn runs with it
    s = httpx.post(f"{sw.url}/api/v1/sessions", json={"model": "de", "max_length": 64}, timeout=30)
    assert s.status_code == 200 and s.json()["model"] == "de", s.text
    sid = s.json()["session_id"]
    g = httpx.post(f"{sw.url}/api/v1/sessions/{sid}/generate", timeout=300,
                   json={"input_ids": PROMPTS[1], "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert g.status_code == 200 and g.json()["token_ids"] == references["de"][1], g.text
    wrong = httpx.post(f"{sw.url}/api/v1/sessions/{sid}/generate", timeout=60,
                       json={"model": "fr", "input_ids": [3], "max_tokens": 1})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "session_model"
    httpx.delete(f"{sw.url}/api/v1/sessions/{sid}", timeout=30)
    # streamed: the same tokens
    text = []
    with httpx.stream("POST", f"{sw.url}/v1/completions", timeout=300,
                      json={"model": "fr", "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        text = "".join(line for line in r.iter_lines())
    assert '"model": "fr"' in text or '"model":"fr"' in text
    # n = 2 with a seed: each choice repeats with the seed, and the adapter samples from its own distribution
    seeded = dict(n=2, seed=7, temperature=1.0, max_tokens=6)
    forks = sw.swarm()["relay"]["forks"]
    a, b = complete(sw, "fr", PROMPTS[2], **seeded).json(), complete(sw, "fr", PROMPTS[2], **seeded).json()
    ids = [c["token_ids"] for c in a["petals_chain"]]
    assert ids == [c["token_ids"] for c in b["petals_chain"]] and len(ids) == 2
    assert sw.swarm()["relay"]["forks"] > forks  # the second choice copied the first's K/V, of the same adapter
    # logprobs, with the same greedy tokens
    r = complete(sw, "fr", PROMPTS[0], logprobs=2).json()
    assert r["petals_chain"][0]["token_ids"] == references["fr"][0]
    assert len(r["choices"][0]["logprobs"]["top_logprobs"]) == N
    # the Python client names the adapter as its model
    client = Client(sw.url, model="fr")
    out = client.complete(PROMPTS[0], max_tokens=N, temperature=0, ignore_eos=True)
    assert out.token_ids == references["fr"][0]


def model_name(sw) -> str:
    return sw.swarm()["model"]


def peer_of(sw, public_name: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        for s in sw.swarm()["servers"]:
            if s["public_name"] == public_name:
                return s["peer_id"]
        assert time.monotonic() < deadline
        time.sleep(0.2)
