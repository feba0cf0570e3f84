"""Follow-ups of session 32: each hop of a chain opens its server session under an id of its own (a replacement's
id could be predicted and opened first), the dashboard's list of departed servers is bounded, ``LocalSwarm``
fails fast when every server exited, and a session turn's request outcome is passed explicitly."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch

HOP_ID = re.compile(r"r-[0-9a-f]{12}\.\d+")  # the form of every server session id a job (or an audit) opens


class _Session:
    def __init__(self, peer: str, session_id: str, kw: dict):
        self.peer, self.session_id, self.kw = peer, session_id, kw
        self.push_token = kw.get("push_token")
        self.closed = False

    async def step(self, x, position, **kw):
        return x

    async def close(self, **kw):
        self.closed = True


class _Client:
    """Records every open; refuses an id already open at that peer, as a server does."""

    def __init__(self):
        self.opens: list[tuple[str, str, dict]] = []
        self.open_ids: dict[str, set] = {}

    async def open_session(self, peer, *, session_id, **kw):
        self.opens.append((peer, session_id, kw))
        ids = self.open_ids.setdefault(peer, set())
        if session_id in ids:
            raise ValueError(f"session {session_id!r} is already open")
        ids.add(session_id)
        return _Session(peer, session_id, kw)


def test_every_hop_and_replacement_opens_under_an_unpredictable_id_of_its_own():
    """Every hop of a chain used the chain's id, and a replacement ``<id>.r1``: every server of the chain knew the
    ids the others used (and the push route told them again), so a peer that a server authorizes (a second
    orchestrator, anyone under ``--allow-any-client``) could open a replacement's id there first, and the
    failover's open was refused. Each hop, fork and replacement now opens under a fresh random id; the push route
    and forks name each hop's own."""
    from petals_chain.orchestrator.relay import ChainSession

    hops = [("a", 0, 2), ("b", 2, 4), ("c", 4, 6)]

    async def main():
        client = _Client()
        cs = ChainSession(client, hops, "r-0123456789ab.7", 64, push=True)
        await cs.open()
        ids = [sid for _, sid, _ in client.opens]
        assert len(set(ids)) == 3 and cs.session_id not in ids and all(HOP_ID.fullmatch(i) for i in ids), ids
        # the route names each later hop's own session (and token)
        assert [(h["peer"], h["session_id"]) for h in cs._route(1)] == [("b", ids[1]), ("c", ids[2])]

        # a peer that knows every id above opens whatever it could derive from them at the replacement server
        squatter = client.open_ids.setdefault("b2", set())
        for known in [cs.session_id, *ids]:
            squatter.update({known, *(f"{known}.r{n}" for n in range(1, 4))})
        out = await cs.replace(1, "b2", torch.zeros(1, 3, 4), torch.ones(1, 1, 4), 3)
        assert out.shape == (1, 1, 4) and cs.hops[1] == ("b2", 2, 4)
        rid = client.opens[-1][1]
        assert HOP_ID.fullmatch(rid) and rid not in ids and rid[:14] not in {i[:14] for i in ids}

        # a fork names each hop's own source session
        sibling = ChainSession(client, list(cs.hops), cs.session_id, 64, push=True)
        await sibling.open(fork_from=cs, fork_length=3)
        forks = client.opens[-3:]
        assert [kw["fork_from"] for _, _, kw in forks] == [s.session_id for s in cs._sessions]
        assert not {sid for _, sid, _ in forks} & set(ids + [rid])

        # the same chain id opened again (another job's, an open retried) gets other ids
        again = ChainSession(client, hops, cs.session_id, 64)
        await again.open()
        assert not {sid for _, sid, _ in client.opens[-3:]} & set(ids)

    asyncio.run(main())


def test_an_audit_session_id_is_drawn_like_a_jobs_hop_ids():
    """An auditor's throwaway session must look like a job's hop (a server lying only outside audits must not
    tell them apart): same form, numbered from the same counter. (A user session's hops were ``s-<id>.<n>``,
    which no audit looks like.)"""
    from petals_chain.orchestrator.audit import Auditor
    from petals_chain.orchestrator.relay import ChainSession

    async def main():
        client = _Client()
        auditor = Auditor(types.SimpleNamespace(cfg=types.SimpleNamespace(step_timeout_s=5.0, max_length=64)),
                          rate=0.0, seed=1)
        first = auditor._job_like_session_id()
        cs = ChainSession(client, [("a", 0, 2), ("b", 2, 4)], "s-0123456789ab.3", 64)
        await cs.open()
        last = auditor._job_like_session_id()
        every = [first, *(sid for _, sid, _ in client.opens), last]
        assert all(HOP_ID.fullmatch(i) for i in every), every
        numbers = [int(i.rsplit(".", 1)[1]) for i in every]
        assert numbers == sorted(numbers) and len(set(numbers)) == 4, numbers

    asyncio.run(main())


DASHBOARD_JS = Path(__file__).resolve().parents[1] / "petals_chain" / "swarm" / "static" / "dashboard.js"

# Runs the page's trackDepartures (and goneNotListed) under node on polls 2 s apart: 5 servers with new ids at
# every poll for 10 minutes, then 11 minutes of one steady server, one of the departed ids back at the first.
_GONE_DRIVER = r"""
const src = require("fs").readFileSync(process.argv[1], "utf8");
const grab = (name) => src.match(new RegExp("  function " + name + "\\([^]*?\\n  }\\n"))[0];
const consts = ["GONE_KEEP_MS", "GONE_KEEP_MAX", "GONE_COUNT_MAX"].map(
  (n) => (src.match(new RegExp("var " + n + " = [^;]*;")) || [""])[0]);
function str(v) { return v === null || v === undefined ? "" : String(v); }
eval(consts.join("\n") + src.match(/  var state = \{[^]*?\n  \};\n/)[0] + grab("trackDepartures") +
     (src.includes("function goneNotListed") ? grab("goneNotListed") : ""));
const notListed = () => (typeof goneNotListed === "function" ? goneNotListed() : 0);
let t = 0, most = 0;
for (let poll = 0; poll < 300; poll++, t += 2000) {
  const servers = [];
  for (let i = 0; i < 5; i++) servers.push({ peer_id: "p" + poll + "-" + i });
  trackDepartures(servers, t);
  most = Math.max(most, state.gone.size);
}
const churned = { listed: state.gone.size, most: most, not_listed: notListed(), newest: state.gone.has("p298-4") };
trackDepartures([{ peer_id: "p298-4" }, { peer_id: "steady" }], t);
const back = { listed: state.gone.size, has_back: state.gone.has("p298-4") };
for (let poll = 0; poll < 330; poll++) { t += 2000; trackDepartures([{ peer_id: "steady" }], t); }
console.log(JSON.stringify({ churned: churned, back: back, later: { listed: state.gone.size, not_listed: notListed() },
                             remembered: state.goneDropped.size }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_dashboards_departed_servers_are_the_50_latest_and_the_rest_counted():
    """The page listed every departed server for 10 minutes, with no bound: peers changing ids at every poll made
    1495 rows in 10 minutes of 5 servers. It lists the 50 latest now and counts the others (for the summary) until
    they are 10 minutes old; a departed server that comes back leaves the list."""
    out = subprocess.run(["node", "-e", _GONE_DRIVER, str(DASHBOARD_JS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["churned"] == {"listed": 50, "most": 50, "not_listed": 299 * 5 - 50, "newest": True}, res
    # p298-4 came back (p299-* left: 5 more, listed, 5 older ones out of the list, and a departure of the last poll)
    assert res["back"] == {"listed": 50, "has_back": False}, res
    assert res["later"] == {"listed": 0, "not_listed": 0} and res["remembered"] == 0, res


def test_waiting_on_a_swarm_whose_every_server_exited_fails_at_once(tiny_model_factory, tmp_path):
    """Servers that all exit at start (here: a bad argument) left ``wait_ready`` polling to its timeout (scripts
    wait 600-900 s); it fails at once now, with the servers' log tails."""
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

    model = tiny_model_factory("llama", num_layers=2)
    servers = [LocalServer("bad", memory_for(model, 64, 2, 2), tau_p=0.002, extra_args=["--no-such-option"])]
    with LocalSwarm(model, servers, max_length=64, log_dir=tmp_path) as sw:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="every server exited") as info:
            sw.wait_ready(timeout=900)
        assert "--no-such-option" in str(info.value) and "exit status 2" in str(info.value)
        assert time.monotonic() - t0 < 600  # not the timeout (in practice seconds: the server's start)
    assert sw.leftover_processes() == []


def test_servers_stopped_on_purpose_are_no_reason_to_fail(tmp_path, monkeypatch):
    """A server stopped by ``kill_server`` (a test waiting for the orchestrator to notice) is no failure; one that
    exits by itself while the others were stopped is."""
    from petals_chain.swarm.local import LocalSwarm, _Proc

    class Exited:
        pid = 0

        @staticmethod
        def poll():
            return 1

        @staticmethod
        def wait(timeout=None):
            return 1

    sw = LocalSwarm("model", log_dir=tmp_path)
    monkeypatch.setattr(sw, "swarm", lambda: {"ready": False})
    sw.orchestrator = _Proc("orchestrator", types.SimpleNamespace(poll=lambda: None), tmp_path / "orchestrator.log")
    for name in "ab":
        (tmp_path / f"server-{name}.log").write_text(f"{name} crashed\n")
        sw.servers[name] = _Proc(f"server-{name}", Exited(), tmp_path / f"server-{name}.log", spec=object())
    monkeypatch.setattr(sw, "_reap", lambda proc, descendants: None)
    monkeypatch.setattr("petals_chain.swarm.local._descendants", lambda pid: [])
    sw.kill_server("a")
    with pytest.raises(RuntimeError, match="every server exited") as info:
        sw.wait_until(lambda st: st["ready"], timeout=60, what="ready")
    assert "b crashed" in str(info.value) and "a crashed" not in str(info.value)
    sw.kill_server("b")
    with pytest.raises(TimeoutError):
        sw.wait_until(lambda st: st["ready"], timeout=0.3, what="ready")
    assert sw.wait_until(lambda st: True, timeout=0.3) == {"ready": False}
