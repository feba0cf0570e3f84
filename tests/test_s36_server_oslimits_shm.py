"""A full (or unwritable) ``/dev/shm``: the server and the orchestrator refuse to start with one line naming it and a
remedy (exit 2), not a 47-line traceback from hivemind's import ending in "OSError: [Errno 28] No space left on
device"."""

from __future__ import annotations

import errno
import multiprocessing.context

import pytest


@pytest.mark.parametrize("role", ["orchestrator", "server"])
def test_a_full_dev_shm_is_one_clear_error_at_start(monkeypatch, capsys, role):
    def full(self, *args, **kwargs):  # sem_open in a full /dev/shm
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(multiprocessing.context.BaseContext, "Lock", full)
    if role == "orchestrator":
        from petals_chain.orchestrator.__main__ import main
    else:
        from petals_chain.server.__main__ import main
    assert main(["--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert f"the {role} cannot create a semaphore in /dev/shm (No space left on device)" in err, err
    assert "--shm-size" in err and "Traceback" not in err, err
