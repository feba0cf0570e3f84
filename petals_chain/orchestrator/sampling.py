"""Token sampling at the orchestrator: transformers' logits processors, seeds, EOS and stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Per-request sampler: holds the processors and the request's own RNG (so a seed reproduces output
    regardless of what other requests run concurrently, and a failover replay does not resample)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        procs = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        if not params.greedy:
            if params.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                procs.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                procs.append(TopPLogitsWarper(params.top_p))
        self.processors = procs
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(int(params.seed))
        else:
            self.generator.seed()

    def next_token(self, logits: torch.Tensor, context_ids: list[int]) -> int:
        """Choose the next token from ``logits`` [vocab] given all tokens so far (for the penalty)."""
        scores = logits.detach().float().reshape(1, -1)
        if len(self.processors):
            ids = torch.tensor([context_ids], dtype=torch.long)
            scores = self.processors(ids, scores)
        if self.params.greedy:
            return int(torch.argmax(scores, dim=-1).item())
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


class StopMatcher:
    """Incremental detokenization with stop strings.

    ``feed`` returns the text that is safe to emit now: text that could still become the start of a
    stop string is held back until it cannot, so a stream never shows part of a stop string.
    """

    def __init__(self, tokenizer, stop: list[str], prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.stopped = False
        self.text = ""
        # Incremental detokenization: only ids[prefix:] are decoded per token (the tokens before ``prefix``
        # are final text), so a long generation costs O(tokens), not O(tokens^2). The ids in
        # [prefix, read) give the decoder its context (leading spaces, merged bytes).
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> bool:
        """Append the newly decodable text to ``text``; False while the last bytes are incomplete."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        # A trailing replacement char means an incomplete multi-byte sequence: wait for more tokens.
        if not final and (now.endswith("\ufffd") or len(now) <= len(before)):
            return False
        self.text += now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return True

    def feed(self, token_id: int) -> str:
        """Add one generated token; return newly emittable text (may be empty). Sets ``stopped``."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        if not self._advance():
            return ""
        text = self.text
        for s in self.stop:
            pos = text.find(s, max(0, self.emitted - len(s) + 1))
            if pos != -1:
                self.stopped = True
                self.text = text[:pos]
                out = self.text[self.emitted:]
                self.emitted = len(self.text)
                return out
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = len(text) - hold
        if safe <= self.emitted:
            return ""
        out = text[self.emitted:safe]
        self.emitted = safe
        return out

    def flush(self) -> str:
        """Emit whatever is held back (generation ended without hitting a stop string)."""
        if self.stopped:
            return ""
        self._advance(final=True)
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
