"""The Python client's streams: a stream resumed on another orchestrator after a cut."""

from __future__ import annotations

import json

import httpx
import pytest

from petals_chain.client import Client, ClientError


def _events(pieces: list[str], cut: bool = False):
    for p in pieces:
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': p, 'finish_reason': None}]})}\n\n".encode()
    if cut:
        raise httpx.ReadError("connection lost")
    yield b"data: [DONE]\n\n"


class _Stream(httpx.SyncByteStream):
    def __init__(self, gen):
        self.gen = gen

    def __iter__(self):
        yield from self.gen


def _client(first: list[str], rerun: list[str]) -> Client:
    c = Client(["http://orch0", "http://orch1"], model="m", retry_s=0)
    for i, (pieces, cut) in enumerate(((first, True), (rerun, False))):
        c._https[i] = httpx.Client(base_url=f"http://orch{i}", transport=httpx.MockTransport(
            lambda req, pieces=pieces, cut=cut: httpx.Response(200, stream=_Stream(_events(pieces, cut)))))
    return c


@pytest.mark.parametrize("rerun, what", [(["Goodbye", " cruel", " world"], "'Goodbye' where the stream had 'Hello w'"),
                                         (["Hel"], "6 characters short")], ids=["other_text", "shorter"])
def test_a_rerun_that_does_not_repeat_the_text_already_yielded_is_an_error(rerun, what):
    """A greedy stream cut after "Hello wor" and rerun elsewhere as "Goodbye cruel world" (another chain's numerics)
    gave the caller "Hello worruel world": the rerun's first 9 characters were dropped unread. A rerun shorter than
    what was yielded ended the stream as if complete. Both are now a 502 ``resume_mismatch`` after what was yielded."""
    got = []
    with pytest.raises(ClientError) as e:
        for piece in _client(["Hello", " wor"], rerun).stream("x", max_tokens=8):
            got.append(piece)
    assert got == ["Hello", " wor"]
    assert (e.value.status, e.value.code) == (502, "resume_mismatch") and what in e.value.message, e.value.message


def test_a_rerun_that_repeats_the_text_goes_on_after_it():
    assert "".join(_client(["Hello", " wor"], ["Hel", "lo w", "orld!"]).stream("x")) == "Hello world!"
