"""Pre-allocated KV-cache slots in the attention's native layout, and a transformers ``Cache`` over them.

One *slot* is the K and V of one decoder layer for one job at ``max_length`` tokens (``s_c`` bytes).
:class:`SlotPool` allocates every slot once, as two tensors ``[num_slots, kv_heads, max_length, head_dim]``;
a session holds one slot per block it processes for its whole life. :class:`SlotCache` is what the decoder
layers see during one step: ``update`` writes the new K/V in place at the step's positions and returns views
of the valid prefix, so a decode step costs no O(L) copy (PETALS concatenates the whole past per token).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.cache_utils import Cache


class NoCapacityError(RuntimeError):
    """The server has too few free cache slots for the requested span."""


class SlotPool:
    """``num_slots`` KV slots allocated up front; hands out and takes back slot indices, never over-commits.

    Not thread-safe on its own: the owner (the block runner) serialises calls.
    """

    def __init__(self, num_slots: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        for name, v in (("num_slots", num_slots), ("num_kv_heads", num_kv_heads), ("max_length", max_length),
                        ("head_dim", head_dim)):
            if int(v) != v or v < (0 if name == "num_slots" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'num_slots' else 'positive'} "
                                 f"integer, got {v!r}")
        self.num_slots, self.max_length = int(num_slots), int(max_length)
        shape = (self.num_slots, int(num_kv_heads), self.max_length, int(head_dim))
        # Zero-filled so that every page is really committed now, not at first use.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))

    @property
    def slots_free(self) -> int:
        return len(self._free)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (K and V): ``s_c``."""
        per = self.keys[0].numel() * self.keys.element_size() if self.num_slots else 0
        return 2 * per

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` slots, or raise :class:`NoCapacityError` and take none."""
        if int(n) != n or n < 1:
            raise ValueError(f"number of slots must be a positive integer, got {n!r}")
        if n > len(self._free):
            raise NoCapacityError(f"no capacity: {n} cache slot(s) needed, {len(self._free)} of "
                                  f"{self.num_slots} free")
        taken = [self._free.pop() for _ in range(int(n))]
        return taken

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copy the K/V of the first ``length`` positions of slot ``src`` into slot ``dst``."""
        self.keys[dst, :, :length].copy_(self.keys[src, :, :length])
        self.values[dst, :, :length].copy_(self.values[src, :, :length])

    def release(self, slots: list[int]) -> None:
        """Give slots back (each exactly once)."""
        free = set(self._free)
        for s in slots:
            if not 0 <= s < self.num_slots or s in free:
                raise ValueError(f"slot {s} is not allocated")
            free.add(s)
        self._free.extend(reversed(slots))


class SlotCache(Cache):
    """The KV cache of ONE session for ONE step, over its slots of a :class:`SlotPool`.

    ``slot_of`` maps a layer's global index (``self_attn.layer_idx``) to the session's slot for that layer;
    ``position`` is where the step's tokens start and ``n_tokens`` how many there are. Positions before
    ``position`` are the session's valid prefix; anything after it is stale (rollback) and never read.
    """

    def __init__(self, pool: SlotPool, slot_of: Mapping[int, int], position: int, n_tokens: int):
        super().__init__(layers=[])
        self.pool, self.slot_of = pool, dict(slot_of)
        self.position, self.n_tokens = int(position), int(n_tokens)
        if self.position + self.n_tokens > pool.max_length:
            raise ValueError(f"positions up to {self.position + self.n_tokens} exceed max_length {pool.max_length}")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, kv_heads, n, head_dim]`` K/V at the step's positions; return K/V of positions ``[0, end)``."""
        slot = self.slot_of[layer_idx]
        end = self.position + key_states.shape[-2]
        self.pool.keys[slot, :, self.position:end].copy_(key_states[0])
        self.pool.values[slot, :, self.position:end].copy_(value_states[0])
        return self.pool.keys[slot:slot + 1, :, :end], self.pool.values[slot:slot + 1, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens already cached before this step."""
        return self.position

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.position + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.pool.max_length

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.slot_of)
