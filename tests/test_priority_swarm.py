"""``--schedule db`` on a real swarm (issue 17, seed 001's doubling budget at the orchestrator): a long request that
used up its budget is paused between two steps for short requests that arrive while it runs; the short ones finish
before it, and it resumes from its cached KV with a token-identical output.

One orchestrator process and one server process holding the whole tiny model with one job's room (so every new
request waits for the running one unless it is paused)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

LONG = 80


@pytest.fixture(scope="module")
def swarm(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory("llama", num_layers=4)
    # 20 ms per hop (emulated link): the long request lasts seconds whatever the machine's load; one job's room
    server = LocalServer("a", memory_for(path, 128, 4, 1), tau_p=0.001, emulate_rtt_ms=20.0)
    with LocalSwarm(path, [server], max_length=128, arrival_rate=1.0, log_dir=tmp_path_factory.mktemp("logs"),
                    orchestrator_args=["--schedule", "db"]) as sw:
        sw.wait_ready(timeout=150)
        yield sw


def post(sw, prompt: str, model: str | None = None, **body) -> httpx.Response:
    return httpx.post(f"{sw.url}/v1/completions", timeout=300,
                      json={"model": model or sw.swarm()["model"], "prompt": prompt, "ignore_eos": True,
                            "temperature": 0, **body})


def test_short_requests_pause_a_long_one_past_its_budget_and_it_stays_exact(swarm, scaled):
    state = swarm.swarm()
    assert state["schedule"]["name"] == "db" and sum(ch["capacity"] for ch in state["chains"]) == 1
    # a few short jobs first: L̂ (mean execution time) is learnt from them, so the long one soon exceeds its budget
    warm = [post(swarm, f"warm {i}", max_tokens=4) for i in range(4)]
    assert all(r.status_code == 200 for r in warm)
    alone = post(swarm, "the long story of a", max_tokens=LONG).json()["petals_chain"][0]["token_ids"]
    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(post, swarm, "the long story of a", max_tokens=LONG)
        until = time.monotonic() + scaled(60)
        while sum(ch["active"] for ch in swarm.swarm()["chains"]) < 1:
            assert time.monotonic() < until, "the long request never started"
            time.sleep(0.05)
        time.sleep(0.5)
        short = [pool.submit(post, swarm, f"quick {i}", max_tokens=3) for i in range(3)]
        replies = [f.result(300) for f in short]
        long_done_first = long.done()
        long_reply = long.result(300)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert not long_done_first, "the short requests waited for the long one"
    assert long_reply.status_code == 200 and long_reply.json()["petals_chain"][0]["token_ids"] == alone
    sched = swarm.swarm()["schedule"]
    assert sched["priority_preemptions"] >= 1 and sched["paused"] >= 1, sched
    assert sched["services"] and next(iter(sched["services"].values()))["completed"] >= 5, sched


def teach_two_kinds(sw) -> list[httpx.Response]:
    """Requests of one prompt, two kinds by max_tokens alone (1 and 8): 63 arrivals of both kinds (mostly the cheap
    short one: K-means finds the two points however many of each) and the 64th fit the length classes; then each
    kind completes 18 times (a class's L̂_s is learnt from its 16th completion on)."""
    model = sw.swarm()["model"]

    def one(max_tokens: int) -> httpx.Response:
        return post(sw, "the same prompt", model=model, max_tokens=max_tokens)

    with ThreadPoolExecutor(4) as pool:  # all 63 arrive before the fit (the map returns when they are done)
        before = list(pool.map(one, [8 if i % 16 == 0 else 1 for i in range(63)]))
    with ThreadPoolExecutor(2) as pool:
        return before + list(pool.map(one, [8 if i % 2 else 1 for i in range(36)]))


@pytest.fixture(scope="module")
def one_slot(tiny_model_factory, tmp_path_factory):
    """One KV slot (``--kv-cache slots``): exactly one job at a time, whatever the jobs' lengths (a paged cache
    would fit several short ones)."""
    path = tiny_model_factory("llama", num_layers=4)
    server = LocalServer("a", memory_for(path, 128, 4, 1), tau_p=0.001, emulate_rtt_ms=40.0,
                         extra_args=["--kv-cache", "slots"])
    with LocalSwarm(path, [server], max_length=128, arrival_rate=1.0, log_dir=tmp_path_factory.mktemp("logs"),
                    orchestrator_args=["--schedule", "db"]) as sw:
        sw.wait_ready(timeout=150)
        yield sw


def test_length_classes_are_learnt_online_and_a_short_kind_overtakes_a_long_kind(one_slot, scaled):
    """``--schedule-classes`` (default 4): the orchestrator clusters (prompt tokens, max_tokens) of the requests it
    sees into services, each with its own learnt L̂_s; then a short request that arrives after a long one of the
    same model goes first (with one service per model both would have the same priority: first come first)."""
    swarm = one_slot
    model = swarm.swarm()["model"]
    assert all(r.status_code == 200 for r in teach_two_kinds(swarm))
    sched = swarm.swarm()["schedule"]
    outs = [c[1] for c in sched["classes"]["centroids_tokens"]]  # shortest first
    assert sched["classes"]["fits"] >= 1 and outs == [1, 8], sched  # two kinds: two classes (of at most 4)
    short_s, long_s = sched["services"][f"{model}:0"], sched["services"][f"{model}:1"]
    assert min(short_s["completed"], long_s["completed"]) >= 16, sched
    assert short_s["mean_exec_s"] < long_s["mean_exec_s"], sched
    with ThreadPoolExecutor(3) as pool:
        # 12 tokens (>= 0.5 s at 40 ms a step): both later requests queue behind it, and the long one waits less
        # than its class's starvation threshold (2 x an 8-token job). A slots chain is not paused for priority (a
        # pause there recomputes the job's KV), so the order shows when it finishes
        running = pool.submit(post, swarm, "the same prompt", max_tokens=12)

        def wait_for(what: str, cond) -> None:
            until = time.monotonic() + scaled(60)
            while not cond(swarm.swarm()):
                assert time.monotonic() < until, what
                time.sleep(0.01)

        wait_for("the first request never started", lambda s: sum(ch["active"] for ch in s["chains"]) >= 1)
        assert sum(ch["capacity"] for ch in swarm.swarm()["chains"]) == 1
        done: dict[str, float] = {}

        def timed(name: str, max_tokens: int) -> httpx.Response:
            r = post(swarm, "the same prompt", max_tokens=max_tokens)
            done[name] = time.monotonic()
            return r

        long = pool.submit(timed, "long", 8)
        wait_for("the long request never queued", lambda s: s["queue_length"] >= 1 or "long" in done)
        short = pool.submit(timed, "short", 1)
        replies = [f.result(300) for f in (running, long, short)]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert done["short"] < done["long"], (done, swarm.swarm()["schedule"])


@pytest.mark.browser
def test_dashboard_shows_each_service_and_its_length_class(one_slot):
    """The orchestrator's page in headless Chromium: the priority schedule panel lists the services the API
    reports (after the test above: the model's length classes) with their class centres and counts."""
    from dashboard_helpers import browser_skip_reason, chromium_browser

    if browser_skip_reason() is not None:
        pytest.skip(str(browser_skip_reason()))
    if len(one_slot.swarm()["schedule"]["services"]) < 2:  # run alone: teach the classes first
        teach_two_kinds(one_slot)
    sched = one_slot.swarm()["schedule"]
    centroids = sched["classes"]["centroids_tokens"]
    with chromium_browser() as new_page:
        page, errors = new_page()
        page.goto(f"{one_slot.url}/?refresh=1")
        page.wait_for_selector("#schedule-table tbody tr[data-service]", timeout=15_000)
        assert page.locator("#schedule-panel").is_visible()
        rows = page.locator("#schedule-table tbody tr[data-service]").evaluate_all(
            "rs => rs.map(r => [r.dataset.service, r.cells[1].innerText, r.cells[4].innerText])")
        assert {name for name, _, _ in rows} == set(sched["services"]), (rows, sched)
        for name, cls, done in rows:
            assert int(done) == sched["services"][name]["completed"], (rows, sched)
            k = name.rpartition(":")[2]
            if name.count(":") and k.isdigit():  # a length class: its centre, prompt -> max_tokens
                assert cls == f"{centroids[int(k)][0]} \u2192 {centroids[int(k)][1]} tokens", rows
        summary = page.locator("#schedule-summary").inner_text()
        assert "db" in summary and "4 length classes" in summary, summary
        assert not errors, errors
