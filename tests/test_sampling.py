"""The batched sampler (sample_batch) against the per-request reference (transformers' processors)."""

from __future__ import annotations

import random

import pytest
import torch

from petals_chain.orchestrator import sampling as S
from petals_chain.orchestrator.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    PerRequestSampler,
    Sampler,
    SamplingParams,
    SequenceSampler,
    TokenChoice,
    prompt_logprobs,
    sample_batch,
)


def _logits(gen: torch.Generator, vocab: int, kind: str) -> torch.Tensor:
    """LM-like rows: a Gaussian bulk plus a few boosted tokens ("peaked"), or nearly uniform ("flat", which makes
    top-p/min-p keep thousands of tokens and forces the full-sort fallback), or in between ("medium": a few hundred
    plausible tokens, kept sets around the first candidate width)."""
    if kind == "flat":
        return torch.randn(vocab, generator=gen) * 0.05
    x = torch.randn(vocab, generator=gen) * 2.0
    n, boost, spread = (min(30, vocab), 8.0, 3.0) if kind == "peaked" else (min(300, vocab // 2), 5.0, 1.0)
    x[torch.randperm(vocab, generator=gen)[:n]] += boost + spread * torch.randn(n, generator=gen)
    return x


def _random_params(rng: random.Random, vocab: int, greedy_ok: bool = True) -> SamplingParams:
    temps = [0.5, 0.8, 1.0, 1.0, 1.5] + ([0.0] if greedy_ok else [])
    bias = {}
    if rng.random() < 0.4:
        bias = {rng.randrange(vocab): rng.choice([-100.0, -3.0, 0.05, 1.0]) for _ in range(rng.randint(1, 4))}
    return SamplingParams(
        temperature=rng.choice(temps), top_k=rng.choice([0, 0, 1, 5, 50, 300, 10 * vocab]),
        top_p=rng.choice([1.0, 1.0, 0.3, 0.9, 0.95]), min_p=rng.choice([0.0, 0.0, 0.05, 0.2, 0.9]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.5, -0.7]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.2]), logit_bias=bias, seed=rng.randrange(2**31))


def _state(rng: random.Random, params: SamplingParams, vocab: int, n_out: int = 0) -> tuple[SequenceSampler,
                                                                                              PerRequestSampler, list]:
    """A sequence with a prompt and ``n_out`` generated tokens (repeats included), and its reference sampler."""
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 200))]
    outs = [rng.choice(prompt) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(n_out)]
    seq = SequenceSampler(params, prompt)
    for t in outs:
        seq.append(t)
    return seq, PerRequestSampler(params, prompt_len=len(prompt)), prompt + outs


def test_greedy_rows_match_reference_argmax():
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for vocab in (50, 49152):
        rows, seqs, refs = [], [], []
        for i in range(12):
            p = _random_params(rng, vocab)
            if i % 2 == 0:
                p.temperature = 0.0
            seq, ref, ctx = _state(rng, p, vocab, n_out=rng.randint(0, 100))
            rows.append(_logits(gen, vocab, "peaked"))
            seqs.append(seq)
            refs.append((ref, ctx))
        logits = torch.stack(rows)
        choices = sample_batch(logits, seqs)
        for i in range(0, 12, 2):
            ref, ctx = refs[i]
            assert choices[i].token == int(ref.processed_scores(logits[i], ctx).argmax())
            assert choices[i].logprob is None and choices[i].top_logprobs is None


def _spy_candidates(monkeypatch) -> list[int]:
    widths: list[int] = []
    real = S._candidates

    def spy(w, kk):
        widths.append(min(kk, w.shape[1]))
        return real(w, kk)

    monkeypatch.setattr(S, "_candidates", spy)
    return widths


@pytest.mark.parametrize("vocab,width", [(50, None), (50, 4), (49152, None)])
def test_filtered_distribution_matches_reference(monkeypatch, vocab, width):
    if width is not None:  # exercise the topk candidates and the retries on a small vocabulary
        monkeypatch.setattr(S, "_FIRST_WIDTH", width)
    widths = _spy_candidates(monkeypatch)
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    rows = 48 if vocab < 1000 else 36
    for _ in range(2):
        seqs, refs, xs = [], [], []
        for i in range(rows):
            p = _random_params(rng, vocab)
            seq, ref, ctx = _state(rng, p, vocab, n_out=rng.randint(0, 100))
            xs.append(_logits(gen, vocab, ("flat", "peaked", "medium")[i % 3]))
            seqs.append(seq)
            refs.append((ref, ctx))
        logits = torch.stack(xs)
        got = S._filtered_probs(logits, seqs)
        for i, (ref, ctx) in enumerate(refs):
            scores = ref.processed_scores(logits[i], ctx)[0]
            if seqs[i].greedy:
                want = torch.zeros(vocab)
                want[scores.argmax()] = 1.0
            else:
                want = torch.softmax(scores, dim=-1)
            assert (got[i] > 0).sum() == (want > 0).sum(), (i, seqs[i].params)
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0, msg=lambda m, i=i: f"row {i}: {m}")
    if vocab == 49152:
        assert S._FIRST_WIDTH in widths and vocab in widths  # both the topk candidates and the full-sort fallback ran


def test_wide_kept_sets_are_sized_then_retried_once(monkeypatch):
    widths = _spy_candidates(monkeypatch)
    vocab = 49152
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(vocab, generator=gen) * 0.05  # top_p 0.9 keeps ~44k tokens: straight to the full sort
    wide = torch.randn(vocab, generator=gen) * 0.5  # ~1000 plausible tokens: top_p 0.8 keeps several hundred
    wide[torch.randperm(vocab, generator=gen)[:1000]] += 6.0 + 0.3 * torch.randn(1000, generator=gen)
    mid = torch.randn(vocab, generator=gen) * 2.0  # min_p 0.05 keeps a few hundred of the bulk's top
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=1.0, min_p=0.05)]
    x = torch.stack([flat, wide, mid])
    got = S._filtered_probs(x, [SequenceSampler(p) for p in params])
    kept = (got > 0).sum(1).tolist()
    assert kept[0] > vocab // 2 and all(S._FIRST_WIDTH < n < 4096 for n in kept[1:]), kept
    # one topk for all, one sized retry per needed width (no ladder of widths), the full sort for the flat row
    assert widths[0] == S._FIRST_WIDTH and widths[-1] == vocab and widths.count(vocab) == 1, widths
    assert all(n < w <= 4 * n for n, w in zip(sorted(kept[1:]), sorted(widths[1:-1]))), (kept, widths)
    for row, p in enumerate(params):
        want = torch.softmax(PerRequestSampler(p).processed_scores(x[row], [0])[0], dim=-1)
        torch.testing.assert_close(got[row], want, atol=1e-7, rtol=0)


@pytest.mark.parametrize("vocab,kk", [(128256, 256), (49152 + 13, 256), (100003, 4096), (5000, 64)])
def test_blocked_topk_equals_torch_topk(vocab, kk):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.stack([_logits(gen, vocab, kind) for kind in ("peaked", "medium", "flat")])
    x = torch.cat([x, x[:1].bfloat16().float()])  # ties
    cv, ci = S._topk(x, kk)
    tv = torch.topk(x, kk, dim=1).values
    assert torch.equal(cv, tv) and torch.equal(x.gather(1, ci), cv)
    assert all(len(set(r)) == kk for r in ci.tolist())
    x[3, 7] = x[3, vocab - 1] = x[3].max() + 1  # a tie for the maximum: the first index wins
    x[2, vocab - 1] = x[2].max() + 1  # the maximum in the tail past the last full block
    assert torch.equal(S._argmax(x), torch.argmax(x, dim=1)) and S._argmax(x)[3] == 7


def test_ties_follow_token_id_order_whatever_the_candidate_width(monkeypatch):
    """bf16 logits (as a bf16 LM head produces) tie a lot: the topk candidates must be ordered value-descending
    then id-ascending, like the full stable sort, so a draw does not depend on which path served the row."""
    vocab, rows = 20000, 32
    gen = torch.Generator().manual_seed(5)
    x = torch.stack([_logits(gen, vocab, "medium") for _ in range(rows)]).bfloat16().float()
    cv, ci = S._candidates(x, 256)
    fv, fi = torch.sort(x, dim=1, descending=True, stable=True)
    inside = cv > cv[:, -1:]  # ties with the last candidate may be any of the tied tokens
    assert bool((cv == fv[:, :256]).all()) and bool((ci[inside] == fi[:, :256][inside]).all())
    params = [SamplingParams(temperature=1.0, top_k=rng_k, min_p=0.01, seed=r) for r, rng_k in
              zip(range(rows), [0, 20, 100, 200] * 8)]
    want = S._filtered_probs(x, [SequenceSampler(p) for p in params])
    for r, p in enumerate(params):  # top-k and min-p are decided by value: ties are no excuse to differ
        ref = torch.softmax(PerRequestSampler(p).processed_scores(x[r], [0])[0], dim=-1)
        torch.testing.assert_close(want[r], ref, atol=1e-5, rtol=0)
    draws = []
    for width in (256, 20000):  # topk candidates, or the full sort
        monkeypatch.setattr(S, "_FIRST_WIDTH", width)
        seqs = [SequenceSampler(p) for p in params]
        draws.append([[c.token for c in sample_batch(x, seqs)] for _ in range(20)])
    assert draws[0] == draws[1]


def test_seeded_sequence_is_independent_of_batch_mates():
    vocab, steps = 6000, 50
    gen = torch.Generator().manual_seed(7)
    kinds = ["peaked", "flat", "peaked", "peaked", "flat"]
    rows = [_logits(gen, vocab, kinds[t % len(kinds)]) for t in range(steps)]
    targets = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(temperature=1.0, seed=12, presence_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=40, min_p=0.05, repetition_penalty=1.2, seed=13),
        SamplingParams(temperature=1.2, top_k=5000, top_p=0.95, frequency_penalty=0.4, seed=14,
                       logit_bias={3: 2.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ]
    prompt = list(range(100, 300))
    for params in targets:
        runs = []
        for layout in range(4):
            rng = random.Random(layout)
            me = SequenceSampler(params, prompt)
            mates = [SequenceSampler(_random_params(rng, vocab), prompt[:rng.randint(1, 200)])
                     for _ in range(0 if layout == 0 else rng.randint(1, 9))]
            toks = []
            for t in range(steps):
                pos = rng.randint(0, len(mates)) if layout else 0
                batch = mates[:pos] + [me] + mates[pos:]
                others = torch.randn(len(mates), vocab, generator=gen) * rng.choice([0.05, 2.0])
                logits = torch.cat([others[:pos], rows[t][None], others[pos:]])
                out = sample_batch(logits, batch)
                for s, c in zip(batch, out):
                    s.append(c.token)
                toks.append(out[pos].token)
            runs.append(toks)
        assert all(r == runs[0] for r in runs[1:]), params
        assert len(set(runs[0])) > 1


def test_logprobs_are_raw_log_softmax():
    vocab = 1000
    gen = torch.Generator().manual_seed(3)
    logits = torch.stack([_logits(gen, vocab, "peaked") for _ in range(4)])
    params = [SamplingParams(temperature=0.7, top_p=0.9, logprobs=5, seed=1, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 100.0}),
              SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=1.0, top_k=3, logprobs=20, seed=3)]
    seqs = [SequenceSampler(p, [1, 2, 3]) for p in params]
    out = sample_batch(logits, seqs)
    lsm = torch.log_softmax(logits, dim=-1)
    assert out[1].token == 5 and out[1].top_logprobs == []
    assert out[2].logprob is None and out[2].top_logprobs is None
    for i in (0, 1, 3):
        assert out[i].logprob == pytest.approx(lsm[i, out[i].token].item(), abs=1e-6)
        k = params[i].logprobs
        tv, ti = torch.topk(lsm[i], k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in out[i].top_logprobs] == ti.tolist()
        assert [v for _, v in out[i].top_logprobs] == pytest.approx(tv.tolist(), abs=1e-6)
        vals = [v for _, v in out[i].top_logprobs]
        assert vals == sorted(vals, reverse=True)
    # prompt logprobs: row i scores token i + 1; the first token has none
    ids = [4, 9, 2, 7]
    pl = prompt_logprobs(logits, ids, 2)
    assert pl[0] is None and len(pl) == 4
    for j in range(1, 4):
        assert isinstance(pl[j], TokenChoice) and pl[j].token == ids[j]
        assert pl[j].logprob == pytest.approx(lsm[j - 1, ids[j]].item(), abs=1e-6)
        assert [t for t, _ in pl[j].top_logprobs] == torch.topk(lsm[j - 1], 2).indices.tolist()
    assert prompt_logprobs(logits, [1], 3) == [None]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_k=6, top_p=0.95, min_p=0.02, repetition_penalty=1.4, presence_penalty=0.3),
    SamplingParams(temperature=1.3, frequency_penalty=0.5, logit_bias={0: -1.0}),  # unfiltered path
])
def test_sampling_frequencies_match_distribution(params):
    vocab, rows, steps = 10, 500, 40  # 20k draws
    x = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, 1.0, -2.0, 0.7, 0.2])
    seqs = []
    for r in range(rows):
        p = SamplingParams(**{**params.__dict__, "seed": 1000 + r})
        s = SequenceSampler(p, [1, 2])
        s.append(6)
        s.append(6)
        seqs.append(s)
    want = torch.softmax(PerRequestSampler(params, prompt_len=2).processed_scores(x, [1, 2, 6, 6])[0], dim=-1)
    counts = torch.zeros(vocab)
    logits = x.expand(rows, vocab)
    for _ in range(steps):
        for c in sample_batch(logits, seqs):
            counts[c.token] += 1
    n = rows * steps
    assert counts[want == 0].sum() == 0
    exp = want[want > 0] * n
    chi2 = (((counts[want > 0] - exp) ** 2) / exp).sum().item()
    assert chi2 < 30.0, (chi2, counts.tolist(), exp.tolist())  # df <= 9: p < 1e-3 by chance


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1},
    {"min_p": -0.1}, {"min_p": 1.1}, {"repetition_penalty": 0.0}, {"repetition_penalty": 5e-324},
    {"repetition_penalty": 1e-4}, {"presence_penalty": 2.5},
    {"frequency_penalty": -3.0}, {"logit_bias": {5: 101.0}}, {"logit_bias": {-1: 1.0}},
    {"logit_bias": {"5": 1.0}}, {"logprobs": 21}, {"logprobs": -1},
])
def test_invalid_params_raise(bad):
    p = SamplingParams(**bad)
    with pytest.raises(ValueError):
        p.validate()
    with pytest.raises(ValueError):
        SequenceSampler(p)


def test_valid_edges_and_bias_beyond_vocab():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, logprobs=20,
                   logit_bias={0: -100.0}).validate()
    bad = SequenceSampler(SamplingParams(logit_bias={10: 1.0}, seed=1))
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(1, 10), [bad])
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, 11), [bad])  # rows != sequences
    # a rejected step draws nothing: the seeded stream is where it was
    assert bad.generator.initial_seed() == 1 and torch.equal(bad.generator.get_state(),
                                                             torch.Generator().manual_seed(1).get_state())
    assert sample_batch(torch.zeros(0, 10), []) == []
    # top_k >= vocab filters nothing: the unfiltered path, the same law as no top_k
    x = torch.randn(1, 300)
    wide = S._filtered_probs(x, [SequenceSampler(SamplingParams(top_k=300))])
    torch.testing.assert_close(wide, torch.softmax(x, dim=-1), atol=1e-7, rtol=0)
    # prompt ids beyond the LM head's vocabulary are ignored by the penalty, as in transformers
    s = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), [3, 50])
    assert sample_batch(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.6]]), [s])[0].token == 4


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-30, 1e-6])
def test_temperatures_too_small_to_divide_by_are_greedy(temperature):
    """float32 logits divided by a tiny temperature overflow to inf and the softmax to NaN (a fuzzed request got a
    token id equal to the vocabulary size): below vLLM's epsilon sampling is greedy, on both paths."""
    torch.manual_seed(0)
    logits = torch.randn(3, 768) * 5
    p = SamplingParams(temperature=temperature, repetition_penalty=MIN_REPETITION_PENALTY, seed=3)
    p.validate()
    assert p.greedy
    seqs = [SequenceSampler(p, prompt_ids=range(0, 768, 3)) for _ in range(3)]
    got = [c.token for c in sample_batch(logits, seqs)]
    ref = [PerRequestSampler(p).next_token(logits[i], list(range(0, 768, 3))) for i in range(3)]
    assert got == ref and all(0 <= t < 768 for t in got)
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).greedy is False


def test_backward_compatible_sampler_name():
    assert Sampler is PerRequestSampler
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert Sampler(SamplingParams(temperature=0)).next_token(logits, [0]) == 1
    p = SamplingParams(temperature=0.0, presence_penalty=1.0)
    s = PerRequestSampler(p)
    assert s.next_token(logits, [1]) == 1  # the context at the first call is the prompt: no presence penalty
    assert s.next_token(logits, [1, 1]) == 2  # token 1 was generated since: penalized


def test_int64_seeds_and_the_seeds_of_n_choices_past_them():
    """OpenAI types ``seed`` as int64: a negative one was a 400; a seed near the top plus a choice's index must not
    overflow the generator. A seed is taken modulo 2**64 (as torch takes a negative one)."""
    for a, b in ((-1, 2**64 - 1), (2**63 - 1 + 7, 2**63 + 6), (-2**63, 2**63)):
        assert SequenceSampler(SamplingParams(temperature=1.0, seed=a)).generator.initial_seed() == \
            SequenceSampler(SamplingParams(temperature=1.0, seed=b)).generator.initial_seed()
    from petals_chain.orchestrator.api import CompletionRequest

    assert CompletionRequest(model="m", prompt="x", seed=-5).seed == -5
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="x", seed=2**63)
