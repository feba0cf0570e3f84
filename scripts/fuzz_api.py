"""Hostile clients against a running orchestrator: schema fuzzing (schemathesis) plus hand-written abuse.

Goal: no 5xx, every 4xx in OpenAI's error format, no leaked chains or server slots afterwards, and an
honest greedy request still served (and identical before and after).

    python scripts/fuzz_api.py --url http://127.0.0.1:8000 --examples 50 --json
    python scripts/fuzz_api.py --swarm --examples 25 --json    # starts its own small LocalSwarm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_int, positive_int  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


def _is_openai_error(resp: httpx.Response | Any) -> bool:
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def schema_fuzz(url: str, model: str, *, examples: int = 25, seed: int = 0, timeout_s: float = 60.0,
                log: Callable[[str], None] = lambda s: None) -> dict:
    """Positive and negative cases for every operation of ``/openapi.json``; generation bodies get the real
    model name half of the time so they reach sampling and the swarm instead of stopping at 404."""
    import hypothesis
    import hypothesis.errors
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    statuses: Counter = Counter()
    failures: list[dict] = []
    sessions: list[str] = []
    unsatisfiable: list[str] = []
    calls = 0
    http = requests.Session()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            counter = {"i": 0}

            @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate], report_multiple_bugs=False)
            @given(case=op.as_strategy(generation_mode=mode))
            @hypothesis.seed(seed)
            def check(case) -> None:
                nonlocal calls
                counter["i"] += 1
                if isinstance(case.body, dict) and op.method.upper() == "POST" and counter["i"] % 2 == 0:
                    if op.path in GENERATE_PATHS:
                        case.body["model"] = model
                    if isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 16:
                        case.body["max_tokens"] = 16  # keep the run bounded; huge values are tested apart
                try:
                    resp = case.call(base_url=url, session=http, timeout=timeout_s)
                except requests.RequestException as e:
                    failures.append({"op": f"{op.method} {op.path}", "mode": mode.value, "error": repr(e)[:300],
                                     "body": repr(case.body)[:300]})
                    return
                calls += 1
                statuses[resp.status_code] += 1
                if op.path == "/api/v1/sessions" and resp.status_code == 200:
                    sessions.append(resp.json()["session_id"])
                bad = resp.status_code >= 500 or (400 <= resp.status_code < 500 and not _is_openai_error(resp))
                if bad:
                    failures.append({"op": f"{op.method} {op.path}", "mode": mode.value, "status": resp.status_code,
                                     "body": repr(case.body)[:300], "query": repr(case.query)[:200],
                                     "response": resp.text[:300]})

            try:
                check()
            except hypothesis.errors.Unsatisfiable:  # e.g. no negative case exists for a GET without inputs
                unsatisfiable.append(f"{op.method.upper()} {op.path} ({mode.value})")
            log(f"fuzzed {op.method.upper()} {op.path} ({mode.value})")
    for sid in sessions:  # the fuzzer's own sessions: close them (what an honest client does)
        http.delete(f"{url}/api/v1/sessions/{sid}", timeout=timeout_s)
    return {"calls": calls, "statuses": {str(k): v for k, v in sorted(statuses.items())}, "failures": failures,
            "sessions_opened": len(sessions), "no_cases": unsatisfiable}


def hostile_cases(url: str, model: str, *, max_length: int, timeout_s: float = 120.0) -> dict:
    """Hand-written abuse: each case lists the statuses it may get; anything else (and any 5xx) fails."""
    c = httpx.Client(base_url=url, timeout=timeout_s)
    post = "/v1/completions"
    ok4 = (400, 404, 413, 422)
    big_ok = (400, 413)
    cases: list[tuple[str, Callable[[], httpx.Response], tuple]] = [
        ("huge prompt (900k chars)", lambda: c.post(post, json={"model": model, "prompt": "a " * 450_000}), big_ok),
        ("prompt over the char limit", lambda: c.post(post, json={"model": model, "prompt": "b" * 1_200_000}), big_ok),
        ("body over 8 MiB", lambda: c.post(post, content=b'{"model":"' + b"x" * (9 << 20) + b'"}',
                                           headers={"content-type": "application/json"}), (413,)),
        ("huge max_tokens", lambda: c.post(post, json={"model": model, "prompt": "hi", "max_tokens": 10**12}), ok4),
        ("max_tokens beyond int64", lambda: c.post(post, json={"model": model, "prompt": "hi", "max_tokens": 2**80}), ok4),
        ("invalid UTF-8 body", lambda: c.post(post, content=b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}',
                                              headers={"content-type": "application/json"}), ok4),
        ("not JSON", lambda: c.post(post, content=b"{{{{", headers={"content-type": "application/json"}), ok4),
        ("deeply nested JSON", lambda: c.post(post, content=b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                              headers={"content-type": "application/json"}), ok4),
        ("prompt of wrong type", lambda: c.post(post, json={"model": model, "prompt": 123}), ok4),
        ("prompt mixed list", lambda: c.post(post, json={"model": model, "prompt": [1, "a", [2]]}), ok4),
        ("empty token list", lambda: c.post(post, json={"model": model, "prompt": []}), ok4),
        ("token id out of vocab", lambda: c.post(post, json={"model": model, "prompt": [10**9]}), ok4),
        ("negative token id", lambda: c.post(post, json={"model": model, "prompt": [-1, 5]}), ok4),
        ("token ids beyond max_length", lambda: c.post(post, json={"model": model, "prompt": [5] * (max_length + 5)}),
         ok4),
        ("temperature NaN", lambda: c.post(post, content=f'{{"model": "{model}", "prompt": "hi", "temperature": NaN}}',
                                           headers={"content-type": "application/json"}), ok4),
        ("temperature Infinity", lambda: c.post(post, content=f'{{"model": "{model}", "prompt": "hi", '
                                                f'"temperature": Infinity}}',
                                                headers={"content-type": "application/json"}), ok4),
        ("negative temperature", lambda: c.post(post, json={"model": model, "prompt": "hi", "temperature": -1}), ok4),
        ("temperature as string", lambda: c.post(post, json={"model": model, "prompt": "hi", "temperature": "hot"}),
         ok4),
        ("top_p zero (greedy, as OpenAI)", lambda: c.post(post, json={"model": model, "prompt": "hi", "top_p": 0,
                                                                       "max_tokens": 2}), (200,)),
        ("top_p negative", lambda: c.post(post, json={"model": model, "prompt": "hi", "top_p": -0.1}), ok4),
        ("n huge", lambda: c.post(post, json={"model": model, "prompt": "hi", "n": 10**9}), ok4),
        ("10k stop strings", lambda: c.post(post, json={"model": model, "prompt": "hi", "stop": ["x"] * 10_000}), ok4),
        ("stop of wrong type", lambda: c.post(post, json={"model": model, "prompt": "hi", "stop": [1, 2]}), ok4),
        ("seed negative (int64, as OpenAI)", lambda: c.post(post, json={"model": model, "prompt": "hi", "seed": -5,
                                                                         "max_tokens": 2}), (200,)),
        ("seed past int64", lambda: c.post(post, json={"model": model, "prompt": "hi", "seed": 2**63}), ok4),
        ("messages as string", lambda: c.post("/v1/chat/completions", json={"model": model, "messages": "hi"}), ok4),
        ("message bad role", lambda: c.post("/v1/chat/completions",
                                            json={"model": model, "messages": [{"role": "root", "content": "x"}]}), ok4),
        ("unknown model", lambda: c.post(post, json={"model": "gpt-9", "prompt": "hi"}), (404,)),
        ("unknown session", lambda: c.post("/api/v1/sessions/nope/generate", json={"prompt": "x"}), (404,)),
        ("session max_length too big", lambda: c.post("/api/v1/sessions", json={"max_length": 10**9}), ok4),
        ("wrong method", lambda: c.put(post, json={}), (405,)),
        ("unknown path", lambda: c.get("/v1/nothing"), (404,)),
        ("64 KiB header", lambda: c.post(post, json={"model": model, "prompt": "hi", "max_tokens": 1},
                                         headers={"x-junk": "j" * 65536}), (200, 400, 413, 431)),
    ]
    results = []
    for name, fn, allowed in cases:
        try:
            r = fn()
            status, good_format = r.status_code, (r.status_code < 400 or _is_openai_error(r) or r.status_code == 431)
            text = r.text[:200]
        except httpx.HTTPError as e:  # the server closed the connection: a refusal, not a crash
            status, good_format, text = None, True, repr(e)[:200]
        results.append({"case": name, "status": status, "ok": (status in allowed or status is None) and good_format,
                        "detail": text if (status not in allowed) else ""})
    c.close()
    return {"cases": len(results), "passed": sum(r["ok"] for r in results),
            "failures": [r for r in results if not r["ok"]], "results": results}


async def stream_abuse(url: str, model: str, *, streams: int = 200, disconnects: int = 20,
                       max_tokens: int = 8) -> dict:
    """``streams`` concurrent streamed completions (429s allowed, never 5xx), then ``disconnects`` clients
    that hang up after their first token."""
    statuses: Counter = Counter()
    errors: list[str] = []
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=0)

    async def one(c: httpx.AsyncClient, hang_up: bool) -> None:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                statuses[r.status_code] += 1
                if r.status_code != 200:
                    await r.aread()
                    if not _is_openai_error(r):
                        errors.append(f"{r.status_code}: {r.text[:100]}")
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"error"' in line:
                        errors.append(line[:200])
                    if hang_up and line.startswith("data:"):
                        return  # leave mid-stream: the context manager closes the connection
        except httpx.HTTPError as e:
            errors.append(repr(e)[:200])

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(one(c, False) for _ in range(streams)))
        flood_s = time.monotonic() - t0
        await asyncio.gather(*(one(c, True) for _ in range(disconnects)))
    return {"streams": streams, "disconnects": disconnects, "statuses": {str(k): v for k, v in statuses.items()},
            "errors": errors[:10], "flood_s": round(flood_s, 2)}


def settled(url: str, timeout_s: float = 60.0) -> dict:
    """Wait until no job runs or waits and every server's slots are free; returns what was found."""
    deadline = time.monotonic() + timeout_s
    st: dict = {}
    while time.monotonic() < deadline:
        st = httpx.get(f"{url}/api/v1/swarm", timeout=10).json()
        servers = [s for s in st["servers"] if s.get("state") == "online"]
        leaked = sum(s["slots_total"] - s["slots_free"] for s in servers)
        active = sum(ch["active"] for ch in st["chains"])
        if st["queue_length"] == 0 and st.get("running", 0) == 0 and active == 0 and leaked == 0:
            return {"settled": True, "leaked_slots": 0, "running": 0, "queue_length": 0}
        time.sleep(0.5)
    return {"settled": False, "leaked_slots": leaked, "running": st.get("running"), "queue_length": st["queue_length"],
            "active": active}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="orchestrator URL (else --swarm)")
    p.add_argument("--swarm", action="store_true", help="start a small LocalSwarm (tiny model) and attack it")
    p.add_argument("--examples", type=positive_int, default=25, help="schemathesis examples per operation and mode")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="hypothesis seed of the schema fuzzing")
    p.add_argument("--streams", type=nonnegative_int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    sw = work = None
    url = args.url
    if url is None:
        if not args.swarm:
            p.error("give --url or --swarm")
        from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for
        from petals_chain.swarm.tiny_model import build_tiny_model

        work = tempfile.TemporaryDirectory(prefix="petals-chain-fuzz-")
        model_path = build_tiny_model(Path(work.name) / "model", num_layers=4)
        mem = memory_for(model_path, 64, 4, 4)
        sw = LocalSwarm(model_path, [LocalServer("a", mem, tau_p=0.002), LocalServer("b", mem, tau_p=0.002)],
                        max_length=64, arrival_rate=1.0, log_dir=Path(work.name) / "logs",
                        orchestrator_args=["--max-queue", "32"])
        sw.start()
        sw.wait_ready(timeout=180)
        url = sw.url
    try:
        st = httpx.get(f"{url}/api/v1/swarm", timeout=10).json()
        model, max_length = st["model"], st["max_length"]
        honest_body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        before = httpx.post(f"{url}/v1/completions", json=honest_body, timeout=120).json()["petals_chain"][0]["token_ids"]
        report: dict[str, Any] = {"url": url}
        report["hostile"] = hostile_cases(url, model, max_length=max_length)
        report["hostile"].pop("results")
        report["streams"] = asyncio.run(stream_abuse(url, model, streams=args.streams))
        report["schema"] = schema_fuzz(url, model, examples=args.examples, seed=args.seed, log=log)
        report["after"] = settled(url)
        after = httpx.post(f"{url}/v1/completions", json=honest_body, timeout=120).json()["petals_chain"][0]["token_ids"]
        report["honest_identical"] = before == after
        report["command"] = "python scripts/fuzz_api.py " + " ".join(argv if argv is not None else sys.argv[1:])
    finally:
        if sw is not None:
            sw.stop()
            work.cleanup()
    print(json.dumps(report, indent=None if args.json else 2))
    bad = (report["hostile"]["failures"] or report["schema"]["failures"] or report["streams"]["errors"]
           or any(int(k) >= 500 for k in report["streams"]["statuses"]) or not report["after"]["settled"]
           or not report["honest_identical"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
