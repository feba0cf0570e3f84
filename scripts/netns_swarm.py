"""A multi-host testbed on one Linux machine, built from network namespaces (root only, standard library only).

A *lab* is a private "internet": a /24 **wan** subnet (``10.213.X.0/24``, X picked so that it collides with no
route on the machine and no other live lab) carried by a Linux bridge in the ROOT namespace, which holds the
subnet's ``.1`` so the controlling process (a test, a benchmark) reaches every host by IP. Hosts are namespaces
plugged into the bridge by veth pairs::

      root ns: bridge <id>br 10.213.X.1/24 -- the only thing the lab adds to the root namespace (plus the
         |   |   |                            bridge's veth ports, which carry no address)
         |   |   +-- <id>-nat-rtr  10.213.X.4  router: forwards, masquerades out of its wan leg, drops new
         |   |            |                    inbound connections (no port forwards)
         |   |        <id>-nat     192.168.K.2 home ns, default route via the router (192.168.K.1)
         |   +------ <id>-b        10.213.X.3
         +---------- <id>-a        10.213.X.2   (plain hosts: lo + their wan address, no default route)

The root namespace's default route and firewall are never touched.

Every namespace and link name starts with the lab's id (``pcl`` + 4 hex digits, 7 characters, so link names
stay within Linux's 15 characters), so several labs coexist. A lab's state (owner pid, subnet, names) lives in
``/run/petals-chain-netns/<id>.json`` (``/tmp/petals-chain-netns`` where /run is not writable), written before
each namespace or link is created, so a lab can always be found and removed again:

* :meth:`NetnsLab.close` (also ``with NetnsLab() as lab:``) kills every process in the lab's namespaces and
  deletes them and the bridge; idempotent.
* A watchdog child (``python scripts/netns_swarm.py reap <id>``, in its own session) holds a pipe from the
  controlling process; when the pipe reaches EOF or the owner pid is gone (the owner crashed, even by SIGKILL)
  it tears the lab down.
* :func:`sweep_stale` removes the labs whose owner is dead (run by every new lab, and by ``sweep``).

API::

    ok, why = available()                       # can namespaces be made here? (reason for pytest skips)
    with NetnsLab() as lab:
        a = lab.add_host("a")                   # Host(name=<netns>, ip=wan ip, public_ip=ip, nat=False)
        n = lab.add_nat_host("n")               # Host(name=<home netns>, ip=192.168.K.2, public_ip=router ip)
        p = lab.popen(a, ["python3", "-m", "http.server"])   # new session: killable as a group
        lab.run(n, ["curl", f"http://{a.ip}:8000/"])
        lab.kill_host(a)                        # SIGKILL everything in a's namespace: "the machine died"

CLI::

    python scripts/netns_swarm.py check        # (or --check) build 2 plain + 1 NAT host, probe, PASS/FAIL table
    python scripts/netns_swarm.py list         # live labs
    python scripts/netns_swarm.py sweep        # remove labs whose owner is dead
"""

import argparse
import contextlib
import dataclasses
import fcntl
import functools
import ipaddress
import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

SCRIPT = Path(__file__).resolve()
ID_PREFIX = "pcl"
ID_LEN = len(ID_PREFIX) + 4  # "pcl" + 4 hex digits: every lab id has this length, so prefixes never overlap
WAN_SUPERNET = ipaddress.ip_network("10.213.0.0/16")  # each lab's wan is one /24 of this
HOME_SUBNET = "192.168.{k}.0/24"  # a NAT host's private subnet; lives only inside its router/home namespaces
MAX_HOSTS = 250  # wan addresses .2 .. .251 (routers of NAT hosts count)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


class LabError(RuntimeError):
    """An ``ip``/``nft`` command (or another step of building a lab) failed."""


class LabUnavailable(LabError):
    """This machine cannot build (this part of) a lab: not root, no ``ip``/``nft``, or the kernel refuses."""


# --------------------------------------------------------------------------------------------- small helpers


def _cmd(argv: Sequence[str], *, input: Optional[str] = None, check: bool = True,
         timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a command, capture its output; with ``check`` a failure raises :class:`LabError` with the command
    line and its stderr."""
    try:
        r = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise LabUnavailable(f"{shlex.join(argv)}: {argv[0]} not found ({e})") from None
    except subprocess.TimeoutExpired:
        raise LabError(f"{shlex.join(argv)}: timed out after {timeout} s") from None
    if check and r.returncode != 0:
        raise LabError(f"{shlex.join(argv)} failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def _ip(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    """``ip [-n NETNS] ARGS...``."""
    return _cmd(["ip", *(["-n", netns] if netns else []), *args], check=check)


def _json(text: str) -> Any:
    text = text.strip()
    return json.loads(text) if text else []


def _state_dir() -> Path:
    for d in (Path("/run/petals-chain-netns"), Path("/tmp/petals-chain-netns")):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise LabUnavailable("no writable state directory (/run/petals-chain-netns, /tmp/petals-chain-netns)")


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    """Serialises id/subnet allocation and teardown across processes."""
    with open(_state_dir() / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _proc_start(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of ``pid``, or None when it is gone or a zombie; guards against reuse
    of a dead owner's pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _alive(pid: Optional[int], start: Optional[int]) -> bool:
    return bool(pid) and _proc_start(pid) is not None and (start is None or _proc_start(pid) == start)


def _netns_names() -> list[str]:
    return [e["name"] for e in _json(_ip("-j", "netns", "list").stdout)]


def _netns_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()] if r.returncode == 0 else []


def _kill_netns(ns: str, timeout: float = 5.0) -> bool:
    """SIGKILL every process in ``ns`` (again and again while new ones appear); True once it is empty."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            return True
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------- lab state


def _state_path(lab_id: str) -> Path:
    return _state_dir() / f"{lab_id}.json"


def _write_state(state: dict) -> None:
    path = _state_path(state["id"])
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def _read_states() -> list[dict]:
    out = []
    for p in sorted(_state_dir().glob(f"{ID_PREFIX}*.json")):
        try:
            st = json.loads(p.read_text())
            if isinstance(st, dict) and st.get("id") == p.stem:
                out.append(st)
                continue
        except (OSError, ValueError):
            pass
        out.append({"id": p.stem, "corrupt": True, "mtime": p.stat().st_mtime if p.exists() else 0})
    return out


def _teardown(lab_id: str) -> list[str]:
    """Remove everything of lab ``lab_id``: kill the processes in its namespaces, delete its links (root side)
    and namespaces, then its state file. Best effort (what is already gone is fine); returns the errors."""
    if not (lab_id.startswith(ID_PREFIX) and len(lab_id) == ID_LEN):
        raise ValueError(f"not a lab id: {lab_id!r}")
    errors: list[str] = []
    with _global_lock():
        path = _state_path(lab_id)
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {}
        try:
            live_ns = _netns_names()
        except LabError as e:
            errors.append(str(e))
            live_ns = []
        namespaces = sorted({*state.get("netns", []), *(n for n in live_ns if n.startswith(lab_id))})
        namespaces = [n for n in namespaces if n in live_ns]
        for ns in namespaces:
            if not _kill_netns(ns):
                errors.append(f"netns {ns}: processes survive SIGKILL: {_netns_pids(ns)}")
        try:
            links = [e["ifname"] for e in _json(_ip("-j", "link", "show").stdout)]
        except LabError as e:
            errors.append(str(e))
            links = []
        bridge = state.get("bridge")
        # the bridge first (detaches its ports), then the remaining root-side veth ends (each takes its peer along)
        for ifname in sorted((n for n in links if n.startswith(lab_id)), key=lambda n: n != bridge):
            r = _ip("link", "del", ifname, check=False)
            if r.returncode != 0 and "Cannot find device" not in r.stderr:
                errors.append(f"ip link del {ifname}: {r.stderr.strip()}")
        for ns in namespaces:
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0 and "No such file" not in r.stderr:
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        log = path.with_suffix(".log")
        if not errors:
            with contextlib.suppress(FileNotFoundError):
                log.unlink()
    return errors


def list_labs() -> list[dict]:
    """The state of every lab on this machine, each with ``alive`` (whether its owner process still runs)."""
    out = []
    for st in _read_states():
        st["alive"] = not st.get("corrupt") and _alive(st.get("owner_pid"), st.get("owner_start"))
        out.append(st)
    return out


def sweep_stale() -> list[str]:
    """Tear down every lab whose controlling process is dead (and whose watchdog did not already); returns
    their ids. Unreadable state files count as stale once a minute old (a live lab's is rewritten atomically)."""
    removed = []
    for st in list_labs():
        if st["alive"] or (st.get("corrupt") and time.time() - st.get("mtime", 0) < 60):
            continue
        _teardown(st["id"])
        removed.append(st["id"])
    return removed


# --------------------------------------------------------------------------------------------- availability


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """``(True, "ok")`` when this process can build a lab (root, ``ip`` present, a namespace, a veth pair and a
    bridge can be created and removed), else ``(False, reason)`` (for ``pytest.skip``)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, f"network namespaces need root (euid {os.geteuid()})"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    probe = f"pclchk{os.getpid() % 0xFFFF:04x}"
    try:
        _state_dir()
        _ip("netns", "add", probe)
        try:
            _ip("link", "set", "lo", "up", netns=probe)
            _ip("link", "add", f"{probe}v", "type", "veth", "peer", "name", f"{probe}p", "netns", probe)
            _ip("link", "add", f"{probe}b", "type", "bridge")
        finally:
            _ip("link", "del", f"{probe}b", check=False)
            _ip("link", "del", f"{probe}v", check=False)
            _ip("netns", "del", probe, check=False)
    except LabError as e:
        return False, f"cannot create network namespaces here: {e}"
    return True, "ok"


_NAT_RULES = """\
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{wan}" masquerade
    }}
}}
table ip filter {{
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        ct state invalid drop
        iifname "{lan}" oifname "{wan}" accept
    }}
}}
"""


@functools.lru_cache(maxsize=None)
def nat_available() -> tuple[bool, str]:
    """Like :func:`available`, for NAT hosts: ``nft`` is installed and the kernel accepts a masquerade and
    conntrack ruleset (loaded into a scratch namespace)."""
    ok, why = available()
    if not ok:
        return ok, why
    if shutil.which("nft") is None:
        return False, "NAT hosts need nftables: the `nft` command is not installed"
    probe = f"pclnat{os.getpid() % 0xFFFF:04x}"
    try:
        _ip("netns", "add", probe)
        try:
            _cmd(["ip", "netns", "exec", probe, "nft", "-f", "-"], input=_NAT_RULES.format(wan="x0", lan="x1"))
        finally:
            _ip("netns", "del", probe, check=False)
    except LabError as e:
        return False, f"the kernel refuses NAT (nftables masquerade/conntrack): {e}"
    return True, "ok"


# --------------------------------------------------------------------------------------------- the lab


@dataclasses.dataclass(frozen=True)
class Host:
    """A machine of the lab. ``name`` is its network namespace (``ip netns exec NAME``), ``ip`` its own address,
    ``public_ip`` the address others see it connect from (its router's wan address for a NAT host)."""

    label: str
    name: str
    ip: str
    public_ip: str
    nat: bool = False
    router: Optional[str] = None  # NAT hosts: the router's namespace
    subnet: Optional[str] = None  # NAT hosts: the private subnet (home side)

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.name, self.router) if self.router else (self.name,)


HostLike = Union[Host, str]


class NetnsLab:
    """A lab: a wan bridge in the root namespace plus hosts in namespaces; see the module docstring.

    ``tag`` is a free label recorded in the lab's state (shown by ``list``); names use only the lab's id.
    ``sweep`` first removes the labs of dead owners. ``watchdog=False`` starts no watchdog (then only
    :meth:`close` or :func:`sweep_stale` remove the lab)."""

    def __init__(self, tag: Optional[str] = None, *, sweep: bool = True, watchdog: bool = True):
        ok, why = available()
        if not ok:
            raise LabUnavailable(why)
        if sweep:
            sweep_stale()
        self._owner = os.getpid()
        self._closed = False
        self._hosts: dict[str, Host] = {}
        self._next = 2  # next wan host number (.2, .3, ...)
        self._watchdog: Optional[subprocess.Popen] = None
        with _global_lock():
            self.id, self.subnet = self._allocate()
            self.bridge = f"{self.id}br"
            self.gateway = str(self.subnet.network_address + 1)
            self._state = {
                "id": self.id, "tag": tag, "owner_pid": self._owner, "owner_start": _proc_start(self._owner),
                "watchdog_pid": None, "subnet": str(self.subnet), "bridge": self.bridge, "netns": [], "links": [],
                "hosts": {}, "created": time.time(),
            }
            _write_state(self._state)  # reserves the id and the subnet
        try:
            if watchdog:
                self._start_watchdog()
            self._record(links=[self.bridge])
            _ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            with contextlib.suppress(LabError):
                self.close()
            raise

    # ---------------------------------------------------------------- allocation and state

    @staticmethod
    def _allocate() -> tuple[str, ipaddress.IPv4Network]:
        """A fresh id and a wan /24 clear of every route/address on the machine and of other labs' subnets
        (caller holds the global lock)."""
        states = _read_states()
        used_ids = {s["id"] for s in states} | {n[:ID_LEN] for n in _netns_names()}
        used_ids |= {e["ifname"][:ID_LEN] for e in _json(_ip("-j", "link", "show").stdout)}
        taken = []
        for r in _json(_ip("-j", "-4", "route", "show", "table", "all").stdout):
            dst = r.get("dst", "")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    taken.append(ipaddress.ip_network(dst, strict=False))
        for link in _json(_ip("-j", "-4", "addr", "show").stdout):
            for a in link.get("addr_info", []):
                with contextlib.suppress(ValueError, KeyError):
                    taken.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
        for s in states:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                taken.append(ipaddress.ip_network(s["subnet"]))
        for _ in range(1000):
            lab_id = ID_PREFIX + secrets.token_hex(2)
            if lab_id not in used_ids:
                break
        else:
            raise LabError("no free lab id")
        subnets = list(WAN_SUPERNET.subnets(new_prefix=24))
        start = secrets.randbelow(len(subnets))
        for net in subnets[start:] + subnets[:start]:
            if not any(net.overlaps(t) for t in taken):
                return lab_id, net
        raise LabError(f"no free /24 in {WAN_SUPERNET} (every one overlaps a route or another lab)")

    def _record(self, *, netns: Sequence[str] = (), links: Sequence[str] = (), host: Optional[Host] = None) -> None:
        """Record names in the state file BEFORE creating them, so a crash never leaves an unknown leftover."""
        self._state["netns"] += [n for n in netns if n not in self._state["netns"]]
        self._state["links"] += [n for n in links if n not in self._state["links"]]
        if host is not None:
            self._state["hosts"][host.label] = dataclasses.asdict(host)
        _write_state(self._state)

    def _start_watchdog(self) -> None:
        log = open(_state_path(self.id).with_suffix(".log"), "ab")
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-S", str(SCRIPT), "reap", self.id, "--owner", str(self._owner)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
            )
        finally:
            log.close()
        self._state["watchdog_pid"] = self._watchdog.pid
        _write_state(self._state)

    # ---------------------------------------------------------------- hosts

    @property
    def hosts(self) -> list[Host]:
        return list(self._hosts.values())

    def _new_host_number(self, label: str) -> int:
        if self._closed:
            raise LabError(f"lab {self.id} is closed")
        if not _NAME_RE.fullmatch(label):
            raise ValueError(f"host name {label!r}: use 1-32 of [A-Za-z0-9_.-], starting alphanumeric")
        if label in self._hosts:
            raise ValueError(f"lab {self.id} already has a host {label!r}")
        if self._next > MAX_HOSTS + 1:
            raise LabError(f"lab {self.id} is full ({MAX_HOSTS} wan addresses)")
        k = self._next
        self._next += 1
        return k

    def _plug_into_wan(self, ns: str, k: int) -> str:
        """Create namespace ``ns`` (lo up) and plug it into the bridge as wan address ``.k`` on interface
        ``<id>w<k>`` (bridge port ``<id>b<k>``); returns the address."""
        port, wan = f"{self.id}b{k}", f"{self.id}w{k}"
        ip = str(self.subnet.network_address + k)
        self._record(netns=[ns], links=[port])
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", netns=ns)
        _ip("link", "add", port, "type", "veth", "peer", "name", wan, "netns", ns)
        _ip("link", "set", port, "master", self.bridge)
        _ip("link", "set", port, "up")
        _ip("addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", wan, netns=ns)
        _ip("link", "set", wan, "up", netns=ns)
        return ip

    def add_host(self, name: str) -> Host:
        """A plain host: namespace ``<id>-<name>`` with ``lo`` up and a wan address (.2, .3, ...); only the wan
        /24 is routed (no default route)."""
        k = self._new_host_number(name)
        ns = f"{self.id}-{name}"
        ip = self._plug_into_wan(ns, k)
        host = Host(label=name, name=ns, ip=ip, public_ip=ip)
        self._hosts[name] = host
        self._record(host=host)
        return host

    def add_nat_host(self, name: str) -> Host:
        """A NAT'd volunteer: a router namespace ``<id>-<name>-rtr`` on the wan (its own wan address, forwarding,
        nftables masquerade out of the wan leg, new connections forwarded only from the home side) and a home
        namespace ``<id>-<name>`` on 192.168.K.0/24 whose default route is the router. Nothing is forwarded
        inbound. Raises :class:`LabUnavailable` when nft is missing or the kernel refuses NAT."""
        ok, why = nat_available()
        if not ok:
            raise LabUnavailable(why)
        k = self._new_host_number(name)
        home, router = f"{self.id}-{name}", f"{self.id}-{name}-rtr"
        public_ip = self._plug_into_wan(router, k)
        wan, lan_r, lan_h = f"{self.id}w{k}", f"{self.id}r{k}", f"{self.id}l{k}"
        subnet = ipaddress.ip_network(HOME_SUBNET.format(k=k))
        gw, ip = str(subnet.network_address + 1), str(subnet.network_address + 2)
        self._record(netns=[home])
        _ip("netns", "add", home)
        _ip("link", "set", "lo", "up", netns=home)
        _ip("link", "add", lan_r, "type", "veth", "peer", "name", lan_h, "netns", home, netns=router)
        _ip("addr", "add", f"{gw}/24", "dev", lan_r, netns=router)
        _ip("link", "set", lan_r, "up", netns=router)
        _ip("addr", "add", f"{ip}/24", "dev", lan_h, netns=home)
        _ip("link", "set", lan_h, "up", netns=home)
        _ip("route", "add", "default", "via", gw, netns=home)
        try:
            _cmd(["ip", "netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
            _cmd(["ip", "netns", "exec", router, "nft", "-f", "-"], input=_NAT_RULES.format(wan=wan, lan=lan_r))
        except LabError as e:
            raise LabUnavailable(f"NAT host {name!r}: cannot set up forwarding/masquerade in {router}: {e}") from e
        host = Host(label=name, name=home, ip=ip, public_ip=public_ip, nat=True, router=router, subnet=str(subnet))
        self._hosts[name] = host
        self._record(host=host)
        return host

    def host(self, name: str) -> Host:
        return self._hosts[name]

    def _ns(self, host: HostLike) -> str:
        return host.name if isinstance(host, Host) else self._hosts[host].name if host in self._hosts else host

    # ---------------------------------------------------------------- processes

    def command(self, host: HostLike, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self._ns(host), *map(str, argv)]

    def popen(self, host: HostLike, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside ``host`` (a Host, its label or a namespace name), in a new
        session (``start_new_session=True`` unless given) so ``os.killpg(p.pid, ...)`` stops it and its children."""
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(host, argv), **kw)

    def run(self, host: HostLike, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside ``host``, in a new session."""
        kw.setdefault("start_new_session", True)
        return subprocess.run(self.command(host, argv), **kw)

    def kill_host(self, host: HostLike) -> None:
        """SIGKILL every process in the host's namespace(s) (a NAT host's router too): "the machine died". Its
        network stays up (a new process may be started there)."""
        if isinstance(host, str) and host in self._hosts:
            host = self._hosts[host]
        namespaces = host.namespaces if isinstance(host, Host) else (host,)
        for ns in namespaces:
            if not _kill_netns(ns):
                raise LabError(f"netns {ns}: processes survive SIGKILL: {_netns_pids(ns)}")

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Kill every process in the lab's namespaces, delete them, the bridge and the state; idempotent. A no-op
        in a forked child of the owner (the owner's lab is not the child's to remove)."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        errors = _teardown(self.id)
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                self._watchdog.stdin.close()  # EOF: the watchdog finds nothing left and exits
            try:
                self._watchdog.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()
                self._watchdog.wait()
        if errors:
            raise LabError(f"lab {self.id}: teardown incomplete: " + "; ".join(errors))

    def __enter__(self) -> "NetnsLab":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NetnsLab({self.id}, wan {self.subnet}, {len(self._hosts)} hosts{', closed' if self._closed else ''})"


def _reap_main(lab_id: str, owner: int) -> int:
    """The watchdog: wait for EOF on stdin (the owner closed the pipe or died) or for the owner pid to vanish,
    then tear the lab down. SIGINT/SIGHUP are ignored (a terminal's Ctrl-C must not skip the teardown);
    SIGTERM tears down at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    start = _proc_start(owner)
    while not stop:
        try:
            ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.5)
        except InterruptedError:
            continue
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF
        if start is None or _proc_start(owner) != start or os.getppid() != owner:
            break
    errors = _teardown(lab_id)
    for e in errors:
        print(f"netns_swarm reap {lab_id}: {e}", file=sys.stderr)
    return 1 if errors else 0


# --------------------------------------------------------------------------------------------- probes / check

_SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(64)
print("READY", flush=True)
while True:
    c, peer = s.accept()
    try:
        c.sendall((peer[0] + "\n").encode())
    except OSError:
        pass
    c.close()
"""

_CLIENT = r"""
import socket, sys
t = float(sys.argv[3])
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=t)
    data = b""
    while not data.endswith(b"\n"):
        chunk = c.recv(256)
        if not chunk:
            break
        data += chunk
    print("OK", data.decode().strip())
except OSError as e:
    print("ERR", type(e).__name__, e)
    sys.exit(1)
"""


@dataclasses.dataclass
class Probe:
    """A TCP connection attempt: ``ok`` (connected and got the server's reply), ``peer`` (the address the server
    saw the connection come from) or ``error``."""

    ok: bool
    peer: Optional[str] = None
    error: Optional[str] = None


@contextlib.contextmanager
def tcp_server(lab: NetnsLab, host: HostLike, port: int, timeout: float = 10.0) -> Iterator[subprocess.Popen]:
    """A tiny TCP server in ``host`` on 0.0.0.0:``port`` that answers every connection with the peer address it
    sees; ready on entry, killed on exit."""
    p = lab.popen(host, [sys.executable, "-S", "-c", _SERVER, str(port)], stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else ""
        if line.strip() != "READY":
            p.kill()
            raise LabError(f"tcp server in {lab._ns(host)}:{port} did not start: {line!r} {p.stderr.read()!r}")
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        p.stderr.close()


def tcp_probe(lab: Optional[NetnsLab], src: Optional[HostLike], ip: str, port: int, timeout: float = 1.5) -> Probe:
    """Connect from ``src`` (None: the root namespace, i.e. this process) to ``ip:port`` (a :func:`tcp_server`)."""
    argv = [sys.executable, "-S", "-c", _CLIENT, ip, str(port), str(timeout)]
    if src is None:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 15)
    else:
        assert lab is not None
        r = lab.run(src, argv, capture_output=True, text=True, timeout=timeout + 15)
    out = r.stdout.strip()
    if r.returncode == 0 and out.startswith("OK"):
        return Probe(True, peer=out[2:].strip())
    return Probe(False, error=out.removeprefix("ERR ").strip() or r.stderr.strip())


@dataclasses.dataclass
class Check:
    name: str
    expect: str  # "connect" or "refuse"
    ok: bool
    detail: str


def run_checks(lab: Optional[NetnsLab] = None, *, port: int = 7070, timeout: float = 1.5) -> list[Check]:
    """The ``check`` subcommand's checks. Adds hosts ``chk-a``, ``chk-b`` (plain) and ``chk-nat`` (NAT) to ``lab``
    (a new lab, torn down after, when None) and probes them with :func:`tcp_server`/:func:`tcp_probe`."""
    if lab is None:
        with NetnsLab(tag="check") as own:
            return run_checks(own, port=port, timeout=timeout)
    a, b, n = lab.add_host("chk-a"), lab.add_host("chk-b"), lab.add_nat_host("chk-nat")
    checks: list[Check] = []

    def expect_connect(name: str, probe: Probe, peer: str) -> None:
        ok = probe.ok and probe.peer == peer
        detail = f"server saw peer {probe.peer} (want {peer})" if probe.ok else f"failed: {probe.error}"
        checks.append(Check(name, "connect", ok, detail))

    def expect_refuse(name: str, probe: Probe) -> None:
        detail = f"CONNECTED (server saw {probe.peer})" if probe.ok else f"blocked: {probe.error}"
        checks.append(Check(name, "refuse", not probe.ok, detail))

    with tcp_server(lab, a, port), tcp_server(lab, b, port), tcp_server(lab, n, port):
        expect_connect(f"A {a.ip} -> B {b.ip}", tcp_probe(lab, a, b.ip, port, timeout), a.ip)
        expect_connect(f"NAT home {n.ip} -> A {a.ip} (A sees the router)", tcp_probe(lab, n, a.ip, port, timeout),
                       n.public_ip)
        expect_connect(f"root ns -> A {a.ip}", tcp_probe(None, None, a.ip, port, timeout), lab.gateway)
        expect_connect(f"NAT home listens (self-probe {n.ip})", tcp_probe(lab, n, n.ip, port, timeout), n.ip)
        expect_refuse(f"A -> NAT private {n.ip} (no route)", tcp_probe(lab, a, n.ip, port, timeout))
        expect_refuse(f"A -> NAT public {n.public_ip}:{port} (no port forward)",
                      tcp_probe(lab, a, n.public_ip, port, timeout))
        # even a host that routes the private subnet via the router gets nothing through: the forward filter
        _ip("route", "add", n.subnet, "via", n.public_ip, netns=a.name)
        try:
            expect_refuse(f"A -> NAT private {n.ip} routed via router (forward filter)",
                          tcp_probe(lab, a, n.ip, port, timeout))
        finally:
            _ip("route", "del", n.subnet, "via", n.public_ip, netns=a.name, check=False)
    return checks


def _bridge_netfilter_hint() -> str:
    with contextlib.suppress(OSError):
        if Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "1":
            return ("hint: br_netfilter is on (net.bridge.bridge-nf-call-iptables=1), so the root namespace's "
                    "iptables FORWARD chain also filters traffic between lab hosts on the bridge")
    return ""


def _cmd_check(args: argparse.Namespace) -> int:
    for ok, why in (available(), nat_available()):
        if not ok:
            print(f"UNAVAILABLE: {why}")
            return 2
    t0 = time.monotonic()
    with NetnsLab(tag="check") as lab:
        print(f"lab {lab.id}: wan {lab.subnet}, bridge {lab.bridge} {lab.gateway} (root ns)")
        checks = run_checks(lab, port=args.port, timeout=args.timeout)
        for h in lab.hosts:
            where = f"{h.ip} behind {h.public_ip} (NAT, router ns {h.router})" if h.nat else h.ip
            print(f"  host {h.label:8} ns {h.name:20} {where}")
    width = max(len(c.name) for c in checks)
    print(f"\n{'check':{width}}  expect   result  detail")
    for c in checks:
        print(f"{c.name:{width}}  {c.expect:7}  {'PASS' if c.ok else 'FAIL':6}  {c.detail}")
    passed = sum(c.ok for c in checks)
    verdict = "PASS" if passed == len(checks) else "FAIL"
    print(f"\n{verdict}: {passed}/{len(checks)} checks passed in {time.monotonic() - t0:.1f} s; lab torn down")
    if verdict == "FAIL" and _bridge_netfilter_hint():
        print(_bridge_netfilter_hint())
    return 0 if verdict == "PASS" else 1


def _cmd_list(args: argparse.Namespace) -> int:
    labs = list_labs()
    for st in labs:
        status = "alive" if st["alive"] else "STALE"
        print(f"{st['id']}  {status:5}  owner {st.get('owner_pid')}  wan {st.get('subnet')}  tag {st.get('tag')}  "
              f"netns {', '.join(st.get('netns', []))}")
    if not labs:
        print("no labs")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    removed = sweep_stale()
    print(f"removed {len(removed)} stale lab(s){': ' + ', '.join(removed) if removed else ''}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Multi-host testbeds from Linux network namespaces (root only).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("CLI::", 1)[1] if "CLI::" in (__doc__ or "") else None,
    )
    parser.add_argument("--check", action="store_true", help="same as the `check` subcommand")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    p = sub.add_parser("check", help="build 2 plain hosts + 1 NAT host, probe TCP reachability, print PASS/FAIL")
    p.add_argument("--port", type=int, default=7070)
    p.add_argument("--timeout", type=float, default=1.5, help="seconds a blocked connection attempt waits")
    p.set_defaults(func=_cmd_check)
    sub.add_parser("list", help="list the labs on this machine").set_defaults(func=_cmd_list)
    sub.add_parser("sweep", help="tear down labs whose owner process is dead").set_defaults(func=_cmd_sweep)
    p = sub.add_parser("reap", help="(internal) a lab's watchdog: tears lab LAB_ID down at EOF on stdin or when "
                       "the owner pid is gone")
    p.add_argument("lab_id")
    p.add_argument("--owner", type=int, required=True)
    p.set_defaults(func=lambda a: _reap_main(a.lab_id, a.owner))
    # Swarm launching (orchestrator + servers + clients across lab hosts) goes here as further subcommands.
    args = parser.parse_args(argv)
    if args.check and args.cmd is None:
        args = parser.parse_args(["check"])
    if args.cmd is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
