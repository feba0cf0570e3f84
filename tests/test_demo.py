"""``python -m petals_chain.demo`` runs a whole swarm, serves a burst, and shuts down cleanly."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_end_to_end(tmp_path):
    r = subprocess.run([sys.executable, "-m", "petals_chain.demo", "--requests", "8", "--max-tokens", "8",
                        "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=420)
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    for expected in ["[1/5]", "Plan: epoch", "c* =", "Servers (placement):", "Chains (GCA order", "[4/5]",
                     "8/8 completed", "Dashboard: http://127.0.0.1:", "Stopped cleanly."]:
        assert expected in out, expected
    # every request line shows its wait and service time and the chain that served it
    rows = [ln for ln in out.splitlines() if re.match(r"^\s+\d+\s+[\d.]+ m?s\s+[\d.]+ m?s\s+8\s", ln)]
    assert len(rows) == 8, out
    assert "FAILED" not in out
