"""A streamed Responses API reply with function calls that fails after its first call was done: ``response.failed``
must carry that call as ``completed`` (what its ``response.output_item.done`` told the client), the call it was cut
inside as ``incomplete``. Before, every call in it was ``incomplete``: the openai package's final snapshot (taken
from ``response.failed``) contradicted the item's done event. Unit level: responses.py's builder, api.py's
ResponsesTail over resume.py's record; no process, no model."""

from __future__ import annotations

import json

from petals_chain.orchestrator.responses import ResponseBuilder, ToolStream

ECHO = {"instructions": None, "metadata": {}, "tools": []}
SENT = '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>\n<tool_call>\n{"name":"get_weather","arguments":{"ci'


def _events(text: str) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if "data: " in e]


def _check(events: list[dict]) -> None:
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["name"], i["status"]) for i in done] == [("now", "completed")], done
    failed = next(e for e in events if e["type"] == "response.failed")["response"]
    got = [(o["id"], o["name"], o["arguments"], o["status"]) for o in failed["output"]]
    assert got[0] == (done[0]["id"], "now", "{}", "completed"), got
    assert got[1][1:] == ("get_weather", '{"ci', "incomplete") and len(got) == 2, got


def test_a_stream_failed_after_a_whole_call_keeps_it_completed():
    """The generation fails inside the second call (builder's failed): the first call completed, the second not."""
    shape = ResponseBuilder("m", ECHO)
    stream = ToolStream(shape, "tagged")
    text = stream.opening() + stream.feed(SENT) + shape.failed(502, "the chain broke")
    _check(_events(text))


def test_a_stream_cut_by_the_shutdown_after_a_whole_call_keeps_it_completed():
    """The shutdown cuts it there (ResponsesTail, from the events that went out): the same."""
    from petals_chain.orchestrator.api import ResponsesTail

    shape = ResponseBuilder("m", ECHO)
    stream = ToolStream(shape, "tagged")
    sent = stream.opening() + stream.feed(SENT)
    tail = ResponsesTail({"model": "m", "stream": True, "tools": []}, shape)
    tail.delivered(sent.encode())
    _check(_events(sent + tail.ending(503, "shutting down", "shutting_down")))
