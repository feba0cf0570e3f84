"""Speculative decoding's draft side, as pure policy: prompt-lookup n-gram drafts and the draft length k.

The orchestrator drafts ``k`` tokens, sends them with the token just sampled through the chain as one step
(one round trip over every hop instead of ``k + 1``), and keeps the drafts the model's own choices confirm
(``orchestrator/sampling.verify_drafts``). Prompt lookup (Saxena 2023, as in transformers'
``prompt_lookup_num_tokens`` and vLLM's ``ngram`` speculator) needs no draft model: the text being generated
often repeats spans of the prompt (summaries, edits, code, quoting), so the tokens that followed the last
n-gram's latest earlier occurrence are a good guess for what follows now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DEFAULT_MAX_NGRAM = 3  # longest suffix looked up (tokens); longer matches are tried first
DEFAULT_K = 4  # draft tokens per pass at the start
MAX_K = 16  # longest draft: a rejected long draft costs the chain compute for nothing


def ngram_draft(tokens: Sequence[int], k: int, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``tokens`` (of
    ``max_ngram`` down to ``min_ngram`` tokens) that occurred before; [] when none did."""
    n_tok = len(tokens)
    if k <= 0 or n_tok < 2:
        return []
    seq = list(tokens)
    for n in range(min(max_ngram, n_tok - 1), max(1, min_ngram) - 1, -1):
        suffix = seq[-n:]
        # latest occurrence that ends before the suffix itself does, so that something follows it
        for start in range(n_tok - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                draft = seq[start + n:start + n + k]
                if draft:
                    return draft
    return []


@dataclass
class DraftLength:
    """The draft length ``k``, adapted to acceptance like transformers' assisted generation ("heuristic"
    schedule): +2 after a pass that accepted every draft, -1 after one that rejected some, within [1, max_k]."""

    k: int = DEFAULT_K
    max_k: int = MAX_K
    passes: int = 0
    drafted: int = 0
    accepted: int = 0

    def update(self, drafted: int, accepted: int) -> None:
        """A verification pass proposed ``drafted`` tokens and ``accepted`` of them were kept."""
        if drafted <= 0:
            return
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in [0, {drafted}], got {accepted}")
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.k = min(self.max_k, self.k + 2) if accepted == drafted else max(1, self.k - 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens so far (0 before any pass)."""
        return self.accepted / self.drafted if self.drafted else 0.0
