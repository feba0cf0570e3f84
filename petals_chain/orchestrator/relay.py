"""Relay of activations through a chain (hop by hop, as in the paper's modified PETALS) and batched LM head."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import secrets
import time
from typing import Any, Callable

import torch

from petals_chain.swarm.push import tensor_digest
from petals_chain.swarm.rpc import InvalidReply, NoCapacityError, RemoteError, RemoteSession

logger = logging.getLogger(__name__)


class HopFailure(Exception):
    """A server on the chain failed (dead, error reply, invalid reply, refused): the caller fails over.

    ``hop``: the index of the failed hop in its chain (None when the failure is not tied to one)."""

    def __init__(self, peer_id: str, cause: BaseException, *, no_capacity: bool = False, hop: int | None = None):
        super().__init__(f"server {peer_id[:16]}…: {type(cause).__name__}: {cause}")
        self.peer_id = peer_id
        self.cause = cause
        self.no_capacity = no_capacity
        self.hop = hop


# (peer_id, n_tokens, n_blocks, seconds of the whole hop, seconds the server reports computing or None)
HopObserver = Callable[[str, int, int, float, "float | None"], None]

# Numbers the server sessions jobs open (and the chain sessions' labels); the auditor's throwaway sessions draw from
# it too (``ChainHolder._counter`` is this counter), so their numbers interleave with the jobs' as one sequence.
SESSION_NUMBERS = itertools.count()


def hop_session_id() -> str:
    """A new id for one server session of a job (a hop, a fork, a replacement): ``r-<12 random hex>.<n>``.

    Every one is fresh: a server learns no id another server's session uses (a peer it authorizes could open a
    predictable replacement id there first, and the failover's open was refused), and no id tells it which chain,
    request or user session a session belongs to, or whether it is a replacement or an audit (same form)."""
    return f"r-{secrets.token_hex(6)}.{next(SESSION_NUMBERS)}"


def check_hop_output(out: Any, sent: torch.Tensor) -> None:
    """Raise InvalidReply unless ``out`` is what a hop must return for ``sent``: same shape and dtype, finite.

    :class:`~petals_chain.swarm.rpc.RemoteSession` checks replies on the wire already; this guards the LM head
    against any session object (the head batches rows of many jobs: one bad row must not reach it)."""
    if not isinstance(out, torch.Tensor) or out.shape != sent.shape or out.dtype != sent.dtype:
        got = f"{out.dtype}{list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise InvalidReply(f"hop returned {got} for {sent.dtype}{list(sent.shape)}")
    if not torch.isfinite(out).all():
        raise InvalidReply("hop returned NaN or inf")


class ChainSession:
    """Server sessions of one job along the hops ``[(peer_id, start, end), ...]`` of a chain.

    A hop can be moved to another server that holds its span (:meth:`replace`); the other hops keep their
    sessions and KV."""

    def __init__(self, client: Any, hops: list[tuple[str, int, int]], session_id: str, max_length: int,
                 observe: HopObserver | None = None, step_timeout_s: float = 60.0, wait_s: float = 0.0,
                 push: bool = False, adapter: str = ""):
        self.client = client
        self.adapter = adapter  # the LoRA adapter fingerprint every hop's server session runs with ("": the base)
        self.hops = list(hops)
        self.peers_used = {h[0] for h in self.hops}  # every server that fed this session's KV, replaced ones too
        self.session_id = session_id  # the chain session's label in our logs; each hop's server session has its own
        self.max_length = max_length
        self.observe = observe
        self.step_timeout_s = step_timeout_s
        self.wait_s = wait_s  # > 0: servers queue the opens (FIFO) up to this long instead of refusing
        # ... but a server that sends no heartbeats while an open waits only this long a time: its silence cannot
        # tell a long wait from a lost reply (the caller sends the open again)
        self.silent_wait_max_s = math.inf
        self._sessions: list[Any] = []
        self._current: asyncio.Future | None = None
        self._current_peer: str | None = None
        self._aborted: set[str] = set()
        self.cached_tokens = 0  # leading tokens of the prompt named at open that every hop's prefix cache held
        self.prefix_cache = False  # every hop's server keeps closed sessions' pages as cached prefixes
        self.push = push and len(self.hops) > 1  # --relay push: servers forward each step to the next hop
        self._step_ids = itertools.count(1)  # numbers push steps (a server takes the push of the step it awaits)
        self.push_rescues = 0  # pushes the orchestrator made itself because a hop could not
        self.push_mismatches = 0  # pushed steps computed on another input than the previous hop's reply
        self._push_current: dict[str, asyncio.Future] = {}  # peer -> its step in flight (push mode)
        self._opening: dict[str, asyncio.Future] = {}  # peer -> its open in flight (may wait long at the server)

    def abort(self, peer_id: str) -> bool:
        """``peer_id`` is known dead: fail the step waiting on it now (not at the timeout), and any later one."""
        if peer_id not in (h[0] for h in self.hops):
            return False
        self._aborted.add(peer_id)
        current = self._current if self._current_peer == peer_id else None
        for inner in (current, self._push_current.get(peer_id), self._opening.get(peer_id)):
            if inner is not None and not inner.done():
                inner.cancel()
        return True

    def wait_for(self, peer_id: str) -> float:
        """How long ``peer_id`` may queue this session's open (s): :attr:`wait_s`, at most
        :attr:`silent_wait_max_s` on a server that does not heartbeat a waiting open."""
        if self.wait_s <= 0:
            return 0.0
        heartbeats = getattr(self.client, "heartbeats", None)
        if heartbeats is not None and heartbeats(peer_id):
            return self.wait_s
        return min(self.wait_s, self.silent_wait_max_s)

    async def open(self, fork_from: "ChainSession | None" = None, fork_length: int = 0, named: bytes = b"") -> None:
        """Open a session on every hop (concurrently). On failure closes what was opened and raises HopFailure.

        ``fork_from``: an open session on the same hops whose first ``fork_length`` tokens of KV every server
        copies into the new session (``n > 1`` samples share one prefill). ``named``: the prefix hashes of the
        tokens the job will feed first (all but the last one, whose output it samples from); servers with a prefix
        cache say how much of them they hold, and :attr:`cached_tokens` is the part every hop holds: the first step
        may start there."""
        if fork_from is not None and (fork_from.hops != self.hops or not fork_from._sessions):
            raise ValueError("fork_from must be an open session on the same hops")
        # each hop forks its own server's session (read now: the source may close while we await)
        sources = [s.session_id for s in fork_from._sessions] if fork_from is not None else []
        if fork_from is not None:
            named = b""

        async def one(j, peer, start, end):
            sid = hop_session_id()
            wait_s = self.wait_for(peer)
            extra = {"wait_s": wait_s} if wait_s > 0 else {}
            if self.push:
                extra["push_token"] = secrets.token_hex(16)
            if named:
                extra["prefix_hashes"] = named
            if fork_from is not None:
                extra = {"fork_from": sources[j], "fork_length": int(fork_length),
                         **({"push_token": extra["push_token"]} if self.push else {})}
            if self.adapter:
                extra["adapter"] = self.adapter
            if peer in self._aborted:
                raise ConnectionError("the server was declared failed")
            # An open queued at the server (wait_s) may wait minutes: abort() cancels it when the server is declared
            # failed, since a dead peer's stream may never end.
            async def opening() -> RemoteSession:
                # asyncio.timeout, not wait_for: wait_for's inner task, cancelled by abort() while its open failed,
                # ended with an exception nobody read (Python 3.11; see rpc._await_next).
                async with asyncio.timeout(self.step_timeout_s + wait_s):
                    return await self.client.open_session(peer, session_id=sid, start_block=start, end_block=end,
                                                          max_length=self.max_length, **extra)

            task = self._opening[peer] = asyncio.ensure_future(opening())
            try:
                return await task
            except asyncio.CancelledError:
                if peer in self._aborted and not _current_task_cancelling():
                    raise ConnectionError("the server was declared failed") from None
                task.cancel()
                task.add_done_callback(_close_if_opened)  # we leave: an open that got through is closed
                raise
            finally:
                if self._opening.get(peer) is task:
                    del self._opening[peer]

        if self.wait_s > 0:
            # Waiting opens go one by one in route order: every route visits servers in increasing order of
            # their span's end, so holding earlier hops while waiting for later ones cannot deadlock.
            results = []
            for j, h in enumerate(self.hops):
                try:
                    results.append(await one(j, *h))
                except BaseException as e:  # noqa: BLE001 - reported below like gather's exceptions
                    if isinstance(e, asyncio.CancelledError):
                        await asyncio.gather(*(s.close() for s in results), return_exceptions=True)
                        raise
                    results.append(e)
                    break
        else:
            tasks = [asyncio.ensure_future(one(j, *h)) for j, h in enumerate(self.hops)]
            try:
                results = await asyncio.gather(*tasks, return_exceptions=True)
            except asyncio.CancelledError:
                # the hops already open would stay open at their servers (their slot counted free here) until the
                # servers' idle timeout: close them, and any that opens still
                for t in tasks:
                    t.cancel()
                    t.add_done_callback(_close_if_opened)
                raise
        failure: HopFailure | None = None
        opened = []
        for i, ((peer, _, _), res) in enumerate(zip(self.hops, results)):  # sequential opens stop at a failure
            if isinstance(res, BaseException):
                if failure is None or isinstance(failure.cause, NoCapacityError):
                    failure = HopFailure(peer, res, no_capacity=isinstance(res, NoCapacityError), hop=i)
            else:
                opened.append(res)
        if failure is not None:
            await asyncio.gather(*(s.close() for s in opened), return_exceptions=True)
            raise failure
        self._sessions = list(results)
        if logger.isEnabledFor(logging.DEBUG):  # each hop's id, to find it in the servers' logs
            logger.debug("session %s: hops opened as %s", self.session_id,
                         [getattr(s, "session_id", None) for s in self._sessions])
        self.cached_tokens = min(getattr(s, "cached_tokens", 0) for s in self._sessions) if named else 0
        self.prefix_cache = all(getattr(s, "prefix_cache", False) for s in self._sessions)

    async def step(self, i: int, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Run ``hidden`` [1, n, H] (positions ``position..``) through hop ``i``; HopFailure(hop=i) if it fails or
        returns anything but finite hidden states of the same shape and dtype."""
        peer, start, end = self.hops[i]
        if peer in self._aborted:
            raise HopFailure(peer, ConnectionError("the server was declared failed"), hop=i)
        sess = self._sessions[i]
        t0 = time.perf_counter()
        # The step timeout is the ServerClient's (one task per hop here keeps the relay cheap).
        self._current, self._current_peer = asyncio.ensure_future(sess.step(hidden, position)), peer
        try:
            out = await self._current
        except asyncio.CancelledError:
            if peer in self._aborted and not _current_task_cancelling():
                raise HopFailure(peer, ConnectionError("the server was declared failed"), hop=i) from None
            self._current.cancel()
            raise
        except BaseException as e:  # any RPC failure means this hop is unusable for this job
            raise HopFailure(peer, e, hop=i) from e
        finally:
            self._current, self._current_peer = None, None
        try:
            check_hop_output(out, hidden)
        except InvalidReply as e:
            raise HopFailure(peer, e, hop=i) from e
        if self.observe is not None:
            self.observe(peer, int(hidden.shape[1]), end - start, time.perf_counter() - t0,
                         getattr(sess, "last_compute_s", None))
        return out

    async def forward(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Run ``hidden`` [1, n, H] (positions ``position..``) through every hop in order."""
        for i in range(len(self.hops)):
            hidden = await self.step(i, hidden, position)
        return hidden

    def _route(self, first: int) -> list[dict]:
        """The push route from hop ``first`` to the end of the chain."""
        return [{"peer": peer, "session_id": self._sessions[j].session_id, "token": self._sessions[j].push_token}
                for j, (peer, _, _) in enumerate(self.hops) if j >= first]

    async def _push_step(self, i: int, hidden: torch.Tensor, position: int, step_id: int) -> torch.Tensor:
        """Hop ``i``'s part of a push step: hop 0 gets ``hidden`` and the route, later hops await their push."""
        peer, start, end = self.hops[i]
        if peer in self._aborted:
            raise HopFailure(peer, ConnectionError("the server was declared failed"), hop=i)
        sess = self._sessions[i]
        kwargs = {"route": self._route(1), "step_id": step_id} if i == 0 else {"pushed": True, "step_id": step_id}
        inner = self._push_current[peer] = asyncio.ensure_future(sess.step(hidden, position, **kwargs))
        try:
            out = await inner
            check_hop_output(out, hidden)
        except asyncio.CancelledError:
            if peer in self._aborted and not _current_task_cancelling():
                raise HopFailure(peer, ConnectionError("the server was declared failed"), hop=i) from None
            inner.cancel()
            raise
        except BaseException as e:  # noqa: BLE001 - any RPC failure means this hop is unusable for this job
            raise HopFailure(peer, e, hop=i) from e
        finally:
            if self._push_current.get(peer) is inner:
                del self._push_current[peer]
        if self.observe is not None and sess.last_compute_s is not None:
            # a hop's reply time in push mode includes waiting for its input: only its compute is observed
            self.observe(peer, int(hidden.shape[1]), end - start, None, sess.last_compute_s)
        return out

    async def forward_push(self, hidden: torch.Tensor, position: int, recover: Callable) -> list[torch.Tensor]:
        """Run ``hidden`` through every hop with server-to-server pushes; returns every hop's output, in order.

        All hops get their step at once: hop 0 with the input and the route, the others await the previous hop's
        push. A hop that fails is given to ``await recover(i, failure, its_input)``, which returns its output
        (another server took the hop over) or raises (the chain is lost: the other hops' steps are abandoned and
        their streams closed). Where a hop's output did not reach the next hop, the orchestrator pushes it; a hop
        that waited its push timeout for a push said to be sent makes the session relay from then on."""
        step_id = next(self._step_ids)
        tasks = [asyncio.ensure_future(self._push_step(i, hidden, position, step_id)) for i in range(len(self.hops))]
        outs: list[torch.Tensor] = []
        unreachable: HopFailure | None = None  # the next hop, which our own push could not reach either
        failed_over: dict[int, str] = {}  # hop -> the server whose session failed in this step (it may have pushed)
        try:
            for i, task in enumerate(tasks):
                x_in = hidden if i == 0 else outs[-1]
                try:
                    if unreachable is not None:
                        task.cancel()
                        raise unreachable
                    out = await task
                    pushed = self._sessions[i].pushed is not False
                except HopFailure as e:
                    if i > 0 and isinstance(e.cause, RemoteError) and e.cause.no_push:
                        # the hop waited its whole push timeout for an input that never came, though the hop before
                        # said it pushed (lost, or a hostile hop lying): a hop that keeps not pushing would make every
                        # step wait as long
                        logger.warning("session %s: hop %d (%s) got no push from %s; relaying through the "
                                       "orchestrator from now on", self.session_id, i, self.hops[i][0][:12],
                                       self.hops[i - 1][0][:12])
                        self.push = False
                    out = await recover(i, e, x_in)  # a new session: it awaits no push
                    failed_over[i] = e.peer_id
                    pushed = False
                else:
                    if i > 0 and self._sessions[i].input_digest != tensor_digest(x_in):
                        return outs + await self._relay_rest(i, x_in, position, tasks[i + 1:], recover,
                                                             failed_over.get(i - 1))
                unreachable = None
                outs.append(out)
                if i + 1 < len(self.hops) and not pushed:
                    # the next hop still waits for this step's input: deliver it, with the rest of the route
                    self.push_rescues += 1
                    nxt = self._route(i + 1)
                    try:
                        await self.client.push(nxt[0], position, step_id, nxt[1:], out, timeout_s=self.step_timeout_s)
                    except Exception as e:  # noqa: BLE001 - refused, unreachable, or its handler's error (a hostile
                        # or broken hop answers P2PHandlerError, neither of the two: it failed the request)
                        unreachable = HopFailure(self.hops[i + 1][0], e, hop=i + 1)
            return outs
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _relay_rest(self, i: int, x: torch.Tensor, position: int, later: list[asyncio.Future],
                          recover: Callable, failed_peer: str | None = None) -> list[torch.Tensor]:
        """Hop ``i`` computed on a push that is not the previous hop's reply (or did not say what it took): one of
        the two is dishonest or broken, and which cannot be told here. Its output and every later hop's are
        discarded; hops ``i..`` run again on the reply, relayed through us (each step overwrites the positions the
        pushed one wrote), and the chain relays from now on. Nobody is struck: the audits judge the relayed steps.

        ``failed_peer``: hop ``i - 1`` failed over in this step from that server, which may have pushed before it
        failed; the reply is its replacement's. Handled the same, but said so and not counted a push mismatch."""
        self.push = False
        if failed_peer is not None:
            logger.warning("session %s: hop %d (%s) computed on a push of %s, whose step then failed (hop %d moved to "
                           "%s); hops %d.. run again on the replacement's output, relayed through the orchestrator "
                           "from now on", self.session_id, i, self.hops[i][0][:12], failed_peer[:12], i - 1,
                           self.hops[i - 1][0][:12], i)
        else:
            self.push_mismatches += 1
            logger.warning("session %s: hop %d (%s) computed on a push that is not %s's reply; relaying through the "
                           "orchestrator from now on", self.session_id, i, self.hops[i][0][:12],
                           self.hops[i - 1][0][:12])
        if later:  # their steps consume pushes already made: let them end, so their streams stay usable
            await asyncio.wait(later, timeout=self.step_timeout_s)
        outs = []
        for j in range(i, len(self.hops)):
            try:
                x = await self.step(j, x, position)
            except HopFailure as e:
                x = await recover(j, e, x)
            outs.append(x)
        return outs

    async def replace(self, i: int, peer: str, history: torch.Tensor | None, hidden: torch.Tensor,
                      position: int) -> torch.Tensor:
        """Move hop ``i`` to ``peer`` (a server holding its span): open a session there, replay ``history`` (what
        the hop received for positions ``0..position-1``) together with ``hidden`` (this step's input at
        ``position..``), and return the hop's output for ``hidden``. The old session is closed, and
        :attr:`prefix_cache` says again whether every hop keeps prefixes. HopFailure(hop=i) if ``peer`` refuses,
        fails or answers garbage; the hop is then unchanged."""
        _, start, end = self.hops[i]
        sid = hop_session_id()  # not derived from any id a server saw: a peer could open it there first
        extra = {"push_token": secrets.token_hex(16)} if self.push else {}
        if self.adapter:
            extra["adapter"] = self.adapter
        try:
            async with asyncio.timeout(self.step_timeout_s):  # not wait_for: it can swallow our cancellation
                sess = await self.client.open_session(peer, session_id=sid, start_block=start, end_block=end,
                                                      max_length=self.max_length, **extra)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - refused, full or unreachable: the caller tries another
            raise HopFailure(peer, e, no_capacity=isinstance(e, NoCapacityError), hop=i) from e
        x = hidden if history is None or position == 0 else torch.cat([history.to(hidden.dtype), hidden], dim=1)
        try:
            out = await sess.step(x, 0)
            check_hop_output(out, x)
        except BaseException as e:
            await asyncio.gather(sess.close(), return_exceptions=True)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise HopFailure(peer, e, hop=i) from e
        old, self._sessions[i] = self._sessions[i], sess
        self.hops[i] = (peer, start, end)
        self.peers_used.add(peer)
        self._aborted.discard(peer)  # declared failed once, banned, back: this session on it is new
        # the new server may keep no prefixes (or the old one kept none): a session's chain is then held between
        # turns (released, its next turn recomputed the whole history) and not entered in the prefix directory
        self.prefix_cache = all(getattr(s, "prefix_cache", False) for s in self._sessions)
        await asyncio.gather(old.close(), return_exceptions=True)
        logger.debug("session %s: hop %d moved to %s as %s", self.session_id, i, peer[:12], sid)
        return out[:, position:]

    async def extend(self, max_length: int) -> None:
        """Let every hop's session hold up to ``max_length`` tokens (concurrently). HopFailure (``no_capacity`` when
        a server has too few free pages) if any hop refuses or fails; hops that granted it keep the larger limit."""
        results = await asyncio.gather(*(asyncio.wait_for(s.extend(max_length), timeout=self.step_timeout_s)
                                         for s in self._sessions), return_exceptions=True)
        failure: HopFailure | None = None
        for i, ((peer, _, _), res) in enumerate(zip(self.hops, results)):
            if isinstance(res, asyncio.CancelledError):
                raise res
            if isinstance(res, BaseException) and (failure is None or failure.no_capacity):
                failure = HopFailure(peer, res, no_capacity=isinstance(res, NoCapacityError), hop=i)
        if failure is not None:
            raise failure
        self.max_length = max(self.max_length, int(max_length))

    async def keepalive(self, now: float) -> None:
        """Keep every hop's server session alive while the job holds it idle (between a session's turns): a
        hop silent for a third of the idle timeout its server announced gets a keepalive."""
        due = [s for s in self._sessions if getattr(s, "idle_timeout_s", None)
               and not s.closed and now - s.last_io > s.idle_timeout_s / 3]
        if due:
            await asyncio.gather(*(s.keepalive() for s in due), return_exceptions=True)

    async def close(self, named: bytes = b"") -> None:
        """Close every hop. ``named``: the prefix hashes of the tokens whose KV every hop holds: servers keep their
        full pages in their prefix caches for later prompts that start with them."""
        sessions, self._sessions = self._sessions, []
        await asyncio.gather(*(s.close(prefix_hashes=named) if named else s.close() for s in sessions),
                             return_exceptions=True)


_CLOSING: set[asyncio.Future] = set()  # closes nobody awaits (the event loop keeps only weak references to tasks)


def _close_if_opened(task: asyncio.Future) -> None:
    """A finished open whose waiter has left: close the session it opened, if it did (a failure is no news)."""
    if task.cancelled() or task.exception() is not None:
        return
    session = task.result()
    if session is not None:
        closing = asyncio.ensure_future(session.close())
        _CLOSING.add(closing)
        closing.add_done_callback(lambda f: (_CLOSING.discard(f), f.cancelled() or f.exception()))


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

    async def verify(self, hidden: torch.Tensor, seq: Any, draft: list[int]) -> tuple[list, torch.Tensor]:
        """Speculative decoding: ``hidden`` [len(draft) + 1, H] are the last block's outputs at the positions of the
        token just fed and of each draft token. -> (the TokenChoices to emit, see
        :func:`~petals_chain.orchestrator.sampling.verify_drafts`, which also advances ``seq``; the embedding
        [1, 1, H] of the last one)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._verify, hidden, seq, draft)

    def _verify(self, hidden: torch.Tensor, seq: Any, draft: list[int]) -> tuple[list, torch.Tensor]:
        from petals_chain.orchestrator.sampling import verify_drafts

        with torch.inference_mode():
            logits = self.head.logits(hidden.reshape(1, -1, hidden.shape[-1]))[0]
            choices = verify_drafts(logits, seq, draft)
            emb = self.head.embed(torch.tensor([[choices[-1].token]], dtype=torch.long)).cpu()
        return choices, emb

    async def pool(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """An embedding (``/v1/embeddings``): ``hidden_last`` [H], the last block's output at a sequence's last
        token -> the final norm's output, L2-normalized, float32 [H] on the CPU (vLLM's default pooling of a decoder
        LM: the last token, normalized)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._pooled, hidden_last)

    def _pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            normed = self.head.norm(hidden.reshape(-1).to(device=self.head.device, dtype=self.head.dtype))
            return torch.nn.functional.normalize(normed.float(), dim=-1).cpu()

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
                    if fut.done():
                        continue
                    if isinstance(result, BaseException):  # that row's own failure (no token to sample)
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
            except BaseException as e:  # deliver the error to every waiter rather than hang them
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                if isinstance(e, asyncio.CancelledError):
                    raise

    def _compute(self, hidden: torch.Tensor, seqs: list) -> list[tuple[Any, torch.Tensor] | BaseException]:
        """Per row: (TokenChoice, its token's embedding), or the row's SamplingError (it fails that request alone)."""
        from petals_chain.orchestrator.sampling import sample_rows

        with torch.inference_mode():
            logits = self.head.logits(hidden)[:, -1, :]
            choices = sample_rows(logits, seqs)
            ids = [[0 if isinstance(c, BaseException) else c.token] for c in choices]  # (a failed row's is unused)
            emb = self.head.embed(torch.tensor(ids, dtype=torch.long)).cpu()
        return [c if isinstance(c, BaseException) else (c, emb[i:i + 1]) for i, c in enumerate(choices)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
