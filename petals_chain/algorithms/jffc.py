"""JFFC: Join-the-Fastest-Free-Chain with one central queue (Alg. 3), as an event-driven state machine."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Sequence

from petals_chain.model import Chain


class FIFOQueue:
    """Central FIFO queue with O(1) push, pop and removal of an arbitrary job (by identity)."""

    def __init__(self) -> None:
        self._items: dict[int, Any] = {}  # insertion-ordered: seq -> job
        self._seq_of: dict[int, list[int]] = {}  # id(job) -> its sequence numbers, oldest first
        self._counter = itertools.count()

    def push(self, job: Any) -> None:
        seq = next(self._counter)
        self._items[seq] = job
        self._seq_of.setdefault(id(job), []).append(seq)

    def pop(self) -> Any:
        """Remove and return the oldest job; IndexError if empty."""
        if not self._items:
            raise IndexError("pop from an empty queue")
        seq = next(iter(self._items))
        job = self._items.pop(seq)
        self._forget(job, seq)
        return job

    def peek(self) -> Any:
        return self._items[next(iter(self._items))]

    def remove(self, job: Any) -> bool:
        """Drop ``job`` (its oldest entry); True if it was queued."""
        seqs = self._seq_of.get(id(job))
        if not seqs:
            return False
        seq = seqs[0]
        del self._items[seq]
        self._forget(job, seq)
        return True

    def _forget(self, job: Any, seq: int) -> None:
        seqs = self._seq_of[id(job)]
        seqs.remove(seq)
        if not seqs:
            del self._seq_of[id(job)]

    def __contains__(self, job: Any) -> bool:
        return id(job) in self._seq_of

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items.values()))


def _chain_rate_capacity(chain: Any) -> tuple[float, int]:
    """Accept Chain objects or ``(mu_k, c_k)`` pairs."""
    if isinstance(chain, Chain):
        mu, cap = chain.rate, chain.capacity
    else:
        try:
            mu, cap = chain
        except (TypeError, ValueError):
            raise TypeError(f"a chain must be a Chain or a (mu_k, c_k) pair, got {chain!r}") from None
    mu = float(mu)
    if not (mu > 0):
        raise ValueError(f"chain service rate must be positive, got {mu!r}")
    if int(cap) != cap or cap < 0:
        raise ValueError(f"chain capacity must be a non-negative integer, got {cap!r}")
    return mu, int(cap)


class JFFCDispatcher:
    """Alg. 3: a new job goes to the fastest chain with ``Z_k < c_k``, else to the central queue;
    when a job completes on chain ``k`` the queue head starts on chain ``k``.

    ``chains``: Chain objects (or ``(mu_k, c_k)`` pairs); indices returned refer to this list.
    Ties in ``mu_k`` go to the lower index. ``arrive``/``complete`` cost O(log K).
    ``queue``: optional queue object with ``push``, ``pop``, ``remove``, ``__len__`` (FIFO default).
    """

    def __init__(self, chains: Sequence[Any], queue: Any | None = None):
        self.chains = list(chains)
        params = [_chain_rate_capacity(ch) for ch in self.chains]
        self.rates = [mu for mu, _ in params]
        self.capacities = [cap for _, cap in params]
        self.occupancy = [0] * len(self.chains)
        self.queue = queue if queue is not None else FIFOQueue()
        self._free = [(-mu, k) for k, (mu, cap) in enumerate(params) if cap > 0]
        heapq.heapify(self._free)
        self.last_started = False  # whether the last arrival started at once (same attribute as the baselines)

    @property
    def running(self) -> list[int]:
        """Jobs in service per chain (equal to ``occupancy`` under JFFC)."""
        return self.occupancy

    @property
    def queue_length(self) -> int:
        return len(self.queue)

    def peek(self, fits: Callable[[int], bool] | None = None) -> int | None:
        """The chain :meth:`arrive` would start a job on now (read-only), or None if it would queue it: the fastest
        free chain, ties to the lower index. ``fits``: when the fastest free chain ``k`` has ``fits(k)`` false, the
        fastest free chain that has it true instead (a job with a deadline that one misses and another meets); the
        fastest if none has. Without ``fits`` this is Alg. 3's rule exactly."""
        if not self._free:
            return None
        k = self._free[0][1]
        if fits is None or fits(k):
            return k
        return next((j for _, j in sorted(self._free) if j != k and fits(j)), k)

    def arrive(self, job: Any, fits: Callable[[int], bool] | None = None) -> int | None:
        """Start ``job`` on the chain :meth:`peek` names (``fits``: see there) and return its index, or queue it and
        return None."""
        k = self.peek(fits)
        if k is not None:
            self.occupancy[k] += 1
            if self.occupancy[k] >= self.capacities[k]:
                if self._free[0][1] == k:
                    heapq.heappop(self._free)
                else:  # another chain than the fastest free one (fits): O(K), only for such jobs
                    self._free = [e for e in self._free if e[1] != k]
                    heapq.heapify(self._free)
            self.last_started = True
            return k
        self.queue.push(job)
        self.last_started = False
        return None

    def adopt(self, k: int, job: Any) -> bool:
        """Count ``job``, already running on chain ``k`` (e.g. across a re-plan), if ``k`` has room."""
        if not (0 <= k < len(self.chains)) or self.occupancy[k] >= self.capacities[k]:
            return False
        self.occupancy[k] += 1
        if self.occupancy[k] >= self.capacities[k]:
            self._free = [e for e in self._free if e[1] != k]
            heapq.heapify(self._free)
        return True

    def complete(self, k: int) -> Any | None:
        """A job left chain ``k``: start the queue head on ``k`` and return it, or None if the queue is empty."""
        if not (0 <= k < len(self.chains)) or self.occupancy[k] <= 0:
            raise ValueError(f"no job is running on chain {k!r}")
        if len(self.queue):
            return self.queue.pop()  # occupancy of k unchanged: the freed slot is reused at once
        self.occupancy[k] -= 1
        if self.occupancy[k] == self.capacities[k] - 1:
            heapq.heappush(self._free, (-self.rates[k], k))
        return None

    def remove_job(self, job: Any) -> bool:
        """Drop a queued job (e.g. its client gave up); True if it was in the queue."""
        return self.queue.remove(job)

    def free_chains(self) -> int:
        """Number of chains with a free slot."""
        return len(self._free)
