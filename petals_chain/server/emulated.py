"""Emulation as wrappers around the real serving path (testbeds and chaos runs; see
:mod:`petals_chain.swarm.emulation` for the knobs). A server composes them only when a knob is set, so with
emulation off nothing here is on its path:

* :class:`EmulatedRunner` -- a :class:`~petals_chain.server.runner.BlockRunner` on a device
  ``compute_scale`` times slower (each compute holds the device that much longer: per step alone, per batch
  when batching);
* :class:`EmulatedDelays` -- adds the footnote-11 compute time after each step (outside the device: the
  modelled time of other sessions overlaps);
* :class:`FaultyReplies` -- corrupts a fraction of step replies (NaN or a wrong shape);
* :class:`EmulatedLink` -- the RPC handler behind a link with round-trip time ``rtt_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.emulation import NOISE_SCALE, Emulation
from petals_chain.swarm.rpc import PetalsChainBlocks

T = TypeVar("T")


class EmulatedRunner(BlockRunner):
    """A BlockRunner whose device is ``compute_scale`` (>= 1) times slower: after each compute the device stays
    busy ``(compute_scale - 1) * elapsed`` longer (other steps wait, as on a slower device)."""

    def __init__(self, *args: Any, compute_scale: float, **kwargs: Any):
        if not (isinstance(compute_scale, (int, float)) and math.isfinite(compute_scale) and compute_scale >= 1.0):
            raise ValueError(f"compute_scale must be a finite number >= 1, got {compute_scale!r}")
        self.compute_scale = float(compute_scale)
        super().__init__(*args, **kwargs)

    def _on_device(self, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            out = super()._on_device(fn)
            time.sleep((self.compute_scale - 1.0) * (time.perf_counter() - t0))
            return out
        finally:
            out = None  # a row's error in it reaches this frame through its traceback: a cycle (BlockRunner._on_device)

    async def forward_async(self, session_id: str, hidden: torch.Tensor, position: int,
                            *, inline_max_tokens: int = 8) -> torch.Tensor:
        # never inline: the emulated slowness would block the event loop
        return await super().forward_async(session_id, hidden, position, inline_max_tokens=0)


def runner_class(emulation: Emulation) -> Callable[..., BlockRunner]:
    """What builds this server's runners: BlockRunner, or EmulatedRunner at the emulated compute scale."""
    if emulation.compute_scale > 1.0:
        return functools.partial(EmulatedRunner, compute_scale=emulation.compute_scale)
    return BlockRunner


class BackendWrapper:
    """A session backend that hands every call to ``inner`` (subclasses change what they emulate)."""

    def __init__(self, inner: Any):
        self.inner = inner

    @property
    def hidden_size(self) -> int:
        return self.inner.hidden_size

    @property
    def model_fingerprint(self) -> str:
        return self.inner.model_fingerprint

    def authorize(self, peer_id: str) -> bool:
        return self.inner.authorize(peer_id)

    def open_session(self, *args: Any, **kwargs: Any) -> dict:
        return self.inner.open_session(*args, **kwargs)

    async def open_session_wait(self, *args: Any, **kwargs: Any) -> dict:
        return await self.inner.open_session_wait(*args, **kwargs)

    async def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        return await self.inner.forward(session_id, hidden, position)

    def extend_session(self, session_id: str, max_length: int) -> dict:
        return self.inner.extend_session(session_id, max_length)

    def close_session(self, session_id: str, **kwargs: Any) -> None:
        self.inner.close_session(session_id, **kwargs)

    def info(self) -> dict:
        return self.inner.info()

    def session(self, session_id: str) -> Optional[Any]:
        return self.inner.session(session_id)


class EmulatedDelays(BackendWrapper):
    """After each step's real compute, sleep its footnote-11 time (:meth:`Emulation.step_delay_s`)."""

    def __init__(self, inner: Any, emulation: Emulation):
        super().__init__(inner)
        self.emulation = emulation

    async def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        out = await self.inner.forward(session_id, hidden, position)
        sess = self.inner.session(session_id)
        if sess is not None:  # still open (a drain may have closed it meanwhile)
            start, end = sess.span
            delay = self.emulation.step_delay_s(sess.steps == 1, end - start, int(hidden.shape[1]))
            if delay > 0:
                await asyncio.sleep(delay)
        return out


class FaultyReplies(BackendWrapper):
    """Corrupt ``reply_fault_rate`` of the step replies, evenly spread (reply k when ``floor(k * rate)`` grows):
    ``nan`` puts NaN in the reply's last token, ``shape`` drops the last hidden unit (``[1, n, hidden - 1]``),
    ``noise`` adds Gaussian noise of ``NOISE_SCALE`` x the reply's RMS (seeded by the reply's number).
    The session's KV cache is computed honestly; only what goes back is wrong."""

    def __init__(self, inner: Any, emulation: Emulation):
        super().__init__(inner)
        self.fault, self.rate = emulation.reply_fault, emulation.reply_fault_rate
        self.replies = 0
        self.faulty = 0

    async def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        out = await self.inner.forward(session_id, hidden, position)
        return out if self.fault == "push" else self.corrupt(out)

    def corrupt(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` as this reply goes out: corrupted when its turn comes (``push``: what is pushed, see
        :func:`push_fault_for`)."""
        self.replies += 1
        if math.floor(self.replies * self.rate + 1e-9) <= self.faulty:
            return out
        self.faulty += 1
        if self.fault == "nan":
            out = out.clone()
            out[:, -1] = float("nan")
            return out
        if self.fault in ("noise", "push"):
            gen = torch.Generator().manual_seed(self.replies)
            noise = torch.randn(out.shape, generator=gen, dtype=torch.float32)
            rms = out.float().pow(2).mean().sqrt()
            return (out.float() + NOISE_SCALE * rms * noise.to(out.device)).to(out.dtype)
        return out[..., :-1].contiguous()

    def info(self) -> dict:
        return {**self.inner.info(), "faulty_replies": self.faulty}


def push_fault_for(backend: Any) -> Any:
    """What corrupts the outputs a server pushes on (``--emulate-reply-fault push``), or None."""
    return backend.corrupt if isinstance(backend, FaultyReplies) and backend.fault == "push" else None


def session_backend(service: Any, emulation: Emulation) -> Any:
    """``service`` wrapped in what ``emulation`` asks for (``service`` itself when it asks for nothing)."""
    backend = service
    if emulation.delays:
        backend = EmulatedDelays(backend, emulation)
    if emulation.faults:
        backend = FaultyReplies(backend, emulation)
    return backend


Message = TypeVar("Message", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


class EmulatedLink:
    """Wraps the server's RPC handler behind a link of ``emulation.rtt_ms``: each message waits half the round trip
    on its way in and each reply half on its way out. A tensor split into chunks travels as one message (only its
    first chunk, the one with metadata, waits). Registered with ``handler.add_p2p_handlers(p2p, wrapper=link)``,
    so peers call the plain handler's names and the plain handler does the work."""

    def __init__(self, handler: PetalsChainBlocks, emulation: Emulation):
        self.handler = handler
        self.emulation = emulation

    async def _delayed(self, messages: AsyncIterator[Message]) -> AsyncIterator[Message]:
        first = True
        async with contextlib.aclosing(messages) as stream:
            async for msg in stream:
                if first or msg.metadata:
                    await self.emulation.half_rtt()
                first = False
                yield msg

    async def _unary(self, method: Callable, request: runtime_pb2.ExpertRequest,
                     context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        await self.emulation.half_rtt()
        async for reply in self._delayed(method(request, context)):
            yield reply

    async def rpc_ping(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for reply in self._unary(self.handler.rpc_ping, request, context):
            yield reply

    async def rpc_info(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for reply in self._unary(self.handler.rpc_info, request, context):
            yield reply

    async def rpc_session(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for reply in self._delayed(self.handler.rpc_session(self._delayed(requests), context)):
            yield reply

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        # a push from the previous hop comes in over this server's link like any other message
        async for reply in self._delayed(self.handler.rpc_push(self._delayed(requests), context)):
            yield reply


def link_for(handler: PetalsChainBlocks, emulation: Emulation) -> Optional[EmulatedLink]:
    """The wrapper to register ``handler`` with (None: no link delay, the handler answers directly)."""
    return EmulatedLink(handler, emulation) if emulation.rtt_ms > 0 else None
