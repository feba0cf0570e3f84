"""Prefix locality: which workers (chains) were last given which prompt prefixes to cache.

The orchestrator relays every token, so it knows what each chain's servers were asked to keep in their prefix
caches when a job closed there (servers evict on their own; this is a hint, not a promise). A prefix is a
sequence of opaque *block keys*, each naming every token up to the end of its block (a hash chain), so a
worker holds a prefix of ``n`` blocks exactly when it holds key ``n - 1`` and, by construction, those before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

DEFAULT_DIRECTORY_ENTRIES = 1 << 16  # (worker, block key) pairs remembered, least recently added dropped first


class PrefixDirectory:
    """A bounded LRU of ``(worker, block key)``: :meth:`add` what a worker was given, :meth:`match` a prompt."""

    def __init__(self, capacity: int = DEFAULT_DIRECTORY_ENTRIES):
        if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
        self.capacity = int(capacity)
        self._entries: OrderedDict[tuple[Hashable, Hashable], None] = OrderedDict()
        self._workers_of: dict[Hashable, dict[Hashable, None]] = {}  # block key -> workers holding it
        self.version = 0  # changes whenever what some worker holds may have changed (live views re-match)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, worker: Hashable, keys: Sequence[Hashable]) -> None:
        """``worker`` was given the prefix of ``keys`` (shallow blocks become the most recent: dropped last)."""
        self.version += 1
        for key in reversed(keys):
            entry = (worker, key)
            if entry in self._entries:
                self._entries.move_to_end(entry)
            else:
                self._entries[entry] = None
                self._workers_of.setdefault(key, {})[worker] = None
        while len(self._entries) > self.capacity:
            (worker_, key_), _ = self._entries.popitem(last=False)
            holders = self._workers_of[key_]
            del holders[worker_]
            if not holders:
                del self._workers_of[key_]

    def match(self, keys: Sequence[Hashable]) -> dict[Hashable, int]:
        """Blocks of ``keys``' prefix each worker holds (workers holding none are left out)."""
        matched: dict[Hashable, int] = {}
        alive = None
        for depth, key in enumerate(keys):
            holders = self._workers_of.get(key)
            if not holders:
                break
            alive = [w for w in (holders if alive is None else alive) if w in holders]
            if not alive:
                break
            for w in alive:
                matched[w] = depth + 1
        return matched

    def preferred(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Workers holding some of ``keys``' prefix, the longest first."""
        matched = self.match(keys)
        return sorted(matched, key=lambda w: -matched[w])

    def forget(self, worker: Hashable) -> None:
        """Drop every entry of ``worker`` (e.g. a chain that no longer exists)."""
        self._drop([e for e in self._entries if e[0] == worker])

    def retain(self, workers: Iterable[Hashable]) -> int:
        """Drop the entries of every worker not in ``workers`` (the chains planned now: a re-planned chain's entries
        otherwise stayed until the LRU cap pushed them out, taking memory and lookups), in one pass. Returns how many
        entries were dropped."""
        keep = set(workers)
        gone = [e for e in self._entries if e[0] not in keep]
        if gone:
            self._drop(gone)
        return len(gone)

    def _drop(self, entries: list[tuple[Hashable, Hashable]]) -> None:
        self.version += 1
        for entry in entries:
            del self._entries[entry]
            holders = self._workers_of[entry[1]]
            del holders[entry[0]]
            if not holders:
                del self._workers_of[entry[1]]


__all__ = ["PrefixDirectory", "DEFAULT_DIRECTORY_ENTRIES"]
