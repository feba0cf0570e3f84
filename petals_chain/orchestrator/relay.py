"""Relay of activations through a chain (hop by hop, as in the paper's modified PETALS) and batched LM head."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


class HopFailure(Exception):
    """A server on the chain failed (dead, error reply, refused): the caller fails over."""

    def __init__(self, peer_id: str, cause: BaseException, *, no_capacity: bool = False):
        super().__init__(f"server {peer_id[:16]}…: {type(cause).__name__}: {cause}")
        self.peer_id = peer_id
        self.cause = cause
        self.no_capacity = no_capacity


def _rpc_errors():
    from petals_chain.swarm import rpc

    no_cap = getattr(rpc, "NoCapacityError", None)
    if no_cap is None:
        from petals_chain.server.runner import NoCapacityError as no_cap  # type: ignore[no-redef]
    return no_cap


# (peer_id, n_tokens, n_blocks, seconds of the whole hop, seconds the server reports computing or None)
HopObserver = Callable[[str, int, int, float, "float | None"], None]


class ChainSession:
    """Server sessions of one job along the hops ``[(peer_id, start, end), ...]`` of a chain."""

    def __init__(self, client: Any, hops: list[tuple[str, int, int]], session_id: str, max_length: int,
                 observe: HopObserver | None = None, step_timeout_s: float = 60.0, wait_s: float = 0.0):
        self.client = client
        self.hops = hops
        self.session_id = session_id
        self.max_length = max_length
        self.observe = observe
        self.step_timeout_s = step_timeout_s
        self.wait_s = wait_s  # > 0: servers queue the opens (FIFO) up to this long instead of refusing
        self._sessions: list[Any] = []
        self._current: asyncio.Future | None = None
        self._aborted: str | None = None

    def abort(self, peer_id: str) -> bool:
        """``peer_id`` is known dead: fail the step waiting on it now instead of at the timeout."""
        if peer_id not in (h[0] for h in self.hops):
            return False
        self._aborted = peer_id
        if self._current is not None and not self._current.done():
            self._current.cancel()
        return True

    async def open(self, fork_from: "ChainSession | None" = None, fork_length: int = 0) -> None:
        """Open a session on every hop (concurrently). On failure closes what was opened and raises HopFailure.

        ``fork_from``: an open session on the same hops whose first ``fork_length`` tokens of KV every server
        copies into the new session (``n > 1`` samples share one prefill)."""
        no_cap = _rpc_errors()
        if fork_from is not None and (fork_from.hops != self.hops or not fork_from._sessions):
            raise ValueError("fork_from must be an open session on the same hops")

        async def one(peer, start, end):
            extra = {"wait_s": self.wait_s} if self.wait_s > 0 else {}
            if fork_from is not None:
                extra = {"fork_from": fork_from.session_id, "fork_length": int(fork_length)}
            return await asyncio.wait_for(
                self.client.open_session(peer, session_id=self.session_id, start_block=start, end_block=end,
                                         max_length=self.max_length, **extra),
                timeout=self.step_timeout_s + self.wait_s,
            )

        if self.wait_s > 0:
            # Waiting opens go one by one in route order: every route visits servers in increasing order of
            # their span's end, so holding earlier hops while waiting for later ones cannot deadlock.
            results = []
            for h in self.hops:
                try:
                    results.append(await one(*h))
                except BaseException as e:  # noqa: BLE001 - reported below like gather's exceptions
                    if isinstance(e, asyncio.CancelledError):
                        await asyncio.gather(*(s.close() for s in results), return_exceptions=True)
                        raise
                    results.append(e)
                    break
        else:
            results = await asyncio.gather(*(one(*h) for h in self.hops), return_exceptions=True)
        failure: HopFailure | None = None
        opened = []
        for (peer, _, _), res in zip(self.hops, results):  # sequential opens stop at the first failure
            if isinstance(res, BaseException):
                if failure is None or isinstance(failure.cause, no_cap):
                    failure = HopFailure(peer, res, no_capacity=isinstance(res, no_cap))
            else:
                opened.append(res)
        if failure is not None:
            await asyncio.gather(*(s.close() for s in opened), return_exceptions=True)
            raise failure
        self._sessions = list(results)

    async def forward(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Run ``hidden`` [1, n, H] (positions ``position..``) through every hop in order."""
        n = int(hidden.shape[1])
        for (peer, start, end), sess in zip(self.hops, self._sessions):
            if self._aborted is not None:
                raise HopFailure(self._aborted, ConnectionError("the server was declared failed"))
            t0 = time.perf_counter()
            # The step timeout is the ServerClient's (one task per hop here keeps the relay cheap).
            self._current = asyncio.ensure_future(sess.step(hidden, position))
            try:
                hidden = await self._current
            except asyncio.CancelledError:
                if self._aborted is not None and not _current_task_cancelling():
                    raise HopFailure(self._aborted, ConnectionError("the server was declared failed")) from None
                self._current.cancel()
                raise
            except BaseException as e:  # any RPC failure means this hop is unusable for this job
                raise HopFailure(peer, e) from e
            finally:
                self._current = None
            if self.observe is not None:
                self.observe(peer, n, end - start, time.perf_counter() - t0, getattr(sess, "last_compute_s", None))
        return hidden

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, []
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)


def _current_task_cancelling() -> bool:
    """True if the task running us is itself being cancelled (not just the step we awaited)."""
    task = asyncio.current_task()
    return bool(task is not None and task.cancelling())


class HeadBatcher:
    """The orchestrator's model head for every active generation: LM head + sampling, batched, off the event loop.

    Rows that arrive while a batch computes (or within ``window_s`` of the first) share one LM-head matrix
    multiply and one vectorized :func:`~petals_chain.orchestrator.sampling.sample_batch`; the batch also embeds
    the tokens it sampled, so the next relay step needs no tensor work on the event loop. Everything runs in one
    worker thread on the head's device.
    """

    def __init__(self, head: Any, window_s: float = 0.0, max_batch: int = 256):
        self.head = head
        self.window_s = window_s
        self.max_batch = max_batch
        self._queue: list[tuple[torch.Tensor, Any, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lm-head")
        self.batches = 0
        self.rows = 0
        self.on_batch: Callable[[int], None] | None = None  # rows per batch, for metrics

    async def sample(self, hidden_last: torch.Tensor, seq: Any) -> tuple[Any, torch.Tensor]:
        """``hidden_last`` [H] (the last block's output) -> (TokenChoice, embedding [1, 1, H] of that token on the CPU).

        ``seq`` is the sequence's :class:`~petals_chain.orchestrator.sampling.SequenceSampler`; the caller appends
        the token to it (a token it does not use must not count for penalties)."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((hidden_last.reshape(-1), seq, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return await fut

    async def embed(self, ids: list[int]) -> torch.Tensor:
        """Token ids -> hidden states ``[1, n, H]`` on the CPU (in the worker thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._embed, ids)

    async def score(self, hidden: torch.Tensor, ids: list[int], k: int) -> list:
        """Prompt logprobs: ``hidden`` [n, H] are the last block's outputs at the positions of ``ids``; position i
        scores token i+1 (the first token gets None)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._score, hidden, ids, k)

    def _embed(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.head.embed(torch.tensor([ids], dtype=torch.long)).cpu()

    def _score(self, hidden: torch.Tensor, ids: list[int], k: int) -> list:
        from petals_chain.orchestrator.sampling import prompt_logprobs

        with torch.inference_mode():
            return prompt_logprobs(self.head.logits(hidden.reshape(1, -1, hidden.shape[-1]))[0], ids, k)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            # Let every session whose last hop already answered in this loop iteration join the batch;
            # an optional window waits a little longer (trades latency for bigger batches).
            await asyncio.sleep(self.window_s if self.window_s > 0 else 0)
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
            try:
                hidden = torch.stack([h for h, _, _ in batch]).unsqueeze(1)  # [B, 1, H]
                out = await loop.run_in_executor(self._pool, self._compute, hidden, [s for _, s, _ in batch])
                self.batches += 1
                self.rows += len(batch)
                if self.on_batch is not None:
                    self.on_batch(len(batch))
                for (_, _, fut), result in zip(batch, out):
                    if not fut.done():
                        fut.set_result(result)
            except BaseException as e:  # deliver the error to every waiter rather than hang them
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                if isinstance(e, asyncio.CancelledError):
                    raise

    def _compute(self, hidden: torch.Tensor, seqs: list) -> list[tuple[Any, torch.Tensor]]:
        from petals_chain.orchestrator.sampling import sample_batch

        with torch.inference_mode():
            logits = self.head.logits(hidden)[:, -1, :]
            choices = sample_batch(logits, seqs)
            emb = self.head.embed(torch.tensor([[c.token] for c in choices], dtype=torch.long)).cpu()
        return [(c, emb[i:i + 1]) for i, c in enumerate(choices)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
