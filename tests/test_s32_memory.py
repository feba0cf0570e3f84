"""A volunteer's memory budget: the CPU default and the ``--memory-gb`` check honour a container's memory limit
(cgroup v1 and v2), and ServerConfig names a memory_bytes it cannot use.

The cgroup files are written under ``tmp_path`` and the module is pointed at them: no real cgroup is touched."""

from __future__ import annotations

import math

import psutil
import pytest

from petals_chain.server import memory as server_memory
from petals_chain.server.config import ServerConfig

GiB = 1 << 30
V1_NO_LIMIT = 9223372036854771712  # what cgroup v1 writes for "no limit"


def _point_at(monkeypatch: pytest.MonkeyPatch, root, proc_cgroup) -> None:
    # raising=False: the test must fail (not error) on code that reads no cgroup at all
    monkeypatch.setattr(server_memory, "CGROUP_ROOT", root, raising=False)
    monkeypatch.setattr(server_memory, "PROC_SELF_CGROUP", proc_cgroup, raising=False)


def _v2(tmp_path, limit: str, current: int, inactive_file: int, rel: str = "docker/abc", make_dir: bool = True):
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    here = root / rel
    if make_dir:
        here.mkdir(parents=True)
    target = here if make_dir else root  # a container sees its own cgroup as the root of the mount
    (target / "memory.max").write_text(f"{limit}\n")
    (target / "memory.current").write_text(f"{current}\n")
    (target / "memory.stat").write_text(f"anon {current}\nfile 0\nactive_file 7\ninactive_file {inactive_file}\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"0::/{rel}\n")
    return root, proc


def _v1(tmp_path, limit: int, usage: int, inactive_file: int, rel: str = "docker/abc", make_dir: bool = True):
    root = tmp_path / "cgroup"
    mem = root / "memory"
    target = mem / rel if make_dir else mem
    target.mkdir(parents=True)
    (target / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (target / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (target / "memory.stat").write_text(f"cache 5\ninactive_file 3\ntotal_inactive_file {inactive_file}\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"12:pids:/{rel}\n4:memory:/{rel}\n1:name=systemd:/{rel}\n0::/{rel}\n")
    return root, proc


def _host_available() -> int:
    return psutil.virtual_memory().available


@pytest.mark.parametrize("layout", ["v2", "v2-namespaced", "v1", "v1-namespaced"])
def test_the_cpu_default_budget_is_half_of_what_a_container_limit_leaves(tmp_path, monkeypatch, layout):
    """A server in a container of 1 GiB on a bigger host took half of the host's available RAM as M_j and allocated
    it whole at start (psutil reads /proc/meminfo, the host's): the container was OOM-killed."""
    limit, used, reclaimable = GiB, 300 << 20, 100 << 20
    if _host_available() < 4 * GiB:
        pytest.skip("the host has too little RAM available for the limit to be the smaller")
    namespaced = layout.endswith("namespaced")
    if layout.startswith("v2"):
        root, proc = _v2(tmp_path, str(limit), used, reclaimable, make_dir=not namespaced)
    else:
        root, proc = _v1(tmp_path, limit, used, reclaimable, make_dir=not namespaced)
    _point_at(monkeypatch, root, proc)
    left = limit - (used - reclaimable)  # page cache the kernel reclaims on demand is not in use
    assert server_memory.default_memory_bytes("cpu") == int(left * server_memory.CPU_MEMORY_FRACTION)
    with pytest.raises(ValueError, match="of RAM available"):  # --memory-gb 2 in a 1 GiB container
        server_memory.check_device_budget("cpu", 2 * GiB)
    server_memory.check_device_budget("cpu", left // 2)  # within the limit: accepted


def test_an_ancestors_limit_counts_and_no_limit_changes_nothing(tmp_path, monkeypatch):
    """The least limit on the way to the root applies (a pod's limit over its container's); "max" and cgroup v1's
    no-limit value leave psutil's figure as it was."""
    if _host_available() < 4 * GiB:
        pytest.skip("the host has too little RAM available for the limit to be the smaller")
    root, proc = _v2(tmp_path, "max", 10 << 20, 0, rel="pod/ctr")
    (root / "pod" / "memory.max").write_text(f"{GiB}\n")
    (root / "pod" / "memory.current").write_text(f"{200 << 20}\n")
    (root / "pod" / "memory.stat").write_text("inactive_file 0\n")
    _point_at(monkeypatch, root, proc)
    assert server_memory.cgroup_memory_available() == GiB - (200 << 20)
    assert server_memory.default_memory_bytes("cpu") == int((GiB - (200 << 20)) * server_memory.CPU_MEMORY_FRACTION)

    unlimited = tmp_path / "v2max"
    unlimited.mkdir()
    _point_at(monkeypatch, *_v2(unlimited, "max", 5, 0))
    assert server_memory.cgroup_memory_available() is None
    unlimited = tmp_path / "v1max"
    unlimited.mkdir()
    _point_at(monkeypatch, *_v1(unlimited, V1_NO_LIMIT, 5, 0))
    assert server_memory.cgroup_memory_available() is None


def test_unreadable_or_odd_cgroup_files_are_no_limit(tmp_path, monkeypatch):
    """No /proc/self/cgroup (not Linux), a line without the memory controller, garbage in the files: no limit, and
    never an exception at start."""
    _point_at(monkeypatch, tmp_path / "none", tmp_path / "missing")
    assert server_memory.cgroup_memory_available() is None
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("garbage\n3:cpu,cpuacct:/x\n\n")
    _point_at(monkeypatch, tmp_path, proc)
    assert server_memory.cgroup_memory_available() is None
    root, proc = _v2(tmp_path / "g", "lots", 1, 0)
    _point_at(monkeypatch, root, proc)
    assert server_memory.cgroup_memory_available() is None
    # usage above the limit (the kernel is reclaiming): nothing left, not a negative budget
    root, proc = _v1(tmp_path / "h", GiB, 2 * GiB, 0)
    _point_at(monkeypatch, root, proc)
    assert server_memory.cgroup_memory_available() == 0


@pytest.mark.parametrize("value", [float("nan"), math.inf, -math.inf, "8GB", True, 0, -1, [8]])
def test_server_config_names_a_memory_budget_it_cannot_use(value):
    """ServerConfig(memory_bytes=nan) failed with "cannot convert float NaN to integer", inf with an OverflowError,
    "8GB" with int()'s message: none named the option."""
    with pytest.raises(ValueError, match="memory_bytes"):
        ServerConfig(model="m", memory_bytes=value).validate()


def test_server_config_takes_a_positive_budget_or_none():
    for value in (None, 1, 2 * GiB, 1.5e9):
        ServerConfig(model="m", memory_bytes=value).validate()


@pytest.mark.parametrize("kv_cache,max_length,page_size", [("paged", 100, 16), ("slots", 100, 16), ("paged", 30, 64)])
def test_the_budget_counts_what_the_runner_allocates(tiny_model_factory, kv_cache, max_length, page_size):
    """No under-count (an OOM on a GPU) and no waste: ``s_m`` per block and ``s_c`` per slot (paged: ``max_length``
    rounded up to whole pages) are the bytes of the runner's blocks and KV pool, for a GQA model (2 KV heads of 4)
    in bfloat16. Measured on SmolLM2 (3 KV heads of 9) in fp32/fp16/bf16 alike: ratio 1.000."""
    import torch

    from petals_chain.server.memory import MemoryBudget
    from petals_chain.server.runner import BlockRunner
    from petals_chain.swarm.checkpoint import load_config

    path = tiny_model_factory("qwen2", num_layers=4)
    budget = MemoryBudget(load_config(path), torch.bfloat16, kv_cache=kv_cache, page_size=page_size)
    budget.measure(10 * GiB, "cpu")
    slots = 3
    r = BlockRunner(path, 1, 2, slots, max_length, dtype="bfloat16", kv_cache=kv_cache, page_size=page_size,
                    progress=False, batching=False)
    try:
        assert r.blocks_bytes == 2 * budget.s_m
        assert r.pool.nbytes == slots * budget.s_c(max_length) == slots * r.s_c
    finally:
        r.close()
