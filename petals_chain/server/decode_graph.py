"""One session's one-token decode step over a span with static shapes, replayed as a CUDA graph (``--decode-graph``).

Eager PyTorch launches about 50 kernels and 100 view operations per decoder layer from Python. At batch 1 on a GPU
that, not the arithmetic, is the step: ~1 ms per block on an H200 for SmolLM2 and Llama-2-7B-shaped blocks alike
(docs/results.md), so a 3-hop chain spends ~30 ms of CPU time per token. :class:`StaticDecode` gives the step fixed
shapes so that it can be captured once and replayed with one launch:

* inputs live in static buffers: the hidden state ``[1, 1, H]``, the position ``[1, 1]``, and the session's page
  tables ``[blocks, P]`` (padded with the table's first page; ``P`` pages cover ``max_length``);
* each layer writes its K/V at ``(table[position // page_size], position % page_size)`` by tensor indexing, reads
  all ``P`` pages (``L = P * page_size`` positions) with one gather, and attends with the length mask
  ``key <= position``: the padded positions hold finite values (zero-filled pool, or stale K/V) that the mask
  removes.

Mode ``cuda`` captures one graph per span ``[start, end)`` (a runner rarely serves more than one), sharing one
memory pool, at the span's first decode step; ``eager`` runs the same static-shape step without capture, on any
device (to check this path where no GPU is). The results equal the eager path's up to floating-point rounding:
attention sums over ``L`` keys instead of ``position + 1``. Steps of several tokens (prefill, speculative
verification) and batches of several sessions keep the eager path.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from petals_chain.server.kv_cache import PagePool, PageTables

__all__ = ["DECODE_GRAPH_MODES", "StaticDecode", "check_decode_graph"]

logger = logging.getLogger(__name__)

DECODE_GRAPH_MODES = ("off", "cuda", "eager")


def check_decode_graph(mode: str, device: str | torch.device, quant: str = "none") -> None:
    """Raise ``ValueError`` for a ``--decode-graph`` mode this device or quantization cannot run."""
    if mode not in DECODE_GRAPH_MODES:
        raise ValueError(f"decode graph mode must be one of {', '.join(DECODE_GRAPH_MODES)}, got {mode!r}")
    if mode == "cuda" and torch.device(device).type != "cuda":
        raise ValueError(f"--decode-graph cuda needs --device cuda (got {device}); 'eager' runs the same "
                         f"static-shape step on any device")
    if mode != "off" and quant != "none":
        raise ValueError(f"--decode-graph {mode} runs unquantized blocks only (got --quant {quant})")


class _StaticPagedCache(Cache):
    """The K/V of one decode step at the position in :class:`StaticDecode`'s buffers (tensor indices only)."""

    def __init__(self, pool: PagePool, tables: torch.Tensor, first_block: int, page: torch.Tensor,
                 offset: torch.Tensor):
        super().__init__(layers=[])
        self.pool, self.tables, self.first_block = pool, tables, first_block
        self.page, self.offset = page, offset  # [1] each: the page row's index and the offset in that page

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables[layer_idx - self.first_block]
        page = table.index_select(0, self.page)
        out = []
        for store, new in ((self.pool.keys, key_states), (self.pool.values, value_states)):
            store[:, page, self.offset] = new[0]  # [kv_heads, 1, head_dim] at (page, offset)
            kv = store.index_select(1, table)  # [kv_heads, P, page_size, head_dim]
            out.append(kv.reshape(kv.shape[0], -1, kv.shape[3])[None])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # not known without a sync; the layers do not ask (the runner passes the mask)

    @property
    def is_compileable(self) -> bool:
        return False


class StaticDecode:
    """The static-shape decode step of a runner's sessions (see the module docstring); ``mode`` cuda or eager."""

    def __init__(self, runner: Any, mode: str):
        if mode not in ("cuda", "eager"):
            raise ValueError(f"StaticDecode mode must be cuda or eager, got {mode!r}")
        # weak: the runner owns this (a cycle kept a dropped runner's memory until the cycle collector ran, see
        # BatchScheduler); steps come through the runner, so it is alive whenever this is used
        self.runner, self.mode = weakref.proxy(runner), mode
        dev, ps = runner.device, runner.page_size
        self.pages = runner.pages_per_slot  # P: pages of a max_length session per block
        self.length = self.pages * ps  # L: positions every step attends over (masked beyond the step's)
        self.hidden = torch.zeros(1, 1, runner.hidden_size, dtype=runner.dtype, device=dev)
        self.position = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.tables = torch.zeros(runner.num_blocks, self.pages, dtype=torch.long, device=dev)
        self.keys = torch.arange(self.length, device=dev)
        self._tables_of: tuple | None = None  # (first row, *tables) in the buffer (tables compared by identity)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.steps = 0  # one-token steps this path served (eager or replayed)
        self.replays = 0
        self.captures = 0
        self.failed: str | None = None  # why capture failed (then every step runs eagerly)

    def run(self, hidden: torch.Tensor, position: int, pages_of: PageTables, start: int,
            end: int) -> torch.Tensor | None:
        """The step's output ``[1, 1, H]``, or None when this path cannot take it (the caller runs it eagerly)."""
        r = self.runner
        if self.failed is not None:
            return None
        if not self._load_tables(start, tuple(pages_of[layer] for layer in range(start, end))):
            return None
        self.hidden.copy_(hidden)
        self.position.fill_(position)
        if self.steps == 0:
            logger.info(f"one-token decode steps run with static shapes over {self.length} positions "
                        f"(--decode-graph {self.mode})")
        if self.mode == "eager":
            out = self._step(start, end)
            self.steps += 1
            return out
        graph = self._graphs.get((start, end))
        if graph is None:
            try:
                t0 = time.perf_counter()
                graph = self._capture(start, end)
                logger.info(f"captured the decode step of blocks [{start}, {end}) as a CUDA graph in "
                            f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
            except Exception as e:  # noqa: BLE001 - fall back to the eager path for good, and say why once
                self.failed = f"{type(e).__name__}: {e}"
                logger.warning(f"CUDA graph capture of blocks [{start}, {end}) failed; decoding eagerly from now "
                               f"on: {self.failed}")
                torch.cuda.synchronize(r.device)
                return None
        graph[0].replay()
        self.replays += 1
        self.steps += 1
        return graph[1].clone()

    def _load_tables(self, start: int, tables: tuple[Sequence[int], ...]) -> bool:
        """Put the step's page tables in the buffer; False if this path cannot take them (the step runs eagerly).
        A session's tables never change in place (a new page gives a new table): identity tells what is loaded."""
        base = start - self.runner.start_block
        loaded = self._tables_of
        key = (base,) + tables
        if loaded is not None and len(loaded) == len(key) and loaded[0] == base and all(
                a is b for a, b in zip(loaded[1:], tables)):
            return True
        # a page not taken yet (NO_PAGE, before a lean session's first step) would be an out-of-range index on
        # the device, where it is a fatal error rather than an exception
        if any(not 0 < len(t) <= self.pages or min(t) < 0 for t in tables):
            return False
        rows = [list(t) + [t[0]] * (self.pages - len(t)) for t in tables]
        self.tables[base:base + len(rows)].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=False)
        self._tables_of = key
        return True

    def _step(self, start: int, end: int) -> torch.Tensor:
        """The step on the static buffers (what a graph captures)."""
        r = self.runner
        pos = self.position
        page_row = torch.div(pos.view(1), r.page_size, rounding_mode="floor")
        cache = _StaticPagedCache(r.pool, self.tables, r.start_block, page_row, pos.view(1) - page_row * r.page_size)
        mask = (self.keys <= pos.view(1)).view(1, 1, 1, self.length)
        if r.config._attn_implementation != "sdpa":  # eager attention adds its mask to the scores
            additive = torch.zeros(mask.shape, dtype=r.dtype, device=mask.device)
            mask = additive.masked_fill(~mask, torch.finfo(r.dtype).min)
        return r.run_layers(self.hidden, start, end, pos, mask, cache)

    def _capture(self, start: int, end: int) -> tuple[Any, torch.Tensor]:
        """Capture the span's step. The warm-up run is this step for real (it writes the step's K/V, which the
        replay writes again identically), as capture itself runs nothing."""
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._step(start, end)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a session's input copied to the device by an RPC thread meanwhile is not an error
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._step(start, end)
        self._graphs[(start, end)] = (graph, out)
        self.captures += 1
        return graph, out

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode, "steps": self.steps, "graphs": len(self._graphs), "captures": self.captures,
                "replays": self.replays, "failed": self.failed}
