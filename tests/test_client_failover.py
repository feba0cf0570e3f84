"""The Python client given several orchestrators: a request one of them cannot serve goes to the next, and a
reproducible stream cut off mid-way resumes there without repeating text. Unit tests drive the retry rules
through httpx's mock transport; the end-to-end test kills a real orchestrator mid-stream."""

from __future__ import annotations

import json
import time
import signal

import httpx
import pytest

from petals_chain.client import Client, ClientError
from petals_chain.swarm.local import signal_role

MODEL = "m"


def _sse(texts: list[str], cut: bool = False):
    """An SSE body yielding ``texts`` as completion chunks; ``cut``: the connection drops after them."""
    for t in texts:
        yield ("data: " + json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": None}]}) + "\n\n").encode()
    if cut:
        raise httpx.ReadError("connection lost")
    yield b"data: [DONE]\n\n"


class _Stream(httpx.SyncByteStream):
    def __init__(self, gen):
        self.gen = gen

    def __iter__(self):
        yield from self.gen


def _client(handlers: list, retry_s: float = 0.0) -> Client:
    c = Client([f"http://orch{i}" for i in range(len(handlers))], model=MODEL, retry_s=retry_s)
    for i, h in enumerate(handlers):
        c._https[i] = httpx.Client(base_url=f"http://orch{i}", transport=httpx.MockTransport(h))
    return c


def _completion(text: str) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": text, "finish_reason": "length"}], "usage": {},
                                     "petals_chain": [{"token_ids": [1, 2]}]})


def test_one_shot_goes_to_the_next_orchestrator_and_stays_there():
    calls = []

    def dead(req):
        calls.append("dead")
        raise httpx.ConnectError("refused")

    def busy(req):
        calls.append("busy")
        return httpx.Response(503, json={"error": {"message": "no chain", "code": "unavailable"}})

    def good(req):
        calls.append("good")
        return _completion("hello")

    c = _client([dead, busy, good])
    assert c.complete("x").text == "hello" and calls == ["dead", "busy", "good"]
    assert c.url == "http://orch2"
    calls.clear()
    assert c.complete("x").text == "hello" and calls == ["good"]  # it stays with the one that answered
    # a refusal (4xx) is the answer, not a reason to try elsewhere (a full queue's 429 is: test_s33_client.py)
    c = _client([lambda r: httpx.Response(429, json={"error": {"message": "slow down", "code": "tokens_per_minute"}}),
                 good])
    with pytest.raises(ClientError) as e:
        c.complete("x")
    assert e.value.status == 429 and c.url == "http://orch0"
    # nobody can serve: one error naming each
    c = _client([dead, dead])
    with pytest.raises(ClientError) as e:
        c.complete("x")
    assert e.value.status == 503 and e.value.message.count("ConnectError") == 2


def test_rounds_go_on_until_an_orchestrator_serves_or_the_retry_time_is_out():
    """With several orchestrators, a request none of them can serve now goes round them again (the survivor of a
    lost orchestrator serves once it adopted that group, ~10 s): one round each, then none (a forwarded stream
    cut off by the lost orchestrator failed at once, the survivor's retry going to the dead one)."""
    calls = []

    def dead(req):
        calls.append("dead")
        raise httpx.ConnectError("refused")

    def later(req):  # cannot serve the first two times, then can
        calls.append("later")
        if calls.count("later") <= 2:
            return httpx.Response(503, json={"error": {"message": "no chain yet", "code": "swarm_unavailable"}})
        return _completion("served")

    t0 = time.monotonic()
    assert _client([later, dead], retry_s=10).complete("x").text == "served"
    assert calls == ["later", "dead", "later", "dead", "later"] and time.monotonic() - t0 < 5
    # the last answer, when nobody served in time, is that orchestrator's own error
    calls.clear()
    c = _client([dead, lambda r: httpx.Response(503, json={"error": {"message": "no chain", "code": "x"}})],
                retry_s=1)
    with pytest.raises(ClientError) as e:
        c.complete("x")
    assert e.value.status == 503 and e.value.message == "no chain" and calls.count("dead") >= 2
    with pytest.raises(ValueError):
        Client("http://x", retry_s=-1)


def test_opening_a_session_is_sent_again_only_if_it_never_arrived():
    """Opening a session creates one: after a connection that may have carried the request (a read error), it is
    not sent to another orchestrator (an orphaned session would hold a place of the key's max_sessions)."""
    opened = []

    def cut_after_sending(req):
        opened.append(0)
        raise httpx.ReadError("connection reset")

    def refused(req):
        raise httpx.ConnectError("refused")

    def opens(req):
        opened.append(1)
        return httpx.Response(200, json={"session_id": "s1", "max_length": 64})

    with pytest.raises(ClientError):
        _client([cut_after_sending, opens]).session()
    assert opened == [0]
    assert _client([refused, opens]).session().id == "s1" and opened == [0, 1]
    # a proxy's 502/504 may come after the session was opened behind it: not sent again; a 503 ("not here") is
    for status, again in ((502, False), (504, False), (503, True)):
        opened.clear()

        def behind_a_proxy(req, status=status):
            opened.append(0)
            return httpx.Response(status, json={"error": {"message": "upstream", "code": "x"}})

        if again:
            assert _client([behind_a_proxy, opens]).session().id == "s1" and opened == [0, 1]
        else:
            with pytest.raises(ClientError):
                _client([behind_a_proxy, opens]).session()
            assert opened == [0], status


def _error_event(status: int, code: str):
    yield ("data: " + json.dumps({"error": {"message": "x", "type": "server_error" if status >= 500 else
                                            "rate_limit_error", "param": None, "code": code, "status": status}})
           + "\n\n").encode()
    yield b"data: [DONE]\n\n"


def test_an_error_event_keeps_its_status_and_a_503_one_tries_the_next_orchestrator():
    """A stream that failed after its 200 (an error event) reports the status the error would have had, and one
    another orchestrator may serve (503) goes there. (Every such error raised at once, as a 400 or a 503.)"""
    calls = []

    def lost(req):
        calls.append("lost")
        return httpx.Response(200, stream=_Stream(_error_event(503, "swarm_unavailable")))

    def good(req):
        calls.append("good")
        return httpx.Response(200, stream=_Stream(_sse(["he", "llo"])))

    assert "".join(_client([lost, good]).stream("x")) == "hello" and calls == ["lost", "good"]
    late = _client([lambda r: httpx.Response(200, stream=_Stream(_error_event(504, "deadline_exceeded"))), good])
    with pytest.raises(ClientError) as e:
        list(late.stream("x"))
    assert e.value.status == 504 and e.value.code == "deadline_exceeded"
    with pytest.raises(ClientError) as e:  # the last orchestrator's error is the answer
        list(_client([lost]).stream("x"))
    assert e.value.status == 503 and e.value.code == "swarm_unavailable"


def test_cut_stream_resumes_elsewhere_without_repeating_text():
    def cut(req):
        return httpx.Response(200, stream=_Stream(_sse(["The ", "quick "], cut=True)))

    def whole(req):
        return httpx.Response(200, stream=_Stream(_sse(["The qu", "ick brown", " fox"])))

    c = _client([cut, whole])
    assert "".join(c.stream("x", temperature=0)) == "The quick brown fox"
    assert c.url == "http://orch1"
    c = _client([cut, whole])
    assert "".join(c.stream("x", temperature=0.8, seed=3)) == "The quick brown fox"  # seeded: reproducible
    c = _client([cut, whole])
    got = []
    with pytest.raises(ClientError) as e:
        for piece in c.stream("x", temperature=0.8):  # sampled without a seed: another orchestrator would differ
            got.append(piece)
    assert got == ["The ", "quick "] and "without a seed" in e.value.message


def test_session_stays_on_its_orchestrator():
    seen = []

    def orch(i):
        def handle(req):
            seen.append((i, req.url.path))
            if req.url.path == "/api/v1/sessions":
                return httpx.Response(200, json={"session_id": f"s{i}", "max_length": 64})
            return httpx.Response(200, json={"text": "ok", "token_ids": [1], "finish_reason": "length", "usage": {},
                                             "wait_s": 0, "service_s": 0, "chain": [], "failovers": 0})
        return handle

    c = _client([orch(0), orch(1)])
    with c.session() as s:
        s.complete("hi")
        c._current = 1  # the client moved on (say, for one-shot requests)
        s.complete("again")
    assert [i for i, _ in seen] == [0, 0, 0, 0]  # open, two turns, close: all on orchestrator 0


def test_a_session_whose_orchestrator_is_gone_raises_client_errors_and_keeps_the_callers_own():
    """Session calls to an orchestrator that went away raise ClientError 503 like one-shot calls (they raised
    httpx's errors), and leaving a ``with`` block on an error keeps that error (the failed close replaced it)."""
    gone = [False]

    def handle(req):
        if gone[0]:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"session_id": "s", "max_length": 64})

    c = _client([handle])
    s = c.session()
    gone[0] = True
    for call in (lambda: s.complete("x"), lambda: list(s.stream("x")), s.info):
        with pytest.raises(ClientError) as e:
            call()
        assert e.value.status == 503 and e.value.code == "unavailable"
    gone[0] = False
    other = c.session()
    gone[0] = True
    with pytest.raises(KeyError):
        with other:
            raise KeyError("the caller's own")


def test_the_model_asked_for_is_the_one_sessions_and_the_transformers_interface_use(monkeypatch):
    """On an orchestrator serving several models, a session of ``Client(model="code")`` and
    ``AutoDistributedModelForCausalLM.from_pretrained("code")`` use "code" (they used the first model listed)."""
    from petals_chain.client import AutoDistributedModelForCausalLM

    bodies = []

    def handle(req):
        body = json.loads(req.content) if req.content else {}
        bodies.append((req.url.path, body))
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "chat"}, {"id": "code"}]})
        if req.url.path == "/api/v1/sessions":
            return httpx.Response(200, json={"session_id": "s", "max_length": 64})
        return httpx.Response(200, json={"choices": [{"text": "x", "finish_reason": "length"}], "usage": {},
                                         "petals_chain": [{"token_ids": [7]}]})

    c = _client([handle])
    c._model = "code"
    c.session().close()
    assert bodies[0] == ("/api/v1/sessions", {"model": "code"})
    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handle), **kw))
    bodies.clear()
    AutoDistributedModelForCausalLM.from_pretrained("code", url="http://orch").generate([[1, 2]], max_new_tokens=1)
    assert [b.get("model") for path, b in bodies if path == "/v1/completions"] == ["code"]


@pytest.mark.slow
def test_a_killed_orchestrator_mid_stream_is_replaced_by_the_other(tiny_model_factory, tmp_path):
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

    model = tiny_model_factory("llama", 4)
    mem = memory_for(model, 160, 4, 4)
    swarms = []
    try:
        for name in "ab":  # two swarms of the same model, one orchestrator each
            sw = LocalSwarm(model, [LocalServer(f"{name}0", mem, tau_p=0.01, emulate_rtt_ms=20)], max_length=160,
                            log_dir=tmp_path / name)
            sw.start()
            swarms.append(sw)
        a, b = swarms
        for sw in swarms:
            sw.wait_ready(timeout=240)
        prompt = [5, 6, 7, 8, 9]
        want = Client(b.url).complete(prompt, max_tokens=120, ignore_eos=True)
        client = Client([a.url, b.url], timeout=120)
        stream = client.stream(prompt, max_tokens=120, ignore_eos=True)
        pieces = [next(stream)]  # served by a
        assert client.url == a.url
        signal_role(a.orchestrator.popen.pid, signal.SIGKILL)  # a's orchestrator dies mid-generation
        pieces.extend(stream)
        assert "".join(pieces) == want.text
        assert client.url == b.url
        # a is unreachable now: one-shot requests go to b at once
        again = Client([a.url, b.url], timeout=120).complete(prompt, max_tokens=16, ignore_eos=True)
        assert again.token_ids == want.token_ids[:16]
    finally:
        for sw in swarms:
            sw.stop()


def test_a_resumed_stream_goes_on_round_the_orchestrators_not_back():
    """Three orchestrators, the first down, the second cut mid-stream: the resume went back to the first (the round
    counted from the one that had answered, mid-round) and never asked the third; with ``retry_s=0`` it failed."""
    calls = []

    def dead(req):
        calls.append("A")
        raise httpx.ConnectError("refused")

    def cut(req):
        calls.append("B")
        return httpx.Response(200, stream=_Stream(_sse(["The ", "quick "], cut=True)))

    def good(req):
        calls.append("C")
        return httpx.Response(200, stream=_Stream(_sse(["The quick brown fox"])))

    assert "".join(_client([dead, cut, good]).stream("x")) == "The quick brown fox" and calls == ["A", "B", "C"]


def test_calls_that_return_one_completion_refuse_what_would_be_lost():
    """``complete`` dropped the logprobs it asked for; ``n=2`` or a batch of prompts returned the first choice alone
    (streamed: both choices' pieces interleaved); ``stream=True`` on ``complete`` failed decoding the reply;
    a session's ``complete(prompt, input_ids=...)`` sent the ids and dropped the prompt without a word."""
    bodies = []

    def orch(req):
        bodies.append(json.loads(req.content))
        if req.url.path.startswith("/api/v1/sessions/"):
            return httpx.Response(200, json={"text": "hi", "token_ids": [1], "finish_reason": "length",
                                             "usage": {}, "wait_s": 0, "service_s": 0, "chain": [], "failovers": 0})
        if req.url.path == "/api/v1/sessions":
            return httpx.Response(200, json={"session_id": "s1", "max_length": 64})
        if req.url.path == "/v1/chat/completions":
            return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                                             "usage": {}})
        return httpx.Response(200, json={"choices": [{"text": "hi", "finish_reason": "length",
                                                      "logprobs": {"tokens": ["hi"]}}], "usage": {},
                                         "petals_chain": [{"token_ids": [1]}]})

    c = _client([orch])
    assert c.complete("x", logprobs=1).logprobs == {"tokens": ["hi"]}
    for call in (lambda: c.complete("x", n=2), lambda: list(c.stream("x", n=2)), lambda: c.complete(["a", "b"]),
                 lambda: c.complete([[1, 2], [3]]), lambda: c.chat_completion([{"role": "user", "content": "x"}], n=3)):
        with pytest.raises(ValueError, match="one completion|one prompt"):
            call()
    for call in (lambda: c.complete("x", stream=True), lambda: list(c.stream("x", stream=False))):
        with pytest.raises(TypeError, match="stream"):
            call()
    assert c.complete([5, 6], n=1).text == "hi"  # token ids are one prompt; n=1 is fine
    # a list of one prompt (OpenAI's form, a tokenizer's batch of one) and a stream= that agrees are fine
    for call in (lambda: c.complete(["one"]), lambda: c.complete([[1, 2, 3]]), lambda: c.complete("x", stream=False),
                 lambda: c.chat_completion([{"role": "user", "content": "x"}], stream=False)):
        assert call().text == "hi"
    assert "stream" not in bodies[-1]
    s = c.session()
    with pytest.raises(ValueError, match="not both"):
        s.complete("hello", input_ids=[1])
    n = len(bodies)
    assert s.complete(input_ids=[1]).text == "hi" and len(bodies) == n + 1


def test_a_session_close_that_did_not_reach_its_orchestrator_can_be_tried_again():
    state = {"up": False, "deletes": 0}

    def orch(req):
        if req.method == "DELETE":
            if not state["up"]:
                raise httpx.ConnectError("refused")
            state["deletes"] += 1
            return httpx.Response(200, json={"closed": True})
        return httpx.Response(200, json={"session_id": "s1", "max_length": 64})

    s = _client([orch]).session()
    with pytest.raises(ClientError):
        s.close()
    assert not s.closed
    state["up"] = True
    s.close()
    s.close()
    assert s.closed and state["deletes"] == 1


def test_a_session_turn_asks_for_logprobs_and_returns_its_own():
    """``logprobs=`` on a session's ``complete``/``chat``/``generate``/``stream`` is sent and the turn's come back
    (``last.logprobs``; a stream's chunks joined): ``complete`` dropped them, and a turn that failed left
    ``last`` holding the turn before it, logprobs and all."""
    bodies = []
    turn = {"n": 0}

    def orch(req):
        if req.url.path == "/api/v1/sessions":
            return httpx.Response(200, json={"session_id": "s1", "max_length": 64})
        body = json.loads(req.content)
        bodies.append(body)
        turn["n"] += 1
        if body.get("prompt") == "boom":
            return httpx.Response(503, json={"error": {"message": "no chain", "code": "swarm_unavailable"}})
        lp = {"tokens": [f"t{turn['n']}"], "token_logprobs": [-0.5], "top_logprobs": [None], "text_offset": [0]}
        if not body.get("stream"):
            return httpx.Response(200, json={"text": f"t{turn['n']}", "token_ids": [1], "finish_reason": "length",
                                             "usage": {}, "wait_s": 0, "service_s": 0, "chain": [], "failovers": 0,
                                             "logprobs": lp if "logprobs" in body else None})
        events = [{"text": "ab", "finish_reason": None,
                   "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [None, None],
                                "text_offset": [0, 1]}},
                  {"text": "c", "finish_reason": None,
                   "logprobs": {"tokens": ["c"], "token_logprobs": [-3.0], "top_logprobs": [None], "text_offset": [2]}},
                  {"text": "", "finish_reason": "stop", "logprobs": None}]
        sse = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
        return httpx.Response(200, stream=_Stream(iter([sse])), headers={"content-type": "text/event-stream"})

    s = _client([orch]).session()
    got = s.complete("x", logprobs=2)
    assert bodies[-1]["logprobs"] == 2 and got.logprobs["tokens"] == ["t1"] and s.last is got
    assert s.chat("hi", logprobs=0).logprobs["tokens"] == ["t2"] and bodies[-1]["logprobs"] == 0
    assert s.generate("x", logprobs=1) == "t3" and s.last.logprobs["tokens"] == ["t3"]
    assert s.complete("x").logprobs is None and "logprobs" not in bodies[-1]  # not asked: none sent, none back
    with pytest.raises(ClientError):
        s.complete("boom", logprobs=1)
    assert s.last is None  # not the turn before's
    assert "".join(s.stream("x", logprobs=0)) == "abc" and bodies[-1]["logprobs"] == 0
    assert s.last.text == "abc" and s.last.finish_reason == "stop"
    assert s.last.logprobs == {"tokens": ["a", "b", "c"], "token_logprobs": [-1.0, -2.0, -3.0],
                               "top_logprobs": [None, None, None], "text_offset": [0, 1, 2]}
    assert "".join(s.stream("x")) == "abc" and s.last.logprobs is None and "logprobs" not in bodies[-1]


def test_a_generation_longer_than_the_timeout_is_a_timeout_and_a_hung_orchestrator_is_passed():
    """With several orchestrators and a short ``timeout`` a generation longer than it (queued on a busy swarm) was
    sent to the next orchestrator on its read timeout, and again, waiting as long at each: an orchestrator that is up
    (its ``/healthz`` answers) makes it a 504 ``timeout``; one that answers nothing at all (hung) is passed for the
    next, as one that cannot be reached; reads (GET) go to the next."""
    calls = []

    def slow(req):
        calls.append(("slow", req.method, req.url.path))
        if req.url.path == "/healthz":
            return httpx.Response(200, json={"ok": True})
        raise httpx.ReadTimeout("timed out")

    def hung(req):
        calls.append(("hung", req.method, req.url.path))
        raise httpx.ReadTimeout("timed out")

    def good(req):
        calls.append(("good", req.method, req.url.path))
        return _completion("hello") if req.method == "POST" else httpx.Response(200, json={"data": [{"id": MODEL}]})

    c = _client([slow, good])
    with pytest.raises(ClientError) as e:
        c.complete("x")
    assert e.value.status == 504 and e.value.code == "timeout" and "http://orch0 is up" in e.value.message
    assert calls == [("slow", "POST", "/v1/completions"), ("slow", "GET", "/healthz")] and c.url == "http://orch0"
    calls.clear()
    assert c.swarm() == {"data": [{"id": MODEL}]} and [x[0] for x in calls] == ["slow", "good"]
    calls.clear()
    c = _client([hung, good])
    assert c.complete("x").text == "hello" and c.url == "http://orch1"
    calls.clear()
    # a proxy in front of a dead orchestrator answers /healthz with a 502: not up either
    c = _client([lambda r: httpx.Response(502) if r.url.path == "/healthz" else hung(r), good])
    assert c.complete("x").text == "hello" and c.url == "http://orch1"
    calls.clear()
    c = _client([hung, good])
    assert c.complete("x").text == "hello" and c.url == "http://orch1"
    assert calls == [("hung", "POST", "/v1/completions"), ("hung", "GET", "/healthz"),
                     ("good", "POST", "/v1/completions")]
