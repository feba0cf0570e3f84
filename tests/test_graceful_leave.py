"""A gracefully stopped server costs one re-plan, at once (real orchestrator and server processes).

Its "offline" record stays in the DHT until it expires; the planner must see that as one leave, not as a join and
a leave at every refresh (which kept resetting the settle time and blocked re-planning until the record expired).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

MAX_LENGTH = 64


def test_sigterm_then_replacement_costs_one_replan(tiny_model_factory, tmp_path, scaled):
    model = tiny_model_factory("llama", num_layers=6)
    mem = memory_for(model, MAX_LENGTH, 2, 2)  # 2 blocks each: the three servers form the only chain
    sw = LocalSwarm(model, [LocalServer(f"s{i}", mem, tau_p=0.002) for i in range(3)], max_length=MAX_LENGTH,
                    arrival_rate=1.0, log_dir=tmp_path, orchestrator_args=["--replan-interval-s", "3600"])
    sw.start(timeout=scaled(120))
    try:
        st = sw.wait_ready(timeout=scaled(150))
        assert len(st["chains"]) == 1 and len(st["chains"][0]["names"]) == 3, st["chains"]
        victim = st["chains"][0]["names"][1]
        t0 = time.monotonic()
        # Graceful stop: SIGTERM to the server process only (not its group: its DHT process and p2pd must live
        # on to announce "offline"); it drains, announces, exits.
        os.kill(sw.servers[victim].popen.pid, signal.SIGTERM)
        time.sleep(2.0)
        t_start = time.monotonic()
        sw.add_server(LocalServer("r", mem, tau_p=0.002))
        joined = sw.wait_until(lambda s: any(x["public_name"] == "r" for x in s["servers"]), scaled(60),
                               "the replacement to join")
        t_join = time.monotonic()
        st = sw.wait_until(lambda s: s["ready"] and any("r" in ch["names"] for ch in s["chains"]), scaled(60),
                           "a chain with the replacement")
        t_ready = time.monotonic()
        r = sw.client().complete([1, 2, 3, 4], max_tokens=4, ignore_eos=True)
        assert len(r.token_ids) == 4
        # a clean leave logs no error: no relayed p2pd shutdown ERROR, no unretrieved task, no traceback
        sw.servers[victim].popen.wait(timeout=scaled(30))
        victim_log = (tmp_path / f"server-{victim}.log").read_text(errors="replace")
        assert "petals_chain.server: stopped" in victim_log
        for noise in ("use of closed network connection", "never retrieved", "Traceback"):
            assert noise not in victim_log, noise
        log = (tmp_path / "orchestrator.log").read_text(errors="replace")
        left = log.count(f"server left: {victim} ")
        rejoined = log.count(f"server joined: {victim} ")
        print(f"SIGTERM -> replacement started {t_start - t0:.1f}s, seen {t_join - t0:.1f}s, chain ready "
              f"{t_ready - t0:.1f}s ({t_ready - t_join:.1f}s after it joined); '{victim}' left {left}x, joined "
              f"{rejoined}x; servers {[(x['public_name'], x['state']) for x in joined['servers']]}")
        assert left == 1 and rejoined == 1, (left, rejoined)
        assert t_ready - t_join < scaled(10), t_ready - t_join  # the join is planned at once (was ~80 s)
        assert t_ready - t0 < scaled(45), t_ready - t0
    finally:
        sw.stop()
