"""A structured output's grammar CPU budget (structured.py): an ambiguous grammar whose every token costs more (it
stalled the head's thread, shared by every generation, for minutes) ends with a 400 once its sequence has spent
its budget, the batch's other rows untouched; a large realistic schema stays far inside it. Also: a schema's own
``x-guidance`` compile options are dropped, and compiles run in their own bounded pool."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from petals_chain.orchestrator import structured
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.sampling import SamplingParams, SequenceSampler, sample_batch, sample_rows
from petals_chain.orchestrator.structured import StructuredSpec, compile_spec

AMBIGUOUS = 'start: a\na: a a | "x"'  # every "x" adds Earley items: each token costs more than the one before
PROPS = {f"field_{i}": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]} for i in range(50)}
BIG_SCHEMA = {"type": "object", "properties": PROPS, "required": list(PROPS), "additionalProperties": False}
BIG_VALUE = {f"field_{i}": (i if i % 3 == 0 else (f"v{i}" if i % 3 == 1 else None)) for i in range(50)}


@pytest.fixture(scope="module")
def tok():
    from petals_chain.swarm.tiny_model import build_tokenizer

    return build_tokenizer()


def _compile(tok, value: dict):
    return compile_spec(StructuredSpec.from_structured_outputs(value), tok, len(tok), [tok.eos_token_id])


class _FakeClock:
    """Each reading is ``tick`` seconds after the previous one: every charged grammar call costs exactly ``tick``."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _force(tok, seq: SequenceSampler, ids: list[int], gen: torch.Generator) -> None:
    """Generate ``ids`` through the batched sampler (each favoured by its logits), then the end token."""
    for t in ids + [tok.eos_token_id]:
        logits = torch.randn(1, len(tok), generator=gen)
        logits[0, t] += 50.0
        got = sample_rows(logits, [seq])[0]
        assert not isinstance(got, BaseException), got
        assert got.token == t
        seq.append(got.token)


def test_the_budget_follows_the_clock_and_grows_with_the_tokens(tok, monkeypatch):
    """With a fake clock: a grammar costing less than the allowance a token never fails (1,000 tokens); one costing
    more fails its row with a 400 as soon as its CPU passes 0.5 s + 2 ms a token, and costs nothing after."""
    grammar = _compile(tok, {"regex": "x{1,5000}"})
    x = tok("x", add_special_tokens=False)["input_ids"][0]
    per_token = structured.GRAMMAR_CPU_PER_TOKEN_S
    monkeypatch.setattr(structured, "_cpu_clock", _FakeClock(0.45 * per_token))  # mask + take: 0.9 of the allowance
    cheap = SequenceSampler(SamplingParams(max_tokens=5000, temperature=0.0, structured=grammar))
    gen = torch.Generator().manual_seed(0)
    _force(tok, cheap, [x] * 1000, gen)
    assert cheap.grammar.error is None and cheap.num_generated == 1001 and cheap.grammar.complete

    tick = 5 * per_token  # mask + take: 10 ms a token, 5x the allowance
    monkeypatch.setattr(structured, "_cpu_clock", _FakeClock(tick))
    seq = SequenceSampler(SamplingParams(max_tokens=5000, temperature=0.0, structured=grammar))
    failure = None
    for _ in range(1000):
        logits = torch.randn(1, len(tok), generator=gen)
        logits[0, x] += 50.0
        got = sample_rows(logits, [seq])[0]
        if isinstance(got, BaseException):
            failure = got
            break
        try:
            seq.append(got.token)
        except RequestError as e:
            failure = e
            break
    assert isinstance(failure, RequestError), "the budget never ended the output"
    assert (failure.status, failure.code, failure.param) == (400, "invalid_structured_output",
                                                             "structured_outputs.regex")
    assert "s of CPU" in str(failure)
    state = seq.grammar
    allowance = structured.GRAMMAR_CPU_BASE_S + per_token * (state.consumed + 1)
    assert allowance < state.cpu_s <= allowance + tick  # it stopped at the first charge past the budget
    # ~0.5 s / (10 ms - 2 ms) = 63 tokens, not the 1,000 the cheap one took
    assert state.consumed == pytest.approx(structured.GRAMMAR_CPU_BASE_S / (2 * tick - per_token), abs=2)
    spent = state.cpu_s
    assert not state.allowed().any() and state.valid_prefix([x, x]) == 0  # spent: no more grammar work
    with pytest.raises(RequestError, match="s of CPU"):
        sample_batch(torch.randn(1, len(tok), generator=gen), [seq])
    assert state.cpu_s == spent


def test_an_ambiguous_grammar_ends_with_a_400_and_the_row_beside_it_is_untouched(tok, monkeypatch):
    """Before: nothing but llguidance's row limit (near token 1,000, after minutes of CPU on the head's thread) ended
    it; now its sequence's budget does (here lowered to 0.02 s + 0.2 ms a token: it ends near token 180 here, by
    token ~310 on a machine 10x as fast, instead of 400 tokens of growing cost), and the other row samples exactly
    what it samples alone."""
    monkeypatch.setattr(structured, "GRAMMAR_CPU_BASE_S", 0.02, raising=False)
    monkeypatch.setattr(structured, "GRAMMAR_CPU_PER_TOKEN_S", 0.0002, raising=False)
    grammar = _compile(tok, {"grammar": AMBIGUOUS})
    x = tok("x", add_special_tokens=False)["input_ids"][0]
    seq = SequenceSampler(SamplingParams(max_tokens=1000, temperature=0.0, structured=grammar))
    other = SequenceSampler(SamplingParams(max_tokens=1000, temperature=0.9, seed=3))
    alone = SequenceSampler(SamplingParams(max_tokens=1000, temperature=0.9, seed=3))
    gen = torch.Generator().manual_seed(0)
    failure = None
    for step in range(400):  # the old code's 400 tokens: ~2.5 s of grammar CPU, and no end in sight
        logits = torch.randn(2, len(tok), generator=gen)
        logits[0, x] += 20.0  # the grammar row's model wants more "x"
        got = sample_rows(logits, [seq, other])
        assert got[1] == sample_batch(logits[1:], [alone])[0]
        other.append(got[1].token)
        alone.append(got[1].token)
        if isinstance(got[0], BaseException):
            failure = got[0]
            break
        assert got[0].token == x, f"step {step}: the row ended with {got[0].token} instead of failing"
        try:
            seq.append(got[0].token)
        except RequestError as e:
            failure = e
            break
    assert isinstance(failure, RequestError), "400 tokens of an ambiguous grammar and still no end"
    assert (failure.status, failure.code, failure.param) == (400, "invalid_structured_output",
                                                             "structured_outputs.grammar")
    assert "s of CPU" in str(failure) and "cannot go on after" in str(failure)
    assert seq.grammar.cpu_s < 1.0  # (its budget at token 400: 0.1 s, plus the one step that passed it)


def test_a_large_realistic_schema_completes_within_the_default_budget(tok):
    """A 50-property anyOf object (a few hundred tokens) is generated whole, spending a sliver of its budget."""
    grammar = compile_spec(StructuredSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}), tok, len(tok),
        [tok.eos_token_id])
    ids = tok(json.dumps(BIG_VALUE, separators=(",", ":")), add_special_tokens=False)["input_ids"]
    seq = SequenceSampler(SamplingParams(max_tokens=2000, temperature=0.7, seed=1, structured=grammar))
    start = time.thread_time()
    _force(tok, seq, list(ids), torch.Generator().manual_seed(0))
    assert seq.grammar.complete and seq.grammar.error is None
    assert seq.grammar.cpu_s <= time.thread_time() - start  # charged: the CPU of this thread's grammar calls
    budget = structured.GRAMMAR_CPU_BASE_S + structured.GRAMMAR_CPU_PER_TOKEN_S * len(ids)
    assert seq.grammar.cpu_s < budget / 10, (seq.grammar.cpu_s, budget)


def test_a_schema_cannot_set_its_own_compile_options(tok):
    """Before: a top-level ``x-guidance`` of ``{"whitespace_flexible": true}`` overrode the server's compact JSON
    (whitespace allowed between tokens: a model could pad to max_tokens with newlines); now it is dropped."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "x-guidance": {"whitespace_flexible": True}}
    spec = StructuredSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    state = compile_spec(spec, tok, len(tok), [tok.eos_token_id]).state()
    state.replay(tok('{"a":', add_special_tokens=False)["input_ids"])
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert state.valid_prefix(newline) == 0
    assert state.valid_prefix(tok("1", add_special_tokens=False)["input_ids"]) == 1
    assert spec.text_format()["schema"] == schema  # the echo is the client's schema as sent


def test_compiles_run_at_most_two_at_once_outside_the_default_executor(monkeypatch):
    """Eight clients compiling at once take two threads of their own; a prompt's tokenizing (the default executor)
    runs meanwhile."""
    release, lock = threading.Event(), threading.Lock()
    running, peak = [0], [0]

    def slow_compile(spec, tokenizer, vocab, eos):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            release.wait(30)
            return spec
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(structured, "compile_spec", slow_compile)

    async def main():
        compiles = [asyncio.ensure_future(structured.compile_spec_async(i, None, 0, [0])) for i in range(8)]
        try:
            for _ in range(500):  # (polled: up to 5 s for the pool to start its threads)
                if running[0] >= structured.MAX_CONCURRENT_COMPILES:
                    break
                await asyncio.sleep(0.01)
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "tokenized"), 10) == "tokenized"
            assert running[0] == peak[0] == structured.MAX_CONCURRENT_COMPILES
            assert not any(c.done() for c in compiles)
        finally:
            release.set()
        assert await asyncio.gather(*compiles) == list(range(8))

    asyncio.run(main())
    assert peak[0] == structured.MAX_CONCURRENT_COMPILES == 2
