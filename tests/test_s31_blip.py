"""A read of the server records that names none of the live servers (a DHT get that timed out or reached no node in a
network blip of the orchestrator's host returns nothing) is a failed read, not every server leaving: the planner keeps
its views and its assignment. Before, one such read published an empty assignment, every server unloaded its blocks
and every request failed until they had reloaded. The emptiness is taken for real once it lasts ``records_lost_s`` (a
server record's lifetime); an ``offline`` announcement is a record, seen at once. A read that raises is a failed read
too: views kept, the assignment still republished. The planner is driven alone, with a fake clock and fake records."""

from __future__ import annotations

import asyncio
import logging

from test_load_deadline import Swarm, record


class Counting:
    """Counts the assignments the planner publishes (through its fake DHT)."""

    def __init__(self, sw: Swarm):
        self.published: list[dict] = []
        sw.pl.dht.publish_assignment = lambda prefix, rec, expiration: self.published.append(dict(rec.assignments))


def _online_swarm() -> Swarm:
    sw = Swarm({n: record(n) for n in "ABC"})
    sw.refresh()
    for n in "ABC":
        sw.load(n)
    sw.refresh(1.0)
    assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)} and sw.chains() == [("A", "B")]
    return sw


def _said(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_one_empty_read_keeps_the_views_and_the_assignment(caplog):
    """Records gone for a few reads: no new epoch, nothing published, the chains and the views (``seen`` too: the
    model placer and the groups read it) kept; one warning for the streak; back, nothing changes. (A read naming only
    a newcomer: test_s31_review2_planner.)"""
    sw = _online_swarm()
    pub = Counting(sw)
    epoch, seen = sw.pl.epoch, dict(sw.pl.seen)
    saved = dict(sw.records)
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.planner"):
        sw.records.clear()
        for _ in range(3):
            sw.refresh(1.0)
            assert sw.pl.epoch == epoch and sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)}
            assert set(sw.pl.servers) == set("ABC") and sw.pl.seen == seen and sw.chains() == [("A", "B")]
        assert sw.pl.failed_reads == 3 and len(_said(caplog, "names none of the 3 live servers")) == 1, caplog.text
        sw.records.clear()
        sw.records.update(saved)
        sw.refresh(1.0)
        sw.refresh(1.0)
    assert sw.pl.epoch == epoch and pub.published == [] and sw.chains() == [("A", "B")] and sw.pl.failed_reads == 0
    assert _said(caplog, "read again after 3 failed read(s)")
    assert not _said(caplog, "server left")


def test_records_lost_for_longer_than_a_record_lives_are_taken_as_gone(caplog):
    """The last servers died silently (their records expired): the planner keeps them for ``records_lost_s`` from the
    first empty read, then re-plans without them (an empty assignment, published once)."""
    sw = _online_swarm()
    pub = Counting(sw)
    epoch, bound = sw.pl.epoch, sw.pl.records_lost_s
    assert bound >= 30.0  # a server record lives 3 x its refresh period (server/announce.py)
    sw.records.clear()
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.planner"):
        sw.refresh(1.0)
        sw.refresh(bound / 2)
        sw.refresh(bound / 2 - 1.0)
        assert sw.pl.epoch == epoch and set(sw.pl.servers) == set("ABC") and pub.published == []
        sw.refresh(2.0)
    assert sw.pl.assignment == {} and sw.pl.servers == {} and sw.pl.epoch == epoch + 1 and pub.published == [{}]
    assert sw.chains() == [] and sw.pl.failed_reads == 0
    assert len(_said(caplog, "taking them as gone")) == 1 and len(_said(caplog, "server left")) == 3
    sw.refresh(1.0)  # no servers now: an empty read is just that
    assert sw.pl.failed_reads == 0 and pub.published == [{}]


def test_servers_announcing_offline_are_seen_at_once_to_the_last():
    """Servers leaving one by one, the last included, announce ``offline``: a record, so each leave is seen at the
    read that shows it (running requests on it failed over by ``on_failure``); their records then expire (an empty
    read with nobody live is no failed read)."""
    sw = _online_swarm()
    failed: list[str] = []
    sw.pl.on_failure = failed.append
    for n, left in (("C", {"A", "B"}), ("A", {"B"}), ("B", set())):
        sw.records[n] = record(n, "offline", sw.pl.assignment.get(n, (0, 0)))
        sw.refresh(1.0)
        assert set(sw.pl.assignment) == left and failed[-1] == n and sw.pl.failed_reads == 0
    assert sw.chains() == []
    sw.records.clear()  # the offline records expire
    sw.refresh(1.0)
    assert sw.pl.servers == {} and sw.pl.failed_reads == 0 and sw.pl.seen == {}


def test_the_last_server_dying_silently_is_seen_after_the_bound():
    """A and C left announcing offline (their records linger), then B, the last one serving, dies silently: reads
    that name only offline servers keep B until ``records_lost_s`` has passed, then it is gone."""
    sw = _online_swarm()
    for n in "AC":
        sw.records[n] = record(n, "offline", sw.pl.assignment[n])
        sw.refresh(1.0)
    assert set(sw.pl.assignment) == {"B"}
    del sw.records["B"]
    sw.refresh(1.0)
    assert sw.pl.assignment == {"B": (2, 2)} and "B" in sw.pl.servers and sw.pl.failed_reads == 1
    sw.refresh(sw.pl.records_lost_s + 1.0)
    assert sw.pl.assignment == {} and "B" not in sw.pl.servers and sw.pl.failed_reads == 0


def test_a_read_that_raises_keeps_the_views_and_the_assignment_is_still_republished(caplog):
    """A DHT error in the read: no traceback out of ``refresh``, the views kept, one warning for the streak, and the
    planner round still republishes the assignment when it is due (else it expired in the DHT during a long one)."""
    sw = _online_swarm()
    pub = Counting(sw)
    epoch = sw.pl.epoch
    fetch = sw.pl.dht.afetch_servers

    async def broken(prefix):
        raise TimeoutError("no DHT node answered")

    sw.pl.dht.afetch_servers = broken
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.planner"):
        sw.refresh(1.0)
        sw.refresh(1.0)
        assert sw.pl.epoch == epoch and set(sw.pl.servers) == set("ABC") and sw.chains() == [("A", "B")]
        assert sw.pl.failed_reads == 2 and len(_said(caplog, "no DHT node answered")) == 1, caplog.text
        sw.pl.last_publish = 0.0  # its republish is due
        asyncio.run(sw.pl._round())
        assert pub.published == [{"A": [0, 2], "B": [2, 2], "C": [0, 2]}]
        sw.pl.dht.afetch_servers = fetch
        sw.refresh(1.0)
    assert sw.pl.failed_reads == 0 and sw.pl.epoch == epoch and sw.chains() == [("A", "B")]


def test_records_lost_s_zero_takes_an_empty_read_at_once():
    """``records_lost_s`` 0: an empty read is every server leaving, at once (the planner's reading before)."""
    sw = _online_swarm()
    sw.pl.records_lost_s = 0.0
    sw.records.clear()
    sw.refresh(1.0)
    assert sw.pl.assignment == {} and sw.pl.servers == {} and sw.pl.failed_reads == 0
