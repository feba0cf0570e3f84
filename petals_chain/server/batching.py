"""Continuous batching for a :class:`~petals_chain.server.runner.BlockRunner`.

Two parts:

* :func:`run_batch` -- one forward per block for the pending steps of several sessions. Tokens of all rows are
  *packed* into one ``[1, T, hidden]`` tensor (no padding through the projections and MLP); each token carries
  its own position (rotary per token) and the K/V it produces is written in place into its session's page at
  its position. Attention is per row over that row's own pages only: single-token (decode) rows are gathered
  into one padded ``[B, kv_heads, max_len, head_dim]`` tensor with a length mask (one SDPA call); multi-token
  rows (prefill chunks) attend over their own pages (a view in ``slots`` mode) with a causal mask. Rows may process different
  sub-spans of the runner's blocks: at each block only the rows whose span contains it take part. Rows of sessions
  using LoRA adapters (:mod:`~petals_chain.server.lora`) get their adapter's deltas; the others are computed as
  without adapters.
* :class:`BatchScheduler` -- callers block in :meth:`BatchScheduler.submit` (or await
  :meth:`BatchScheduler.submit_async`); one worker thread gathers pending requests for at most a short window,
  and only while some open session is likely to send a step soon (it got its last result recently),
  or until the token budget is full; runs them with :func:`run_batch`, and hands each caller its output. Long prefills are cut into chunks
  of at most ``prefill_chunk_tokens`` so that they never stall the decode steps of other sessions for more than
  one chunk; short requests go first, and a request passed over twice goes to the front.

The attention goes through a dispatcher registered with transformers' ``AttentionInterface``: it runs the
batched kernel when the layer is called with a :class:`_Segment` under the keyword ``SEGMENT_KWARG`` (which
transformers passes through the layer to the attention) and otherwise the layer's original implementation
(``sdpa`` or ``eager``), so the one-session path is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, TypeVar

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from petals_chain.server.kv_cache import PagePool, PageTables, pages_for
from petals_chain.server.session_state import SessionState
from petals_chain.swarm.aio import outlast
from petals_chain.swarm.checkpoint import cache_kwarg

__all__ = ["ATTN_NAME", "install_dispatch", "run_batch", "BatchScheduler", "BatchItem", "BatchHost"]

T = TypeVar("T")
logger = logging.getLogger(__name__)
_MAX_FAILURE_KINDS = 64  # kinds of worker failure counted (beyond: counting starts over)
# A batch that fails whole while each of its rows passes alone (the batched path is broken, the rows then run one by
# one, slower) is logged with its traceback once, then at most once per this many seconds with a count
BATCH_FAILURE_LOG_S = 60.0

ATTN_NAME = "petals_chain_paged"
# The keyword argument that carries a batch's :class:`_Segment` from the decoder layer to the attention (transformers
# passes a layer's extra keyword arguments through to the attention function).
SEGMENT_KWARG = "petals_chain_segment"
# Decode rows are gathered into one padded K/V tensor while it holds at most this many elements (per K and V);
# above it they attend one by one over their own pages. On this CPU (1 thread) gathering wins up to about
# 16 rows x 512 tokens x 4 heads x 16 dims and loses 5x at 2048 tokens (scripts/bench_batching.py --attention).
# On CUDA per-row kernel launches are the larger cost; that limit is a guess, not measured here.
GATHER_MAX_ELEMENTS = 1 << 19
# The gathering window waits for sessions served within this many windows: on a loaded CPU a session that just
# got its result can take a few ms to send its next step (bench_batching.py, 16 sessions: counting sessions
# served within 1 window gave about 12 rows per batch, within 10 windows about 15).
RECENT_WINDOWS = 10
GATHER_MAX_ELEMENTS_CUDA = 1 << 26


# ---------------------------------------------------------------------------------------------- attention
def _dispatch_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any):
    seg = kwargs.pop(SEGMENT_KWARG, None)
    if seg is not None:
        return seg.attend(module, query, scaling)
    return module._pc_base_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                     **kwargs)


AttentionInterface.register(ATTN_NAME, _dispatch_attention)


def install_dispatch(layers: Sequence[torch.nn.Module]) -> None:
    """Route the attention of ``layers`` through the dispatcher, keeping each layer's implementation as fallback.

    Only the layers' own config copies change (a runner's ``config`` is untouched).
    """
    for layer in layers:
        attn = layer.self_attn
        base = attn.config._attn_implementation
        if base == ATTN_NAME:
            continue
        if base == "eager" or base is None:
            fn = getattr(sys.modules[type(attn).__module__], "eager_attention_forward")
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        attn._pc_base_attention = fn
        attn.config._attn_implementation = ATTN_NAME


class BatchHost(Protocol):
    """What :func:`run_batch` and :class:`BatchScheduler` use of the blocks they run (``BlockRunner`` is one)."""

    device: torch.device
    pool: PagePool
    rotary: torch.nn.Module
    blocks: torch.nn.ModuleList
    start_block: int

    def run_on_device(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the device to itself (one compute at a time), returning once the device is done."""

    def _run_blocks(self, hidden: torch.Tensor, position: int, pages_of: PageTables, start: int,
                    end: int) -> torch.Tensor:
        """One row alone through blocks ``[start, end)`` (no lock: called inside :meth:`run_on_device`); a row of
        an adapter is passed it as ``adapter=`` (its fingerprint), only then."""


@dataclass
class BatchItem:
    """One row of a batch: ``x`` ``[1, n, H]`` at positions ``position..position+n-1`` over blocks ``[start, end)``."""

    x: torch.Tensor
    position: int
    pages_of: PageTables  # global layer index -> the row's page table
    start: int
    end: int
    adapter: str | None = None  # the fingerprint of the LoRA adapter its session uses (None: the base model)


class _Segment:
    """Per-batch metadata of a set of rows that run the same blocks (handed to the attention as ``SEGMENT_KWARG``).

    Token order inside the segment is the packed order of its rows. ``lo`` is the global index of the first
    block of the batch; ``tables[layer_idx - lo][i]`` is row ``i``'s page table at that layer.
    """

    def __init__(self, runner: BatchHost, items: Sequence[BatchItem], rows: Sequence[int], lo: int, hi: int,
                 tok_off: Sequence[int]):
        dev = runner.device
        self.pool = pool = runner.pool
        ps = pool.page_size
        self.lo = lo
        counts = [items[r].x.shape[1] for r in rows]
        self.num_tokens = sum(counts)
        self.tables = [[items[r].pages_of.get(layer, []) for r in rows] for layer in range(lo, hi)]
        pos = torch.cat([torch.arange(items[r].position, items[r].position + c) for r, c in zip(rows, counts)])
        # token indices of these rows in the full packed batch (None when the segment is the whole batch)
        full = torch.cat([torch.arange(tok_off[r], tok_off[r] + c) for r, c in zip(rows, counts)])
        self.tok_idx = None if len(full) == tok_off[-1] else full.to(dev)
        self.position_ids = pos.unsqueeze(0).to(dev)
        # where each token's K/V goes, per layer: its row's page at its position, and the offset in that page
        page_of_tok = [(i, p // ps) for i, (r, c) in enumerate(zip(rows, counts))
                       for p in range(items[r].position, items[r].position + c)]
        self.write_pages = torch.tensor([[t[i][k] if k < len(t[i]) else 0 for i, k in page_of_tok]
                                         for t in self.tables], dtype=torch.long).to(dev)  # [layers, T]
        self.write_offs = (pos % ps).to(dev)
        # each adapter's rows, as token indices of this segment (None: every token is that adapter's)
        self.adapter_rows: list[tuple[str, torch.Tensor | None]] = []
        adapter_of_tok = [items[r].adapter for r, c in zip(rows, counts) for _ in range(c)]
        for fp in sorted({a for a in adapter_of_tok if a is not None}):
            idx = [t for t, a in enumerate(adapter_of_tok) if a == fp]
            self.adapter_rows.append((fp, None if len(idx) == self.num_tokens else torch.tensor(idx, device=dev)))

        dec = [i for i, c in enumerate(counts) if c == 1]
        self.all_decode = len(dec) == len(rows)
        self.dec = dec
        if dec:
            lengths = [items[rows[i]].position + 1 for i in dec]
            self.dec_len = max(lengths)
            # gather the rows' prefixes into one padded tensor only while that copy is small; else attend per
            # row (over a view of its page in slots mode): see GATHER_MAX_ELEMENTS
            limit = GATHER_MAX_ELEMENTS_CUDA if pool.keys.device.type == "cuda" else GATHER_MAX_ELEMENTS
            npages = pages_for(self.dec_len, ps)
            copied = self.dec_len if npages == 1 else npages * ps  # tokens per row read_batch copies
            self.dec_gather = len(dec) * copied * pool.keys.shape[0] * pool.keys.shape[3] <= limit
            if self.dec_gather:
                lt = torch.tensor(lengths)
                self.dec_mask = (torch.arange(self.dec_len)[None, :] < lt[:, None])[:, None, None, :].to(dev)
            starts = [0]
            for c in counts[:-1]:
                starts.append(starts[-1] + c)
            self.dec_tok = torch.tensor([starts[i] for i in dec], device=dev)
            self.dec_rows = [(starts[i], lengths[k], i) for k, i in enumerate(dec)]  # (token, length, row)
        self.long: list[tuple[int, int, int, int, torch.Tensor | None]] = []  # (tok offset, n, position, row, mask)
        off = 0
        for i, (r, c) in enumerate(zip(rows, counts)):
            if c > 1:
                p = items[r].position
                mask = None
                if p > 0:
                    q = torch.arange(p, p + c, device=dev)[:, None]
                    mask = torch.arange(p + c, device=dev)[None, :] <= q
                self.long.append((off, c, p, i, mask))
            off += c
        self.cache = _SegmentCache(self)

    def attend(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> tuple[torch.Tensor, None]:
        """Attention of every row over its own pages. -> ``[1, T, h, d]``."""
        li = module.layer_idx - self.lo
        tables, pool = self.tables[li], self.pool
        gqa = query.shape[1] != pool.keys.shape[0]
        h, d = query.shape[1], query.shape[3]
        out = None
        if self.dec and not self.dec_gather:
            out = query.new_empty(self.num_tokens, h, d)
            for tok, length, row in self.dec_rows:
                k, v = pool.read(tables[row], length)
                o = F.scaled_dot_product_attention(query[:, :, tok:tok + 1], k, v, scale=scaling, enable_gqa=gqa)
                out[tok] = o[0, :, 0]
        elif self.dec:
            k, v = pool.read_batch([tables[i] for i in self.dec], self.dec_len)
            q = query[0].transpose(0, 1) if self.all_decode else query[0].index_select(1, self.dec_tok).transpose(0, 1)
            o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=self.dec_mask, scale=scaling,
                                               enable_gqa=gqa)  # [Bd, h, 1, d]
            if self.all_decode:
                return o.squeeze(2).unsqueeze(0), None
            out = query.new_empty(self.num_tokens, h, d)
            out.index_copy_(0, self.dec_tok, o.squeeze(2))
        if out is None:
            out = query.new_empty(self.num_tokens, h, d)
        for off, c, p, row, mask in self.long:
            k, v = pool.read(tables[row], p + c)
            o = F.scaled_dot_product_attention(query[:, :, off:off + c], k, v, attn_mask=mask,
                                               is_causal=mask is None, scale=scaling, enable_gqa=gqa)  # [1, h, c, d]
            out[off:off + c] = o[0].transpose(0, 1)
        return out.unsqueeze(0), None


class _SegmentCache(Cache):
    """Writes each token's K/V into its row's page at its position; the attention reads the pages itself."""

    def __init__(self, seg: _Segment):
        super().__init__(layers=[])
        self.seg = seg

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        seg = self.seg
        pages = seg.write_pages[layer_idx - seg.lo]
        seg.pool.keys[:, pages, seg.write_offs] = key_states[0]
        seg.pool.values[:, pages, seg.write_offs] = value_states[0]
        return seg.pool.keys, seg.pool.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


@torch.inference_mode()  # cheaper than no_grad per op; outputs are only serialized
def run_batch(runner: BatchHost, items: Sequence[BatchItem]) -> list[torch.Tensor]:
    """One forward per block for all ``items`` (already validated, on the runner's device and dtype).

    Returns each row's output ``[1, n_i, H]``. Each row's K/V is written only into its own pages and each row
    attends only over its own pages: rows never see each other.
    """
    counts = [it.x.shape[1] for it in items]
    tok_off = [0]
    for c in counts:
        tok_off.append(tok_off[-1] + c)
    lo, hi = min(it.start for it in items), max(it.end for it in items)
    hidden = torch.cat([it.x for it in items], dim=1)
    segments: dict[tuple[int, ...], _Segment] = {}
    for layer_idx in range(lo, hi):
        rows = tuple(i for i, it in enumerate(items) if it.start <= layer_idx < it.end)
        if not rows:  # sub-spans with a gap between them (e.g. [0, 2) and [5, 8)): no row needs this block
            continue
        seg = segments.get(rows)
        if seg is None:
            seg = segments[rows] = _Segment(runner, items, rows, lo, hi, tok_off)
            seg.position_embeddings = runner.rotary(hidden, seg.position_ids)
        layer = runner.blocks[layer_idx - runner.start_block]
        h = hidden if seg.tok_idx is None else hidden.index_select(1, seg.tok_idx)
        lora = getattr(runner, "lora", None) if seg.adapter_rows else None
        with lora.rows(seg.adapter_rows) if lora is not None else contextlib.nullcontext():
            h = layer(h, attention_mask=None, position_ids=seg.position_ids, use_cache=True,
                      position_embeddings=seg.position_embeddings,
                      **{cache_kwarg(layer): seg.cache, SEGMENT_KWARG: seg})
        h = h[0] if isinstance(h, tuple) else h
        hidden = h if seg.tok_idx is None else hidden.index_copy(1, seg.tok_idx, h)
    return [hidden[:, tok_off[i]:tok_off[i + 1]] for i in range(len(items))]


# ---------------------------------------------------------------------------------------------- scheduler
class _Cancelled(KeyError):
    pass


def _own_error(e: BaseException) -> BaseException:
    """A copy of ``e`` for one caller of a failed batch (same type, arguments and attributes; its own notes, and its
    own traceback and context once raised), caused by ``e``."""
    try:
        own = copy.copy(e)  # what pickling does: the class called with ``e.args``, then ``e.__dict__``
        # an __init__ that builds its message from its arguments (``def __init__(self, device, why="unknown")``)
        # built another one from ``e.args`` ("cuda:0: lost: unknown"): the caller saw a message nobody raised
        own.args = e.args
    except Exception:  # noqa: BLE001 - a class whose __init__ does not take its args back: not called
        try:
            own = type(e).__new__(type(e), *e.args)
            own.__dict__.update(getattr(e, "__dict__", {}))
        except Exception:  # noqa: BLE001
            own = RuntimeError(f"{type(e).__name__}: {e}")
    notes = getattr(own, "__notes__", None)
    if isinstance(notes, list):  # shared by the shallow copy: a note one caller's handler added showed in the others'
        own.__notes__ = list(notes)
    own.__cause__ = e
    return own


def _describe(e: BaseException) -> str:
    """``"Type: message"`` of ``e``; its type alone when its ``__str__`` fails (a bug's error must not hide it)."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001
        return f"{type(e).__name__} (its message could not be read)"


def _failure_key(e: BaseException) -> tuple[str, str]:
    """The kind of a worker's failure: its type and the line that raised it."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
    return type(e).__qualname__, where


def _resolve(fut: asyncio.Future) -> None:
    """Wake an asyncio waiter (on its loop): a future cancelled or resolved meanwhile is left as it is."""
    if not fut.done():
        fut.set_result(None)


@dataclass(eq=False)
class _Request:
    session: SessionState
    x: torch.Tensor  # [1, n, H] on the runner's device and dtype
    position: int
    pages_of: PageTables
    start: int
    end: int
    seq: int
    done: int = 0  # tokens already computed (chunked prefill)
    skipped: int = 0  # batches this request waited through without getting tokens
    started: bool = False
    outputs: list[torch.Tensor] = field(default_factory=list)
    error: BaseException | None = None
    event: threading.Event = field(default_factory=threading.Event)
    on_done: Any = None  # called (on the worker thread) after ``event`` is set: wakes an asyncio waiter

    def complete(self) -> None:
        self.event.set()
        # let go at once: the wake-up closes over its caller's session and runner (``on_abandoned``), and a worker
        # idling with its last batch in hand kept a closed runner allocated
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            try:
                on_done()
            except Exception:  # noqa: BLE001 - one caller's broken wake-up must not end the worker (and the others)
                logger.exception(f"waking the caller of session {self.session.session_id!r} failed; its result is "
                                 f"dropped")

    @property
    def remaining(self) -> int:
        return self.x.shape[1] - self.done


class BatchScheduler:
    """Gathers pending steps of a runner's sessions and runs them together (see the module docstring).

    ``max_batch_tokens`` bounds the tokens of one batch, ``prefill_chunk_tokens`` the tokens one request gets
    per batch, ``gather_s`` how long the worker waits for more requests after the first one arrives (it stops
    early once every open session has a step queued). The worker thread starts on demand and exits after
    ``idle_exit_s`` without work.
    """

    def __init__(self, runner: BatchHost, *, lock: threading.Lock, sessions: Mapping[str, SessionState],
                 max_batch_tokens: int, prefill_chunk_tokens: int, gather_s: float, idle_exit_s: float = 1.0):
        # weak: the runner owns its scheduler, and a cycle kept a dropped runner's blocks and KV pool allocated until
        # the cycle collector ran (a reload loaded the new span beside the old one). Every batch comes from a caller
        # holding the runner, so it is alive whenever it is used.
        self.runner = weakref.proxy(runner)
        self._sessions = sessions  # the runner's open sessions (read under ``lock``)
        self.max_batch_tokens, self.prefill_chunk_tokens = max_batch_tokens, prefill_chunk_tokens
        self.gather_s, self.idle_exit_s = gather_s, idle_exit_s
        self._cv = threading.Condition(lock)  # the runner's lock: queue and sessions change together
        self._queue: deque[_Request] = deque()
        self._seq = 0
        self._worker: threading.Thread | None = None
        self._failures: dict[tuple[str, str], int] = {}  # worker deaths by _failure_key, for the log's volume
        self.batches = 0  # statistics: batches run and rows in them
        self.rows = 0
        self.batch_failures = 0  # batches that failed whole while each row passed alone (see _compute)
        self._failures_logged, self._failure_logged_at = 0, -float("inf")

    # -------------------------------------------------------------- caller side
    def submit(self, session: SessionState, x: torch.Tensor, position: int, pages_of: PageTables, start: int,
               end: int) -> torch.Tensor:
        """Queue one step and block until its output ``[1, n, H]`` is ready (raises the step's error).

        A session alone on the runner runs its step (up to one chunk) at once in the calling thread.
        """
        req = self._enqueue(session, x, position, pages_of, start, end, inline_max_tokens=self.prefill_chunk_tokens)
        if req is None:
            return self._inline(x, position, pages_of, start, end, session.adapter)
        req.event.wait()
        return self._result(req)

    async def submit_async(self, session: SessionState, x: torch.Tensor, position: int, pages_of: PageTables,
                           start: int, end: int, *, inline_max_tokens: int = 0,
                           on_abandoned: Callable[[], None] | None = None) -> torch.Tensor:
        """:meth:`submit` for asyncio: awaits the batch without blocking the loop. ``on_abandoned``: called once the
        step is done if the caller's event loop closed meanwhile (by the worker thread, holding the runner's lock):
        the caller never resumes, so what it would let go when it does (its session, busy) is let go there."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # "Event loop is closed": nobody awaits this step any more (its result is dropped)
                logger.debug(f"the event loop of session {session.session_id!r}'s caller closed while its step "
                             f"ran: result dropped")
                if on_abandoned is not None:
                    on_abandoned()

        req = self._enqueue(session, x, position, pages_of, start, end, inline_max_tokens=inline_max_tokens,
                            on_done=wake)
        if req is None:
            return self._inline(x, position, pages_of, start, end, session.adapter)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the caller gave up: drop the step if it has not started; a started step still writes the session's
            # pages, so wait for it (one batch at most) before the session may take another step
            with self._cv:
                dropped = not req.started and self.cancel(session)
            if not dropped:
                await outlast(fut)
            raise
        return self._result(req)

    def _enqueue(self, session: SessionState, x: torch.Tensor, position: int, pages_of: PageTables, start: int,
                 end: int, *, inline_max_tokens: int, on_done: Any = None) -> _Request | None:
        with self._cv:
            # alone on the runner: nothing to batch with, so skip the hand-off to the worker (returns None)
            if (not self._queue and x.shape[1] <= inline_max_tokens
                    and all(s is session or s.closing for s in self._sessions.values())):
                return None
            self._seq += 1
            req = _Request(session, x, position, pages_of, start, end, self._seq, on_done=on_done)
            self._queue.append(req)
            # not alive: a worker that died without clearing ``_worker`` (it fails its steps first, see
            # :meth:`_loop`) would otherwise leave this step, and every later one, waiting for ever
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._loop, name="petals-chain-batcher", daemon=True)
                self._worker.start()
            self._cv.notify_all()
        return req

    def _inline(self, x: torch.Tensor, position: int, pages_of: PageTables, start: int, end: int,
                adapter: str | None = None) -> torch.Tensor:
        res = self._compute([BatchItem(x, position, pages_of, start, end, adapter)])[0]
        if isinstance(res, BaseException):
            try:
                raise res
            finally:
                del res  # held here, the exception and its traceback (every caller's frame, the runner's) are a cycle
        return res

    @staticmethod
    def _result(req: _Request) -> torch.Tensor:
        # taken off the request: the callers' frames hold the request, and the error's traceback holds their frames
        # (the runner's too); left on it, that cycle kept a dropped runner's blocks and KV pool until a collection
        error, req.error = req.error, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # the same cycle through this frame
        return req.outputs[0] if len(req.outputs) == 1 else torch.cat(req.outputs, dim=1)

    def cancel(self, session: SessionState) -> bool:
        """Drop ``session``'s queued step if it has not started; its caller gets a KeyError. Caller holds the lock."""
        for req in self._queue:
            if req.session is session and not req.started:
                self._queue.remove(req)
                req.error = _Cancelled(f"session {session.session_id!r} was released before its step ran")
                req.complete()
                return True
        return False

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    # -------------------------------------------------------------- worker side
    def _loop(self) -> None:
        """The worker thread: serves batches until idle. Should it fail (a bug), every step it leaves queued fails
        with the error, and the next step starts a new worker: a dead worker left its steps, and every later one,
        waiting for ever."""
        me = threading.current_thread()
        try:
            self._serve()
        except BaseException as e:
            what = _describe(e)
            with self._cv:
                # one hold of the lock with giving up ``_worker``: a step queued in between saw this worker alive (so
                # started none), was not failed, and waited for ever once this thread ended
                if self._worker is me:
                    self._worker = None
                failed = RuntimeError(f"the server's batch worker failed: {what}")
                failed.__cause__ = e
                while self._queue:
                    r = self._queue.popleft()
                    r.error = _own_error(failed)
                    r.complete()
                failed = None  # its traceback holds this frame (see _execute)
                # counted under the lock (a worker started meanwhile may fail too), by type and place: a message
                # that names a session or a size differs every time
                key = _failure_key(e)
                if key not in self._failures and len(self._failures) >= _MAX_FAILURE_KINDS:
                    self._failures.clear()
                repeats = self._failures[key] = self._failures.get(key, 0) + 1
            # a bug that fails every step: its traceback once, then a line at each power of two (not one per step)
            if repeats == 1:
                logger.error("the batch worker failed: its queued steps fail; the next step starts a new worker",
                             exc_info=e)
            elif repeats & (repeats - 1) == 0:
                logger.error(f"the batch worker failed again ({repeats} times so far): {what}")
            else:
                logger.debug(f"the batch worker failed again ({repeats} times so far): {what}")
        finally:
            with self._cv:
                if self._worker is me:
                    self._worker = None

    def _serve(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._cv.wait(self.idle_exit_s)
                    if not self._queue:
                        self._worker = None
                        return
                deadline = time.monotonic() + self.gather_s
                while not self._batch_ready():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch = self._take()
                if not batch:  # the queue was emptied meanwhile (a cancel): no batch, none counted
                    continue
            try:
                self._execute(batch)
            except BaseException as e:  # never leave a caller waiting
                with self._cv:
                    for r, _, _ in batch:
                        if r not in self._queue:  # completed before the failure: its caller has its result
                            continue
                        self._queue.remove(r)
                        # each its own: one object re-raised by every caller chained their tracebacks into each
                        # other, and a handler that changed it changed the others'
                        r.error = _own_error(e)
                        r.complete()
            batch = None  # not held while this worker idles (the requests reach their runner)

    def _batch_ready(self) -> bool:
        """True once waiting longer cannot grow the batch: no open session is about to send a step."""
        if any(r.done for r in self._queue):
            return True  # a chunked prefill is under way: keep it moving, take whatever else is queued
        if sum(min(r.remaining, self.prefill_chunk_tokens) for r in self._queue) >= self.max_batch_tokens:
            return True
        queued = {id(r.session) for r in self._queue}
        now = time.monotonic()
        for s in self._sessions.values():
            if s.closing or id(s) in queued:
                continue
            # still handing its last result back, or got it recently: its next step is likely close (the
            # deadline still bounds the wait). A session whose last step ended long ago (its job is at other
            # servers of the chain) is not waited for.
            if s.busy or now - s.last_used < RECENT_WINDOWS * self.gather_s:
                return False
        return True

    def _take(self) -> list[tuple[_Request, int, int]]:
        chunk = self.prefill_chunk_tokens
        starved = [r for r in self._queue if r.skipped >= 2]
        short = [r for r in self._queue if r.skipped < 2 and r.remaining <= chunk]
        long = [r for r in self._queue if r.skipped < 2 and r.remaining > chunk]
        budget, taken = self.max_batch_tokens, []
        for r in starved + short + long:
            n = min(r.remaining, chunk, budget)
            if n <= 0:
                break
            taken.append((r, r.done, n))
            r.started = True
            budget -= n
        chosen = {id(r) for r, _, _ in taken}
        for r in self._queue:
            if id(r) not in chosen:
                r.skipped += 1
        return taken

    def _execute(self, batch: list[tuple[_Request, int, int]]) -> None:
        items = [BatchItem(r.x[:, off:off + n], r.position + off, r.pages_of, r.start, r.end, r.session.adapter)
                 for r, off, n in batch]
        results = self._compute(items)
        with self._cv:
            for (r, _, n), res in zip(batch, results):
                if isinstance(res, BaseException):
                    r.error = res
                else:
                    r.outputs.append(res)
                    r.done += n
                    r.skipped = 0
                    if r.remaining > 0:
                        continue
                self._queue.remove(r)
                r.complete()
        # the rows' errors are their requests' now: held here, each one's traceback (which reaches this frame through
        # its callers') made a cycle that kept the runner's frames, and the runner, until the cycle collector ran
        results = res = None

    def _compute(self, items: list[BatchItem]) -> list[torch.Tensor | BaseException]:
        """Run ``items`` on the device as one batch; a row's error is its result."""

        def batch() -> list[torch.Tensor | BaseException]:
            self.batches += 1  # on the device: one batch at a time, so the counts need no lock of their own
            self.rows += len(items)
            if len(items) == 1:
                return [self._one(items[0])]
            try:
                return list(run_batch(self.runner, items))
            except Exception as e:
                # isolate the failure: every row again on its own, so only the row that fails gets the error
                out = [self._one(it) for it in items]
                if not any(isinstance(r, BaseException) for r in out):  # no row's fault: the batched path's
                    self._batch_failed(e, len(items))
                return out

        return self.runner.run_on_device(batch)

    def _batch_failed(self, e: BaseException, rows: int) -> None:
        """A batch of ``rows`` failed with ``e`` where each row alone passed (on the device thread): counted, and
        logged (rate-limited), else an operator never learnt that every batch now runs row by row."""
        self.batch_failures += 1
        now = time.monotonic()
        if now - self._failure_logged_at < BATCH_FAILURE_LOG_S:
            return
        since, self._failures_logged, self._failure_logged_at = \
            self.batch_failures - self._failures_logged, self.batch_failures, now
        if self._failures_logged == 1:
            logger.warning(f"a batch of {rows} rows failed where each row alone passed: the batched path is broken "
                           f"(its rows ran one by one)", exc_info=e)
        else:
            logger.warning(f"{since} more batches failed where each row alone passed ({self.batch_failures} since "
                           f"start; the last: {_describe(e)}): their rows ran one by one")

    def stats(self) -> dict[str, int]:
        """Batches run, rows in them, and batches that failed whole while each row passed alone."""
        return {"batches": self.batches, "rows": self.rows, "batch_failures": self.batch_failures}

    def _one(self, it: BatchItem) -> torch.Tensor | BaseException:
        try:
            return self.runner._run_blocks(it.x, it.position, it.pages_of, it.start, it.end,
                                           **({"adapter": it.adapter} if it.adapter is not None else {}))
        except Exception as e:  # handed to the request's caller
            return e

