"""Review of 8e5a16d (the batch worker replaced when it dies of a bug): a step queued while the dying worker let go of
the lock between failing its queue and giving up ``_worker`` waited for ever; a bug whose message cannot be read
left the queued steps waiting; a bug that fails every step logged its traceback once per step."""

from __future__ import annotations

import logging
import threading

import torch

from petals_chain.server.batching import BatchScheduler
from petals_chain.server.session_state import SessionState

DEADLINE_S = 30.0  # generous: a hang is what these tests catch, not slowness


class _Host:
    """A stand-in for the runner's blocks: a step's output is its input doubled."""

    device = torch.device("cpu")

    def run_on_device(self, fn):
        return fn()

    def _run_blocks(self, hidden, position, pages_of, start, end):
        return hidden * 2


def _scheduler(lock: threading.Lock | None = None) -> tuple[BatchScheduler, dict[str, SessionState]]:
    sessions = {sid: SessionState(sid, 0, 1, {}, limit=64) for sid in ("a", "b")}  # two: steps are not run inline
    host = _Host()
    sched = BatchScheduler(host, lock=lock or threading.Lock(), sessions=sessions, max_batch_tokens=64,
                           prefill_chunk_tokens=32, gather_s=0.0, idle_exit_s=0.5)
    sched.host = host  # the scheduler holds its runner weakly
    return sched, sessions


def _wait_for(cond) -> bool:
    """Poll ``cond`` until true (False at the deadline): the worker logs after its callers have their errors."""
    waited = threading.Event()
    for _ in range(int(DEADLINE_S / 0.01)):
        if cond():
            return True
        waited.wait(0.01)
    return False


def _break_take(sched: BatchScheduler, error, times: int) -> dict:
    """The worker's ``_take`` raises ``error()`` its first ``times`` calls (a bug in the worker)."""
    real_take, state = sched._take, {"n": 0}

    def take():
        state["n"] += 1
        if state["n"] <= times:
            raise error()
        return real_take()

    sched._take = take
    return state


def _submit(sched: BatchScheduler, session: SessionState, x: torch.Tensor):
    """``sched.submit`` in a daemon thread (a hang must not hold the test run): its result or its error."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = sched.submit(session, x, 0, {}, 0, 1)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), "the step waited for ever"
    return out.get("result", out.get("error"))


def test_a_step_queued_while_the_worker_dies_is_served():
    lock = threading.Lock()
    sched, sessions = _scheduler(lock)
    state = _break_take(sched, lambda: AssertionError("a bug in the worker"), 1)
    late: dict = {}

    class Cond(threading.Condition):
        """The first time the dying worker lets go of the lock after the bug (not leaving ``_serve`` with it), a
        caller's step comes in: what a caller blocked on the lock meanwhile does."""

        def __exit__(self, *exc):
            out = super().__exit__(*exc)
            if (state["n"] == 1 and exc[0] is None and "started" not in late
                    and threading.current_thread().name == "petals-chain-batcher"):
                late["started"] = True
                late["req"] = sched._enqueue(sessions["b"], torch.ones(1, 1, 4), 0, {}, 0, 1, inline_max_tokens=0)
            return out

    sched._cv = Cond(lock)
    err = _submit(sched, sessions["a"], torch.ones(1, 2, 4))
    assert isinstance(err, RuntimeError) and "a bug in the worker" in str(err)
    assert _wait_for(lambda: late.get("req") is not None)  # the dying worker queues it, maybe after a's error
    req = late["req"]
    # before: the dying worker was still ``_worker`` (no new one started), then gave it up without failing this step
    assert req.event.wait(DEADLINE_S), "a step queued as the worker died waited for ever"
    assert req.error is None
    torch.testing.assert_close(req.outputs[0], torch.ones(1, 1, 4) * 2)
    assert sched.pending == 0


class _Unreadable(Exception):
    def __str__(self) -> str:
        raise ValueError("a broken __str__")


def test_a_bug_whose_message_cannot_be_read_still_fails_the_steps(caplog):
    sched, sessions = _scheduler()
    _break_take(sched, _Unreadable, 1)
    with caplog.at_level(logging.ERROR, logger="petals_chain.server.batching"):
        err = _submit(sched, sessions["a"], torch.ones(1, 2, 4))  # before: waited for ever
        assert isinstance(err, RuntimeError) and "_Unreadable" in str(err)
        assert _wait_for(lambda: any("batch worker failed" in rec.getMessage() for rec in caplog.records))
    x = torch.ones(1, 1, 4)
    torch.testing.assert_close(_submit(sched, sessions["b"], x), x * 2)


def test_a_bug_on_every_step_logs_its_traceback_once(caplog):
    sched, sessions = _scheduler()
    steps = 20
    _break_take(sched, lambda: AssertionError(f"a bug in the worker, step {len(caplog.records)}"), steps)
    with caplog.at_level(logging.DEBUG, logger="petals_chain.server.batching"):
        for i in range(steps):
            err = _submit(sched, sessions["ab"[i % 2]], torch.ones(1, 2, 4))
            assert isinstance(err, RuntimeError) and "a bug in the worker" in str(err)
        assert _wait_for(lambda: len([rec for rec in caplog.records if "batch worker failed" in rec.getMessage()])
                         == steps)  # every failure counted
    said = [rec for rec in caplog.records if "batch worker failed" in rec.getMessage()]
    loud = [rec for rec in said if rec.levelno >= logging.WARNING]
    # before: 20 tracebacks; now the first one, then a line at 2, 4, 8 and 16 failures
    assert [rec.exc_info is not None for rec in loud] == [True, False, False, False, False], \
        [rec.getMessage() for rec in loud]
    assert "(16 times so far)" in loud[-1].getMessage()
    x = torch.ones(1, 1, 4)
    torch.testing.assert_close(_submit(sched, sessions["a"], x), x * 2)  # the bug gone: served
