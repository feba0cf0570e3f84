"""Draft model for speculative decoding (``--speculative draft:MODEL``): a small causal LM with the chain model's
tokenizer, run at the orchestrator, proposes the next k tokens greedily; the chain verifies them in one step.

``MODEL`` is a registry name, a path (GGUF or HF directory) or ``self`` (the served model itself); with
``--draft-layers N`` only its first N decoder layers run, before the final norm and LM head (self-speculative
drafting: no second model needed, same tokenizer by construction). Drafts are greedy, so the draft distribution
is a point mass and the verification rule of :func:`~petals_chain.orchestrator.sampling.verify_drafts` keeps a
sampled request's distribution exact.

Each generation keeps a :class:`DraftState` (the draft model's KV cache and the tokens it holds): a draft call
rolls the cache back to what it shares with the sequence now (rejected drafts are dropped) and feeds only the
rest. The model runs in its own worker thread, off the event loop, one call at a time. Drafts are only guesses:
a draft model that fails (an error, out of memory) stops drafting for that generation, which goes on without
drafts (the output is the same), instead of failing the request. So does a call that takes longer than
:attr:`DraftModel.timeout_s` (a hung or far too slow draft model): a thread cannot be stopped, so until that call
ends in the worker every generation's draft is [] at once rather than queued behind it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import torch

from petals_chain.orchestrator.failover import common_prefix
from petals_chain.swarm.checkpoint import cache_kwarg

logger = logging.getLogger(__name__)

# Seconds a draft call may take, its wait behind other generations' calls included: far above a small draft model's
# k tokens (and a first call's prompt) on a CPU, far below a stall anyone would wait out
DRAFT_TIMEOUT_S = 10.0


class DraftState:
    """One generation's draft KV cache and the tokens it holds."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.ids: list[int] = []
        self.failed = False  # the draft model failed for this generation: no more drafts


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
        self._stuck: concurrent.futures.Future | None = None  # a call that timed out, still running in the worker

    @classmethod
    def load(cls, source: Any, name: str, num_layers: int | None = None, dtype: Any = None,
             device: str = "cpu") -> "DraftModel":
        from petals_chain.swarm.checkpoint import load_causal_lm

        model = load_causal_lm(source, num_layers=num_layers, dtype=dtype, device=device)
        return cls(model, name)

    async def draft(self, state: DraftState, context: list[int], k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``context`` (the whole sequence so far); [] from the first failure of
        the draft model on, or its first call past :attr:`timeout_s` (logged, counted in :attr:`failures`), and []
        while such a call still runs in the worker."""
        if k <= 0 or not context or state.failed:
            return []
        if self._stuck is not None:
            if not self._stuck.done():
                return []  # the worker is still busy with a call that timed out: queueing would wait for it
            self._stuck = None
        call = self._pool.submit(self._draft, state, list(context), k)
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: it can swallow our cancellation
                return await asyncio.wrap_future(call)
        except TimeoutError:
            if call.cancel():  # still queued behind another generation's call (which its own timeout marks)
                return []
            if not call.done():
                self._stuck = call
            self._give_up(state, f"no draft within {self.timeout_s} s")
            return []
        except Exception as e:  # noqa: BLE001 - a draft is a guess: its model failing must not fail the request
            self._give_up(state, f"{type(e).__name__}: {e}")
            return []

    def _give_up(self, state: DraftState, why: str) -> None:
        """No more drafts for the generation of ``state``."""
        state.failed, state.cache, state.ids = True, None, []  # a cache a failed call left half-updated
        self.failures += 1
        logger.warning("draft model %s failed (%s); this generation goes on without drafts", self.name, why)

    def _draft(self, state: DraftState, context: list[int], k: int) -> list[int]:
        from transformers import DynamicCache

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
                logits = self.model(input_ids=torch.tensor([feed], device=device), use_cache=True,
                                    **{self._cache_arg: state.cache}).logits[0, -1]
                state.ids += feed
                tok = int(torch.argmax(logits))
                out.append(tok)
                feed = [tok]
            return out  # the cache holds context + out[:-1]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
