"""Chain capacity in a paged swarm: Eq. 3's cache reservation read as a token budget.

In the paper (Eq. 3) a server holding ``m_j`` blocks keeps ``M~_j = floor((M_j - s_m m_j) / s_c)`` cache slots,
each the KV of one block for one job at the swarm's ``max_length`` ``L_max``; a job whose chain runs ``m_ij``
of those blocks takes ``m_ij`` of them, and GCA (Alg. 2) gives each chain the jobs its hops' slots hold. With a
paged KV cache a job holds only the tokens it declares (its prompt plus ``max_tokens``), so the same memory is a
*token budget* of ``M~_j * L_max`` block-tokens, which holds ``floor(M~_j * L_max / L^)`` slots of the expected
job length ``L^`` (tokens): GCA, JFFC and the Theorem 3.7 bounds run unchanged on those slots. The placement
(GBP-CR with ``c``) keeps reserving ``c`` slots of ``L_max`` tokens, so every server still holds one job of any
admissible length and a paged swarm sits on the same blocks as a slot swarm.

``L^`` is the mean declared length of recent jobs, rounded up to whole pages (the unit servers reserve in). A
burst of long jobs can exceed a chain's budget: the server then makes the open wait (FIFO) until pages free up;
it never over-commits.
"""

from __future__ import annotations

import math
from collections import deque


def jobs_in_budget(budget_tokens: int, job_tokens: int) -> int:
    """Slots of ``job_tokens`` tokens that a budget of ``budget_tokens`` tokens holds (both per block, or both
    summed over a server's blocks)."""
    if job_tokens < 1:
        raise ValueError(f"job_tokens must be >= 1, got {job_tokens!r}")
    if budget_tokens < 0:
        raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens!r}")
    return int(budget_tokens) // int(job_tokens)


class JobTokenEstimate:
    """``L^``: the mean KV tokens a job reserves (its declared length), over the last ``window`` jobs, rounded up
    to ``granularity`` tokens (the page size) and clamped to ``[granularity, max_length]``.

    ``prior`` is used until ``min_jobs`` jobs were observed (default ``max_length``: a fresh orchestrator plans
    like a slot swarm until it has seen its traffic). :attr:`value` moves only when the running mean leaves a band
    of ``tolerance`` (relative) around it, so chain capacities are not recomputed for every job.
    """

    def __init__(self, max_length: int, *, prior: int | None = None, window: int = 256, min_jobs: int = 16,
                 granularity: int = 16, tolerance: float = 0.2):
        if max_length < 1 or granularity < 1 or window < 1 or min_jobs < 1 or not 0 <= tolerance < 1:
            raise ValueError("max_length, granularity, window and min_jobs must be >= 1 and 0 <= tolerance < 1")
        self.max_length, self.granularity, self.min_jobs, self.tolerance = (int(max_length), int(granularity),
                                                                             int(min_jobs), float(tolerance))
        self._recent: deque[int] = deque(maxlen=int(window))
        self._sum = 0
        self.observed = 0  # jobs seen since start
        self.value = self._round(max_length if prior is None else prior)

    def _round(self, tokens: float) -> int:
        g = self.granularity
        return max(g, min(self.max_length, int(math.ceil(tokens / g)) * g))

    @property
    def mean(self) -> float:
        """Mean declared length over the window (0 before any job)."""
        return self._sum / len(self._recent) if self._recent else 0.0

    def observe(self, tokens: int) -> bool:
        """A job declared ``tokens`` tokens; True if :attr:`value` changed."""
        t = max(1, min(int(tokens), self.max_length))
        if len(self._recent) == self._recent.maxlen:
            self._sum -= self._recent[0]
        self._recent.append(t)
        self._sum += t
        self.observed += 1
        if self.observed < self.min_jobs:
            return False
        # The band is around the running mean itself, not its page-rounded value: for short jobs one page is more
        # than the tolerance, and a mean hovering at a page boundary would flip L^ (and the chains) back and forth.
        mean = self.mean
        if abs(mean - self.value) > self.tolerance * self.value and self._round(mean) != self.value:
            self.value = self._round(mean)
            return True
        return False


__all__ = ["JobTokenEstimate", "jobs_in_budget"]
