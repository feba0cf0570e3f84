"""Token sampling at the orchestrator: parameters, a batched vectorized sampler, seeds, EOS and stop strings.

Two implementations of the same semantics live here:

* ``sample_batch`` + ``SequenceSampler``: the orchestrator runs the LM head for every active generation at once,
  so it samples all rows of a step in one vectorized pass (rows may have different parameters).
* ``PerRequestSampler`` (alias ``Sampler``): one request at a time through transformers' logits processors. It is
  the reference the batched path is tested against, and what older callers use.

Order of operations (vLLM's): logit_bias -> repetition penalty -> presence/frequency penalties -> [greedy: argmax]
-> temperature -> top-k -> top-p -> min-p -> sample (the batched path: an exponential race, see ``sample_batch``).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.tokentext import MAX_CHARACTER_BYTES, context_tail, incomplete_end


# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by a smaller one
# overflows to inf and the softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
# Where a structured output is complete only an end token is allowed: ignoring it would leave no token to sample
IGNORE_EOS_WITH_GRAMMAR = ("ignore_eos cannot be used with a structured output: the output ends when it is complete "
                           "(its end token is then the only one allowed)")
# A logprob of -inf (a token the model rules out, or a logit gap beyond float32) is shown as this, as vLLM does:
# JSON has no infinity, and a body with one was invalid JSON
MIN_LOGPROB = -9999.0
# The smallest repetition penalty: a logit of 100 divided by it stays far inside float32 (1e-40 became 0, then inf).
MIN_REPETITION_PENALTY = 1e-3


@dataclass
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` (below ``GREEDY_BELOW_TEMPERATURE``) means greedy (argmax).

    ``presence_penalty``/``frequency_penalty`` apply to generated tokens only (OpenAI/vLLM);
    ``repetition_penalty`` to prompt and generated tokens (transformers/vLLM). ``logprobs``: None for none, k >= 0 for
    the chosen token's logprob plus the k most likely alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    speculative: str | None = None  # "none", "ngram" or "draft"; None: the orchestrator's --speculative
    relay: str | None = None  # "orchestrator" or "push"; None: the orchestrator's --relay
    # a compiled structured output (structured.Grammar): the tokens it forbids are masked before anything else, each
    # sequence has its own state of it. None: unconstrained.
    structured: Any = None
    # ``stop`` does not apply to an output that starts with this text ("": to none): a reply's tool calls (tools.py)
    stop_unless: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field (construction itself stays lenient)."""

        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            return float(v)

        if self.speculative not in (None, "none", "ngram", "draft"):
            raise ValueError(f"speculative must be 'none', 'ngram' or 'draft', got {self.speculative!r}")
        if self.relay not in (None, "orchestrator", "push"):
            raise ValueError(f"relay must be 'orchestrator' or 'push', got {self.relay!r}")
        if num("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < num("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not 0.0 <= num("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if num("repetition_penalty") < MIN_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be >= {MIN_REPETITION_PENALTY} (1 = disabled), "
                             f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= num(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(  # noqa: TRY004 -- the API maps ValueError to a 400
                f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.structured is not None and self.ignore_eos:
            raise ValueError(IGNORE_EOS_WITH_GRAMMAR)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed`` (``n`` > 1): ``seed`` itself for choice 0 (a seeded
    request's first choice is what the same request with n = 1 gives), else a 64-bit mix of (seed, index): numpy's
    ``SeedSequence(seed, spawn_key=(index,))``, the standard way to derive independent child streams. ``seed + index``
    made choice i of seed s the very stream of choice 0 of seed s + i: neighbouring seeds shared outputs."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"a choice index is an integer >= 0, got {index!r}")
    if seed is None or index == 0:
        return seed
    state = np.random.SeedSequence(int(seed) % 2**64, spawn_key=(index,)).generate_state(1, np.uint64)
    return int(state[0])


def _generator(seed: int | None) -> torch.Generator:
    """A sequence's own generator: seeded by ``seed`` (any int, taken mod 2**64: OpenAI's int64 seeds and
    :func:`choice_seed`'s), or from the OS's entropy when None."""
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(int(seed) % 2**64)
    else:
        gen.seed()
    return gen


class SamplingError(RequestError):
    """No token can be sampled for one sequence: its logits hold NaN or +inf (a broken model output, or a value that
    overflowed), or exclude every token (all -inf). It fails that sequence's request alone, with this message (HTTP
    500, code ``invalid_logits``); :func:`sample_rows` samples the batch's other rows as usual. ``row``: its row."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message, status=500, code="invalid_logits")
        self.row = row


class StructuredOutputError(SamplingError):
    """A structured output's grammar cannot go on mid-output: llguidance hit one of its per-token limits, or the
    sequence spent its grammar CPU budget (structured.py; an ambiguous grammar whose parse grows with every token),
    while computing the next mask or taking the token just sampled. HTTP 400 ``invalid_structured_output`` naming
    the body field: its output so far is not a whole match, and ending it "stop" (only EOS was left allowed)
    returned truncated JSON as a success."""

    def __init__(self, message: str, row: int | None = None, param: str | None = None):
        super().__init__(message, row)
        self.status, self.code, self.param = 400, "invalid_structured_output", param


def _grammar_failure(seq: "SequenceSampler", detail: str, row: int | None = None) -> StructuredOutputError:
    """The error of ``seq``'s grammar failing after the tokens it has taken (``detail``: llguidance's reason)."""
    spec = getattr(seq.grammar.grammar, "spec", None)
    param = getattr(spec, "param", None)
    where = f"{param}: " if param else ""
    return StructuredOutputError(
        f"{where}the structured output cannot go on after {seq.num_generated} generated tokens: {detail[:300]}; its "
        "grammar needs more work per token than this server allows (an ambiguous grammar?); the generation was "
        "stopped", row, param)


@dataclass(frozen=True, slots=True)
class TokenChoice:
    """One sampled (or scored) token. ``logprob``/``top_logprobs`` are of the raw model distribution, or None when
    not requested; ``top_logprobs`` is sorted by descending logprob."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


# --------------------------------------------------------------------------------------------------------------------
# Reference: one request at a time, transformers' processors.


class _PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI/vLLM penalties on generated tokens: ``logit -= frequency * count + presence`` for count > 0."""

    def __init__(self, presence: float, frequency: float, prompt_len: int):
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts: dict[int, int] = {}
        for t in input_ids[0, self.prompt_len:].tolist():
            counts[t] = counts.get(t, 0) + 1
        counts = {t: c for t, c in counts.items() if t < scores.shape[-1]}
        if not counts:
            return scores
        ids = torch.tensor(list(counts), dtype=torch.long)
        sub = torch.tensor([self.frequency * c + self.presence for c in counts.values()], dtype=torch.float32)
        scores = scores.clone()
        scores[0, ids] -= sub
        return scores


class _GrammarMask(LogitsProcessor):
    """A structured output's mask (first: before bias and penalties, as the batched path): the grammar's state
    takes the generated tokens (``input_ids`` past ``prompt_len``) it has not seen, then forbidden tokens are -inf."""

    def __init__(self, structured: Any, stop_token_ids: Iterable[int], prompt_len: int):
        self.state = structured.state(stop_token_ids)
        self.prompt_len = prompt_len
        self.seen = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.prompt_len + self.seen:].tolist()
        for t in new:
            self.state.consume(t)  # ValueError: a token this grammar forbids, or a limit hit parsing it
            self.seen += 1
        scores = scores.to("cpu", torch.float32, copy=True).contiguous()
        self.state.mask_(scores[0])
        if self.state.error is not None:
            raise ValueError(f"the structured output cannot go on after {self.seen} generated tokens: "
                             f"{self.state.error}")
        return scores


class PerRequestSampler:
    """Per-request sampler on transformers' processors, with the request's own RNG (so a seed reproduces output
    regardless of concurrent requests, and a failover replay does not resample).

    ``prompt_len`` is where generated tokens start in ``context_ids`` (for presence/frequency penalties, and a
    structured output's state: ``params.structured`` masks first, as in the batched path); None takes the length of
    the context at the first ``next_token`` call, i.e. everything before the first sampled token.
    """

    def __init__(self, params: SamplingParams, prompt_len: int | None = None):
        if params.structured is not None and params.ignore_eos:
            raise ValueError(IGNORE_EOS_WITH_GRAMMAR)
        self.params = params
        self.prompt_len = prompt_len
        self.generator = _generator(params.seed)
        self.processors: LogitsProcessorList | None = None

    def _build(self, prompt_len: int) -> LogitsProcessorList:
        p = self.params
        procs = LogitsProcessorList()
        if p.structured is not None:
            procs.append(_GrammarMask(p.structured, p.stop_token_ids, prompt_len))
        if p.logit_bias:
            procs.append(SequenceBiasLogitsProcessor({(int(t),): float(b) for t, b in p.logit_bias.items()}))
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty)))
        if p.presence_penalty or p.frequency_penalty:
            procs.append(_PresenceFrequencyPenalty(float(p.presence_penalty), float(p.frequency_penalty), prompt_len))
        if not p.greedy:
            if p.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(float(p.temperature)))
            if p.top_k > 0:
                procs.append(TopKLogitsWarper(int(p.top_k)))
            if p.top_p < 1.0:
                procs.append(TopPLogitsWarper(float(p.top_p)))
            if p.min_p > 0.0:
                procs.append(MinPLogitsWarper(float(p.min_p)))
        return procs

    def processed_scores(self, logits: torch.Tensor, context_ids: Sequence[int]) -> torch.Tensor:
        """Scores [1, vocab] after every processor (filtered tokens are -inf); softmax gives the sampled law."""
        if self.processors is None:
            self.prompt_len = len(context_ids) if self.prompt_len is None else self.prompt_len
            self.processors = self._build(self.prompt_len)
        scores = logits.detach().float().reshape(1, -1)
        if len(self.processors):
            ids = torch.tensor([list(context_ids)], dtype=torch.long)
            scores = self.processors(ids, scores)
        return scores

    def next_token(self, logits: torch.Tensor, context_ids: Sequence[int]) -> int:
        """Choose the next token from ``logits`` [vocab] given all tokens so far (prompt + generated)."""
        scores = self.processed_scores(logits, context_ids)
        if self.params.greedy:
            return int(torch.argmax(scores, dim=-1).item())
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


Sampler = PerRequestSampler  # backward-compatible name


# --------------------------------------------------------------------------------------------------------------------
# Batched path.


class SequenceSampler:
    """Sampling state of one generated sequence: its RNG and the token statistics the penalties need.

    The penalized/biased tokens are kept as flat numpy arrays (token id, bias, repetition factor, penalty to
    subtract) indexed through a dict, so ``append`` is O(1) and a step never rebuilds anything O(context); the
    batch concatenates the arrays of its rows. Call ``append`` with every token the sequence actually emits.
    """

    _CAP0 = 64

    def __init__(self, params: SamplingParams, prompt_ids: Iterable[int] = ()):
        params.validate()
        self.params = params
        self.generator = _generator(params.seed)
        self.greedy = params.greedy
        self.temperature = 1.0 if self.greedy else float(params.temperature)
        self.counts: dict[int, int] = {}  # generated token -> occurrences
        self.num_generated = 0
        self._rep = float(params.repetition_penalty)
        self._rep_on = self._rep != 1.0
        self._pres, self._freq = float(params.presence_penalty), float(params.frequency_penalty)
        self._pf_on = self._pres != 0.0 or self._freq != 0.0
        self._slot: dict[int, int] = {}
        self._n = 0
        self._ids = np.empty(self._CAP0, np.int64)
        self._bias = np.zeros(self._CAP0, np.float32)
        self._repf = np.ones(self._CAP0, np.float32)
        self._sub = np.zeros(self._CAP0, np.float32)
        self._max_id = -1
        self._max_bias_id = max((int(t) for t in params.logit_bias), default=-1)
        self._has_bias = bool(params.logit_bias)
        # the structured output's state: masks this sequence's logits, consumes every token it emits
        self.grammar = params.structured.state(params.stop_token_ids) if params.structured is not None else None
        for t, b in params.logit_bias.items():
            s = self._slot_of(int(t))  # before indexing: the slot may reallocate the arrays
            self._bias[s] = b
        if self._rep_on:
            toks = list(dict.fromkeys(int(t) for t in prompt_ids))
            new = [t for t in toks if t not in self._slot]
            if new:
                self._reserve(self._n + len(new))
                self._ids[self._n:self._n + len(new)] = new
                self._slot.update(zip(new, range(self._n, self._n + len(new))))
                self._n += len(new)
                self._max_id = max(self._max_id, max(new))
            if toks:
                self._repf[[self._slot[t] for t in toks]] = self._rep

    def _reserve(self, n: int) -> None:
        cap = len(self._ids)
        if n <= cap:
            return
        while cap < n:
            cap *= 2
        for name, fill in (("_ids", 0), ("_bias", 0.0), ("_repf", 1.0), ("_sub", 0.0)):
            old = getattr(self, name)
            arr = np.full(cap, fill, old.dtype)
            arr[:self._n] = old[:self._n]
            setattr(self, name, arr)

    def _slot_of(self, t: int) -> int:
        s = self._slot.get(t)
        if s is None:
            s = self._n
            self._reserve(s + 1)
            self._ids[s] = t
            self._slot[t] = s
            self._n = s + 1
            self._max_id = max(self._max_id, t)
        return s

    def append(self, token_id: int) -> None:
        """Record a generated token (updates the penalty state in O(1); a structured output's state consumes it)."""
        t = int(token_id)
        if self.grammar is not None:
            try:
                self.grammar.consume(t)
            except ValueError as e:  # a per-token limit hit while parsing it (the mask allowed it)
                raise _grammar_failure(self, str(e)) from None
        self.num_generated += 1
        c = self.counts.get(t, 0) + 1
        self.counts[t] = c
        if self._rep_on or self._pf_on:
            s = self._slot_of(t)
            if self._rep_on:
                self._repf[s] = self._rep
            if self._pf_on:
                self._sub[s] = self._freq * c + self._pres

    def _entries(self, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = self._n
        ids, bias, repf, sub = self._ids[:n], self._bias[:n], self._repf[:n], self._sub[:n]
        if self._max_id >= vocab:  # (logit_bias ids were checked against the vocabulary by ``_check``)
            ok = ids < vocab  # context ids beyond the LM head's vocabulary cannot be sampled: no penalty (as HF)
            ids, bias, repf, sub = ids[ok], bias[ok], repf[ok], sub[ok]
        return ids, bias, repf, sub


# Filtered rows first try this many topk candidates (top-k rows: k + 1 at least). A width is exact for a row when
# its kept set provably lies inside (see ``_filter_sorted``); rows it cannot decide are sized by one histogram pass
# (``_sizes``) and retried with a width that fits; only what still fails, or needs most of the vocabulary, sorts
# the full row.
_FIRST_WIDTH = 256
_NEG_INF = float("-inf")
_WORKSPACE_MAX = 8 << 20  # floats kept per thread between steps (32 MiB); bigger batches allocate per step
_local = threading.local()


def _workspace(name: str, rows: int, cols: int) -> torch.Tensor:
    """A per-thread scratch [rows, cols] reused across steps: fresh multi-MiB tensors cost page faults each step."""
    n = rows * cols
    if n > _WORKSPACE_MAX:
        return torch.empty(rows, cols)
    cache = getattr(_local, "bufs", None)
    if cache is None:
        cache = _local.bufs = {}
    buf = cache.get(name)
    if buf is None or buf.numel() < n:
        buf = cache[name] = torch.empty(max(n, 1 << 16))
    return buf[:n].view(rows, cols)


def _k_eff(top_k: int, vocab: int) -> int:
    return top_k if 0 < top_k < vocab else 0


def _first_width(k: int, vocab: int) -> int:
    return min(vocab, max(_FIRST_WIDTH, k + 1))


def _width_for(need: int, vocab: int) -> int:
    """A candidate width of at least ``need``, rounded up to a multiple of 1024 (few distinct topk calls); the
    full vocabulary past 80% of it, where topk costs about as much as a sort."""
    w = -(-need // 1024) * 1024
    return vocab if w > 0.8 * vocab else w


_HALF_OCTAVE = 2.0 / math.log(2.0)


def _sizes(w: torch.Tensor, cv: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           s_full: torch.Tensor) -> torch.Tensor:
    """Upper bounds on how many tokens each row keeps, from one pass over its logits ``w`` [r, V] (temperature
    applied; ``cv`` its first candidates): top-k rows keep the tokens >= the k-th value, min-p rows the tokens with
    weight >= min_p; top-p rows (without top-k) at most the tokens down to the half-octave weight bucket where the
    cumulative mass first reaches top_p. Only the width of the retry depends on these bounds, never the result."""
    r, vocab = w.shape
    c0 = cv[:, :1]
    bound = torch.full((r,), vocab, dtype=torch.long)
    has_k = k > 0
    if bool(has_k.any()):
        thr = cv.gather(1, (k - 1).clamp(0, cv.shape[1] - 1).unsqueeze(1))
        bound = torch.where(has_k, torch.minimum(bound, (w >= thr).sum(1)), bound)
    use_m = min_p > 0
    use_p = (top_p < 1.0) & ~has_k
    if not bool(use_m.any() or use_p.any()):
        return bound
    e = torch.exp(w - c0)
    if bool(use_m.any()):
        cnt = (e >= (min_p.float() * (1 - 1e-6)).unsqueeze(1)).sum(1)  # a superset: margin for rounding
        bound = torch.where(use_m, torch.minimum(bound, cnt), bound)
    if bool(use_p.any()):
        b = torch.sub(c0, w).mul_(_HALF_OCTAVE).floor_().clamp_(0, 63).long()
        b += (torch.arange(r) * 64).unsqueeze(1)
        mass = torch.bincount(b.view(-1), weights=e.view(-1), minlength=r * 64).view(r, 64).double().cumsum(1)
        count = torch.bincount(b.view(-1), minlength=r * 64).view(r, 64).cumsum(1)
        target = top_p * s_full.double() * (1 + 1e-5)  # a margin for rounding: the bound must not fall short
        first = (mass < target.unsqueeze(1)).sum(1).clamp(max=63)
        bound = torch.where(use_p, torch.minimum(bound, count.gather(1, first.unsqueeze(1)).squeeze(1)), bound)
    return bound


def _topk(w: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk (sorted) of each row's ``kk`` largest values, about 2.5x faster for kk << vocab.

    The vocabulary is split into ``nb`` strided blocks {b, b + nb, b + 2 nb, ...} (a cheap vectorized max over
    ``bs`` contiguous slices); the ``kk`` blocks with the largest maxima hold at least ``kk`` values >= the kk-th
    largest block maximum, so they (plus the < bs tail tokens) hold every value above the row's kk-th largest:
    a topk over those ``kk * bs`` values returns the same values as a topk over the row (which tokens among
    values tied with the last one may differ, as it may between topk implementations).
    """
    g, vocab = w.shape
    bs = 1 << max(0, round(math.log2(math.sqrt(vocab / kk))))  # balances the block topk and the final topk
    if bs < 4:
        return torch.topk(w, kk, dim=1, sorted=True)
    nb = vocab // bs
    blocks = w[:, :nb * bs].view(g, bs, nb)
    bi = torch.topk(blocks.amax(dim=1), kk, dim=1, sorted=False).indices
    vals = blocks.gather(2, bi.unsqueeze(1).expand(g, bs, kk)).reshape(g, bs * kk)
    ids = (bi.unsqueeze(1) + nb * torch.arange(bs).unsqueeze(1)).reshape(g, bs * kk)
    if nb * bs < vocab:
        vals = torch.cat([vals, w[:, nb * bs:]], dim=1)
        ids = torch.cat([ids, torch.arange(nb * bs, vocab).expand(g, -1)], dim=1)
    cv, pos = torch.topk(vals, kk, dim=1, sorted=True)
    return cv, ids.gather(1, pos)


_KEYED_WIDTH = 4096  # from this width on, candidates come from a topk/sort of unique int64 keys


def _canonical_keys(w: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys whose ascending order is (value descending, token id ascending): the float's bits mapped
    to an order-preserving integer (-0.0 folded onto +0.0), shifted above a 31-bit token id."""
    bits = (w + 0.0).view(torch.int32).long()
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float value
    return ((0x7FFFFFFF - ordered) << 31) | torch.arange(w.shape[1])


def _candidates(w: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kk`` largest values per row in canonical order: value descending, then token id ascending."""
    if kk >= _KEYED_WIDTH or kk >= w.shape[1]:
        # wide: ties are likely (float32 logits over a large vocabulary), so order by unique keys directly,
        # cheaper than a stable sort or a topk followed by a tie-fixing sort
        keys = _canonical_keys(w)
        if kk >= w.shape[1]:
            ci = torch.sort(keys, dim=1).indices
        else:
            ci = torch.topk(keys, kk, dim=1, largest=False, sorted=True).indices
        return w.gather(1, ci), ci
    cv, ci = _topk(w, kk)
    new_run = cv[:, 1:] != cv[:, :-1]
    if not bool(new_run.all()):  # ties: topk's order among equals is unspecified; sort each run of equals by id
        run = torch.cat([torch.zeros_like(ci[:, :1]), new_run.long().cumsum(1)], dim=1)
        perm = torch.sort(run * w.shape[1] + ci, dim=1).indices
        cv, ci = cv.gather(1, perm), ci.gather(1, perm)
    return cv, ci


def _row_sum(e: torch.Tensor) -> torch.Tensor:
    """Row sums of ``e`` [g, V] (float32, >= 0) computed in an order fixed by V alone: a plain multi-threaded sum
    splits a lone row across threads but not a batch of rows, which would make a row's top-p decision (at the
    last bit) depend on its batch mates. Columns of 64 strided values are summed, then the columns in double."""
    g, vocab = e.shape
    n = vocab // 64
    total = e[:, n * 64:].double().cumsum(1)[:, -1] if n * 64 < vocab else torch.zeros(g, dtype=torch.float64)
    if n:
        total = total + e[:, :n * 64].view(g, 64, n).sum(1).cumsum(1, dtype=torch.float64)[:, -1]
    return total.float()


def _argmax(w: torch.Tensor) -> torch.Tensor:
    """First maximal index per row, as torch.argmax, but through block maxima (several times faster on CPU)."""
    g, vocab = w.shape
    n = vocab // 64
    if n < 4:
        return w.max(dim=1).indices
    head = w[:, :n * 64].view(g, n, 64)
    bmax, blk = head.amax(dim=2).max(dim=1)  # first block holding the maximum
    inner = head.gather(1, blk.view(g, 1, 1).expand(g, 1, 64)).squeeze(1).max(dim=1).indices
    idx = blk * 64 + inner
    if n * 64 < vocab:
        tmax, tidx = w[:, n * 64:].max(dim=1)
        idx = torch.where(tmax > bmax, n * 64 + tidx, idx)
    return idx


def _filter_sorted(cv: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   s_full: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k -> top-p -> min-p on canonically sorted candidate logits ``cv`` [g, K] (temperature applied).

    Returns ``(wk, valid)``: ``wk`` the unnormalized kept weights exp(cv - max) (0 where filtered);
    ``valid`` whether that is exact for the row, i.e. independent of the tokens outside the candidates: the kept
    set's smallest value is strictly above the smallest candidate (so every token tied with a kept one is a
    candidate; for a top-k row, every token tied with its k-th value too), or the smallest candidate's weight
    underflows to 0 (the tokens outside cannot carry probability). ``s_full`` is the row's full normalizer
    sum(exp(logit - max)), used by top-p rows without top-k.

    Semantics (transformers' warpers): top-k keeps every token >= the k-th largest value; top-p keeps a token iff
    the mass before it (canonical order) is < top_p, i.e. the smallest prefix with mass >= top_p, at least one
    token (transformers: remove where the ascending cumulative mass <= 1 - top_p; the same set up to rounding of
    the masses, ~1e-7); min-p keeps tokens with probability >= min_p * max probability. Ties at the top-p
    boundary are broken by token id (lower id first); transformers breaks them in torch.sort's unspecified order.
    """
    g, kk = cv.shape
    w = torch.exp(cv - cv[:, :1])
    has_k = k > 0
    keep = torch.ones_like(cv, dtype=torch.bool)
    last = cv[:, -1]
    thr_k = None
    if bool(has_k.any()):
        kth = cv.gather(1, (k - 1).clamp(0, kk - 1).unsqueeze(1)).squeeze(1)
        thr_k = torch.where(has_k, kth, torch.full_like(kth, _NEG_INF))
        keep &= cv >= thr_k.unsqueeze(1)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        wk = torch.where(keep, w, torch.zeros_like(w))
        cum = wk.cumsum(1)  # double-accumulated on CPU: each entry is the rounded exact prefix sum
        norm = torch.where(has_k, cum[:, -1], s_full).double()
        limit = torch.where(use_p, top_p * norm, torch.full_like(norm, math.inf))
        excl = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        keep &= excl < limit.unsqueeze(1)
    if bool((min_p > 0).any()):
        keep &= w >= min_p.unsqueeze(1)
    keep[:, 0] = True
    wk = torch.where(keep, w, torch.zeros_like(w))
    if kk >= vocab:
        return wk, torch.ones(g, dtype=torch.bool)
    m = keep.sum(1)
    w_last = w[:, -1]
    valid = (cv.gather(1, (m - 1).unsqueeze(1)).squeeze(1) > last) | (w_last == 0)
    if thr_k is not None:
        valid &= ~has_k | (last < thr_k) | (w_last == 0)
    return wk, valid


def _race_uniforms(seqs: Sequence[SequenceSampler], rows: list[int], vocab: int) -> torch.Tensor:
    """The exponential race's draws of ``rows`` [len(rows), vocab]: per row, one vector of vocab uniforms u from its
    sequence's generator, in token id order (E_i = -log(u_i) ~ Exp(1), see ``_log_e_``)."""
    u = _workspace("noise", len(rows), vocab)
    for j, i in enumerate(rows):
        torch.rand(vocab, generator=seqs[i].generator, out=u[j])
    return u


# torch.rand's float32 uniforms are multiples of 2**-24 in [0, 1): u = 0 stands for the cell [0, 2**-24) and is
# taken at its middle. As 0 it gave E = inf: the token sat out the race, and a row whose allowed tokens all drew 0
# (one allowed token: a 2**-24 chance per step) went to position 0, a filtered (-inf) token.
_U_ZERO = 2.0 ** -25


def _log_e_(u: torch.Tensor) -> torch.Tensor:
    """log E = log(-log u) of uniforms ``u`` [rows, n] (CPU float32, contiguous), in place. Row by row in numpy: a
    row's values then never depend on the batch's layout (vectorized and scalar log may differ in the last bit),
    and no op is split across threads (torch parallelizes a log of a few thousand floats: on a loaded machine each
    of a batch's per-row logs waited ~10 ms for a second thread). u = 0 is taken as ``_U_ZERO`` (E ~ 17.3), so every
    log E is finite."""
    for row in u.numpy():
        if row.min() == 0.0:  # a 2**-24 chance per token; the check costs ~1/5 of one log
            row[row == 0.0] = _U_ZERO
        np.log(row, out=row)
        np.negative(row, out=row)
        np.log(row, out=row)
    return u


def _centered(scores: torch.Tensor, top: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scores - top`` (``top`` [rows, 1] each row's maximum; a non-finite one is left alone) for the race: the
    front-runners then sit near 0, where float32 resolves log E's differences. Raw scores of a low temperature or a
    big logit_bias (100 / 1.2e-5 ~ 1e7: a float32 step of 1) rounded ``scores - log_e`` to ties, which the first
    index won: two tied tokens split 62/38 instead of 50/50 at T = 1.2e-5 with logit_bias 100."""
    return torch.sub(scores, torch.where(torch.isfinite(top), top, torch.zeros_like(top)), out=out)


def _race(scores: torch.Tensor, log_e: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Positions that win the exponential race (Gumbel-max): per row the first maximum of ``scores - log_e``, i.e.
    of p_i / E_i, which is position i with probability p_i = softmax(scores)_i. Filtered tokens (-inf) never win.
    Only two near-equal front-runners can swap on a float-noise change of ``scores``, not every CDF boundary."""
    return _argmax(torch.sub(scores, log_e, out=out))


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, torch.tensor(rows, dtype=torch.long))


def _check(logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> None:
    """Reject a malformed step before any generator advances."""
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(f"logits must be [batch, vocab] with batch == len(seqs) ({len(seqs)}), got "
                         f"{tuple(logits.shape)}")
    vocab = logits.shape[1]
    for s in seqs:
        if s._max_bias_id >= vocab:
            raise ValueError(f"logit_bias has token id {s._max_bias_id}, but the vocabulary has {vocab} tokens")


def _filters(s: SequenceSampler, vocab: int) -> bool:
    p = s.params
    return not s.greedy and (_k_eff(p.top_k, vocab) > 0 or p.top_p < 1.0 or p.min_p > 0.0)


def _row_error(raw: torch.Tensor, processed: torch.Tensor | None, row: int,
               lead: str = "no next token can be sampled", end: str = "the generation was stopped",
               masked: bool = False) -> SamplingError:
    """Why row ``row`` has no token to sample (or, with its own ``lead``, cannot be scored), from its model logits
    ``raw`` and ``processed`` ones [vocab] (None: only the model's are used). ``masked``: ``raw`` is a structured
    output's masked row (its -inf are the tokens the grammar forbids as well)."""
    vocab = raw.numel()
    if masked:
        lead = "no token the structured output allows can be sampled next"
    rows = [("the model's logits", raw)]
    if processed is not None:
        rows.append(("its logits after temperature, penalties and logit_bias", processed))
    for where, x in rows:
        for what, mask in (("NaN", torch.isnan(x)), ("+inf", torch.isposinf(x))):
            if bool(mask.any()):
                ids = mask.nonzero().squeeze(1)
                return SamplingError(f"{lead}: {where} are {what} at {len(ids)} of {vocab} tokens (token "
                                     f"{int(ids[0])} first); {end}", row)
    after = "" if processed is None else ", or after temperature, penalties and logit_bias"
    return SamplingError(f"{lead}: every token's logit is -inf (the model's logits{after}); {end}", row)


@torch.inference_mode()
def _run(logits: torch.Tensor, seqs: Sequence[SequenceSampler], draw: bool, want_probs: bool,
         fail_fast: bool = True) -> tuple[list[int], torch.Tensor | None, dict[int, SamplingError]]:
    """The whole vectorized step. ``draw``: each sampled row draws its race (``_race_uniforms``) and gets a token; else
    nothing is drawn (only ``want_probs``). Returns (tokens, probs, errors): ``errors`` maps the rows that have no
    token to sample to their :class:`SamplingError` (their tokens and probs are meaningless); ``fail_fast`` raises
    the first instead.

    Rows are laid out by kind (greedy, unfiltered, then filtered by first candidate width, top-p-without-top-k
    first) in one working copy, so every kind is a contiguous slice: no per-kind copies of [rows, vocab].
    """
    _check(logits, seqs)
    bsz, vocab = logits.shape
    raw = logits.detach().to("cpu", torch.float32).contiguous()
    constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if constrained:
        # a structured output's forbidden tokens are -inf before bias, penalties and filters see the row (a copy: the
        # caller's logits stay the raw distribution its logprobs are of); the batch's other rows are untouched
        raw = _workspace("masked", bsz, vocab).copy_(raw)  # reused: a fresh copy each step costs page faults
    tokens = [0] * bsz
    probs = torch.zeros(bsz, vocab) if want_probs else None
    errors: dict[int, SamplingError] = {}
    for i in constrained:
        state = seqs[i].grammar
        state.mask_(raw[i])
        reason = state.error  # a limit hit computing the mask, or the grammar's CPU budget spent: cut short
        if reason is not None:
            errors[i] = _grammar_failure(seqs[i], reason, i)
            if fail_fast:  # (before any generator advances)
                raise errors[i]
            raw[i] = 0.0  # finite: sampled with the batch, its token dropped
    if bsz == 0:
        return tokens, probs, errors

    filt = [_filters(s, vocab) for s in seqs]
    greedy = [i for i, s in enumerate(seqs) if s.greedy]
    plain = [i for i, s in enumerate(seqs) if not s.greedy and not filt[i]]
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        if filt[i]:
            groups.setdefault(_first_width(_k_eff(s.params.top_k, vocab), vocab), []).append(i)
    for members in groups.values():  # top-p rows without top-k first: they need the full normalizer
        members.sort(key=lambda i: not (seqs[i].params.top_p < 1.0 and _k_eff(seqs[i].params.top_k, vocab) == 0))
    order = greedy + plain + [i for kk in sorted(groups) for i in groups[kk]]
    slot = [0] * bsz
    for j, i in enumerate(order):
        slot[i] = j
    temps = [seqs[i].temperature for i in order]
    any_temp = any(t != 1.0 for t in temps)

    # 1. Penalties and bias, sparse: one gather, a few elementwise ops and one scatter over all rows' entries.
    pen_rows = [i for i in order if seqs[i]._n]
    src = dst = vals = None
    if pen_rows:
        parts = [seqs[i]._entries(vocab) for i in pen_rows]
        lens = np.fromiter((len(p[0]) for p in parts), np.int64, len(parts))
        if lens.sum():
            ids = np.concatenate([p[0] for p in parts])
            src = torch.from_numpy(ids + np.repeat(np.asarray(pen_rows, np.int64) * vocab, lens))
            dst = torch.from_numpy(ids + np.repeat(np.asarray([slot[i] for i in pen_rows], np.int64) * vocab, lens))
            vals = raw.view(-1).index_select(0, src)
            if any(seqs[i]._has_bias for i in pen_rows):
                vals = vals + torch.from_numpy(np.concatenate([p[1] for p in parts]))
            if any(seqs[i]._rep_on for i in pen_rows):
                repf = torch.from_numpy(np.concatenate([p[2] for p in parts]))
                vals = torch.where(vals < 0, vals * repf, vals / repf)
            if any(seqs[i]._pf_on for i in pen_rows):
                vals = vals - torch.from_numpy(np.concatenate([p[3] for p in parts]))
            if any_temp:
                tidx = np.repeat(np.asarray([seqs[i].temperature for i in pen_rows], np.float32), lens)
                vals = vals / torch.from_numpy(tidx)

    # 2. The working copy in kind order; temperature (bitwise as transformers' ``scores / temperature``), then the
    #    penalized entries on top.
    identity = order == list(range(bsz))
    if identity and not any_temp and dst is None:
        work, owned = raw, False
    else:
        work, owned = _workspace("work", bsz, vocab), True
        if any_temp:  # row by row: the row stays in cache between the read and the division
            for j, i in enumerate(order):
                if temps[j] != 1.0:
                    torch.div(raw[i], temps[j], out=work[j])
                else:
                    work[j].copy_(raw[i])
        elif identity:
            work.copy_(raw)
        else:
            torch.index_select(raw, 0, torch.tensor(order, dtype=torch.long), out=work)
        if dst is not None:
            work.view(-1).index_copy_(0, dst, vals)

    # Rows with no token to sample (NaN or +inf, or all -inf): an error each; with ``fail_fast`` the first is raised
    # before any generator advances, else the row is zeroed so the batch goes on, and its token is dropped.
    top = torch.from_numpy(work.numpy().max(axis=1))  # NaN propagates; numpy's is ~3x torch's amax on a CPU row
    bad_slots = (~torch.isfinite(top)).nonzero().squeeze(1).tolist()
    if bad_slots:
        for j in bad_slots:
            errors[order[j]] = _row_error(raw[order[j]], work[j], order[j], masked=seqs[order[j]].grammar is not None)
        if fail_fast:
            raise errors[order[bad_slots[0]]]
        if not owned:  # ``work`` is ``raw``, which may be the caller's own tensor
            work, owned = _workspace("work", bsz, vocab), True
            work.copy_(raw)
        work[bad_slots] = 0.0
        top[bad_slots] = 0.0

    noise = _race_uniforms(seqs, order[len(greedy):], vocab) if draw and len(greedy) < bsz else None

    # 3. Greedy rows: the first maximal index.
    at = 0
    if greedy:
        am = _argmax(work[:len(greedy)]).tolist()
        for i, t in zip(greedy, am):
            tokens[i] = t
        if probs is not None:
            probs[greedy, am] = 1.0
        at = len(greedy)

    # 4. Unfiltered sampled rows: the race over the whole vocabulary (no softmax needed).
    if plain:
        wp = work[at:at + len(plain)]
        at += len(plain)
        if probs is not None:
            probs[plain] = torch.softmax(wp, dim=1)
        if noise is not None:
            scores = _centered(wp, top[at - len(plain):at].unsqueeze(1), out=wp if owned else None)
            for i, t in zip(plain, _race(scores, _log_e_(noise[:len(plain)]), out=scores).tolist()):
                tokens[i] = t

    # 5. Filtered rows: candidates by topk; rows the first width cannot decide exactly are sized and retried.
    for kk0 in sorted(groups):
        rows = groups[kk0]
        wg = work[at:at + len(rows)]
        ng = noise[at - len(greedy):at - len(greedy) + len(rows)] if noise is not None else None
        at += len(rows)
        ks = torch.tensor([_k_eff(seqs[i].params.top_k, vocab) for i in rows], dtype=torch.long)
        tp = torch.tensor([seqs[i].params.top_p for i in rows], dtype=torch.float64)
        mp = torch.tensor([seqs[i].params.min_p for i in rows], dtype=torch.float64)
        n_need = int(((tp < 1.0) & (ks == 0)).sum())  # these rows come first in the group
        s_full = torch.zeros(len(rows))
        pending = [(kk0, torch.arange(len(rows)), 0)]  # (width, rows of the group, attempt)
        while pending:
            kk, idx, attempt = pending.pop(0)
            sub = wg if len(idx) == len(rows) else wg.index_select(0, idx)
            cv, ci = _candidates(sub, kk)
            if attempt == 0 and n_need:  # the full normalizers, with the row max from topk
                e = torch.sub(wg[:n_need], cv[:n_need, :1], out=_workspace("scratch", n_need, vocab)).exp_()
                s_full[:n_need] = _row_sum(e)
            wk, valid = _filter_sorted(cv, ks[idx], tp[idx], mp[idx], s_full[idx], vocab)
            ok = valid.nonzero().squeeze(1)
            if len(ok):
                rws = [rows[j] for j in idx[ok].tolist()]
                wok, cok = (wk, ci) if len(ok) == len(idx) else (wk[ok], ci[ok])
                if probs is not None:
                    dist = torch.zeros(len(rws), vocab)
                    dist.scatter_(1, cok, wok / wok.sum(dim=1, keepdim=True))
                    probs[rws] = dist
                if ng is not None:  # the race over the kept candidates, each with its own token's draw
                    cvk = cv if len(ok) == len(idx) else cv[ok]
                    scores = torch.where(wok > 0, _centered(cvk, cvk[:, :1]), _NEG_INF)  # sorted: [:, 0] the max
                    log_e = _log_e_(torch.take(ng, idx[ok].unsqueeze(1) * vocab + cok))  # kept candidates'
                    pos = _race(scores, log_e, out=scores)
                    for i, t in zip(rws, cok.gather(1, pos.unsqueeze(1)).squeeze(1).tolist()):
                        tokens[i] = t
            if len(ok) < len(idx):
                bad = (~valid).nonzero().squeeze(1)
                if attempt == 0:
                    bi = idx[bad]
                    sizes = _sizes(sub[bad], cv[bad], ks[bi], tp[bi], mp[bi], s_full[bi])
                    nxt: dict[int, list[int]] = {}
                    for b, n in zip(bad.tolist(), sizes.tolist()):
                        nxt.setdefault(_width_for(max(n + 1, 2 * kk), vocab), []).append(b)
                    pending += [(wd, idx[torch.tensor(b)], 1) for wd, b in sorted(nxt.items())]
                else:  # the bound fell short (rounding, or ties at the boundary): the full sort decides
                    pending.append((vocab, idx[bad], 2))
    return tokens, probs, errors


def sample_batch(logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> list[TokenChoice]:
    """Sample one token for every row of ``logits`` [B, vocab] (row i belongs to ``seqs[i]``) in one vectorized pass.

    Rows may mix greedy and sampled, filtered and unfiltered parameters. Every sampled row draws one vector of
    vocab uniforms from its own generator, E_i = -log(u_i) ~ Exp(1) per token id, and takes the token that wins the
    exponential race over its filtered distribution p: argmax p_i / E_i (Gumbel-max; token i wins with probability
    p_i). So a seeded sequence yields the same tokens whatever shares its batch and at whatever position, and the
    float noise of a batched LM head (~1e-5 in a logit) changes a draw only when two front-runners are that close
    (an inverse CDF over the vocabulary moved ~49k boundaries: 0.1-0.4 % of seeded draws changed with the batch
    size). Greedy rows draw nothing and take the first maximal index. Filtering is exact (the kept set and its
    normalized probabilities equal transformers' warpers, see ``_filter_sorted`` for tie rules) and sorts a full
    vocabulary row only when the kept set covers most of it (topk candidates otherwise).

    A row whose sequence has a structured output (``seq.grammar``) is first masked to the tokens its grammar allows
    (forbidden ones -inf), before bias, penalties, temperature and filtering; the other rows are sampled bit for bit
    as without it.

    Logprobs (rows with ``params.logprobs is not None``) are of the RAW model distribution, log_softmax of the
    unprocessed logits (vLLM v1's default "raw logprobs"): before the grammar's mask, bias, penalties, temperature
    and filtering; -inf is shown as :data:`MIN_LOGPROB`.
    The penalty state is not advanced: call ``seqs[i].append(choice.token)`` for each emitted token. Logits on
    another device are sampled on the CPU.

    A row with no token to sample (NaN or +inf logits, or all -inf) raises its :class:`SamplingError` before any
    generator advances; :func:`sample_rows` fails such rows alone.
    """
    return _sample(logits, seqs, fail_fast=True)  # type: ignore[return-value]  # (raised: no errors in the list)


def sample_rows(logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> list[TokenChoice | SamplingError]:
    """:func:`sample_batch` for a batch of independent requests: a row with no token to sample (NaN or +inf
    logits, or all -inf) gets its :class:`SamplingError` in its place, for the caller to fail that row's request
    with, and every other row is sampled exactly as :func:`sample_batch` samples it (same draws, same tokens)."""
    return _sample(logits, seqs, fail_fast=False)


def _sample(logits: torch.Tensor, seqs: Sequence[SequenceSampler], fail_fast: bool
            ) -> list[TokenChoice | SamplingError]:
    tokens, _, errors = _run(logits, seqs, True, want_probs=False, fail_fast=fail_fast)
    out: list[TokenChoice | SamplingError] = [errors.get(i) or TokenChoice(t) for i, t in enumerate(tokens)]
    lp_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and i not in errors]
    if not lp_rows:
        return out
    with torch.inference_mode():
        lsm = torch.log_softmax(_rows(logits.detach().to("cpu", torch.float32), lp_rows), dim=1)
        chosen = _shown_logprobs(lsm.gather(1, torch.tensor([[tokens[i]] for i in lp_rows])).squeeze(1))
        kmax = max(seqs[i].params.logprobs for i in lp_rows)
        if kmax:
            tv, ti = torch.topk(lsm, min(kmax, lsm.shape[1]), dim=1)
            tv, ti = _shown_logprobs(tv), ti.tolist()
        for j, i in enumerate(lp_rows):
            k = seqs[i].params.logprobs
            top = list(zip(ti[j][:k], tv[j][:k])) if k else []
            out[i] = TokenChoice(tokens[i], chosen[j], top)
    return out


def _shown_logprobs(values: torch.Tensor) -> list:
    """``values`` as a (nested) list of floats with -inf as :data:`MIN_LOGPROB` (vLLM's): a token the raw model
    rules out (with a structured output it may still be the one sampled), or one of fewer finite alternatives than
    ``top_logprobs`` asked for, broke the JSON body."""
    return values.clamp(min=MIN_LOGPROB).tolist()


def verify_drafts(logits: torch.Tensor, seq: SequenceSampler, draft: Sequence[int]) -> list[TokenChoice]:
    """Speculative decoding's verification of ``draft`` for one sequence: ``logits`` [len(draft) + 1, vocab] are the
    model's at the positions that end with each draft token's predecessor (row j predicts what follows
    ``draft[:j]``). Returns the tokens to emit: the accepted drafts, then one more (the model's own token where a
    draft was rejected, else the bonus token from the last row). Advances ``seq`` by every returned token.

    Each row is sampled exactly as plain decoding samples it (``sample_batch``: greedy's choice, or the exponential
    race of one vector of draws from the sequence's generator over the processed distribution) and a draft is kept
    iff it is the race's winner. For a draft that is one token with certainty (prompt lookup's, a greedy draft
    model's) this is the speculative-sampling rule coupled to plain sampling's draws: a draft is kept with
    probability p(draft) (Leviathan et al. 2023's min(1, p/q) with q = 1) and a rejected position emits the
    winner among the other tokens, a draw from p without the draft, so each token has p's distribution; and since
    every emitted token consumes exactly the one draw vector plain decoding would, a seeded request gives the same
    tokens with or without speculation (up to the float differences between a verification pass's logits and a
    single step's, which change a draw only where two front-runners are within them).

    With a structured output, row j is masked by the grammar's state after the tokens emitted before it (each is
    consumed as it is appended), so a draft token the grammar forbids can never be the winner: it is rejected, and
    the grammar never consumes a draft verification did not keep (nothing to roll back)."""
    if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"need logits [{len(draft) + 1}, vocab] for {len(draft)} draft tokens, got "
                         f"{tuple(logits.shape)}")
    out: list[TokenChoice] = []
    for j in range(len(draft) + 1):
        choice = sample_batch(logits[j:j + 1], [seq])[0]
        seq.append(choice.token)
        out.append(choice)
        if j < len(draft) and choice.token != int(draft[j]):
            break
    return out


def _filtered_probs(logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> torch.Tensor:
    """Per-row distribution ``sample_batch`` draws from [B, vocab] (greedy rows: one-hot); for tests. No draws."""
    return _run(logits, seqs, False, want_probs=True)[1]  # (a row with no token to sample raises)


def prompt_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenChoice | None]:
    """Raw logprobs of a prompt (``echo`` + logprobs): row i of ``logits`` [n, vocab] scores ``token_ids[i + 1]``;
    the first token has no context to be scored by, so it gets None. Needs n >= len(token_ids) - 1.

    A scored row of NaN or +inf logits, or all -inf, has no distribution: its :class:`SamplingError` (500
    ``invalid_logits``) is raised, as sampling from it does (its logprobs were NaN, which a JSON body cannot hold:
    a 500 "internal error", or a stream of invalid JSON)."""
    n = len(token_ids)
    if n == 0:
        return []
    if logits.dim() != 2 or logits.shape[0] < n - 1:
        raise ValueError(f"need logits [>= {n - 1}, vocab] for {n} prompt tokens, got {tuple(logits.shape)}")
    out: list[TokenChoice | None] = [None]
    if n == 1:
        return out
    with torch.inference_mode():
        lsm = torch.log_softmax(logits.detach()[: n - 1].to("cpu", torch.float32), dim=1)
        nxt = torch.tensor(list(token_ids[1:]), dtype=torch.long)
        chosen = _shown_logprobs(lsm.gather(1, nxt.unsqueeze(1)).squeeze(1))  # NaN stays NaN: checked below
        # log_softmax makes such a row NaN throughout (its max or sum is NaN), and no other row NaN anywhere
        bad = next((j for j, v in enumerate(chosen) if math.isnan(v)), None)
        if bad is not None:
            row = logits.detach()[bad].to("cpu", torch.float32)
            raise _row_error(row, None, bad, lead=f"the prompt cannot be scored (echo with logprobs) at its token "
                             f"{bad + 1} (counted from 0)", end="the request was stopped")
        if k > 0:
            tv, ti = torch.topk(lsm, min(k, lsm.shape[1]), dim=1)
            tv, ti = _shown_logprobs(tv), ti.tolist()
    for j in range(n - 1):
        top = list(zip(ti[j], tv[j])) if k > 0 else []
        out.append(TokenChoice(int(token_ids[j + 1]), chosen[j], top))
    return out


MAX_PENDING_TOKENS = 2 * MAX_CHARACTER_BYTES  # a whole character spans fewer tokens: a longer wait is stray bytes


def _failure_links(s: str) -> list[int]:
    """KMP's: ``links[k]`` is the longest proper prefix of ``s[:k]`` that ``s[:k]`` also ends with."""
    links = [0] * (len(s) + 1)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = links[k]
        if s[i] == s[k]:
            k += 1
        links[i + 1] = k
    return links


_SILENT: "weakref.WeakKeyDictionary[Any, frozenset[int]]" = weakref.WeakKeyDictionary()


def silent_tokens(tokenizer) -> frozenset[int]:
    """Special tokens that decoding drops wherever they are (skip_special_tokens): they add no text, so the
    incremental decoder leaves them out of its window (a run of them, e.g. end-of-text after end-of-text with
    ``ignore_eos``, was decoded again at every token)."""
    try:
        return _SILENT[tokenizer]
    except (KeyError, TypeError):
        pass
    # added tokens marked special are skipped too, though not all are in all_special_ids (SmolLM2's <file_sep>, ...)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidates = {*(getattr(tokenizer, "all_special_ids", None) or ()),
                  *(t for t, tok in added.items() if getattr(tok, "special", False))}
    ids = frozenset(int(t) for t in candidates if tokenizer.decode([int(t)], skip_special_tokens=True) == "")
    try:
        _SILENT[tokenizer] = ids
    except TypeError:  # not weakly referenceable: computed per matcher
        pass
    return ids


class StopMatcher:
    """Incremental detokenization with stop strings.

    ``feed`` returns the text that is safe to emit now: text that could still become the start of a
    stop string is held back until it cannot, so a stream never shows part of a stop string.

    A context (``prompt_ids``) that ends inside a character leaves that character to the generated text: the tokens
    that complete it show it whole (the prompt's part of it had decoded to U+FFFD, which took its place, so the
    character was lost), and ``whole_text(prompt) + text`` is the decoding of prompt and generated tokens together.

    ``unless``: the stop strings do not apply to a text that starts with it (a tool call's marker; "": to any text).
    While the text may still become it, it is held back; once it cannot, the stop strings apply from its start.
    """

    def __init__(self, tokenizer, stop: list[str], prompt_ids: list[int] | None = None, unless: str | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s] if unless != "" else []
        self._unless = unless if self.stop else None  # None once decided (or nothing to decide)
        # per stop: KMP failure links and the longest prefix of it the text ends with (the hold-back, updated per
        # new character: testing every prefix of 16 stops of 256 characters cost 0.3 ms a token)
        self._fail = [_failure_links(s) for s in self.stop]
        self._ends_with = [0] * len(self.stop)
        self._scanned = 0  # characters of ``text`` those counts have seen
        self._silent = silent_tokens(tokenizer)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.stopped = False
        self.text = ""
        # Incremental detokenization: only ids[prefix:] are decoded per token (the tokens before ``prefix``
        # are final text), so a long generation costs O(tokens), not O(tokens^2). The ids in
        # [prefix, read) give the decoder its context (leading spaces, merged bytes).
        self.prefix = 0
        self.read = 0
        self._head = ""  # what the token that starts the context's incomplete last character has before it (" ")
        if prompt_ids:
            # The last prompt tokens as the decoder's context: a SentencePiece tokenizer ("▁" word starts: Llama-2,
            # Mistral) drops the leading space of a sequence's first word, so the first generated word decoded
            # alone lost its space ('TRAN…' for ' TRAN…'); prompt + text now equals decoding the whole sequence.
            self.ids = context_tail(tokenizer, prompt_ids)
            self.read = len(self.ids)
            if self._decode(self.ids).endswith("\ufffd") and (cut := incomplete_end(tokenizer, self.ids)):
                # the tokens of the character the context ends inside of are read with the generated ones
                self.read, self._head = cut
                if not self._decode(self.ids).startswith(self._decode(self.ids[:self.read]) + self._head):
                    self._head = ""  # (a decoder whose text of that token is not its bytes: the token's text too)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> bool:
        """Append the newly decodable text to ``text``; False while the last bytes are incomplete."""
        before = self._decode(self.ids[self.prefix:self.read]) + self._head
        now = self._decode(self.ids[self.prefix:])
        # A trailing replacement char means an incomplete multi-byte sequence: wait for more tokens.
        if not final and (now.endswith("\ufffd") or len(now) <= len(before)):
            if now.endswith("\ufffd") and len(self.ids) - self.read > MAX_PENDING_TOKENS:
                return self._advance_within(before, now)
            return False
        self.text += now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self._head = ""
        return True

    def _advance_within(self, before: str, now: str) -> bool:
        """Bytes that are no character (a run of stray UTF-8 bytes) never end in a whole one: take the text up to a
        token at least 4 bytes back, where whatever character is cut is already resolved in ``now`` (its
        replacement char, or the character itself, which then is not cut). Without this every token of the run
        decoded the whole run again (quadratic) and a stream showed nothing until its end."""
        end = len(self.ids) - MAX_CHARACTER_BYTES
        for k in range(end, max(self.read, end - MAX_CHARACTER_BYTES), -1):
            part = self._decode(self.ids[self.prefix:k])
            if len(part) > len(before) and now.startswith(part):
                self.text += part[len(before):]
                self.prefix, self.read = self.read, k
                self._head = ""
                return True
        return False

    def feed(self, token_id: int) -> str:
        """Add one generated token; return newly emittable text (may be empty). Sets ``stopped``."""
        if self.stopped or token_id in self._silent:
            return ""
        self.ids.append(token_id)
        if not self._advance():
            return ""
        if self._unless is not None and not self._decide():
            return ""
        text = self.text
        if (out := self._cut_at_stop()) is not None:
            return out
        safe = len(text) - self._hold()
        if safe <= self.emitted:
            return ""
        out = text[self.emitted:safe]
        self.emitted = safe
        return out

    def _decide(self, final: bool = False) -> bool:
        """Whether the stop strings' exemption (``unless``) is decided: the text starts with it (no stop applies
        from here on) or cannot (they all do); ``final``: the text is whole, decided either way."""
        if self.text.startswith(self._unless):
            self.stop, self._fail, self._ends_with = [], [], []
        elif not final and self._unless.startswith(self.text):
            return False
        self._unless = None
        return True

    def _hold(self) -> int:
        """The longest end of ``text`` that is a proper prefix of a stop string (it may yet become one)."""
        for ch in self.text[self._scanned:]:
            for i, s in enumerate(self.stop):
                k, fail = self._ends_with[i], self._fail[i]
                while k and s[k] != ch:
                    k = fail[k]
                if s[k] == ch:
                    k += 1
                self._ends_with[i] = fail[k] if k == len(s) else k  # a whole stop is cut before this is asked
        self._scanned = len(self.text)
        return max(self._ends_with, default=0)

    def _cut_at_stop(self) -> str | None:
        """If :attr:`text` holds a stop string: cut it there, set ``stopped`` and return the text not yet emitted;
        else None. The earliest match wins, whatever the order of the stop list (the first stop listed that matched
        left an earlier one in the text when one token held both, e.g. ".\n")."""
        text = self.text
        found = [p for p in (text.find(s, max(0, self.emitted - len(s) + 1)) for s in self.stop) if p != -1]
        if not found:
            return None
        self.stopped = True
        self.text = text[:min(found)]
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out

    def feed_offsets(self, ids: Sequence[int]) -> list[int]:
        """Feed ``ids`` (no stop strings); where each starts in :attr:`text`, the whole characters decoded before it
        (a token inside an incomplete character starts where that character does): logprobs' ``text_offset``."""
        out = []
        for tok in ids:
            out.append(len(self.text))
            self.feed(int(tok))
        return out

    def flush(self) -> str:
        """Emit whatever is held back (generation ended without hitting a stop string). The text the last tokens
        held back as an incomplete character is searched too: a stop string it completes ends the text there (and
        sets ``stopped``)."""
        if self.stopped:
            return ""
        self._advance(final=True)
        if self._unless is not None:
            self._decide(final=True)
        if (out := self._cut_at_stop()) is not None:
            return out
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


_OPENING: "weakref.WeakKeyDictionary[Any, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def added_opening(tokenizer) -> tuple[int, ...]:
    """The tokens ``tokenizer`` puts before a text's own (``add_special_tokens``: a BOS), found once by tokenizing
    a word with and without them; () when it adds none there, or the two do not line up."""
    try:
        return _OPENING[tokenizer]
    except (KeyError, TypeError):
        pass
    with_added = list(tokenizer("a")["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    cut = next((k for k in range(len(with_added) - len(plain) + 1) if with_added[k:k + len(plain)] == plain), 0)
    opening = tuple(int(t) for t in with_added[:cut])
    try:
        _OPENING[tokenizer] = opening
    except TypeError:  # not weakly referenceable: found per call
        pass
    return opening


def offsets_in_text(tokenizer, ids: Sequence[int], text: str, *, special_added: bool = True) -> list[int]:
    """Where each of ``ids`` starts in ``text``, the text they were tokenized from (a prompt echoed as sent;
    ``special_added``: with the tokenizer's own special tokens, as the API tokenizes a prompt): logprobs'
    ``text_offset``. Decoding skips special tokens, but a prompt written with its chat markup
    (``<|im_start|>user…``) has their text in it: a special token takes its room where ``text`` has its text. The
    tokens the tokenizer adds before the text (a BOS, which ``text`` lacks) take none, though ``text`` starts with
    their text (``<s>hi`` is ``<s> <s> h i``: the second ``<s>`` is the text's). Offsets stay within ``text``."""
    silent = silent_tokens(tokenizer)
    opening = added_opening(tokenizer) if special_added else ()
    skip = len(opening) if tuple(ids[:len(opening)]) == opening else 0
    out, shift = [], 0
    for k, (tok, at) in enumerate(zip(ids, StopMatcher(tokenizer, []).feed_offsets(ids))):
        at = min(at + shift, len(text))
        out.append(at)
        if tok in silent and k >= skip:
            piece = tokenizer.convert_ids_to_tokens(int(tok))
            if isinstance(piece, str) and piece and text.startswith(piece, at):
                shift += len(piece)
    return out
