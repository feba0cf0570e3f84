"""A server offering several models that cannot load the span of the one it was placed on (issue 17 with the failed-load
report of ``failed_span`` / ``load_error``): the model placer moves it to another model it offers and does not give it
the failed one again until it restarts, loads it, or its record stops saying so. Before, the placer kept it on the
model it could not load (planned around there, idle for good) and could give that model back at a re-placement."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from conftest import hf_greedy_from
from petals_chain.algorithms.multimodel import ServedModel, Volunteer, place_by_unserved_index
from petals_chain.model import ModelSpec
from petals_chain.orchestrator.placement import ModelPlacer
from petals_chain.orchestrator.planner import Planner
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for
from petals_chain.swarm.records import ServerRecord

PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.slow
def test_a_server_that_cannot_load_a_models_span_is_moved_to_a_model_it_can_load(tiny_model_factory, tmp_path, scaled):
    """``F`` serves alpha only; ``S`` offers alpha and beta with ``--cache-tokens-per-block 16``: at ``--max-length 64``
    it holds a job in 4 blocks (alpha whole) but none in 2 (beta whole). Joining after ``F``, ``S`` is placed on beta
    (the model without a chain), fails to load it and says so; the placer moves it to alpha, says why in its log and
    in ``/api/v1/swarm``, and keeps it off beta."""
    alpha = tiny_model_factory("llama", num_layers=4)
    beta = tiny_model_factory("qwen2", num_layers=2)
    memory = memory_for(alpha, 64, 4, 2)
    assert memory >= memory_for(beta, 64, 2, 2)
    sw = LocalSwarm(alpha, [LocalServer("F", memory, tau_p=0.1)], max_length=64, log_dir=tmp_path / "logs",
                    models={"alpha": alpha, "beta": beta},
                    orchestrator_args=["--audit-rate", "0", "--replace-interval-s", "3600"])
    with sw:
        sw.wait_until(lambda s: any(m["name"] == "alpha" and m["chains"] for m in s["models"]), scaled(90),
                      "a chain of alpha")
        sw.add_server(LocalServer("S", memory, tau_p=0.1, model=[str(alpha), str(beta)],
                                  extra_args=["--cache-tokens-per-block", "16"]))
        state = sw.wait_until(lambda s: s["model_placement"]["recent"], scaled(90), "S placed")
        first = state["model_placement"]["recent"][0]
        peer = first["server"]
        assert first["to"] == "beta" and first["from"] is None, state["model_placement"]

        def moved(s: dict) -> bool:
            return s["model_placement"]["placement"].get(peer) == "alpha"

        state = sw.wait_until(moved, scaled(60), "S moved off beta, which it cannot load")
        mp = state["model_placement"]
        failure = mp["load_failures"][peer]["beta"]
        assert failure["failed_span"] == [0, 2] and "--cache-tokens-per-block 16" in failure["load_error"], mp
        last = mp["recent"][-1]
        assert last["from"] == "beta" and last["to"] == "alpha" and "cannot load" in last["why"], mp["recent"]
        said = sw.log_tail("orchestrator", 400)
        assert "cannot load model beta's blocks [0, 2)" in said, said
        # it follows the placement and loads alpha's blocks (4 of them hold its one job)
        def online_on_alpha(s: dict) -> bool:
            return any(x["peer_id"] == peer and x["state"] == "online" and x["num_blocks"] for x in s["servers"])

        state = sw.wait_until(online_on_alpha, scaled(60), "S online with alpha's blocks")
        row = next(x for x in state["servers"] if x["peer_id"] == peer)
        assert row["num_blocks"] == 4 and row["load_error"] == "" and row["failed_span"] is None, row
        assert row["failed_models"]["beta"]["failed_span"] == [0, 2], row  # what it cannot serve, on its row
        assert row["failed_models"]["beta"]["reason"] == "reported", row  # by its record, not its load deadline
        assert sw.client().complete(PROMPT, max_tokens=6).token_ids == hf_greedy_from(alpha, PROMPT, 6)
        placement = sw.swarm()["model_placement"]
        assert [m["to"] for m in placement["recent"] if m["server"] == peer] == ["beta", "alpha"], placement["recent"]


# ---- the same rules on the real planners and placer, driven round by round (fast) ------------------------------------

SHORT_CACHE = "2 blocks leave 0 cache slots of 64 tokens: --cache-tokens-per-block 16 holds 0 cache slots"


class FakeDHT:
    """The records each server publishes under each model's prefix; the assignments and placement published."""

    peer_id = "orch"

    def __init__(self):
        self.records: dict[str, dict[str, ServerRecord]] = {}
        self.placements: list = []

    async def afetch_servers(self, prefix: str) -> dict[str, ServerRecord]:
        return dict(self.records.get(prefix, {}))

    def publish_assignment(self, prefix: str, record, expiration_s: float) -> None:
        pass

    async def apublish_placement(self, prefix: str, record, expiration_s: float) -> bool:
        self.placements.append(record)
        return True


class Pinger:
    async def ping(self, peer_id: str) -> float:
        return 0.001


SPECS = {"alpha": ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0),
         "beta": ModelSpec(num_blocks=2, block_size=100.0, cache_size=10.0)}


class Swarm:
    """Two models' real planners and the real placer over a fake DHT; the test plays the servers."""

    def __init__(self):
        self.dht = FakeDHT()
        self.orchs = {}
        for name, spec in SPECS.items():
            planner = Planner(dht=self.dht, prefix=f"{name}-p", client=Pinger(), max_length=64,
                              on_chains=lambda chains: None, arrival_rate=0.5, model_spec_fallback=lambda s=spec: s,
                              settle_s=0.0, replan_interval_s=3600.0, use_all_servers=True)
            self.orchs[name] = SimpleNamespace(model_id=name, prefix=f"{name}-p", planner=planner, dht=self.dht,
                                               stats=SimpleNamespace(history=[]), model_spec=lambda s=spec: s)
        self.placer = ModelPlacer(list(self.orchs.values()), window_s=30.0, reload_s=1.0, min_arrivals=10,
                                  interval_s=1000.0)
        self.now = time.monotonic()
        self.placer.clock = lambda: self.now

    def announce(self, peer: str, offered: list[str], serving: str, **served) -> None:
        """``peer``'s records: under the model it serves with ``served`` (span, state, failure), the others bare."""
        prefixes = [f"{n}-p" for n in offered] if len(offered) > 1 else []
        for name in offered:
            fields = {"state": "joining", **(served if name == serving else {})}
            self.dht.records.setdefault(f"{name}-p", {})[peer] = ServerRecord(
                peer_id=peer, public_name=peer, memory_bytes=500, tau_p=0.1, max_length=64, kv_cache="slots",
                models=prefixes, serving=f"{serving}-p" if prefixes else "", **fields)

    def leave(self, peer: str) -> None:
        for recs in self.dht.records.values():
            recs.pop(peer, None)

    def load(self, peer: str, offered: list[str], name: str, **kw) -> None:
        """``peer`` follows its model's assignment: online with the span assigned."""
        start, num = self.orchs[name].planner.assignment[peer]
        self.announce(peer, offered, name, state="online", start_block=start, num_blocks=num, slots_total=5,
                      slots_free=5, epoch=self.orchs[name].planner.epoch, **kw)

    def step(self, n: int = 1) -> None:
        async def one():
            for o in self.orchs.values():
                await o.planner.refresh()
            await self.placer.round()

        for _ in range(n):
            asyncio.run(one())

    def placed(self, peer: str) -> str | None:
        return self.placer.placement.get(peer)


BOTH = ["alpha", "beta"]


def s_on_beta_with_a_span() -> Swarm:
    """F serves alpha (alpha only); S, offering both, joins after it: placed on beta, which assigns it [0, 2)."""
    sw = Swarm()
    sw.announce("F", ["alpha"], "alpha")
    sw.step()
    sw.load("F", ["alpha"], "alpha")
    sw.announce("S", BOTH, "alpha")
    sw.step()
    assert sw.placed("S") == "beta"  # alpha has a chain, beta none
    sw.announce("S", BOTH, "beta")  # it follows the placement
    sw.step()
    assert sw.orchs["beta"].planner.assignment == {"S": (0, 2)}
    return sw


def test_a_failed_load_moves_the_server_and_the_model_is_not_given_back_until_it_restarts(caplog):
    sw = s_on_beta_with_a_span()
    beta = sw.orchs["beta"].planner
    # a failure announced before the epoch that gave the span (to an orchestrator before a restart): stale
    sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch - 1)
    sw.step(2)
    assert sw.placed("S") == "beta" and not sw.placer.json().get("load_failures")
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.placement"):
        sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
        sw.step()
    assert sw.placed("S") == "alpha", sw.placer.json()  # at once, not at the interval's end
    shown = sw.placer.json()
    assert shown["load_failures"]["S"]["beta"]["failed_span"] == [0, 2]
    assert SHORT_CACHE in shown["load_failures"]["S"]["beta"]["load_error"]
    move = shown["recent"][-1]
    assert (move["from"], move["to"]) == ("beta", "alpha") and "cannot load model beta's blocks [0, 2)" in move["why"]
    assert any(r.levelno == logging.WARNING and "cannot load model beta's blocks [0, 2)" in r.getMessage()
               for r in caplog.records), caplog.text
    assert sw.dht.placements[-1].placement["S"] == "alpha-p"  # published: the server follows it

    # it follows: alpha's record serving, beta's bare (the server forgot the failure with the model it left)
    sw.announce("S", BOTH, "alpha")
    sw.step()
    assert "S" not in beta.servers and "S" in sw.orchs["alpha"].planner.servers
    # beta's traffic arrives, beta has no server, a re-placement is due: S is never given beta back
    sw.now += 1001.0
    for i in range(60):
        beta.rates.arrive(sw.now - 20 + i / 3)
    sw.step(3)
    replan = sw.placer.json()["replans"][-1]
    assert replan["rates"]["beta"] > 1 and replan["servers_per_model"]["beta"] == 0, replan
    assert sw.placed("S") == "alpha", sw.placer.json()
    assert [m["to"] for m in sw.placer.json()["recent"] if m["server"] == "S"] == ["beta", "alpha"]

    # it restarts (leaves, comes back with its identity, on the model it held): beta may be placed on it again
    sw.leave("S")
    sw.step()
    assert sw.placer.load_failures == {}
    sw.announce("S", BOTH, "alpha")
    sw.now += 31.0
    for i in range(60):
        beta.rates.arrive(sw.now - 20 + i / 3)
    sw.step(2)
    assert sw.placed("S") == "beta", sw.placer.json()  # beta's traffic has no server: the one that may serve it


def test_a_server_that_fails_every_model_it_offers_stays_and_is_forgiven_once_it_loads(caplog):
    sw = s_on_beta_with_a_span()
    beta, alpha = sw.orchs["beta"].planner, sw.orchs["alpha"].planner
    sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
    sw.step()
    assert sw.placed("S") == "alpha"
    sw.announce("S", BOTH, "alpha")
    sw.step(2)
    assert "S" in alpha.assignment, alpha.assignment  # every server that adds capacity gets blocks (the test's planner)
    start, num = alpha.assignment["S"]
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.placement"):
        sw.announce("S", BOTH, "alpha", failed_span=[start, num], load_error="loading failed: out of memory",
                    epoch=alpha.epoch)
        sw.step(2)
        assert sw.placed("S") == "alpha" and set(sw.placer.load_failures["S"]) == {"alpha", "beta"}
        assert sw.placer.allowed("S", alpha.seen["S"]) == []
        said = [r.getMessage() for r in caplog.records if "any other model it offers" in r.getMessage()]
        assert len(said) == 1 and "kept on alpha (it retries)" in said[0], caplog.text  # once, not every round
        sw.now += 1001.0  # a re-placement: nothing to move it to, and it counts for neither model
        sw.step()
        assert sw.placed("S") == "alpha" and sw.placer.replans
        sw.load("S", BOTH, "alpha")  # a retry worked: alpha's failure is forgotten, beta's stands
        sw.step()
    assert set(sw.placer.load_failures["S"]) == {"beta"} and sw.placer.allowed("S", alpha.seen["S"]) == ["alpha"]
    assert "no longer reports a failed load of model alpha" in caplog.text


def test_the_unserved_index_places_a_server_only_on_the_models_it_may_take():
    """``allowed`` (algorithms/multimodel.py): a server limited to some models is never placed on another, even the
    one whose unserved index is highest; one allowed none stays unplaced; others are free as before."""
    models = [ServedModel("a", 2, 1.0, 0.1, 0.1, rate=0.1), ServedModel("b", 2, 1.0, 0.1, 0.1, rate=5.0)]
    servers = [Volunteer("x", 10.0), Volunteer("y", 10.0), Volunteer("z", 10.0)]
    free = place_by_unserved_index(servers, models)
    assert free["x"] == "b"  # the busy model first
    plan = place_by_unserved_index(servers, models, allowed={"x": ["a"], "z": []})
    assert plan["x"] == "a" and "z" not in plan and plan["y"] == "b", plan


def test_a_server_kept_on_a_model_it_cannot_load_does_not_count_as_serving_it_for_a_new_one():
    """S failed both models it offers and is kept on alpha (serving nothing); alpha's only working server leaves;
    T, offering both, joins: it was placed on beta as if S served alpha (found by review)."""
    def fail(sw, peer, name):
        p = sw.orchs[name].planner
        st, nm = p.assignment[peer]
        sw.announce(peer, BOTH, name, failed_span=[st, nm], load_error="out of memory", epoch=p.epoch)

    sw = s_on_beta_with_a_span()
    fail(sw, "S", "beta")
    sw.step()
    assert sw.placed("S") == "alpha"
    sw.announce("S", BOTH, "alpha")
    sw.step(2)
    fail(sw, "S", "alpha")
    sw.step(2)
    assert sw.placed("S") == "alpha" and sw.placer._failing("S")
    sw.announce("G", ["beta"], "beta")
    sw.step()
    sw.load("G", ["beta"], "beta")
    sw.step()
    sw.leave("F")
    sw.step()
    sw.announce("T", BOTH, "alpha")
    sw.step()
    assert sw.placed("T") == "alpha", sw.placer.placement
