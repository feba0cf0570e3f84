"""Review of fce63fc (tool calling): a streamed tool call cut off and finished by a rerun (resume.py). The rerun
makes its calls with new ids and sends them as OpenAI's tool-call deltas (no ``content``): the client must get the
rest of the arguments once, under the id it already has, as the openai package accumulates them."""

from __future__ import annotations

import json
import time

import pytest
from openai.lib.streaming._deltas import accumulate_delta

import petals_chain.orchestrator.resume as rs

ARGS = ['{"city":', '"Rome",', '"days":2}']


def ev(delta: dict, finish=None, cid="chatcmpl-run") -> bytes:
    obj = {"id": cid, "object": "chat.completion.chunk", "created": 1,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    return f"data: {json.dumps(obj)}\n\n".encode()


def run_events(call_id: str, cid: str, second: str = "now") -> list[bytes]:
    """A streamed reply of two calls, as api.py's tool_chunk sends it."""
    out = [ev({"role": "assistant", "content": None}, cid=cid),
           ev({"tool_calls": [{"index": 0, "id": f"{call_id}0", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}, cid=cid)]
    out += [ev({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}, cid=cid) for a in ARGS]
    out += [ev({"tool_calls": [{"index": 1, "id": f"{call_id}1", "type": "function",
                                "function": {"name": second, "arguments": ""}}]}, cid=cid),
            ev({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}, cid=cid),
            ev({}, "tool_calls", cid=cid)]
    return out


def accumulated(events: list[bytes]) -> dict:
    """What the openai package makes of the events: the choice's delta accumulated (its stream helper's way)."""
    acc: dict = {}
    for e in events:
        obj = json.loads(e[len(b"data: "):])
        for c in obj["choices"]:
            acc = accumulate_delta(acc, c["delta"])
    return acc


def record() -> rs.StreamRecord:
    return rs.StreamRecord({"model": "m", "messages": [], "stream": True, "temperature": 0, "tools": []},
                           time.monotonic())


@pytest.mark.parametrize("cut", [2, 3, 5, 6, 7])
def test_a_resumed_tool_call_keeps_its_id_and_gets_the_rest_of_its_arguments_once(cut):
    """Cut after ``cut`` events (inside the first call's arguments, between calls, inside the second), the rerun's
    events: the client's accumulation is the whole reply, each call under the one id it was first given. Before, the
    rerun's tool-call deltas (no text) were all dropped: the arguments stopped where the cut was."""
    rec = record()
    first = run_events("call_first", "chatcmpl-a")
    sent = [out for e in first[:cut] if (out := rec.take(e)) is not None]
    rec.restart()
    sent += [out for e in run_events("call_rerun", "chatcmpl-b") if (out := rec.take(e)) is not None]
    want = accumulated(first)
    if cut <= 5:  # the second call's opening came from the rerun only: its id is the rerun's
        want["tool_calls"][1]["id"] = "call_rerun1"
    assert accumulated(sent) == want, [s.decode() for s in sent]
    assert all(json.loads(s[6:])["id"] == "chatcmpl-a" for s in sent)
    assert rec.complete


def test_a_rerun_that_calls_another_function_is_a_mismatch():
    """A rerun whose call differs from the one the client has (another function, other arguments, fewer calls)
    ends the stream with resume_mismatch, never a call spliced from two replies."""
    for cut, rerun in ((2, run_events("x", "b", second="now")), (7, run_events("x", "b", second="other"))):
        rec = record()
        for e in run_events("call_first", "a")[:cut]:
            rec.take(e)
        rec.restart()
        changed = [e.replace(b'"Rome"', b'"Oslo"') for e in rerun] if cut == 2 else rerun
        if cut == 2:
            changed[1] = changed[1].replace(b"get_weather", b"set_weather")
        with pytest.raises(rs._Mismatch):
            for e in changed:
                rec.take(e)
    rec = record()  # the rerun ends with fewer arguments than the client has
    for e in run_events("c", "a")[:5]:
        rec.take(e)
    rec.restart()
    short = run_events("x", "b")
    with pytest.raises(rs._Mismatch):
        for e in short[:3] + short[-1:]:
            rec.take(e)
