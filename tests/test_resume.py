"""Finishing a forwarded stream another orchestrator cut off (orchestrator/resume.py), in process: what the client
already has is never sent twice nor lost (text, logprob entries, ends, usage), a rerun that does not repeat it is an
error, deadlines keep counting, and a silent sender that stops refreshing its group record counts as a cut."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import petals_chain.orchestrator.resume as rs
from petals_chain.orchestrator.deadlines import MAX_DEADLINE_MS

_CLIENT = httpx.AsyncClient


def ev(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def cmpl(text: str, finish=None, tokens=None, cid="cmpl-1") -> bytes:
    lp = None if tokens is None else {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens),
                                      "top_logprobs": None, "text_offset": [0] * len(tokens)}
    return ev({"id": cid, "created": 1, "choices": [{"text": text, "index": 0, "logprobs": lp,
                                                     "finish_reason": finish}]})


def usage(cid="cmpl-1") -> bytes:
    return ev({"id": cid, "created": 1, "choices": [], "usage": {"completion_tokens": 3}})


DONE = b"data: [DONE]\n\n"


def record(**body) -> rs.StreamRecord:
    return rs.StreamRecord({"prompt": [1, 2], "stream": True, "temperature": 0, **body}, time.monotonic())


def feed(rec: rs.StreamRecord, events: list[bytes]) -> list[bytes]:
    return [out for e in events if (out := rec.take(e)) is not None]


def parsed(events: list[bytes]) -> list:
    """Each event of the bytes sent, parsed ("data: [DONE]" as text)."""
    parts = [e for e in b"".join(events).split(b"\n\n") if e]
    return [e.decode() if e == DONE.strip() else json.loads(e[len(b"data: "):]) for e in parts]


def run_finish(rec, monkeypatch, handler, where=lambda refused: ("http://127.0.0.1:1", True), alive=lambda u: True):
    seen = []

    class Client(_CLIENT):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(lambda req: seen.append(req) or handler(req, len(seen))),
                             **kw)

    monkeypatch.setattr(rs.httpx, "AsyncClient", Client)
    monkeypatch.setattr(rs, "RESUME_PAUSE_S", 0.0)

    async def main():
        return [e async for e in rs.finish(rec, "/v1/completions", {"authorization": "Bearer k"}, where, alive,
                                           "http://lost")]
    return asyncio.run(main()), seen


class Chunks(httpx.AsyncByteStream):
    def __init__(self, *chunks: bytes, stall_s: float = 0.0):
        self.chunks, self.stall_s = chunks, stall_s

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        if self.stall_s:
            await asyncio.sleep(self.stall_s)


def sse(*chunks: bytes, status: int = 200) -> httpx.Response:
    return httpx.Response(status, headers={"content-type": "text/event-stream"}, stream=Chunks(*chunks))


def test_a_rerun_passes_on_only_what_is_new_logprobs_of_held_back_text_included(monkeypatch):
    """The client had "Hel" + "lo" (with logprobs); the rerun repeats them and goes on, including a last event whose
    text is empty but whose logprobs are the stop string's tokens: every entry reaches the client once, the usage
    event once, under the first run's id."""
    full = [cmpl("Hel", tokens=["Hel"]), cmpl("lo", tokens=["lo"]), cmpl(" wor", tokens=[" wor"]),
            cmpl("", tokens=[" u", "j"]), cmpl("", finish="stop"), usage(), DONE]
    rec = record(stream_options={"include_usage": True}, logprobs=1, stop=["uj"])
    first = feed(rec, full[:2])
    out, seen = run_finish(rec, monkeypatch, lambda req, n: sse(*[e.replace(b"cmpl-1", b"cmpl-2") for e in full]))
    got = parsed(first + out)
    assert got[-1] == "data: [DONE]" and {g["id"] for g in got[:-1]} == {"cmpl-1"}
    assert "".join(c["text"] for g in got[:-1] for c in g["choices"]) == "Hello wor"
    assert [t for g in got[:-1] for c in g["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]] == \
        ["Hel", "lo", " wor", " u", "j"]
    assert sum(1 for g in got[:-1] if g.get("usage")) == 1 and len(seen) == 1 and rec.finished_by


def test_a_rerun_that_ends_short_of_what_the_client_has_is_an_error(monkeypatch):
    rec = record()
    feed(rec, [cmpl("Hel"), cmpl("lo wor")])
    out, _ = run_finish(rec, monkeypatch, lambda req, n: sse(cmpl("Hel"), cmpl("lo"), cmpl("", finish="stop"), DONE))
    err = parsed(out)[-2]["error"]
    assert err["code"] == "resume_mismatch" and err["status"] == 502 and rec.finished_by is None


def test_a_stream_cut_after_its_last_event_only_gets_its_done(monkeypatch):
    rec = record(temperature=0.8)  # sampled: it could not be rerun, and needs not be
    feed(rec, [cmpl("Hi"), cmpl("", finish="length")])
    out, seen = run_finish(rec, monkeypatch, lambda req, n: pytest.fail("rerun"))
    assert out == [DONE] and not seen


def test_an_unseeded_sampled_stream_ends_with_an_error_and_null_fields_are_defaults(monkeypatch):
    rec = record(temperature=None)  # JSON null: the API's default (1.0), sampled
    feed(rec, [cmpl("Hi")])
    out, seen = run_finish(rec, monkeypatch, lambda req, n: pytest.fail("rerun"))
    assert parsed(out)[0]["error"]["code"] == "stream_cut" and not seen
    assert record(temperature=None, seed=7).reproducible and record(temperature=None, top_k=1).reproducible
    assert record(temperature=0, top_p=None, n=None).n == 1


def test_deadlines_keep_counting_from_the_first_arrival(monkeypatch):
    rec = rs.StreamRecord({"prompt": [1], "stream": True, "temperature": 0, "deadline_ms": 60_000,
                           "ttft_deadline_ms": 50_000}, time.monotonic() - 5.0)
    feed(rec, [cmpl("Hi")])
    out, seen = run_finish(rec, monkeypatch, lambda req, n: sse(cmpl("Hi"), cmpl("!", finish="length"), DONE))
    body = json.loads(seen[0].content)
    assert 54_000 < body["deadline_ms"] < 55_100  # its first token was sent: the TTFT one is spent
    assert body["ttft_deadline_ms"] == body["deadline_ms"]
    late = rs.StreamRecord({"prompt": [1], "stream": True, "temperature": 0, "deadline_ms": 1000},
                           time.monotonic() - 2.0)
    out, seen = run_finish(late, monkeypatch, lambda req, n: pytest.fail("rerun"))
    assert parsed(out)[0]["error"]["code"] == "deadline_exceeded" and not seen
    refused = record(deadline_ms=300)
    out, seen = run_finish(refused, monkeypatch, lambda req, n: httpx.Response(
        429, json={"error": {"code": "deadline_unreachable", "message": "doomed"}}))
    # tried again while time is left, never past the deadline: then a late request's 504 (test_s37_deadlines_left.py)
    assert parsed(out)[0]["error"]["code"] == "deadline_exceeded" and len(seen) > 1


def test_the_keys_default_deadlines_keep_counting_too(monkeypatch):
    """A body naming no deadline runs under its API key's defaults: the rerun keeps counting them from the first
    arrival (run again as they are, they started over); a deadline the body names wins over the key's."""
    hdrs = {"content-type": "text/event-stream"}
    body = json.dumps({"prompt": [1], "stream": True, "temperature": 0, "ttft_deadline_ms": 40_000}).encode()
    rec = rs.StreamRecord.of("POST", "/v1/completions", body, 200, hdrs, time.monotonic() - 5.0,
                             {"deadline_ms": 30_000, "ttft_deadline_ms": 8_000})
    out, seen = run_finish(rec, monkeypatch, lambda req, n: sse(cmpl("!", finish="length"), DONE))
    sent = json.loads(seen[0].content)
    assert 24_000 < sent["deadline_ms"] < 25_100 and 34_000 < sent["ttft_deadline_ms"] < 35_100
    assert rs.StreamRecord.of("POST", "/v1/completions", body, 200, hdrs, time.monotonic(),
                              {"deadline_ms": None, "ttft_deadline_ms": None}).body == json.loads(body)


def test_spent_and_passed_deadlines_are_not_restarted_by_the_keys_defaults(monkeypatch):
    """Once a generated token went out, the TTFT deadline is spent: the rerun names one that cannot restart (left
    out, the key's default would apply again, counted afresh); an echoed prompt is not a generated token; a best
    effort request whose deadline passed is run again late, as asked, not ended with a 504."""
    hdrs = {"content-type": "text/event-stream"}

    def rec_of(body, gone_s, defaults):
        return rs.StreamRecord.of("POST", "/v1/completions", json.dumps({"prompt": [1], "stream": True,
                                  "temperature": 0, **body}).encode(), 200, hdrs, time.monotonic() - gone_s, defaults)

    key_ttft = {"deadline_ms": None, "ttft_deadline_ms": 3000}
    rec = rec_of({}, 1.0, key_ttft)
    feed(rec, [cmpl("Hi")])
    assert json.loads(rec.rerun_body())["ttft_deadline_ms"] == MAX_DEADLINE_MS
    echo = rec_of({"echo": True}, 1.0, key_ttft)
    feed(echo, [cmpl("the prompt")])  # only the prompt went out: the first token is still to come
    assert 1900 < json.loads(echo.rerun_body())["ttft_deadline_ms"] < 2100
    feed(echo, [cmpl(" and")])
    assert json.loads(echo.rerun_body())["ttft_deadline_ms"] == MAX_DEADLINE_MS
    late = rec_of({"best_effort": True}, 5.0, {"deadline_ms": 2000, "ttft_deadline_ms": None})
    out, seen = run_finish(late, monkeypatch, lambda req, n: sse(cmpl("!", finish="length"), DONE))
    assert json.loads(seen[0].content)["deadline_ms"] == 1.0 and parsed(out)[-1] == "data: [DONE]"
    with pytest.raises(rs.DeadlineGone):
        rec_of({}, 5.0, {"deadline_ms": 2000}).rerun_body()
    # the first forward, sent on after a wait for a target: the key's defaults count from the arrival too
    sent = json.loads(rs.with_time_gone(b'{"prompt": [1], "deadline_ms": null}', time.monotonic() - 2.0,
                                        {"deadline_ms": 9000, "ttft_deadline_ms": None}))
    assert 6900 < sent["deadline_ms"] < 7100 and "ttft_deadline_ms" not in sent


def test_a_refused_rerun_ends_with_the_refusals_own_type(monkeypatch):
    out, _ = run_finish(record(), monkeypatch, lambda req, n: httpx.Response(
        401, json={"error": {"code": "invalid_api_key", "type": "authentication_error", "message": "no"}}))
    err = parsed(out)[0]["error"]
    assert (err["status"], err["code"], err["type"]) == (401, "invalid_api_key", "authentication_error")
    out, _ = run_finish(record(), monkeypatch, lambda req, n: httpx.Response(405, text="Method Not Allowed"))
    err = parsed(out)[0]["error"]
    assert (err["status"], err["code"], err["type"]) == (405, "resume_refused", "invalid_request_error")


def test_a_forwarded_request_takes_its_keys_defaults(tmp_path):
    """The forward reads the defaults of the key the request came with (the app's limits, the client's name)."""
    from types import SimpleNamespace as NS

    from starlette.requests import Request

    from petals_chain.orchestrator.auth import CLIENT, KeyRing
    from petals_chain.orchestrator.forward import _key_deadlines
    from petals_chain.orchestrator.limits import LimitsConfig

    (tmp_path / "keys").write_text(f"alice {'a' * 20} deadline_ms=9000\nbob {'b' * 20}\n")
    app = NS(state=NS(limits=NS(limits=LimitsConfig(keys=KeyRing.from_file(tmp_path / "keys")))))
    request = Request({"type": "http", "app": app, "headers": []})
    for who, want in (("alice", {"deadline_ms": 9000, "ttft_deadline_ms": None}),
                      ("bob", {"deadline_ms": None, "ttft_deadline_ms": None})):
        token = CLIENT.set(who)
        try:
            assert _key_deadlines(request) == want
        finally:
            CLIENT.reset(token)
    assert _key_deadlines(Request({"type": "http", "headers": []})) == {}  # no limits: no defaults


def test_refused_here_it_tries_another_orchestrator(monkeypatch):
    """Forwarded because this queue was full, it must not wait on this queue alone."""
    asked = []

    def where(local_refused):
        asked.append(local_refused)
        return ("http://third:8000", False) if local_refused else ("http://127.0.0.1:1", True)

    def handler(req, n):
        if req.url.host == "127.0.0.1":
            return httpx.Response(429, json={"error": {"code": "queue_full", "message": "full"}})
        return sse(cmpl("A"), cmpl("B", finish="length"), DONE)
    rec = record()
    out, seen = run_finish(rec, monkeypatch, handler, where=where)
    assert [r.url.host for r in seen] == ["127.0.0.1", "third"] and parsed(out)[-1] == "data: [DONE]"
    assert rs.RESUME_HEADER in seen[0].headers and rs.RESUME_HEADER not in seen[1].headers  # the secret stays here


def test_events_split_anywhere_and_a_silent_sender_that_stops_refreshing_is_a_cut():
    async def chunks(*cs, stall_s=0.0):
        for c in cs:
            yield c
        await asyncio.sleep(stall_s)

    async def collect(rec, gen, alive):
        out = []
        try:
            async for e in rs.relay_events(rec, gen, alive):
                out.append(e)
        except rs.Cut:
            out.append("cut")
        return out

    data = b'data: {"id":"c","choices":[{"index":0,"text":"A"}]}\r\n\r\ndata: {"id":"c","choices":[{"index":0,"text":"B"}]}\r\n\r\n'
    rec = record()
    cut = data.index(b"\r\n\r\n") + 3  # between the first event's last "\r" and "\n"
    got = asyncio.run(collect(rec, chunks(data[:cut], data[cut:cut + 1], data[cut + 1:]), lambda: True))
    assert len(got) == 2 and rec.text == {0: "AB"}
    alive = iter([True, False])
    rec = record()
    t0 = time.monotonic()
    first_end = data.index(b"\r\n\r\n") + 4
    got = asyncio.run(collect(rec, chunks(data[:first_end], data[first_end:first_end + 9], stall_s=30),
                              lambda: next(alive)))
    assert got[-1] == "cut" and rec.text == {0: "A"} and time.monotonic() - t0 < 10


def test_the_resume_header_takes_only_this_process_secret():
    assert rs.is_resume(rs.resume_headers())
    for forged in ("", "guess", "caf\xe9", rs.resume_headers()[rs.RESUME_HEADER][:-1]):
        assert not rs.is_resume({rs.RESUME_HEADER: forged})


def test_a_request_sent_on_after_a_wait_carries_what_is_left_of_its_deadlines():
    arrived = time.monotonic() - 2.0
    body = json.loads(rs.with_time_gone(json.dumps({"deadline_ms": 5000, "ttft_deadline_ms": 3000}).encode(), arrived))
    assert 2900 < body["deadline_ms"] < 3050 and 900 < body["ttft_deadline_ms"] < 1050
    with pytest.raises(rs.DeadlineGone):
        rs.with_time_gone(b'{"deadline_ms": 1000}', arrived)
    for untouched in (b'{"prompt": "x"}', b"not json"):
        assert rs.with_time_gone(untouched, arrived) == untouched
    assert json.loads(rs.with_time_gone(b'{"deadline_ms": "soon"}', arrived)) == {"deadline_ms": "soon"}  # a 400 there
    # nor a number in a string or a boolean: float() made them valid deadlines at the target ("5000" -> 2999.9,
    # true with best_effort -> 1 ms), past the API's strict typing
    for raw in ('{"deadline_ms": "5000"}', '{"deadline_ms": true, "best_effort": true}'):
        assert json.loads(rs.with_time_gone(raw.encode(), arrived)) == json.loads(raw)
