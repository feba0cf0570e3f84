"""Bounded FIFO slot wait: the queue alone, then a real server process (opens with ``wait_s``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from petals_chain.server.admission import SlotWaitQueue, WaitRefused


class Full(Exception):
    pass


class Pool:
    def __init__(self, free: int):
        self.free = free
        self.log: list[str] = []

    def alloc(self, name: str, n: int):
        def go():
            if self.free < n:
                raise Full()
            self.free -= n
            self.log.append(name)
            return name
        return go


def test_fifo_no_overtaking_and_bounds():
    async def main():
        pool = Pool(2)
        q = SlotWaitQueue(Full, max_waiters=2, max_wait_s=5.0)
        assert await q.acquire(pool.alloc("a", 2), 0) == "a"
        with pytest.raises(Full):
            await q.acquire(pool.alloc("x", 1), 0)  # wait_s=0: refuse at once (today's behaviour)
        big = asyncio.ensure_future(q.acquire(pool.alloc("big", 2), 5))
        small = asyncio.ensure_future(q.acquire(pool.alloc("small", 1), 5))
        await asyncio.sleep(0.01)
        assert len(q) == 2
        with pytest.raises(WaitRefused) as e:
            await q.acquire(pool.alloc("third", 1), 5)
        assert e.value.reason == "queue_full"
        pool.free += 1  # one slot frees: "small" fits but must not overtake "big"
        q.notify()
        await asyncio.sleep(0.01)
        assert not small.done() and not big.done()
        pool.free += 1
        q.notify()
        assert await big == "big"
        assert not small.done()
        pool.free += 1
        q.notify()
        assert await small == "small"
        assert pool.log == ["a", "big", "small"] and len(q) == 0
        assert q.stats()["served"] == 2

    asyncio.run(main())


def test_timeout_and_cancel_remove_waiters():
    async def main():
        pool = Pool(0)
        q = SlotWaitQueue(Full, max_waiters=8, max_wait_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(WaitRefused) as e:
            await q.acquire(pool.alloc("a", 1), 30)  # capped at max_wait_s
        assert e.value.reason == "timeout" and time.monotonic() - t0 < 2 and len(q) == 0
        w1 = asyncio.ensure_future(q.acquire(pool.alloc("w1", 2), 5))
        w2 = asyncio.ensure_future(q.acquire(pool.alloc("w2", 1), 5))
        await asyncio.sleep(0.01)
        pool.free = 1
        q.notify()  # w1 (head) does not fit: w2 waits behind it
        await asyncio.sleep(0.01)
        assert not w2.done()
        w1.cancel()  # the head leaves: w2 now fits and is served
        await asyncio.sleep(0.01)
        assert await w2 == "w2" and len(q) == 0 and q.stats()["abandoned"] == 1

    asyncio.run(main())


def test_errors_propagate():
    async def main():
        q = SlotWaitQueue(Full)
        state = {"fail": False}

        def alloc():
            if state["fail"]:
                raise ValueError("draining")
            raise Full()

        w = asyncio.ensure_future(q.acquire(alloc, 5))
        await asyncio.sleep(0.01)
        state["fail"] = True
        q.notify()
        with pytest.raises(ValueError):
            await w

    asyncio.run(main())


# ------------------------------------------------------------------ real server process

@pytest.mark.slow
def test_server_wait_fifo_timeout_and_disconnect(tiny_model_factory, tmp_path):
    from conftest import ServerProcess, measure_slowdown
    from test_server import MAX_LENGTH, PREFIX, publish, server_args, wait_online, with_client

    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.dht import SwarmDHT
    from petals_chain.swarm.memory import block_bytes, cache_slot_bytes
    from petals_chain.swarm.rpc import NoCapacityError, RemoteError, ServerClient

    model = tiny_model_factory("llama", num_layers=4)
    config = load_config(model)
    s_m, s_c = block_bytes(config, "float32"), cache_slot_bytes(config, "float32", MAX_LENGTH)
    memory = 2 * s_m + 2 * s_c + s_c // 2  # 2 slots: one job over blocks [0, 2)
    orch = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    proc = ServerProcess(server_args(model, orch, "--max-waiters", "2", "--max-wait-s", "20",
                                     "--emulate-decode-ms", "50", "--emulate-rtt-ms", "10",
                                     memory_bytes=memory), tmp_path / "server.log")
    try:
        peer = proc.wait_peer_id()
        publish(orch, 1, {peer: (0, 2)})
        wait_online(orch, [peer], 1)

        async def scenario(client: ServerClient):
            import torch

            a = await client.open_session(peer, "a", 0, 2, MAX_LENGTH)
            with pytest.raises(NoCapacityError):
                await client.open_session(peer, "x", 0, 2, MAX_LENGTH)  # no wait_s: refused at once
            t0 = time.monotonic()
            with pytest.raises(NoCapacityError, match="within"):
                await client.open_session(peer, "t", 0, 2, MAX_LENGTH, wait_s=0.5)
            assert 0.4 < time.monotonic() - t0 < 10 * measure_slowdown()
            order: list[str] = []

            async def until_waiting(n: int) -> None:
                """Until the server's queue holds ``n`` opens (a lasting state; no fixed sleep assumed enough)."""
                deadline = time.monotonic() + 20 * measure_slowdown()
                while (await client.info(peer))["admission"]["waiting"] != n:
                    assert time.monotonic() < deadline, f"the server's wait queue never held {n}"
                    await asyncio.sleep(0.05)

            async def waiter(name: str):
                s = await client.open_session(peer, name, 0, 2, MAX_LENGTH, wait_s=20)
                order.append(name)
                await asyncio.sleep(0.2)
                await s.close()

            # A waiter whose client gives up (cancelled open: the stream ends) leaves the server's queue.
            gone = asyncio.ensure_future(client.open_session(peer, "gone", 0, 2, MAX_LENGTH, wait_s=20))
            await until_waiting(1)
            gone.cancel()
            await until_waiting(0)
            w1 = asyncio.ensure_future(waiter("w1"))
            await until_waiting(1)  # w1 queued first, then w2: their FIFO order is known
            w2 = asyncio.ensure_future(waiter("w2"))
            await until_waiting(2)
            with pytest.raises(NoCapacityError, match="limit 2"):
                await client.open_session(peer, "w3", 0, 2, MAX_LENGTH, wait_s=20)
            # The emulated decode time applies per block per one-token step: 2 blocks x 50 ms.
            h = torch.randn(1, 1, config.hidden_size)
            t0 = time.monotonic()
            await a.step(h, 0)
            assert time.monotonic() - t0 >= 0.1
            await a.close()
            await asyncio.wait_for(asyncio.gather(w1, w2), 30)
            assert order == ["w1", "w2"]
            info = await client.info(peer)
            assert info["slots_free"] == 2 and info["admission"]["waiting"] == 0 and info["sessions"] == 0
            # after the queue drained, an open with wait_s is served at once
            s = await client.open_session(peer, "late", 0, 2, MAX_LENGTH, wait_s=5)
            await s.close()

            # A reload (a new span) fails the opens waiting there at once, with a reply: heartbeats until then
            # (its record says it sends them), then "unavailable" (not silence: a benchmark once saw 594 s of it).
            assert orch.fetch_servers(PREFIX)[peer].open_heartbeats
            client.heartbeats, client.heartbeat_s = (lambda peer_id: True), 0.2
            full = await client.open_session(peer, "full", 0, 2, MAX_LENGTH)
            drained = asyncio.ensure_future(client.open_session(peer, "drained", 0, 2, MAX_LENGTH, wait_s=20))
            await until_waiting(1)
            await asyncio.sleep(0.5)  # a few heartbeats
            publish(orch, 2, {peer: (2, 2)})
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as err:
                await asyncio.wait_for(drained, 30 * measure_slowdown())
            assert err.value.code == "unavailable" and "draining" in str(err.value), err.value
            assert time.monotonic() - t0 < 15 * measure_slowdown()  # the next assignment poll, not the wait
            await full.close()

        asyncio.run(with_client(orch, scenario))
    finally:
        proc.kill()
        orch.shutdown()
