"""Review of 6c5e9a4 (structured outputs, the compiler): an unsatisfiable schema (a ``$ref`` cycle) is a 400 found by
probing the compiled grammar's first mask; that probe went through the sequence path that logs a resource limit hit
mid-output, so every such request also wrote a WARNING "a structured output stopped early" to the orchestrator's log
(a client could fill the log with requests that are only 400s, and an operator read a generation problem)."""

from __future__ import annotations

import logging

import pytest

from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.structured import StructuredSpec, compile_spec

CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}


def test_an_unsatisfiable_schema_is_a_400_without_a_warning_in_the_log(caplog):
    from petals_chain.swarm.tiny_model import build_tokenizer

    tok = build_tokenizer()
    spec = StructuredSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": CYCLE}})
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.structured"):
        with pytest.raises(RequestError) as e:
            compile_spec(spec, tok, len(tok), [tok.eos_token_id])
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema", e.value
    assert "no output can match it" in str(e.value)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
