"""BlockRunner: a server's span of decoder layers, its pre-allocated KV page pool and its sessions.

The runner loads blocks ``[start_block, start_block + num_blocks)`` one by one from an HF-format checkpoint,
owns the rotary module, and allocates the memory of ``num_slots`` cache slots (``s_c`` bytes each) once, as a
:class:`~petals_chain.server.kv_cache.PagePool`. In ``paged`` mode (default) a session processing blocks
``[a, b)`` holds, in each block, the pages its declared length needs from :meth:`allocate` to :meth:`release`;
in ``slots`` mode it holds one ``max_length`` slot per block (Eq. 3). A full runner refuses with
:class:`NoCapacityError` and never over-commits: a step never runs out of pages.

Per-session state (:class:`~petals_chain.server.session_state.SessionState`: span, pages, cached length) is
kept apart from the compute. With ``batching=True`` (the default) concurrent :meth:`BlockRunner.forward`
calls are gathered by a :class:`~petals_chain.server.batching.BatchScheduler` and run together, one forward
per block; with ``batching=False`` each call runs alone. Every compute goes through
:meth:`BlockRunner.run_on_device` (one at a time); :class:`~petals_chain.server.emulated.EmulatedRunner`
stretches it to emulate a slower device.

With ``adapters`` (LoRA, :mod:`~petals_chain.server.lora`) a session opened with an adapter's fingerprint runs its
steps with that adapter's deltas, batched with base sessions and other adapters' alike; its prefix-cache pages are
named apart (:func:`~petals_chain.swarm.lora.adapter_salt`), so no K/V is shared across adapters or with the base.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Optional, TypeVar

import torch
from tqdm.auto import tqdm

from petals_chain.server.batching import BatchScheduler, install_dispatch
from petals_chain.server.decode_graph import StaticDecode, check_decode_graph
from petals_chain.server.kv_cache import (DEFAULT_PAGE_SIZE, NO_PAGE, NoCapacityError, PagedCache, PagePool, PageTable,
                                          PageTables, check_kv_cache, page_size_for, pages_for)
from petals_chain.server.lora import SpanAdapters
from petals_chain.server.session_state import SessionState
from petals_chain.swarm.aio import outlast
from petals_chain.swarm.checkpoint import build_rotary, cache_kwarg, load_block, parse_dtype
from petals_chain.swarm.lora import LoraAdapter, adapter_salt, check_adapter_fits
from petals_chain.swarm.memory import head_dim, num_kv_heads
from petals_chain.swarm.prefix import PREFIX_BLOCK_TOKENS, page_hashes, supports_prefix_cache
from petals_chain.swarm.sources import ModelSource, resolve_source

__all__ = ["BlockRunner", "NoCapacityError"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
T = TypeVar("T")


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _avoid_cudnn_attention(device: torch.device) -> None:
    """On CUDA, keep scaled-dot-product attention off its cuDNN backend (flash / memory-efficient instead): cuDNN
    builds an execution plan per new shape, and decode keeps asking for new ones (a new KV length every step,
    batches of varying rows). Measured on an H200 (torch 2.11, bf16, 4 Llama-2-7B-shaped blocks, one session):
    52.9 ms per decode step at lengths not seen before, 2.6 ms at lengths seen, 3.9 ms without cuDNN
    (docs/results.md, "GPU checks"). Process-wide; a server process runs only its blocks."""
    if device.type == "cuda" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def _deepest_first(tables: Mapping[int, Sequence[int]]) -> Iterator[tuple[int, int, int]]:
    """``(position, layer, page)`` of several layers' page tables, deepest position first and every layer's page at
    a position together: the order pages become evictable in (unpinned or cached), so that evictions take a prefix's
    depth away in all its layers alike (a match needs a page in every layer; layer by layer, three evictions took
    one layer's whole prefix and nothing matched any more)."""
    depth = max((len(t) for t in tables.values()), default=0)
    for j in range(depth - 1, -1, -1):
        for layer, table in tables.items():
            if j < len(table):
                yield j, layer, table[j]


def sliding_window(config: Any) -> Optional[int]:
    """The attention window of a model config whose layers use one (None: full attention): no session may be longer,
    as the cache keeps the whole prefix and attends to all of it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(window, int) and not isinstance(window, bool) and (layer_types is None
                                                                     or "sliding_attention" in layer_types):
        return window
    return None


class BlockRunner:
    """Decoder layers ``[start_block, start_block + num_blocks)`` with the KV memory of ``num_slots`` slots of
    ``max_length`` tokens, as pages of ``page_size`` tokens (``kv_cache="paged"``) or as slots (``"slots"``).

    ``dtype`` None/"auto" keeps the checkpoint's dtype; ``quant`` is none|int8|nf4 (CUDA only). Thread-safe.

    Batching (keyword-only): ``batching`` gathers concurrent steps of different sessions into one forward per
    block; ``max_batch_tokens`` bounds the tokens of one batch; ``prefill_chunk_tokens`` is the most tokens one
    step contributes to a batch (longer prefills run in chunks, so decode steps of other sessions keep going);
    ``batch_wait_ms`` is how long the batcher waits for more steps after the first one arrives (only while
    some other open session got its last result recently, i.e. is likely to send a step soon). Defaults from ``scripts/bench_batching.py``:
    prefill throughput saturates near 128-token chunks (``--chunks``) and a 256-token budget holds decode
    steps up by at most about two chunks; a 2 ms window fills 16-session decode batches (15.6 rows on
    average vs 11 with no window). A session alone on the runner skips the batcher. Async callers (a
    server's event loop) use :meth:`forward_async`.
    """

    def __init__(
        self,
        model_path: "str | os.PathLike | ModelSource",
        start_block: int,
        num_blocks: int,
        num_slots: int,
        max_length: int,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quant: str = "none",
        *,
        attn_implementation: str = "sdpa",
        config: Any = None,
        progress: bool | None = None,
        batching: bool = True,
        max_batch_tokens: int = 256,
        prefill_chunk_tokens: int = 128,
        batch_wait_ms: float = 2.0,
        kv_cache: str = "paged",
        page_size: int = DEFAULT_PAGE_SIZE,
        prefix_cache: bool = True,
        decode_graph: str = "off",
        adapters: Sequence[LoraAdapter] = (),
    ):
        self.source = resolve_source(model_path)
        self.model_path = self.source.path
        # A private copy: the attention implementation is set on it, not on the caller's config.
        self.config = copy.deepcopy(config if config is not None else self.source.config)
        self.config._attn_implementation = attn_implementation
        n_layers = int(self.config.num_hidden_layers)
        for name, v in (("start_block", start_block), ("num_blocks", num_blocks), ("num_slots", num_slots),
                        ("max_length", max_length)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if not (0 <= start_block and num_blocks >= 1 and start_block + num_blocks <= n_layers):
            raise ValueError(f"blocks [{start_block}, {start_block + num_blocks}) outside the model's "
                             f"[0, {n_layers})")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos is not None and max_length > max_pos:
            raise ValueError(f"max_length {max_length} exceeds the model's max_position_embeddings {max_pos}")
        self._check_sliding_window(max_length)
        check_kv_cache(kv_cache, page_size)
        check_decode_graph(decode_graph, device, quant)
        for name, v in (("max_batch_tokens", max_batch_tokens), ("prefill_chunk_tokens", prefill_chunk_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(batch_wait_ms, (int, float)) and not isinstance(batch_wait_ms, bool)
                and math.isfinite(batch_wait_ms) and batch_wait_ms >= 0):
            raise ValueError(f"batch_wait_ms must be a finite number >= 0, got {batch_wait_ms!r}")

        self.start_block, self.num_blocks = start_block, num_blocks
        self.end_block = start_block + num_blocks
        self.max_length = max_length
        self.dtype = parse_dtype(dtype, self.config)
        self.device = torch.device(device)
        _avoid_cudnn_attention(self.device)
        self.quant = quant
        self.hidden_size = int(self.config.hidden_size)

        self.blocks = torch.nn.ModuleList()
        for i in tqdm(range(self.start_block, self.end_block), desc=f"loading blocks {self.start_block}-"
                      f"{self.end_block - 1}", unit="block", disable=None if progress is None else not progress):
            self.blocks.append(load_block(self.source, i, self.dtype, self.device, quant,
                                          config=self.config, attn_implementation=attn_implementation))
        self.rotary = build_rotary(self.config, self.device)
        for adapter in adapters:
            check_adapter_fits(adapter, self.config)
        # LoRA adapters' tensors of this span and the hooks adding their deltas (None: no adapters)
        self.lora = SpanAdapters(adapters, self.blocks, start_block, self.dtype, self.device) if adapters else None
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        self.page_size = page_size_for(kv_cache, max_length, page_size)
        self.pages_per_slot = pages_for(max_length, self.page_size)  # pages a max_length session takes per block
        # the memory of num_slots slots, each rounded up to whole pages (kv_cache.slot_tokens)
        self.pool = PagePool(num_slots * self.pages_per_slot, num_kv_heads(self.config), self.page_size,
                             head_dim(self.config), self.dtype, self.device)
        # Finished sessions' full pages stay cached for sessions with the same prompt prefix (kv_cache module).
        self.prefix_cache = bool(prefix_cache) and kv_cache == "paged" and supports_prefix_cache(self.page_size)
        # counted at a session's first served step (an open whose first step is refused or fails counts nothing):
        self.prefix_offered_tokens = 0  # prompt tokens sessions named by prefix hashes at open
        self.prefix_reused_tokens = 0  # of those, tokens whose K/V came from the cache (not computed)

        install_dispatch(self.blocks)
        # one-token steps of one session with static shapes (a CUDA graph replay in mode "cuda")
        self.static_decode = StaticDecode(self, decode_graph) if decode_graph != "off" else None

        self._sessions: dict[str, SessionState] = {}
        self._lock = threading.Lock()  # session table, pool and batch queue
        self._compute_lock = threading.Lock()  # one forward at a time on the device
        self.batching = bool(batching)
        self.scheduler = BatchScheduler(self, lock=self._lock, sessions=self._sessions,
                                        max_batch_tokens=max_batch_tokens,
                                        prefill_chunk_tokens=min(prefill_chunk_tokens, max_batch_tokens),
                                        gather_s=batch_wait_ms / 1000.0)

    # ---------------------------------------------------------------- capacity and sessions
    @property
    def slots_total(self) -> int:
        """Sessions of ``max_length`` tokens per block the pool holds (Eq. 3's slots; paged mode: its memory)."""
        return self.num_slots

    @property
    def slots_free(self) -> int:
        """Sessions of ``max_length`` tokens per block that could still be admitted."""
        with self._lock:
            return min(self.num_slots, self.pool.pages_available // self.pages_per_slot)

    @property
    def cache_tokens_total(self) -> int:
        """Tokens of K/V the pool holds, summed over the pages of all blocks."""
        return self.pool.num_pages * self.page_size

    @property
    def cache_tokens_free(self) -> int:
        """Tokens of K/V a new session may still reserve (all blocks together)."""
        with self._lock:
            return self.pool.pages_available * self.page_size

    def cache_stats(self) -> dict[str, int]:
        """The pool in pages: total, used (held by sessions, or cached prefixes they pin), cached (prefixes,
        pinned or evictable), evictable, free; tokens per page; prefix-cache counters (tokens)."""
        with self._lock:
            p = self.pool
            return {"pages_total": p.num_pages, "pages_used": p.num_pages - p.pages_free - p.pages_evictable,
                    "pages_cached": p.pages_cached, "pages_evictable": p.pages_evictable, "pages_free": p.pages_free,
                    "page_size": self.page_size, "prefix_cache": self.prefix_cache,
                    "prefix_offered_tokens": self.prefix_offered_tokens,
                    "prefix_reused_tokens": self.prefix_reused_tokens, "prefix_evictions": p.evictions}

    @property
    def s_c(self) -> int:
        """Bytes of the cache of one ``max_length`` session for one block (a slot) as allocated."""
        return self.pool.page_bytes * self.pages_per_slot

    @property
    def adapters(self) -> dict[str, str]:
        """``{fingerprint: name}`` of the LoRA adapters sessions may open with."""
        return dict(self.lora.names) if self.lora is not None else {}

    @property
    def adapter_bytes(self) -> int:
        """Bytes of the LoRA adapters' tensors loaded for this span."""
        return self.lora.nbytes if self.lora is not None else 0

    @property
    def blocks_bytes(self) -> int:
        """Bytes of the loaded blocks' parameters and buffers (all ``num_blocks`` of them)."""
        return sum(t.numel() * t.element_size() for t in list(self.blocks.parameters()) + list(self.blocks.buffers()))

    def sessions(self) -> dict[str, dict[str, Any]]:
        """Snapshot of open sessions: span, cached length, token limit, pages held, idle seconds."""
        now = time.monotonic()
        with self._lock:
            return {sid: {"start_block": s.start_block, "end_block": s.end_block, "length": s.length,
                          "limit": s.limit, "pages": sum(p != NO_PAGE for t in s.pages_of.values() for p in t),
                          "shared_pages": s.shared_pages * len(s.pages_of),
                          "idle_s": now - s.last_used, "busy": s.busy}
                    for sid, s in self._sessions.items()}

    def session_length(self, session_id: str) -> int:
        """Tokens cached so far for ``session_id`` (the position its next step must start at, or earlier)."""
        with self._lock:
            return self._get(session_id).length

    def allocate(self, session_id: str, start_block: int, end_block: int, max_tokens: int | None = None,
                 prefix_hashes: bytes | Sequence[bytes] = (), adapter: str | None = None) -> int:
        """Open ``session_id`` over blocks ``[start_block, end_block)`` for at most ``max_tokens`` tokens (default and
        cap: ``max_length``), reserving the pages it may need (``slots`` mode: one slot per block).

        ``prefix_hashes``: the session's prompt named by :func:`~petals_chain.swarm.prefix.prefix_hashes` (one per
        16 tokens). Returns how many leading tokens of it the prefix cache holds in every block of the span: the
        session starts with them (its cached length); its first step may start there or earlier (the caller
        takes the smallest such length over a chain's hops), and positions before the first step's are never
        written again (a rollback below them is refused). ``adapter``: the fingerprint of the LoRA adapter its
        steps use (None: the base model).

        Raises :class:`NoCapacityError` if too few pages are available, ``ValueError`` for a bad span, length or a
        session id already open. Nothing changes on error.
        """
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        for name, v in (("start_block", start_block), ("end_block", end_block)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if not self.start_block <= start_block < end_block <= self.end_block:
            raise ValueError(f"span [{start_block}, {end_block}) is not a non-empty part of this server's "
                             f"blocks [{self.start_block}, {self.end_block})")
        limit = self.max_length if max_tokens is None else max_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= self.max_length:
            raise ValueError(f"max_tokens must be an int in [1, {self.max_length}], got {max_tokens!r}")
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"this server does not serve adapter {adapter!r}")
        with self._lock:
            return self.allocate_locked(session_id, start_block, end_block, limit, prefix_hashes, adapter)

    def pages_needed(self, num_blocks: int, max_tokens: int) -> int:
        """Pages a session over ``num_blocks`` blocks of at most ``max_tokens`` tokens reserves (in ``slots`` mode a
        page is ``max_length`` tokens, so one per block)."""
        return num_blocks * pages_for(max_tokens, self.page_size)

    def allocate_locked(self, session_id: str, start_block: int, end_block: int, limit: int,
                        prefix_hashes: bytes | Sequence[bytes] = (), adapter: str | None = None) -> int:
        """:meth:`allocate` with ``_lock`` held and the span and limit already validated."""
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        per_block = self.pages_needed(1, limit)
        layers = range(start_block, end_block)
        pool = self.pool
        names = ([adapter_salt(adapter, h) for h in page_hashes(prefix_hashes, self.page_size)]
                 if self.prefix_cache else [])
        # A matched page is pinned before the reservation (which could evict it otherwise); the last token of a
        # limit is never reused (the session must compute at least one position).
        matched = min(pool.match(layers, names), (limit - 1) // self.page_size)
        pending = {b: pool.pin(b, names[:matched]) for b in layers} if matched else None
        lean = 0  # own pages not taken under the matched prefix (the first step takes them if it starts earlier)
        try:
            # The whole limit in own pages, whatever is matched: if another hop of the chain matched less, the
            # first step starts earlier and needs them; the unused ones are returned at that step (_start_at).
            pool.reserve(per_block * len(layers))
        except NoCapacityError:
            if pending is None:
                raise
            try:
                # Too full for that: own pages only after the matched prefix (a server that can hold one such
                # session keeps reusing its prefix instead of evicting it to make room for a copy). If even that
                # does not fit, neither would the session without reuse (the matched pages count as available).
                pool.reserve((per_block - matched) * len(layers))
                lean = matched
            except NoCapacityError:
                for pages in pending.values():
                    pool.unpin(reversed(pages))
                raise
        # Every page now, one run per block where the pool has one: a reservation is what admission counts, and
        # consecutive pages read as a view (kv_cache.PagePool.read), so a long session's decode copies nothing.
        pages_of = {b: PageTable([NO_PAGE] * lean + pool.take(per_block - lean)) for b in layers}
        s = SessionState(session_id, start_block, end_block, pages_of,
                         limit=limit if self.kv_cache == "paged" else self.max_length)
        s.pending, s.length, s.adapter = pending, matched * self.page_size, adapter
        if self.prefix_cache:  # counted at its first served step (_finish)
            s.offered_tokens = min(len(page_hashes(prefix_hashes, PREFIX_BLOCK_TOKENS)) * PREFIX_BLOCK_TOKENS,
                                   limit - 1)
        self._sessions[session_id] = s
        return s.length

    def extend(self, session_id: str, max_tokens: int) -> int:
        """Raise ``session_id``'s token limit to ``max_tokens`` (at most ``max_length``), taking the pages that needs
        in every block of its span now; returns the new limit (``slots`` mode: ``max_length`` already).

        What a job that outgrows the length it declared at open asks for before its next step (the orchestrator
        declares the prompt plus an output reserve, not the request's whole ``max_tokens``). Raises
        :class:`NoCapacityError` if too few pages are available (nothing changes: the caller preempts the job),
        ``KeyError`` for an unknown session, ``ValueError`` for a bad length or a session with a step running."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.max_length:
            raise ValueError(f"max_tokens must be an int in [1, {self.max_length}], got {max_tokens!r}")
        with self._lock:
            s = self._get(session_id)
            if s.busy:
                raise ValueError(f"session {session_id!r} has a step in progress")
            more = self.pages_needed(1, max_tokens) - self.pages_needed(1, s.limit)
            if max_tokens <= s.limit or more <= 0:
                s.limit = max(s.limit, max_tokens)
                return s.limit
            self.pool.reserve(more * len(s.pages_of))
            for layer, table in s.pages_of.items():
                s.pages_of[layer] = PageTable(list(table) + self.pool.take(more))
            s.limit = max_tokens
            return s.limit

    def _start_at(self, s: SessionState, position: int) -> None:
        """A session opened on a matched prefix steps at ``position`` for the first time: its tables become the
        cached pages before ``position``'s page plus its own pages from there (the part of that page before
        ``position`` copied); the other matched pages are unpinned and the own pages under shared ones returned."""
        pool, ps = self.pool, self.page_size
        keep, part = divmod(position, ps)
        missing = {layer: [j for j in range(keep, len(own)) if own[j] == NO_PAGE] for layer, own in s.pages_of.items()}
        need = sum(len(js) for js in missing.values())  # opened lean and starts before its match: pages to take
        after = {layer: shared[keep:] for layer, shared in s.pending.items()}  # matched pages it computes itself
        # The matched pages it gives up count: a session opened lean on a full pool fits on them (it was refused a
        # first step at 0 though nothing but its own pins held the memory).
        if need > pool.pages_available + pool.sole_pins(p for pages in after.values() for p in pages):
            raise NoCapacityError(f"no capacity: {need} cache page(s) needed, {pool.pages_available} of "
                                  f"{pool.num_pages} available")  # nothing changed
        # the part of `position`'s matched page the session keeps, read before that page is unpinned (and may be
        # evicted to become one of the pages taken below)
        head = {layer: tuple(t[0].clone() for t in pool.read([shared[keep]], part))
                for layer, shared in s.pending.items() if part and keep < len(shared)}
        pool.unpin(page for _, _, page in _deepest_first(after))
        if need:
            pool.reserve(need)
        for layer, shared in s.pending.items():
            own = list(s.pages_of[layer])
            for j, page in zip(missing[layer], pool.take(len(missing[layer]))):
                own[j] = page
            if layer in head:
                pool.write([own[keep]], 0, *head[layer])
            pool.release([p for p in own[:keep] if p != NO_PAGE])
            s.pages_of[layer] = PageTable(list(shared[:keep]) + list(own[keep:]))
        s.pending, s.shared_pages = None, keep
        s.reused_tokens = position  # counted once a step is served (_finish)

    def fork(self, source_id: str, session_id: str, length: int, max_tokens: int | None = None) -> None:
        """Open ``session_id`` over ``source_id``'s span with a copy of its first ``length`` cached tokens, holding
        up to ``max_tokens`` (at least ``length``; default the source's limit).

        What ``n > 1`` samples of one prompt share: the prompt's KV is computed once and copied per sample
        (copying ``length`` tokens of K/V per block is far cheaper than recomputing them). Raises
        :class:`NoCapacityError` without slots, ``KeyError`` for an unknown source, ``ValueError`` if the
        source holds fewer than ``length`` tokens or a step of it is rewriting some of them (a roll-back); a step
        that writes only positions ``>= length`` may run meanwhile. A source opened on a cached prefix that has
        not stepped yet holds its tokens in the shared pages it matched: they are copied from there.
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"fork length must be a positive int, got {length!r}")
        with self._lock:
            src = self._get(source_id)
            if length > src.length:
                raise ValueError(f"session {source_id!r} holds {src.length} tokens, cannot fork {length}")
            if src.busy and src.writing_from < length:
                raise ValueError(f"a step of session {source_id!r} is rewriting its tokens from position "
                                 f"{src.writing_from}: cannot fork {length} now")
            limit = src.limit if max_tokens is None else max_tokens
            if isinstance(limit, bool) or not isinstance(limit, int) or not length <= limit <= self.max_length:
                raise ValueError(f"a fork of {length} tokens must hold {length}..{self.max_length} tokens, "
                                 f"got {limit!r}")
            self.allocate_locked(session_id, src.start_block, src.end_block, limit)
            dst = self._sessions[session_id]
            dst.adapter = src.adapter  # the KV copied was computed with it
            # before its first step, the source's own tables hold nothing valid (or NO_PAGE, opened lean)
            source = src.pending if src.pending is not None else src.pages_of
            for layer, table in dst.pages_of.items():
                self.pool.copy(source[layer], table, length)
            dst.length = length

    def release(self, session_id: str, prefix_hashes: bytes | Sequence[bytes] = ()) -> bool:
        """Close ``session_id`` and return its pages (after its running step, if any). False if unknown.

        ``prefix_hashes`` name the tokens the session holds (:func:`~petals_chain.swarm.prefix.prefix_hashes`): its
        full pages among them stay in the prefix cache instead of being freed. A malformed blob is a ValueError
        that leaves the session as it was."""
        # first: raised once the session was closing, it was never dropped (its pages held until the runner closed)
        hashes = tuple(page_hashes(prefix_hashes, self.page_size)) if self.prefix_cache else ()
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or s.closing:
                return False
            s.closing = True
            s.close_hashes = tuple(adapter_salt(s.adapter, h) for h in hashes)
            if not s.busy or self.scheduler.cancel(s):
                self._drop(s)  # idle, or its step was still queued (its caller gets a KeyError)
            return True

    def release_idle(self, max_idle_s: float) -> list[str]:
        """Release every session idle for more than ``max_idle_s`` seconds; return their ids."""
        now = time.monotonic()
        with self._lock:
            stale = [s for s in self._sessions.values()
                     if not s.busy and not s.closing and now - s.last_used > max_idle_s]
            for s in stale:
                self._drop(s)
        return [s.session_id for s in stale]

    def close(self) -> None:
        """Release every session (running steps finish first, then their pages return; queued steps are dropped)."""
        with self._lock:
            for s in list(self._sessions.values()):
                s.closing = True
                if not s.busy or self.scheduler.cancel(s):
                    self._drop(s)

    def _drop(self, s: SessionState) -> None:
        if s.dropped:  # a release's cancel of its queued step dropped it already (a caller whose loop closed)
            return
        s.dropped = True
        del self._sessions[s.session_id]
        pool = self.pool
        if s.pending is not None:  # never stepped: its matched pages were only pinned
            pool.unpin(page for _, _, page in _deepest_first(s.pending))
            pool.release([p for table in s.pages_of.values() for p in table if p != NO_PAGE])
            return
        cacheable = min(len(s.close_hashes), s.length // self.page_size)
        free = []
        for j, layer, page in _deepest_first(s.pages_of):  # a prefix's shallow pages evicted last
            if j < s.shared_pages:
                pool.unpin([page])
            elif not (j < cacheable and pool.cache(layer, s.close_hashes[j], page)):
                free.append(page)
        pool.release(free)

    def _get(self, session_id: str) -> SessionState:
        s = self._sessions.get(session_id)
        if s is None or s.closing:
            raise KeyError(f"unknown session {session_id!r}")
        return s

    # ---------------------------------------------------------------- compute
    def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Run the session's blocks on ``hidden`` ``[1, n, hidden_size]`` at positions ``position..position+n-1``.

        ``position`` must be <= the session's cached length (== continues; < rolls back and overwrites,
        as PETALS' ``start_from_position``) and ``position + n`` at most the session's token limit. Returns the output hidden
        states in the input's dtype and device. Invalid input raises ``ValueError`` (``KeyError`` for an
        unknown session, or one released while its step was still queued) and changes nothing.

        Blocking. With batching on, the step joins the next batch; called from a thread that runs an asyncio
        event loop, it runs on its own at once instead (no other step could join while the loop is blocked):
        async callers should use :meth:`forward_async`.
        """
        s, x, n, pages_of, start, end = self._begin(session_id, hidden, position)
        ok = False
        try:
            if self.batching and not _on_event_loop():
                out = self.scheduler.submit(s, x, position, pages_of, start, end)
            else:
                out = self._compute_alone(x, position, pages_of, start, end, s.adapter)
            ok = True
            return out.to(device=hidden.device, dtype=hidden.dtype)
        finally:
            self._finish(s, position, n, ok)

    async def forward_async(self, session_id: str, hidden: torch.Tensor, position: int,
                            *, inline_max_tokens: int = 8) -> torch.Tensor:
        """:meth:`forward` for asyncio callers: the step joins a batch without blocking the event loop.

        A step of at most ``inline_max_tokens`` tokens of a session alone on the runner runs inline (no thread
        hand-off). Without batching, the step runs in the loop's default executor.
        """
        s, x, n, pages_of, start, end = self._begin(session_id, hidden, position)
        ok = False
        # finished once, by whichever comes first: this call's end, or the batch worker's when this caller's event
        # loop closed mid-step (the call then never ends, and its session stayed busy, its pages held, until the
        # coroutine was collected)
        step = [False]
        try:
            if self.batching:
                out = await self.scheduler.submit_async(
                    s, x, position, pages_of, start, end, inline_max_tokens=inline_max_tokens,
                    on_abandoned=lambda: self._finish_locked(s, position, n, False, step))
            else:
                fut = asyncio.get_running_loop().run_in_executor(None, self._compute_alone, x, position, pages_of,
                                                                 start, end, s.adapter)
                try:
                    out = await asyncio.shield(fut)
                except asyncio.CancelledError:
                    # the thread goes on writing the session's pages: they stay the session's (busy) until it ends,
                    # as a started batch's do (BatchScheduler.submit_async)
                    await outlast(fut)
                    raise
                finally:
                    # a failed step's exception is in the future, and its traceback holds this frame: kept here, that
                    # cycle kept the runner (blocks, KV pool) allocated after a reassignment dropped it
                    del fut
            ok = True
            return out.to(device=hidden.device, dtype=hidden.dtype)
        finally:
            self._finish(s, position, n, ok, step)

    def _begin(self, session_id: str, hidden: torch.Tensor, position: int):
        """Validate a step and mark its session busy; nothing changes on error."""
        n = self._validate_hidden(hidden)
        if isinstance(position, bool) or not isinstance(position, int):
            raise ValueError(f"position must be an int, got {position!r}")
        x = hidden.to(device=self.device, dtype=self.dtype)
        if x.dtype != hidden.dtype and not bool(torch.isfinite(x).all()):
            # finite as sent, not in our dtype (float32/bfloat16 past float16's range): computed, it wrote NaN K/V
            # that every later step of the session read, and replied NaN (the server was blamed for the input)
            raise ValueError(f"hidden states overflow this server's dtype {str(self.dtype).replace('torch.', '')} "
                             f"(sent as {str(hidden.dtype).replace('torch.', '')})")
        with self._lock:
            s = self._get(session_id)
            if s.busy:
                raise ValueError(f"session {session_id!r} already has a step in progress")
            if not 0 <= position <= s.length:
                raise ValueError(f"position {position} is not in [0, {s.length}] (the session's cached length): "
                                 f"steps must continue the prefix or roll back, not skip ahead")
            if position + n > s.limit:
                what = "max_length" if s.limit == self.max_length else "the session's token limit"
                raise ValueError(f"positions {position}..{position + n - 1} exceed {what} {s.limit}")
            if position < s.shared_pages * self.page_size:
                raise ValueError(f"position {position} rolls back into the session's shared cached prefix "
                                 f"(positions < {s.shared_pages * self.page_size} are never rewritten)")
            if s.pending is not None:
                self._start_at(s, position)
            s.busy, s.writing_from = True, position
            pages_of, start, end = dict(s.pages_of), s.start_block, s.end_block  # tables are immutable
        return s, x, n, pages_of, start, end

    def _finish(self, s: SessionState, position: int, n: int, ok: bool, step: list[bool] | None = None) -> None:
        with self._lock:
            self._finish_locked(s, position, n, ok, step)

    def _finish_locked(self, s: SessionState, position: int, n: int, ok: bool,
                       step: list[bool] | None = None) -> None:
        """The step's end (``_lock`` held): the session is free again. ``step``: ``[finished]``, shared by the two
        ends a step may have (see :meth:`forward_async`): only the first one counts."""
        if step is not None:
            if step[0]:
                return
            step[0] = True
        s.busy = False
        s.last_used = time.monotonic()
        # A failed step may have overwritten cache entries from `position` on.
        s.length = position + n if ok else min(s.length, position)
        if ok and s.offered_tokens:  # its first served step: the open's prefix lookup counts now
            self.prefix_offered_tokens += s.offered_tokens
            # a step served after a failed one may start earlier than the first: the tokens before it were reused
            self.prefix_reused_tokens += min(s.reused_tokens, position)
            s.offered_tokens = s.reused_tokens = 0
        if s.closing and not s.dropped:
            self._drop(s)

    def _compute_alone(self, x: torch.Tensor, position: int, pages_of: PageTables, start: int,
                       end: int, adapter: str | None = None) -> torch.Tensor:
        """One session's step on its own (the unbatched path)."""
        extra = {"adapter": adapter} if adapter is not None else {}
        return self.run_on_device(lambda: self._run_blocks(x, position, pages_of, start, end, **extra))

    def run_on_device(self, fn: Callable[[], T]) -> T:
        """``fn()`` (one step or one batch) with the device to itself; returns once the device is done with it.

        The one place every compute passes through: :class:`~petals_chain.server.emulated.EmulatedRunner`
        overrides :meth:`_on_device` here to emulate a slower device."""
        with self._compute_lock:
            return self._on_device(fn)

    def _on_device(self, fn: Callable[[], T]) -> T:
        try:
            out = fn()
            if self.device.type == "cuda":  # kernels run asynchronously: the device is busy until they finish
                torch.cuda.synchronize(self.device)
            return out
        finally:
            # a batch's result may be a row's error, whose traceback reaches this frame (its callers'): kept here,
            # that cycle kept the runner (blocks, KV pool) allocated after a reassignment dropped it
            out = None

    def _validate_hidden(self, hidden: Any) -> int:
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"hidden states must be a torch.Tensor, got {type(hidden).__name__}")
        if hidden.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"hidden states must be float32/float16/bfloat16, got {hidden.dtype}")
        if hidden.ndim != 3 or hidden.shape[0] != 1 or hidden.shape[2] != self.hidden_size or hidden.shape[1] < 1:
            raise ValueError(f"hidden states must have shape [1, n>=1, {self.hidden_size}], got {list(hidden.shape)}")
        if not bool(torch.isfinite(hidden).all()):
            raise ValueError("hidden states contain NaN or infinite values")
        return int(hidden.shape[1])

    def _check_sliding_window(self, max_length: int) -> None:
        # The cache keeps the full prefix; a sliding-window layer would need to mask beyond the window.
        window = sliding_window(self.config)
        if window is not None and max_length > window:
            raise ValueError(f"max_length {max_length} exceeds the model's sliding_window {window}; "
                             f"sliding-window attention beyond the window is not supported")

    def _causal_mask(self, position: int, n: int) -> torch.Tensor | None:
        """Mask for ``n`` queries at ``position..`` over keys ``0..position+n-1`` (None where not needed)."""
        impl = self.config._attn_implementation
        if n == 1:
            return None  # one query sees the whole valid prefix
        if impl == "sdpa" and position == 0:
            return None  # sdpa's is_causal path is exact when there is no prefix
        q = torch.arange(position, position + n, device=self.device)[:, None]
        k = torch.arange(position + n, device=self.device)[None, :]
        allowed = (k <= q)[None, None]
        if impl == "sdpa":
            return allowed
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def _run_blocks(self, hidden: torch.Tensor, position: int, pages_of: PageTables, start: int,
                    end: int, adapter: str | None = None) -> torch.Tensor:
        """One session's step through blocks ``[start, end)``: pure compute over the given pages (with the deltas
        of LoRA adapter ``adapter``, a fingerprint, when given)."""
        n = hidden.shape[1]
        if n == 1 and self.static_decode is not None and adapter is None:  # its graph holds no adapter's deltas
            out = self.static_decode.run(hidden, position, pages_of, start, end)
            if out is not None:
                return out
        position_ids = torch.arange(position, position + n, device=self.device).unsqueeze(0)
        with self.lora.rows([(adapter, None)]) if adapter is not None else contextlib.nullcontext():
            return self.run_layers(hidden, start, end, position_ids, self._causal_mask(position, n),
                                   PagedCache(self.pool, pages_of, position, n))

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, position_ids: torch.Tensor,
                   mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """Blocks ``[start, end)`` on ``hidden`` at ``position_ids``, attending under ``mask`` over what ``cache``
        (a transformers ``Cache``) stores and returns."""
        position_embeddings = self.rotary(hidden, position_ids)
        for layer in self.blocks[start - self.start_block:end - self.start_block]:
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, use_cache=True,
                        position_embeddings=position_embeddings, **{cache_kwarg(layer): cache})
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden
