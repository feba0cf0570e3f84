"""The suite's Hypothesis profile (tests/conftest.py): derandomized in CI, where a fresh clone has no example
database and random draws failed runs at random (HERD's split ILP, session 36); random locally."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import settings

from conftest import REPO_ROOT, STATUS_FILE_VAR


def test_ci_runs_draw_the_same_examples_and_local_runs_random_ones(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env[STATUS_FILE_VAR] = str(tmp_path / "status")  # what .ci/run sets
    code = ("import conftest; from hypothesis import settings as s; "
            "print(s.get_current_profile_name(), s.default.derandomize, s.default.database)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT / "tests", env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["petals-chain-ci", "True", "None"]
    if not (os.environ.get("CI") or os.environ.get(STATUS_FILE_VAR)):  # this run: a local one
        assert not settings.default.derandomize and settings.default.database is not None
