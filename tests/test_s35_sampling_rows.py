"""The batched sampler with rows that have no token to sample, and the seeds of a request's choices (session 35).

A row whose logits hold NaN or +inf, or exclude every token (all -inf), crashed the whole batch (a top-p row:
torch.bincount's error) or silently took an arbitrary token (NaN's position, or token 0): now it is a
``SamplingError`` of its own, and the batch's other rows are sampled as if it were not there. Choice i of a request
seeded s was choice 0 of seed s + i (``seed + i``); ``choice_seed`` mixes (seed, index) instead."""

from __future__ import annotations

import pytest
import torch

from petals_chain.orchestrator import sampling as S
from petals_chain.orchestrator.sampling import SamplingParams, SequenceSampler, sample_batch

VOCAB = 1000
KINDS = {"plain": {}, "greedy": {"temperature": 0.0}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 5},
         "min_p": {"min_p": 0.1}, "penalized": {"temperature": 0.7, "repetition_penalty": 1.3, "logit_bias": {3: 5.0}}}
_NAN, _INF = float("nan"), float("inf")


def _bad_row(kind: str) -> torch.Tensor:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5))
    if kind == "nan":
        row[17] = _NAN
    elif kind == "negative nan":  # x86's default NaN (0 * inf): sign bit set
        row[VOCAB - 1] = -_NAN
    elif kind == "+inf":
        row[17] = _INF
    else:
        row[:] = -_INF
    return row


def _batch(bad_kind: str, bad_params: dict) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Five rows, the bad one in the middle, its mates of every kind, seeded."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    logits[2] = _bad_row(bad_kind)
    params = [SamplingParams(seed=10, top_p=0.8), SamplingParams(temperature=0.0),
              SamplingParams(seed=11, **bad_params), SamplingParams(seed=12),
              SamplingParams(seed=13, top_k=20, min_p=0.05, logprobs=2)]
    return logits, params


@pytest.mark.parametrize("bad_kind", ["nan", "negative nan", "+inf", "all -inf"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_row_with_no_token_to_sample_is_an_error_before_any_draw(kind, bad_kind):
    """sample_batch raises a SamplingError naming what is wrong, before any generator advanced (a top-p row raised
    torch.bincount's RuntimeError; every other kind returned a token: NaN's or +inf's position, or 0 for -inf)."""
    seq = SequenceSampler(SamplingParams(seed=3, **KINDS[kind]), [3, 4])
    state = seq.generator.get_state()
    with pytest.raises(Exception) as err:
        sample_batch(_bad_row(bad_kind).unsqueeze(0), [seq])
    assert type(err.value).__name__ == "SamplingError", repr(err.value)
    word = {"nan": "NaN", "negative nan": "NaN", "+inf": "+inf", "all -inf": "every token's logit is -inf"}[bad_kind]
    assert word in str(err.value) and "no next token can be sampled" in str(err.value)
    assert err.value.status == 500 and err.value.code == "invalid_logits"
    assert torch.equal(seq.generator.get_state(), state)


@pytest.mark.parametrize("bad_kind", ["nan", "all -inf"])
@pytest.mark.parametrize("kind", ["plain", "top_p", "top_k", "greedy"])
def test_a_bad_row_fails_alone_and_its_mates_sample_as_without_it(kind, bad_kind):
    """sample_rows: the bad row's place holds its SamplingError; the other rows get exactly the tokens (and logprobs)
    they get in a batch without it, and the caller's logits are left as they were."""
    logits, params = _batch(bad_kind, KINDS[kind])
    before = logits.clone()
    out = S.sample_rows(logits, [SequenceSampler(p) for p in params])
    assert isinstance(out[2], S.SamplingError) and out[2].row == 2
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())
    good = [0, 1, 3, 4]
    ref = sample_batch(logits[good], [SequenceSampler(params[i]) for i in good])
    assert [out[i] for i in good] == ref
    assert out[4].top_logprobs is not None and len(out[4].top_logprobs) == 2


def test_the_callers_logits_are_not_written_when_a_bad_row_is_set_aside():
    """Rows that need no working copy (greedy, then unfiltered at T = 1) are sampled from the caller's own tensor:
    the bad row is zeroed in a copy, not in it."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[1] = _bad_row("nan")
    before = logits.clone()
    out = S.sample_rows(logits, [SequenceSampler(SamplingParams(temperature=0.0)),
                                 SequenceSampler(SamplingParams(seed=1)), SequenceSampler(SamplingParams(seed=2))])
    assert isinstance(out[1], S.SamplingError) and torch.isnan(logits[1, 17])
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())
    assert out[0].token == int(before[0].argmax())


def test_only_non_finite_rows_fail():
    """-inf on some tokens (logit_bias -100 is finite; a model's masked tokens) samples among the others; a row with
    one finite token takes it, whatever its parameters."""
    row = torch.full((VOCAB,), -_INF)
    row[[7, 400]] = torch.tensor([1.0, 3.0])
    for params in KINDS.values():
        tok = sample_batch(row.unsqueeze(0), [SequenceSampler(SamplingParams(seed=1, **params))])[0].token
        assert tok in (7, 400)
    row[7] = -_INF
    for params in KINDS.values():
        assert sample_batch(row.unsqueeze(0), [SequenceSampler(SamplingParams(seed=2, **params))])[0].token == 400


def test_the_api_limits_cannot_overflow_finite_logits():
    """What a request can set at most (temperature just above greedy's 1e-5, repetition_penalty 10, presence and
    frequency 2 over 2000 repeats, logit_bias -100 on every token) keeps logits of +-100 finite: no request fails by
    its parameters alone."""
    logits = torch.linspace(-100, 100, VOCAB).unsqueeze(0)
    seq = SequenceSampler(SamplingParams(temperature=1.1e-5, repetition_penalty=10.0, presence_penalty=2.0,
                                         frequency_penalty=2.0, logit_bias={t: -100.0 for t in range(VOCAB)}),
                          range(VOCAB))
    for _ in range(2000):
        seq.append(0)
    assert sample_batch(logits, [seq])[0].token == VOCAB - 1


def test_choice_zero_keeps_its_seed_and_the_others_are_mixed():
    """choice_seed(s, 0) is s (a seeded single choice does not change); choice i > 0 is a 64-bit mix of (s, i), not
    s + i: choice 1 of seed 1 is not choice 0 of seed 2. Deterministic, distinct per choice and per seed, any int64."""
    assert S.choice_seed(None, 3) is None and S.choice_seed(7, 0) == 7 and S.choice_seed(-5, 0) == -5
    seeds = {(s, i): S.choice_seed(s, i) for s in (-2**63, -1, 0, 1, 2, 3, 2**63 - 1) for i in range(1, 4)}
    assert all(0 <= v < 2**64 for v in seeds.values()) and len(set(seeds.values())) == len(seeds)
    assert all(v not in (-2**63, -1, 0, 1, 2, 3, 4, 5, 2**63 - 1) for v in seeds.values())
    assert S.choice_seed(1, 1) == S.choice_seed(1, 1) != S.choice_seed(2, 0)
    assert S.choice_seed(-1, 2) == S.choice_seed(2**64 - 1, 2)  # seeds are taken mod 2**64, as the generator does

    def first_draws(seed):
        return torch.rand(8, generator=SequenceSampler(SamplingParams(seed=seed)).generator)

    assert not torch.equal(first_draws(S.choice_seed(1, 1)), first_draws(S.choice_seed(2, 0)))
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="choice index"):
            S.choice_seed(1, bad)
