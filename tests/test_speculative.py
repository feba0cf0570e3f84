"""Speculative decoding's pieces: prompt-lookup drafts, the adaptive draft length, and the verification rule
(greedy: exactly plain greedy; sampled: exactly the plain sampling distribution, by a chi-square test)."""

from __future__ import annotations

import math

import pytest
import torch

from petals_chain.algorithms.speculative import DraftLength, ngram_draft
from petals_chain.orchestrator.sampling import (SamplingParams, SequenceSampler, _filtered_probs, sample_batch,
                                              verify_drafts)


def test_ngram_draft_takes_what_followed_the_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (2, 6, 7)? never before; (6, 7) last occurred at 6..7 (then 2), before that at 1..2 (then 8)
    assert ngram_draft(tokens, 3) == [2, 6, 7]
    assert ngram_draft(tokens, 1) == [2]
    assert ngram_draft([1, 2, 3, 1, 2], 4) == [3, 1, 2]  # a 2-gram match beats the later 1-gram one
    assert ngram_draft([1, 2, 3, 4], 4) == []  # nothing repeats
    assert ngram_draft([4, 4], 3) == [4]
    assert ngram_draft([7], 3) == [] and ngram_draft([1, 2, 1], 0) == []
    assert ngram_draft([1, 2, 9, 1, 2], 4, max_ngram=1) == [9, 1, 2]  # only the last token is looked up


def test_draft_length_adapts_to_acceptance():
    d = DraftLength(k=4, max_k=8)
    d.update(4, 4)
    assert d.k == 6
    d.update(6, 6)
    d.update(8, 8)
    assert d.k == 8  # capped
    d.update(8, 2)
    assert d.k == 7
    for _ in range(20):
        d.update(d.k, 0)
    assert d.k == 1
    d.update(0, 0)  # nothing drafted: nothing learnt
    assert d.passes == 24 and d.drafted == 4 + 6 + 8 + 8 + sum(range(1, 8)) + 13  # 7, 6, ..., 1, then 1s
    assert math.isclose(d.acceptance_rate, (4 + 6 + 8 + 2) / d.drafted)
    with pytest.raises(ValueError):
        d.update(2, 3)


def _logits(rows: int, vocab: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_greedy_verification_is_plain_greedy():
    logits = _logits(4, seed=1)
    plain = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=1.3), [3, 4])
    want = []
    for j in range(4):  # what greedy emits if each row's input were the previous greedy token
        t = sample_batch(logits[j:j + 1], [plain])[0].token
        plain.append(t)
        want.append(t)
    # a draft that agrees with greedy for two tokens, then not
    bad = (want[2] + 1) % 12
    seq = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=1.3), [3, 4])
    got = verify_drafts(logits, seq, [want[0], want[1], bad])
    assert [c.token for c in got] == want[:3]  # two accepted, then greedy's own token
    assert seq.num_generated == 3 and seq.counts.get(want[2], 0) >= 1
    # every draft right: all accepted plus the bonus token from the last row
    seq = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=1.3), [3, 4])
    assert [c.token for c in verify_drafts(logits, seq, want[:3])] == want
    # first draft wrong: only greedy's token
    seq = SequenceSampler(SamplingParams(temperature=0.0), [])
    first = sample_batch(logits[:1], [SequenceSampler(SamplingParams(temperature=0.0), [])])[0].token
    assert [c.token for c in verify_drafts(logits[:3], seq, [(first + 1) % 12, 0])] == [first]
    with pytest.raises(ValueError):
        verify_drafts(logits, seq, [1])


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5, repetition_penalty=1.2, frequency_penalty=0.3),
    dict(temperature=1.3, top_p=0.8, logprobs=2),
])
def test_seeded_sampling_gives_the_same_tokens_with_or_without_drafts(params):
    """A seeded sampled sequence emits the tokens plain decoding emits from the same logits, whatever the drafts
    (right, wrong, or mixed): each emitted token consumes the one draw vector (its exponential race) plain sampling
    would."""
    vocab, rows = 12, 7
    logits = _logits(rows, vocab, seed=11)
    for seed in range(60):
        plain = SequenceSampler(SamplingParams(seed=seed, **params), [1, 2])
        want = []
        for j in range(rows):
            c = sample_batch(logits[j:j + 1], [plain])[0]
            plain.append(c.token)
            want.append(c.token)
        g = torch.Generator().manual_seed(seed)
        seq = SequenceSampler(SamplingParams(seed=seed, **params), [1, 2])
        got, pos = [], 0
        while pos < rows - 1:
            k = min(int(torch.randint(1, 4, (), generator=g)), rows - 1 - pos)
            # drafts: plain's own tokens, each swapped for a wrong one a third of the time
            draft = [t if torch.rand((), generator=g) < 0.67 else (t + 1) % vocab for t in want[pos:pos + k]]
            out = verify_drafts(logits[pos:pos + k + 1], seq, draft)
            got += [c.token for c in out]
            pos += len(out)
        assert got[:rows] == want[:len(got[:rows])], seed
        assert seq.num_generated == len(got)


def test_verification_keeps_logprobs_of_the_raw_distribution():
    logits = _logits(3, seed=2)
    seq = SequenceSampler(SamplingParams(temperature=0.8, seed=5, logprobs=2), [])
    got = verify_drafts(logits, seq, [int(logits[0].argmax()), 0])
    lsm = torch.log_softmax(logits, dim=1)
    for j, c in enumerate(got):
        assert c.logprob == pytest.approx(float(lsm[j, c.token]), abs=1e-5)
        assert [t for t, _ in c.top_logprobs] == torch.topk(lsm[j], 2).indices.tolist()


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5, repetition_penalty=1.2),
    dict(temperature=1.3, top_p=0.8),
])
def test_speculative_sampling_has_the_plain_distribution(params):
    """Chi-square over 6,000 seeds: the first emitted token's distribution equals what plain sampling draws from
    (for a likely draft and an unlikely one), and so does the second's, given the first was the draft."""
    vocab, n = 12, 6000
    logits = _logits(2, vocab, seed=3)
    context = [1, 2, 2]
    p0 = _filtered_probs(logits[:1], [SequenceSampler(SamplingParams(**params), context)])[0].double()
    likely, unlikely = int(p0.argmax()), int(p0.argsort()[len(p0) // 2])
    for draft in (likely, unlikely):
        counts = torch.zeros(vocab, dtype=torch.float64)
        second = torch.zeros(vocab, dtype=torch.float64)
        for seed in range(n):
            seq = SequenceSampler(SamplingParams(seed=seed, **params), context)
            out = verify_drafts(logits, seq, [draft])
            counts[out[0].token] += 1
            if out[0].token == draft:
                second[out[1].token] += 1
        _chi_square_ok(counts, p0)
        after = SequenceSampler(SamplingParams(**params), context)
        after.append(draft)
        p1 = _filtered_probs(logits[1:2], [after])[0].double()
        if draft == likely or second.sum() >= 300:  # an unlikely draft is kept too rarely to test its bonus token
            _chi_square_ok(second, p1)


def _chi_square_ok(counts: torch.Tensor, p: torch.Tensor) -> None:
    """Pearson's chi-square of ``counts`` against ``p`` below the 0.999 quantile (tokens of p = 0 never drawn)."""
    total = float(counts.sum())
    assert total > 300
    assert float(counts[p == 0].sum()) == 0
    keep = p * total >= 5  # the chi-square approximation needs expected counts of 5 or more; pool the rest
    exp = torch.cat([p[keep] * total, (p[~keep] * total).sum().reshape(1)])
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    if float(exp[-1]) < 5:
        exp, obs = exp[:-1], obs[:-1]
        exp = exp * (float(obs.sum()) / float(exp.sum()))
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile
    z = 3.09
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    assert stat <= bound, (stat, bound, obs.tolist(), exp.tolist())
