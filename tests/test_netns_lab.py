"""The network-namespace testbed of scripts/netns_swarm.py: plain hosts, a NAT'd host, teardown (close, the
watchdog after the owner is SIGKILLed, sweep_stale). Network plumbing only (no model, no hivemind); needs root
and iproute2 (nftables for the NAT tests), else skips with the reason. About 10 s."""

import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns_swarm.py"
_spec = importlib.util.spec_from_file_location("_netns_swarm", SCRIPT)
nl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nl
_spec.loader.exec_module(nl)

PORT = 7070


# ------------------------------------------------------------------------------------------------ helpers


def _require_netns():
    ok, why = nl.available()
    if not ok:
        pytest.skip(why)


def _require_nat():
    _require_netns()
    ok, why = nl.nat_available()
    if not ok:
        pytest.skip(why)


def _lab_netns(lab_id):
    return [n for n in nl._netns_names() if n.startswith(lab_id)]


def _lab_links(lab_id):
    return [e["ifname"] for e in nl._json(nl._ip("-j", "link", "show").stdout) if e["ifname"].startswith(lab_id)]


def _gone(lab_id):
    return not _lab_netns(lab_id) and not _lab_links(lab_id) and not nl._state_path(lab_id).exists()


def _pid_dead(pid):
    return nl._proc_start(pid) is None  # gone, or a zombie waiting to be reaped


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def _root_snapshot():
    """What a lab must never change in the root namespace: its default route(s) and its nftables ruleset."""
    routes = nl._json(nl._ip("-j", "route", "show").stdout)
    defaults = [r for r in routes if r.get("dst") == "default"]
    ruleset = nl._cmd(["nft", "list", "ruleset"], check=False).stdout if nl.shutil.which("nft") else ""
    return defaults, ruleset


_CHILD = textwrap.dedent("""
    import importlib.util, json, subprocess, sys, time
    spec = importlib.util.spec_from_file_location("_netns_swarm", sys.argv[1])
    nl = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = nl
    spec.loader.exec_module(nl)
    lab = nl.NetnsLab(tag="pytest-child", watchdog=sys.argv[2] == "1")
    h = lab.add_host("h")
    p = lab.popen(h, ["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(json.dumps({"id": lab.id, "netns": h.name, "sleeper": p.pid}), flush=True)
    time.sleep(600)
""")


@contextlib.contextmanager
def _child_lab(watchdog):
    """A child python that owns a lab (one host running `sleep`) and then sleeps; yields (child, info)."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(SCRIPT), "1" if watchdog else "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    info = None
    try:
        ready, _, _ = select.select([child.stdout], [], [], 20)
        line = child.stdout.readline() if ready else ""
        if not line:
            child.kill()
            pytest.fail(f"child lab did not start: {child.stderr.read()}")
        info = json.loads(line)
        assert _lab_netns(info["id"]) == [info["netns"]]
        yield child, info
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
        if info is not None:  # whatever the test's outcome, leave nothing behind
            nl._teardown(info["id"])


# ------------------------------------------------------------------------------------------------ the shared lab


@pytest.fixture(scope="module")
def lab():
    _require_netns()
    with nl.NetnsLab(tag="pytest") as lab:
        yield lab


@pytest.fixture(scope="module")
def hosts(lab):
    """Plain hosts a, b (each running the probe server) and, where NAT works, a NAT host n (also serving)."""
    a, b = lab.add_host("a"), lab.add_host("b")
    n = lab.add_nat_host("n") if nl.nat_available()[0] else None
    with contextlib.ExitStack() as stack:
        for h in (a, b, n):
            if h is not None:
                stack.enter_context(nl.tcp_server(lab, h, PORT))
        yield {"a": a, "b": b, "n": n}


@pytest.fixture
def nat(hosts):
    _require_nat()
    return hosts["n"]


def test_names_and_addresses(lab, hosts):
    a, b = hosts["a"], hosts["b"]
    assert lab.id.startswith("pcl") and len(lab.id) == nl.ID_LEN
    assert str(lab.subnet).startswith("10.213.") and lab.subnet.prefixlen == 24
    assert lab.gateway == str(lab.subnet.network_address + 1)
    assert {a.ip, b.ip} <= {str(i) for i in lab.subnet.hosts()} and a.ip != b.ip != lab.gateway
    assert a.public_ip == a.ip and not a.nat
    for name in nl._netns_names():
        if name.startswith(lab.id):
            assert name.startswith(lab.id + "-")
    links = _lab_links(lab.id)
    assert lab.bridge in links and all(len(n) <= 15 for n in links)
    # the bridge is the root namespace's only address in the lab
    addrs = nl._json(nl._ip("-j", "-4", "addr", "show", "dev", lab.bridge).stdout)
    assert [i["local"] for i in addrs[0]["addr_info"]] == [lab.gateway]
    # plain hosts: no default route, only their /24
    routes = nl._json(nl._ip("-j", "route", "show", netns=a.name).stdout)
    assert [r["dst"] for r in routes] == [str(lab.subnet)]


def test_plain_host_reaches_plain_host(lab, hosts):
    a, b = hosts["a"], hosts["b"]
    assert nl.tcp_probe(lab, a, b.ip, PORT) == nl.Probe(True, peer=a.ip)


def test_root_namespace_reaches_host(lab, hosts):
    assert nl.tcp_probe(None, None, hosts["a"].ip, PORT) == nl.Probe(True, peer=lab.gateway)


def test_nat_host_connects_out_as_its_router(lab, hosts, nat):
    assert nat.nat and nat.ip.startswith("192.168.") and nat.public_ip in {str(i) for i in lab.subnet.hosts()}
    assert nl.tcp_probe(lab, nat, hosts["a"].ip, PORT) == nl.Probe(True, peer=nat.public_ip)


def test_nothing_reaches_into_the_nat_home(lab, hosts, nat):
    a = hosts["a"]
    assert nl.tcp_probe(lab, nat, nat.ip, PORT).ok  # the home server is up: the refusals below are the network's
    no_route = nl.tcp_probe(lab, a, nat.ip, PORT)
    assert not no_route.ok, no_route
    no_forward = nl.tcp_probe(lab, a, nat.public_ip, PORT)
    assert not no_forward.ok and "refused" in no_forward.error.lower(), no_forward
    # a host that routes the private subnet via the router directly is stopped by the router's forward filter
    nl._ip("route", "add", nat.subnet, "via", nat.public_ip, netns=a.name)
    try:
        filtered = nl.tcp_probe(lab, a, nat.ip, PORT, timeout=1.0)
    finally:
        nl._ip("route", "del", nat.subnet, "via", nat.public_ip, netns=a.name)
    assert not filtered.ok, filtered


def test_run_checks_all_pass(lab, hosts):
    _require_nat()
    checks = nl.run_checks(lab, port=PORT + 1, timeout=1.0)
    assert len(checks) == 7
    assert all(c.ok for c in checks), "\n".join(f"{c.name}: {c.detail}" for c in checks if not c.ok)


def test_popen_new_session_and_kill_host(lab, hosts):
    k = lab.add_host("k")
    p = lab.popen(k, ["sleep", "60"])
    try:
        assert os.getsid(p.pid) == p.pid
        r = lab.run(k, ["cat", "/proc/self/net/dev"], capture_output=True, text=True, check=True)
        assert f"{lab.id}w" in r.stdout and "eth0" not in r.stdout  # really inside the namespace
        assert p.pid in nl._netns_pids(k.name)
        lab.kill_host(k)
        assert p.wait(timeout=5) == -signal.SIGKILL
        assert nl._netns_pids(k.name) == []
        assert nl.tcp_probe(lab, hosts["a"], hosts["b"].ip, PORT).ok  # the other hosts are untouched
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_ip_failure_raises_with_command_and_stderr():
    _require_netns()
    with pytest.raises(nl.LabError) as e:
        nl._ip("link", "del", "pclnosuchdev0")
    assert "ip link del pclnosuchdev0" in str(e.value) and "Cannot find device" in str(e.value)


def test_bad_host_names_refused(lab):
    with pytest.raises(ValueError):
        lab.add_host("a b")
    with pytest.raises(ValueError):
        lab.add_host("x" * 33)


# ------------------------------------------------------------------------------------------------ teardown


def test_close_removes_everything_and_is_idempotent():
    _require_netns()
    before = _root_snapshot()
    with nl.NetnsLab(tag="pytest-close") as lab:
        h = lab.add_host("h")
        nat = lab.add_nat_host("n") if nl.nat_available()[0] else None
        p = lab.popen(nat or h, ["sleep", "60"])
        assert len(_lab_netns(lab.id)) == (3 if nat else 1)
        assert _root_snapshot() == before  # default route and firewall of the root ns untouched
        other = nl.NetnsLab(tag="pytest-other")  # labs coexist: own id, own subnet
        try:
            assert other.id != lab.id and not other.subnet.overlaps(lab.subnet)
        finally:
            other.close()
        assert _gone(other.id) and _lab_netns(lab.id)
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert _gone(lab.id)
    lab.close()  # idempotent
    assert _root_snapshot() == before
    with pytest.raises(nl.LabError):
        lab.add_host("late")


def test_watchdog_tears_down_after_owner_sigkill(scaled):
    _require_netns()
    with _child_lab(watchdog=True) as (child, info):
        os.kill(child.pid, signal.SIGKILL)
        assert _wait(lambda: _gone(info["id"]), scaled(10)), f"lab {info['id']} still there: {_lab_netns(info['id'])}"
        assert _wait(lambda: _pid_dead(info["sleeper"]), 5)


def test_sweep_stale_removes_labs_of_dead_owners(scaled):
    _require_netns()
    with _child_lab(watchdog=False) as (child, info):
        assert [s["alive"] for s in nl.list_labs() if s["id"] == info["id"]] == [True]
        assert info["id"] not in nl.sweep_stale()  # a live owner's lab stays
        # Every new lab sweeps first (test_netns_swarm's, on the other xdist worker): it may remove this one as soon
        # as its owner is dead. Its teardown waits for the lock held here; after it, whichever sweep comes first.
        with nl._global_lock():
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            assert _lab_netns(info["id"])  # no watchdog: still there
            assert [s["alive"] for s in nl.list_labs() if s["id"] == info["id"]] == [False]
        swept = nl.sweep_stale()
        assert info["id"] in swept or not nl._state_path(info["id"]).exists(), swept
        assert _gone(info["id"])
        assert _wait(lambda: _pid_dead(info["sleeper"]), 5)
