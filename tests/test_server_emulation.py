"""Emulation as wrappers around the real serving path, and the test-only faults for chaos runs.

* With every knob off, a server serves its plain session service over plain BlockRunners (nothing wrapped).
* ``--emulate-reply-fault nan|shape`` at ``--emulate-reply-fault-rate P`` corrupts that fraction of step
  replies (the server's own state stays right); ``--emulate-tau-p-lie X`` announces tau_p X times better.
  Both show in the server record (a real process read from a stand-in orchestrator's DHT node).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from petals_chain.server.emulated import EmulatedDelays, EmulatedRunner, FaultyReplies
from petals_chain.server.runner import BlockRunner
from petals_chain.server.server import Server, ServerConfig
from petals_chain.server.sessions import SessionService
from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.emulation import Emulation
from petals_chain.swarm.records import AssignmentRecord
from petals_chain.swarm.rpc import ServerClient, _await_next, _pack, _unpack, serialize_chunks

PREFIX = "emu"
MAX_LENGTH = 64


def test_no_emulation_means_no_wrappers(tiny_model_dir):
    plain = Server(ServerConfig(model=str(tiny_model_dir)))
    assert not plain.emulation.active
    assert type(plain.backend) is SessionService and plain._make_runner is BlockRunner
    emulated = Server(ServerConfig(model=str(tiny_model_dir), emulate_compute_scale=2.0, emulate_decode_ms=5.0,
                                   emulate_reply_fault="shape", emulate_reply_fault_rate=0.1))
    assert isinstance(emulated.backend, FaultyReplies) and isinstance(emulated.backend.inner, EmulatedDelays)
    assert emulated.backend.inner.inner is emulated.service
    assert emulated._make_runner.func is EmulatedRunner and emulated._make_runner.keywords == {"compute_scale": 2.0}
    # knobs that change nothing on the serving path wrap nothing
    lying = Server(ServerConfig(model=str(tiny_model_dir), emulate_tau_p_lie=3.0, emulate_rtt_ms=10.0,
                                emulate_reply_fault="nan", emulate_reply_fault_rate=0.0))
    assert type(lying.backend) is SessionService and lying._make_runner is BlockRunner
    assert lying.emulation.active


def test_footnote11_delay_model():
    emu = Emulation(step_ms=10.0, prefill_ms_per_token=2.0, decode_ms=4.0)
    assert emu.step_delay_s(True, 3, 5) == pytest.approx((10 + 2 * 5) * 3 / 1000)  # first step: t_o + t_I l_I
    assert emu.step_delay_s(False, 3, 1) == pytest.approx(4 * 3 / 1000)  # decode: t_O per block
    assert Emulation().step_delay_s(True, 8, 100) == 0.0


class _Echo:
    """A stand-in session backend: every step returns its input."""

    hidden_size = 8

    async def forward(self, session_id, hidden, position):
        return hidden

    def info(self):
        return {}


@pytest.mark.parametrize("rate, faulty", [(1.0, list(range(1, 9))), (0.5, [2, 4, 6, 8]), (0.25, [4, 8]),
                                          (1 / 3, [3, 6]), (0.0, [])])
def test_reply_faults_are_evenly_spread(rate, faulty):
    nan = FaultyReplies(_Echo(), Emulation(reply_fault="nan", reply_fault_rate=rate))
    shape = FaultyReplies(_Echo(), Emulation(reply_fault="shape", reply_fault_rate=rate))
    x = torch.randn(1, 3, 8)
    got_nan, got_shape = [], []
    for k in range(1, 9):
        out = asyncio.run(nan.forward("s", x, 0))
        if not torch.isfinite(out).all():
            assert torch.isnan(out[:, -1]).all() and torch.equal(out[:, :-1], x[:, :-1])  # only the last token
            got_nan.append(k)
        else:
            assert torch.equal(out, x)
        out = asyncio.run(shape.forward("s", x, 0))
        if out.shape != x.shape:
            assert list(out.shape) == [1, 3, 7] and torch.equal(out, x[..., :-1])
            got_shape.append(k)
    assert got_nan == faulty and got_shape == faulty
    assert nan.info()["faulty_replies"] == len(faulty)


def test_emulation_knobs_validated():
    for bad in (dict(reply_fault="zeros"), dict(reply_fault_rate=1.5), dict(reply_fault_rate=float("nan")),
                dict(tau_p_lie=0.0), dict(tau_p_lie=float("inf")), dict(decode_ms=-1.0)):
        with pytest.raises(ValueError, match="emulate_"):
            Emulation(**bad)
    assert Emulation(compute_scale=2.0, tau_p_lie=4.0).announced_tau_p(0.02) == pytest.approx(0.01)


@pytest.mark.slow
def test_faulty_and_lying_server_shows_it_and_misbehaves(tiny_model_dir, orchestrator_dht, server_procs, scaled):
    orch: SwarmDHT = orchestrator_dht
    proc = server_procs(["--model", str(tiny_model_dir), "--initial-peers", *orch.visible_maddrs(),
                         "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--dht-prefix", PREFIX, "--memory-bytes",
                         "50000000", "--assignment-poll-s", "0.3", "--refresh-s", "2", "--no-progress",
                         "--tau-p", "0.03", "--emulate-reply-fault", "nan", "--emulate-reply-fault-rate", "0.5",
                         "--emulate-tau-p-lie", "3"])
    peer = proc.wait_peer_id(timeout=scaled(60))
    assert orch.publish_assignment(PREFIX, AssignmentRecord(epoch=1, max_length=MAX_LENGTH,
                                                            orchestrator_peer_id=orch.peer_id,
                                                            assignments={peer: [0, 2]}), 120)
    deadline = time.time() + scaled(60)
    rec = None
    while time.time() < deadline and not (rec is not None and rec.state == "online"):
        time.sleep(0.25)
        rec = orch.fetch_servers(PREFIX).get(peer)
    assert rec is not None and rec.state == "online", proc.log()[-3000:]
    assert (rec.emulate_reply_fault, rec.emulate_reply_fault_rate, rec.emulate_tau_p_lie) == ("nan", 0.5, 3.0)
    assert rec.tau_p == pytest.approx(0.01)  # measured (--tau-p) 0.03, announced 3x better

    ref = BlockRunner(tiny_model_dir, 0, 2, num_slots=2, max_length=MAX_LENGTH, dtype="float32", progress=False)
    ref.allocate("ref", 0, 2)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 5, 64, generator=g)] + [torch.randn(1, 1, 64, generator=g) for _ in range(7)]

    async def raw_step(sess, x: torch.Tensor, position: int) -> torch.Tensor:
        """A step read off the stream as it comes (the client's own checks would refuse a faulty reply)."""
        (chunk,) = serialize_chunks(x)
        sess._queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({"op": "step", "position": position}),
                                                         tensors=[chunk]))
        reply = await _await_next(sess._responses, scaled(60), "step")
        assert _unpack(reply.metadata)["ok"] and len(reply.tensors) == 1 and reply.tensors[0].chunks <= 1
        return deserialize_torch_tensor(reply.tensors[0])

    async def steps(client: ServerClient):
        sess = await client.open_session(peer, "s", 0, 2, MAX_LENGTH)
        outs, pos = [], 0
        for x in inputs:  # fresh inputs: a NaN reply is never fed back (the next hop would refuse it)
            outs.append(await raw_step(sess, x, pos))
            pos += x.shape[1]
        info = await client.info(peer)
        await sess.close()
        return outs, info

    async def with_client():
        p2p = await orch.replicate_p2p()
        try:
            return await steps(ServerClient(p2p, step_timeout_s=scaled(60)))
        finally:
            await p2p.shutdown()

    outs, info = asyncio.run(with_client())
    pos, faulty = 0, []
    for k, (x, out) in enumerate(zip(inputs, outs), start=1):
        want = ref.forward("ref", x, pos)
        pos += x.shape[1]
        assert out.shape == want.shape
        if not torch.isfinite(out).all():
            faulty.append(k)
            assert torch.isnan(out[:, -1]).all()
            out = out[:, :-1]
            want = want[:, :-1]
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)  # the server's state stays right
    assert faulty == [2, 4, 6, 8] and info["faulty_replies"] == 4
    assert info["tau_p"] == pytest.approx(0.01) and info["emulate_tau_p_lie"] == 3.0
    assert proc.stop(timeout=scaled(60)) == 0
