"""The KV cache of a server's blocks: a pool of fixed-size pages, and a transformers ``Cache`` over one session's.

A *page* holds the K and V of ``page_size`` consecutive tokens of one decoder layer for one session.
:class:`PagePool` allocates every page once, as two tensors ``[kv_heads, num_pages, page_size, head_dim]`` (KV
heads first, so that a page table gathers into one sequence without a second copy), and never over-commits: a
session first *reserves* the pages it may ever need (``ceil(its max tokens / page_size)`` per block) and takes
them from its reservation, one run of consecutive pages per block when the pool has one free.

Two modes (``--kv-cache``) use the same pool:

* ``paged`` (default): pages of ``page_size`` tokens (16); a session holds pages for the tokens it declared at
  open (the request's prompt plus ``max_tokens``, not the server's ``max_length``).
* ``slots``: the paper's Eq. 3 model: one page of ``max_length`` tokens per block (an ``s_c``-byte slot) per
  session, whatever its length. The Table 1 reproduction plans with it.

:class:`PagedCache` is what the decoder layers see during one step of one session: ``update`` writes the step's
K/V in place at its positions and returns the K/V of the valid prefix -- a view when its pages are consecutive
(always in ``slots`` mode, usually in ``paged`` mode), so a decode step costs no O(L) copy; else the session's
pages gathered in order.

Prefix cache (``paged`` mode): a full page whose tokens' *prefix hash* is known (the orchestrator sends the
hash chain of the token ids, :mod:`petals_chain.swarm.prefix`; a server never sees tokens) can outlive its
session: at close it is *cached* under ``(layer, hash)`` instead of freed. A later session over the same layers
whose prompt starts with the same tokens *pins* those pages and skips their compute. Cached pages no session
uses are evictable, least recently used first (the deepest page of a prefix goes before its shallower ones),
and count as available: they are evicted on demand by :meth:`PagePool.take`, so caching never refuses a session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers.cache_utils import Cache

# one page size and rounding for servers and orchestrator
from petals_chain.swarm.memory import DEFAULT_PAGE_SIZE, page_size_for, slot_tokens

KV_CACHE_MODES = ("paged", "slots")


class NoCapacityError(RuntimeError):
    """The server has too few free cache pages for the requested span and length."""


NO_PAGE = -1  # a table entry with no page yet (under a matched prefix of a session opened lean, see the runner)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-int(tokens) // int(page_size))


def _consecutive(pages: Sequence[int]) -> bool:
    first = pages[0] if pages else 0
    return all(p == first + i for i, p in enumerate(pages))


# A session's page tables: global layer index -> its pages for that layer in token order.
PageTables = Mapping[int, Sequence[int]]


class PageTable(tuple):
    """One session's pages for one layer, in token order; whether they are consecutive is computed once (a
    session's table never changes), so a step reads them as a view without checking again."""

    consecutive: bool

    def __new__(cls, pages: Sequence[int]) -> "PageTable":
        table = super().__new__(cls, pages)
        table.consecutive = _consecutive(table)
        return table


class PagePool:
    """``num_pages`` KV pages of ``page_size`` tokens allocated up front (see the module docstring).

    Accounting: ``free`` pages are not held by any session; ``reserved`` of them are promised to a session
    being opened (:meth:`reserve` checks capacity for all its blocks at once, :meth:`take` then hands out each
    block's pages); *cached* pages hold a prefix (:meth:`cache`), pinned by the sessions reusing them
    (:meth:`pin`) or evictable; ``available = free + evictable - reserved``. Not thread-safe on its own: the
    owner (the block runner) serialises calls.
    """

    def __init__(self, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        for name, v in (("num_pages", num_pages), ("num_kv_heads", num_kv_heads), ("page_size", page_size),
                        ("head_dim", head_dim)):
            if isinstance(v, bool) or int(v) != v or v < (0 if name == "num_pages" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'num_pages' else 'positive'} "
                                 f"integer, got {v!r}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        shape = (int(num_kv_heads), self.num_pages, self.page_size, int(head_dim))
        # Zero-filled so that every page is really committed now, not at first use.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._allocated = bytearray(self.num_pages)  # 1 = held by a session (bytes.find locates free runs fast)
        self._free = self.num_pages
        self.reserved = 0
        # prefix cache: (layer, prefix hash) <-> page, sessions pinning each cached page, and the unpinned ones
        # in eviction order (least recently used first)
        self._index: dict[tuple[int, bytes], int] = {}
        self._key_of: dict[int, tuple[int, bytes]] = {}
        self._pins: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0  # cached pages reclaimed for new sessions so far

    @property
    def pages_free(self) -> int:
        """Pages held by no session (some may be reserved)."""
        return self._free

    @property
    def pages_available(self) -> int:
        """Pages a new session may reserve: free or evictable, and not promised to an open session."""
        return self._free + len(self._evictable) - self.reserved

    @property
    def pages_cached(self) -> int:
        """Pages holding a cached prefix (pinned by a session or evictable)."""
        return len(self._key_of)

    @property
    def pages_evictable(self) -> int:
        """Cached pages no session uses (reclaimed, least recently used first, when free pages run out)."""
        return len(self._evictable)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (K and V)."""
        return 2 * self.keys[:, 0].numel() * self.keys.element_size() if self.num_pages else 0

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def reserve(self, n: int) -> None:
        """Promise ``n`` pages to a session, or raise :class:`NoCapacityError` and promise none."""
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"number of pages must be a positive integer, got {n!r}")
        if n > self.pages_available:
            raise NoCapacityError(f"no capacity: {n} cache page(s) needed, {self.pages_available} of "
                                  f"{self.num_pages} available")
        self.reserved += int(n)

    def take(self, n: int) -> list[int]:
        """Hand out ``n`` pages out of a reservation made earlier: consecutive pages when a free run of ``n``
        exists (the first one), else the lowest free pages."""
        if not 0 <= n <= self.reserved:
            raise ValueError(f"cannot take {n} pages: only {self.reserved} are reserved")
        while self._free < n:  # the reservation counted evictable pages: reclaim the least recently used
            self._evict_one()
        start = self._allocated.find(bytes(n)) if n else -1
        if start >= 0:
            taken = list(range(start, start + n))
            self._allocated[start:start + n] = b"\x01" * n
        else:
            taken, at = [], 0
            while len(taken) < n:
                at = self._allocated.find(0, at)
                taken.append(at)
                self._allocated[at] = 1
                at += 1
        self.reserved -= n
        self._free -= n
        return taken

    def release(self, pages: Sequence[int]) -> None:
        """Give pages back (each exactly once)."""
        if len(set(pages)) != len(pages):
            raise ValueError("a page is released twice")
        for p in pages:
            if not 0 <= p < self.num_pages or not self._allocated[p] or p in self._key_of:
                raise ValueError(f"page {p} is not allocated to a session")
        for p in pages:
            self._allocated[p] = 0
        self._free += len(pages)

    # ------------------------------------------------------------------ prefix cache
    def match(self, layers: Iterable[int], hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` (one per page, a hash chain) are cached in every one of ``layers``."""
        layers = list(layers)
        n = 0
        for h in hashes:
            if not all((layer, h) in self._index for layer in layers):
                break
            n += 1
        return n

    def pin(self, layer: int, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of ``layer`` for ``hashes`` (all must be cached), pinned: not evictable until
        :meth:`unpin`."""
        pages = [self._index[(layer, h)] for h in hashes]
        for p in pages:
            self._pins[p] = self._pins.get(p, 0) + 1
            self._evictable.pop(p, None)
        return pages

    def unpin(self, pages: Iterable[int]) -> None:
        """Undo one :meth:`pin` of each page; a page no session pins becomes the most recently used evictable one
        (unpin a prefix deepest page first, so that its shallow pages are evicted last)."""
        for p in pages:
            left = self._pins[p] - 1
            if left:
                self._pins[p] = left
            else:
                del self._pins[p]
                self._evictable[p] = None

    def sole_pins(self, pages: Iterable[int]) -> int:
        """How many of ``pages`` one :meth:`unpin` each would make evictable (no other session pins them)."""
        return sum(self._pins.get(p) == 1 for p in pages)

    def cache(self, layer: int, prefix_hash: bytes, page: int) -> bool:
        """Keep ``page`` (held by a closing session, its K/V valid) as the cached page of ``(layer, prefix_hash)``.
        False if that prefix is cached already: the caller releases ``page`` as usual."""
        key = (layer, prefix_hash)
        cached = self._index.get(key)
        if cached is not None:
            if cached in self._evictable:
                self._evictable.move_to_end(cached)
            return False
        if not (0 <= page < self.num_pages and self._allocated[page]) or page in self._key_of:
            raise ValueError(f"page {page} is not a held page")
        self._index[key] = page
        self._key_of[page] = key
        self._evictable[page] = None
        return True

    def _evict_one(self) -> None:
        page, _ = self._evictable.popitem(last=False)
        del self._index[self._key_of.pop(page)]
        self._allocated[page] = 0
        self._free += 1
        self.evictions += 1

    # ------------------------------------------------------------------ reading and writing one session's K/V
    def write(self, table: Sequence[int], position: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[kv_heads, n, head_dim]`` at positions ``position..position+n-1`` of ``table``."""
        ps, n = self.page_size, key.shape[-2]
        first, last = position // ps, (position + n - 1) // ps
        if first == last:
            page, off = table[first], position - first * ps
            self.keys[:, page, off:off + n] = key
            self.values[:, page, off:off + n] = value
            return
        pos = torch.arange(position, position + n)
        pages = torch.tensor(table, dtype=torch.long)[pos // ps].to(self.keys.device)
        offs = (pos % ps).to(self.keys.device)
        self.keys[:, pages, offs] = key
        self.values[:, pages, offs] = value

    def read(self, table: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[1, kv_heads, length, head_dim]`` of positions ``[0, length)``: a view when they lie in one page
        or in consecutive pages, else one gathering copy."""
        np_ = pages_for(length, self.page_size)
        first = table[0]
        if table.consecutive if isinstance(table, PageTable) else _consecutive(table[:np_]):
            return tuple(t[:, first:first + np_].reshape(t.shape[0], -1, t.shape[3])[None, :, :length]
                         for t in (self.keys, self.values))  # type: ignore[return-value]
        idx = torch.tensor(table[:np_], dtype=torch.long, device=self.keys.device)
        return tuple(t.index_select(1, idx).view(t.shape[0], -1, t.shape[3])[None, :, :length]
                     for t in (self.keys, self.values))  # type: ignore[return-value]

    def read_batch(self, tables: Sequence[Sequence[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, kv_heads, length, head_dim]`` of positions ``[0, length)`` of each table (padded rows
        repeat a page of their own and must be masked by the caller). One gathering copy."""
        np_ = pages_for(length, self.page_size)
        idx = torch.tensor([list(t[:np_]) + [t[0]] * (np_ - min(len(t), np_)) for t in tables], dtype=torch.long,
                           device=self.keys.device)
        b = len(tables)
        if np_ == 1:  # one page per row (always in slots mode): copy only the valid prefix
            # advanced indexing gathers from the strided view; index_select on it first made the whole pool
            # contiguous on CPU (a copy of every page at every decode step: 43 ms for a 52k-page pool)
            i = idx[:, 0]
            return tuple(t[:, i, :length].transpose(0, 1)  # type: ignore[return-value]
                         for t in (self.keys, self.values))
        flat = idx.reshape(-1)
        return tuple(t.index_select(1, flat).view(t.shape[0], b, np_ * self.page_size, t.shape[3])
                     .transpose(0, 1)[:, :, :length] for t in (self.keys, self.values))  # type: ignore[return-value]

    def copy(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        """Copy the K/V of the first ``length`` positions of pages ``src`` into pages ``dst`` (same page size)."""
        ps = self.page_size
        for i in range(pages_for(length, ps)):
            n = min(ps, length - i * ps)
            self.keys[:, dst[i], :n] = self.keys[:, src[i], :n]
            self.values[:, dst[i], :n] = self.values[:, src[i], :n]


class PagedCache(Cache):
    """The KV cache of ONE session for ONE step, over its pages of a :class:`PagePool`.

    ``pages_of`` maps a layer's global index (``self_attn.layer_idx``) to the session's page table for that
    layer (covering at least ``position + n_tokens`` tokens); ``position`` is where the step's tokens start.
    Positions before ``position`` are the session's valid prefix; anything after it is stale (rollback) and
    never read.
    """

    def __init__(self, pool: PagePool, pages_of: Mapping[int, Sequence[int]], position: int, n_tokens: int):
        super().__init__(layers=[])
        self.pool, self.pages_of = pool, dict(pages_of)
        self.position, self.n_tokens = int(position), int(n_tokens)
        need = pages_for(self.position + self.n_tokens, pool.page_size)
        short = [layer for layer, t in self.pages_of.items() if len(t) < need]
        if short:
            raise ValueError(f"positions up to {self.position + self.n_tokens} exceed the pages of layer(s) {short} "
                             f"({need} pages of {pool.page_size} tokens needed)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, kv_heads, n, head_dim]`` K/V at the step's positions; return K/V of positions ``[0, end)``."""
        table = self.pages_of[layer_idx]
        self.pool.write(table, self.position, key_states[0], value_states[0])
        return self.pool.read(table, self.position + key_states.shape[-2])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens already cached before this step."""
        return self.position

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.position + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return min((len(t) for t in self.pages_of.values()), default=0) * self.pool.page_size

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.pages_of)


def check_kv_cache(mode: str, page_size: int) -> None:
    """Raise ``ValueError`` for an unknown ``--kv-cache`` mode or a bad ``--page-size``."""
    if mode not in KV_CACHE_MODES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_MODES)}, got {mode!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


__all__ = ["KV_CACHE_MODES", "DEFAULT_PAGE_SIZE", "NoCapacityError", "PagePool", "PageTable", "PageTables", "PagedCache", "pages_for",
           "check_kv_cache", "page_size_for", "slot_tokens"]
