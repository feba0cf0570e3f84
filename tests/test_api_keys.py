"""API keys on a real swarm: per-key token budgets, sessions owned by their key, the openai package with a key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

ALICE, BOB, CAROL = "alice-secret-0123456789", "bob-secret-0123456789", "carol-secret-0123456789"
DAVE = "dave-secret-0123456789"
IDLE_S = 10.0  # the session lease (--session-idle-timeout-s)


@pytest.fixture(scope="module")
def swarm(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory("llama", num_layers=4)
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"alice {ALICE} tokens_per_minute=60\nbob {BOB}\ncarol {CAROL}\ndave {DAVE} tokens_per_minute=50\n")
    with LocalSwarm(path, [LocalServer("a", memory_for(path, 128, 4, 8), tau_p=0.001)], max_length=128,
                    arrival_rate=1.0, log_dir=tmp_path_factory.mktemp("logs"),
                    orchestrator_args=["--api-keys", str(keys), "--session-idle-timeout-s", str(IDLE_S)]) as sw:
        sw.wait_ready(timeout=150)
        yield sw


def gen(sw, key, max_tokens=20):
    return httpx.post(f"{sw.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": sw.swarm()["model"], "prompt": "hello there", "max_tokens": max_tokens,
                            "ignore_eos": True})


def test_token_budget_is_per_key(swarm):
    # alice spends her 60 tokens per minute (prompt + generated); then 429 with a Retry-After
    codes = [gen(swarm, ALICE).status_code for _ in range(4)]
    assert codes[:2] == [200, 200] and codes[-1] == 429, codes
    r = gen(swarm, ALICE)
    assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    # bob is unaffected, also while alice keeps knocking
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda k: gen(swarm, k).status_code, [BOB, ALICE, BOB, ALICE, BOB, BOB]))
    assert [results[i] for i in (0, 2, 4, 5)] == [200] * 4 and {results[1], results[3]} == {429}
    clients = {c["name"]: c for c in swarm.swarm()["clients"]}
    assert 40 <= clients["alice"]["tokens_last_minute"] <= 60 and clients["bob"]["completed"] >= 4  # never past it
    metrics = httpx.get(f"{swarm.url}/metrics").text
    assert 'petals_chain_client_tokens_total{client="bob"}' in metrics and ALICE not in metrics


def test_a_request_holds_its_most_tokens_before_it_runs(swarm):
    """``tokens_per_minute`` holds a request's prompt + max_tokens x n when it is admitted: one request cannot
    overspend the budget, nor can many at once (12 concurrent requests of a key limited to 30 got 5 answers, 150
    tokens charged)."""
    r = gen(swarm, DAVE, max_tokens=100)
    assert r.status_code == 429 and r.json()["error"]["param"] == "max_tokens", r.text
    # a chat request that sent max_completion_tokens is told to lower that (it was told max_tokens)
    r = httpx.post(f"{swarm.url}/v1/chat/completions", headers={"Authorization": f"Bearer {DAVE}"}, timeout=120,
                   json={"model": swarm.swarm()["model"], "messages": [{"role": "user", "content": "hi"}],
                         "max_completion_tokens": 100})
    err = r.json()["error"]
    assert r.status_code == 429 and err["param"] == "max_completion_tokens", r.text
    assert "lower max_completion_tokens" in err["message"], r.text
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: gen(swarm, DAVE, max_tokens=20).status_code, range(6)))
    assert sorted(codes) == [200, 200, 429, 429, 429, 429], codes  # 2 x (2 + 20) <= 50
    dave = {c["name"]: c for c in swarm.swarm()["clients"]}["dave"]
    assert dave["tokens_last_minute"] <= 50, dave


def test_a_stream_cut_off_is_charged_the_tokens_it_generated(swarm, scaled):
    """A client that reads part of a stream and leaves pays for what was generated, not only for its prompt (it
    paid 0 generated tokens: a way around tokens_per_minute)."""
    import time

    body = {"model": swarm.swarm()["model"], "prompt": "hello there", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{swarm.url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {CAROL}"}) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 12:
                break
    deadline = time.monotonic() + scaled(30)
    while True:
        carol = {c["name"]: c for c in swarm.swarm()["clients"]}.get("carol", {})
        # its job ends cancelled (the client left while it held a chain), else failed or completed
        if sum(carol.get(k, 0) for k in ("failed", "completed", "cancelled")) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert carol["tokens_last_minute"] >= 2 + 10, carol  # the prompt and at least the tokens read


def test_sessions_belong_to_their_key(swarm):
    a = swarm.client(api_key=BOB)
    with a.session() as s:
        s.generate("hello", max_tokens=2)
        other = httpx.post(f"{swarm.url}/api/v1/sessions/{s.id}/generate", json={"prompt": "x", "max_tokens": 1},
                           headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
        assert other.status_code == 404
        assert httpx.delete(f"{swarm.url}/api/v1/sessions/{s.id}").status_code == 401
        assert s.info()["turns"] == 1  # untouched by the other key


def test_idle_session_lease_expires(swarm, scaled):
    """A session without a turn for --session-idle-timeout-s is closed: its chain and slots come back, and the id
    answers 404 afterwards."""
    import time

    s = swarm.client(api_key=BOB).session()
    s.generate("hello", max_tokens=2)
    assert swarm.swarm()["sessions"] >= 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < IDLE_S + scaled(20):
        if swarm.swarm()["sessions"] == 0:
            break
        time.sleep(0.5)
    assert swarm.swarm()["sessions"] == 0 and time.monotonic() - t0 >= IDLE_S * 0.9
    gone = httpx.post(f"{swarm.url}/api/v1/sessions/{s.id}/generate", json={"prompt": "x", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {BOB}"}, timeout=60)
    assert gone.status_code == 404


def test_openai_package_with_a_key(swarm):
    from openai import AuthenticationError, OpenAI

    model = swarm.swarm()["model"]
    ok = OpenAI(base_url=f"{swarm.url}/v1", api_key=BOB, max_retries=0)
    assert ok.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{swarm.url}/v1", api_key="wrong-key-0123456789", max_retries=0).models.list()
