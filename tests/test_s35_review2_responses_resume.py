"""Review of dd3bec5's Responses stream resume (resume.py ``ResponsesRecord``): a stream cut after
``response.output_text.done`` was finished by a rerun that sent the client ``output_text.done``,
``content_part.done`` and ``output_item.done`` a second time. Events by responses.py's builder, reruns by a mock
transport (test_s35_review_responses_resume): no process."""

from __future__ import annotations

import pytest
from test_s35_review_responses_resume import _finish, _parsed, _record, _run


def _kinds(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


@pytest.mark.parametrize("delivered", [9, 10, 11])  # cut after output_text.done, content_part.done, item done
def test_a_rerun_sends_no_closing_event_the_client_has(monkeypatch, delivered):
    """Each event kind of a response comes once: the client's stream is the first run's event kinds, numbered
    0.. without a gap, the text once, ``response.incomplete`` last with the whole text."""
    first = _run()
    rec = _record()
    got = [out for e in first[:delivered] if (out := rec.take(e)) is not None]
    got += _finish(rec, monkeypatch, _run())
    events = _parsed(got)
    assert _kinds(events) == _kinds(_parsed(first))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello world"
    assert rec.finished_by


def test_a_rerun_with_more_text_than_the_client_had_at_its_end_is_a_mismatch(monkeypatch):
    """The client had ``output_text.done`` ("Hello world"): a rerun going on past it ("Hello worlds") would put text
    after the text's end; it ends as a rerun giving another text does (``resume_mismatch``)."""
    rec = _record()
    got = [out for e in _run()[:9] if (out := rec.take(e)) is not None]
    got += _finish(rec, monkeypatch, _run(["Hel", "lo", " wor", "lds"]))
    events = _parsed(got)
    assert _kinds(events)[-2:] == ["response.failed", "error"] and events[-1]["code"] == "resume_mismatch"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world"
