"""The volunteer guide's example (server/README.md) runs end to end: join, assignment, one step, clean exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO_ROOT


@pytest.mark.slow
def test_readme_example_runs(tmp_path):
    env_cache = {"PETALS_CHAIN_CACHE_DIR": str(tmp_path / "cache")}
    import os

    proc = subprocess.run([sys.executable, str(REPO_ROOT / "server" / "example.py")], cwd=str(REPO_ROOT),
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, **env_cache))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "EXAMPLE OK" in proc.stdout
    assert "python -m petals_chain.server" in open(REPO_ROOT / "server" / "README.md").read()
    # The example uses the README's command line (model, initial peers, memory, public name).
    assert "--memory-gb" in proc.stdout and "--public-name example" in proc.stdout
