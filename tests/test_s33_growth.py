"""Long runs stay bounded: per-peer and per-chain state of the orchestrator is pruned when servers come and go with
new peer ids (a public swarm's volunteers restart without --identity-path: each run is a new id)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from petals_chain.model import Chain, ModelSpec, ServerSpec
from petals_chain.orchestrator.dispatch import KEPT_CHAIN_IDS, DispatchJob
from petals_chain.orchestrator.routed import make_dispatch
from petals_chain.swarm.records import ServerRecord

MODEL = ModelSpec(num_blocks=4, block_size=10.0, cache_size=1.0)
CHURN = 1000  # servers that come and go, each with a new peer id


class ChurnPlanner:
    """One whole-model server at a time, under a new peer id each time (routed dispatch's planner interface)."""

    def __init__(self):
        self.model_spec = ModelSpec(num_blocks=4, block_size=1.0, cache_size=0.1)
        self.assignment: dict = {}
        self.steps_per_job = 10.0
        self.views: list = []

    def serve(self, peer: str) -> None:
        self.assignment = {peer: (0, 4)}
        self.views = [SimpleNamespace(peer_id=peer, rtt_s=0.01, record=SimpleNamespace(slots_total=8, memory_bytes=10))]

    def online_views(self):
        return list(self.views)

    def tau_c(self, v):
        return 0.1

    def tau_p(self, v):
        return 0.1

    def specs(self, views):
        return [ServerSpec(name=v.peer_id, memory=10.0, tau_c=0.1, tau_p=0.1) for v in views]


def test_routed_peaks_of_chains_gone_are_forgotten():
    """Routed dispatch (--dispatch petals|bprr) kept the peak of every GCA chain a route ever matched: one entry per
    chain of every plan since start (1,000 server churns: 1,000 entries). Now the chains of older plans are
    forgotten past KEPT_CHAIN_IDS, as the central dispatcher's are; the current chains keep their peaks."""
    async def main():
        d = make_dispatch("petals", wait_s=5.0)
        planner = ChurnPlanner()
        d.attach(planner)
        for i in range(CHURN):
            peer = f"server-{i}"
            planner.serve(peer)
            d.set_chains([Chain(servers=(peer,), blocks=(4,), service_time=1.0, capacity=2, spans=((0, 4),))])
            leases = [await d.acquire(DispatchJob(job_id=f"{i}-{k}")) for k in range(2)]
            assert d.peak_active(0) == 2
            for lease in leases:
                d.release(lease)
        return d

    d = asyncio.run(main())
    assert len(d._peak) <= KEPT_CHAIN_IDS + 1, len(d._peak)
    assert d.peak_active(0) == 2 and d.running == 0 and d.held == {}


def _record(peer: str, **kw) -> ServerRecord:
    return ServerRecord(**{"peer_id": peer, "state": "online", "memory_bytes": 60, "tau_p": 0.01, "public_name": peer,
                           "max_length": 64, "timestamp": time.time(), **kw})


class FakeDHT:
    peer_id = "orch"

    def __init__(self, records: dict):
        self.records = records

    async def afetch_servers(self, prefix):
        return dict(self.records)

    def publish_assignment(self, prefix, rec, expiration):
        pass


class FakeClient:
    async def ping(self, peer_id):
        return 0.001


def test_planner_forgets_warnings_of_servers_gone(caplog):
    """The planner remembered each server it warned about (sizes it does not believe, slots for a smaller
    max_length) for ever: one entry per such server ever seen. Now a server's entries go with its record (and one
    that comes back is warned about again)."""
    from petals_chain.orchestrator.planner import Planner

    records = {"a": _record("a")}  # a server that stays (a read naming none of the last ones is a failed read)
    pl = Planner(dht=FakeDHT(records), prefix="x", client=FakeClient(), max_length=64, on_chains=lambda c: None,
                 arrival_rate=1.0, model_spec_fallback=lambda: MODEL, settle_s=0.0)
    caplog.set_level(logging.WARNING, logger="petals_chain.orchestrator.planner")
    for i in range(200):
        peer = f"p{i}"
        records.pop(f"p{i - 1}", None)
        # sizes far from the model's, and online with a span but slots for 32 tokens (the swarm's max_length is 64)
        records[peer] = _record(peer, s_m_bytes=100_000, s_c_bytes=100_000, max_length=32, start_block=0,
                                num_blocks=4)
        asyncio.run(pl.refresh())
        pl.assignment[peer] = (0, 4)
        assert peer not in {v.peer_id for v in pl.online_views()}  # left out of the chains, warned once
        assert peer in pl._odd_sizes and pl._short.get(peer) == 32  # (the test reaches both warnings)
    assert pl._odd_sizes == {"p199"} and set(pl._short) == {"p199"}, (len(pl._odd_sizes), len(pl._short))
    # a server back after its record expired is warned about again
    del records["p199"]
    asyncio.run(pl.refresh())
    assert not pl._odd_sizes and not pl._short
    caplog.clear()
    records["p199"] = _record("p199", s_m_bytes=100_000, s_c_bytes=100_000)
    asyncio.run(pl.refresh())
    assert sum("announces s_m=" in r.getMessage() for r in caplog.records) == 1


def test_soak_removes_its_model_directory(tmp_path, monkeypatch):
    """The growth soak (session 33's script, scripts/soak.py since session 35) built its tiny model in a fresh temp
    directory and never removed it: each run (or a failed start) left a directory under /tmp. Now it goes with the
    run, whatever ends it (tests/test_s35_soak_one.py: and a failed start stops what it started)."""
    import petals_chain.swarm.tiny_model as tiny

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its folders first
    spec = importlib.util.spec_from_file_location(
        "s33_soak", Path(__file__).resolve().parents[1] / "scripts" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    work = tmp_path / "soak-x"

    def mkdtemp(prefix=""):
        work.mkdir()
        return str(work)

    def build(path, **kw):  # the model is written, then building the swarm fails
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"0" * 1024)
        raise RuntimeError("no room for the swarm")

    monkeypatch.setattr(soak.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(tiny, "build_tiny_model", build)
    monkeypatch.setattr(soak.logging, "basicConfig", lambda **kw: None)  # the test's logging stays as it is
    with pytest.raises(RuntimeError, match="no room"):
        soak.main(["--rounds", "2", "--requests", "10"])
    assert not work.exists()
