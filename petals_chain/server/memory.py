"""This server's memory budget ``M_j`` and what fits in it: ``s_m`` per block, ``s_c`` per KV slot, and
``floor((M_j - s_m m_j) / s_c)`` slots for ``m_j`` blocks (Eq. 3). The sizes themselves come from
:mod:`petals_chain.swarm.memory` (shared with the orchestrator, which plans with the same numbers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from petals_chain.server.kv_cache import DEFAULT_PAGE_SIZE, check_kv_cache, slot_tokens
from petals_chain.swarm.memory import block_bytes, cache_slot_bytes, capped_slots, check_device, slots_for_budget

CPU_MEMORY_FRACTION = 0.5  # default M_j on CPU: half of the RAM available at start
CUDA_HEADROOM_FRACTION = 0.05  # default M_j on CUDA: free memory minus max(1 GiB, 5 %) for activations
CUDA_HEADROOM_MIN_BYTES = 1 << 30
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup hierarchies are mounted
PROC_SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup in each hierarchy
_CGROUP_NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as 0x7ffffffffffff000 (v2 writes "max")


def _cgroup_int(path: Path) -> Optional[int]:
    """The number in a one-value cgroup file; None if unreadable or not a number ("max": no limit)."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if _is_number(text) else None


def _is_number(text: str) -> bool:
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses (a ValueError at the server's start)
    return text.isascii() and text.isdigit()


def _cgroup_stat(path: Path, key: str) -> int:
    """``key``'s value in a ``memory.stat`` file (0 if absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and _is_number(value.strip()):
                return int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def cgroup_memory_available() -> Optional[int]:
    """Bytes the memory cgroups of this process (its own and their ancestors', v1 or v2) still let it take: the least
    of ``limit - (usage - inactive page cache)`` over those with a limit; None where none limits memory.

    psutil reads /proc/meminfo, which a container shows for the whole host: in a 4 GiB container on a 128 GiB host the
    default budget was half the host's available RAM (up to 64 GiB), and the KV cache, allocated whole at start, got
    the server killed by the container's OOM killer."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    least: Optional[int] = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        # os.path's probes say False on any OSError; Path.is_dir() raised a PermissionError (a cgroup directory this
        # user may not search) or "File name too long" at the server's start
        if not controllers and os.path.isfile(CGROUP_ROOT / "cgroup.controllers"):  # v2 (not the hybrid layout's)
            root, files = CGROUP_ROOT, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            root, files = CGROUP_ROOT / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                   "total_inactive_file")
        else:
            continue
        here = root / rel.strip().lstrip("/")
        if ".." in here.parts or not os.path.isdir(here):  # a container sees its own cgroup as the mount's root
            here = root
        while True:
            limit = _cgroup_int(here / files[0])
            if limit is not None and limit < _CGROUP_NO_LIMIT:
                # page cache the kernel drops on demand (the model file just read) is not in use
                used = (_cgroup_int(here / files[1]) or 0) - _cgroup_stat(here / "memory.stat", files[2])
                left = max(0, limit - max(0, used))
                least = left if least is None else min(least, left)
            if here == root:
                break
            here = here.parent
    return least


def ram_available() -> int:
    """RAM this process may still take: what the host has available, or less where a cgroup limits memory."""
    import psutil

    free = int(psutil.virtual_memory().available)
    limited = cgroup_memory_available()
    return free if limited is None else min(free, limited)


def default_memory_bytes(device: str) -> int:
    """``M_j`` when the volunteer gives no limit: see CPU_MEMORY_FRACTION / CUDA_HEADROOM_* above (on CPU, of
    :func:`ram_available`: a container's limit counts)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return max(0, int(free - max(CUDA_HEADROOM_MIN_BYTES, CUDA_HEADROOM_FRACTION * free)))
    return int(ram_available() * CPU_MEMORY_FRACTION)


def check_device_budget(device: str, memory_bytes: int | None) -> None:
    """ValueError, in one line, for a device this machine lacks or a budget above what the device has free now (the
    KV cache is allocated whole at start: ``--memory-gb 20`` on a CPU host with less took the host's RAM)."""
    dev = check_device(device)
    if memory_bytes is None:
        return
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
    else:
        free = ram_available()  # a container's limit included
    if memory_bytes > free:
        raise ValueError(f"the memory budget ({memory_bytes / 2**30:.1f} GiB) exceeds the {free / 2**30:.1f} GiB "
                         f"{'free on ' + device if dev.type == 'cuda' else 'of RAM available'}: give a smaller "
                         f"--memory-gb (or none: a share of what is free)")


class MemoryBudget:
    """``M_j`` (``memory_bytes``) and ``s_m`` of this server's model, dtype and quantization; zero until
    :meth:`measure` (a server measures at start, when it knows its device)."""

    def __init__(self, config: Any, dtype: torch.dtype, quant: str = "none", cache_tokens_per_block: int = 0,
                 kv_cache: str = "slots", page_size: int = DEFAULT_PAGE_SIZE):
        if cache_tokens_per_block < 0:
            raise ValueError("--cache-tokens-per-block must be >= 0")
        check_kv_cache(kv_cache, page_size)
        self.config, self.dtype, self.quant = config, dtype, quant
        self.cache_tokens_per_block = cache_tokens_per_block
        self.kv_cache, self.page_size = kv_cache, page_size
        self.memory_bytes = 0
        self.s_m = 0
        self.adapter_bytes = 0  # LoRA adapters' bytes per block (their layer holding most), counted in s_m

    def measure(self, memory_bytes: Optional[int], device: str) -> None:
        """Fix ``M_j`` (the volunteer's limit, else :func:`default_memory_bytes`) and compute ``s_m`` (a block's
        weights and its LoRA adapters' tensors, :attr:`adapter_bytes`)."""
        self.memory_bytes = int(memory_bytes if memory_bytes is not None else default_memory_bytes(device))
        self.s_m = block_bytes(self.config, self.dtype, self.quant) + self.adapter_bytes

    def s_c(self, max_length: int) -> int:
        """Bytes of one KV slot: one block's K and V for one job of ``max_length`` tokens (paged mode: rounded up
        to whole pages, as the runner allocates them)."""
        return cache_slot_bytes(self.config, self.dtype, slot_tokens(self.kv_cache, max_length, self.page_size))

    def slots_for(self, num_blocks: int, max_length: int, cap: bool = True) -> int:
        """Eq. 3: ``floor((M_j - s_m m_j) / s_c)``, capped by ``--cache-tokens-per-block`` when set (and ``cap``)."""
        slots = slots_for_budget(self.memory_bytes, num_blocks, self.s_m, self.s_c(max_length))
        return capped_slots(slots, num_blocks, self.cache_tokens_per_block, max_length) if cap else slots

    def slots_for_one_job(self, num_blocks: int) -> int:
        """The fewest slots with which ``num_blocks`` blocks open a session: ``slots`` mode reserves a whole slot in
        each block; ``paged`` mode one slot's pages, shared among the blocks (a session of ``max_length /
        num_blocks`` tokens; the orchestrator plans paged chains by tokens)."""
        return max(1, num_blocks) if self.kv_cache == "slots" else 1

    def holds(self, num_blocks: int, max_length: int) -> bool:
        """Whether ``num_blocks`` blocks fit with the KV slots of at least one session (:meth:`slots_for_one_job`)."""
        return (self.s_m * num_blocks <= self.memory_bytes
                and self.slots_for(num_blocks, max_length) >= self.slots_for_one_job(num_blocks))
