"""The Python client's streams: a stream resumed on another orchestrator after a cut."""

from __future__ import annotations

import httpx
import pytest
from test_client_failover import _client as _mock_client
from test_client_failover import _sse, _Stream

from petals_chain.client import Client, ClientError


def _client(first: list[str], rerun: list[str]) -> Client:
    return _mock_client([lambda req, pieces=pieces, cut=cut: httpx.Response(200, stream=_Stream(_sse(pieces, cut)))
                         for pieces, cut in ((first, True), (rerun, False))])


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
