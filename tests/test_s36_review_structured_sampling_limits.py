"""Review of 6c5e9a4 (structured outputs), the sampler's side: a grammar that hits llguidance's per-token limits
mid-output fails its row with a 400 naming the field (it ended "stop" with truncated output, or was a 500
``internal_error`` ValueError), the batch's other rows untouched; the reference sampler (``PerRequestSampler``)
honours ``params.structured`` as the batched path does; a row with no allowed token says so."""

from __future__ import annotations

import json

import pytest
import torch

from petals_chain.orchestrator import structured
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.sampling import (PerRequestSampler, SamplingParams, SequenceSampler, _filtered_probs,
                                                sample_batch, sample_rows)
from petals_chain.orchestrator.structured import StructuredSpec, compile_spec

# Ambiguous: every "x" adds Earley items, so the parse outgrows any per-token limit (with llguidance's default
# limits, 1,000 tokens of it cost minutes of CPU)
AMBIGUOUS = 'start: a\na: a a | "x"'
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from petals_chain.swarm.tiny_model import build_tokenizer

    return build_tokenizer()


def _compile(tok, value: dict, monkeypatch=None, **limits):
    if limits:
        monkeypatch.setattr(structured, "LIMITS", dict(structured.LIMITS, **limits))
    spec = (StructuredSpec.from_structured_outputs(value) if "json_schema" not in value
            else StructuredSpec.from_response_format(value))
    return compile_spec(spec, tok, len(tok), [tok.eos_token_id])


def _favouring(vocab: int, row_token: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen)
    logits[0, row_token] += 20.0  # the grammar row's model wants more "x"
    return logits


def test_a_mask_limit_hit_mid_output_fails_its_row_with_a_400_not_a_truncated_stop(tok, monkeypatch):
    """Before: the mask past the limit allowed only EOS, so the row sampled it and the request ended "stop" with a
    truncated output (a warning in the log); now that row gets a 400 ``invalid_structured_output`` naming the field,
    and the row beside it samples exactly what it samples alone."""
    grammar = _compile(tok, {"grammar": AMBIGUOUS}, monkeypatch, step_max_items=60)
    x = tok("x", add_special_tokens=False)["input_ids"][0]
    seq = SequenceSampler(SamplingParams(max_tokens=200, temperature=0.0, structured=grammar))
    other = SequenceSampler(SamplingParams(max_tokens=200, temperature=0.9, seed=3))
    alone = SequenceSampler(SamplingParams(max_tokens=200, temperature=0.9, seed=3))
    gen = torch.Generator().manual_seed(0)
    failure = None
    for step in range(100):
        logits = _favouring(len(tok), x, 2, gen)
        got = sample_rows(logits, [seq, other])
        assert got[1] == sample_batch(logits[1:], [alone])[0]
        other.append(got[1].token)
        alone.append(got[1].token)
        if isinstance(got[0], BaseException):
            failure = got[0]
            break
        assert got[0].token == x, f"step {step}: the row ended with {got[0].token} instead of failing"
        seq.append(got[0].token)
    assert isinstance(failure, RequestError), "the limit was never hit"
    assert (failure.status, failure.code, failure.param) == (400, "invalid_structured_output",
                                                             "structured_outputs.grammar")
    assert "cannot go on after" in str(failure) and "Too many items" in str(failure)
    with pytest.raises(RequestError, match="cannot go on") as e:  # sample_batch: raised, nothing drawn
        sample_batch(_favouring(len(tok), x, 1, gen), [seq])
    assert e.value.status == 400


def test_a_limit_hit_taking_a_token_is_the_same_400(tok, monkeypatch):
    """Before: the token the mask allowed was refused by the parser's row limit and ``append`` raised a bare
    ValueError (the API's 500 ``internal_error``); now the same 400 naming the field."""
    grammar = _compile(tok, {"grammar": AMBIGUOUS}, monkeypatch, max_items_in_row=30)
    x = tok("x", add_special_tokens=False)["input_ids"][0]
    seq = SequenceSampler(SamplingParams(max_tokens=200, temperature=0.0, structured=grammar))
    with pytest.raises(RequestError) as e:
        for _ in range(100):
            seq.append(sample_batch(_favouring(len(tok), x, 1, torch.Generator().manual_seed(1)), [seq])[0].token)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_structured_output",
                                                             "structured_outputs.grammar")
    assert "Current row has" in str(e.value)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.0, logit_bias={40: 30.0})])
def test_the_reference_sampler_honours_a_grammar_greedy(tok, kw):
    """Before: ``PerRequestSampler`` ignored ``params.structured`` (random logits gave text that is no JSON); now
    it takes the same greedy tokens as the batched path, a valid object ending with EOS."""
    grammar = _compile(tok, {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    params = SamplingParams(max_tokens=64, structured=grammar, **kw)
    ref, batched = PerRequestSampler(params), SequenceSampler(params)
    prompt = [5, 6, 7]
    gen = torch.Generator().manual_seed(2)
    out: list[int] = []
    for _ in range(64):
        logits = torch.randn(len(tok), generator=gen) * 3
        t = ref.next_token(logits, prompt + out)
        assert t == sample_batch(logits.unsqueeze(0), [batched])[0].token
        batched.append(t)
        out.append(t)
        if t == tok.eos_token_id:
            break
    assert out[-1] == tok.eos_token_id
    assert set(json.loads(tok.decode(out[:-1]))) == {"ok", "n"}


def test_the_reference_sampler_draws_from_the_masked_distribution(tok):
    """Seeded, filtered and penalized: the reference's processed distribution is the batched path's (mask first,
    then bias, penalties, temperature, top-k/top-p), step after step; a stop token id is allowed where EOS is."""
    grammar = _compile(tok, {"choice": ["yes", "no", "maybe"]})
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=4, top_p=0.9, top_k=50, repetition_penalty=1.2,
                            presence_penalty=0.5, logit_bias={tok("no", add_special_tokens=False)["input_ids"][0]:
                                                              -5.0}, stop_token_ids=[9], structured=grammar)
    ref, batched = PerRequestSampler(params), SequenceSampler(params, [5, 6])
    gen = torch.Generator().manual_seed(5)
    out: list[int] = []
    for _ in range(8):
        logits = torch.randn(len(tok), generator=gen) * 2
        want = _filtered_probs(logits.unsqueeze(0), [batched])[0]
        got = torch.softmax(ref.processed_scores(logits, [5, 6] + out), dim=-1)[0]
        assert torch.allclose(got, want, atol=1e-6)
        assert int((want > 0).sum()) < len(tok)  # masked
        t = ref.next_token(logits, [5, 6] + out)
        if t in (9, tok.eos_token_id):
            break
        batched.append(t)
        out.append(t)
    assert tok.decode(out) in ("yes", "no", "maybe")


def test_the_reference_sampler_refuses_ignore_eos_with_a_grammar(tok):
    grammar = _compile(tok, {"choice": ["yes"]})
    with pytest.raises(ValueError, match="ignore_eos cannot be used with a structured output"):
        PerRequestSampler(SamplingParams(ignore_eos=True, structured=grammar))


def test_a_row_with_no_allowed_finite_token_says_the_structured_output(tok):
    """The model rules out (-inf) every token the grammar allows: the 500 ``invalid_logits`` says so, not "every
    token's logit is -inf (the model's logits)", which its logits were not."""
    grammar = _compile(tok, {"choice": ["yes"]})
    allowed = grammar.state().allowed()[:len(tok)]
    logits = torch.randn(1, len(tok))
    logits[0, torch.from_numpy(allowed.copy())] = float("-inf")
    with pytest.raises(RequestError, match="the structured output allows") as e:
        sample_batch(logits, [SequenceSampler(SamplingParams(temperature=0.0, structured=grammar))])
    assert (e.value.status, e.value.code) == (500, "invalid_logits")
