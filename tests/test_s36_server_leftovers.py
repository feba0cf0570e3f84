"""The server role's leftovers of session 35, each pinned by a test that failed before its fix: a stopped server
freed its blocks and KV pool only when the process exited; a session opened on a cached prefix counted its lookup
before any step was served; the batcher counted a batch of nothing after a cancel; and every request of a failed
batch re-raised one shared exception object."""

from __future__ import annotations

import asyncio
import threading
import time
import types
import weakref

import pytest
import torch

from petals_chain.server.runner import BlockRunner, NoCapacityError
from petals_chain.swarm.prefix import prefix_hashes
from petals_chain.swarm.tiny_model import build_tiny_model

PROMPT = list(range(1, 41))  # 40 tokens: 2 full pages of 16 in the prefix cache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=4, seed=0)


def _embed(ids: list[int]) -> torch.Tensor:
    table = torch.randn(1000, 64, generator=torch.Generator().manual_seed(1))
    return table[torch.tensor(ids)].unsqueeze(0)


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------- stop frees the runner
class _Announcer:
    """What the shutdown uses of an Announcer: it records what the offline publish announces."""

    def __init__(self, server):
        self.server, self.published = server, []

    def mark_dirty(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def publish(self, timeout_s=None) -> bool:
        self.published.append(self.server.record())
        return True


def test_a_stopped_server_frees_its_blocks_and_kv_pool(model):
    """A program that runs a server in-process (tests, a notebook, scripts/soak.py) and stops it: the server kept
    ``service.runner`` (its blocks and KV pool) until the process exited. Freed at stop now, after the offline
    record, which is as before (it names the span served)."""
    from petals_chain.server.config import ServerConfig
    from petals_chain.server.server import Server
    from petals_chain.swarm.local import model_memory

    _, s_m, s_c = model_memory(model, 64)
    s = Server(ServerConfig(model=str(model), tau_p=0.002, memory_bytes=4 * s_m + 8 * s_c, max_length=64,
                            progress=False, drain_timeout_s=1.0))
    s.sd = types.SimpleNamespace(peer_id="me", alive=True, shutdown=lambda: None)
    asg = types.SimpleNamespace(epoch=1, timestamp=1.0, max_length=64, model_fingerprint="",
                                assignments={"me": [0, 4]}, span_of=lambda peer_id: (0, 4))

    async def main() -> weakref.ref:
        for h in s.hosted:
            h.memory.measure(s.cfg.memory_bytes, s.cfg.device)
        await s.apply_assignment(asg)
        assert s.state == "online" and isinstance(s.runner, BlockRunner)
        s.runner.allocate("open", 0, 4)  # a session still open at the stop: drained
        ref = weakref.ref(s.runner)
        s.announcer = _Announcer(s)
        await s._shutdown(None)
        return ref

    ref = asyncio.run(main())
    assert s.runner is None and s.service.runner is None and s.span is None
    assert ref() is None  # nothing else holds it: freed by its reference count, no collection needed
    offline = s.announcer.published
    assert [(r.state, r.start_block, r.num_blocks) for r in offline] == [("offline", 0, 4)]


# ---------------------------------------------------------------------------------------------- prefix counters
def test_a_lean_open_whose_first_step_is_refused_counts_no_prefix_lookup(model):
    """Two sessions open on a cached prompt, the second lean on the same pinned pages; its first step, at 0 (the
    chain's other hop matched nothing), is refused no_capacity and the job re-opens elsewhere. The refused open's
    lookup was counted as offered at open: 128 tokens offered, 0 reused for sessions that served nothing. Counted
    at a session's first served step now."""
    r = BlockRunner(model, 0, 4, num_slots=8, max_length=64, progress=False, batching=False)  # 32 pages
    r.allocate("a", 0, 4)
    r.forward("a", _embed(PROMPT), 0)
    r.release("a", prefix_hashes(PROMPT))
    assert r.cache_stats()["prefix_offered_tokens"] == 0  # "a" named no prefix
    r.allocate("b", 0, 4, prefix_hashes=prefix_hashes(PROMPT))
    r.allocate("c", 0, 4, prefix_hashes=prefix_hashes(PROMPT))  # lean
    with pytest.raises(NoCapacityError):
        r.forward("c", _embed(PROMPT), 0)
    r.release("c")
    stats = r.cache_stats()
    assert (stats["prefix_offered_tokens"], stats["prefix_reused_tokens"]) == (0, 0)
    r.forward("b", _embed(PROMPT[32:]), 32)  # served: its lookup counts, once
    r.forward("b", _embed([7]), 40)
    stats = r.cache_stats()
    assert (stats["prefix_offered_tokens"], stats["prefix_reused_tokens"]) == (32, 32)


def test_a_failed_first_step_counts_nothing_until_a_step_is_served(model, monkeypatch):
    """The first step on a matched prefix took the cached pages, then failed in the compute: its reused tokens
    counted as hits though nothing was served. They count when the step is served (again, at or before the match)."""
    r = BlockRunner(model, 0, 4, num_slots=8, max_length=64, progress=False, batching=False)
    r.allocate("a", 0, 4)
    r.forward("a", _embed(PROMPT), 0)
    r.release("a", prefix_hashes(PROMPT))
    assert r.allocate("b", 0, 4, prefix_hashes=prefix_hashes(PROMPT)) == 32
    real = r._run_blocks

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(r, "_run_blocks", real)
        raise RuntimeError("out of memory, for a moment")

    monkeypatch.setattr(r, "_run_blocks", fail_once)
    with pytest.raises(RuntimeError, match="for a moment"):
        r.forward("b", _embed(PROMPT[20:]), 20)  # the chain's other hop matched 20 tokens
    stats = r.cache_stats()
    assert (stats["prefix_offered_tokens"], stats["prefix_reused_tokens"]) == (0, 0)
    r.forward("b", _embed(PROMPT[16:]), 16)  # the retry starts earlier, at its shared page: 16 tokens reused
    stats = r.cache_stats()
    assert (stats["prefix_offered_tokens"], stats["prefix_reused_tokens"]) == (32, 16)


# ---------------------------------------------------------------------------------------------- batcher
def _batching_runner(model) -> BlockRunner:
    # a gathering window far longer than the test: the worker takes a batch only once no open session is about to
    # send a step (every open one queued, or none used recently)
    r = BlockRunner(model, 0, 4, num_slots=8, max_length=64, progress=False, batching=True, batch_wait_ms=60_000)
    r.scheduler.idle_exit_s = 0.05
    return r


def _step_in_thread(r: BlockRunner, sid: str, out: dict) -> threading.Thread:
    def step() -> None:
        try:
            out[sid] = r.forward(sid, _embed([5, 6]), 0)
        except BaseException as e:  # noqa: BLE001 - what the caller of the step sees
            out[sid] = e

    t = threading.Thread(target=step, daemon=True)
    t.start()
    return t


def test_a_cancel_that_empties_the_queue_counts_no_batch(model):
    """A step queued while another session was likely to send one (the worker gathering), then released: the
    worker took an empty batch, ran ``run_batch([])`` (a ValueError, caught) and counted a batch of 0 rows."""
    r = _batching_runner(model)
    r.allocate("x", 0, 4)
    r.allocate("y", 0, 4)  # just opened: recently used, so the worker waits for its step
    out: dict = {}
    t = _step_in_thread(r, "x", out)
    _wait(lambda: r.scheduler.pending == 1, "x's step queued")
    assert r.release("x")  # its queued step is dropped: the queue is empty
    t.join(30)
    assert isinstance(out["x"], KeyError)
    with r.scheduler._cv:  # y went quiet: the worker stops gathering and takes what is queued (nothing)
        r._sessions["y"].last_used = 0.0
        r.scheduler._cv.notify_all()
    _wait(lambda: r.scheduler._worker is None, "the batch worker's exit")
    assert (r.scheduler.batches, r.scheduler.rows) == (0, 0)


class _DeviceLost(RuntimeError):
    """An error class whose constructor does not take its ``args`` back (so ``copy.copy`` cannot rebuild it)."""

    def __init__(self, device: str, why: str):
        super().__init__(f"{device}: {why}")
        self.device = device


@pytest.mark.parametrize("error", [RuntimeError("device lost"), _DeviceLost("cuda:0", "device lost")],
                         ids=["plain", "custom-init"])
def test_each_request_of_a_failed_batch_gets_its_own_error(model, monkeypatch, error):
    """The device failed under a batch of two steps: both callers re-raised one exception object (each raise
    appended its frames to the same traceback, and a handler changing it changed the other's). Each gets its own
    now, of the same type, message and attributes, caused by the batch's error."""
    r = _batching_runner(model)
    r.allocate("x", 0, 4)
    r.allocate("y", 0, 4)

    def device_lost(fn):
        raise error

    monkeypatch.setattr(r, "run_on_device", device_lost)
    out: dict = {}
    threads = [_step_in_thread(r, "x", out)]
    _wait(lambda: r.scheduler.pending == 1, "x's step queued")
    threads.append(_step_in_thread(r, "y", out))  # both queued: the worker takes them as one batch
    for t in threads:
        t.join(30)
    ex, ey = out["x"], out["y"]
    assert ex is not ey and ex is not error and ey is not error
    for e in (ex, ey):
        assert type(e) is type(error) and str(e) == str(error) and e.__cause__ is error
        assert getattr(e, "device", None) == getattr(error, "device", None)
    ex.args = ("changed by x's handler",)
    assert str(ey) == str(error)
    _wait(lambda: r.scheduler._worker is None, "the batch worker's exit")
