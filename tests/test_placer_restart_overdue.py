"""The model placer and a server's failed or overdue loads (issue 17), on the real planners and placer driven round by
round over a fake DHT (``test_multimodel_load_failure.Swarm``):

* a server that restarts faster than its record expires (same identity, a new ``started_at``) had its failed loads
  kept for good: it was never placed on the failed model again;
* a server placed on a model and not online with its span by the planner's ``--load-deadline-s`` was planned around
  there but kept placed on it (serving nothing);
* a server announcing ``--cache-tokens-per-block`` was planned by its memory (more slots than its cap lets it load)
  on a model it had not loaded yet, such as the one the placer just moved it to.

Records are read with ``ServerRecord.from_value`` (as off the DHT), so the code before the fields existed ignores
them and fails by what it does."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from petals_chain.swarm.records import ServerRecord
from test_multimodel_load_failure import BOTH, SHORT_CACHE, Swarm

DEADLINE = 60.0


class RestartableSwarm(Swarm):
    """:class:`Swarm` whose servers announce a process start (``started_at``) and a cache cap; the planners run on
    the test's clock."""

    def __init__(self, deadline_s: float = 0.0):
        super().__init__()
        self.started: dict[str, float] = {}
        self.caps: dict[str, int] = {}
        self.memory = 500
        for o in self.orchs.values():
            o.planner.clock = lambda: self.now
            o.planner.load_deadline_s = deadline_s

    def announce(self, peer: str, offered: list[str], serving: str, started_at: float | None = None, **served) -> None:
        """As :meth:`Swarm.announce`; ``started_at``: the served model's record is of the process started then (a
        record of an earlier run still under that key)."""
        prefixes = [f"{n}-p" for n in offered] if len(offered) > 1 else []
        for name in offered:
            fields = {"state": "joining", **(served if name == serving else {})}
            value = ServerRecord(peer_id=peer, public_name=peer, memory_bytes=self.memory, tau_p=0.1, max_length=64,
                                 kv_cache="slots", models=prefixes, serving=f"{serving}-p" if prefixes else "",
                                 **fields).to_value()
            value.pop("started_at", None)  # the code before knew neither field: its records could not carry them
            value.pop("cache_tokens_per_block", None)
            if peer in self.started:
                value["started_at"] = started_at if started_at is not None and name == serving else self.started[peer]
            if peer in self.caps:
                value["cache_tokens_per_block"] = self.caps[peer]
            self.dht.records.setdefault(f"{name}-p", {})[peer] = ServerRecord.from_value(value)


def s_on_beta(sw: RestartableSwarm, started_at: float | None = 1000.0) -> None:
    """F serves alpha (alpha only); S, offering both (started at ``started_at``; None: an older server, which does
    not say), joins after it: placed on beta, which assigns it [0, 2)."""
    if started_at is not None:
        sw.started["S"] = started_at
    sw.announce("F", ["alpha"], "alpha")
    sw.step()
    sw.load("F", ["alpha"], "alpha")
    sw.announce("S", BOTH, "alpha")
    sw.step()
    assert sw.placed("S") == "beta"
    sw.announce("S", BOTH, "beta")
    sw.step()
    assert sw.orchs["beta"].planner.assignment == {"S": (0, 2)}


def beta_traffic(sw: RestartableSwarm) -> None:
    """Beta's requests arrive (it has no server) and a re-placement is due."""
    sw.now += 1001.0
    for i in range(60):
        sw.orchs["beta"].planner.rates.arrive(sw.now - 20 + i / 3)


def test_a_server_restarted_before_its_record_expired_may_be_placed_on_the_model_it_failed_again(caplog):
    """S fails beta's span and is moved to alpha; it restarts (a fixed configuration) and is back before its record
    expires: the placer never saw it leave. Its new ``started_at`` tells the restart: beta's failure is forgotten, and
    beta's traffic gets it back. A record of the run before (beta's, stale) reporting the failure does not count."""
    sw = RestartableSwarm()
    s_on_beta(sw)
    beta = sw.orchs["beta"].planner
    sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
    sw.step()
    assert sw.placed("S") == "alpha" and set(sw.placer.load_failures["S"]) == {"beta"}
    sw.announce("S", BOTH, "alpha")
    sw.step()
    beta_traffic(sw)
    sw.step(2)
    assert sw.placed("S") == "alpha", sw.placer.json()  # kept off beta while its failure stands

    sw.started["S"] = 2000.0  # restarted: the same identity, a new process; its records replace the old ones
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.placement"):
        sw.announce("S", BOTH, "alpha")
        sw.step()
    assert "S" not in sw.placer.load_failures, sw.placer.json()["load_failures"]
    assert any("restarted" in r.getMessage() and "beta" in r.getMessage() for r in caplog.records), caplog.text
    beta_traffic(sw)
    sw.step(2)
    assert sw.placed("S") == "beta", sw.placer.json()

    # beta assigns it a span; a record of the run before (started 1000) still says it failed it: not taken
    sw.step()
    assert beta.assignment.get("S") == (0, 2), beta.assignment
    sw.announce("S", BOTH, "beta", started_at=1000.0, failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
    sw.step()
    assert sw.placed("S") == "beta" and "S" not in sw.placer.load_failures, sw.placer.json()


def test_an_older_server_without_a_start_time_keeps_its_failures_until_it_leaves():
    """An older server announces no ``started_at`` (0): nothing reads as a restart; its failure stands as before."""
    sw = RestartableSwarm()
    s_on_beta(sw, started_at=None)
    beta = sw.orchs["beta"].planner
    sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
    sw.step()
    assert sw.placed("S") == "alpha"
    sw.announce("S", BOTH, "alpha")
    sw.step(3)
    assert set(sw.placer.load_failures["S"]) == {"beta"} and sw.placer.started_at["S"] == 0.0


def test_a_server_overdue_loading_its_models_span_is_moved_like_a_failed_load(caplog):
    """S, placed on beta and assigned [0, 2), stays joining without a word (a load that hangs, an older server): past
    beta's load deadline the placer moves it to alpha, says why in its JSON (``reason`` "overdue") and its log, and
    keeps it off beta for as long again; within the deadline nothing moves."""
    sw = RestartableSwarm(deadline_s=DEADLINE)
    s_on_beta(sw)
    sw.now += DEADLINE - 1
    sw.step()
    assert sw.placed("S") == "beta" and not sw.placer.load_failures  # a load may take a while
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.placement"):
        sw.now += 2.0
        sw.step()
    assert sw.placed("S") == "alpha", sw.placer.json()
    failure = sw.placer.json()["load_failures"]["S"]["beta"]
    assert failure["reason"] == "overdue" and failure["failed_span"] == [0, 2], failure
    assert f"--load-deadline-s {DEADLINE:g}" in failure["load_error"], failure
    move = sw.placer.json()["recent"][-1]
    assert (move["from"], move["to"]) == ("beta", "alpha") and "overdue loading model beta's blocks [0, 2)" in move[
        "why"], move
    assert any(r.levelno == logging.WARNING and "overdue loading model beta's blocks [0, 2)" in r.getMessage()
               for r in caplog.records), caplog.text
    sw.announce("S", BOTH, "alpha")  # it follows, and loads alpha's span
    sw.step()
    sw.load("S", BOTH, "alpha")
    sw.now += DEADLINE - 5
    sw.step()
    assert sw.placed("S") == "alpha" and sw.placer.json()["load_failures"]["S"]["beta"]["reason"] == "overdue"
    assert sw.orchs["beta"].planner.reported_load_failure("S") is None  # not beta's any more
    # as long again as the deadline it missed: a load that was only slow gets another try (kept off beta for good,
    # beta, whose only server it is, stayed unserved with traffic waiting until S restarted: review)
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.placement"):
        beta_traffic(sw)
        sw.step(2)
    assert "S" not in sw.placer.load_failures and sw.placed("S") == "beta", sw.placer.json()
    assert any("was overdue loading model beta" in r.getMessage() for r in caplog.records), caplog.text


def test_the_planner_plans_a_capped_server_moved_to_another_model_by_its_cap():
    """S (memory for 60 slots beside 4 blocks) announces ``--cache-tokens-per-block 128``: at max_length 64 it loads
    at most 8 slots in 4 blocks. Moved to alpha after failing beta, alpha's planner gives it a span before it loads:
    the plan's chains count the slots its cap allows (2 jobs over 4 blocks), not its memory's (15)."""
    sw = RestartableSwarm()
    sw.memory, sw.caps["S"] = 1000, 128
    s_on_beta(sw)
    beta, alpha = sw.orchs["beta"].planner, sw.orchs["alpha"].planner
    sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error="loading failed: out of memory", epoch=beta.epoch)
    sw.step()
    assert sw.placed("S") == "alpha"
    sw.announce("S", BOTH, "alpha")
    sw.step(2)
    assert alpha.assignment.get("S") == (0, 4), alpha.assignment
    used = [ch.capacity * b for ch in alpha.plan.chains for name, b in zip(ch.servers, ch.blocks) if name == "S"]
    assert used and sum(used) <= 8, alpha.plan.chains  # 4 x 128 // 64 = 8 slots (of a job in one block each)
    # loaded, it announces the slots it holds: the same count
    sw.load("S", BOTH, "alpha")
    sw.step()
    assert alpha.specs([alpha.servers["S"]])[0].residual_slots(alpha.model_spec, 4) == 8


def test_the_record_announces_the_cap_and_the_process_start_for_every_model_it_offers():
    """``build_record`` (the served model's record, and each standby one) carries ``--cache-tokens-per-block`` and
    the process start; an older record without them reads as no cap and an unknown start."""
    from petals_chain.server import announce
    from petals_chain.server.models import StandbyView
    from petals_chain.swarm.emulation import Emulation
    from petals_chain.swarm.records import _ServerValueV1

    cfg = SimpleNamespace(device="cpu", quant="none", public_name="S", max_blocks=0, kv_cache="slots", page_size=16,
                          cache_tokens_per_block=16)
    hosted = SimpleNamespace(tau_p=0.1, dtype_name="float32", fingerprint="",
                             memory=SimpleNamespace(memory_bytes=1000, s_m=100, s_c=lambda n: 10))
    view = StandbyView(hosted, 64, Emulation(), cfg, [], "unknown")
    rec = announce.build_record(view, "peer")
    assert rec.cache_tokens_per_block == 16 and rec.started_at == announce.PROCESS_STARTED_AT > 0
    value = rec.to_value()
    assert _ServerValueV1.parse_obj(value).dict() == value
    older = {k: v for k, v in value.items() if k not in ("cache_tokens_per_block", "started_at")}
    got = ServerRecord.from_value(older)
    assert got.cache_tokens_per_block == 0 and got.started_at == 0.0
    assert _ServerValueV1.parse_obj(older).dict() == older
    assert time.time() >= rec.started_at
