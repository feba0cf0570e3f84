"""Mixed versions in one swarm: records and RPC messages of older and newer peers, built by hand.

A newer server's record may carry a value this version does not know in a field with a fixed set (a new state, KV
mode, reachability): it is read as the field's fallback, not dropped (and the DHT validator, which drops a peer's
whole reply of a key for one record it refuses, takes it). Records say which wire protocols a server speaks; an
older record without them speaks the oldest. Refusal codes that refine one older clients know travel as that one.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pydantic
import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from petals_chain.orchestrator.planner import ServerView
from petals_chain.swarm import rpc
from petals_chain.swarm.dht import _SwarmSchemaValidator
from petals_chain.swarm import records
from petals_chain.swarm.records import ServerRecord
from petals_chain.swarm.rpc import (NoCapacityError, PetalsChainBlocks, RefusedError, RemoteError, RemoteSession,
                                    ServerClient, _error, _pack, _raise_if_error, _unpack, serialize_chunks)

PREFIX = "compat-model"
HIDDEN = 8
FALLBACKS = {"state": "offline", "kv_cache": "paged", "reachability": "unknown", "emulate_reply_fault": "none"}


def _value(**kw) -> dict:
    base = dict(peer_id="QmNewer", state="online", memory_bytes=10_000_000, tau_p=0.01, num_blocks=2, slots_total=4,
                slots_free=4, public_name="volunteer", max_length=64)
    return ServerRecord(**base).to_value() | kw


def _validates(value: dict) -> bool:
    """What this node's DHT validator says of the record (False: the peer's whole reply of the key is dropped)."""
    record = DHTRecord(key=DHTID.generate(source=f"{PREFIX}.servers").to_bytes(),
                       subkey=MSGPackSerializer.dumps(b"[owner:ssh-rsa AAAAB3NzaC1yc2E]"),
                       value=MSGPackSerializer.dumps(value), expiration_time=time.time() + 60)
    return _SwarmSchemaValidator(PREFIX).validate(record)


@pytest.mark.parametrize("field,said", [("state", "maintenance"), ("kv_cache", "quantized"),
                                        ("reachability", "hole-punched"), ("emulate_reply_fault", "drop")])
def test_a_newer_servers_enum_value_is_read_as_the_fallback(field, said):
    """Before: ServerRecord.from_value raised (literal_error) and the DHT validator refused the record, so a newer
    server was invisible (with a warning per writer), and any peer's reply holding it lost every record of the key."""
    value = _value(**{field: said})
    assert _validates(value)
    got = ServerRecord.from_value(value)
    assert getattr(got, field) == FALLBACKS[field] == records.OPEN_ENUMS[field] and got.unread == {field: said}
    assert got.public_name == "volunteer" and got.slots_free == 4
    assert ServerRecord.from_value(_value()).unread == {}
    with pytest.raises(pydantic.ValidationError):  # built in code, an unknown value is still an error
        ServerRecord(**{k: v for k, v in value.items() if k != "timestamp"})
    for junk in ("Bad State", "x" * 40, ""):  # not a short name: refused by both, as before
        assert not _validates(_value(**{field: junk}))
        with pytest.raises(ValueError):
            ServerRecord.from_value(_value(**{field: junk}))


def test_a_server_in_a_state_this_version_does_not_know_is_not_planned():
    newer = ServerView("QmNewer", ServerRecord.from_value(_value(state="maintenance")))
    assert newer.record.state == "offline" and not newer.usable
    # an unknown KV mode or reachability does not keep a server out
    for field, said in (("kv_cache", "quantized"), ("reachability", "hole-punched")):
        assert ServerView("QmNewer", ServerRecord.from_value(_value(**{field: said}))).usable


def test_records_say_their_protocol_and_an_older_record_speaks_the_oldest():
    """A record without ``protocol`` (every server before the field) is read as protocol 1, however far PROTOCOL
    has moved; a server whose protocols this version does not speak is said to be so, with the way out."""
    PROTOCOL = records.PROTOCOL
    ours = _value()
    assert ours["protocol"] == PROTOCOL and ours["protocol_min"] == 1 and _validates(ours)
    older = {k: v for k, v in ours.items() if k not in ("protocol", "protocol_min")}
    assert _validates(older)
    got = ServerRecord.from_value(older)
    assert (got.protocol, got.protocol_min, got.protocol_problem()) == (1, 1, "")
    newer = ServerRecord.from_value(_value(protocol=PROTOCOL + 2, protocol_min=PROTOCOL + 1,
                                           version="petals-chain/9"))
    assert "newer server, upgrade the orchestrator" in newer.protocol_problem()
    assert "petals-chain/9" in newer.protocol_problem()
    assert ServerRecord.from_value(_value(protocol=PROTOCOL + 2)).protocol_problem() == ""  # it still serves ours
    if records.MIN_PROTOCOL > 1:
        assert "older server, upgrade it" in got.protocol_problem()
    for bad in (dict(protocol=1, protocol_min=2), dict(protocol=0), dict(protocol_min=1 << 20)):
        with pytest.raises(ValueError):
            ServerRecord.from_value(_value(**bad))
    assert not any(_validates(_value(protocol=bad)) for bad in (0, "2", 1.0))


def _client_before_the_quota_code(meta: dict) -> RemoteError:
    """What every orchestrator before 2b322eb raised for an error reply (only no_capacity meant 'full')."""
    code, message = str(meta.get("code", "invalid")), str(meta.get("error", "unknown error"))
    return NoCapacityError(message) if code == "no_capacity" else RemoteError(message, code)


def test_stranger_quota_travels_as_no_capacity_and_reads_back_as_itself():
    """Before: the reply said code stranger_quota, which every orchestrator before 2b322eb (8 commits back) read as
    a failed server: a failover counted, its tokens replayed, the job given up with 503 after the failover budget."""
    wire = _unpack(_error("stranger_quota", "full for you").metadata)
    assert wire == {"ok": False, "code": "no_capacity", "reason": "stranger_quota", "error": "full for you"}
    assert isinstance(_client_before_the_quota_code(wire), NoCapacityError)
    with pytest.raises(NoCapacityError) as info:
        _raise_if_error(wire)
    assert info.value.code == "stranger_quota" and str(info.value) == "full for you"
    # a server between df23090 and now sends the code itself; a reason that refines another code is not taken
    with pytest.raises(NoCapacityError, match="full") as info:
        _raise_if_error({"ok": False, "code": "stranger_quota", "error": "full"})
    assert info.value.code == "stranger_quota"
    for code, reason, expect in (("invalid", "stranger_quota", "invalid"), ("no_capacity", "gpu_hot", "no_capacity"),
                                 ("no_capacity", 5, "no_capacity")):
        with pytest.raises(RemoteError) as info:
            _raise_if_error({"ok": False, "code": code, "reason": reason, "error": "x"})
        assert info.value.code == expect and isinstance(info.value, NoCapacityError) == (expect == "no_capacity")
    assert _unpack(_error("no_push", "no push for step 3").metadata)["code"] == "no_push"  # text read by older ones


class _Backend:
    """Opens refused with ``refuse`` (a code) if set; steps add one."""

    hidden_size = HIDDEN
    model_fingerprint = ""

    def __init__(self, refuse: str = ""):
        self.refuse, self.opened, self.closed = refuse, [], []

    def authorize(self, peer_id: str) -> bool:
        return True

    def open_session(self, sid, start, end, max_length, peer, **kwargs) -> dict:
        if self.refuse:
            raise RefusedError(self.refuse, f"refused: {self.refuse}")
        self.opened.append((sid, kwargs))
        return {}

    async def forward(self, session_id, hidden, position):
        return hidden + 1

    def close_session(self, session_id, **kwargs) -> None:
        self.closed.append(session_id)

    def info(self) -> dict:
        return {}


async def _converse(handler: PetalsChainBlocks, messages: list) -> list[dict]:
    """Send ``messages`` on one session stream; the replies' metadata (tensor chunks skipped)."""
    async def requests():
        for m in messages:
            yield m

    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: "QmNewerOrchestrator"))
    out = []
    async for reply in handler.rpc_session(requests(), context):
        if reply.metadata:
            out.append(_unpack(reply.metadata))
    return out


def _msg(meta: dict, tensor: torch.Tensor | None = None) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=_pack(meta), tensors=serialize_chunks(tensor) if tensor is not None
                                     else [])


def test_the_server_refuses_a_stranger_with_a_code_older_orchestrators_wait_on():
    replies = asyncio.run(_converse(PetalsChainBlocks(_Backend(refuse="stranger_quota"), linger_s=0.0), [
        _msg({"op": "open", "session_id": "s", "start_block": 0, "end_block": 1, "max_length": 8})]))
    assert [(r["code"], r.get("reason")) for r in replies] == [("no_capacity", "stranger_quota")]
    assert isinstance(_client_before_the_quota_code(replies[0]), NoCapacityError)


def test_a_newer_clients_fields_and_ops_are_ignored_or_refused_without_losing_the_session():
    """An orchestrator newer than the server sends fields the server does not know (ignored) and an op it does not
    know (refused ``invalid``; the session stays usable)."""
    backend = _Backend()
    x = torch.zeros(1, 2, HIDDEN)
    future = {"protocol": 9, "trace": {"id": "abc", "hops": [1, 2]}, "priority": 0.5}
    replies = asyncio.run(_converse(PetalsChainBlocks(backend, linger_s=0.0), [
        _msg({"op": "open", "session_id": "s", "start_block": 0, "end_block": 1, "max_length": 8, **future}),
        _msg({"op": "step", "position": 0, **future}, x),
        _msg({"op": "rewind", "position": 1}),
        _msg({"op": "step", "position": 2, **future}, x),
        _msg({"op": "keepalive", **future}),
        _msg({"op": "close", **future})]))
    assert [r["ok"] for r in replies] == [True, True, False, True, True, True], replies
    assert replies[1]["position"] == 2 and replies[3]["position"] == 4
    assert replies[2]["code"] == "invalid" and "unknown op 'rewind'" in replies[2]["error"]
    assert backend.opened == [("s", {})] and backend.closed == ["s"]


async def _replies(*metas_and_tensors):
    for meta, tensor in metas_and_tensors:
        chunks = serialize_chunks(tensor) if tensor is not None else []
        yield runtime_pb2.ExpertResponse(metadata=_pack(meta), tensors=chunks[:1])


def test_an_older_servers_replies_without_optional_fields_take_their_defaults(monkeypatch):
    """A server before idle_timeout_s, prefix caches, compute_s, push digests: its bare replies are read with the
    documented defaults (no keepalives, nothing cached, no compute time, did not push)."""
    x = torch.zeros(1, 2, HIDDEN)

    async def open_stream(p2p, peer_id, method, requests):
        return _replies(({"ok": True}, None))

    monkeypatch.setattr(rpc.PeerStream, "open", open_stream)

    async def main():
        client = ServerClient(p2p=None, open_timeout_s=5)
        sess = await client.open_session("QmOlder", "s", 0, 1, 8, prefix_hashes=b"\x01" * 16, push_token="t" * 16)
        assert (sess.idle_timeout_s, sess.cached_tokens, sess.position, sess.prefix_cache) == (None, 0, 0, False)
        step = RemoteSession("QmOlder", "s2", 0, 1, 8, step_timeout_s=5)
        step._responses = _replies(({"ok": True}, x + 1), ({"ok": True}, x + 1))
        out = await step.step(x, 0)
        assert torch.equal(out, x + 1) and step.last_compute_s is None and step.input_digest is None
        route = [{"peer": "QmNext", "session_id": "n", "token": "t" * 16}]
        await step.step(x, 2, route=route, step_id=1)
        assert step.pushed is False and step.push_error == "the server did not push" and step.position == 4

    asyncio.run(main())


def test_the_planner_refuses_a_server_it_cannot_drive_and_says_why():
    """A server whose oldest wire protocol is newer than this version's is never planned: it is listed as refused
    with the reason (it was planned, and every open to it would fail)."""
    import asyncio

    from petals_chain.swarm import records as rec_mod
    from test_failover_units import planner, record

    newer = rec_mod.PROTOCOL + 1
    records = {"a": record("a"), "b": record("b", protocol=newer, protocol_min=newer)}
    pl = planner(records)
    asyncio.run(pl.refresh())
    assert "b" in pl.refused and "b" not in pl.servers and "a" in pl.servers
    shown = {s["peer_id"]: s for s in pl.server_json()}
    assert shown["b"]["state"] == "refused" and "protocol" in shown["b"]["refused_reason"], shown["b"]
    assert shown["a"]["refused_reason"] == "" and not shown["b"]["model_mismatch"]
