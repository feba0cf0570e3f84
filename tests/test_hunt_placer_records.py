"""Server records with odd (valid) values, read by the planner and the model placer: any integer is a valid
``memory_bytes`` or ``slots_total``. One record announcing 10**30 of either overflowed int64 in GCA: every planner
refresh raised, and the plan stopped following the swarm; the placer's M/M/C estimate (Erlang C) looped once per
slot (about 10**12 times), freezing the orchestrator's event loop."""

from __future__ import annotations

import pytest

from petals_chain.algorithms.multimodel import erlang_c
from petals_chain.swarm.records import ServerRecord
from test_load_deadline import Swarm, record
from test_multimodel_load_failure import BOTH
from test_placer_restart_overdue import RestartableSwarm, beta_traffic, s_on_beta

HUGE = 10 ** 30


def test_a_record_announcing_huge_memory_or_slots_does_not_stop_the_planner():
    sw = Swarm({n: record(n) for n in "ABC"})
    sw.refresh()
    for n in "ABC":
        sw.load(n)
    sw.records["B"] = ServerRecord(**{**sw.records["B"].model_dump(), "slots_total": HUGE, "slots_free": HUGE})
    sw.records["D"] = ServerRecord(**{**record("D").model_dump(), "memory_bytes": HUGE})
    sw.refresh(1.0)
    sw.refresh(1.0)
    assert "D" in sw.pl.assignment and ("A", "B") in sw.chains(), (sw.pl.assignment, sw.chains())
    # D gives up its record: the plan still follows the swarm
    del sw.records["D"]
    sw.refresh(1.0)
    assert "D" not in sw.pl.servers


@pytest.mark.timeout(60)
def test_a_volunteer_announcing_huge_memory_is_placed_without_freezing_the_placer():
    sw = RestartableSwarm()
    sw.memory = HUGE
    s_on_beta(sw)
    sw.load("S", BOTH, "beta")
    beta_traffic(sw)
    sw.step(3)  # a re-placement, with the analytic index's M/M/C estimate of each model
    assert sw.placer.replans and sw.placed("S") == "beta", sw.placer.json()


@pytest.mark.timeout(60)
def test_erlang_c_stops_once_the_terms_left_are_negligible():
    assert erlang_c(10 ** 12, 3.0) == 0.0
    assert erlang_c(10, 3.0) == pytest.approx(0.0011572953262096433, rel=1e-12)


def test_a_record_announcing_the_largest_epoch_is_refused():
    """A restarted orchestrator continues above the epochs its servers follow (and a HERD leader above the splits'):
    one record saying 2**64 - 1 (the most the DHT's msgpack carries) made the next epoch 2**64, which no assignment
    or split could be published with, for good. Records now carry epochs up to ``EPOCH_MAX`` (2**53): larger ones
    are refused by the records and by the DHT's schema; a record at the largest is not continued from."""
    import pydantic
    from hivemind.utils.serializer import MSGPackSerializer

    from petals_chain.swarm.records import (EPOCH_MAX, AssignmentRecord, GroupRecord, PlacementRecord,
                                            _AssignmentValueV1, _GroupValueV1)

    with pytest.raises(pydantic.ValidationError):
        record("C", epoch=2 ** 64 - 1)
    for cls, kw in ((AssignmentRecord, dict(max_length=8)), (GroupRecord, {}), (PlacementRecord, {})):
        with pytest.raises(pydantic.ValidationError):
            cls(orchestrator_peer_id="o", epoch=EPOCH_MAX + 1, **kw)
        assert cls(orchestrator_peer_id="o", epoch=EPOCH_MAX, **kw).epoch == EPOCH_MAX
    for schema, value in ((_AssignmentValueV1, AssignmentRecord(orchestrator_peer_id="o", epoch=0, max_length=8)),
                          (_GroupValueV1, GroupRecord(orchestrator_peer_id="o"))):
        with pytest.raises(Exception):
            schema.parse_obj({**value.to_value(), "epoch": 2 ** 64 - 1})
    published = []
    sw = Swarm({"A": record("A"), "B": record("B"), "C": record("C", epoch=EPOCH_MAX)})
    sw.pl.dht.publish_assignment = lambda prefix, rec, expiration: published.append(
        MSGPackSerializer.dumps(rec.to_value()))
    sw.refresh()
    assert published and sw.pl.assignment and sw.pl.epoch < EPOCH_MAX
