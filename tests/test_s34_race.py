"""Seeded sampling draws by an exponential race (Gumbel-max), so the float noise of a batched LM head (the same row's
logits differ by ~1e-5 with the number of rows sharing the head's matmul) hardly ever changes a seeded draw: an
inverse CDF over the vocabulary in id order moved every boundary and changed 0.1-0.4 % of draws (issue found by
the s34 hunt with SmolLM2's head)."""

from __future__ import annotations

import pytest
import torch

from petals_chain.orchestrator import sampling as S
from petals_chain.orchestrator.sampling import SamplingParams, SequenceSampler, sample_batch


def _lm_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """LM-like rows: a Gaussian bulk and a few hundred plausible tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    for r in range(rows):
        x[r, torch.randperm(vocab, generator=gen)[:300]] += 5.0 + torch.randn(300, generator=gen)
    return x


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.95),
                                    dict(temperature=1.0, top_k=1000)])
def test_seeded_draws_hardly_move_with_float_noise_of_the_logits(params):
    """The same seeded request alone and in a bigger batch: its logits differ by float noise (here 1e-3, amplified
    from a batched head's ~1e-5 so that 400 draws show it); a draw changes only where two front-runners are that
    close: 1 draw of 400 here. The inverse CDF moved every one of ~8k boundaries and changed 26, 16 and 21."""
    vocab, seeds = 8192, 400
    x = _lm_rows(1, vocab, 0).expand(seeds, vocab)
    noisy = x + 1e-3 * torch.randn(seeds, vocab, generator=torch.Generator().manual_seed(1))
    a = sample_batch(x, [SequenceSampler(SamplingParams(seed=s, **params)) for s in range(seeds)])
    b = sample_batch(noisy, [SequenceSampler(SamplingParams(seed=s, **params)) for s in range(seeds)])
    toks = [c.token for c in a]
    flips = sum(c.token != t for c, t in zip(b, toks))
    assert len(set(toks)) > 100  # really sampled, from a wide distribution
    assert flips <= 3, f"{flips} of {seeds} seeded draws changed with 1e-3 of logit noise"


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, presence_penalty=0.5, logit_bias={3: 4.0}),
    dict(temperature=0.7, top_k=40, min_p=0.05, repetition_penalty=1.2),
    dict(temperature=1.0, top_p=0.8),  # a few hundred kept: the first candidate width cannot decide, a retry does
    dict(temperature=1.2, top_p=0.95),  # flat rows: thousands kept, the full sort
])
def test_a_draw_is_the_race_of_one_vector_of_its_own_generators_uniforms(params):
    """Each sampled row takes argmax over the kept tokens of log p_i - log(-log u_i), u the next ``vocab`` uniforms
    of its own generator in token id order, whatever row of the batch it is and whoever shares it; greedy rows draw
    nothing."""
    vocab, steps, seeds = 2000, 3, 4
    gen = torch.Generator().manual_seed(2)
    flat = "top_p" in params and params["temperature"] > 1.0
    for seed in range(seeds):
        me = SequenceSampler(SamplingParams(seed=seed, **params), [3, 7, 7])
        mates = [SequenceSampler(SamplingParams(temperature=0.0)),
                 SequenceSampler(SamplingParams(temperature=0.9, top_k=5, seed=99)),
                 SequenceSampler(SamplingParams(temperature=1.0, top_p=0.5, seed=98))]
        ref = torch.Generator().manual_seed(seed)
        greedy_state = mates[0].generator.get_state()
        for step in range(steps):
            rows = torch.randn(4, vocab, generator=gen) * 0.05 if flat else _lm_rows(4, vocab, 10 * seed + step)
            pos = (seed + step) % 4
            batch = mates[:pos] + [me] + mates[pos:]
            p = S._filtered_probs(rows[pos:pos + 1], [me])[0]
            u = torch.rand(vocab, generator=ref)
            want = int(torch.argmax(torch.where(p > 0, p.log(), float("-inf")) - u.log().neg().log()))
            out = sample_batch(rows, batch)
            for s, c in zip(batch, out):
                s.append(c.token)
            assert out[pos].token == want, (seed, step)
        assert torch.equal(me.generator.get_state(), ref.get_state())  # one vector per token, nothing more
        assert torch.equal(mates[0].generator.get_state(), greedy_state)


@pytest.mark.parametrize("params", [dict(), dict(top_k=2), dict(top_p=0.9)])
def test_tied_front_runners_split_evenly_at_a_low_temperature(params):
    """Two tokens tied at the top with logit_bias 100 (a forced choice) at a temperature just above greedy's: their
    scores are ~1e7, where a float32 step is 1, so the race's ``score - log E`` rounded to ties that the lower id
    won: 62 % instead of 50 %. The race runs on scores minus the row's maximum."""
    vocab, n = 256, 4000
    x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    x[0, 10] = x[0, 200] = 20.0
    seqs = [SequenceSampler(SamplingParams(temperature=1.2e-5, seed=s, logit_bias={10: 100.0, 200: 100.0},
                                           **params)) for s in range(n)]
    p = S._filtered_probs(x, seqs[:1])[0]
    assert p[10] == p[200] == 0.5
    toks = [c.token for c in sample_batch(x.expand(n, vocab), seqs)]
    assert toks.count(10) + toks.count(200) == n
    assert abs(toks.count(10) / n - 0.5) < 0.03, toks.count(10) / n  # 3.8 sigma


def _state_with_a_zero_uniform_at(token: int) -> torch.Tensor:
    """A generator state whose next vector of uniforms has u == 0 at ``token`` (torch.rand draws k * 2**-24)."""
    gen = torch.Generator().manual_seed(3)
    start = gen.get_state()
    z = int((torch.rand(1 << 22, generator=gen) == 0).nonzero()[0])
    gen.set_state(start)
    torch.rand(z - token, generator=gen)
    return gen.get_state()


@pytest.mark.parametrize("case", ["only token allowed", "dominant", "dominant, top_k"])
def test_a_uniform_of_zero_does_not_hand_the_draw_to_a_banned_or_unlikely_token(case):
    """u = 0 gave E = inf: that token sat out the race. The only finite token of a row lost to token 0 (logit
    -inf), and a token with p ~ 1 - 1e-21 lost to one with p ~ 2e-22. It now counts as u = 2**-25."""
    vocab, t = 64, 11
    state = _state_with_a_zero_uniform_at(t)
    probe = torch.Generator()
    probe.set_state(state)
    assert torch.rand(vocab, generator=probe)[t] == 0
    x = torch.full((1, vocab), float("-inf")) if case == "only token allowed" else torch.zeros(1, vocab)
    x[0, t] = 0.0 if case == "only token allowed" else 50.0
    s = SequenceSampler(SamplingParams(seed=3, top_k=2 if "top_k" in case else 0))
    s.generator.set_state(state)
    assert sample_batch(x, [s])[0].token == t
    assert torch.equal(s.generator.get_state(), probe.get_state())  # one vector, as any draw
