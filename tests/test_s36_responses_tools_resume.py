"""A streamed Responses API reply with function calls cut off and finished by a rerun (resume.py's
``ResponsesRecord``), as chat's tool-call streams are: the rerun's calls have ids of their own (``fc_``, ``call_``)
and come as ``response.function_call_arguments.delta`` events; the client must get each call once, under the ids it
was first given, its arguments whole. Events by responses.py's ToolStream (two runs, two sets of ids), reruns by
test_s35_review_responses_resume's mock transport: no process."""

from __future__ import annotations

import json

import pydantic
import pytest
from test_s35_review_responses_resume import _finish, _parsed, _record

from petals_chain.orchestrator.responses import ResponseBuilder, ToolStream, usage

openai = pytest.importorskip("openai")
from openai.types.responses import ResponseStreamEvent  # noqa: E402

ECHO = {"instructions": None, "metadata": {}, "temperature": 0.0, "top_p": 1.0, "parallel_tool_calls": True,
        "tool_choice": "auto", "tools": []}
PIECES = ['<tool_call>\n{"name":"get_weather","arguments":{"ci', 'ty":"Rome",', '"days":2}}\n</tool_call>',
          '\n<tool_call>\n{"name":"now","arguments":', '{}}\n</tool_call>']
_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _run(pieces=PIECES) -> list[bytes]:
    """One run's events, as the API streams them (each event alone)."""
    stream = ToolStream(ResponseBuilder("m", ECHO), "tagged")
    text = stream.opening() + "".join(stream.feed(p) for p in pieces) + stream.closing("stop", usage(3, 9))
    return [e.encode() + b"\n\n" for e in text.split("\n\n") if e]


def _calls(events: list[dict]) -> dict:
    """What a client accumulates: each output index's (item id, call_id, name, arguments)."""
    out: dict = {}
    for e in events:
        _EVENTS.validate_python(e)  # each event as the openai package types it
        if e["type"] == "response.output_item.added":
            item = e["item"]
            assert e["output_index"] not in out, "an item added twice"
            out[e["output_index"]] = [item["id"], item["call_id"], item["name"], ""]
        elif e["type"] == "response.function_call_arguments.delta":
            assert out[e["output_index"]][0] == e["item_id"]
            out[e["output_index"]][3] += e["delta"]
    return out


@pytest.mark.parametrize("delivered", [3, 4, 5, 7, 8, 10, 12])
def test_a_cut_function_call_stream_is_finished_under_its_first_ids(monkeypatch, delivered):
    """Cut after ``delivered`` events (inside the first call's arguments, after its done, inside the second), the
    rerun's events: the client's stream is the first run's event kinds numbered 0.. without a gap, each call's
    arguments once, every event under the first run's ids, and the completed response's output the calls the client
    accumulated. Before, the rerun's argument deltas and second item were passed on unchanged (another fc_ id and
    call_id, the arguments again from their start) or dropped as an item already added."""
    first, rerun = _run(), _run()
    rec = _record()
    got = [out for e in first[:delivered] if (out := rec.take(e)) is not None]
    got += _finish(rec, monkeypatch, rerun)
    events, want = _parsed(got), _calls(_parsed(first))
    assert [e["type"] for e in events] == [e["type"] for e in _parsed(first)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    if delivered <= 8:  # the second call's opening came from the rerun only: its ids are the rerun's
        want[1][:2] = _calls(_parsed(rerun))[1][:2]
    calls = _calls(events)
    assert calls == want, calls
    assert [json.loads(c[3]) for c in calls.values()] == [{"city": "Rome", "days": 2}, {}]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["id"] == _parsed(first)[-1]["response"]["id"]
    assert [[o["id"], o["call_id"], o["name"], o["arguments"]] for o in final["output"]] == list(calls.values())
    assert rec.finished_by


def test_a_rerun_that_calls_another_function_or_answers_in_text_is_a_mismatch(monkeypatch):
    """The client has the first call's opening: a rerun calling another function there, or answering in text
    (``auto``'s other branch), ends the stream with ``resume_mismatch`` and the call as far as it went, never a call
    spliced from two replies or text under a call's id."""
    other = [PIECES[0].replace("get_weather", "set_weather"), *PIECES[1:]]
    for rerun in (_run(other), _run(["It is sunny."])):
        rec = _record()
        got = [out for e in _run()[:4] if (out := rec.take(e)) is not None]
        got += _finish(rec, monkeypatch, rerun)
        events = _parsed(got)
        assert [e["type"] for e in events][-2:] == ["response.failed", "error"], events
        assert events[-1]["code"] == "resume_mismatch"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        (item,) = events[-2]["response"]["output"]
        assert (item["type"], item["name"], item["status"]) == ("function_call", "get_weather", "incomplete")
        assert item["arguments"] == '{"ci' and item["id"] == events[2]["item"]["id"]
        assert not any(e["type"] == "response.output_text.delta" for e in events)


def test_a_function_call_stream_cut_by_the_shutdown_fails_with_the_calls_as_sent():
    """The shutdown cuts a stream generated here inside its first call (api.py's ResponsesTail follows the bytes
    sent): ``response.failed`` carries that call (its ids, its arguments as far as they went out, incomplete),
    numbered on, not the arguments the builder had made but not sent."""
    from petals_chain.orchestrator.api import ResponsesTail

    shape = ResponseBuilder("m", ECHO)
    stream = ToolStream(shape, "tagged")
    sent = stream.opening() + stream.feed(PIECES[0])
    stream.feed(PIECES[1])  # made, never written
    tail = ResponsesTail({"model": "m", "stream": True, "tools": []}, shape)
    tail.delivered(sent.encode())
    events = _parsed([tail.ending(503, "shutting down", "shutting_down").encode()])
    assert [e["type"] for e in events] == ["response.failed", "error"]
    assert [e["sequence_number"] for e in events] == [4, 5]
    (item,) = events[0]["response"]["output"]
    assert (item["id"], item["call_id"], item["name"], item["arguments"], item["status"]) == (
        shape.call_ids[0], stream.scanner.calls[0].id, "get_weather", '{"ci', "incomplete")
