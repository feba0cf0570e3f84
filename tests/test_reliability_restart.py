"""Which assignments a server follows after its orchestrator restarted (epochs count anew from 1)."""

from __future__ import annotations

from petals_chain.server.server import Server, ServerConfig
from petals_chain.swarm.records import AssignmentRecord

ORCH = "QmOrchestrator"


def asg(epoch: int, t: float, spans: dict, max_length: int = 64) -> AssignmentRecord:
    return AssignmentRecord(epoch=epoch, max_length=max_length, orchestrator_peer_id=ORCH, assignments=spans,
                            timestamp=t)


def follow(server: Server, record: AssignmentRecord) -> None:
    """What apply_assignment records about the assignment it follows (without loading blocks)."""
    server.epoch, server.assignment_timestamp = record.epoch, record.timestamp
    server._applied_content = server._assignment_content(record)


def test_restarted_orchestrator_assignments_are_followed(tiny_model_dir):
    server = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.01))
    assert server.is_new_assignment(asg(1, 100.0, {"a": [0, 4]}))
    follow(server, asg(3, 100.0, {"a": [0, 4]}))
    assert server.is_new_assignment(asg(4, 90.0, {"a": [0, 4]}))  # a higher epoch always counts
    assert not server.is_new_assignment(asg(2, 90.0, {"a": [0, 2]}))  # older and lower: stale
    assert server.is_new_assignment(asg(1, 200.0, {"a": [0, 2]}))  # restarted: lower epoch, published later
    assert not server.is_new_assignment(asg(3, 200.0, {"a": [0, 4]}))  # a re-publish of what we follow
    assert server.is_new_assignment(asg(3, 200.0, {"a": [0, 2]}))  # restarted, reached the same epoch, other spans
    assert server.is_new_assignment(asg(3, 200.0, {"a": [0, 4]}, max_length=128))
    assert not server.is_new_assignment(asg(3, 50.0, {"a": [0, 2]}))  # same epoch, older: stale
