"""A server's session cap in its record, and the descriptors a session holds by relay mode.

1. The planner counted a paged server's jobs by its cache tokens over ``L^`` (``max_length / L^`` times its slots)
   while admission takes no more sessions than its open-files limit holds: at a cap of 10 sessions it planned 40 jobs
   of 64 tokens. The record now says the cap (``max_sessions``) and the planner counts no more.
2. Every session was counted at 3 descriptors, as a push relay's session holds (its stream, a push in, a push out),
   under the default ``--relay orchestrator`` too, where it holds 1 (measured with the tiny model: 8 sessions, +9
   descriptors in the server process): at ``ulimit -n 1024`` the cap was 320 sessions where 960 fit.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hivemind.proto import runtime_pb2

from petals_chain.server import admission
from petals_chain.swarm.records import ServerRecord, _ServerValueV1
from petals_chain.swarm.rpc import PetalsChainBlocks, RefusedError, _pack, _unpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_s36_server_oslimits_fds import _Counter, _record_of, _service  # noqa: E402

_BUDGET = admission.DESCRIPTORS_IDLE + admission.DESCRIPTOR_RESERVE  # a limit's part no session may have


def _planner(job_tokens: int):
    from petals_chain.orchestrator.planner import Planner

    return Planner(dht=None, prefix="t", client=None, max_length=256, on_chains=lambda chains: None,
                   job_tokens=job_tokens)


def _admitted(svc, prefix: str = "s", **kw) -> int:
    """Opens ``svc`` takes before it refuses one (``no_capacity``)."""
    n = 0
    with pytest.raises(RefusedError) as e:
        while True:
            svc.open_session(f"{prefix}{n}", 0, 4, 256, "orch", **kw)
            n += 1
    assert e.value.code == "no_capacity", e.value
    return n


def test_a_paged_server_under_its_session_cap_is_planned_no_more_jobs_than_admission_takes():
    """A paged server whose open-files limit holds 10 sessions announced 10 slots of 256 tokens: the planner,
    with jobs of 64 tokens, counted 40 jobs on it (its tokens over L^), and admission took 10."""
    svc = _service(_Counter(in_use=None, limit=_BUDGET + 10))  # a limit that holds 10 (plain) sessions
    rec = _record_of(svc)
    assert rec.kv_cache == "paged" and rec.cache_tokens_total == rec.slots_total * 256
    planned = _planner(job_tokens=64).residual_jobs(rec)
    admitted = _admitted(svc)
    assert planned == admitted, f"{planned} jobs planned on a server that admits {admitted}"
    assert rec.max_sessions == rec.session_cap() == admitted == 10
    # below its cap the tokens still count: a cap of 10 on 2 slots of 256 tokens plans 8 jobs of 64
    small = rec.model_copy(update=dict(slots_total=2, slots_free=2, cache_tokens_total=512, cache_tokens_free=512,
                                       stranger_slots_free=-1))
    assert _planner(job_tokens=64).residual_jobs(small) == 8


def test_a_record_without_a_cap_is_planned_as_before_and_the_cap_is_validated():
    common = dict(peer_id="p", state="online", memory_bytes=1, tau_p=0.01, start_block=0, num_blocks=4,
                  max_length=256, slots_total=10, slots_free=10, kv_cache="paged", page_size=16,
                  cache_tokens_total=2560, cache_tokens_free=2560)
    old = ServerRecord(**common).to_value()
    del old["max_sessions"]  # an older server's record: it does not say
    rec = ServerRecord.from_value(old)
    assert rec.max_sessions == -1 and rec.session_cap() is None and _planner(64).residual_jobs(rec) == 40
    assert _ServerValueV1(**old).dict() == old  # the DHT's validator takes it, filling nothing in
    new = ServerRecord(**common, max_sessions=10).to_value()
    assert _ServerValueV1(**new).dict()["max_sessions"] == 10
    for bad in (-2, 2.0, "10", True):
        with pytest.raises(Exception):
            _ServerValueV1(**{**new, "max_sessions": bad})
    with pytest.raises(ValueError):
        ServerRecord(**common, max_sessions=-2)


def test_a_change_of_cap_is_a_change_of_the_servers_capacities():
    """GCA's chains are computed again when a server's cap changes (its slots and tokens may not)."""
    pl = _planner(64)
    base = dict(peer_id="p", state="online", memory_bytes=1, tau_p=0.01, start_block=0, num_blocks=4,
                max_length=256, slots_total=10, slots_free=10, kv_cache="paged", page_size=16,
                cache_tokens_total=2560, cache_tokens_free=2560, public_name="A")
    views = [SimpleNamespace(peer_id="p", record=ServerRecord(**base, max_sessions=c)) for c in (10, 30)]
    was, now = pl._chains_key(views[:1]), pl._chains_key(views[1:])
    assert was != now and pl._servers_change(was[2:], now[2:]) == "session cap of p 10 -> 30"


def test_plain_sessions_hold_one_descriptor_and_push_sessions_three():
    """At ``ulimit -n 1024`` the cap was 320 sessions (3 each) under ``--relay orchestrator``, where 960 fit."""
    c = _Counter(in_use=20, limit=1024)
    clock = SimpleNamespace(t=0.0)
    d = admission.Descriptors(in_use=lambda: c.in_use, limit=lambda: c.limit, clock=lambda: clock.t)
    assert d.sessions_total() == 960 and d.stats()["per_session"] == 1
    assert d.refusal(959) is None and d.refusal(960) is not None  # plain opens: 960 held at most
    assert d.refusal(319, push=319, opening_push=True) is None  # 320 push sessions hold all 960
    assert d.refusal(320, push=320, opening_push=True) is not None
    assert d.sessions_total() == 320  # a push open came: the record counts 3 a session
    assert d.refusal(319, push=319) is None  # a plain open still fits: 958 of 960
    assert d.sessions_free(300, push=100) == (960 - 100 * 3 - 200) // 3
    clock.t += admission.PUSH_SEEN_S  # no push open for PUSH_SEEN_S: counted at 1 again
    assert d.sessions_total() == 960 and d.sessions_free(300, push=100) == 960 - 100 * 3 - 200


def test_the_server_counts_push_sessions_at_three_and_others_at_one():
    """The session service weighs the sessions it holds by their kind; closing one gives its descriptors back."""
    svc = _service(_Counter(in_use=None, limit=_BUDGET + 30))
    assert _admitted(svc) == 30  # plain: 30 at 1 each (was 10 at 3 each)
    for i in range(30):
        svc.close_session(f"s{i}")
    assert _admitted(svc, "p", push=True) == 10 and svc.held_push() == 10
    svc.close_session("p0")
    assert svc.held_push() == 9
    assert _admitted(svc, "q") == 3  # 9 push sessions hold 27 of 30
    assert svc.info()["open_files"]["sessions_free"] == 0
    for i in range(1, 10):
        svc.close_session(f"p{i}")
    assert svc.held_push() == 0 and svc._push_waiting == 0


def test_a_waiting_push_open_counts_as_a_push_session():
    svc = _service(_Counter(in_use=None, limit=_BUDGET + 6))

    async def main():
        svc.runner.pool = SimpleNamespace(num_pages=10**6)
        svc.runner.pages_needed = lambda blocks, tokens: 1
        got = await svc.open_session_wait("w", 0, 4, 256, "orch", wait_s=1.0, push=True)
        assert got["start_block"] == 0 and svc.held_push() == 1 and svc._push_waiting == 0
        assert _admitted(svc, "p", push=True) == 1  # 2 push sessions hold all 6

    asyncio.run(main())


class _Recording:
    """A session backend that records the keywords of each open."""

    hidden_size = 8
    model_fingerprint = ""

    def __init__(self):
        self.opens: list[dict] = []

    def authorize(self, peer_id: str) -> bool:
        return True

    def open_session(self, sid, start, end, max_length, peer, **kw) -> dict:
        self.opens.append(kw)
        return {}

    async def open_session_wait(self, sid, start, end, max_length, peer, wait_s, **kw) -> dict:
        self.opens.append({"wait": True, **kw})
        return {}

    def close_session(self, session_id: str, **kw) -> None:
        pass

    def info(self) -> dict:
        return {}


def test_the_rpc_tells_the_backend_which_opens_carry_a_push_token():
    backend = _Recording()
    handler = PetalsChainBlocks(backend, linger_s=0.0)
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: "orch"))

    async def open_one(**extra) -> dict:
        async def requests():
            yield runtime_pb2.ExpertRequest(metadata=_pack({"op": "open", "session_id": f"s{len(backend.opens)}",
                                                            "start_block": 0, "end_block": 2, "max_length": 16,
                                                            **extra}))
            await asyncio.Event().wait()  # the stream stays open: the open is answered, not withdrawn

        replies = handler.rpc_session(requests(), context)
        try:
            return _unpack((await asyncio.wait_for(replies.__anext__(), 30)).metadata)
        finally:
            await replies.aclose()

    async def main():
        token = "t" * 32
        for extra in ({}, {"push_token": token}, {"wait_s": 1.0}, {"wait_s": 1.0, "push_token": token}):
            assert (await open_one(**extra))["ok"], extra
    asyncio.run(main())
    assert backend.opens == [{}, {"push": True}, {"wait": True}, {"wait": True, "push": True}], backend.opens


def test_a_push_server_announces_a_third_of_the_sessions():
    """The record's cap follows the kind of sessions the server is opened: a push open makes it count 3 each."""
    svc = _service(_Counter(in_use=20, limit=_BUDGET + 60))
    rec = _record_of(svc)
    assert (rec.slots_total, rec.max_sessions) == (60, 60)
    svc.open_session("p", 0, 4, 256, "orch", push=True)
    rec = _record_of(svc)
    assert (rec.slots_total, rec.max_sessions, rec.slots_free) == (20, 20, 19)
