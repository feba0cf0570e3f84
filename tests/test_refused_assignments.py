"""A server that cannot load the span it is assigned (``--cache-tokens-per-block`` too small for one job, its weights
out of memory, ``--max-length`` below the swarm's) says so in its record (``failed_span``, ``load_error``), and the
planner plans around it until it loads one or restarts. Before, it stayed ``joining`` without blocks while the
placement counted on them: with its span held by nobody else, the swarm had no chain for good (every request a 503
after ``--no-chain-wait-s``), and the orchestrator said nothing about why."""

from __future__ import annotations

import asyncio
import signal
import types

import pytest

from conftest import hf_greedy_from
from petals_chain.model import ModelSpec
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for
from petals_chain.swarm.records import ServerRecord, _ServerValueV1

PROMPT = [5, 6, 7, 8, 9]
TOKENS = 8


@pytest.mark.slow
def test_a_server_that_cannot_load_its_span_is_planned_around_and_joins_once_fixed(tiny_model_factory, tmp_path,
                                                                                     scaled):
    """Three servers of two blocks each (of four); by their speeds GBP-CR puts A on [0, 2), B on [2, 4) and C, a spare,
    on [0, 2) again: the only chain needs B, whose ``--cache-tokens-per-block 16`` holds no job of 64 tokens. The
    planner moves C to [2, 4) and the swarm serves, token-exact; B, restarted without the flag, joins the chains."""
    model = tiny_model_factory("llama", num_layers=4)
    expected = hf_greedy_from(model, PROMPT, TOKENS)
    memory = memory_for(model, 64, 2, 4)  # two blocks and 4 slots: no server holds the whole model
    key = str(tmp_path / "b.key")
    servers = [LocalServer("A", memory, tau_p=0.1),
               LocalServer("B", memory, tau_p=0.2, extra_args=["--identity-path", key, "--cache-tokens-per-block", "16"]),
               LocalServer("C", memory, tau_p=0.4)]
    # no periodic re-plan during the test: what re-plans is the failure itself. The first plan waits until no server
    # joined for settle_s (all three start at once: their joins spread over a second or two), and so does each
    # plan after B's restart
    sw = LocalSwarm(model, servers, max_length=64, arrival_rate=0.5, settle_s=scaled(3), log_dir=tmp_path / "logs",
                    orchestrator_args=["--replan-interval-s", "3600", "--audit-rate", "0"])
    with sw:
        state = sw.wait_until(lambda s: sum(1 for x in s["servers"] if x["assigned"]) == 3, scaled(90),
                              "all three servers placed")
        placed = {s["public_name"]: s["assigned"] for s in state["servers"]}
        assert placed == {"A": [0, 2], "B": [2, 2], "C": [0, 2]}, placed  # the plan needs B
        state = sw.wait_until(lambda s: s["ready"] and s["chains"], scaled(60), "a chain without B")
        b = next(s for s in state["servers"] if s["public_name"] == "B")
        assert b["state"] == "failed" and b["failed_span"] == [2, 2] and not b["banned"], b
        assert "--cache-tokens-per-block 16" in b["load_error"] and "at least 32" in b["load_error"], b
        assert all("B" not in ch["names"] for ch in state["chains"]), state["chains"]
        said = sw.log_tail("orchestrator", 400)
        assert "server B (" in said and "cannot load its assigned blocks [2, 4)" in said, said
        assert sw.client().complete(PROMPT, max_tokens=TOKENS).token_ids == expected

        sw.kill_server("B", signal.SIGTERM)  # the operator fixes the flag and restarts it (same identity)
        sw.servers["B"].popen.wait(timeout=scaled(30))
        sw.add_server(LocalServer("B-fixed", memory, tau_p=0.2, extra_args=["--identity-path", key]))

        def b_serves(s: dict) -> bool:
            fixed = [x for x in s["servers"] if x["public_name"] == "B-fixed"]
            return (bool(fixed) and fixed[0]["state"] == "online" and not fixed[0]["load_error"]
                    and any("B-fixed" in ch["names"] for ch in s["chains"]))

        sw.wait_until(b_serves, scaled(90), "the fixed server in a chain")
        assert sw.client().complete(PROMPT, max_tokens=TOKENS).token_ids == expected


def test_failed_load_fields_are_optional_both_ways():
    """An older server's record (without the fields) reads as no failure; a newer one's passes the DHT's schema."""
    rec = ServerRecord(peer_id="p", state="joining", memory_bytes=10, tau_p=0.1, failed_span=[2, 2], load_error="oom")
    value = rec.to_value()
    assert ServerRecord.from_value(value).failed_span == [2, 2]
    assert _ServerValueV1.parse_obj(value).dict() == value
    older = {k: v for k, v in value.items() if k not in ("failed_span", "load_error")}
    got = ServerRecord.from_value(older)
    assert got.failed_span == [] and got.load_error == ""
    assert _ServerValueV1.parse_obj(older).dict() == older  # hivemind compares the parse with what was stored
    with pytest.raises(ValueError):
        ServerRecord(peer_id="p", state="joining", memory_bytes=10, tau_p=0.1, failed_span=[2])


def test_a_load_that_raises_is_announced_until_a_retry_succeeds():
    """Loading raised (out of memory): the record carries the span and the error, in one line, until a load works."""
    from test_server_lifecycle import _Assignment, _Runner, _server

    attempts = []

    def load(source, start, num, **kw):
        attempts.append((start, num))
        if len(attempts) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(GPU 0; 1.00 GiB free)")
        return _Runner()

    async def main():
        s = _server(load)
        await s.apply_assignment(_Assignment(1, (0, 4), 1.0))
        assert s.state == "joining" and s.load_failure == (
            (0, 4), "loading failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 1.00 GiB free)")
        await s.apply_assignment(_Assignment(1, (0, 4), 1.0))  # within the backoff: not tried again
        assert attempts == [(0, 4)]
        s._failed_load = (s._failed_load[0], 0.0)  # the backoff is over
        await s.apply_assignment(_Assignment(1, (0, 4), 1.0))
        return s

    s = asyncio.run(main())
    assert attempts == [(0, 4), (0, 4)] and s.state == "online" and s.load_failure is None


def test_a_server_whose_max_length_is_below_the_swarms_loads_nothing_and_says_so():
    """Its short slots serve none of the swarm's chains: it loaded its blocks all the same, and the plan counted on
    them. Now it loads nothing and announces the span with the flag to change."""
    from test_server_lifecycle import _Assignment, _server

    loads = []
    s = _server(lambda source, start, num, **kw: loads.append((start, num)))
    s.cfg.max_length = 32
    asyncio.run(s.apply_assignment(_Assignment(1, (0, 4), 1.0)))
    assert loads == [] and s.state == "joining" and s.runner is None
    assert s.load_failure == ((0, 4), "--max-length 32 is below the swarm's max_length 128 (restart without "
                                      "--max-length, or with 128 or more)")


def _record(name: str, tau_p: float, **kw) -> ServerRecord:
    return ServerRecord(**{"peer_id": name, "public_name": name, "state": "joining", "memory_bytes": 300, "tau_p": tau_p,
                           "max_length": 64, "kv_cache": "slots", **kw})


def test_the_planner_moves_blocks_off_a_server_that_cannot_load_them():
    """Unit view of the same story: the failed server keeps its span in the assignment (it retries), is planned
    around at once (a spare takes its blocks), is shown failed with its reason, and rejoins once it has loaded."""
    from petals_chain.orchestrator.planner import Planner, ServerView

    published = []
    dht = types.SimpleNamespace(peer_id="orch", publish_assignment=lambda prefix, rec, exp: published.append(rec))
    model = ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0)  # 300 bytes: 2 blocks with 5 slots
    chains = []
    pl = Planner(dht=dht, prefix="x", client=None, max_length=64, on_chains=chains.append, arrival_rate=0.5,
                 model_spec_fallback=lambda: model, use_all_servers=True, replan_interval_s=3600)
    for name, tau_p in (("A", 0.1), ("B", 0.2), ("C", 0.4)):
        pl.servers[name] = ServerView(peer_id=name, record=_record(name, tau_p))
    pl.last_change = -1e9  # settled

    def load(name: str, span, **kw) -> None:
        pl.servers[name].record = _record(name, pl.servers[name].record.tau_p, state="online", start_block=span[0],
                                          num_blocks=span[1], slots_total=5, slots_free=5, **kw)

    async def main():
        await pl._decide([], [])
        assert pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)}
        load("A", (0, 2))
        load("C", (0, 2))
        # announced by a server following this planner's epoch (a failure reported before it is stale)
        pl.servers["B"].record = _record("B", 0.2, failed_span=[2, 2], load_error="out of memory", epoch=pl.epoch)
        pl._note_load_failure(pl.servers["B"])
        await pl._decide([], [])
        assert pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (2, 2)}  # B held: it may still load
        load("C", (2, 2))
        pl._recompute_chains("C reloaded")
        assert [ch.servers for ch in chains[-1]] == [("A", "C")]
        shown = {s["public_name"]: s for s in pl.server_json()}
        assert shown["B"]["state"] == "failed" and shown["B"]["load_error"] == "out of memory"
        load("B", (2, 2), failed_span=[], load_error="")  # a retry worked
        pl._note_load_failure(pl.servers["B"])
        await pl._decide([], [])
        assert any("B" in ch.servers for ch in chains[-1]) and pl.assignment["B"] == (2, 2)
        pl.servers["C"].record = _record("C", 0.4, state="offline", failed_span=[2, 2], load_error="oom")
        assert not pl.servers["C"].load_failed and "C" not in pl.held_spans()  # gone, whatever its record says
        assert {s["public_name"]: s["state"] for s in pl.server_json()}["C"] == "offline"

    asyncio.run(main())


def test_a_failure_of_a_span_no_longer_assigned_is_not_announced_on():
    """Its load of [0, 4) failed; the next assignment gives it another span (or none): announcing the old failure
    on, it read as failing still to a planner that never gave it that span, which never planned it again."""
    from test_server_lifecycle import _Assignment, _Runner, _server

    def load(source, start, num, **kw):
        if (start, num) == (0, 4):
            raise RuntimeError("CUDA out of memory")
        return _Runner()

    async def main():
        s = _server(load)
        await s.apply_assignment(_Assignment(1, (0, 4), 1.0))
        assert s.load_failure is not None and s.load_failure[0] == (0, 4)
        unassigned = _Assignment(2, (0, 4), 2.0)
        unassigned.assignments = {"other": [0, 4]}
        unassigned.span_of = lambda peer_id: None
        await s.apply_assignment(unassigned)
        assert s.load_failure is None and s._failed_load is None
        await s.apply_assignment(_Assignment(3, (0, 4), 3.0))  # the same span again: tried at once, fails again
        assert s.load_failure is not None and s.load_failure[0] == (0, 4)
        await s.apply_assignment(_Assignment(4, (0, 2), 4.0))  # another span: loaded, nothing failed stands
        return s

    s = asyncio.run(main())
    assert s.load_failure is None and s.state == "online" and s.span == (0, 2)
