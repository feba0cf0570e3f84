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
drafts (the output is the same), instead of failing the request.
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


class DraftState:
    """One generation's draft KV cache and the tokens it holds."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.ids: list[int] = []
        self.failed = False  # the draft model failed for this generation: no more drafts


class DraftModel:
    """A causal LM that drafts tokens greedily for speculative decoding (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, name: str):
        self.model = model
        self.name = name
        self.layers = int(model.config.num_hidden_layers)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self._cache_arg = cache_kwarg(model)
        self.failures = 0  # generations whose drafting failed (they went on without drafts)

    @classmethod
    def load(cls, source: Any, name: str, num_layers: int | None = None, dtype: Any = None,
             device: str = "cpu") -> "DraftModel":
        from petals_chain.swarm.checkpoint import load_causal_lm

        model = load_causal_lm(source, num_layers=num_layers, dtype=dtype, device=device)
        return cls(model, name)

    async def draft(self, state: DraftState, context: list[int], k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``context`` (the whole sequence so far); [] from the first failure of
        the draft model on (logged, counted in :attr:`failures`)."""
        if k <= 0 or not context or state.failed:
            return []
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._draft, state, list(context), k)
        except Exception as e:  # noqa: BLE001 - a draft is a guess: its model failing must not fail the request
            state.failed, state.cache, state.ids = True, None, []  # a cache a failed call left half-updated
            self.failures += 1
            logger.warning("draft model %s failed (%s: %s); this generation goes on without drafts", self.name,
                           type(e).__name__, e)
            return []

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
