"""Multi-turn sessions: a job that keeps its KV between calls, its lease, and keepalives.

Between turns a session gives its chain back when every hop has a prefix cache (the servers keep the KV as
cached prefixes and dispatch prefers that chain for the next turn, which recomputes only what was evicted);
otherwise, or with ``--hold-sessions``, it holds the chain and its server sessions. The lease: a session idle for ``session_idle_timeout_s`` is closed by the reaper. Servers drop a session
stream idle for the ``idle_timeout_s`` they announce at open (120 s by default), usually shorter: so while a
job holds its sessions idle (between turns), every hop gets a keepalive after a third of its server's timeout.
A session a server dropped anyway (it restarted, or a keepalive came too late) fails over on its next step:
the hop is re-opened and its inputs replayed (:mod:`~petals_chain.orchestrator.failover`), never an error.

:class:`SessionMixin` holds these methods of :class:`~petals_chain.orchestrator.core.Orchestrator`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from petals_chain.orchestrator.deadlines import DEADLINE
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.generation import Emit, Generation
from petals_chain.orchestrator.sampling import SamplingParams

logger = logging.getLogger(__name__)

# How long a turn that finds another running waits for it to end before its 409: a client that left a streamed turn
# (its next turn sent at once) is noticed and its turn given up within this, and then the next one runs.
TURN_GRACE_S = 5.0


class UserSession:
    """A multi-turn session: one job that keeps its chain and KV between calls.

    ``history`` is the session's token sequence after its last completed turn; ``messages`` the conversation
    of a chat session (None for a session fed raw text or token ids). A turn that fails or is aborted leaves
    both exactly as they were."""

    def __init__(self, orch: Any, max_length: int):
        self.id = uuid.uuid4().hex
        self.holder = ChainHolder(orch, f"s-{self.id[:12]}", max_length)
        self.history: list[int] = []
        self.messages: list[dict] | None = None
        self.lock = asyncio.Lock()
        self.last_used = time.monotonic()
        self.created = time.time()
        self.turns = 0
        self.last_chain: list[str] = []  # the chain of the last turn (released between turns, see below)
        self.turn: asyncio.Task | None = None  # the task running a turn now (a close cancels it)
        self.closed = False

    async def wait_turn_end(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the turn running (if any) to end; True if none runs now."""
        if not self.lock.locked():
            return True
        try:
            await asyncio.wait_for(self.lock.acquire(), timeout)
        except asyncio.TimeoutError:
            return False
        self.lock.release()
        return True

    def snapshot(self) -> tuple[list[int], list[dict] | None, int]:
        """The session's state between turns, for :meth:`forget_turn`."""
        return list(self.history), None if self.messages is None else list(self.messages), self.turns

    def forget_turn(self, before: tuple[list[int], list[dict] | None, int]) -> bool:
        """Undo the one turn completed since ``before`` (its client never got it); False if that is not the case
        (no turn completed, or another one runs or ran since). The chain's KV is reconciled by the next turn."""
        if self.lock.locked() or self.turns != before[2] + 1:
            return False
        self.history, self.messages, self.turns = list(before[0]), before[1], before[2]
        return True

    @property
    def max_length(self) -> int:
        return self.holder.max_length


class SessionMixin:
    """The session methods of the Orchestrator (it provides ``sessions``, ``siblings``, ``chain_sessions``, ``cfg``,
    ``stats``, ``_stop``, ``_decode_loop``, ``validate_prompt`` and ``_max_tokens``)."""

    def open_session(self, max_length: int | None = None) -> UserSession:
        if sum(len(o.sessions) for o in self.siblings) >= self.cfg.max_sessions:  # every model's, in total
            raise RequestError(f"too many open sessions ({self.cfg.max_sessions})", status=429,
                               code="too_many_sessions")
        ml = self.cfg.max_length if max_length is None else int(max_length)
        if not (2 <= ml <= self.cfg.max_length):
            raise RequestError(f"max_length must be in [2, {self.cfg.max_length}], got {ml}", param="max_length",
                               code="invalid_value")
        s = UserSession(self, ml)
        self.sessions[s.id] = s
        return s

    def get_session(self, session_id: str) -> UserSession:
        s = self.sessions.get(session_id)
        if s is None:
            raise RequestError(f"no open session {session_id!r}", status=404, code="session_not_found")
        return s

    async def close_session(self, session_id: str) -> None:
        """Close a session: a turn running ends at once (its caller gets 404 ``session_not_found``)."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            raise RequestError(f"no open session {session_id!r}", status=404, code="session_not_found")
        s.closed = True
        if s.turn is not None:  # else it ran on to its end (the close waiting), computing for a closed session
            s.turn.cancel()
        async with s.lock:
            await s.holder.close()

    def session_messages(self, s: UserSession, new: list[dict]) -> list[dict]:
        """The whole conversation after a chat turn adding ``new`` (refused for a raw-text session)."""
        if s.messages is None and s.history:
            raise RequestError("this session was fed raw text or token ids; chat messages cannot continue it",
                               param="messages", code="session_mode")
        return list(s.messages or []) + list(new)

    def session_target(self, s: UserSession, new_ids: list[int]) -> list[int]:
        """The session's token sequence after a raw turn adding ``new_ids`` (refused for a chat session)."""
        if s.messages is not None:
            raise RequestError("this is a chat session; continue it with messages", param="prompt",
                               code="session_mode")
        return s.history + list(new_ids)

    async def session_generate(self, s: UserSession, target: list[int], params: SamplingParams, *,
                               explicit_max_tokens: bool = True, emit: Emit | None = None,
                               messages: list[dict] | None = None, based_on: int | None = None) -> Generation:
        """Continue session ``s`` so that its tokens are ``target`` (the history plus this turn's input, or a
        chat conversation templated at once), then generate. Only the tokens the chain does not hold yet are
        fed; on failure or cancellation the session stays as it was before the turn. ``based_on``: the session's
        turns when ``target`` was built; another turn since is a 409 (its target would undo that turn)."""
        if s.closed:  # first: a close holds the lock while it closes the chain (a 409 would invite a retry)
            raise RequestError("the session was closed", status=404, code="session_not_found")
        if s.lock.locked():
            raise RequestError("this session is already generating", status=409, code="session_busy")
        async with s.lock:
            if s.id not in self.sessions:
                raise RequestError("the session was closed", status=404, code="session_not_found")
            if based_on is not None and s.turns != based_on:
                raise RequestError("the session took another turn while this request was read; send it again",
                                   status=409, code="session_busy")
            self.validate_prompt(target, params.max_tokens, explicit_max_tokens, max_length=s.max_length)
            self.check_speculative(params)
            params = SamplingParams(**{**params.__dict__, "stop": list(params.stop), "max_tokens": self._max_tokens(
                params.max_tokens, len(target), s.max_length, explicit_max_tokens, session=True)})
            s.last_used = time.monotonic()
            if self.planner is not None:  # a turn is a request to the planner's rate and the model placement
                self.planner.rates.arrive()
            holder = s.holder
            holder.relay = params.relay  # for the chain it opens next (a held chain keeps its mode)
            wait0 = holder.wait_s
            t0 = time.monotonic()
            # a new request unless it holds its chain: a turn cut or failed before this one left it marked admitted
            # (its next turn took the re-queue lane)
            holder.admitted = holder.cs is not None
            if s.turns:
                holder.next_turn()
            pending = holder.sync(target)
            prompt_tokens = len(pending)
            # this turn's relay passes and mean batch (else each turn added every earlier turn's passes again)
            holder.steps = holder.batch_steps = 0
            generated: list[int] = []
            s.turn = asyncio.current_task()
            try:
                if pending:
                    hidden = await holder.feed(pending)
                else:  # the chain already holds the whole target: recompute the last position's output
                    last = target[-1:]
                    holder.sync(target[:-1])
                    hidden = await holder.feed(last)
                cached = holder.reused_tokens
                generated, text, finish, choices = await self._decode_loop(holder, list(target), hidden, params, emit,
                                                                            generated)
                # Between turns the chain goes back to the pool and its servers keep the KV as cached prefixes
                # (where they have a prefix cache): the next turn reuses what is still cached.
                chain = s.last_chain = holder.chain_names
                holder.completed = True
                await holder.release_chain()
            except BaseException as e:
                # Between two turns, whatever ended this one (the client gone while sampling, a failure): the chain
                # goes back to the pool as after a completed turn (else its slot stayed held until the reaper, 300 s,
                # and one marked to pause kept the slot it promised a deadline job), or stays held marked idle (no
                # steps, no slot a pause could free; else the deadline predictions learnt the gap until the next
                # turn as a step). Shielded: a second cancellation does not stop it half way; under the session's
                # lock, so before its next turn
                try:
                    await asyncio.shield(holder.release_chain())
                except BaseException as release_error:  # noqa: BLE001 - the turn's own error is what the caller gets
                    logger.debug("session %s: giving its chain back after a failed turn: %r", s.id, release_error)
                self.stats.record(wait_s=holder.wait_s - wait0, service_s=0.0, tokens=len(generated),
                                  prompt_tokens=prompt_tokens, ok=False, served=holder.admitted)
                deadline = DEADLINE.get()
                if deadline is not None:  # failed or cancelled after admission: not met (a refusal is settled already)
                    self.deadlines.settle(deadline, "missed")
                if isinstance(e, asyncio.CancelledError) and s.closed and s.turn.uncancel() == 0:  # by the close alone
                    raise RequestError("the session was closed during this turn", status=404,
                                       code="session_not_found") from None
                raise
            finally:
                s.turn = None
                s.last_used = time.monotonic()
            if messages is not None:
                s.messages = self.session_messages(s, messages) + [{"role": "assistant", "content": text}]
            s.history = list(target) + generated
            s.turns += 1
            wait = holder.wait_s - wait0
            service = max(0.0, time.monotonic() - t0 - wait)
            self.stats.record(wait_s=wait, service_s=service, tokens=len(generated), prompt_tokens=prompt_tokens,
                              ok=True, batch=holder.mean_batch)
            deadline = DEADLINE.get()
            if deadline is not None:
                self.deadlines.settle(deadline)
            return Generation(token_ids=generated, text=text, finish_reason=finish, prompt_tokens=len(target),
                              wait_s=wait, service_s=service, chain=chain, failovers=holder.failovers,
                              logprobs=choices if params.logprobs is not None else None, cached_tokens=cached)

    async def _reap_sessions(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(min(5.0, self.cfg.session_idle_timeout_s / 4))
            now = time.monotonic()
            for sid, s in list(self.sessions.items()):
                if not s.lock.locked() and now - s.last_used > self.cfg.session_idle_timeout_s:
                    logger.info("closing idle session %s", sid)
                    self.sessions.pop(sid, None)
                    await s.holder.close()

    async def _keep_alive(self) -> None:
        """Send keepalives on the idle server sessions of every job (see the module docstring)."""
        inflight: dict = {}  # ChainSession -> its keepalive task (one at a time per job)
        tick = self.cfg.keepalive_tick_s
        try:
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=tick)
                    return
                except asyncio.TimeoutError:
                    pass
                now = time.monotonic()
                for cs in list(self.chain_sessions):
                    if cs not in inflight:
                        task = asyncio.ensure_future(cs.keepalive(now))
                        inflight[cs] = task
                        task.add_done_callback(lambda t, cs=cs: inflight.pop(cs, None))
        finally:
            for task in list(inflight.values()):
                task.cancel()
