"""A volunteer server open to any client (``--allow-any-client``) keeps untrusted peers ("strangers") to their share of
the KV pool: one peer id at most ``--max-kv-share-per-stranger``, all of them together at most
``--max-kv-share-strangers`` (peer ids are free), refused past it with code ``stranger_quota``; their queued opens
neither hold up trusted opens nor fill the wait queue. One stranger used to open sessions until the whole pool was
its own, and the trusted orchestrator's opens got ``no_capacity``."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from petals_chain.server.__main__ import build_parser
from petals_chain.server import admission
from petals_chain.server.admission import SlotWaitQueue
from petals_chain.server.config import ServerConfig
from petals_chain.server.kv_cache import NoCapacityError
from petals_chain.server.runner import BlockRunner
from petals_chain.server.sessions import SessionService
from petals_chain.swarm.rpc import PetalsChainBlocks, RefusedError, RemoteError, ServerClient
from petals_chain.swarm.tiny_model import build_tiny_model

QUOTA = "stranger_quota"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=2, seed=0)


def _service(model, trusted=("orch",), **kw) -> SessionService:
    """2 blocks, a pool of 32 pages of 16 tokens: a 16-token session takes 2 pages (per stranger 8, together 16)."""
    svc = SessionService(hidden_size=0, trusted=set(trusted), allow_any_client=True, state=lambda: "online",
                         on_change=lambda: None, describe=lambda: {}, **kw)
    svc.runner = BlockRunner(model, 0, 2, num_slots=8, max_length=64, progress=False, batching=False)
    svc.hidden_size = svc.runner.hidden_size
    assert svc.runner.pool.num_pages == 32
    return svc


def _refused(fn, *args, **kwargs) -> RefusedError:
    with pytest.raises(RefusedError) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------------------------- accounting
def test_shares_refuse_past_the_per_peer_and_the_strangers_cap():
    shares = admission.StrangerShares(per_stranger=0.25, strangers=0.5)
    assert shares.refusal(8, 0, 0, 32) is None and shares.refusal(2, 6, 14, 32) is None
    assert "at most 8 of its 32" in shares.refusal(9, 0, 0, 32)  # one session over the cap alone
    assert "close a session first" in shares.refusal(2, 8, 8, 32)
    assert "trusted orchestrators" in shares.refusal(2, 0, 16, 32)
    assert shares.refusal(2, 0, 16, 32, reserve=False) is None  # nobody trusted: no reserve to keep
    assert admission.StrangerShares(1.0, 1.0).refusal(32, 0, 0, 32) is None
    for bad in (0, -0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="fraction in"):
            admission.StrangerShares(per_stranger=bad)
        with pytest.raises(ValueError, match="--max-kv-share-strangers"):
            admission.StrangerShares(strangers=bad)


def test_a_stranger_is_held_to_its_share_and_a_trusted_peer_still_opens(model):
    """Before: one peer id opened 16 sessions (all 32 pages) and the orchestrator's open got ``no_capacity``."""
    svc = _service(model)
    for i in range(4):
        svc.open_session(f"m{i}", 0, 2, 16, "mallory")
    err = _refused(svc.open_session, "m4", 0, 2, 16, "mallory")
    assert err.code == QUOTA and "holds (or waits for) 8 cache pages" in str(err)
    for i in range(4):  # a second peer id: up to the strangers' 16 pages together
        svc.open_session(f"e{i}", 0, 2, 16, "eve")
    err = _refused(svc.open_session, "z0", 0, 2, 16, "zed")  # a fresh peer id gets nothing more
    assert err.code == QUOTA and "kept for its trusted orchestrators" in str(err)
    for i in range(8):  # the reserve: the trusted orchestrator opens over the other half of the pool
        svc.open_session(f"o{i}", 0, 2, 16, "orch")
    assert svc.runner.pool.pages_available == 0
    assert _refused(svc.open_session, "o8", 0, 2, 16, "orch").code == "no_capacity"  # full: not a quota
    svc.close_session("m0")
    svc.open_session("m4", 0, 2, 16, "mallory")  # a close gives the share back


def test_nobody_trusted_keeps_no_reserve_but_each_peer_its_cap(model):
    svc = _service(model, trusted=())
    for peer in ("a", "b", "c", "d"):
        for i in range(4):
            svc.open_session(f"{peer}{i}", 0, 2, 16, peer)
    assert svc.runner.pool.pages_available == 0
    assert _refused(svc.open_session, "a4", 0, 2, 16, "a").code == QUOTA


def test_a_fork_and_an_extend_count_against_the_share(model):
    async def main():
        svc = _service(model)
        svc.open_session("m", 0, 2, 32, "mallory")  # 4 of its 8 pages
        await svc.forward("m", torch.randn(1, 3, svc.hidden_size), 0)
        svc.open_session("f", 0, 2, 32, "mallory", fork_from="m", fork_length=3)  # 8 of 8
        free = svc.runner.pool.pages_available
        err = _refused(svc.extend_session, "m", 48)
        assert err.code == QUOTA and svc.sessions["m"].max_length == 32 and svc.runner.pool.pages_available == free
        assert svc.extend_session("m", 30)["max_length"] == 32  # no more pages: nothing to refuse
        svc.close_session("f")
        assert svc.extend_session("m", 48)["max_length"] == 48
        svc.open_session("o", 0, 2, 64, "orch")
        assert svc.extend_session("o", 64)["max_length"] == 64

    asyncio.run(main())


def test_a_session_bigger_than_the_cap_is_refused_with_the_cap(model):
    shares = admission.StrangerShares(per_stranger=0.2)
    err = shares.refusal(8, 0, 0, 32)  # no floor given: 6 of 32 pages
    assert "8 cache pages asked for" in err and "at most 6 of its 32" in err
    assert shares.refusal(8, 0, 0, 32, session_pages=8) is None  # a cap is at least one whole-span session
    svc = _service(model, stranger_shares=shares)
    svc.open_session("m", 0, 2, 64, "mallory")  # 8 pages: one session of the server's span at its max length
    err = _refused(svc.open_session, "m2", 0, 2, 16, "mallory")
    assert err.code == QUOTA and "at most 8 of its 32" in str(err)
    svc.open_session("o", 0, 2, 64, "orch")


# ---------------------------------------------------------------------------------------------------- queued opens
def test_a_strangers_queued_open_does_not_hold_up_trusted_opens(model):
    """Before: a stranger's open waiting for 4 pages made every open that did not wait ``no_capacity`` (2 pages
    free), and a trusted open that waited queued behind it."""
    async def main():
        svc = _service(model)
        for i in range(15):
            svc.open_session(f"o{i}", 0, 2, 16, "orch")  # 30 of 32 pages
        stranger = asyncio.ensure_future(svc.open_session_wait("m", 0, 2, 32, "mallory", wait_s=30.0))
        await asyncio.sleep(0.05)
        assert not stranger.done() and len(svc.admission) == 1
        svc.open_session("o15", 0, 2, 16, "orch")  # the 2 free pages
        trusted = asyncio.ensure_future(svc.open_session_wait("o16", 0, 2, 16, "orch", wait_s=30.0))
        await asyncio.sleep(0.05)
        assert [w.guest for w in svc.admission._queue] == [False, True]  # the trusted open waits ahead
        svc.close_session("o0")
        await asyncio.wait_for(trusted, 5.0)
        assert not stranger.done()
        svc.close_session("o1")
        svc.close_session("o2")
        await asyncio.wait_for(stranger, 5.0)
        assert "m" in svc.sessions

    asyncio.run(main())


def test_a_strangers_queued_opens_count_against_its_share_and_the_queue(model):
    async def main():
        svc = _service(model, max_waiters=4)  # strangers may fill 2 of its places
        for i in range(16):
            svc.open_session(f"o{i}", 0, 2, 16, "orch")  # the pool is full
        waits = [asyncio.ensure_future(svc.open_session_wait("m0", 0, 2, 64, "mallory", wait_s=30.0))]
        await asyncio.sleep(0.05)
        err = _refused(svc.open_session, "m1", 0, 2, 16, "mallory")  # its queued 8 pages are its share
        assert err.code == QUOTA and "waits for" in str(err)
        with pytest.raises(RefusedError) as info:
            await svc.open_session_wait("m1", 0, 2, 16, "mallory", wait_s=30.0)
        assert info.value.code == QUOTA
        waits.append(asyncio.ensure_future(svc.open_session_wait("e0", 0, 2, 16, "eve", wait_s=30.0)))
        await asyncio.sleep(0.05)
        with pytest.raises(RefusedError) as info:  # a third stranger's wait: the queue's strangers' half is full
            await svc.open_session_wait("z0", 0, 2, 16, "zed", wait_s=30.0)
        assert info.value.code == QUOTA and "wait for slots already" in str(info.value)
        waits.append(asyncio.ensure_future(svc.open_session_wait("o16", 0, 2, 16, "orch", wait_s=30.0)))
        await asyncio.sleep(0.05)
        assert len(svc.admission) == 3 and svc.admission.guests == 2
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        assert len(svc.admission) == 0 and not svc._waiting
        svc.close_session("o0")
        svc.open_session("m1", 0, 2, 16, "mallory")  # its wait withdrawn, its share is back

    asyncio.run(main())


def test_a_strangers_queued_opens_served_together_are_counted_once(model):
    """A served wait's pages counted twice (held, and still waited for) until its waiter woke: the same peer's next
    waiter, served in the same pass, was refused its share."""
    async def main():
        svc = _service(model)
        for i in range(16):
            svc.open_session(f"o{i}", 0, 2, 16, "orch")
        waits = [asyncio.ensure_future(svc.open_session_wait(f"m{i}", 0, 2, 32, "mallory", wait_s=30.0))
                 for i in range(2)]  # 4 + 4 pages: its whole share
        await asyncio.sleep(0.05)
        # one id waits once: sent again, it takes its wait's place (its pages not counted twice: no quota)
        waits.append(asyncio.ensure_future(svc.open_session_wait("m0", 0, 2, 32, "mallory", wait_s=30.0)))
        await asyncio.sleep(0.05)
        with pytest.raises(RefusedError) as info:
            await waits.pop(0)
        assert info.value.code == "invalid" and "replaced" in str(info.value) and len(svc.admission) == 2
        for i in range(4):
            svc.close_session(f"o{i}")  # 8 pages free: both fit
        await asyncio.wait_for(asyncio.gather(*waits), 5.0)
        assert {"m0", "m1"} <= set(svc.sessions) and not svc._waiting

    asyncio.run(main())


def test_the_queue_serves_trusted_waiters_before_guests():
    async def main():
        q = SlotWaitQueue(NoCapacityError, max_waiters=8)
        free = {"n": 0}
        order = []

        def alloc(name):
            def go():
                if not free["n"]:
                    raise NoCapacityError("full")
                free["n"] -= 1
                order.append(name)
                return name
            return go

        tasks = [asyncio.ensure_future(q.acquire(alloc("g1"), 10.0, guest=True)),
                 asyncio.ensure_future(q.acquire(alloc("t1"), 10.0)),
                 asyncio.ensure_future(q.acquire(alloc("g2"), 10.0, guest=True)),
                 asyncio.ensure_future(q.acquire(alloc("t2"), 10.0))]
        await asyncio.sleep(0.01)
        assert q.guests == 2 and q.ahead_of(False) == 2 and q.ahead_of(True) == 4
        free["n"] = 4
        q.notify()
        await asyncio.gather(*tasks)
        assert order == ["t1", "t2", "g1", "g2"]

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("flag", ["--max-kv-share-per-stranger", "--max-kv-share-strangers"])
@pytest.mark.parametrize("value", ["0", "-0.5", "1.01", "nan", "inf", "half"])
def test_a_bad_share_exits_2_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--model", "m", flag, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {flag}: " in err and ("fraction in (0, 1]" in err or "number" in err)


def test_the_shares_reach_the_config(monkeypatch):
    args = build_parser().parse_args(["--model", "m"])
    assert (args.max_kv_share_per_stranger, args.max_kv_share_strangers) == (0.25, 0.5)
    seen = []

    def fake_server(cfg, **kw):
        seen.append(cfg)
        raise ValueError("stop here")

    monkeypatch.setattr("petals_chain.server.server.Server", fake_server)
    from petals_chain.server.__main__ import main
    assert main(["--model", "m", "--allow-any-client", "--max-kv-share-per-stranger", "0.1",
                 "--max-kv-share-strangers", "1", "--log-level", "WARNING"]) == 2
    cfg = seen[0]
    assert cfg.stranger_shares() == admission.StrangerShares(per_stranger=0.1, strangers=1.0)
    with pytest.raises(ValueError, match="--max-kv-share-strangers must be a fraction"):
        ServerConfig(model="m", max_kv_share_strangers=0).validate()


# ---------------------------------------------------------------------------------------------------- over loopback
def test_over_loopback_a_stranger_is_refused_at_its_cap_and_the_orchestrator_still_opens(model):
    trusted: set[str] = set()
    svc = _service(model)
    svc.trusted = trusted

    async def main():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        await PetalsChainBlocks(svc, linger_s=0.2).add_p2p_handlers(server)
        maddrs = [str(m) for m in await server.get_visible_maddrs()]
        orch, stranger = [await P2P.create(initial_peers=maddrs) for _ in range(2)]
        trusted.add(str(orch.peer_id))
        try:
            client = ServerClient(stranger, step_timeout_s=60)
            held = [await client.open_session(server.peer_id, f"m{i}", 0, 2, 16) for i in range(4)]
            with pytest.raises(RemoteError) as info:
                await client.open_session(server.peer_id, "m4", 0, 2, 16)
            assert info.value.code == QUOTA and "close a session first" in str(info.value)
            out = await held[0].step(torch.randn(1, 2, svc.hidden_size), 0)  # its sessions still serve
            assert out.shape == (1, 2, svc.hidden_size)
            orch_client = ServerClient(orch, step_timeout_s=60)
            mine = [await orch_client.open_session(server.peer_id, f"o{i}", 0, 2, 16) for i in range(12)]
            assert svc.runner.pool.pages_available == 0
            for sess in held + mine:
                await sess.close()
        finally:
            for p in (orch, stranger, server):
                await p.shutdown()

    asyncio.run(main())


def test_the_server_serves_with_the_configured_shares(tiny_model_dir):
    from petals_chain.server.server import Server

    server = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.01, allow_any_client=True,
                                 max_kv_share_per_stranger=0.1))
    assert server.service.stranger_shares == admission.StrangerShares(per_stranger=0.1, strangers=0.5)
    with pytest.raises(ValueError, match="--max-kv-share-per-stranger"):
        Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.01, max_kv_share_per_stranger=float("nan")))


# ---------------------------------------------------------------------------------------------------- review fixes
@pytest.mark.parametrize("max_waiters", [0, 1])
def test_the_wait_queues_part_bounds_only_opens_that_must_wait(model, max_waiters):
    """Before: with ``--max-waiters`` 0 or 1 the strangers' part of the queue is 0, and every stranger's open asking
    to wait was refused ``stranger_quota`` on an empty server (a routed orchestrator always asks to wait)."""
    async def main():
        svc = _service(model, max_waiters=max_waiters)
        reply = await svc.open_session_wait("m0", 0, 2, 16, "mallory", wait_s=30.0)  # fits: opens at once
        assert "m0" in svc.sessions and reply["slots_free"] == 7
        for i in range(15):
            svc.open_session(f"o{i}", 0, 2, 16, "orch")  # the pool is full
        with pytest.raises(RefusedError) as info:  # must wait now: past the strangers' part (0 places)
            await svc.open_session_wait("e0", 0, 2, 16, "eve", wait_s=30.0)
        code = "no_capacity" if max_waiters == 0 else QUOTA  # no queue at all: full, as for anyone
        assert info.value.code == code and len(svc.admission) == 0 and not svc._waiting
        if max_waiters:
            assert "wait for slots already (at most 0)" in str(info.value)
            trusted = asyncio.ensure_future(svc.open_session_wait("o15", 0, 2, 16, "orch", wait_s=30.0))
            await asyncio.sleep(0.05)
            assert len(svc.admission) == 1  # the trusted open still queues
            svc.close_session("o0")
            await asyncio.wait_for(trusted, 5.0)

    asyncio.run(main())


def test_a_queued_strangers_turn_on_a_full_pool_does_not_scan_every_session(model, monkeypatch):
    """Every step and close tries the queue's head; a stranger's there summed every open session's pages first,
    also when the pool had no room for it: each step O(sessions), a decode round O(sessions^2) (2,000 sessions:
    1.4 s of event loop per round)."""
    async def main():
        svc = _service(model, stranger_shares=admission.StrangerShares(1.0, 1.0))
        for i in range(16):
            svc.open_session(f"o{i}", 0, 2, 16, "orch" if i % 2 else f"p{i}")  # full; 8 strangers' sessions
        scans = []
        scan = svc.stranger_pages
        monkeypatch.setattr(svc, "stranger_pages", lambda *a, **kw: scans.append(a) or scan(*a, **kw))
        waiter = asyncio.ensure_future(svc.open_session_wait("m", 0, 2, 16, "mallory", wait_s=30.0))
        await asyncio.sleep(0.05)
        assert len(svc.admission) == 1 and not waiter.done()
        scans.clear()
        for _ in range(3):
            await svc.forward("o1", torch.randn(1, 1, svc.hidden_size), svc.runner.session_length("o1"))
        assert len(svc.admission) == 1 and scans == []  # tried at each step, found too big before any scan
        svc.close_session("o3")
        await asyncio.wait_for(waiter, 5.0)  # room now: its share checked, and served
        assert "m" in svc.sessions and scans

    asyncio.run(main())
