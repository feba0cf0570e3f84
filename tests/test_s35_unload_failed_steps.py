"""A runner whose step failed is freed when it is dropped, not at the cycle collector's next run.

A failed step's exception held, through its traceback, the frames it passed (the runner's ``forward_async``/``forward``
among them), and those frames held the exception again (the batcher's request, its ``error``; the unbatched path's
executor future): a reference cycle around the runner. A server reassigned while a session's step was still queued
(the drain's end or ``close`` cancels it), or after a step failed on the device (a CUDA out-of-memory error), kept the
old span's blocks and KV pool allocated after ``_unload`` while it loaded the new span. Every check here runs with the
cycle collector off: only reference counting may free the runner.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest
import torch

from petals_chain.server.emulated import EmulatedRunner
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.tiny_model import build_tiny_model


class _Faults:
    """A runner whose computes wait for ``gate`` (to keep a step in flight) and whose one-row steps fail while
    ``fail`` is set (as a device error would, from inside the blocks)."""

    def _on_device(self, fn):
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return super()._on_device(fn)

    def _run_blocks(self, *args, **kwargs):
        if self.fail:
            raise RuntimeError("CUDA out of memory (emulated)")
        return super()._run_blocks(*args, **kwargs)


class _Gated(_Faults, BlockRunner):
    """The server's runner."""


class _GatedEmulated(_Faults, EmulatedRunner):
    """A testbed's runner on an emulated slower device."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=2, seed=0)


@pytest.fixture
def no_cycle_collector():
    gc.disable()  # only reference counting may free the runner
    try:
        yield
    finally:
        gc.enable()


def _runner(model, batching: bool = True, emulated: bool = False) -> _Gated:
    kw = {"compute_scale": 1.5} if emulated else {}
    r = (_GatedEmulated if emulated else _Gated)(model, 0, 2, num_slots=4, max_length=32, progress=False,
                                                   batching=batching, **kw)
    r.entered, r.gate, r.fail = threading.Event(), threading.Event(), False
    r.gate.set()
    return r


def _wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _memory_refs(r: BlockRunner) -> list[weakref.ref]:
    """Weak references to the runner's block parameters and KV pool tensors."""
    return [weakref.ref(t) for t in (*r.blocks.parameters(), r.pool.keys, r.pool.values)]


def _alive(refs: list[weakref.ref]) -> int:
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("caller", ["async", "thread"])
def test_a_step_cancelled_in_the_queue_leaves_the_closed_runner_freeable(model, no_cycle_collector, caller):
    """Session b's step waits in the batcher's queue behind a's; b is released (a client's close, or the drain of a
    reassignment), so its caller gets a KeyError. Before: after close and del, the runner's 20 tensors (its blocks'
    parameters and KV pool) all stayed allocated; now none does."""
    r = _runner(model)
    H = r.hidden_size
    r.allocate("a", 0, 2)
    r.allocate("b", 0, 2)
    r.gate.clear()
    errors: list[str] = []

    async def step_async(runner: BlockRunner, sid: str) -> None:
        try:
            await runner.forward_async(sid, torch.randn(1, 2, H), 0)
        except KeyError:
            errors.append(sid)

    def step_thread(runner: BlockRunner, sid: str) -> None:
        try:
            runner.forward(sid, torch.randn(1, 2, H), 0)
        except KeyError:
            errors.append(sid)

    def run(runner: BlockRunner, sid: str) -> threading.Thread:
        if caller == "async":
            t = threading.Thread(target=asyncio.run, args=(step_async(runner, sid),), daemon=True)
        else:
            t = threading.Thread(target=step_thread, args=(runner, sid), daemon=True)
        t.start()
        return t

    a = run(r, "a")
    _wait_for(r.entered.is_set, "a's step on the device")
    b = run(r, "b")
    scheduler = r.scheduler
    _wait_for(lambda: scheduler.pending == 2, "b's step in the queue behind a's")
    assert r.release("b")
    b.join(30)
    r.gate.set()
    a.join(30)
    assert not a.is_alive() and not b.is_alive() and errors == ["b"]
    r.close()
    refs = _memory_refs(r)
    del r
    assert _alive(refs) == 0, f"{_alive(refs)} of {len(refs)} tensors of the dropped runner still allocated"


@pytest.mark.parametrize("path", ["inline", "worker", "unbatched", "emulated"])
def test_a_step_failed_on_the_device_leaves_the_closed_runner_freeable(model, no_cycle_collector, path):
    """A step fails inside the blocks (a device error): run inline (a session alone on the runner), by the batcher's
    worker (another session is open, or an emulated slower device: never inline) or in the executor (batching off).
    Each kept the runner in a cycle after close and del (the error was held by a frame its traceback reaches:
    ``_on_device``'s result, the batcher's request, the executor's future); now it is freed."""
    r = _runner(model, batching=path != "unbatched", emulated=path == "emulated")
    r.allocate("a", 0, 2)
    if path == "worker":
        r.allocate("b", 0, 2)
    r.fail = True

    async def step(runner: BlockRunner) -> None:
        with pytest.raises(RuntimeError, match="out of memory"):
            await runner.forward_async("a", torch.randn(1, 1, runner.hidden_size), 0)

    asyncio.run(step(r))
    r.fail = False
    assert r.session_length("a") == 0  # the failed step changed nothing
    assert r.scheduler.batches == (1 if path != "unbatched" else 0)  # it took the path named
    r.close()
    refs = _memory_refs(r)
    del r
    assert _alive(refs) == 0, f"{_alive(refs)} of {len(refs)} tensors of the dropped runner still allocated"


def test_a_reassignment_with_a_step_queued_frees_the_old_span(model, no_cycle_collector):
    """The server's path: a new assignment drains and closes the old runner while a session's step is queued (it is
    cancelled), then loads the new span. Before: the old span's blocks and pool stayed allocated after the
    reassignment (until a collection); now they are freed once its last step has ended."""
    from test_server_lifecycle import _Assignment, _server

    runners: list[_Gated] = []

    def load(source, start, num, **kw):
        r = _Gated(model, start, num, num_slots=kw["num_slots"], max_length=kw["max_length"], progress=False)
        r.entered, r.gate, r.fail = threading.Event(), threading.Event(), False
        r.gate.set()
        runners.append(r)
        return r

    async def main() -> list[weakref.ref]:
        s = _server(load)
        await s.apply_assignment(_Assignment(1, (0, 2), 1.0))
        r = s.runner
        H = r.hidden_size
        r.allocate("a", 0, 2, max_tokens=8)
        r.allocate("b", 0, 2, max_tokens=8)
        r.gate.clear()

        async def step(runner: BlockRunner, sid: str) -> str:
            try:
                await runner.forward_async(sid, torch.randn(1, 2, H), 0)
                return "ok"
            except KeyError:
                return "cancelled"

        a = asyncio.ensure_future(step(r, "a"))
        await asyncio.get_running_loop().run_in_executor(None, _wait_for, r.entered.is_set, "a's step on the device")
        b = asyncio.ensure_future(step(r, "b"))
        while r.scheduler.pending < 2:
            await asyncio.sleep(0.005)
        refs = _memory_refs(r)
        reassigned = asyncio.ensure_future(s.apply_assignment(_Assignment(2, (0, 1), 2.0)))
        assert await b == "cancelled"  # the unload's close dropped the queued step
        r.gate.set()
        del r
        assert await a == "ok"
        await reassigned
        assert s.span == (0, 1) and runners[-1] is s.runner
        return refs

    refs = asyncio.run(main())
    runners.clear()
    assert _alive(refs) == 0, f"{_alive(refs)} of {len(refs)} tensors of the old span still allocated"
