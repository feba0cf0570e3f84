"""Review of the container-aware CPU budget (server/memory.py): a cgroup tree the server cannot probe, or a file
with odd digits, is "no limit" (psutil's figure), never an exception at the server's start.

The cgroup files are written under ``tmp_path`` and the module is pointed at them: no real cgroup is touched."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import psutil
import pytest

from petals_chain.server import memory as server_memory


def _point_at(monkeypatch: pytest.MonkeyPatch, root, proc_cgroup) -> None:
    monkeypatch.setattr(server_memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(server_memory, "PROC_SELF_CGROUP", proc_cgroup)


def test_a_cgroup_path_the_server_cannot_probe_is_no_limit(tmp_path, monkeypatch):
    """``Path.is_dir()`` says False for a missing path only: a cgroup directory this user may not search raised a
    PermissionError, and a path the kernel calls too long an OSError, out of the server's start."""
    root = tmp_path / "cg"
    (root / "memory" / "locked" / "ctr").mkdir(parents=True)
    proc = tmp_path / "proc_self_cgroup"
    _point_at(monkeypatch, root, proc)
    proc.write_text("4:memory:/" + "x" * 300 + "\n")  # ENAMETOOLONG from the real file system
    assert server_memory.cgroup_memory_available() is None

    locked = str(root / "memory" / "locked")
    real_stat = os.stat

    def stat(path, *args, **kwargs):  # what a non-root user gets under a 0700 directory (root is never refused)
        if os.fspath(path).startswith(locked + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    proc.write_text("4:memory:/locked/ctr\n0::/locked/ctr\n")
    assert server_memory.cgroup_memory_available() is None
    (root / "cgroup.controllers").write_text("memory\n")  # the same under cgroup v2
    proc.write_text("0::/locked/ctr\n")
    assert server_memory.cgroup_memory_available() is None
    assert server_memory.ram_available() > 0


@pytest.mark.parametrize("limit,inactive,left", [("²", "0", None), ("1000000", "³", 1000000 - 10)])
def test_digits_that_int_refuses_are_not_numbers(tmp_path, monkeypatch, limit, inactive, left):
    """``str.isdigit()`` takes "²" and "³", which ``int()`` refuses: a ValueError at start. A limit that is not a
    plain number is no limit; a page-cache figure that is not one counts 0."""
    mem = tmp_path / "cg" / "memory"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (mem / "memory.usage_in_bytes").write_text("10\n")
    (mem / "memory.stat").write_text(f"total_inactive_file {inactive}\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("4:memory:/\n")
    _point_at(monkeypatch, tmp_path / "cg", proc)
    assert server_memory.cgroup_memory_available() == left
    # the host's figure fixed: the real one moves whenever another process (another xdist worker's) takes or frees
    # memory, so one read before ram_available()'s own could be the smaller
    host = 8 << 30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=host))
    assert server_memory.ram_available() == (host if left is None else min(host, left))
