"""Review of 0497ed7 (context-length errors). A refusal's "N too many" did not count the token a completion needs: a
prompt of 66 tokens at a context of 64 read "2 too many", and the same prompt 2 tokens shorter was refused again ("no
room is left"); only a scored prompt (max_tokens 0) may fill the context. And the orchestrator's own check (what a
session turn and ``generate``/``generate_n`` run again, in-process callers get first) still said the old "the prompt
has 64 tokens, but this model's maximum context length is 64 tokens"."""

from __future__ import annotations

import re

import pytest

from petals_chain.orchestrator.core import Orchestrator, RequestError
from petals_chain.orchestrator.errors import context_length_error

MAX = 64


def _excess(message: str) -> int:
    found = re.search(r"(\d+) too many", message)
    assert found, message
    return int(found.group(1))


@pytest.mark.parametrize("session", [False, True])
@pytest.mark.parametrize("scoring", [False, True])
def test_a_prompt_shortened_by_the_excess_said_fits(session, scoring):
    """Whatever the prompt's length over the context, losing exactly the tokens the error says makes it fit, and
    one fewer does not."""
    max_tokens = 0 if scoring else 16
    for tokens in range(MAX + 1, MAX + 5):
        with pytest.raises(RequestError) as e:
            Orchestrator._max_tokens(max_tokens, tokens, MAX, scoring, session=session)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
        n = _excess(str(e.value))
        assert Orchestrator._max_tokens(max_tokens, tokens - n, MAX, scoring, session=session) == (
            0 if scoring else 1), (tokens, str(e.value))
        with pytest.raises(RequestError):
            Orchestrator._max_tokens(max_tokens, tokens - n + 1, MAX, scoring, session=session)
    if not scoring:
        assert "at most 63 leave room for a completion" in str(e.value), str(e.value)


def test_the_orchestrators_own_check_words_it_as_the_api_does():
    """An in-process ``generate`` (and a session turn's re-check) said "the prompt has 64 tokens, but this model's
    maximum context length is 64 tokens"."""
    with pytest.raises(RequestError) as e:
        Orchestrator._max_tokens(16, MAX, MAX, False)
    assert str(e.value) == str(context_length_error(MAX, MAX))
    assert "no room is left for a completion" in str(e.value) and "the prompt has" not in str(e.value)
    with pytest.raises(RequestError) as e:
        Orchestrator._max_tokens(4, MAX - 3, MAX, True, session=True, field="max_completion_tokens")
    assert e.value.param == "max_completion_tokens" and "this session's max_length is 64 tokens" in str(e.value)
    assert "max_completion_tokens is 4: at most 3 fit" in str(e.value), str(e.value)


def test_a_session_is_full_only_when_no_turn_could_fit():
    """A session holding one token less than its max_length can still take an empty turn and generate one."""
    assert "shorten this turn's input_ids" in str(context_length_error(33, 32, field="input_ids", held=31))
    assert "the session is full" in str(context_length_error(33, 32, field="input_ids", held=32))
    assert "shorten this turn's prompt" in str(context_length_error(33, 32, held=32, scoring=True))
