"""The thirty-first hunt of the volunteer server's KV cache, batching and sessions: a defect each test names."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=2, seed=0)


def test_a_dropped_runner_frees_its_blocks_and_pool_at_once(model):
    """A reload drops the old runner and loads the new span at once (``Server._unload``, then
    ``torch.cuda.empty_cache``): the runner's batch scheduler and static decode held it in a reference cycle, so its
    KV pool and blocks stayed allocated until the cycle collector happened to run, and a GPU server sized to its memory
    ran out of it loading the new span beside the old one."""
    gc.collect()
    gc.disable()  # only reference counting may free it here
    try:
        r = BlockRunner(model, 0, 2, num_slots=4, max_length=32, progress=False, decode_graph="eager")
        H = r.hidden_size
        r.allocate("a", 0, 2)
        r.allocate("b", 0, 2)
        r.forward("a", torch.randn(1, 3, H), 0)  # b is open: the step goes through the batcher's worker thread
        r.forward("a", torch.randn(1, 1, H), 3)  # one token: the static-shape decode step
        assert r.scheduler.batches >= 1 and r.static_decode.steps == 1
        r.release("a")
        r.close()
        pool, blocks = weakref.ref(r.pool), weakref.ref(r.blocks)
        del r
        assert pool() is None and blocks() is None
    finally:
        gc.enable()


def test_a_reload_frees_the_old_span_before_it_loads_the_new_one(model):
    """What the server did with the cycle above: a new assignment drained and closed the old runner, then loaded the
    new span while the old one's blocks and KV pool were still allocated."""
    import asyncio

    from test_server_lifecycle import _Assignment, _server

    pools: list[weakref.ref] = []
    old_alive_at_load: list[bool] = []

    def load(source, start, num, **kw):
        old_alive_at_load.extend(p() is not None for p in pools)
        r = BlockRunner(model, start, num, num_slots=kw["num_slots"], max_length=kw["max_length"], progress=False)
        pools.append(weakref.ref(r.pool))
        return r

    async def main():
        s = _server(load)
        await s.apply_assignment(_Assignment(1, (0, 2), 1.0))
        r = s.runner
        r.allocate("a", 0, 2, max_tokens=8)
        r.allocate("b", 0, 2, max_tokens=8)
        await asyncio.get_running_loop().run_in_executor(None, r.forward, "a", torch.randn(1, 2, r.hidden_size), 0)
        r.release("a")
        r.release("b")
        del r
        await s.apply_assignment(_Assignment(2, (0, 1), 2.0))
        assert s.span == (0, 1)

    gc.collect()
    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    assert old_alive_at_load == [False]


def test_hidden_states_beyond_the_servers_dtype_are_refused_and_change_nothing(model):
    """A float16 server took float32 (or bfloat16) hidden states past float16's range: finite as sent, infinite once
    converted, computed into NaN K/V and a NaN reply (the orchestrator blamed the server) and every later step of the
    session read the NaN cache. Now the step is refused as bad input and the session is as it was."""
    r = BlockRunner(model, 0, 2, num_slots=4, max_length=32, progress=False, dtype="float16", batching=False)
    H = r.hidden_size
    r.allocate("a", 0, 2)
    prompt = torch.randn(1, 4, H, generator=torch.Generator().manual_seed(1))
    r.forward("a", prompt, 0)
    big = torch.randn(1, 2, H)
    big[0, 1, 3] = 1e6  # finite in float32, inf in float16
    for position in (4, 2):  # continuing, and rolling back
        with pytest.raises(ValueError, match="float16"):
            r.forward("a", big, position)
        assert r.session_length("a") == 4
    again = r.forward("a", prompt[:, 2:], 2)
    r.allocate("b", 0, 2)  # the same steps on a session that never saw the bad input: the cache was left intact
    r.forward("b", prompt, 0)
    torch.testing.assert_close(again, r.forward("b", prompt[:, 2:], 2), rtol=0, atol=0)
    r.release("b")
    assert bool(torch.isfinite(r.forward("a", big.to(torch.float16).nan_to_num(posinf=1.0), 4)).all())
    r.release("a")
    assert r.slots_free == 4
