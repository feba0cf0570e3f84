"""Review of the planner's failed reads (3bef391): a read naming none of the live servers is a failed read, but what it
misses is kept as the last read saw it, not frozen. The live servers are still pinged, so servers killed -9 all at once
with the DHT nodes that held their records leave the chains within two pings (they stayed there for records_lost_s,
90 s, every request sent to them), and servers the read names are taken in, so a swarm back with new identities is
planned at once (it was ignored for records_lost_s). The planner is driven alone, with a fake clock and records."""

from __future__ import annotations

from test_load_deadline import record
from test_s31_blip import Counting, _online_swarm


def _kill_all(sw) -> None:
    """A, B and C killed -9, their records gone with the DHT nodes that held them."""
    sw.records.clear()
    sw.pl.client.dead |= set("ABC")


def test_servers_dead_with_their_records_leave_the_chains_at_their_failed_pings():
    sw = _online_swarm()
    pub = Counting(sw)
    epoch = sw.pl.epoch
    _kill_all(sw)
    sw.refresh(5.0)
    sw.refresh(5.0)  # the second failed ping of each
    assert sw.pl.failed_reads == 2 and sw.chains() == []
    assert all(sw.pl.servers[n].banned for n in "ABC")
    # still a failed read: views and assignment kept, nothing published (a blip's live servers come back as they were)
    assert sw.pl.epoch == epoch and set(sw.pl.assignment) == set("ABC") and pub.published == []


def test_a_swarm_back_with_new_identities_is_planned_at_once():
    sw = _online_swarm()
    _kill_all(sw)
    sw.refresh(5.0)
    sw.refresh(5.0)
    for n in "DEF":  # back after a host reboot, new peer ids, the old records expired
        sw.records[n] = record(n)
    sw.refresh(5.0)
    assert {"D", "E", "F"} <= set(sw.pl.assignment), sw.pl.assignment
    for n in "DEF":
        sw.load(n)
    sw.refresh(5.0)  # names live servers now: a read like any other, the dead ones gone
    assert sw.pl.failed_reads == 0 and set(sw.pl.servers) == set("DEF") and set(sw.pl.assignment) == set("DEF")
    assert sw.chains() and all(set(ch) <= set("DEF") for ch in sw.chains())


def test_a_read_naming_only_a_newcomer_keeps_the_live_servers():
    """A partial read (a newcomer's record only): A, B and C kept in the chains and the assignment, E taken in."""
    sw = _online_swarm()
    saved = dict(sw.records)
    sw.records.clear()
    sw.records["E"] = record("E")
    sw.refresh(1.0)
    assert sw.pl.failed_reads == 1 and set(sw.pl.servers) == set("ABCE") and sw.chains() == [("A", "B")]
    assert {"A", "B", "C"} <= set(sw.pl.assignment) and not any(sw.pl.servers[n].banned for n in "ABC")
    sw.records.update(saved)
    sw.refresh(1.0)
    assert sw.pl.failed_reads == 0 and set(sw.pl.servers) == set("ABCE") and ("A", "B") in sw.chains()
