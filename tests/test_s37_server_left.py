"""What the thirty-sixth session left in the server.

* A caller whose event loop closed while its step sat in a batch: session 36 kept the batch worker alive, but the
  caller's session stayed busy (a second step refused "already has a step in progress"; a release deferred, its KV
  pages held) until the caller's coroutine was collected. Now the worker lets the session go once the step is done.
* A batch that failed whole while each of its rows then passed alone was counted and logged nowhere: an operator never
  learnt that every batch ran row by row. Now logged (the first with its traceback, then a line a minute with a
  count) and counted (``info``'s ``batches.batch_failures``).
* An open sent again while the same peer's earlier open under the same id still waits takes that wait's place; at
  the open-files cap (every descriptor held by sessions and that wait) the re-sent open was refused ``no_capacity``
  instead: it holds no more than the wait it replaces.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from test_s36_batch_worker_loop import DEADLINE_S, _in_thread, _scheduler, _wait_for
from test_s36_server_oslimits_fds import _Counter, _Runner, _service

from petals_chain.server import batching
from petals_chain.server.batching import BatchItem
from petals_chain.server.kv_cache import NoCapacityError
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.rpc import RefusedError


# ------------------------------------------------------------------------------------------ a caller's loop closed
def test_a_caller_whose_loop_closed_lets_its_session_go_once_its_step_is_done(tiny_model_dir):
    r = BlockRunner(tiny_model_dir, 0, 2, num_slots=6, max_length=16, batch_wait_ms=0, progress=False)
    H = r.hidden_size
    for sid in "acb":
        r.allocate(sid, 0, 2)
    a_pages = sum(len(t) for t in r._sessions["a"].pages_of.values())
    free = r.pool.pages_free
    loop = asyncio.new_event_loop()
    tasks = []
    try:
        with r._compute_lock:  # the device is busy: a's step sits in a batch, c's and b's queue behind it
            async def start():
                ts = [asyncio.ensure_future(r.forward_async(sid, torch.randn(1, 2, H), 0)) for sid in "ac"]
                # (c's step may be left for the next batch: it then runs with b's, before b's call returns)
                while not (len(r.scheduler._queue) == 2 and r.scheduler._queue[0].started):
                    await asyncio.sleep(0.001)
                return ts

            tasks = loop.run_until_complete(start())
            tb, b = _in_thread(lambda: r.forward("b", torch.randn(1, 2, H), 0))
            _wait_for(lambda: r.scheduler.pending == 3, "b's step to queue")
            assert r.release("a")  # released while its step runs: its pages go back when the step ends
            loop.close()  # a's and c's caller is gone, its tasks still held (not collected)
        tb.join(DEADLINE_S)
        assert not tb.is_alive() and b["result"].shape == (1, 2, H)  # a's and c's batch ran before b's
        # was: both still busy, a never dropped (its pages held) until the coroutines were collected or closed
        assert "a" not in r._sessions and r.pool.pages_free == free + a_pages
        c = r._sessions["c"]
        assert not c.busy and c.length == 0  # its step's result reached nobody: counted as not kept
        # another caller steps c at once (was: "session 'c' already has a step in progress")
        assert asyncio.run(r.forward_async("c", torch.randn(1, 3, H), 0)).shape == (1, 3, H)
        assert r.session_length("c") == 3
    finally:
        for t in tasks:  # closed now, the old calls end without touching the sessions again
            t._log_destroy_pending = False
            t.get_coro().close()
        if not loop.is_closed():
            loop.close()
    assert r.session_length("c") == 3 and not r._sessions["c"].busy and "a" not in r._sessions
    r.close()


def test_a_queued_step_of_a_closed_loop_cancelled_by_a_release_drops_its_session_once(tiny_model_dir):
    """The release cancels the step (queued, not started): the worker's wake-up finds the loop closed and finishes the
    step, which drops the released session; the release then must not drop it again (a guard of the above)."""
    r = BlockRunner(tiny_model_dir, 0, 2, num_slots=6, max_length=16, batch_wait_ms=0, progress=False)
    H = r.hidden_size
    for sid in "ab":
        r.allocate(sid, 0, 2)
    a_pages = sum(len(t) for t in r._sessions["a"].pages_of.values())
    free = r.pool.pages_free
    loop = asyncio.new_event_loop()
    task = None
    try:
        with r._compute_lock:  # b's step runs (held), a's queues behind it, not started
            tb, b = _in_thread(lambda: r.forward("b", torch.randn(1, 2, H), 0))
            _wait_for(lambda: r.scheduler._queue and r.scheduler._queue[0].started, "b's batch")

            async def start():
                t = asyncio.ensure_future(r.forward_async("a", torch.randn(1, 2, H), 0))
                while r.scheduler.pending < 2:
                    await asyncio.sleep(0.001)
                return t

            task = loop.run_until_complete(start())
            loop.close()
            assert r.release("a")
        tb.join(DEADLINE_S)
        assert not tb.is_alive() and b["result"].shape == (1, 2, H)
        assert "a" not in r._sessions and r.pool.pages_free == free + a_pages
    finally:
        if task is not None:
            task._log_destroy_pending = False
            task.get_coro().close()
        if not loop.is_closed():
            loop.close()
    assert r.pool.pages_free == free + a_pages  # given back once
    r.close()


# ------------------------------------------------------------------------------------------ a batch failing whole
def test_a_batch_failing_whole_while_its_rows_pass_alone_is_logged_rate_limited_and_counted(monkeypatch, caplog):
    sched, host, _ = _scheduler()

    def broken(runner, items):
        raise RuntimeError("the batched kernel is broken")

    monkeypatch.setattr(batching, "run_batch", broken)
    items = [BatchItem(torch.ones(1, 1, 4), 0, {}, 0, 1), BatchItem(torch.ones(1, 2, 4), 0, {}, 0, 1)]
    with caplog.at_level(logging.DEBUG, logger="petals_chain.server.batching"):
        for _ in range(5):
            out = sched._compute(items)
            assert [o.shape for o in out] == [(1, 1, 4), (1, 2, 4)]  # each row's own result, as before
    logged = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    # was: nothing logged, nothing counted
    assert len(logged) == 1 and logged[0].exc_info is not None, [rec.getMessage() for rec in caplog.records]
    assert "each row alone passed" in logged[0].getMessage() and "broken" in str(logged[0].exc_info[1])
    assert sched.stats() == {"batches": 5, "rows": 10, "batch_failures": 5}
    # a minute later: one line with the count, no traceback
    monkeypatch.setattr(batching, "BATCH_FAILURE_LOG_S", 0.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="petals_chain.server.batching"):
        sched._compute(items)
    (line,) = caplog.records
    assert line.exc_info is None and line.getMessage().startswith("5 more batches failed"), line.getMessage()
    assert "6 since start" in line.getMessage() and "the batched kernel is broken" in line.getMessage()


def test_a_batch_failed_by_one_rows_own_error_is_that_rows_and_not_the_batched_paths(monkeypatch, caplog):
    sched, host, _ = _scheduler()
    monkeypatch.setattr(batching, "run_batch", lambda runner, items: 1 / 0)
    real = host._run_blocks

    def run_blocks(hidden, position, pages_of, start, end):
        if hidden.shape[1] == 2:
            raise ValueError("this row's own input is bad")
        return real(hidden, position, pages_of, start, end)

    monkeypatch.setattr(host, "_run_blocks", run_blocks)
    items = [BatchItem(torch.ones(1, 1, 4), 0, {}, 0, 1), BatchItem(torch.ones(1, 2, 4), 0, {}, 0, 1)]
    with caplog.at_level(logging.WARNING, logger="petals_chain.server.batching"):
        out = sched._compute(items)
    assert out[0].shape == (1, 1, 4) and isinstance(out[1], ValueError)
    assert not caplog.records and sched.stats()["batch_failures"] == 0


# ------------------------------------------------------------------------------------------ a re-sent waiting open
class _FullRunner(_Runner):
    """A runner whose pool is full until told otherwise (opens wait for slots)."""

    full = False

    class pool:
        num_pages = 1 << 20

    def pages_needed(self, blocks: int, max_length: int) -> int:
        return 1

    def allocate(self, session_id, start, end, *, max_tokens, prefix_hashes=()):
        if self.full:
            raise NoCapacityError("no free pages")
        return super().allocate(session_id, start, end, max_tokens=max_tokens, prefix_hashes=prefix_hashes)


def test_a_resent_waiting_open_at_the_open_files_cap_takes_its_earlier_waits_place():
    async def main():
        svc = _service(_Counter(in_use=20, limit=128))
        runner = svc.runner = _FullRunner()
        total = svc.descriptors.sessions_total()
        for i in range(total - 1):
            svc.open_session(f"s{i}", 0, 4, 256, "orch")
        runner.full = True
        first = asyncio.ensure_future(svc.open_session_wait("w", 0, 4, 256, "orch", wait_s=30.0))
        while not len(svc.admission):
            await asyncio.sleep(0.001)
        assert svc.held() == total  # the sessions and the wait hold every descriptor the limit leaves
        with pytest.raises(RefusedError) as e:  # a new open is refused, as before
            await svc.open_session_wait("x", 0, 4, 256, "orch", wait_s=30.0)
        assert e.value.code == "no_capacity" and "open files" in str(e.value)
        # its first stream broke: the client sends the open again
        second = asyncio.ensure_future(svc.open_session_wait("w", 0, 4, 256, "orch", wait_s=30.0))
        await asyncio.sleep(0)  # its checks run at once
        assert not second.done(), second.exception()  # was: refused no_capacity "out of open files"
        with pytest.raises(RefusedError) as e:
            await asyncio.wait_for(first, DEADLINE_S)
        assert e.value.code == "invalid" and "replaced" in str(e.value)
        assert not second.done() and len(svc.admission) == 1 and svc.held() == total
        runner.full = False
        svc.close_session("s0")  # a session ends: the re-sent open, first in the queue, gets its slots
        assert (await asyncio.wait_for(second, DEADLINE_S))["start_block"] == 0
        assert "w" in svc.sessions and len(svc.admission) == 0 and svc.held() == total - 1
        assert svc._wait_pushes == {}  # nothing left of either wait

    asyncio.run(asyncio.wait_for(main(), 2 * DEADLINE_S))


def test_a_resent_push_open_replacing_a_plain_wait_counts_as_a_push_session():
    """The wait it replaces is discounted as what it was: a push open (3 descriptors) in place of a plain wait (1)
    still needs the 2 more."""
    async def main():
        svc = _service(_Counter(in_use=20, limit=128))
        runner = svc.runner = _FullRunner()
        total = svc.descriptors.sessions_total()
        for i in range(total - 1):
            svc.open_session(f"s{i}", 0, 4, 256, "orch")
        runner.full = True
        first = asyncio.ensure_future(svc.open_session_wait("w", 0, 4, 256, "orch", wait_s=30.0))
        while not len(svc.admission):
            await asyncio.sleep(0.001)
        with pytest.raises(RefusedError) as e:
            await svc.open_session_wait("w", 0, 4, 256, "orch", wait_s=30.0, push=True)
        assert e.value.code == "no_capacity" and not first.done()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 2 * DEADLINE_S))


# ------------------------------------------------------------------------------------------ a client drops mid-request
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _serve_one_stream(read_error: BaseException | None = None, handler_error: BaseException | None = None,
                      data: bytes = b"") -> list[logging.LogRecord]:
    """hivemind's own stream handler (P2P._add_protobuf_stream_handler, no p2pd) serving one stream whose reader ends
    in ``read_error`` (or holds ``data``), over a handler that raises ``handler_error`` after its first reply; the
    records hivemind's P2P logger passed on."""
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID, StreamInfo
    from hivemind.proto import runtime_pb2

    import petals_chain.swarm.rpc  # noqa: F401 - installs the filter as every role serving streams does

    class Node:
        peer_id = PeerID(b"\x00" * 34)

        async def add_binary_stream_handler(self, name, handler, balanced=False):
            self.handle = handler

    class Writer:
        def write(self, data):
            pass

        async def drain(self):
            pass

        def close(self):
            pass

    async def handler(requests, context):
        yield runtime_pb2.ExpertResponse()
        if handler_error is not None:
            raise handler_error
        async for _ in requests:
            pass

    async def main():
        node = Node()
        await P2P._add_protobuf_stream_handler(node, "rpc_test", handler, runtime_pb2.ExpertRequest)
        reader = asyncio.StreamReader()
        if read_error is not None:
            reader.set_exception(read_error)
        else:
            reader.feed_data(data)
        await node.handle(StreamInfo(node.peer_id, "/ip4/127.0.0.1", "rpc_test"), reader, Writer())
        await asyncio.sleep(0.01)  # the handler's task ends

    log = logging.getLogger("hivemind.p2p.p2p_daemon")
    records, level = _Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        asyncio.run(main())
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    return [r for r in records.records if "receiving requests" in r.getMessage() or "mid-request" in r.getMessage()
            or "Handler failed" in r.getMessage()]


def test_a_client_gone_mid_request_is_one_quiet_line_and_real_errors_keep_their_traceback():
    (rec,) = _serve_one_stream(read_error=ConnectionResetError(104, "Connection reset by peer"))
    # was: WARNING "Exception while receiving requests:" with a 10-line traceback
    assert rec.levelno == logging.DEBUG and rec.exc_info is None, (rec.levelname, rec.getMessage())
    assert rec.getMessage() == ("a peer left mid-request (reading its next request): ConnectionResetError: "
                                "[Errno 104] Connection reset by peer")
    (rec,) = _serve_one_stream(handler_error=BrokenPipeError(32, "Broken pipe"))
    assert rec.levelno == logging.DEBUG and rec.exc_info is None and "(in the handler)" in rec.getMessage()
    # not a peer gone: as loud as before
    (rec,) = _serve_one_stream(data=b"\x07")  # an unknown message type: hivemind's TypeError
    assert rec.levelno == logging.WARNING and isinstance(rec.exc_info[1], TypeError), rec.getMessage()
    (rec,) = _serve_one_stream(handler_error=RuntimeError("a bug in the handler"))
    assert rec.levelno == logging.WARNING and isinstance(rec.exc_info[1], RuntimeError), rec.getMessage()


def test_a_reply_to_a_client_gone_mid_message_stops_at_once_without_a_warning_per_chunk(caplog):
    """hivemind wrote a reply's every 64 KiB chunk to a connection already lost: asyncio logged "socket.send() raised
    exception." for each past the fifth (46 for a 3 MiB reply; 6,900 lines for a storm of 150 dropped clients)."""
    import socket

    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    import petals_chain.swarm.rpc  # noqa: F401 - as every role serving streams does

    async def main():
        ours, theirs = socket.socketpair()  # p2pd's end of a stream is a Unix socket too
        _, writer = await asyncio.open_connection(sock=ours)
        theirs.close()  # the client is gone
        reply = runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"x" * (3 << 20))])
        with pytest.raises(ConnectionError):
            await P2P.send_protobuf(reply, writer)
        writer.close()

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        asyncio.run(main())
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]  # was: 46 of them
