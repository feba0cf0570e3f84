"""HTTP API of an in-process orchestrator (real DHT peer, no servers yet): validation, errors, not-ready paths."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.api import create_app
from petals_chain.orchestrator.core import Unavailable


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def run_with_api(model_path, fn, **cfg_kwargs):
    async def main():
        cfg = OrchestratorConfig(model=str(model_path), max_length=64, port=0, **cfg_kwargs)
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        try:
            app = create_app(orch)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orch") as c:
                return await fn(orch, c)
        finally:
            await orch.stop()

    return asyncio.run(main())


def test_an_unexpected_error_is_a_json_500(model_path, monkeypatch):
    """A bug in a handler still answers in OpenAI's error format (a fuzzed request got a plain-text 500)."""
    async def main():
        orch = Orchestrator(OrchestratorConfig(model=str(model_path), max_length=64, port=0))
        orch.load_model()
        await orch.start()
        try:
            def boom(*args, **kwargs):
                raise RuntimeError("boom")

            monkeypatch.setattr(orch, "validate_prompt", boom)
            transport = httpx.ASGITransport(app=create_app(orch), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://orch") as c:
                r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": "x", "max_tokens": 2})
                assert (await c.get("/healthz")).status_code == 200  # the app goes on
        finally:
            await orch.stop()
        return r

    r = asyncio.run(main())
    err = r.json()["error"]
    assert r.status_code == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
    assert "RuntimeError" in err["message"]


def test_api_without_servers(model_path):
    async def fn(orch, c):
        r = await c.get("/healthz")
        assert r.status_code == 200 and r.json()["ready"] is False
        models = (await c.get("/v1/models")).json()
        model = models["data"][0]["id"]
        assert model == orch.model_id and models["data"][0]["max_model_len"] == 64
        assert (await c.get(f"/v1/models/{model}")).status_code == 200
        r = await c.get("/v1/models/unknown")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        st = (await c.get("/api/v1/swarm")).json()
        assert st["ready"] is False and st["initial_peers"] and st["servers"] == [] and st["chains"] == []
        assert st["c"] is None and st["predicted_response_s"] is None and st["queue_length"] == 0
        metrics = (await c.get("/metrics")).text
        assert "petals_chain_ready 0.0" in metrics
        # no chain, no prediction: a plan's bounds must not outlive its chains
        assert "petals_chain_predicted_response_lower_seconds NaN" in metrics
        assert st["num_blocks"] == orch.source.config.num_hidden_layers
        page = await c.get("/")
        assert page.status_code == 200

        # validation: OpenAI error shape, never a 500
        cases = [
            {"model": model, "prompt": "x", "max_tokens": -1},
            {"model": model, "prompt": "x", "top_k": -2},
            {"model": model, "prompt": "x", "repetition_penalty": 0},
            {"model": model, "prompt": "x", "repetition_penalty": 5e-324},  # found by fuzzing: was a 500
            {"model": model, "prompt": "x", "stop": ["a"] * 50},
            {"model": model, "prompt": "x", "presence_penalty": 2.5},
            {"model": model, "prompt": "x", "logit_bias": {"99999": 1}},
            {"model": model, "prompt": "x", "logit_bias": {"abc": 1}},
            {"model": model, "prompt": "x", "logit_bias": {"\u00b2": 1}},  # "²".isdigit(), int() fails: was a 500
            {"model": model, "prompt": "x", "logit_bias": {"\u0661": 1}},  # Arabic-Indic one: was read as token 1
            {"model": model, "prompt": "x", "speculative": "draft", "stream": True},  # no draft model: was 200
            {"model": model, "prompt": "x", "min_p": 1.5},
            {"model": model, "prompt": "x", "logprobs": 21},
            {"model": model, "prompt": "x", "best_of": 2},
            {"model": model, "prompt": "x", "unknown_field": 1},
            {"model": model, "prompt": "x", "suffix": "y"},
            {"model": model, "prompt": [[1, 2], "mixed"]},
            {"model": model, "prompt": "x " * 100},
            {"model": model, "prompt": "x", "max_tokens": 64},
            {"model": model, "prompt": ["a", "b", "c"], "n": 4},
            {"model": model, "prompt": ["a", "b"], "stream": True},
        ]
        for body in cases:
            r = await c.post("/v1/completions", json=body)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], body
        r = await c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                                       "tools": [{"type": "function"}]})
        assert r.status_code == 400
        r = await c.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404
        r = await c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # max_tokens 0 computes nothing (echo without logprobs): answered without a chain, even with none up
        r = await c.post("/v1/completions", json={"model": model, "prompt": "hello world", "max_tokens": 0,
                                                  "echo": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == "hello world"
        # echo gives the prompt back as sent: decoding its tokens dropped special tokens (a chat-formatted prompt's
        # "<|user|>", "</s>"), and stripping the echo by the prompt's length cut into the completion
        special = f"{orch.tokenizer.eos_token}\nhello {orch.tokenizer.eos_token} world"
        for stream in (False, True):
            r = await c.post("/v1/completions", json={"model": model, "prompt": special, "max_tokens": 0, "echo": True,
                                                      "stream": stream})
            text = r.json()["choices"][0]["text"] if not stream else "".join(
                json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"])
            assert text == special, (stream, text)
        r = await c.post("/v1/completions", json={"model": model, "prompt": [special, "two"], "max_tokens": 0,
                                                  "echo": True})
        assert [ch["text"] for ch in r.json()["choices"]] == [special, "two"]
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0

        # sessions: open, inspect, validate, close; unknown ids are 404
        s = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()
        sid = s["session_id"]
        assert s["max_length"] == 32
        info = (await c.get(f"/api/v1/sessions/{sid}")).json()
        assert info["tokens"] == 0 and info["chain"] == []
        r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"prompt": "a", "input_ids": [1]})
        assert r.status_code == 400
        r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"prompt": "word " * 40, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "this session's max_length is 32 tokens" in r.json()["error"]["message"]  # not the model's 64
        assert (await c.delete(f"/api/v1/sessions/{sid}")).json()["closed"] is True
        assert (await c.delete(f"/api/v1/sessions/{sid}")).status_code == 404
        assert (await c.get("/api/v1/sessions/nope")).status_code == 404

        # a valid request with no chain waits in the queue, then gets a 503 (not a hang, not a 500)
        orch.cfg.queue_timeout_s = 0.5
        r = await c.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "swarm_unavailable"
        st = (await c.get("/api/v1/swarm")).json()
        assert st["queue_length"] == 0 and st["measured"]["failed"] == 0 and st["measured"]["unserved"] == 1
        # with no chain at all a new request hears it after --no-chain-wait-s, not after the queue time (it waited
        # the whole 600 s, and the openai package retried it twice)
        orch.cfg.queue_timeout_s, orch.cfg.no_chain_wait_s = 600.0, 0.3
        r = await asyncio.wait_for(c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}),
                                   10.0)
        assert r.status_code == 503 and "no server serves the model" in r.json()["error"]["message"]
        # streamed, the same: a 503, not a 200 whose stream holds a role chunk and an error event (the openai package
        # raised a plain APIError it does not retry; nothing had gone out before the error)
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = await asyncio.wait_for(c.post(path, json={"model": model, "max_tokens": 2, "stream": True, **body}),
                                       10.0)
            assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
            assert r.json()["error"]["code"] == "swarm_unavailable" and "retry-after" in r.headers

    run_with_api(model_path, fn)


def test_too_many_prompts_are_refused_before_any_is_tokenized(model_path, monkeypatch):
    """prompts x n is checked first: a body of many short prompts held the event loop while each was tokenized,
    only to be refused afterwards."""
    async def fn(orch, c):
        encoded = []
        encode = orch.encode
        monkeypatch.setattr(orch, "encode", lambda text, **kw: encoded.append(text) or encode(text, **kw))
        r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": ["a"] * 5000, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and encoded == []
        assert "--max-choices" in r.json()["error"]["message"]
        nine = {"model": orch.model_id, "prompt": ["a"] * 9, "max_tokens": 0, "echo": True}  # no chain needed
        assert (await c.post("/v1/completions", json=nine)).status_code == 400
        orch.cfg.max_n = 16  # --max-choices 16
        r = await c.post("/v1/completions", json=nine)
        assert r.status_code == 200 and len(r.json()["choices"]) == 9
        r = await c.post("/v1/completions", json={**nine, "prompt": ["a"] * 2, "n": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"

    run_with_api(model_path, fn)


def test_a_failed_prompt_cancels_the_requests_other_prompts(model_path, monkeypatch):
    """One prompt of a multi-prompt completion fails: the others are cancelled with it, not left holding chains
    after the client has its error."""
    async def fn(orch, c):
        still_running, cancelled = [], []

        async def generate_n(ids, params, explicit, *args, **kwargs):
            if len(ids) == 1:
                await asyncio.sleep(0.05)
                raise Unavailable("no chain for this one")
            still_running.append(ids)
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                cancelled.append(ids)
                raise

        monkeypatch.setattr(orch, "generate_n", generate_n)
        r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": [[5], [5, 6], [5, 6, 7]],
                                                  "max_tokens": 1})
        assert r.status_code == 503
        assert sorted(map(len, still_running)) == [2, 3] and sorted(map(len, cancelled)) == [2, 3]

    run_with_api(model_path, fn)


def test_a_multi_prompt_deadline_is_met_only_if_its_last_prompt_is_in_time(model_path, monkeypatch):
    """Every prompt of a request shares its deadline: the first prompt to finish decided it ("met") however late
    the others came."""
    from petals_chain.orchestrator.core import Generation
    from petals_chain.orchestrator.deadlines import DEADLINE

    async def fn(orch, c):
        async def generate_n(ids, params, explicit, *args, settle=True, **kwargs):
            await asyncio.sleep(0.01 if len(ids) == 1 else 0.6)  # the second prompt ends after the deadline
            deadline = DEADLINE.get()
            deadline.first_token_at = deadline.first_token_at or time.monotonic()
            if settle:  # as the real one does
                orch.deadlines.settle(deadline)
            return [Generation(token_ids=[5], text="x", finish_reason="length", prompt_tokens=len(ids), wait_s=0.0,
                               service_s=0.01, chain=[], failovers=0)]

        monkeypatch.setattr(orch, "generate_n", generate_n)
        r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": [[5], [5, 6]], "max_tokens": 1,
                                                  "deadline_ms": 300, "best_effort": True})
        assert r.status_code == 200, r.text
        return r.json()

    body = run_with_api(model_path, fn)
    assert body["deadline"]["met"] is False, body["deadline"]


def test_a_chunked_body_past_the_limit_is_a_413(model_path):
    """Without Content-Length the limit trips while the app reads the body: FastAPI's body parsing made that a 400
    "error parsing the body"; it is a 413 as with Content-Length."""
    async def main():
        cfg = OrchestratorConfig(model=str(model_path), max_length=64, port=0)
        cfg.max_body_bytes = 1000
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        try:
            async def body():
                yield b'{"model": "m", "prompt": "'
                for _ in range(10):
                    yield b"x" * 200
                yield b'"}'

            transport = httpx.ASGITransport(app=create_app(orch))
            async with httpx.AsyncClient(transport=transport, base_url="http://orch") as c:
                return [await c.post(path, content=body(), headers={"content-type": "application/json"})
                        for path in ("/v1/completions", "/api/v1/sessions")]
        finally:
            await orch.stop()

    for r in asyncio.run(main()):
        assert r.status_code == 413 and "larger than 1000 bytes" in r.json()["error"]["message"], r.text


async def _post_later(app, path: str, body: bytes, body_arrives: asyncio.Event, headers=()) -> tuple[int, bytes]:
    """POST ``body`` to the ASGI ``app``: the headers now, the body once ``body_arrives`` is set (a slow client).
    Returns (status, response body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "scheme": "http", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1), "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    sent, status, out = False, 0, b""

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            await body_arrives.wait()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    async def send(message):
        nonlocal status, out
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            out += message.get("body", b"")

    await app(scope, receive, send)
    return status, out


def test_a_deadline_counts_from_the_requests_arrival_not_from_its_body(model_path, monkeypatch):
    """A client whose body comes 0.5 s after its headers has spent that much of a 300 ms deadline (the clock
    started once the body was read and tokenized)."""
    from petals_chain.orchestrator.core import Generation
    from petals_chain.orchestrator.deadlines import DEADLINE

    async def main():
        orch = Orchestrator(OrchestratorConfig(model=str(model_path), max_length=64, port=0))
        orch.load_model()
        await orch.start()
        try:
            async def generate_n(ids, params, explicit, *args, settle=True, **kwargs):
                deadline = DEADLINE.get()
                deadline.first_token_at = time.monotonic()
                orch.deadlines.settle(deadline)
                return [Generation(token_ids=[5], text="x", finish_reason="length", prompt_tokens=len(ids),
                                   wait_s=0.0, service_s=0.0, chain=[], failovers=0)]

            monkeypatch.setattr(orch, "generate_n", generate_n)
            body_arrives = asyncio.Event()
            body = json.dumps({"model": orch.model_id, "prompt": [5], "max_tokens": 1, "deadline_ms": 300,
                               "best_effort": True}).encode()
            posting = asyncio.ensure_future(_post_later(create_app(orch), "/v1/completions", body, body_arrives))
            await asyncio.sleep(0.5)
            body_arrives.set()
            status, out = await posting
            return status, json.loads(out)
        finally:
            await orch.stop()

    status, out = asyncio.run(main())
    assert status == 200 and out["deadline"]["met"] is False, out


def test_concurrent_session_opens_stay_within_the_keys_cap(model_path, tmp_path):
    """A key with max_sessions=2 opening 10 sessions at once (their bodies arrive just after the headers) gets 2:
    the opens under way count. (Each was checked before its body was read and recorded after its reply: all 10
    were opened.)"""
    key = "k" * 24
    keys = tmp_path / "keys"
    keys.write_text(f"alice {key} max_sessions=2\n")

    async def main():
        orch = Orchestrator(OrchestratorConfig(model=str(model_path), max_length=64, port=0, api_keys=str(keys)))
        orch.load_model()
        await orch.start()
        try:
            app = create_app(orch)
            body_arrives = asyncio.Event()
            opens = [asyncio.ensure_future(_post_later(app, "/api/v1/sessions", b"{}", body_arrives,
                                                       [(b"authorization", f"Bearer {key}".encode())]))
                     for _ in range(10)]
            await asyncio.sleep(0.2)
            body_arrives.set()
            statuses = [status for status, _ in await asyncio.gather(*opens)]
            return sorted(statuses), len(orch.sessions)
        finally:
            await orch.stop()

    statuses, opened = asyncio.run(main())
    assert statuses == [200, 200] + [429] * 8 and opened == 2


def test_cli_rejects_bad_arguments(model_path, capsys, scaled):
    import subprocess
    import sys

    from petals_chain.orchestrator.__main__ import main

    # in this process (a `python -m` start imports torch: ~6 s of CPU each), then the entry point once
    for args, msg in [(["--arrival-rate", "-1"], "arrival rate"), (["--placement", "nope"], "invalid choice"),
                      (["--dispatch", "nope"], "invalid choice"), (["--max-length", "0"], "positive")]:
        with pytest.raises(SystemExit) as e:
            main(["--model", str(model_path), *args])
        err = capsys.readouterr().err
        assert e.value.code != 0 and msg in err, (args, err)
    r = subprocess.run([sys.executable, "-m", "petals_chain.orchestrator", "--model", str(model_path),
                        "--rho-bar", "2"], capture_output=True, text=True, timeout=scaled(60))
    assert r.returncode != 0 and "rho-bar" in r.stderr, r.stderr


def test_client_disconnect_cancels_queued_request(model_path, scaled):
    """A client that gives up is removed from the queue (real HTTP server, so the disconnect is real)."""
    import socket

    import uvicorn

    async def main():
        cfg = OrchestratorConfig(model=str(model_path), max_length=64, port=0, queue_timeout_s=60)
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(orch), log_level="warning", lifespan="off"))
        serve = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=scaled(60)) as c:
                while not server.started:
                    await asyncio.sleep(0.05)
                # No servers: the request waits in the queue (a lasting state) until its client gives up.
                post = asyncio.create_task(c.post("/v1/completions",
                                                  json={"model": orch.model_id, "prompt": "hi", "max_tokens": 2}))
                for _ in range(int(scaled(10) / 0.02)):
                    if orch.dispatch.queue_length == 1:
                        break
                    await asyncio.sleep(0.02)
                assert orch.dispatch.queue_length == 1 and not post.done()
                post.cancel()  # the client gives up: its connection closes
                await asyncio.gather(post, return_exceptions=True)
            # The queue entry goes first (inner wait_for task), the request is counted (unserved: it never held a
            # chain) when the outer
            # generate() unwinds a loop iteration later: wait for both.
            for _ in range(int(scaled(100))):
                if orch.dispatch.queue_length == 0 and orch.stats.unserved == 1:
                    break
                await asyncio.sleep(0.1)
            assert orch.dispatch.queue_length == 0 and orch.stats.unserved == 1 and orch.stats.failed == 0
        finally:
            server.should_exit = True
            await serve
            await orch.stop()

    asyncio.run(main())


def test_a_streamed_turn_whose_end_the_client_never_got_is_undone(model_path):
    """A session turn streamed to a client that leaves before ``[DONE]`` leaves the session as it was, even when the
    turn itself finished (the client cannot know it did); a stream taken to its end keeps the turn. Driven at the
    ASGI level so the client's departure falls exactly between the turn's end and its last events."""
    import json
    from types import SimpleNamespace

    from petals_chain.orchestrator.dispatch import note_admission

    async def fake_turn(s, target, params, *, explicit_max_tokens=True, emit=None, messages=None, based_on=None):
        async with s.lock:  # a turn that finishes at once, as the race has it
            note_admission(True)  # as the dispatcher does when it starts the job: the stream flows from here
            await asyncio.sleep(0.05)
            await emit("ok", [])
            s.history, s.turns = [*target, 7], s.turns + 1
            return SimpleNamespace(token_ids=[7], finish_reason="stop", cached_tokens=0, prompt_tokens=len(target))

    async def stream_turn(app, sid: str, leave_at_end: bool) -> bytes:
        body = json.dumps({"input_ids": [1, 2], "max_tokens": 1, "stream": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": f"/api/v1/sessions/{sid}/generate", "raw_path": b"",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                    (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("orch", 80)}
        sent = bytearray()
        fed = False

        async def receive():
            nonlocal fed
            if not fed:
                fed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client says nothing more

        async def send(message):
            chunk = message.get("body", b"")
            if leave_at_end and b'"finish_reason":"stop"' in chunk:
                raise OSError("the client is gone")  # as uvicorn's send fails on a closed connection
            sent.extend(chunk)

        try:
            await app(scope, receive, send)
        except Exception:  # noqa: BLE001 - starlette's ClientDisconnect, as a server would see it
            pass
        return bytes(sent)

    async def fn(orch, c):
        orch.session_generate = fake_turn
        app = c._transport.app
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        s = orch.get_session(sid)
        got = await stream_turn(app, sid, leave_at_end=False)
        assert got.rstrip().endswith(b"data: [DONE]") and s.turns == 1 and s.history == [1, 2, 7]
        got = await stream_turn(app, sid, leave_at_end=True)
        assert b'"text":"ok"' in got and b"[DONE]" not in got
        for _ in range(100):  # the stream's generator is closed by the event loop once dropped
            if s.turns == 1:
                break
            await asyncio.sleep(0.02)
        assert s.turns == 1 and s.history == [1, 2, 7]

    run_with_api(model_path, fn)


def test_a_turn_whose_client_left_while_it_ran_is_undone(model_path):
    """A session turn (not streamed) whose client timed out while it ran, finished in less than the second between
    two checks for a disconnect: it was kept, and the client's retry of the turn held its input twice."""
    import json
    from types import SimpleNamespace

    async def fake_turn(s, target, params, *, explicit_max_tokens=True, emit=None, messages=None, based_on=None):
        async with s.lock:
            await asyncio.sleep(0.05)
            s.history, s.turns = [*target, 7], s.turns + 1
            return SimpleNamespace(text="ok", token_ids=[7], finish_reason="stop", cached_tokens=0, prompt_tokens=2,
                                   wait_s=0.0, service_s=0.05, chain=[], failovers=0)

    async def fn(orch, c):
        orch.session_generate = fake_turn
        app = c._transport.app
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        s = orch.get_session(sid)
        body = json.dumps({"input_ids": [1, 2], "max_tokens": 1}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": f"/api/v1/sessions/{sid}/generate", "raw_path": b"",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                    (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("orch", 80)}
        messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0) if len(messages) > 1 else messages[0]

        sent = []

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        assert s.turns == 0 and s.history == [] and sent[0]["status"] == 499
        r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"input_ids": [1, 2], "max_tokens": 1})
        assert r.status_code == 200 and s.turns == 1 and s.history == [1, 2, 7]  # a client that stays keeps it

    run_with_api(model_path, fn)


def test_a_turn_built_before_another_turn_ended_is_refused_not_undoing_it(model_path):
    """Two calls on one session, the second read (tokenized) while the first ran and ended: its target was the
    history before the first turn, so it rewound the session over that turn. Now it is a 409."""
    async def fn(orch, c):
        sid = (await c.post("/api/v1/sessions", json={"max_length": 32})).json()["session_id"]
        s = orch.get_session(sid)
        build = orch.session_target

        def meanwhile(sess, new_ids):
            target = build(sess, new_ids)
            sess.history, sess.turns = [9, 9, 7], sess.turns + 1  # another call's turn ended meanwhile
            return target

        orch.session_target = meanwhile
        r = await c.post(f"/api/v1/sessions/{sid}/generate", json={"input_ids": [1, 2], "max_tokens": 1})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
        assert s.history == [9, 9, 7] and s.turns == 1

    run_with_api(model_path, fn)


def test_a_refused_field_is_named_in_the_error(model_path):
    """OpenAI's error names the offending field in ``param``; a model-level check gave ``param: null`` (tools,
    best_of, top_logprobs without logprobs, ...), an out-of-vocabulary ``stop_token_ids`` entry was blamed on
    ``logit_bias``, and a ``max_completion_tokens`` too long for the context on ``max_tokens``."""
    async def fn(orch, c):
        model = orch.model_id
        msgs = [{"role": "user", "content": "hi"}]
        cases = [("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
                 ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
                 ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
                 ("/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function"}]}, "tools.0.function"),
                 ("/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
                 ("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "yaml"}},
                  "response_format.type"),
                 ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "a", "tool_calls": [{}]}]},
                  "messages.0.tool_calls.0.id")]
        # an output limit past the context, or too long for the prompt, is named as the request sent it (the chat
        # API's newer max_completion_tokens included)
        most = orch.cfg.max_length
        for path, body in [("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "x"})]:
            for field in ("max_tokens", "max_completion_tokens") if "messages" in body else ("max_tokens",):
                cases += [(path, {**body, field: most + 1}, field), (path, {**body, field: most - 1}, field)]
        for path, body, param in cases:
            r = await c.post(path, json={"model": model, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            if body.get(param) == most - 1:
                assert r.json()["error"]["code"] == "context_length_exceeded", r.text
            if param.startswith("max_"):
                assert param in r.json()["error"]["message"], r.text

    run_with_api(model_path, fn)


def test_session_turns_carry_their_own_logprobs(model_path):
    """A session turn takes ``logprobs`` (it was refused as an unknown field): the turn's sampling gets it (its
    generation computes them) and the reply carries the turn's tokens in /v1/completions' format, text, token-id
    and chat turns alike; a stream carries each chunk's, text_offset running on over the chunks as the whole
    reply's. Each turn's are its own: a turn undone (its streamed client left) and taken again, or a turn after
    it, never shows another turn's tokens. ``logprobs: true`` (chat's habit) is refused, not read as 1."""
    import json

    from petals_chain.orchestrator.generation import Generation
    from petals_chain.orchestrator.sampling import TokenChoice

    asked: list = []
    words = iter([" red fox", " blue sky", " green tea", " old bridge", " dark night"])

    async def fn(orch, c):
        async def fake_turn(s, target, params, *, explicit_max_tokens=True, emit=None, messages=None,
                            based_on=None):
            asked.append(params.logprobs)
            toks = orch.encode(next(words), add_special_tokens=False)
            k = params.logprobs
            choices = [TokenChoice(t, -1.0 - i, None if not k else [(t, -1.0 - i), (t + 1, -3.0)][:k])
                       for i, t in enumerate(toks)]
            async with s.lock:
                for ch in choices:  # one token per chunk
                    if emit is not None:
                        await emit(orch.decode([ch.token]), [ch])
                s.history, s.turns = [*target, *toks], s.turns + 1
                return Generation(token_ids=toks, text=orch.decode(toks), finish_reason="length",
                                  prompt_tokens=len(target), wait_s=0.0, service_s=0.0, chain=[], failovers=0,
                                  logprobs=choices if k is not None else None)

        def check(lp: dict, text: str, k: int) -> None:
            """``lp`` is the object of ``text``'s tokens alone (as the fake turn scored them)."""
            n = len(orch.encode(text, add_special_tokens=False))
            assert "".join(lp["tokens"]) == text and len(lp["tokens"]) == n
            assert lp["token_logprobs"] == [-1.0 - i for i in range(n)]
            assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
            if k:
                assert all(len(top) == k and top[tok] == p
                           for top, tok, p in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"]))
            else:
                assert lp["top_logprobs"] == [None] * n

        async def stream(sid: str, body: dict) -> tuple[str, dict]:
            text, joined = "", {}
            async with c.stream("POST", f"/api/v1/sessions/{sid}/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        assert ev["logprobs"] is None or "".join(ev["logprobs"]["tokens"]) == ev["text"]
                        text += ev["text"]
                        for key, values in (ev["logprobs"] or {}).items():
                            joined.setdefault(key, []).extend(values)
            return text, joined

        orch.session_generate = fake_turn
        sid = (await c.post("/api/v1/sessions", json={"max_length": 48})).json()["session_id"]
        url = f"/api/v1/sessions/{sid}/generate"
        for bad in (True, False, 21, -1):
            r = await c.post(url, json={"input_ids": [1, 2], "logprobs": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        r = (await c.post(url, json={"input_ids": [1, 2], "max_tokens": 4, "logprobs": 2})).json()
        check(r["logprobs"], r["text"], 2)
        assert r["text"] == " red fox"
        r = (await c.post(url, json={"prompt": " and", "max_tokens": 4})).json()
        assert r["logprobs"] is None and r["text"] == " blue sky"  # not asked: none
        s = orch.get_session(sid)
        before = s.snapshot()
        text, lp = await stream(sid, {"prompt": " then", "max_tokens": 4, "logprobs": 0})
        assert text == " green tea"
        check(lp, text, 0)
        assert s.forget_turn(before)  # as when its client left before [DONE]: the turn is taken again
        text, lp = await stream(sid, {"prompt": " then", "max_tokens": 4, "logprobs": 1})
        assert text == " old bridge"
        check(lp, text, 1)  # its own tokens, offsets from 0: nothing of the undone turn
        chat = (await c.post("/api/v1/sessions", json={"max_length": 48})).json()["session_id"]
        hi = [{"role": "user", "content": "hi"}]
        r = (await c.post(f"/api/v1/sessions/{chat}/generate", json={"messages": hi, "max_tokens": 4, "logprobs": 2}))
        r = r.json()
        check(r["logprobs"], r["text"], 2)
        assert asked == [2, None, 0, 1, 2]

    run_with_api(model_path, fn)
