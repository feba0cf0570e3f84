"""Loose ends of the strangers' shares (``--allow-any-client``, server/admission.py and server/sessions.py): a small
server serves one stranger session when its shares round down below one; the record says how many slots a stranger
can get; one stranger's queued opens are capped; an extend past ``max_length`` is ``invalid`` before any quota; and
an open sent again while its earlier wait still queues replaces that wait, for every peer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from petals_chain.server import admission
from petals_chain.server.admission import SlotWaitQueue, WaitRefused
from petals_chain.server.announce import build_record
from petals_chain.server.kv_cache import NoCapacityError
from petals_chain.server.runner import BlockRunner
from petals_chain.server.sessions import SessionService
from petals_chain.swarm.emulation import Emulation
from petals_chain.swarm.records import ServerRecord, _ServerValueV1
from petals_chain.swarm.rpc import RefusedError
from petals_chain.swarm.tiny_model import build_tiny_model

QUOTA = "stranger_quota"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=2, seed=0)


def _service(model, trusted=("orch",), num_slots=8, kv_cache="paged", allow_any_client=True, **kw) -> SessionService:
    """2 blocks of max_length 64; paged with 8 slots: 32 pages of 16 tokens (a 16-token session takes 2 pages, a
    full one 8; per stranger 8 pages, together 16)."""
    svc = SessionService(hidden_size=0, trusted=set(trusted), allow_any_client=allow_any_client,
                         state=lambda: "online", on_change=lambda: None, describe=lambda: {}, **kw)
    svc.runner = BlockRunner(model, 0, 2, num_slots=num_slots, max_length=64, progress=False, batching=False,
                             kv_cache=kv_cache)
    svc.hidden_size = svc.runner.hidden_size
    return svc


def _refused(fn, *args, **kwargs) -> RefusedError:
    with pytest.raises(RefusedError) as info:
        fn(*args, **kwargs)
    return info.value


async def _refused_async(coro) -> RefusedError:
    with pytest.raises(RefusedError) as info:
        await coro
    return info.value


async def _cancel(tasks) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------------------- 1. small servers
def test_each_cap_is_at_least_one_whole_span_session():
    shares = admission.StrangerShares()
    assert shares.caps(32, 8) == (8, 16)  # the shares, where they hold a session
    assert shares.caps(3, 2) == (2, 2)  # 3 slots on 2 blocks: floor(0.75), floor(1.5) -> one 2-block session
    assert shares.caps(1, 2) == (1, 1)  # never past the pool
    assert shares.caps(3) == (0, 1)  # no floor given: the shares rounded down
    why = shares.refusal(2, 2, 2, 3, session_pages=2)
    assert "at most 2 of its 3" in why and "at least one session of its whole span" in why


def test_an_idle_small_server_serves_one_strangers_session(model):
    """Before: slots mode, 3 slots, 2 blocks: every stranger's full-span open was refused ``stranger_quota``
    ("a peer this server does not trust may hold at most 0 of its 3"), the server idle."""
    svc = _service(model, num_slots=3, kv_cache="slots")
    assert svc.runner.pool.num_pages == 3
    svc.open_session("m0", 0, 2, 64, "mallory")
    err = _refused(svc.open_session, "e0", 0, 2, 64, "eve")  # one stranger session at a time
    assert err.code == QUOTA and "together they may hold at most 2 of its 3" in str(err)
    svc.open_session("o0", 1, 2, 64, "orch")  # the trusted orchestrator has the rest
    svc.close_session("m0")
    svc.open_session("e0", 0, 2, 64, "eve")


# ---------------------------------------------------------------------------------------------------- 2. the record
def test_stranger_slots_free_is_what_a_new_stranger_can_open(model):
    """The record's slots_free counts the trusted orchestrators' reserve: a planner of a peer the server does not
    trust saw 8 free slots where it could open 2 (its cap), then 4 where it could open none."""
    svc = _service(model)
    assert svc.runner.slots_free == 8 and svc.stranger_slots_free() == 2  # the per-stranger cap: 8 pages, 2 slots
    svc.open_session("m0", 0, 2, 64, "mallory")
    svc.open_session("e0", 0, 2, 64, "eve")  # the strangers' 16 pages are taken
    assert svc.runner.slots_free == 4 and svc.stranger_slots_free() == 0
    err = _refused(svc.open_session, "z0", 0, 2, 16, "zed")
    assert err.code == QUOTA
    svc.close_session("e0")
    assert svc.stranger_slots_free() == 2
    for i in range(3):
        svc.open_session(f"o{i}", 0, 2, 64, "orch")  # trusted sessions fill the pool
    assert svc.runner.slots_free == 0 and svc.stranger_slots_free() == 0
    assert _service(model, trusted=()).stranger_slots_free() == 2  # nobody trusted: the per-peer cap only
    assert _service(model, allow_any_client=False).stranger_slots_free() == 0  # strangers are not served at all


def _source(svc: SessionService) -> SimpleNamespace:
    from petals_chain.server.config import ServerConfig

    memory = SimpleNamespace(memory_bytes=1 << 30, s_m=1 << 20, s_c=lambda n: 1024 * n)
    return SimpleNamespace(state="online", epoch=1, span=(0, 2), max_length=64, tau_p=0.01, runner=svc.runner,
                           memory=memory, emulation=Emulation(), cfg=ServerConfig(model="m"), dtype_name="float32",
                           model_fingerprint="", maddrs=[], reachability="unknown", service=svc)


def test_the_record_carries_stranger_slots_free_and_older_records_read_as_before(model):
    svc = _service(model)
    svc.open_session("m0", 0, 2, 64, "mallory")
    svc.open_session("e0", 0, 2, 32, "eve")  # the strangers hold 12 of their 16 pages: one slot left of theirs
    rec = build_record(_source(svc), "server")
    assert (rec.slots_free, rec.stranger_slots_free) == (5, 1)
    assert rec.slots_free_for(trusted=True) == 5 and rec.slots_free_for(trusted=False) == 1
    value = rec.to_value()
    _ServerValueV1.parse_obj(value)  # the DHT's validator takes it
    older = {k: v for k, v in value.items() if k != "stranger_slots_free"}  # an older server's record
    old = ServerRecord.from_value(older)
    assert old.stranger_slots_free == -1 and old.slots_free_for(trusted=False) == 5
    assert _ServerValueV1.parse_obj(older).dict() == older
    with pytest.raises(ValueError, match="stranger_slots_free"):
        ServerRecord.from_value({**value, "stranger_slots_free": 6})
    standby = build_record(SimpleNamespace(**{**vars(_source(svc)), "runner": None, "service": None}), "server")
    assert standby.stranger_slots_free == 0


# ---------------------------------------------------------------------------------------------------- 3. queued opens
def test_one_stranger_queues_at_most_its_share_of_the_wait_places(model):
    """Before: with --max-waiters 8 one peer id queued 4 one-page opens (its 8-page cap allowed it) and filled the
    strangers' 4 places: every other stranger's open was refused ``stranger_quota``."""
    async def main():
        svc = _service(model, max_waiters=8)  # per stranger 2 places, strangers 4
        for i in range(16):
            svc.open_session(f"o{i}", 0, 2, 16, "orch")  # the pool is full
        waits = [asyncio.ensure_future(svc.open_session_wait(f"m{i}", 0, 1, 16, "mallory", wait_s=30.0))
                 for i in range(2)]
        await asyncio.sleep(0.05)
        err = await asyncio.wait_for(_refused_async(svc.open_session_wait("m2", 0, 1, 16, "mallory", wait_s=30.0)),
                                     5.0)
        assert err.code == QUOTA and "this peer has 2 opens waiting" in str(err) and "at most 2" in str(err)
        waits.append(asyncio.ensure_future(svc.open_session_wait("e0", 0, 1, 16, "eve", wait_s=30.0)))
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waits) and svc.admission.guests == 3
        await _cancel(waits)
        assert not svc._waiting and len(svc.admission) == 0
        waits = [asyncio.ensure_future(svc.open_session_wait("m3", 0, 1, 16, "mallory", wait_s=30.0))]
        await asyncio.sleep(0.05)  # its withdrawn waits gave its places back
        assert not waits[0].done()
        await _cancel(waits)

    asyncio.run(main())


def test_the_per_stranger_wait_cap_holds_with_nobody_trusted_and_is_at_least_one():
    shares = admission.StrangerShares()
    assert [shares.waits_per_stranger(n) for n in (0, 1, 4, 8, 256)] == [1, 1, 1, 2, 64]


# ---------------------------------------------------------------------------------------------------- 4. extend
def test_an_extend_past_max_length_is_invalid_before_the_quota(model):
    """Before: a stranger at its cap that asked to extend to 65 tokens (the server's max_length 64) got
    ``stranger_quota`` (wait for a close) for a request no close could make valid."""
    svc = _service(model)
    svc.open_session("m0", 0, 2, 48, "mallory")
    svc.open_session("m1", 0, 2, 16, "mallory")  # 6 + 2: its 8 pages
    for bad in (65, 0, True, 64.0):
        err = _refused(svc.extend_session, "m0", bad)
        assert err.code == "invalid" and "[1, 64]" in str(err), (bad, err.code)
    assert svc.sessions["m0"].max_length == 48
    assert _refused(svc.extend_session, "m0", 64).code == QUOTA  # a valid length past the share: the quota
    svc.open_session("o0", 0, 2, 16, "orch")
    assert _refused(svc.extend_session, "o0", 65).code == "invalid"


# ---------------------------------------------------------------------------------------------------- 5. re-sent opens
@pytest.mark.parametrize("peer", ["mallory", "orch"])
def test_an_open_sent_again_replaces_its_earlier_wait(model, peer):
    """Before: a stranger's open sent again (its first stream broke) while the first still waited was refused
    ``invalid`` ("waits already"), where a trusted peer's queued twice (two places; the second failed ``invalid``
    "already open" at its turn). Now, for both, the new open takes the earlier one's place, which is refused."""
    async def main():
        svc = _service(model, max_waiters=4)
        for i in range(16):
            svc.open_session(f"o{i}", 0, 2, 16, "orch")  # the pool is full
        first = asyncio.ensure_future(svc.open_session_wait("s", 0, 2, 16, peer, wait_s=30.0))
        await asyncio.sleep(0.05)
        behind = asyncio.ensure_future(svc.open_session_wait("b", 0, 2, 16, "eve", wait_s=30.0))
        await asyncio.sleep(0.05)
        again = asyncio.ensure_future(svc.open_session_wait("s", 0, 2, 16, peer, wait_s=30.0))
        err = await asyncio.wait_for(_refused_async(first), 5.0)
        assert err.code == "invalid" and "replaced" in str(err)
        assert len(svc.admission) == 2 and not again.done()
        other = await _refused_async(svc.open_session_wait("b", 0, 2, 16, "zed", wait_s=30.0))
        assert other.code == "invalid" and "another peer" in str(other)  # a stranger's id is its own
        svc.close_session("o0")  # 2 pages: the re-sent open is served first, in its earlier place
        reply = await asyncio.wait_for(again, 5.0)
        assert reply["start_block"] == 0 and svc.sessions["s"].peer == peer and not behind.done()
        svc.close_session("o1")
        await asyncio.wait_for(behind, 5.0)
        assert not svc._waiting and svc.admission.stats()["served"] == 2

    asyncio.run(main())


def test_a_replacing_wait_keeps_its_place_and_needs_no_free_place():
    async def main():
        q = SlotWaitQueue(NoCapacityError, max_waiters=2)
        free = {"n": 0}

        def alloc(name):
            def go():
                if not free["n"]:
                    raise NoCapacityError("full")
                free["n"] -= 1
                return name
            return go

        a = asyncio.ensure_future(q.acquire(alloc("a"), 10.0, key="k"))
        b = asyncio.ensure_future(q.acquire(alloc("b"), 10.0))
        await asyncio.sleep(0.01)
        since = q._queue[0].since
        with pytest.raises(WaitRefused) as info:  # full: a new key does not queue
            await q.acquire(alloc("c"), 10.0, key="c")
        assert info.value.reason == "queue_full"
        a2 = asyncio.ensure_future(q.acquire(alloc("a2"), 10.0, key="k"))  # full, but it takes a's place
        with pytest.raises(WaitRefused) as info:
            await a
        assert info.value.reason == "replaced" and len(q) == 2 and q._queue[0].since == since
        free["n"] = 1
        q.notify()
        assert await a2 == "a2" and not b.done()
        free["n"] = 1
        q.notify()
        assert await b == "b" and q.stats()["served"] == 2  # the replaced one was not served

    asyncio.run(main())
