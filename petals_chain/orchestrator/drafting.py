"""Draft model for speculative decoding (``--speculative draft:MODEL``): a small causal LM with the chain model's
tokenizer, run at the orchestrator, proposes the next k tokens greedily; the chain verifies them in one step.

``MODEL`` is a registry name, a path (GGUF or HF directory) or ``self`` (the served model itself); with
``--draft-layers N`` only its first N decoder layers run, before the final norm and LM head (self-speculative
drafting: no second model needed, same tokenizer by construction). Drafts are greedy, so the draft distribution
is a point mass and the verification rule of :func:`~petals_chain.orchestrator.sampling.verify_drafts` keeps a
sampled request's distribution exact.

A generation under a structured output drafts under its grammar (``grammar``: a fork of its state): each draft
token is the draft model's most likely one among those the grammar allows next, so a draft is never cut where the
grammar would refuse it (unconstrained, the draft model's choice was mostly a token the grammar refused, and the
draft ended there). Greedy verification keeps the output the same either way.

Each generation keeps a :class:`DraftState` (the draft model's KV cache and the tokens it holds): a draft call
rolls the cache back to what it shares with the sequence now (rejected drafts are dropped) and feeds only the
rest. The model runs in its own worker thread, off the event loop, one call at a time. Drafts are only guesses:
a draft model that fails (an error, out of memory) stops drafting for that generation, which goes on without
drafts (the output is the same), instead of failing the request. So does a call whose model finishes no forward
within :attr:`DraftModel.timeout_s` (a hung draft model; a long feed runs in pieces of ``DRAFT_CHUNK_TOKENS``, so a
slow model's long prompt is not taken for it): a thread cannot be stopped, so until that call ends in the worker
every generation's draft is [] at once rather than queued behind it. A call still queued after ``timeout_s`` (the
worker busy with other generations' calls) is dropped: that step goes without a draft, the generation drafts on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import torch

from petals_chain.orchestrator.failover import common_prefix
from petals_chain.swarm.checkpoint import cache_kwarg

logger = logging.getLogger(__name__)

# Seconds a running draft call may go without finishing a forward (of one token, or of a prompt's piece), and a
# queued one may wait for the worker: far above a small draft model's forward on a CPU, far below a stall anyone
# would wait out. Not a bound on the whole call: a first call feeds the whole prompt (SmolLM2-135M took 31 s for
# 2k tokens on a loaded 2-core CPU)
DRAFT_TIMEOUT_S = 10.0
DRAFT_CHUNK_TOKENS = 128  # a longer feed (a prompt) runs as forwards of this many tokens


class DraftState:
    """One generation's draft KV cache and the tokens it holds."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.ids: list[int] = []
        self.failed = False  # the draft model failed for this generation: no more drafts


class _Allowed:
    """A draft's own state of its sequence's grammar (a fork): :meth:`pick` is the draft model's choice among the
    tokens the grammar allows next, taken into that state."""

    def __init__(self, state: Any):
        self.state = state
        self.ended = False  # the last token picked ends the output

    def pick(self, logits: torch.Tensor) -> int:
        """The most likely allowed token, taken (-1: none, or the grammar cannot go on)."""
        st = self.state
        if st.error is not None:
            return -1
        mask = torch.from_numpy(st.allowed())
        n = min(len(mask), logits.shape[-1])
        if st.error is not None or not bool(mask[:n].any()):
            return -1
        tok = int(torch.argmax(logits[:n].float().masked_fill(~mask[:n].to(logits.device), float("-inf"))))
        try:
            st.consume(tok)
        except ValueError:
            return -1
        self.ended = tok in st.grammar.eos
        return tok


class DraftModel:
    """A causal LM that drafts tokens greedily for speculative decoding (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, name: str, timeout_s: float = DRAFT_TIMEOUT_S):
        self.model = model
        self.name = name
        self.layers = int(model.config.num_hidden_layers)
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self._cache_arg = cache_kwarg(model)
        self.failures = 0  # generations whose drafting failed or timed out (they went on without drafts)
        self.constrained = True  # drafts under a structured output's grammar (False: as before; benchmarks compare)
        self._stuck: concurrent.futures.Future | None = None  # a call that timed out, still running in the worker
        self._progress = 0.0  # time.monotonic() when the worker last started a call or finished a forward

    @classmethod
    def load(cls, source: Any, name: str, num_layers: int | None = None, dtype: Any = None,
             device: str = "cpu") -> "DraftModel":
        from petals_chain.swarm.checkpoint import load_causal_lm

        model = load_causal_lm(source, num_layers=num_layers, dtype=dtype, device=device)
        return cls(model, name)

    async def draft(self, state: DraftState, context: list[int], k: int, grammar: Any = None) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``context`` (the whole sequence so far); [] from the first failure of
        the draft model on, or its first call that finished no forward within :attr:`timeout_s` (logged, counted in
        :attr:`failures`); [] while such a call still runs in the worker, and for a call the worker did not start
        within :attr:`timeout_s`. ``grammar``: the sequence's structured output state (structured.GrammarState): the
        draft takes only tokens it allows (in a fork of it; the CPU is charged to it)."""
        if k <= 0 or not context or state.failed:
            return []
        if grammar is None or not self.constrained:
            return await self._call(state, context, k, None)
        twin = grammar.fork()
        try:
            return await self._call(state, context, k, _Allowed(twin))
        finally:
            grammar.join(twin)

    async def _call(self, state: DraftState, context: list[int], k: int, allowed: "_Allowed | None") -> list[int]:
        """:meth:`draft` in the worker, within :attr:`timeout_s`."""
        if self._stuck is not None:
            if not self._stuck.done():
                return []  # the worker is still busy with a call that timed out: queueing would wait for it
            self._stuck = None
        submitted = time.monotonic()
        call = self._pool.submit(self._draft, state, list(context), k, allowed)
        waiting = asyncio.wrap_future(call)
        try:
            while not call.done():
                now = time.monotonic()
                if not call.running():  # queued behind other generations' calls
                    if now - submitted >= self.timeout_s:
                        if call.cancel():
                            return []  # no draft this step (the worker is busy): not this generation's fault
                        continue  # it has just started
                    left = submitted + self.timeout_s - now
                else:
                    left = max(submitted, self._progress) + self.timeout_s - now
                    if left <= 0:
                        break  # no forward finished for timeout_s: hung (a slow model finishes its pieces)
                # not asyncio.timeout around the call: a long prompt's legit first call would pass any fixed bound
                await asyncio.wait([waiting], timeout=left)
            else:
                return call.result()
        except asyncio.CancelledError:
            waiting.cancel()  # the generation is gone: a queued call never runs (a running one ends in the worker)
            raise
        except Exception as e:  # noqa: BLE001 - a draft is a guess: its model failing must not fail the request
            self._give_up(state, f"{type(e).__name__}: {e}")
            return []
        waiting.cancel()  # its result, whenever it comes, is not awaited
        self._stuck = call
        self._give_up(state, f"no forward finished within {self.timeout_s} s")
        return []

    def _give_up(self, state: DraftState, why: str) -> None:
        """No more drafts for the generation of ``state``."""
        state.failed, state.cache, state.ids = True, None, []  # a cache a failed call left half-updated
        self.failures += 1
        logger.warning("draft model %s failed (%s); this generation goes on without drafts", self.name, why)

    def _draft(self, state: DraftState, context: list[int], k: int, allowed: "_Allowed | None" = None) -> list[int]:
        from transformers import DynamicCache

        self._progress = time.monotonic()  # this call's start: its first piece is timed from here, not its queueing
        with torch.inference_mode():
            if state.cache is None:
                state.cache, state.ids = DynamicCache(config=self.model.config), []
                # a sliding-window layer past its window keeps only the window: rolling rejected drafts back (crop)
                # then needs the states it dropped (transformers raises otherwise)
                record = getattr(state.cache, "activate_past_recording", None)
                if record is not None:
                    record()
            keep = min(common_prefix(state.ids, context), len(context) - 1)  # the last token is always fed
            held = state.cache.get_seq_length()
            if held > keep:
                state.cache.crop(keep - held)  # a negative count: tokens removed from the end
            state.ids = state.ids[:keep]
            feed = context[keep:]
            out: list[int] = []
            device = self.model.device
            for _ in range(k):
                for i in range(0, len(feed), DRAFT_CHUNK_TOKENS):  # a long prompt in pieces: each one is progress
                    piece = feed[i:i + DRAFT_CHUNK_TOKENS]
                    logits = self.model(input_ids=torch.tensor([piece], device=device), use_cache=True,
                                        **{self._cache_arg: state.cache}).logits[0, -1]
                    state.ids += piece
                    self._progress = time.monotonic()
                tok = int(torch.argmax(logits)) if allowed is None else allowed.pick(logits)
                if tok < 0:
                    break  # nothing the grammar allows next (its output is complete, or its budget spent)
                out.append(tok)
                if allowed is not None and allowed.ended:
                    break  # an end token: nothing follows it
                feed = [tok]
            return out  # the cache holds context + out[:-1]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
