"""bench_swarm replays the trace only once the plan has settled: ``wait_ready`` passed while servers still joined."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("s33_bench_swarm", SCRIPTS / "bench_swarm.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


class _Swarm:
    """Answers ``wait_until`` with a scripted sequence of states, one per poll, on a fake clock."""

    def __init__(self, states, clock):
        self.states, self.clock, self.polls = states, clock, 0

    def wait_until(self, predicate, timeout, what):
        for state in self.states:
            self.polls += 1
            if predicate(state):
                return state
            self.clock.t += 2.0  # two seconds between polls
        raise TimeoutError(what)


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _state(epoch: int, chains: int, online: int) -> dict:
    return {"ready": True, "epoch": epoch, "chains": [{}] * chains,
            "servers": [{"public_name": f"s{i}", "state": "online" if i < online else "joining"} for i in range(9)]}


def test_the_replay_waits_for_the_plan_to_stop_changing(monkeypatch):
    bench = _bench()
    clock = _Clock()
    monkeypatch.setattr(bench.time, "monotonic", clock)
    forming = [_state(1, 3, 3), _state(1, 3, 5), _state(2, 6, 6), _state(3, 9, 9)]
    swarm = _Swarm(forming + [_state(3, 9, 9)] * 10, clock)
    state = bench.wait_plan_settled(swarm, timeout=600, quiet_s=10.0)
    assert len(state["chains"]) == 9 and state["epoch"] == 3
    assert swarm.polls == len(forming) + 5  # 10 s of the same plan, polled every 2 s
