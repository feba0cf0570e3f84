"""CI-sized run of the emulated Table-1 testbed (scripts/bench_swarm.py): every policy through real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("mean_response_s", "median_response_s", "p95_response_s", "p99_response_s", "mean_wait_s",
        "mean_service_s", "completed", "failed")


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_bench_swarm_quick_accounts_for_every_request(tmp_path):
    n = 6
    out = tmp_path / "bench.json"
    # The smaller variant of --quick: 1 fast + 1 slow server (9 server processes per policy are too many for CI),
    # and Table 1's two ends, PETALS (routed per request) and the proposed plan (BPRR's routing and whole-model
    # placement have their own tests: test_routed.py, test_baselines.py).
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_swarm.py"), "--quick", "--requests", str(n),
                             "--fast", "1", "--slow", "1", "--policies", "petals", "proposed", "--json",
                             "--no-progress", "--out", str(out),
                             # 2 servers and no periodic re-plan: the first ready plan is the last one
                             "--plan-quiet-s", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the bench stops its swarms on SIGTERM (no p2pd or server is left behind)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"bench_swarm --quick timed out:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    res = json.loads(stdout)
    assert set(res) >= {"petals", "proposed", "c", "setting"}
    assert isinstance(res["c"], int) and res["c"] >= 1
    for pol in ("petals", "proposed"):
        r = res[pol]
        for k in KEYS:
            assert k in r, (pol, k)
        assert r["completed"] + r["failed"] == n, (pol, r)
        assert sum(r["failure_reasons"].values()) == r["failed"], (pol, r)
        assert r["completed"] >= 1, (pol, r)
        assert r["mean_response_s"] > 0 and r["mean_wait_s"] >= 0 and r["mean_service_s"] > 0
        assert r["median_response_s"] <= r["p95_response_s"] <= r["p99_response_s"]
    full = json.loads(out.read_text())
    assert all(len(full[p]["response_times_s"]) == n for p in ("petals", "proposed"))
    # PETALS mode: every server's cache is PETALS' fixed 2 slots (4096 tokens) per hosted block
    for s in full["petals"]["servers"]:
        assert s["slots_total"] == 2 * s["span"][1]
