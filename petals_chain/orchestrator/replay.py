"""What each hop of a job received, kept so that a failed hop can be replayed alone (as PETALS does).

A job's :class:`HopInputs` holds, for every block boundary ``a > 0`` where a hop of its chain starts, the hidden
states that entered block ``a`` at positions ``0..length-1`` (at boundary 0 they are the embeddings, recomputed
from the token ids). All jobs share one :class:`ReplayCache` byte budget (``--replay-cache-mb``): past it the
oldest jobs' inputs are dropped, and those jobs fall back to replaying their whole prefix on a new chain.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

COMPACT_EVERY = 64  # decode steps append one row each: join the pieces now and then


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HopInputs:
    """One job's hop inputs by block boundary; rows are positions. Use :meth:`ReplayCache.new`."""

    def __init__(self, cache: "ReplayCache", key: int):
        self.cache = cache
        self.key = key
        self.bytes = 0
        self._rows: dict[int, list[torch.Tensor]] = {}  # boundary -> [n_k, H] pieces, positions in order
        self._length: dict[int, int] = {}

    def length(self, boundary: int) -> int:
        return self._length.get(boundary, 0)

    def append(self, boundary: int, x: torch.Tensor, position: int) -> None:
        """``x`` [1, n, H] entered block ``boundary`` at positions ``position..``. Kept only if the rows before
        ``position`` are kept too (after an eviction a boundary starts again at position 0)."""
        if self.cache is None or self.cache.budget <= 0:
            return
        if self.length(boundary) != position:
            self._discard(boundary)
            if position != 0:
                return
        t = x[0]
        if t.untyped_storage().nbytes() > _nbytes(t):  # a slice of a bigger reply: do not pin the rest
            t = t.clone()
        rows = self._rows.setdefault(boundary, [])
        rows.append(t)
        self._length[boundary] = position + int(t.shape[0])
        if len(rows) > COMPACT_EVERY:
            self._rows[boundary] = [torch.cat(rows)]
        self.cache._charge(self, _nbytes(t))

    def get(self, boundary: int, length: int) -> torch.Tensor | None:
        """The inputs of block ``boundary`` at positions ``0..length-1`` as [1, length, H], or None if not kept."""
        if length <= 0 or self.length(boundary) < length:
            return None
        rows = self._rows[boundary]
        whole = rows[0] if len(rows) == 1 else torch.cat(rows)
        self._rows[boundary] = [whole]
        return whole[:length].unsqueeze(0)

    def truncate(self, length: int) -> None:
        """Forget positions ``>= length`` (a rolled-back turn: the chain's KV past ``length`` is stale)."""
        for b in list(self._rows):
            if self._length[b] > length:
                if length <= 0:
                    self._discard(b)
                    continue
                whole = torch.cat(self._rows[b])[:length].clone()
                freed = self._drop_rows(b)
                self._rows[b], self._length[b] = [whole], length
                if self.cache is not None:
                    self.cache._charge(self, _nbytes(whole) - freed)

    def copy_prefix(self, other: "HopInputs", length: int) -> None:
        """Start with ``other``'s first ``length`` positions at every boundary it keeps (a fork of its KV)."""
        self.clear()
        for b in list(other._rows):
            src = other.get(b, length)
            if src is not None:
                self.append(b, src, 0)

    def clear(self) -> None:
        """Forget everything (a new chain: its hops start at other boundaries)."""
        for b in list(self._rows):
            self._discard(b)

    def close(self) -> None:
        self.clear()
        if self.cache is not None:
            self.cache._forget(self)
            self.cache = None

    def _drop_rows(self, boundary: int) -> int:
        freed = sum(_nbytes(t) for t in self._rows.pop(boundary, []))
        self._length.pop(boundary, None)
        return freed

    def _discard(self, boundary: int) -> None:
        freed = self._drop_rows(boundary)
        if freed and self.cache is not None:
            self.cache._charge(self, -freed)


class ReplayCache:
    """The byte budget shared by every job's :class:`HopInputs`; evicts the oldest jobs' inputs first."""

    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        self.bytes = 0
        self.evictions = 0  # times a job's inputs were dropped to stay within the budget
        self._jobs: OrderedDict[int, HopInputs] = OrderedDict()  # oldest job first
        self._keys = itertools.count()

    def new(self) -> HopInputs:
        store = HopInputs(self, next(self._keys))
        self._jobs[store.key] = store
        return store

    @property
    def jobs(self) -> int:
        """Jobs holding inputs now."""
        return sum(1 for s in self._jobs.values() if s.bytes > 0)

    def _charge(self, store: HopInputs, nbytes: int) -> None:
        self.bytes += nbytes
        store.bytes += nbytes
        if nbytes <= 0 or self.bytes <= self.budget:
            return
        for other in list(self._jobs.values()):
            if self.bytes <= self.budget:
                return
            if other is not store and other.bytes > 0:
                other.clear()
                self.evictions += 1
        if self.bytes > self.budget:  # this job alone is over the budget
            store.clear()
            self.evictions += 1

    def _forget(self, store: HopInputs) -> None:
        self._jobs.pop(store.key, None)
