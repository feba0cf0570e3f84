"""Dispatch baselines over chains (each chain = a ``c_k``-server station with its own FIFO queue).

Scores (paper §4.1, extended to parallel chains as in [5]), with ``Z_k`` = jobs at chain ``k``
(running + waiting there):

* JSQ: argmin ``(Z_k - c_k + 1)+ / c_k``, random ties.
* SA-JSQ: the same score, ties to the fastest chain (then lower index).
* SED: argmin ``1/mu_k + (Z_k - c_k + 1)+ / (mu_k c_k)``, ties to the lower index.
* JIQ: a uniformly random chain with a free slot, else a uniformly random chain.

They never queue centrally: ``arrive`` always returns a chain index and the job waits in that
chain's FIFO if the chain is full (``last_started`` tells whether it started). ``complete(k)``
starts chain ``k``'s next waiting job. Decisions cost O(log K) (lazy heaps / indexable free sets).
"""

from __future__ import annotations

import heapq
import random
from typing import Any, Sequence

from petals_chain.algorithms.jffc import FIFOQueue, _chain_rate_capacity


def _make_rng(rng: Any):
    if rng is None:
        return random.Random(0)
    if isinstance(rng, int):
        return random.Random(rng)
    if hasattr(rng, "random"):
        return rng
    raise TypeError(f"rng must be None, an int seed, random.Random or numpy Generator, got {type(rng).__name__}")


class _IndexedSet:
    """Set of ints with O(1) add/remove and uniform random choice."""

    def __init__(self) -> None:
        self._items: list[int] = []
        self._pos: dict[int, int] = {}

    def add(self, x: int) -> None:
        if x not in self._pos:
            self._pos[x] = len(self._items)
            self._items.append(x)

    def discard(self, x: int) -> None:
        i = self._pos.pop(x, None)
        if i is None:
            return
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._pos[last] = i

    def choice(self, rng) -> int:
        return self._items[int(rng.random() * len(self._items)) % len(self._items)]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, x: int) -> bool:
        return x in self._pos


class _PerChainDispatcher:
    """Shared bookkeeping: per-chain FIFO queues, occupancy = running + waiting at the chain."""

    def __init__(self, chains: Sequence[Any]):
        self.chains = list(chains)
        params = [_chain_rate_capacity(ch) for ch in self.chains]
        if not self.chains:
            raise ValueError("at least one chain is needed")
        if all(cap == 0 for _, cap in params):
            raise ValueError("every chain has capacity 0")
        self.rates = [mu for mu, _ in params]
        self.capacities = [cap for _, cap in params]
        self.running = [0] * len(self.chains)
        self.waiting = [FIFOQueue() for _ in self.chains]
        self.last_started = False
        self._where: dict[int, int] = {}  # id(job) -> chain it waits at

    @property
    def occupancy(self) -> list[int]:
        """``Z_k``: jobs at each chain, running or waiting in its FIFO."""
        return [r + len(w) for r, w in zip(self.running, self.waiting)]

    @property
    def queue_length(self) -> int:
        """Jobs waiting at all chains' FIFOs (there is no central queue)."""
        return sum(len(w) for w in self.waiting)

    def _z(self, k: int) -> int:
        return self.running[k] + len(self.waiting[k])

    def _choose(self) -> int:
        raise NotImplementedError

    def _changed(self, k: int) -> None:
        """Hook: Z_k changed."""

    def arrive(self, job: Any) -> int:
        k = self._choose()
        if self.running[k] < self.capacities[k]:
            self.running[k] += 1
            self.last_started = True
        else:
            self.waiting[k].push(job)
            self._where[id(job)] = k
            self.last_started = False
        self._changed(k)
        return k

    def adopt(self, k: int, job: Any) -> bool:
        """Count ``job``, already running on chain ``k`` (e.g. across a re-plan), if ``k`` has room."""
        if not (0 <= k < len(self.chains)) or self.running[k] >= self.capacities[k]:
            return False
        self.running[k] += 1
        self._changed(k)
        return True

    def complete(self, k: int) -> Any | None:
        if not (0 <= k < len(self.chains)) or self.running[k] <= 0:
            raise ValueError(f"no job is running on chain {k!r}")
        if len(self.waiting[k]):
            job = self.waiting[k].pop()
            self._where.pop(id(job), None)
        else:
            job = None
            self.running[k] -= 1
        self._changed(k)
        return job

    def remove_job(self, job: Any) -> bool:
        k = self._where.get(id(job))
        if k is None or not self.waiting[k].remove(job):
            return False
        del self._where[id(job)]
        self._changed(k)
        return True


class _ScoreHeapDispatcher(_PerChainDispatcher):
    """argmin of a per-chain score via a lazy heap keyed ``(score, tiebreak, k)``."""

    def __init__(self, chains: Sequence[Any], rng: Any = None):
        super().__init__(chains)
        self.rng = _make_rng(rng)
        self._version = [0] * len(self.chains)
        self._heap: list[tuple] = []
        for k in range(len(self.chains)):
            if self.capacities[k] > 0:
                self._heap.append(self._entry(k))
        heapq.heapify(self._heap)

    def _score(self, k: int) -> float:
        raise NotImplementedError

    def _tiebreak(self, k: int) -> float:
        return 0.0

    def _entry(self, k: int) -> tuple:
        return (self._score(k), self._tiebreak(k), k, self._version[k])

    def _choose(self) -> int:
        heap = self._heap
        while heap[0][3] != self._version[heap[0][2]]:
            heapq.heappop(heap)
        return heap[0][2]

    def _changed(self, k: int) -> None:
        if self.capacities[k] == 0:
            return
        self._version[k] += 1
        heapq.heappush(self._heap, self._entry(k))
        if len(self._heap) > 4 * len(self.chains) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if e[3] == self._version[e[2]]]
            heapq.heapify(self._heap)


class JSQDispatcher(_PerChainDispatcher):
    """Join-the-Shortest-Queue over parallel chains: argmin ``(Z_k - c_k + 1)+ / c_k``, ties uniformly at random.

    Chains are kept in buckets by score (a lazy heap of the scores in use): every arrival draws uniformly among
    all chains at the minimum. (A random key drawn when a chain's score changed is not uniform: the chains not
    picked keep keys known to be above the last winner's, so the last pick tended to win again.)"""

    def __init__(self, chains: Sequence[Any], rng: Any = None):
        super().__init__(chains)
        self.rng = _make_rng(rng)
        self._score_of: dict[int, float] = {}
        self._buckets: dict[float, _IndexedSet] = {}
        self._scores: list[float] = []  # heap of scores, some of them with an empty bucket now (lazy)
        for k in range(len(self.chains)):
            self._changed(k)

    def _score(self, k: int) -> float:
        return max(self._z(k) - self.capacities[k] + 1, 0) / self.capacities[k]

    def _choose(self) -> int:
        scores, buckets = self._scores, self._buckets
        while not len(buckets[scores[0]]):
            heapq.heappop(scores)
        return buckets[scores[0]].choice(self.rng)

    def _changed(self, k: int) -> None:
        if self.capacities[k] == 0:
            return
        score, old = self._score(k), self._score_of.get(k)
        if score == old:
            return
        if old is not None:
            self._buckets[old].discard(k)
        self._score_of[k] = score
        bucket = self._buckets.setdefault(score, _IndexedSet())
        if not len(bucket):
            heapq.heappush(self._scores, score)
            if len(self._scores) > 4 * len(self.chains) + 64:  # drop the scores of empty buckets now and then
                self._scores = sorted({x for x in self._scores if len(self._buckets[x])} | {score})
        bucket.add(k)


class SAJSQDispatcher(_ScoreHeapDispatcher):
    """Speed-Aware JSQ: JSQ's score, ties to the fastest chain."""

    def _score(self, k: int) -> float:
        return max(self._z(k) - self.capacities[k] + 1, 0) / self.capacities[k]

    def _tiebreak(self, k: int) -> float:
        return -self.rates[k]


class SEDDispatcher(_ScoreHeapDispatcher):
    """Smallest Expected Delay: argmin ``1/mu_k + (Z_k - c_k + 1)+ / (mu_k c_k)``."""

    def _score(self, k: int) -> float:
        mu, cap = self.rates[k], self.capacities[k]
        return 1.0 / mu + max(self._z(k) - cap + 1, 0) / (mu * cap)


class JIQDispatcher(_PerChainDispatcher):
    """Join-the-Idle-Queue: a random chain with a free slot, else a random chain (capacity > 0)."""

    def __init__(self, chains: Sequence[Any], rng: Any = None):
        super().__init__(chains)
        self.rng = _make_rng(rng)
        self._free = _IndexedSet()
        self._usable = _IndexedSet()
        for k, cap in enumerate(self.capacities):
            if cap > 0:
                self._free.add(k)
                self._usable.add(k)

    def _choose(self) -> int:
        if len(self._free):
            return self._free.choice(self.rng)
        return self._usable.choice(self.rng)

    def _changed(self, k: int) -> None:
        if self.capacities[k] > 0 and self.running[k] < self.capacities[k]:
            self._free.add(k)
        else:
            self._free.discard(k)


DISPATCHERS = {
    "jsq": JSQDispatcher,
    "jiq": JIQDispatcher,
    "sed": SEDDispatcher,
    "sa-jsq": SAJSQDispatcher,
}


def make_dispatcher(name: str, chains: Sequence[Any], rng: Any = None):
    """Dispatcher by name: ``jffc``, ``jsq``, ``jiq``, ``sed`` or ``sa-jsq`` (``rng`` for the random ones)."""
    from petals_chain.algorithms.jffc import JFFCDispatcher

    key = name.lower().replace("_", "-")
    if key == "jffc":
        return JFFCDispatcher(chains)
    if key not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; choose from jffc, {', '.join(DISPATCHERS)}")
    cls = DISPATCHERS[key]
    return cls(chains, rng=rng)
