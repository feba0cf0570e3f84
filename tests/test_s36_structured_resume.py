"""A structured (json_schema) stream cut mid-way and finished by a rerun (orchestrator/resume.py, as forward.py does
when the orchestrator serving a forwarded stream is lost): the client's text is the uncut stream's token for token,
and it parses. Chat (seeded sampling, two choices, logprobs, usage) and the Responses API (greedy, ``text.format``).

The orchestrator runs in this process over fake chains on the tiny random-weight model (test_s36_structured_api's
fixture), whose output knows nothing of JSON: only the grammar makes it valid, so a rerun that lost the grammar's
state, or replayed it wrong, would give another text (a ``resume_mismatch``) or invalid JSON."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import test_s36_structured_api
from test_s33_api_envelope import _chain
from test_s36_structured_api import STRICT, Answer

import petals_chain.orchestrator.resume as rs

api = test_s36_structured_api.api  # the fixture: the app over fake chains on the tiny model
_CLIENT = httpx.AsyncClient
CHAT = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 60,
        "logprobs": True, "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": STRICT, "strict": True}}}
RESPONSES = {"input": "hi", "temperature": 0, "max_output_tokens": 60, "stream": True,
             "text": {"format": {"type": "json_schema", "name": "a", "schema": STRICT, "strict": True}}}


def _payloads(events: list[bytes]) -> list:
    """Each event's data, parsed ("[DONE]" as text); one bytes may hold several events (an ending's)."""
    out = []
    for e in b"".join(events).split(b"\n\n"):
        data = b"".join(ln[5:].strip() for ln in e.split(b"\n") if ln.startswith(b"data:"))
        if data:
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def _cut_and_resume(api, monkeypatch, path: str, body: dict, text_of) -> tuple[list, list, rs.StreamRecord]:
    """(the uncut stream's events, the client's events when it is cut after half its text and rerun, the record)."""
    orch, app = api

    class Local(_CLIENT):  # the rerun reaches this app (in process)
        def __init__(self, **kw):
            kw.pop("verify", None)
            super().__init__(transport=httpx.ASGITransport(app=app), **kw)

    monkeypatch.setattr(rs.httpx, "AsyncClient", Local)
    monkeypatch.setattr(rs, "RESUME_PAUSE_S", 0.0)

    async def main():
        orch.dispatch.set_chains([_chain(4)])
        full = {**body, "model": orch.model_id}
        raw = json.dumps(full).encode()
        async with _CLIENT(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            r = await c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            uncut = [e async for e in rs.sse_events(_once(r.content))]
        rec = rs.StreamRecord.of("POST", path, raw, 200, r.headers, time.monotonic())
        assert rec is not None and rec.reproducible
        texts = [text_of(p) for p in _payloads(uncut)]
        total, upto, k = sum(map(len, texts)), 0, 0
        while upto < total // 2:  # the events that delivered the first half of the text reached the client
            upto, k = upto + len(texts[k]), k + 1
        first = [out for e in uncut[:k] if (out := rec.take(e)) is not None]
        assert 0 < upto < total
        rest = [e async for e in rs.finish(rec, path, {"content-type": "application/json"},
                                           lambda refused: ("http://o", True), lambda url: True, "http://lost")]
        return uncut, first + rest, rec

    return asyncio.run(main())


async def _once(data: bytes):
    yield data


def _chat_text(p) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for c in p.get("choices") or []) \
        if isinstance(p, dict) else ""


def test_a_cut_structured_chat_stream_is_finished_token_for_token(api, monkeypatch):
    uncut, got, rec = _cut_and_resume(api, monkeypatch, "/v1/chat/completions", CHAT, _chat_text)
    assert rec.finished_by == "http://o" and _payloads(got)[-1] == "[DONE]"

    def per_choice(events):
        text, tokens, ends, ids, usage = {}, {}, {}, set(), 0
        for p in _payloads(events)[:-1]:
            assert "error" not in p, p
            ids.add(p["id"])
            usage += p.get("usage") is not None
            for c in p["choices"]:
                i = c["index"]
                text[i] = text.get(i, "") + ((c.get("delta") or {}).get("content") or "")
                tokens[i] = tokens.get(i, []) + [e["token"] for e in ((c.get("logprobs") or {}).get("content") or [])]
                if c.get("finish_reason") is not None:
                    ends[i] = ends.get(i, []) + [c["finish_reason"]]
        return text, tokens, ends, ids, usage

    want, have = per_choice(uncut), per_choice(got)
    assert have[1] == want[1] and have[0] == want[0]  # token for token, each choice
    assert have[2] == want[2] == {0: ["stop"], 1: ["stop"]}
    assert have[3] == want[3] and len(have[3]) == 1 and have[4] == want[4] == 1  # the first run's id; usage once
    for text in have[0].values():
        Answer.model_validate_json(text)


def _responses_text(p) -> str:
    return p.get("delta") or "" if isinstance(p, dict) and p.get("type") == "response.output_text.delta" else ""


def test_a_cut_structured_responses_stream_is_finished_token_for_token(api, monkeypatch):
    uncut, got, rec = _cut_and_resume(api, monkeypatch, "/v1/responses", RESPONSES, _responses_text)
    want, have = _payloads(uncut), _payloads(got)
    assert rec.finished_by == "http://o" and have[-1]["type"] == "response.completed"
    assert [p["sequence_number"] for p in have] == list(range(len(have)))
    assert [p["type"] for p in have] == [p["type"] for p in want]
    assert [p["delta"] for p in have if p["type"] == "response.output_text.delta"] == \
        [p["delta"] for p in want if p["type"] == "response.output_text.delta"]
    done = have[-1]["response"]
    assert done["id"] == have[0]["response"]["id"] and done["status"] == "completed"
    assert done["text"]["format"]["type"] == "json_schema"
    Answer.model_validate_json(done["output"][0]["content"][0]["text"])
