"""NetnsSwarm: a LocalSwarm whose orchestrator and servers each run on a host of their own.

The hosts come from a network-namespace lab (``scripts/netns_swarm.py``: ``NetnsLab``, root only): each has its
own network stack and address, so peers dial each other across a bridge as on a LAN, and a NAT'd host can only
dial out. The orchestrator listens on its host's address (HTTP included); servers listen on all their interfaces
and find out by the orchestrator's dial-back whether they are reachable (``swarm/reachability.py``).

```python
with NetnsLab() as lab, NetnsSwarm(lab, model_path, [LocalServer("a", mem), ...]) as swarm:
    swarm.wait_ready()
    swarm.add_server(LocalServer("nat", mem), nat=True)   # a volunteer behind NAT: joins through the relay
```
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from typing import Any, Optional, Sequence

from petals_chain.swarm.local import LocalServer, LocalSwarm, _Proc
from petals_chain.swarm.reachability import is_loopback


class NetnsSwarm(LocalSwarm):
    """An orchestrator and servers on separate hosts of ``lab`` (duck-typed: ``add_host``, ``add_nat_host``,
    ``popen``, ``kill_host``). Every node gets a host named after it; ``url`` is the orchestrator's address on
    the lab's network, reachable from the controlling process."""

    def __init__(self, lab: Any, model_path: str | os.PathLike, servers: Sequence[LocalServer] = (), *,
                 orchestrator_host: str = "orch", **kwargs: Any):
        super().__init__(model_path, servers, **kwargs)
        self.lab = lab
        self.hosts: dict[str, Any] = {}  # node name (as in _spawn) -> lab host
        self.orchestrator_host = lab.add_host(orchestrator_host)
        self.hosts["orchestrator"] = self.orchestrator_host
        ip = self.orchestrator_host.ip
        self.orchestrator_args = ["--host", "0.0.0.0", "--host-maddrs", f"/ip4/{ip}/tcp/0", *self.orchestrator_args]

    def _spawn(self, name: str, args: list[str], spec: Any = None) -> _Proc:
        host = self.hosts[name]
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = self.lab.popen(host, [self.python, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                   cwd=os.getcwd())
        return _Proc(name=name, popen=popen, log_path=log_path, spec=spec)

    def start_orchestrator(self, timeout: float = 120.0) -> None:
        super().start_orchestrator(timeout)
        port = self.url.rsplit(":", 1)[1]
        self.url = f"http://{self.orchestrator_host.ip}:{port}"
        self.initial_peers = [m for m in self.initial_peers if not is_loopback(m)]

    def add_server(self, spec: LocalServer, *, nat: bool = False, host: Optional[Any] = None) -> None:
        """Start a server on a new host of its own (``nat``: behind a NAT router) or on ``host``."""
        if spec.public_name in self.servers:  # before a host is made for it
            raise ValueError(f"a server named {spec.public_name!r} already exists")
        if host is None:
            host = self.lab.add_nat_host(spec.public_name) if nat else self.lab.add_host(spec.public_name)
        self.hosts[f"server-{spec.public_name}"] = host
        super().add_server(dataclasses.replace(spec, extra_args=("--host-maddrs", "/ip4/0.0.0.0/tcp/0",
                                                                 *spec.extra_args)))

    def kill_server(self, name: str, sig: int = signal.SIGKILL) -> None:
        """SIGKILL: the server's machine dies (every process on its host, p2pd included; the host stays, empty).
        Other signals go to the server's own process, as in LocalSwarm."""
        if sig != signal.SIGKILL:
            return super().kill_server(name, sig)
        self.servers[name].stopped = True  # on purpose: waits do not fail fast on its exit
        self.lab.kill_host(self.hosts[f"server-{name}"])
        self.servers[name].popen.wait(timeout=10)
