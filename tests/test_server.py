"""Multi-process tests of the volunteer server on loopback: a fake orchestrator (this test) publishes the
signed assignment with SwarmDHT and relays activations hop by hop through real server processes."""

from __future__ import annotations

import asyncio
import time
import uuid

import psutil
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.records import AssignmentRecord
from petals_chain.swarm.rpc import (NoCapacityError, RemoteError, ServerClient, _await_next, _pack,
                                    serialize_chunks)

PREFIX = "tiny"
MAX_LENGTH = 64


def server_args(model, orch: SwarmDHT, *extra: str, memory_bytes: int = 50_000_000) -> list[str]:
    return ["--model", str(model), "--initial-peers", *orch.visible_maddrs(), "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0", "--dht-prefix", PREFIX, "--memory-bytes", str(memory_bytes),
            "--assignment-poll-s", "0.3", "--refresh-s", "2", "--tau-p", "0.01", "--no-progress", *extra]


def publish(orch: SwarmDHT, epoch: int, spans: dict[str, tuple[int, int]], max_length: int = MAX_LENGTH) -> None:
    asg = AssignmentRecord(epoch=epoch, max_length=max_length, orchestrator_peer_id=orch.peer_id,
                           assignments={p: [a, m] for p, (a, m) in spans.items()})
    # a DHT store can fail on a loaded host (no peer acknowledged it in time): the orchestrator re-publishes too
    assert any(orch.publish_assignment(PREFIX, asg, 120) for _ in range(3))


def wait_records(orch: SwarmDHT, peer_ids, predicate, timeout: float = 90.0) -> dict:
    deadline = time.time() + timeout
    recs = {}
    while time.time() < deadline:
        recs = orch.fetch_servers(PREFIX)
        if all(p in recs and predicate(recs[p]) for p in peer_ids):
            return recs
        time.sleep(0.25)
    raise TimeoutError(f"records did not reach the expected state: {recs}")


def wait_online(orch, peer_ids, epoch, timeout=90.0) -> dict:
    return wait_records(orch, peer_ids, lambda r: r.state == "online" and r.epoch == epoch, timeout)


def run(coro):
    return asyncio.run(coro)


async def with_client(orch: SwarmDHT, fn):
    p2p = await orch.replicate_p2p()
    try:
        return await fn(ServerClient(p2p, step_timeout_s=60))
    finally:
        await p2p.shutdown()


# ---------------------------------------------------------------- chains vs one process vs transformers

CHAINS = {
    # family: (server spans (start, num), chain hops (server index, start, end)) over a 4-layer model
    "llama": ([(0, 2), (1, 2), (3, 1)], [(0, 0, 2), (1, 2, 3), (2, 3, 4)]),
    "mistral": ([(0, 3), (2, 2)], [(0, 0, 2), (1, 2, 4)]),
    "qwen2": ([(0, 2), (2, 2)], [(0, 0, 2), (1, 2, 4)]),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CHAINS))
def test_chain_matches_local_layers_and_generate(family, tiny_model_factory, orchestrator_dht, server_procs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from petals_chain.server.runner import BlockRunner
    from petals_chain.swarm.checkpoint import load_head

    model = tiny_model_factory(family, num_layers=4)
    orch = orchestrator_dht
    spans, hops = CHAINS[family]
    procs = [server_procs(server_args(model, orch, "--public-name", f"{family}{i}")) for i in range(len(spans))]
    peers = [p.wait_peer_id() for p in procs]
    publish(orch, 1, {peers[i]: span for i, span in enumerate(spans)})
    wait_online(orch, peers, 1)

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = torch.tensor([tok("The quick brown fox jumps over")["input_ids"]])
    head = load_head(model, "float32")
    local = BlockRunner(model, 0, 4, num_slots=4, max_length=MAX_LENGTH, dtype="float32")
    local.allocate("ref", 0, 4)
    ref_prefill = local.forward("ref", head.embed(ids), 0)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    new_tokens = 8
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()

    async def relay(client: ServerClient):
        sessions = [await client.open_session(peers[i], f"job-{uuid.uuid4().hex[:8]}", a, b, MAX_LENGTH)
                    for i, a, b in hops]
        try:
            x, pos, out_tokens, prefill_out = head.embed(ids), 0, [], None
            for _ in range(new_tokens):
                h = x
                for sess in sessions:
                    h = await sess.step(h, pos)
                    assert sess.last_compute_s is not None and sess.last_compute_s > 0  # the server's own time
                if prefill_out is None:
                    prefill_out = h
                pos += x.shape[1]
                nxt = int(head.logits(h[:, -1]).argmax(-1))
                out_tokens.append(nxt)
                x = head.embed(torch.tensor([[nxt]]))
            return prefill_out, out_tokens
        finally:
            for sess in sessions:
                await sess.close()

    prefill_out, tokens = run(with_client(orch, relay))
    assert torch.allclose(prefill_out, ref_prefill, atol=1e-5, rtol=1e-4)
    assert tokens == expected, f"{family}: chain {tokens} != transformers {expected}"
    for p in procs:
        assert p.stop() == 0


# ---------------------------------------------------------------- one server: slots, refusals, malformed input

@pytest.fixture(scope="module")
def slot_server(tiny_model_factory, tmp_path_factory):
    """One server hosting blocks [0, 2) with M_j chosen for exactly 5 slots; idle timeout 4 s."""
    from conftest import ServerProcess
    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.memory import block_bytes, cache_slot_bytes

    model = tiny_model_factory("llama", num_layers=4)
    config = load_config(model)
    s_m, s_c = block_bytes(config, "float32"), cache_slot_bytes(config, "float32", MAX_LENGTH)
    memory = 2 * s_m + 5 * s_c + s_c // 2
    orch = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    workdir = tmp_path_factory.mktemp("slots")
    client_identity = str(workdir / "client.id")  # a second trusted client (for the killed-client test)
    P2P.generate_identity(client_identity)
    with open(client_identity, "rb") as f:
        client_peer = PeerID.from_identity(f.read()).to_base58()
    proc = ServerProcess(server_args(model, orch, "--idle-timeout-s", "4", "--trust-orchestrator", orch.peer_id,
                                     client_peer, memory_bytes=memory), workdir / "server.log")
    try:
        peer = proc.wait_peer_id()
        publish(orch, 1, {peer: (0, 2)})
        rec = wait_online(orch, [peer], 1)[peer]
        yield dict(orch=orch, peer=peer, model=model, record=rec, s_m=s_m, s_c=s_c, memory=memory, proc=proc,
                   client_identity=client_identity)
    finally:
        proc.kill()
        orch.shutdown()


def test_capacity_is_eq3_exactly(slot_server):
    rec, s_m, s_c, memory = slot_server["record"], slot_server["s_m"], slot_server["s_c"], slot_server["memory"]
    assert rec.slots_total == (memory - 2 * s_m) // s_c == 5
    assert rec.s_m_bytes == s_m and rec.s_c_bytes == s_c and rec.memory_bytes == memory
    assert (rec.start_block, rec.num_blocks, rec.max_length) == (0, 2, MAX_LENGTH)


def test_refusal_when_full_and_release(slot_server):
    peer = slot_server["peer"]

    async def scenario(client: ServerClient):
        a = await client.open_session(peer, "a", 0, 2, MAX_LENGTH)
        b = await client.open_session(peer, "b", 0, 2, MAX_LENGTH)
        with pytest.raises(NoCapacityError):
            await client.open_session(peer, "c", 0, 2, MAX_LENGTH)  # needs 2, 1 free
        c = await client.open_session(peer, "c", 1, 2, MAX_LENGTH)  # needs 1
        assert (await client.info(peer))["slots_free"] == 0
        with pytest.raises(NoCapacityError):
            await client.open_session(peer, "d", 1, 2, MAX_LENGTH)
        await c.close()
        assert (await client.info(peer))["slots_free"] == 1
        await a.close()
        await b.close()
        assert (await client.info(peer))["slots_free"] == 5

    run(with_client(slot_server["orch"], scenario))


def test_release_on_idle_timeout(slot_server):
    orch, peer = slot_server["orch"], slot_server["peer"]

    async def scenario(client: ServerClient):
        idle = await client.open_session(peer, "idle", 0, 2, MAX_LENGTH)
        await idle.step(torch.zeros(1, 1, 64), 0)
        assert (await client.info(peer))["slots_free"] == 3
        # Idle timeout (4 s): "idle" sends nothing more and gets its slots taken back.
        t0 = time.time()
        await wait_info(client, peer, lambda i: i["slots_free"] == 5, timeout=12)
        assert time.time() - t0 > 2.5
        with pytest.raises((RemoteError, ConnectionError)):
            await idle.step(torch.zeros(1, 1, 64), 1)
        # A step cancelled mid-flight (e.g. the orchestrator aborts a job) ends the stream: slots come back.
        sess = await client.open_session(peer, "cancelled", 0, 2, MAX_LENGTH)
        task = asyncio.ensure_future(sess.step(torch.randn(1, MAX_LENGTH, 64), 0))
        await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sess.closed
        await wait_info(client, peer, lambda i: i["slots_free"] == 5, timeout=10)
        with pytest.raises(RemoteError):
            await sess.step(torch.zeros(1, 1, 64), 0)

    run(with_client(orch, scenario))


def test_release_when_client_process_dies(slot_server, tmp_path, scaled):
    """A trusted client process holding a session is SIGKILLed (with its p2pd): its slots come back."""
    import subprocess
    import sys
    import textwrap

    orch, peer = slot_server["orch"], slot_server["peer"]
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from hivemind.p2p import P2P
        from petals_chain.swarm.rpc import ServerClient
        async def main():
            p2p = await P2P.create(initial_peers={orch.visible_maddrs()!r}, identity_path=sys.argv[1],
                                   host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            client = ServerClient(p2p, open_timeout_s={scaled(30)!r})
            for attempt in range(30):  # p2pd may not have found the server through its bootstrap peer yet
                try:
                    sess = await client.open_session({peer!r}, "doomed", 0, 2, {MAX_LENGTH})
                    break
                except ConnectionError as e:
                    if "failed to find any peer" not in str(e) or attempt == 29:
                        raise
                    await asyncio.sleep(1.0)
            print("OPEN", flush=True)
            while True:  # held, as a client between steps does: only the kill may end it (idle timeout 4 s)
                await sess.keepalive()
                await asyncio.sleep(1.0)
        asyncio.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script), slot_server["client_identity"]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output = b""
        while b"OPEN" not in output:  # readline returns b"" only at EOF: the client exited
            line = proc.stdout.readline()
            if not line:
                break
            output += line
        assert b"OPEN" in output, f"the client exited ({proc.wait(10)}) before opening:\n{output.decode()}"
        info = run(with_client(orch, lambda c: c.info(peer)))
        assert info["slots_free"] == 3
    finally:
        with_kill(proc)

    async def wait_free(client):
        return await wait_info(client, peer, lambda i: i["slots_free"] == 5, timeout=scaled(15))

    assert run(with_client(orch, wait_free))["slots_free"] == 5


def with_kill(proc):
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def test_untrusted_peer_refused_and_rogue_assignment_ignored(slot_server):
    orch, peer = slot_server["orch"], slot_server["peer"]
    rogue = SwarmDHT.create(initial_peers=orch.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        rogue.publish_assignment(PREFIX, AssignmentRecord(epoch=50, max_length=MAX_LENGTH,
                                                          orchestrator_peer_id=rogue.peer_id,
                                                          assignments={peer: [2, 2]}), 60)

        async def scenario(client: ServerClient):
            assert await client.ping(peer) < 5  # ping and info are public
            assert (await client.info(peer))["span"] == [0, 2]
            with pytest.raises(RemoteError) as err:
                await client.open_session(peer, "rogue", 0, 2, MAX_LENGTH)
            assert err.value.code == "untrusted"

        run(with_client(rogue, scenario))
        time.sleep(1.5)  # several assignment polls
        info = run(with_client(orch, lambda c: c.info(peer)))
        assert info["epoch"] == 1 and info["span"] == [0, 2] and info["reloads"] == 1
    finally:
        rogue.shutdown()


def test_malformed_messages_get_errors_and_change_nothing(slot_server):
    from petals_chain.server.runner import BlockRunner

    orch, peer, model = slot_server["orch"], slot_server["peer"], slot_server["model"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 64, generator=gen)
    x2 = torch.randn(1, 1, 64, generator=gen)
    local = BlockRunner(model, 0, 2, num_slots=2, max_length=MAX_LENGTH, dtype="float32")
    local.allocate("ref", 0, 2)
    ref1, ref2 = local.forward("ref", x, 0), local.forward("ref", x2, 3)

    def step_msg(tensor, position, **meta):
        chunks = serialize_chunks(tensor)
        return runtime_pb2.ExpertRequest(metadata=_pack({"op": "step", "position": position, **meta}),
                                         tensors=[chunks[0]])

    async def raw(sess, *msgs):
        for m in msgs:
            sess._queue.put_nowait(m)
        reply = await _await_next(sess._responses, 20, "raw")
        from petals_chain.swarm.rpc import _unpack

        return _unpack(reply.metadata)

    async def scenario(client: ServerClient):
        # Bad opens are refused and hold nothing.
        for args, code in [((0, 3), "invalid"), ((2, 2), "invalid"), ((1, 1), "invalid")]:
            with pytest.raises(RemoteError) as err:
                await client.open_session(peer, "bad", *args, MAX_LENGTH)
            assert err.value.code == code
        with pytest.raises(RemoteError):
            await client.open_session(peer, "bad", 0, 2, MAX_LENGTH + 1)  # longer than the slots
        sess = await client.open_session(peer, "m", 0, 2, MAX_LENGTH)
        with pytest.raises(RemoteError):
            await client.open_session(peer, "m", 0, 2, MAX_LENGTH)  # session id in use
        assert (await client.info(peer))["slots_free"] == 3

        bad_tensor_chunk = serialize_chunks(x)[0]
        bad_tensor_chunk.chunks = 3
        cases = [
            runtime_pb2.ExpertRequest(metadata=b"\xc1\xc1"),  # not msgpack
            runtime_pb2.ExpertRequest(metadata=_pack([1, 2])),  # not a map
            runtime_pb2.ExpertRequest(metadata=_pack({"op": "explode"})),
            runtime_pb2.ExpertRequest(metadata=_pack({"op": "step", "position": 0})),  # no tensor
            runtime_pb2.ExpertRequest(metadata=_pack({"op": "step", "position": 0, "pad": "x" * 5000})),
            step_msg(torch.randn(1, 3, 32), 0),  # wrong hidden size
            step_msg(torch.randn(2, 3, 64), 0),  # batch 2
            step_msg(torch.randn(3, 64), 0),  # 2-D
            step_msg(torch.ones(1, 3, 64, dtype=torch.int64), 0),  # integer dtype
            step_msg(torch.full((1, 3, 64), float("nan")), 0),  # NaN
            step_msg(x, 5),  # skips ahead of the cached prefix (0)
            step_msg(x, -1),  # negative position
            step_msg(x, "0"),  # position not an int
            runtime_pb2.ExpertRequest(metadata=_pack({"op": "step", "position": 0}), tensors=[bad_tensor_chunk]),
            step_msg(torch.randn(1, MAX_LENGTH + 1, 64), 0),  # longer than max_length
        ]
        for msg in cases:
            reply = await raw(sess, msg)
            assert reply["ok"] is False and reply["code"] == "invalid", (msg.metadata[:50], reply)
        # The 3-chunk case above left no stray chunks: the next valid step works and equals the local run.
        out1 = await sess.step(x, 0)
        assert torch.allclose(out1, ref1, atol=1e-5)
        reply = await raw(sess, step_msg(x2, 5))  # skip ahead again: error, cache untouched
        assert reply["code"] == "invalid"
        out2 = await sess.step(x2, 3)
        assert torch.allclose(out2, ref2, atol=1e-5)
        # A bf16 step is served too (activations travel as 2-byte bf16).
        out3 = await sess.step(x2.to(torch.bfloat16), 3)
        assert out3.dtype == torch.bfloat16 and torch.allclose(out3.float(), ref2, atol=0.1)
        await sess.close()
        assert (await client.info(peer))["slots_free"] == 5

    run(with_client(orch, scenario))


def test_large_prefill_is_chunked(slot_server):
    """A step split into many messages is reassembled; a bad first chunk does not desync the stream."""
    import petals_chain.swarm.rpc as rpc
    from petals_chain.server.runner import BlockRunner

    orch, peer, model = slot_server["orch"], slot_server["peer"], slot_server["model"]
    x = torch.randn(1, MAX_LENGTH, 64, dtype=torch.float32)
    local = BlockRunner(model, 0, 2, num_slots=2, max_length=MAX_LENGTH, dtype="float32")
    local.allocate("ref", 0, 2)
    ref = local.forward("ref", x, 0)

    async def scenario(client: ServerClient):
        old = rpc.CHUNK_BYTES
        rpc.CHUNK_BYTES = 4096  # client side: 4 messages of 4 KiB for this 16 KiB step
        try:
            assert len(serialize_chunks(x)) == 4
            sess = await client.open_session(peer, "big", 0, 2, MAX_LENGTH)
            with pytest.raises(RemoteError):  # wrong hidden size in an 8-chunk message: one error, chunks dropped
                await sess.step(torch.randn(1, 128, 32), 0)
            out = await sess.step(x, 0)
        finally:
            rpc.CHUNK_BYTES = old
        await sess.close()
        return out

    out = run(with_client(orch, scenario))
    assert torch.allclose(out, ref, atol=1e-5)


def test_concurrent_sessions_are_independent(slot_server):
    """Two jobs stepping at once (a long prefill and decode steps) each get their own, correct results."""
    from petals_chain.server.runner import BlockRunner

    orch, peer, model = slot_server["orch"], slot_server["peer"], slot_server["model"]
    gen = torch.Generator().manual_seed(2)
    long_prompt = torch.randn(1, 48, 64, generator=gen)
    short_prompt = torch.randn(1, 2, 64, generator=gen)
    tokens = [torch.randn(1, 1, 64, generator=gen) for _ in range(6)]
    local = BlockRunner(model, 0, 2, num_slots=4, max_length=MAX_LENGTH, dtype="float32")
    local.allocate("A", 0, 2)
    local.allocate("B", 0, 2)
    ref_a = local.forward("A", long_prompt, 0)
    local.forward("B", short_prompt, 0)
    ref_b = [local.forward("B", t, 2 + i) for i, t in enumerate(tokens)]

    async def scenario(client: ServerClient):
        a = await client.open_session(peer, "A", 0, 2, MAX_LENGTH)
        b = await client.open_session(peer, "B", 0, 2, MAX_LENGTH)
        await b.step(short_prompt, 0)

        async def decode():
            return [await b.step(t, 2 + i) for i, t in enumerate(tokens)]

        out_a, out_b = await asyncio.gather(a.step(long_prompt, 0), decode())
        await a.close()
        await b.close()
        return out_a, out_b

    out_a, out_b = run(with_client(orch, scenario))
    assert torch.allclose(out_a, ref_a, atol=1e-5)
    for got, want in zip(out_b, ref_b):
        assert torch.allclose(got, want, atol=1e-5)


# ---------------------------------------------------------------- assignment changes and shutdown

@pytest.mark.slow
def test_assignment_change_drain_reload_and_clean_shutdown(tiny_model_dir, orchestrator_dht, server_procs,
                                                          scaled):
    from conftest import p2pd_pids_of

    orch = orchestrator_dht
    proc = server_procs(server_args(tiny_model_dir, orch, "--drain-timeout-s", "30", "--emulate-rtt-ms", "60",
                                    "--emulate-compute-scale", "3"))
    peer = proc.wait_peer_id()
    publish(orch, 1, {peer: (0, 2)})
    rec = wait_online(orch, [peer], 1)[peer]
    # Emulation is visible in the record; tau_p (--tau-p 0.01) is announced scaled.
    assert rec.emulate_rtt_ms == 60.0 and rec.emulate_compute_scale == 3.0 and rec.tau_p == pytest.approx(0.03)

    async def scenario(client: ServerClient):
        # half the emulated RTT each way (less a little: asyncio wakes a sleeper up to its clock resolution early)
        assert await client.ping(peer) >= 0.058
        info = await client.info(peer)
        assert info["reloads"] == 1 and info["span"] == [0, 2]
        publish(orch, 2, {peer: (0, 2), "QmOtherServer": (2, 2)})  # same span for us: no reload
        await wait_info(client, peer, lambda i: i["epoch"] == 2)
        assert (await client.info(peer))["reloads"] == 1
        sess = await client.open_session(peer, "busy", 0, 2, MAX_LENGTH)
        t0 = time.perf_counter()
        await sess.step(torch.randn(1, 2, 64), 0)
        assert time.perf_counter() - t0 >= 0.058  # a session step crosses the emulated link both ways too
        publish(orch, 3, {peer: (2, 2)})  # new span: drain (the open session finishes), then reload
        await wait_info(client, peer, lambda i: i["state"] == "draining")
        with pytest.raises(RemoteError) as err:
            await client.open_session(peer, "late", 0, 2, MAX_LENGTH)
        assert err.value.code == "unavailable"
        await sess.step(torch.randn(1, 1, 64), 2)  # the draining session still works
        await sess.close()
        info = await wait_info(client, peer, lambda i: i["state"] == "online" and i["epoch"] == 3)
        assert info["reloads"] == 2 and info["span"] == [2, 2]
        s2 = await client.open_session(peer, "new", 2, 4, MAX_LENGTH)
        await s2.close()
        # The orchestrator restarts and counts epochs from 1 again: followed (newer), same span: no reload.
        publish(orch, 1, {peer: (2, 2)})
        info = await wait_info(client, peer, lambda i: i["epoch"] == 1)
        assert info["reloads"] == 2 and info["span"] == [2, 2] and info["state"] == "online"

    run(with_client(orch, scenario))
    rec = wait_records(orch, [peer], lambda r: r.epoch == 1)[peer]
    assert (rec.state, rec.start_block, rec.num_blocks) == ("online", 2, 2)

    p2pds = p2pd_pids_of([proc.proc.pid])
    assert p2pds, "expected the server's p2pd to be running"
    assert proc.stop(timeout=30) == 0
    assert orch.fetch_servers(PREFIX)[peer].state == "offline"

    def running() -> list[int]:
        out = []
        for p in p2pds:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    # the DHT process stops p2pd once it sees the server gone: polled, not a fixed 0.5 s (too short on a loaded host)
    deadline = time.monotonic() + scaled(10)
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()


async def wait_info(client: ServerClient, peer: str, predicate, timeout: float = 60.0) -> dict:
    deadline = time.time() + timeout
    info = {}
    while time.time() < deadline:
        info = await client.info(peer)
        if predicate(info):
            return info
        await asyncio.sleep(0.2)
    raise TimeoutError(f"server info never matched: {info}")
