"""This server's memory budget ``M_j`` and what fits in it: ``s_m`` per block, ``s_c`` per KV slot, and
``floor((M_j - s_m m_j) / s_c)`` slots for ``m_j`` blocks (Eq. 3). The sizes themselves come from
:mod:`petals_chain.swarm.memory` (shared with the orchestrator, which plans with the same numbers)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from petals_chain.server.kv_cache import DEFAULT_PAGE_SIZE, check_kv_cache, slot_tokens
from petals_chain.swarm.memory import block_bytes, cache_slot_bytes, capped_slots, check_device, slots_for_budget

CPU_MEMORY_FRACTION = 0.5  # default M_j on CPU: half of the RAM available at start
CUDA_HEADROOM_FRACTION = 0.05  # default M_j on CUDA: free memory minus max(1 GiB, 5 %) for activations
CUDA_HEADROOM_MIN_BYTES = 1 << 30


def default_memory_bytes(device: str) -> int:
    """``M_j`` when the volunteer gives no limit: see CPU_MEMORY_FRACTION / CUDA_HEADROOM_* above."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return max(0, int(free - max(CUDA_HEADROOM_MIN_BYTES, CUDA_HEADROOM_FRACTION * free)))
    import psutil

    return int(psutil.virtual_memory().available * CPU_MEMORY_FRACTION)


def check_device_budget(device: str, memory_bytes: int | None) -> None:
    """ValueError, in one line, for a device this machine lacks or a budget above what the device has free now (the
    KV cache is allocated whole at start: ``--memory-gb 20`` on a CPU host with less took the host's RAM)."""
    dev = check_device(device)
    if memory_bytes is None:
        return
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
    else:
        import psutil

        free = psutil.virtual_memory().available
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

    def measure(self, memory_bytes: Optional[int], device: str) -> None:
        """Fix ``M_j`` (the volunteer's limit, else :func:`default_memory_bytes`) and compute ``s_m``."""
        self.memory_bytes = int(memory_bytes if memory_bytes is not None else default_memory_bytes(device))
        self.s_m = block_bytes(self.config, self.dtype, self.quant)

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
