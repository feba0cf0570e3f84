"""A server following its assignments, with the blocks' loading and the sessions' drain stood in: a stop that comes
while it drains for a re-assignment loads nothing more, and a load that failed is tried again when the orchestrator
publishes the assignment again (after a backoff), instead of the server staying joining without blocks."""

from __future__ import annotations

import asyncio
import logging
import types

import pytest

from petals_chain.server.server import Server


class _Runner:
    slots_total = slots_free = 4

    def close(self) -> None:
        pass


class _Assignment:
    def __init__(self, epoch: int, span: tuple[int, int], timestamp: float):
        self.epoch, self.timestamp, self.max_length, self.model_fingerprint = epoch, timestamp, 128, ""
        self.assignments = {"me": list(span)}

    def span_of(self, peer_id: str):
        return tuple(self.assignments[peer_id])


def _server(load) -> Server:
    """A Server without a model, a DHT or sessions: ``load(source, start, num, ...)`` makes its runner."""
    class Service:
        runner = None

        async def drain(self, timeout_s, forced):
            await asyncio.sleep(0.2)  # open sessions finishing

    s = object.__new__(Server)
    s.cfg = types.SimpleNamespace(max_length=None, max_blocks=0, device="cpu", quant="none", progress=False,
                                  batching=False, kv_cache="slots", page_size=16, prefix_cache=False,
                                  decode_graph="off", drain_timeout_s=5)
    s.state, s.epoch, s.assignment_timestamp, s._applied_content = "joining", -1, 0.0, ()
    s.span, s.max_length, s.reloads, s.announcer = None, 128, 0, None
    s._failed_load, s._failed_loads, s.load_failure = None, 0, None
    s.service, s._stop, s._force_stop = Service(), asyncio.Event(), False
    s.sd = types.SimpleNamespace(peer_id="me")
    memory = types.SimpleNamespace(slots_for=lambda n, length: 4, holds=lambda n, length: True)
    s.active = types.SimpleNamespace(num_layers=8, memory=memory, source=None, config=None, torch_dtype=None,
                                     fingerprint="fp", adapters=(), adapter_names={})
    s._make_runner = load
    return s


def test_a_stop_during_a_re_assignments_drain_loads_nothing_more():
    """It loaded the new span anyway (minutes on a real model, uncancellable) and announced itself online."""
    loads = []

    def load(source, start, num, **kw):
        loads.append((start, num))
        return _Runner()

    async def main():
        s = _server(load)
        await s.apply_assignment(_Assignment(1, (0, 4), 1.0))
        assert s.state == "online"

        async def stop_soon():
            await asyncio.sleep(0.05)
            s._on_signal()

        stopping = asyncio.ensure_future(stop_soon())
        await s.apply_assignment(_Assignment(2, (4, 4), 2.0))
        await stopping
        return s

    s = asyncio.run(main())
    assert loads == [(0, 4)] and s.state != "online" and s.service.runner is None


def test_a_failed_load_is_tried_again_after_a_backoff(monkeypatch):
    attempts = []

    def load(source, start, num, **kw):
        attempts.append((start, num))
        if len(attempts) == 1:
            raise RuntimeError("out of memory, for a moment")
        return _Runner()

    now = [1000.0]
    monkeypatch.setattr("petals_chain.server.server.time.monotonic", lambda: now[0])
    logging.disable(logging.CRITICAL)
    try:
        async def main():
            s = _server(load)
            await s.apply_assignment(_Assignment(1, (0, 4), 1.0))
            assert s.state == "joining" and s.service.runner is None
            republished = _Assignment(1, (0, 4), 5.0)  # the same epoch and spans, published again
            assert s.is_new_assignment(republished)
            await s.apply_assignment(republished)  # within the backoff: not yet
            assert len(attempts) == 1
            now[0] += 11.0
            await s.apply_assignment(republished)
            return s

        s = asyncio.run(main())
    finally:
        logging.disable(logging.NOTSET)
    assert len(attempts) == 2 and s.state == "online" and s.service.runner is not None



def test_a_model_switch_whose_unload_failed_is_tried_again():
    """The drain or unload raised while switching models: the placement is followed again at the next poll (it was
    marked followed first, so the server stayed draining with the old model's blocks)."""
    a, b = (types.SimpleNamespace(prefix=p, hidden_size=64, fingerprint=p) for p in ("model-a", "model-b"))
    placement = types.SimpleNamespace(timestamp=10.0, placement={"me": "model-b"})
    unloads = []

    async def unload():
        unloads.append(1)
        if len(unloads) == 1:
            raise RuntimeError("drain failed")

    async def fetch(prefixes, trusted, peer_id):
        return placement

    async def main():
        s = _server(lambda *a, **k: _Runner())
        s.hosted, s.active, s.trusted, s._misplaced, s.placement_timestamp, s.switches = [a, b], a, {"o"}, set(), 0.0, 0
        s.sd.afetch_placement = fetch
        s._unload = unload
        with pytest.raises(RuntimeError):
            await s.follow_placement()
        assert s.active is a
        await s.follow_placement()  # the next poll
        return s

    s = asyncio.run(main())
    assert s.active is b and len(unloads) == 2 and s.state == "joining"


def test_a_server_left_without_blocks_says_why_after_a_while(caplog):
    """A server that no orchestrator assigns (none serves its model under its DHT prefix, or the plan leaves it out)
    stayed joining in silence; after two minutes without blocks it says which, then every ten minutes."""
    from petals_chain.server.server import UNASSIGNED_REPEAT_S, UNASSIGNED_WARN_S

    s = _server(lambda *a, **kw: _Runner())
    s._unassigned_since, s._unassigned_said = None, float("-inf")
    s.active.prefix = "smollm2-135m"
    with caplog.at_level(logging.WARNING, logger="petals_chain.server.server"):
        assert s.say_if_unassigned(None, 0.0) is None
        assert s.say_if_unassigned(None, UNASSIGNED_WARN_S - 1) is None
        said = s.say_if_unassigned(None, UNASSIGNED_WARN_S + 1)
        assert "no trusted orchestrator publishes assignments" in said and "'smollm2-135m'" in said
        assert s.say_if_unassigned(None, UNASSIGNED_WARN_S + 60) is None  # not at every poll
        left_out = s.say_if_unassigned(_Assignment(3, (0, 4), 1.0), UNASSIGNED_WARN_S + UNASSIGNED_REPEAT_S + 2)
        assert "plan (epoch 3) leaves this server out" in left_out
        assert len([r for r in caplog.records if "no blocks assigned" in r.getMessage()]) == 2
        s.span = (0, 4)  # assigned: quiet, and the clock starts again when it has none
        assert s.say_if_unassigned(None, 10_000.0) is None and s._unassigned_since is None


def test_a_server_of_several_models_moves_to_one_an_orchestrator_serves():
    """``--model gamma --model alpha`` with an orchestrator serving alpha only: that orchestrator never places the
    server (it offers one of its models), and the server served gamma, its first, which no orchestrator serves: idle
    for good, silently. After ``ORPHAN_SWITCH_S`` with no orchestrator for gamma (no assignment, no summary) it
    serves alpha, whose orchestrator publishes its summary (it has no plan yet: no server)."""
    from petals_chain.server.server import ORPHAN_SWITCH_S

    gamma, alpha = (types.SimpleNamespace(prefix=p, hidden_size=64, fingerprint=p) for p in ("gamma", "alpha"))
    asked = []

    async def fetch(prefix, trusted, peer_id):
        asked.append(prefix)
        return None  # no plan anywhere yet: alpha's orchestrator has no server

    async def summary(prefix, trusted):
        return {"model": "alpha"} if prefix == "alpha" else None  # alpha's orchestrator is there

    async def unload():
        pass

    async def main():
        s = _server(lambda *a, **k: _Runner())
        s.hosted, s.active, s.trusted, s.placement_timestamp, s.switches = [gamma, alpha], gamma, {"o"}, 0.0, 0
        s._unassigned_since, s._unassigned_said = None, float("-inf")
        s.sd.afetch_assignment, s.sd.afetch_summary = fetch, summary
        s._unload = unload
        s.say_if_unassigned(None, 0.0)
        assert not await s.serve_a_model_someone_serves(None, ORPHAN_SWITCH_S - 1) and asked == []
        # an orchestrator assigns the model served (even without blocks for it): no move
        assert not await s.serve_a_model_someone_serves(_Assignment(1, (0, 4), 1.0), ORPHAN_SWITCH_S + 1)
        s.placement_timestamp = 7.0  # placed once, by an orchestrator since gone: moves all the same
        assert await s.serve_a_model_someone_serves(None, ORPHAN_SWITCH_S + 1)
        return s

    s = asyncio.run(main())
    assert s.active is alpha and s.switches == 1 and s.state == "joining" and asked == ["alpha"]


def test_an_assignment_it_cannot_serve_says_which_flag(caplog):
    """``--cache-tokens-per-block`` below what one job needs: every assignment was refused with an error about the
    memory budget (``M_j``), which had room for 42 slots; and ``--max-length`` below the swarm's said nothing (its
    chains then refused every longer job)."""
    def load(source, start, num, **kw):
        return _Runner()

    async def main(s, asg):
        await s.apply_assignment(asg)

    s = _server(load)
    s.memory.slots_for = lambda n, length, cap=True: 0 if cap else 42
    s.memory.holds = lambda n, length: False
    s.memory.cache_tokens_per_block, s.memory.memory_bytes, s.memory.s_m = 16, 10**6, 1000
    s.memory.s_c = lambda length: 100
    s.memory.slots_for_one_job = lambda n: 1  # paged: one slot's pages open a session over the span
    with caplog.at_level(logging.INFO):
        asyncio.run(main(s, _Assignment(1, (0, 4), 1.0)))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert said and "--cache-tokens-per-block 16" in said[-1] and "at least 32" in said[-1], said
    s = _server(load)
    s.cfg.max_length = 32
    caplog.clear()
    with caplog.at_level(logging.INFO):
        asyncio.run(main(s, _Assignment(1, (0, 4), 1.0)))
    assert any("--max-length 32 is below the swarm's max_length 128" in r.getMessage() for r in caplog.records)
