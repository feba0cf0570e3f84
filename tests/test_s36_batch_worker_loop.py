"""The batch worker survives what its callers do: a caller whose event loop closed while its step sat in a batch
costs only that caller, and a worker that dies of a bug fails its steps and is replaced by the next step (before,
both left the worker dead with ``_worker`` set: that batch's other callers and every later batched step waited for
ever, a server that stopped serving without a word). Also: the "no trusted orchestrator" warning is said when the
server runs, not when one is built to have assignments applied directly."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import pytest
import torch

from petals_chain.server.batching import BatchScheduler
from petals_chain.server.runner import BlockRunner
from petals_chain.server.session_state import SessionState

DEADLINE_S = 30.0  # generous: a hang is what these tests catch, not slowness


def _wait_for(cond, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < DEADLINE_S, f"timed out waiting for {what}"
        time.sleep(0.001)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a daemon thread (a hang must not hold the test run); ``out`` gets its result or error."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_caller_whose_loop_closed_costs_only_that_caller(tiny_model_dir, caplog):
    r = BlockRunner(tiny_model_dir, 0, 2, num_slots=6, max_length=16, batch_wait_ms=0, progress=False)
    H = r.hidden_size
    for sid in "abc":
        r.allocate(sid, 0, 2)
    loop = asyncio.new_event_loop()
    task = None
    try:
        with caplog.at_level(logging.DEBUG, logger="petals_chain.server.batching"):
            with r._compute_lock:  # the device is busy: a's step sits in a batch, b's in the queue behind it
                async def start():
                    t = asyncio.ensure_future(r.forward_async("a", torch.randn(1, 2, H), 0))
                    while not (r.scheduler._queue and r.scheduler._queue[0].started):
                        await asyncio.sleep(0.001)
                    return t

                task = loop.run_until_complete(start())
                tb, b = _in_thread(lambda: r.forward("b", torch.randn(1, 2, H), 0))
                _wait_for(lambda: r.scheduler.pending == 2, "b's step to queue")
                loop.close()  # a's caller is gone; its step is still to run
            tb.join(DEADLINE_S)
            assert not tb.is_alive(), "b waited for ever behind the closed loop's step"
            assert b["result"].shape == (1, 2, H)
            # the worker still serves later steps
            tc, c = _in_thread(lambda: r.forward("c", torch.randn(1, 3, H), 0))
            tb2, b2 = _in_thread(lambda: r.forward("b", torch.randn(1, 1, H), 2))
            tc.join(DEADLINE_S)
            tb2.join(DEADLINE_S)
            assert not tc.is_alive() and not tb2.is_alive(), "later batched steps waited for ever"
            assert c["result"].shape == (1, 3, H) and b2["result"].shape == (1, 1, H)
            assert r.session_length("b") == 3 and r.session_length("c") == 3
        dropped = [rec for rec in caplog.records if "result dropped" in rec.getMessage()]
        assert len(dropped) == 1 and dropped[0].levelno == logging.DEBUG, [x.getMessage() for x in caplog.records]
        assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    finally:
        if task is not None:
            task._log_destroy_pending = False  # it can never run again: its loop is closed
            task.get_coro().close()  # its step ends as failed: the session is free again
        if not loop.is_closed():
            loop.close()
    assert not r._sessions["a"].busy and r.session_length("a") == 0
    r.close()


class _Host:
    """A stand-in for the runner's blocks: a step's output is its input doubled."""

    device = torch.device("cpu")

    def run_on_device(self, fn):
        return fn()

    def _run_blocks(self, hidden, position, pages_of, start, end):
        return hidden * 2


def _scheduler() -> tuple[BatchScheduler, _Host, dict[str, SessionState]]:
    host = _Host()
    sessions = {sid: SessionState(sid, 0, 1, {}, limit=64) for sid in ("a", "b")}  # two: steps are not run inline
    sched = BatchScheduler(host, lock=threading.Lock(), sessions=sessions, max_batch_tokens=64,
                           prefill_chunk_tokens=32, gather_s=0.0, idle_exit_s=0.5)
    return sched, host, sessions


def test_a_worker_that_dies_fails_its_steps_and_the_next_step_starts_a_new_one(monkeypatch, caplog):
    sched, host, sessions = _scheduler()
    real_take = sched._take
    calls = {"n": 0}

    def take_once_broken():
        calls["n"] += 1
        if calls["n"] == 1:
            raise AssertionError("a bug in the worker")
        return real_take()

    monkeypatch.setattr(sched, "_take", take_once_broken)
    x = torch.ones(1, 2, 4)
    with caplog.at_level(logging.ERROR, logger="petals_chain.server.batching"):
        t, out = _in_thread(lambda: sched.submit(sessions["a"], x, 0, {}, 0, 1))
        t.join(DEADLINE_S)
    assert not t.is_alive(), "the step waited for ever on a dead worker"
    err = out["error"]
    assert isinstance(err, RuntimeError) and "batch worker failed" in str(err) and "a bug in the worker" in str(err)
    assert any("batch worker failed" in rec.getMessage() for rec in caplog.records)
    assert sched.pending == 0
    # the next step gets a new worker and its result
    t, out = _in_thread(lambda: sched.submit(sessions["b"], x, 0, {}, 0, 1))
    t.join(DEADLINE_S)
    assert not t.is_alive(), "the next step waited for ever: no new worker"
    torch.testing.assert_close(out["result"], x * 2)


def test_a_worker_thread_gone_without_a_word_is_replaced():
    """However the thread ended (``_worker`` still set to it), the next step notices and starts another."""
    sched, host, sessions = _scheduler()
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    sched._worker = dead
    x = torch.ones(1, 1, 4)
    t, out = _in_thread(lambda: sched.submit(sessions["a"], x, 0, {}, 0, 1))
    t.join(DEADLINE_S)
    assert not t.is_alive(), "the step waited for ever on a dead worker"
    torch.testing.assert_close(out["result"], x * 2)
    assert sched._worker is not dead


def test_no_trusted_orchestrator_is_said_when_the_server_runs(tiny_model_dir, monkeypatch, caplog):
    """Built for direct use (a test, a tool applying assignments itself) it said "will never receive an assignment";
    a volunteer who forgot the flag still reads it, when the server starts."""
    from petals_chain.server.config import ServerConfig
    from petals_chain.server.server import Server

    said = "will never receive an assignment"
    with caplog.at_level(logging.WARNING, logger="petals_chain.server.server"):
        s = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.002, progress=False))
        trusting = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.002, progress=False,
                                       trust_orchestrator=[_PEER]))
    assert not [rec for rec in caplog.records if said in rec.getMessage()]

    class Joined(Exception):
        pass

    async def join() -> None:
        raise Joined()

    async def shutdown(handler) -> None:
        pass

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for server in (s, trusting):
            monkeypatch.setattr(server, "_join", join)
            monkeypatch.setattr(server, "_shutdown", shutdown)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="petals_chain.server.server"):
                with pytest.raises(Joined):
                    asyncio.run(server.run())
            warned = [rec for rec in caplog.records if said in rec.getMessage()]
            assert len(warned) == (1 if server is s else 0)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


_PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
