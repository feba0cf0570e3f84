"""Defects a hostile and a demanding user found in the HTTP API and the decode loop (in process, no servers)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.api import create_app
from petals_chain.orchestrator.generation import Generation, GenerationMixin
from petals_chain.orchestrator.sampling import SamplingParams, StopMatcher, TokenChoice

KEY = "hunt-secret-0123456789"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def run_with_api(model_path, fn, **cfg_kwargs):
    async def main():
        orch = Orchestrator(OrchestratorConfig(model=str(model_path), max_length=64, port=0, **cfg_kwargs))
        orch.load_model()
        await orch.start()
        try:
            app = create_app(orch)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orch") as c:
                return await fn(orch, app, c)
        finally:
            await orch.stop()

    return asyncio.run(main())


def test_hostile_bodies_are_400s_naming_what_is_wrong(model_path):
    """Each of these was a 500 (a lone surrogate reached the tokenizer: TypeError; a 5000-digit logit_bias key
    reached int(): ValueError), silently accepted (a negative stop token id) or named a parameter "1" (bad JSON)."""
    async def fn(orch, app, c):
        m = orch.model_id.encode()
        raw = {
            "prompt": b'{"model": "%s", "prompt": "\\ud800abc", "max_tokens": 2}' % m,
            "prompt.list": b'{"model": "%s", "prompt": ["ok", "\\udc00"], "max_tokens": 2}' % m,
            "messages.0.content": b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud83d"}]}' % m,
        }
        raw["temperature"] = b'{"model": "%s", "prompt": "x", "temperature": NaN}' % m
        raw["deadline_ms"] = b'{"model": "%s", "prompt": "x", "deadline_ms": Infinity}' % m
        out = {}
        for what, body in raw.items():
            path = "/v1/chat/completions" if what.startswith("messages") else "/v1/completions"
            out[what] = await c.post(path, content=body, headers={"content-type": "application/json"})
        base = {"model": orch.model_id, "prompt": "x", "max_tokens": 2}
        out["logit_bias"] = await c.post("/v1/completions", json={**base, "logit_bias": {"9" * 5000: 1}})
        out["stop_token_ids"] = await c.post("/v1/completions", json={**base, "stop_token_ids": [5, -1]})
        out["json"] = await c.post("/v1/completions", content=b'{"model": 1,,}',
                                   headers={"content-type": "application/json"})
        out["form"] = await c.post("/v1/completions", content=b'{"model": "m", "prompt": "x"}',
                                   headers={"content-type": "application/x-www-form-urlencoded"})  # curl -d
        s = (await c.post("/api/v1/sessions", json={})).json()["session_id"]
        out["session"] = await c.post(f"/api/v1/sessions/{s}/generate", content=b'{"prompt": "\\ud800"}',
                                      headers={"content-type": "application/json"})
        return out

    out = run_with_api(model_path, fn)
    for what, r in out.items():
        assert r.status_code == 400, (what, r.status_code, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", what
    for what in ("prompt", "messages.0.content", "session"):
        err = out[what].json()["error"]
        assert err["param"] == ("prompt" if what == "session" else what) and "surrogate" in err["message"], err
    assert out["prompt.list"].json()["error"]["param"] == "prompt"
    for what in ("temperature", "deadline_ms"):
        err = out[what].json()["error"]
        assert err["param"] == what and "finite" in err["message"], err
    assert out["logit_bias"].json()["error"]["param"] == "logit_bias"
    assert out["stop_token_ids"].json()["error"]["param"] == "stop_token_ids.1"
    for what in ("json", "form"):
        err = out[what].json()["error"]
        assert err["param"] is None and err["code"] == "invalid_json" and "JSON" in err["message"], err
    assert "at character 12" in out["json"].json()["error"]["message"]


def test_an_implicit_output_limit_holds_only_what_the_context_leaves(model_path, tmp_path):
    """A chat request without max_tokens may generate what the context leaves (max_length 64 here), not
    --max-tokens-limit (4096): a key with 400 tokens per minute was refused every such request ("may use 4104
    tokens"), and a session turn was held to its session's max_length likewise."""
    keys = tmp_path / "keys"
    keys.write_text(f"k {KEY} tokens_per_minute=400\n")
    held = []

    async def fn(orch, app, c):
        async def fake_generate_n(prompt_ids, params, explicit=True, emits=None, **kw):
            held.append((len(prompt_ids), app.state.limits.reserved.get("k")))
            return [Generation(token_ids=[7], text="x", finish_reason="length", prompt_tokens=len(prompt_ids),
                               wait_s=0.0, service_s=0.0, chain=[], failovers=0) for _ in params]

        orch.generate_n = fake_generate_n
        h = {"Authorization": f"Bearer {KEY}"}
        chat = await c.post("/v1/chat/completions", headers=h,
                            json={"model": orch.model_id, "messages": [{"role": "user", "content": "hi"}], "n": 2})
        reserved_after = app.state.limits.reserved.get("k", 0)
        sid = (await c.post("/api/v1/sessions", headers=h, json={"max_length": 20})).json()["session_id"]
        turn_reserved = []

        async def fake_session_generate(s, target, params, **kw):
            turn_reserved.append((len(target), app.state.limits.reserved.get("k")))
            return Generation(token_ids=[7], text="x", finish_reason="length", prompt_tokens=len(target),
                              wait_s=0.0, service_s=0.0, chain=[], failovers=0)

        orch.session_generate = fake_session_generate
        turn = await c.post(f"/api/v1/sessions/{sid}/generate", headers=h,
                            json={"messages": [{"role": "user", "content": "hi"}]})
        return chat, reserved_after, turn, turn_reserved

    chat, reserved_after, turn, turn_reserved = run_with_api(model_path, fn, api_keys=str(keys))
    assert chat.status_code == 200, chat.text
    (prompt, reserved), = held
    assert reserved == prompt + 2 * (64 - prompt)  # the prompt, and each of the 2 choices up to the context's end
    assert reserved_after == 0  # given back when the request ended
    assert turn.status_code == 200, turn.text
    (target, reserved), = turn_reserved
    assert reserved == 20  # the turn's new tokens (all of them: the session was empty) and the rest of its 20


class _Bytes:
    """A byte-level stand-in tokenizer: each id is a piece of bytes (as byte-level BPE merges them)."""

    pieces = {0: b"Q", 1: b": \xe2", 2: b"\x80\x9c", 3: b"x"}

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", "replace")


def test_a_stop_string_completed_before_a_held_incomplete_character_still_stops():
    """Token 1 ends the stop string ": " and starts a 3-byte character: the matcher waits for the character to
    complete, and when the generation ended there (max_tokens, an EOS) the final flush returned "Q: \\ufffd",
    the stop string in the text."""
    m = StopMatcher(_Bytes(), [": "])
    streamed = m.feed(0) + m.feed(1) + m.flush()
    assert m.stopped and m.text == streamed == "Q"
    m = StopMatcher(_Bytes(), [": "])
    streamed = m.feed(0) + m.feed(1) + m.feed(2) + m.flush()  # the character completed: found on feed as before
    assert m.stopped and m.text == streamed == "Q"


def test_the_decode_loop_reports_stop_for_a_stop_string_found_at_the_end():
    """The generation's finish_reason is "stop" (not "length") when the flush found the stop string, and a
    stream's last emit carries no part of it."""
    script = iter([0, 1])

    class Batcher:
        async def sample(self, hidden, seq):
            return TokenChoice(next(script)), None

    async def feed(*args, **kwargs):
        return None

    orch = SimpleNamespace(tokenizer=_Bytes(), _eos=set(), cfg=SimpleNamespace(speculative="none", speculative_k=0),
                           batcher=Batcher(), stats=SimpleNamespace(relay_steps=0))
    holder = SimpleNamespace(max_length=64, charge_output=lambda: None, feed=feed, steps=0)
    emitted = []

    async def emit(text, choices):
        emitted.append(text)

    params = SamplingParams(max_tokens=2, temperature=0.0, stop=[": "])
    tokens, text, finish, _ = asyncio.run(GenerationMixin._decode_loop(orch, holder, [3], None, params, emit))
    assert (tokens, text, finish) == ([0, 1], "Q", "stop")
    assert "".join(emitted) == "Q"


def test_a_lone_surrogate_in_a_chat_sessions_new_message_is_named_by_its_own_index(model_path):
    """After a turn, the session's earlier messages came first in the list checked: the request's messages[0] was
    reported as messages.2.content (review)."""
    async def fn(orch, app, c):
        s = (await c.post("/api/v1/sessions", json={})).json()["session_id"]
        sess = orch.get_session(s)
        sess.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]  # one turn
        sess.history = orch.encode_chat(sess.messages)
        body = b'{"messages": [{"role": "user", "content": "ok \\ud800"}]}'
        r = await c.post(f"/api/v1/sessions/{s}/generate", content=body, headers={"content-type": "application/json"})
        return r.status_code, r.json()["error"]

    status, err = run_with_api(model_path, fn)
    assert status == 400 and err["param"] == "messages.0.content", err
