"""Structured outputs at the sampler (structured.py + sampling.py), on the tiny model's tokenizer and random logits.

A row with a grammar is masked to the tokens the grammar allows, and only that row: the batch's other rows are
sampled bit for bit as without it; drafts verified under a grammar give what plain decoding gives; a state rebuilt by
replaying the tokens sent is the state that sampled them; each choice has its own state; a bad, huge or hostile
schema or grammar is a 400 naming its field, fast. Logprobs of -inf are shown as -9999.0 (they broke the JSON body).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.sampling import (MIN_LOGPROB, SamplingParams, SequenceSampler, prompt_logprobs,
                                                sample_batch, verify_drafts)
from petals_chain.orchestrator.structured import StructuredSpec, compile_spec

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from petals_chain.swarm.tiny_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def grammar(tok):
    spec = StructuredSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    return compile_spec(spec, tok, len(tok), [tok.eos_token_id])


def _params(grammar=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=64, structured=grammar, **kw)


def _generate(tok, seq: SequenceSampler, steps: list[torch.Tensor]) -> list[int]:
    out = []
    for logits in steps:
        c = sample_batch(logits, [seq])[0]
        seq.append(c.token)
        out.append(c.token)
        if c.token == tok.eos_token_id:
            break
    return out


def _steps(vocab: int, n: int = 40, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, vocab, generator=g) * 3 for _ in range(n)]


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.9, seed=7),
                                dict(temperature=1.2, seed=3, top_p=0.8, top_k=40, repetition_penalty=1.3)])
def test_a_grammar_row_yields_valid_json_that_ends_with_stop(tok, grammar, kw):
    """Random logits (a model that knows nothing of JSON): the output still parses and matches the schema, and ends
    with EOS once complete (the only token then allowed)."""
    seq = SequenceSampler(_params(grammar, **kw))
    out = _generate(tok, seq, _steps(len(tok), 60, seed=kw.get("seed", 1)))
    assert out[-1] == tok.eos_token_id and seq.grammar.complete
    value = json.loads(tok.decode(out[:-1]))
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and isinstance(value["n"], int)


def test_the_mask_is_applied_to_its_row_only_and_other_rows_are_bit_identical(tok, grammar):
    """A batch of a grammar row beside greedy, seeded and filtered rows: the other rows' tokens (and raw logprobs)
    are those of the same batch without any grammar, step after step; the caller's logits are not changed."""
    others = [dict(temperature=0.0, logprobs=3), dict(temperature=0.8, seed=11, logprobs=2),
              dict(temperature=1.1, seed=12, top_p=0.7, top_k=50, min_p=0.02, presence_penalty=0.5)]
    with_g = [SequenceSampler(_params(grammar, temperature=0.7, seed=5))] + [SequenceSampler(_params(**o))
                                                                             for o in others]
    without = [SequenceSampler(_params(temperature=0.7, seed=5))] + [SequenceSampler(_params(**o)) for o in others]
    g = torch.Generator().manual_seed(4)
    constrained_differs = False
    for _ in range(12):
        logits = torch.randn(4, len(tok), generator=g) * 3
        before = logits.clone()
        a, b = sample_batch(logits, with_g), sample_batch(logits, without)
        assert torch.equal(logits, before)
        assert a[1:] == b[1:]  # tokens, logprobs and top logprobs, exactly
        constrained_differs |= a[0].token != b[0].token
        for seqs, out in ((with_g, a), (without, b)):
            for s, c in zip(seqs, out):
                if not (s.grammar is not None and s.grammar.complete):
                    s.append(c.token)
    assert constrained_differs  # the grammar row was masked: random logits pick other tokens


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0, seed=21)])
def test_drafts_under_a_grammar_equal_plain_decoding(tok, grammar, kw):
    """``verify_drafts`` with drafts (some of which the grammar forbids) emits what step-by-step sampling emits from
    the same logits, greedy and seeded: a forbidden draft is rejected, and the state consumed exactly the emitted
    tokens (the next mask is the plain run's)."""
    steps = _steps(len(tok), 40, seed=9)
    plain = SequenceSampler(_params(grammar, **kw))
    want = _generate(tok, plain, steps)
    spec_seq = SequenceSampler(_params(grammar, **kw))
    got: list[int] = []
    rng = torch.Generator().manual_seed(1)
    rejected_forbidden = 0
    while len(got) < len(want) and (not got or got[-1] != tok.eos_token_id):
        j = len(got)
        k = min(3, len(want) - j - 1)
        # drafts: the right tokens, or a random (mostly forbidden) one in their place
        draft = [want[j + i] if torch.rand(1, generator=rng) < 0.6 else int(torch.randint(3, len(tok), (1,),
                 generator=rng)) for i in range(k)]
        out = verify_drafts(torch.cat(steps[j:j + k + 1]), spec_seq, draft)
        for i, c in enumerate(out[:-1]):
            assert c.token == draft[i]
        if len(out) <= k and draft[len(out) - 1] != want[j + len(out) - 1]:
            rejected_forbidden += 1
        got += [c.token for c in out]
    assert got == want and rejected_forbidden > 0
    assert spec_seq.grammar.complete and spec_seq.grammar.consumed == plain.grammar.consumed


def test_a_replayed_state_masks_as_the_one_that_sampled(tok, grammar):
    """A grammar state fed the tokens another state sampled masks as that state does, and sampling goes on from there
    (a resumed stream reruns its whole request instead: test_s36_structured_resume.py)."""
    seq = SequenceSampler(_params(grammar, temperature=0.0))
    out = _generate(tok, seq, _steps(len(tok), 5, seed=2))
    replayed = grammar.state()
    replayed.replay(out)
    assert (replayed.allowed() == seq.grammar.allowed()).all()
    fresh = grammar.state()
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        fresh.replay(tok("hello", add_special_tokens=False)["input_ids"])  # not JSON: refused, not followed


def test_each_choice_has_its_own_state(tok, grammar):
    """``n`` > 1: one compiled grammar, one state per choice; each choice's output is valid on its own."""
    params = [_params(grammar, temperature=1.0, seed=s) for s in (1, 2, 3)]
    seqs = [SequenceSampler(p) for p in params]
    assert len({id(s.grammar) for s in seqs}) == 3
    outs = [_generate(tok, s, _steps(len(tok), 60, seed=i)) for i, s in enumerate(seqs)]
    for out in outs:
        json.loads(tok.decode(out[:-1]))
    assert len({tuple(o) for o in outs}) > 1


def test_stop_token_ids_end_where_eos_could(tok):
    """A ``stop_token_ids`` token is allowed wherever the grammar allows its end (it ends the output as EOS does),
    and nowhere else."""
    spec = StructuredSpec.from_structured_outputs({"choice": ["yes", "no"]})
    g = compile_spec(spec, tok, len(tok), [tok.eos_token_id])
    state = g.state([5])
    assert not state.allowed()[5]
    state.replay(tok("yes", add_special_tokens=False)["input_ids"])
    allowed = state.allowed()
    assert allowed[5] and allowed[tok.eos_token_id] and allowed.sum() == 2


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(2000)}}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": "nested"}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "x" * 70_000}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_a_bad_or_hostile_spec_is_a_400_naming_its_field_fast(tok, body, param):
    """Too large (a 2,000-property schema: 120 KB), nested 600 deep, a ``$ref`` to itself, unsatisfiable, an invalid
    regex, an undefined Lark rule, empty choices, two at once, an unknown type: each a 400 (``invalid_request_error``
    through the API) naming the field, within a second of one core, never a hang or a crash."""
    if body.get("structured_outputs", {}).get("json") == "nested":
        nested: dict = {"type": "string"}
        for _ in range(600):
            nested = {"type": "array", "items": nested}
        body = {"structured_outputs": {"json": nested}}
    t0 = time.process_time()
    with pytest.raises(RequestError) as e:
        spec = (StructuredSpec.from_response_format(body["response_format"]) if "response_format" in body
                else StructuredSpec.from_structured_outputs(body["structured_outputs"]))
        compile_spec(spec, tok, len(tok), [tok.eos_token_id])
    assert e.value.status == 400 and e.value.param == param, str(e.value)
    assert time.process_time() - t0 < 2.0


def test_minus_infinity_logprobs_are_shown_as_minus_9999(tok):
    """A token the model rules out (-inf logit), and more top_logprobs than finite tokens: -9999.0, not -inf (which
    JSON cannot carry), in sampling and in prompt scoring."""
    logits = torch.full((1, len(tok)), float("-inf"))
    logits[0, 7], logits[0, 8] = 1.0, 0.5
    c = sample_batch(logits, [SequenceSampler(_params(temperature=0.0, logprobs=4))])[0]
    assert c.token == 7 and [v for _, v in c.top_logprobs][2:] == [MIN_LOGPROB, MIN_LOGPROB]
    scored = prompt_logprobs(logits.repeat(2, 1), [3, 9, 7], 3)
    assert scored[1].logprob == MIN_LOGPROB and scored[1].top_logprobs[2][1] == MIN_LOGPROB
    json.dumps([c.top_logprobs, scored[1].top_logprobs], allow_nan=False)
