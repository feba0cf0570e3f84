"""``--load-deadline-s``: a server assigned a span that is not online with it that long after the assignment (a load
that hangs, a wedged device, an older server that does not report a failed load) is planned around like a failed
load: held in the assignment, shown failed with why, and back in the chains once it serves the span. Before, the plan
counted on its blocks for good: with nobody else holding them, no chain, every request a 503 after
``--no-chain-wait-s``. The planner is driven alone, with a fake clock and fake records."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest

from petals_chain.model import ModelSpec
from petals_chain.swarm.records import ServerRecord
from test_failover_units import FakeClient, FakeDHT

MODEL = ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0)  # 300 bytes: 2 blocks with 5 slots
DEADLINE = 60.0
SPEEDS = {"A": 0.1, "B": 0.2, "C": 0.4, "E": 0.3}


def record(name: str, state: str = "joining", span: tuple[int, int] = (0, 0), **kw) -> ServerRecord:
    slots = 5 if span[1] else 0
    return ServerRecord(peer_id=name, public_name=name, state=state, memory_bytes=300, tau_p=SPEEDS.get(name, 0.1),
                        kv_cache="slots", start_block=span[0], num_blocks=span[1], slots_total=slots,
                        slots_free=slots, **{"timestamp": time.time(), "max_length": 64, **kw})


class Swarm:
    """A planner, the records it reads and its clock."""

    def __init__(self, records: dict, load_deadline_s: float = DEADLINE):
        from petals_chain.orchestrator.planner import Planner

        self.records, self.now = records, [1000.0]
        # by their speeds GBP-CR puts A on [0, 2), B on [2, 4) and C, a spare, on [0, 2) again: chains need B
        self.pl = Planner(dht=FakeDHT(records), prefix="x", client=FakeClient(), max_length=64,
                          on_chains=lambda c: None, arrival_rate=0.5, model_spec_fallback=lambda: MODEL,
                          use_all_servers=True, replan_interval_s=3600, settle_s=0.0, clock=lambda: self.now[0])
        self.pl.load_deadline_s = load_deadline_s  # set after: the code before the deadline fails by what it does

    def refresh(self, advance_s: float = 0.0) -> None:
        self.now[0] += advance_s
        asyncio.run(self.pl.refresh())

    def load(self, name: str) -> None:
        """``name`` loaded its assigned span (online with it)."""
        self.records[name] = record(name, "online", self.pl.assignment[name], epoch=self.pl.epoch)

    def chains(self) -> list[tuple[str, ...]]:
        return [ch.servers for ch in self.pl.current.chains]

    def shown(self, name: str) -> dict:
        return {s["public_name"]: s for s in self.pl.server_json()}[name]


def _said(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_server_never_online_with_its_span_is_planned_around_and_rejoins_once_it_is(caplog):
    """B, assigned [2, 4), stays joining: within the deadline the plan waits for it; past it, C takes its blocks over
    (one warning naming B, its span and how long), B keeps its span in the assignment and is shown failed with why;
    once B serves [2, 4) it is in the chains again, without a reload or a new epoch."""
    sw = Swarm({n: record(n) for n in "ABC"})
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.planner"):
        sw.refresh()
        assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)}
        sw.load("A")
        sw.load("C")
        sw.refresh(DEADLINE - 1)  # a load may take a while: nothing is done yet
        assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)} and sw.chains() == []
        assert sw.shown("B")["state"] == "joining" and not sw.shown("B")["load_error"]
        assert not _said(caplog, "is not online")

        sw.refresh(2.0)
        assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (2, 2)}  # B held: it may still come online
        said = _said(caplog, "is not online")
        assert len(said) == 1 and "server B (" in said[0] and "[2, 4) 61 s after its assignment" in said[0], said
        b = sw.shown("B")
        assert b["state"] == "failed" and b["failed_span"] == [2, 2] and not b["banned"], b
        assert b["load_error"] == "not online 61 s after its assignment (--load-deadline-s 60)", b
        assert "planned around B (not online 61 s after its assignment)" in sw.pl.plan_log[-1]["reason"]
        sw.load("C")  # C reloads [2, 4) well within its own deadline
        for _ in range(5):
            sw.refresh(5.0)
        assert sw.chains() == [("A", "C")]
        assert len(_said(caplog, "is not online")) == 1  # said once, not at every refresh
        assert not sw.pl.servers["C"].load_failed

        epoch = sw.pl.epoch
        sw.load("B")  # its load finished after all
        sw.refresh(1.0)
        assert ("A", "B") in sw.chains() and sw.pl.assignment["B"] == (2, 2) and sw.pl.epoch == epoch
        b = sw.shown("B")
        assert b["state"] == "online" and b["failed_span"] is None and b["load_error"] == "", b
        assert _said(caplog, "server B (B) is online with its blocks [2, 4)")


def test_a_reloading_server_is_timed_from_the_assignment_that_moved_it_not_while_it_drains(caplog):
    """Servers online for hours start no deadline; C, moved to [2, 4) when B leaves, is timed from that assignment,
    and not while it drains its old blocks' sessions; it is planned around only once it overstays after that."""
    sw = Swarm({n: record(n) for n in "ABC"})
    sw.refresh()
    for n in "ABC":
        sw.load(n)
    for _ in range(3):
        sw.refresh(3600.0)
    assert not any(v.load_failed for v in sw.pl.servers.values()) and ("A", "B") in sw.chains()

    del sw.records["B"]  # gone: C is moved to [2, 4)
    sw.refresh(1.0)
    assert sw.pl.assignment == {"A": (0, 2), "C": (2, 2)}
    sw.refresh(5.0)  # C has not seen the new epoch yet: still online with [0, 2)
    sw.records["C"] = record("C", "draining", (0, 2), epoch=sw.pl.epoch)
    for _ in range(4):
        sw.refresh(30.0)  # 120 s of draining: its old blocks still serve sessions
    sw.records["C"] = record("C", "joining", epoch=sw.pl.epoch)
    sw.refresh(DEADLINE - 10)
    assert not sw.pl.servers["C"].load_failed and sw.shown("C")["state"] == "joining"
    with caplog.at_level(logging.WARNING, logger="petals_chain.orchestrator.planner"):
        sw.refresh(11.0)
    assert sw.pl.servers["C"].load_failed and sw.shown("C")["state"] == "failed"
    said = _said(caplog, "is not online")
    assert len(said) == 1 and "server C (C)" in said[0] and "[2, 4) 61 s" in said[0], said
    assert sw.pl.assignment["C"] == (2, 2)  # held: nobody else can take [2, 4) over
    sw.load("C")
    sw.refresh(1.0)
    assert sw.chains() == [("A", "C")] and not sw.pl.servers["C"].load_failed


def test_a_restarted_orchestrator_starts_no_deadline_for_servers_serving_their_spans(caplog):
    """A restarted orchestrator adopts the spans the servers serve (epoch 7 of the one before): no deadline for them
    however long it runs; another group's server that never loads is not its to judge; a newcomer of its group it
    assigns a span to is timed from that assignment."""
    records = {n: record(n, "online", span, epoch=7) for n, span in (("A", (0, 2)), ("B", (2, 2)), ("C", (0, 2)))}
    records["D"] = record("D")  # another orchestrator's, joining for ever
    sw = Swarm(records)
    sw.pl.group = {"A", "B", "C", "E"}
    with caplog.at_level(logging.WARNING, logger="petals_chain.orchestrator.planner"):
        sw.refresh()
        assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)} and sw.pl.epoch == 8
        for _ in range(5):
            sw.refresh(10 * DEADLINE)
        assert not _said(caplog, "is not online") and "D" not in sw.pl.servers
        assert not any(v.load_failed for v in sw.pl.servers.values())  # ten deadlines on: none was started
        assert ("A", "B") in sw.chains() and sw.pl.epoch == 8

        records["E"] = record("E")
        sw.refresh(1.0)
        assert sw.pl.assignment.get("E") == (2, 2)
        sw.refresh(DEADLINE + 1)
    said = _said(caplog, "is not online")
    assert len(said) == 1 and "server E (E)" in said[0], said
    assert sw.shown("E")["state"] == "failed" and {n: sw.shown(n)["state"] for n in "ABC"} == dict.fromkeys("ABC",
                                                                                                          "online")


def test_a_deadline_of_zero_waits_for_ever():
    """``--load-deadline-s 0``: the plan waits for B however long it takes (as before the deadline existed)."""
    swarms = {deadline: Swarm({n: record(n) for n in "ABC"}, load_deadline_s=deadline) for deadline in (0.0, DEADLINE)}
    for sw in swarms.values():
        sw.refresh()
        sw.load("A")
        sw.load("C")
        sw.refresh(100 * DEADLINE)
    assert swarms[0.0].pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)}
    assert not swarms[0.0].pl.servers["B"].load_failed and swarms[0.0].shown("B")["state"] == "joining"
    assert swarms[DEADLINE].pl.servers["B"].load_failed and swarms[DEADLINE].pl.assignment["C"] == (2, 2)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_load_deadline_is_a_usage_error_naming_the_flag(tiny_model_dir, capsys, value):
    from petals_chain.orchestrator.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_model_dir), "--load-deadline-s", value])
    assert e.value.code == 2
    assert "argument --load-deadline-s" in capsys.readouterr().err


def test_the_load_deadline_reaches_the_planner_config(tiny_model_dir, monkeypatch):
    from petals_chain.orchestrator import __main__ as cli
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.planner import Planner

    assert Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None,
                   load_deadline_s=5.0).load_deadline_s == 5.0

    got = []

    async def serve(cfgs, ready_file=None, placement=None, lost=None, grace_s=None):
        got.append([c.load_deadline_s for c in cfgs])

    monkeypatch.setattr(cli, "serve", serve)
    assert cli.main(["--model", str(tiny_model_dir), "--load-deadline-s", "5"]) == 0
    assert cli.main(["--model", str(tiny_model_dir)]) == 0
    assert got == [[5.0], [600.0]]
    with pytest.raises(ValueError, match="--load-deadline-s"):
        Orchestrator(OrchestratorConfig(model=str(tiny_model_dir), load_deadline_s=math.nan))


def test_a_failure_reported_to_another_planner_or_before_a_restart_does_not_keep_a_server_out(caplog):
    """B reported a failed load of [2, 4) to the orchestrator before this one (or another group's): its record still
    says so. Read as failing for good, B was never planned again, and with C gone nobody served [2, 4): no chain for
    hours. A failure counts only of the span this planner gives, reported at that assignment's epoch or later; B is
    planned, and says so again if it fails again."""
    records = {"A": record("A", "online", (0, 2), epoch=7),
               "B": record("B", failed_span=[2, 2], load_error="oom", epoch=7)}
    sw = Swarm(records)
    sw.refresh()
    assert sw.pl.assignment.get("B") == (2, 2) and sw.shown("B")["state"] == "joining"
    assert sw.shown("B")["load_error"] == "" and sw.shown("B")["failed_span"] is None
    sw.refresh(5.0)  # its record has not caught up with the new epoch yet: not judged on the stale one
    assert not sw.pl.servers["B"].load_failed
    with caplog.at_level(logging.WARNING, logger="petals_chain.orchestrator.planner"):
        records["B"] = record("B", failed_span=[2, 2], load_error="oom\x1b[2J\nforged", epoch=sw.pl.epoch)
        sw.refresh(1.0)  # it fails again, at this planner's epoch: planned around, said once, in one line
    said = _said(caplog, "cannot load its assigned blocks")
    assert sw.pl.servers["B"].load_failed and len(said) == 1 and "\x1b" not in said[0] and "\n" not in said[0]
    assert sw.shown("B")["load_error"] == "oom [2J forged"
    sw.load("B")
    sw.refresh(1.0)
    assert sw.chains() == [("A", "B")]


def test_an_older_server_with_short_slots_is_not_serving_its_span_for_the_deadline():
    """An older server started with a --max-length below the swarm's loads its span and goes online: the chains
    leave it out (its slots are too short), and it reports no failure. The plan counted on its blocks for good; the
    deadline now sees it as not serving its span."""
    sw = Swarm({n: record(n) for n in "AB"})
    sw.refresh()
    sw.load("A")
    sw.records["B"] = record("B", "online", sw.pl.assignment["B"], epoch=sw.pl.epoch, max_length=32)
    sw.refresh(DEADLINE + 1)
    assert sw.pl.servers["B"].load_failed and sw.shown("B")["state"] == "failed" and sw.chains() == []
