"""Per-session state of a runner, shared by the runner (which owns it) and the batch scheduler (which reads it).

Kept apart so that :mod:`~petals_chain.server.runner` depends on :mod:`~petals_chain.server.batching` and not
the other way round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SessionState:
    """One open session on a runner: its span, its pages and how much of them holds valid K/V."""

    session_id: str
    start_block: int
    end_block: int
    pages_of: dict[int, tuple[int, ...]]  # global layer index -> page table (kv_cache.PageTable, token order)
    limit: int  # most tokens the session may hold (what its pages cover)
    length: int = 0  # tokens whose K/V are valid in every layer of the session
    busy: bool = False  # a step is computing; a second concurrent step is refused
    writing_from: int = 0  # while busy: the first position the running step writes
    closing: bool = False  # released while busy: pages go back when the step ends
    dropped: bool = False  # pages already returned to the pool
    last_used: float = field(default_factory=time.monotonic)
    # prefix cache (kv_cache.PagePool.pin): the first `shared_pages` pages of every table are cached pages the
    # session pins; until its first step says where it starts, `pending` holds the pinned pages matched at open
    # (the tables then hold only the session's own pages) and `length` is the matched prefix
    shared_pages: int = 0
    pending: Optional[dict[int, list[int]]] = None
    close_hashes: tuple[bytes, ...] = ()  # page names given at close: its full pages are cached, not freed
    # prefix-cache counters of the open (tokens named by its prefix hashes; of them, reused from the cache), added
    # to the runner's once a step is served: an open whose first step is refused or fails reused nothing
    offered_tokens: int = 0
    reused_tokens: int = 0
    adapter: Optional[str] = None  # the fingerprint of the LoRA adapter its steps use (None: the base model)
