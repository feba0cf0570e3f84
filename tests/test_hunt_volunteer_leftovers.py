"""What a volunteer's server, the orchestrator's dial-back and the standalone dashboard got wrong (unit level): a cached
tau_p of Infinity taken, a sliding window passed at start, the free slots announced low after a close mid-step, "/"
taken as a multiaddr, the dial-back's queue and caller table growing with new peer ids, a lone record sizing the
coverage chart, and ``?model=`` answered with another model's view before the first summary."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from petals_chain.server import profiling
from petals_chain.server.config import ServerConfig
from petals_chain.server.runner import BlockRunner
from petals_chain.server.server import Server
from petals_chain.server.sessions import SessionService
from petals_chain.swarm import reachability
from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=2, seed=0)


@pytest.mark.parametrize("cached", ["Infinity", "true"])
def test_a_cached_tau_p_that_is_no_measurement_is_measured_again(llama, tmp_path, cached):
    """json reads ``Infinity`` (and ``true``, as 1.0): an infinite tau_p made every record the server published
    afterwards invalid, so it left the swarm."""
    runner = BlockRunner(llama, 0, 1, num_slots=1, max_length=16, progress=False)
    cache = tmp_path / "tau_p.json"
    cache.write_text('{"%s": {"tau_p": %s}}' % (profiling.cache_key(runner, 8, 2), cached))
    tau_p = profiling.measure_tau_p(runner, 8, 2, repeats=1, warmup=0, cache_path=cache, progress=False)
    assert 0 < tau_p < 1.0  # measured: a 2-layer toy's block takes milliseconds


def test_a_sliding_window_bounds_the_profile_and_max_length_at_start(tmp_path):
    model = build_tiny_model(tmp_path / "mistral", family="mistral", num_layers=2, seed=0, sliding_window=64)
    with pytest.raises(ValueError, match=r"--profile-l-in 128 \+ --profile-l-out 16 exceeds sliding_window 64"):
        Server(ServerConfig(model=str(model), allow_any_client=True))
    with pytest.raises(ValueError, match=r"--max-length 100 exceeds sliding_window 64"):
        Server(ServerConfig(model=str(model), allow_any_client=True, max_length=100, tau_p=0.01))
    Server(ServerConfig(model=str(model), allow_any_client=True, max_length=64, profile_l_in=48))  # within it


def test_a_close_during_a_step_announces_the_pages_when_they_return(llama):
    """The close's change notice came while the step still held its pages; none came when they returned, so the
    record showed them held until the next refresh."""
    seen: list[int] = []
    svc = SessionService(hidden_size=0, trusted={"peer"}, allow_any_client=False, state=lambda: "online",
                         on_change=lambda: seen.append(svc.runner.slots_free), describe=lambda: {})
    svc.runner = BlockRunner(llama, 0, 2, num_slots=1, max_length=32, progress=False, batching=False)
    svc.hidden_size = svc.runner.hidden_size
    started, go = threading.Event(), threading.Event()
    compute = svc.runner._compute_alone

    def held(*args):
        started.set()
        go.wait(30)
        return compute(*args)

    svc.runner._compute_alone = held

    async def main():
        svc.open_session("a", 0, 2, 16, "peer")  # every page of the pool
        step = asyncio.ensure_future(svc.forward("a", torch.randn(1, 4, svc.hidden_size), 0))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        svc.close_session("a")
        assert seen[-1] == 0  # the step still holds the slot
        go.set()
        await step

    asyncio.run(main())
    assert svc.runner.slots_free == 1 and seen[-1] == 1


@pytest.mark.parametrize("text", ["/", "//"])
def test_an_empty_multiaddr_is_refused(text):
    with pytest.raises(ValueError, match="not a multiaddr"):
        reachability.to_multiaddr(text)
    assert str(reachability.to_multiaddr("/ip4/1.2.3.4/tcp/1/")) == "/ip4/1.2.3.4/tcp/1"  # a trailing slash is fine


class _SlowProber:
    """Dials that wait until released; counts those started."""

    def __init__(self, until: int):
        self.started, self.until = 0, until
        self.all_started, self.release = asyncio.Event(), asyncio.Event()

    async def dial(self, peer_id, maddrs):
        self.started += 1
        if self.started >= self.until:
            self.all_started.set()
        await self.release.wait()
        return True, maddrs[0], ""


def _ask(frontdoor, peer_id: str):
    request = runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps({"maddrs": ["/ip4/1.2.3.4/tcp/1"]}))
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer_id))
    return frontdoor.rpc_dial_back(request, context).__anext__()


def test_dial_backs_of_new_peer_ids_wait_in_a_bounded_queue(monkeypatch):
    """A new peer id is free to make: each one queued a dial behind the prober's two slots (up to 3 timeouts each),
    so a hundred of them made every honest server's check time out."""
    monkeypatch.setattr(reachability, "LINGER_S", 0.0)
    n = reachability.MAX_PENDING_DIAL_BACKS

    async def main():
        prober = _SlowProber(until=n)
        door = reachability.PetalsChainFrontdoor(prober)
        queued = [asyncio.ensure_future(_ask(door, f"peer{i}")) for i in range(n)]
        await prober.all_started.wait()
        extra = MSGPackSerializer.loads((await asyncio.wait_for(_ask(door, "peer-new"), 10)).metadata)
        assert extra["ok"] is False and extra["code"] == "busy"
        prober.release.set()
        replies = [MSGPackSerializer.loads(r.metadata) for r in await asyncio.gather(*queued)]
        assert all(r["ok"] and r["reachable"] for r in replies)
        assert prober.started == n
        assert MSGPackSerializer.loads((await _ask(door, "peer-new")).metadata)["ok"]  # room again

    asyncio.run(main())


def test_the_dial_back_rate_table_is_bounded(monkeypatch):
    monkeypatch.setattr(reachability, "LINGER_S", 0.0)
    monkeypatch.setattr(reachability, "MAX_DIAL_BACK_PEERS", 10)

    async def main():
        prober = _SlowProber(until=1)
        prober.release.set()
        door = reachability.PetalsChainFrontdoor(prober)
        for i in range(30):
            await _ask(door, f"peer{i}")
        return door

    door = asyncio.run(main())
    assert list(door._last) == [f"peer{i}" for i in range(20, 30)]


def _record(pid: str, start: int, num: int) -> dict:
    return {"peer_id": pid, "state": "online", "start_block": start, "num_blocks": num, "timestamp": 0.0}


def test_without_a_summary_a_lone_huge_span_does_not_size_the_coverage_chart():
    from petals_chain.dashboard.source import merge_view

    honest = {"a": _record("a", 0, 15), "b": _record("b", 15, 15)}
    assert merge_view("p", honest, None)["num_blocks"] == 30
    assert merge_view("p", {**honest, "liar": _record("liar", 0, 4096)}, None)["num_blocks"] == 30
    assert merge_view("p", {"small": _record("small", 0, 2), "big": _record("big", 2, 28)}, None)["num_blocks"] == 30
    assert merge_view("p", {"lone": _record("lone", 0, 30)}, None)["num_blocks"] == 30
    assert merge_view("p", {}, None)["num_blocks"] is None


class _FakeDHT:
    def __init__(self):
        self.summary = None
        self.records = {"liar": _record("liar", 0, 4096), "a": _record("a", 0, 30)}

    def fetch_servers(self, prefix):
        return dict(self.records)

    def fetch_summary(self, prefix, trusted):
        return self.summary


def test_the_standalone_dashboard_keeps_the_models_length_and_waits_for_its_models():
    from petals_chain.dashboard.app import create_app
    from petals_chain.dashboard.source import DhtSwarmSource, ModelsNotKnownYet

    sd = _FakeDHT()
    source = DhtSwarmSource(sd, "tiny", trusted=["QmOrch"])
    source.refresh()
    client = TestClient(create_app(source.view, source.health, model_view=source.view))
    # before any summary another model's name got this swarm's view, labelled with its name in the URL
    with pytest.raises(ModelsNotKnownYet):
        source.view("other-model")
    reply = client.get("/api/v1/swarm", params={"model": "other-model"})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "models_not_known_yet"
    assert client.get("/", params={"model": "other-model"}).status_code == 200  # the page waits for it
    assert client.get("/api/v1/swarm", params={"model": "tiny"}).status_code == 200
    sd.summary = {"model": "tiny", "num_blocks": 32, "servers": [], "chains": []}
    source.refresh()
    assert source.view("other-model")["num_blocks"] == 32  # one model: ?model= is ignored, as before
    sd.summary = None  # the orchestrator restarting: its length stays known
    assert source.refresh()["num_blocks"] == 32


@pytest.mark.parametrize("flags, message", [
    (["--host-maddrs", "/ip4/1.2.3.4/tcp/99999"], "--host-maddrs '/ip4/1.2.3.4/tcp/99999': not a multiaddr"),
    (["--host-maddrs", "garbage"], "--host-maddrs 'garbage': not a multiaddr"),
    (["--announce-maddrs", "/"], "--announce-maddrs '/': not a multiaddr"),
    (["--initial-peers", "/"], "--initial-peers '/': not a multiaddr"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmBad"], "--initial-peers '/ip4/127.0.0.1/tcp/1/p2p/QmBad'"),
    (["--device", "tpu"], "--device 'tpu': give cpu, cuda or cuda:N"),
    (["--device", "meta"], "--device 'meta': give cpu, cuda or cuda:N"),
])
def test_a_volunteers_bad_address_or_device_is_refused_before_anything_starts(tiny_model_dir, capsys, flags, message):
    """A port over 65535 ended in a traceback from bind(); the other addresses started the DHT's daemon, which refused
    them ("cannot join the swarm", exit 1); a device torch knows but the server cannot use (meta) was announced."""
    from petals_chain.server.__main__ import main

    assert main(["--model", str(tiny_model_dir), "--tau-p", "0.01", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_volunteer_reads_which_blocks_an_assignment_gives_and_what_a_move_costs():
    """The log said "assignment epoch 7: span (10, 5), max_length 2048": a start and a count read as a range, and
    nothing of the blocks it left or of the drain a move costs."""
    from petals_chain.server.server import assignment_news

    assert assignment_news(3, None, 2048, (10, 5), 2048) == (
        "the orchestrator's plan (epoch 3) assigns this server blocks [10, 15) (5 of them), sessions of up to "
        "2048 tokens")
    moved = assignment_news(4, (10, 5), 2048, (0, 8), 2048)
    assert "moves this server from blocks [10, 15) (5 of them) to blocks [0, 8) (8 of them)" in moved
    assert "draining open sessions, then reloading" in moved
    assert "instead of 2048" in assignment_news(5, (0, 8), 2048, (0, 8), 4096)
    assert "no blocks: unloading blocks [0, 8)" in assignment_news(6, (0, 8), 2048, None, 2048)
    assert assignment_news(7, None, 2048, None, 2048).endswith("gives this server no blocks yet")


def test_ctrl_c_before_the_server_handles_signals_exits_without_a_traceback(tiny_model_dir, capsys, monkeypatch):
    """Ctrl-C in the first seconds (imports, reading the model) printed a KeyboardInterrupt traceback."""
    from petals_chain.server import server
    from petals_chain.server.__main__ import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(server.Server, "__init__", interrupted)
    try:
        rc = main(["--model", str(tiny_model_dir), "--tau-p", "0.01"])
    except KeyboardInterrupt:  # escaping, it would stop the whole test run
        pytest.fail("Ctrl-C escaped main() as a KeyboardInterrupt (a traceback for the volunteer)")
    assert rc == 130
    assert "interrupted before joining the swarm" in capsys.readouterr().err
