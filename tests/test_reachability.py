"""Reachability (swarm/reachability.py): multiaddr encoding, the command-line address options, the orchestrator's
dial-back service on real hivemind P2P, and whole swarms on loopback where one server announces an address
nobody can dial (refused by the planner, told so at start) or joins through the orchestrator as a relay."""

import asyncio
import time

import pytest

from conftest import hf_greedy_from
from petals_chain.swarm.local import LocalServer, LocalSwarm, free_port, memory_for
from petals_chain.swarm.reachability import (PetalsChainFrontdoor, Prober, all_interfaces, ask_dial_back,
                                             circuit_maddrs, clean_maddrs, is_loopback, listen_and_announce,
                                             to_multiaddr)

PEER = "QmdvonHqWpd9t3zAe5MGHBmG7YsRLnmWQ3mTg5zDG7Yz3F"
PEER_ED = "12D3KooWNFdy6AHFdKGUt2ZtmVQq3KUwsx9JQ5muWVvZKo5jBWaC"


def test_multiaddrs_with_peer_ids_and_circuits_encode_as_the_daemon_reads_them():
    from hivemind.p2p import PeerID

    for peer in (PEER, PEER_ED):
        m = to_multiaddr(f"/ip4/10.0.0.1/tcp/31337/p2p/{peer}/p2p-circuit")
        raw = m.to_bytes()
        digest = PeerID.from_base58(peer).to_bytes()
        # /p2p/ carries the raw multihash (what go-multiaddr parses), and p2p-circuit (290) has no value
        assert digest in raw and raw.endswith(bytes([0xA2, 0x02]))
    assert circuit_maddrs([f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}", "/ip4/1.2.3.4/tcp/6"]) == [
        f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}/p2p-circuit"]
    assert is_loopback("/ip4/127.0.0.1/tcp/1") and is_loopback("/ip6/::1/tcp/1")
    assert not is_loopback("/ip4/10.0.0.1/tcp/1") and not is_loopback("/dns4/localhost/tcp/1")
    for bad in ("", "ip4/1.2.3.4", "/ip4/999.1.1.1/tcp/1", "/p2p", "/ip4/1.2.3.4/tcp/1/p2p/notbase58!", "/" + "x" * 400):
        with pytest.raises(ValueError):
            to_multiaddr(bad)
    with pytest.raises(ValueError):
        clean_maddrs("/ip4/1.2.3.4/tcp/1")
    with pytest.raises(ValueError):
        clean_maddrs([1, 2])
    assert len(clean_maddrs(["/ip4/1.2.3.4/tcp/1"] * 20)) == 8


def test_public_ip_and_announce_options():
    host, announce = listen_and_announce(["/ip4/127.0.0.1/tcp/0"], [], "203.0.113.7", 31337)
    assert host == ["/ip4/0.0.0.0/tcp/31337"] and announce == ["/ip4/203.0.113.7/tcp/31337"]
    host, announce = listen_and_announce([], [], "203.0.113.7", 0)  # a free port, the same in both
    assert host[0].split("/")[-1] == announce[0].split("/")[-1] != "0"
    assert listen_and_announce(["/ip4/0.0.0.0/tcp/0"], [], None, 4000) == (all_interfaces(4000), [])  # + IPv6
    assert listen_and_announce(["/ip4/1.2.3.4/tcp/0"], [], None, 0) == (["/ip4/1.2.3.4/tcp/0"], [])
    for args in ((["/ip4/0.0.0.0/tcp/0"], [], "not-an-ip", 0), (["/ip4/0.0.0.0/tcp/0"], ["/ip4/1.2.3.4/tcp/0"], None, 0),
                 (["/ip4/0.0.0.0/tcp/0"], [], None, 70000), (["/ip4/0.0.0.0/tcp/0"], ["garbage"], None, 0)):
        with pytest.raises(ValueError):
            listen_and_announce(*args)


def test_a_port_something_listens_on_is_refused():
    """p2pd binds with SO_REUSEPORT: a second server given the same --p2p-port started silently and the kernel split
    incoming connections between the two. A listener there (with SO_REUSEPORT, as p2pd) is now an error."""
    import socket

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} is in use"):
            listen_and_announce([], [], None, port)
        with pytest.raises(ValueError, match="in use"):
            listen_and_announce([], [], "203.0.113.7", port)
    assert listen_and_announce([], [], None, port) == (all_interfaces(port), [])  # closed: free again


def test_server_and_orchestrator_cli_refuse_bad_addresses(tmp_path):
    from petals_chain.orchestrator.__main__ import main as orchestrator_main
    from petals_chain.server.__main__ import main as server_main

    assert server_main(["--model", str(tmp_path), "--public-ip", "nope"]) == 2
    assert server_main(["--model", str(tmp_path), "--announce-maddrs", "/ip4/1.2.3.4/tcp/0"]) == 2
    with pytest.raises(SystemExit) as e:
        orchestrator_main(["--model", str(tmp_path), "--ssl-certfile", str(tmp_path / "missing.pem")])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        orchestrator_main(["--model", str(tmp_path), "--p2p-port", "99999", "--public-ip", "1.2.3.4"])
    assert e.value.code == 2
    for bad in (["--public-url", "ftp://x"], ["--public-url", "http://"], ["--group-with", "not-a-peer-id"],
                ["--group-with", "notapeerid"]):  # base58, which hivemind's from_base58 alone took
        with pytest.raises(SystemExit) as e:
            orchestrator_main(["--model", str(tmp_path), *bad])
        assert e.value.code == 2, bad


def test_dial_back_service_dials_only_the_caller_and_only_where_it_says(scaled):
    from hivemind.p2p import P2P

    async def scenario():
        orch = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        prober = Prober(timeout_s=5.0)
        # the rate limit counts from a dial-back's arrival: the one asked right after a dial must come within it,
        # and a dial (a daemon started) took 0.6-0.8 s with the cores busy, past a fixed 0.5 s
        interval_s = max(1.0, scaled(0.5))
        await PetalsChainFrontdoor(prober, interval_s=interval_s).add_p2p_handlers(orch)
        orch_id = orch.peer_id.to_base58()
        server = await P2P.create(initial_peers=[str(m) for m in await orch.get_visible_maddrs()],
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            mine = [str(m) for m in await server.get_visible_maddrs()]
            ok, maddr, error = await ask_dial_back(server, orch_id, mine)
            assert ok and maddr == mine[0] and not error
            await asyncio.sleep(interval_s + 0.1)
            # a port with nothing behind it: refused, although the caller is connected to us (a fresh dial)
            # (the asker is told that no address answered, not how each failed: a port scan otherwise)
            ok, _, error = await ask_dial_back(server, orch_id, [f"/ip4/127.0.0.1/tcp/{free_port()}"])
            assert not ok and "none of the announced addresses answered" in error and "refused" not in error
            with pytest.raises(ConnectionError, match="one dial-back per"):  # rate limit per caller
                await ask_dial_back(server, orch_id, mine)
            await asyncio.sleep(interval_s + 0.1)
            with pytest.raises(ConnectionError, match="refused"):
                await ask_dial_back(server, orch_id, ["not a multiaddr"])
            # a listening address of *another* peer: its handshake proves the wrong identity, so not reachable
            await asyncio.sleep(interval_s + 0.1)
            ok, _, error = await ask_dial_back(server, orch_id, [str(m) for m in await orch.get_visible_maddrs()])
            assert not ok and error
            assert prober.checks == 3
        finally:
            await server.shutdown()
            await orch.shutdown()

    asyncio.run(scenario())


def test_a_caller_leaving_mid_dial_leaves_no_daemon_behind():
    """A server killed (or timing out) while the orchestrator dials it back cancels the dial-back handler; the dial's
    own daemon must still be shut down (hivemind leaves a daemon cancelled mid-start running), and nothing is logged
    as a task exception nobody retrieved."""
    import gc
    import logging

    import psutil
    from hivemind.p2p import P2P

    def p2pds() -> set[int]:
        out = set()
        for c in psutil.Process().children(recursive=True):
            try:
                if "p2pd" in c.name():
                    out.add(c.pid)
            except psutil.NoSuchProcess:  # a child (of any test's) that ended between the listing and the read
                pass
        return out

    async def scenario() -> tuple[int, set[int]]:
        """-> (dials begun, prober daemons still running 20 s after the callers left)"""
        orch = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        prober = Prober(timeout_s=5.0)
        await PetalsChainFrontdoor(prober, interval_s=0.0).add_p2p_handlers(orch)
        server = await P2P.create(initial_peers=[str(m) for m in await orch.get_visible_maddrs()],
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            before = p2pds()
            mine = [str(m) for m in await server.get_visible_maddrs()]
            for _ in range(3):  # gone while the prober's daemon starts (~0.3 s)
                with pytest.raises(ConnectionError):
                    await ask_dial_back(server, orch.peer_id.to_base58(), mine, timeout_s=0.05)
            deadline = time.monotonic() + 20
            while (prober.checks < 3 or p2pds() - before) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            gc.collect()
            await asyncio.sleep(0.5)
            return prober.checks, p2pds() - before
        finally:
            await server.shutdown()
            await orch.shutdown()

    records: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.ERROR)
    logging.getLogger("asyncio").addHandler(handler)
    try:
        checks, left = asyncio.run(scenario())
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert checks == 3, "the dial-backs did not begin before their callers left"
    assert not left, f"prober daemons left running: {sorted(left)}"
    unretrieved = [r.getMessage()[:200] for r in records if "never retrieved" in r.getMessage()]
    assert not unretrieved, unretrieved


@pytest.mark.slow
def test_unreachable_server_is_told_and_not_planned_and_a_relayed_one_serves(tiny_model_dir, tmp_path, scaled):
    mem = memory_for(tiny_model_dir, 64, blocks=2, slots_per_block=4)  # each holds half of the 4 blocks
    dead_port = free_port()
    servers = [LocalServer("direct", mem, tau_p=0.01),
               # announces an address nobody listens on and may not relay: told at start, never planned
               LocalServer("wrong", mem, tau_p=0.01, extra_args=["--announce-maddrs", f"/ip4/127.0.0.1/tcp/{dead_port}",
                                                                 "--nat-relay", "never"])]
    with LocalSwarm(tiny_model_dir, servers, max_length=64, log_dir=tmp_path) as swarm:
        st = swarm.wait_until(lambda st: {s["public_name"]: s["reachability"] for s in st["servers"]}
                              == {"direct": "direct", "wrong": "unreachable"}, scaled(120), "reachability checks")
        wrong = next(s for s in st["servers"] if s["public_name"] == "wrong")
        # the public state says that no address answered, not how each failed (a port scan of the orchestrator's
        # network otherwise); the orchestrator's log has the details
        assert wrong["assigned"] is None and "none of the announced addresses" in wrong["reachability_error"]
        assert str(dead_port) not in wrong["reachability_error"]
        assert f"/tcp/{dead_port}" in (tmp_path / "orchestrator.log").read_text()
        assert not st["ready"]  # half the model is not enough
        log = (tmp_path / "server-wrong.log").read_text()
        assert "NOT REACHABLE" in log and f"/tcp/{dead_port}" in log and "not given blocks" in log
        time.sleep(scaled(3))  # re-checked, still not planned
        assert next(s for s in swarm.swarm()["servers"] if s["public_name"] == "wrong")["assigned"] is None

        # The same address problem with relaying allowed: it joins through the orchestrator and serves.
        swarm.add_server(LocalServer("relayed", mem, tau_p=0.01,
                                     extra_args=["--announce-maddrs", f"/ip4/127.0.0.1/tcp/{dead_port}"]))
        st = swarm.wait_until(lambda st: st["ready"] and any(
            s["public_name"] == "relayed" and s["reachability"] == "relayed" and s["assigned"] and s["state"] == "online"
            for s in st["servers"]), scaled(180), "the relayed server to serve")
        relayed = next(s for s in st["servers"] if s["public_name"] == "relayed")
        assert relayed["maddrs"] and all("/p2p-circuit" in m for m in relayed["maddrs"])
        assert "relaying through the orchestrator" in (tmp_path / "server-relayed.log").read_text()
        prompt = [1, 5, 9, 13, 2, 7]
        c = swarm.client().complete(prompt, max_tokens=8)
        assert c.token_ids == hf_greedy_from(tiny_model_dir, prompt, 8)
        assert relayed["peer_id"] in c.chain and len(c.chain) == 2  # the relayed hop computed its blocks


def _self_signed(tmp_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_https_api_with_a_certificate(tiny_model_dir, tmp_path, scaled):
    import httpx

    cert, key = _self_signed(tmp_path)
    swarm = LocalSwarm(tiny_model_dir, [], max_length=64, log_dir=tmp_path,
                       orchestrator_args=["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    try:
        swarm.start_orchestrator(timeout=scaled(120))
        assert swarm.url.startswith("https://127.0.0.1:")
        r = httpx.get(f"{swarm.url}/v1/models", verify=str(cert), timeout=10)
        assert r.status_code == 200 and r.json()["data"]
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused by a verifying client
            httpx.get(f"{swarm.url}/healthz", timeout=10)
        with pytest.raises(httpx.HTTPError):  # and plain HTTP gets nothing
            httpx.get(swarm.url.replace("https://", "http://") + "/healthz", timeout=10)
    finally:
        swarm.stop()


def test_an_identity_path_with_a_tilde_is_the_home_directorys(tmp_path, monkeypatch):
    """Every role's ``--identity-path`` (the orchestrator's, the dashboard's: ``SwarmDHT.create``) given as
    ``--identity-path=~/x`` or quoted: the key went to ``./~/x`` (a new peer id when started from elsewhere, or no
    start at all without a ``./~``)."""
    from petals_chain.swarm.dht import SwarmDHT

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    node = SwarmDHT.create(identity_path="~/orch.key", host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        assert (home / "orch.key").is_file() and not (cwd / "~").exists()
    finally:
        node.shutdown()
