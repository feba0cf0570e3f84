"""Plain data of the paper's system model (§2.1). No torch, no I/O.

Symbols and units (defined once here; everything else refers to these names):

* ``L`` = :attr:`ModelSpec.num_blocks` — number of service blocks (transformer layers).
* ``s_m`` = :attr:`ModelSpec.block_size` — memory of one block's parameters (any one memory unit,
  e.g. bytes or GB, used consistently with ``M_j`` and ``s_c``).
* ``s_c`` = :attr:`ModelSpec.cache_size` — memory of one *cache slot*: the KV cache of one block for
  one job at the swarm's ``max_length``.
* ``M_j`` = :attr:`ServerSpec.memory` — server ``j``'s memory budget (same unit as ``s_m``).
* ``tau_c_j`` = :attr:`ServerSpec.tau_c` — mean communication time of one job with server ``j``
  (seconds per job).
* ``tau_p_j`` = :attr:`ServerSpec.tau_p` — mean computation time of one block for one job on server
  ``j`` (seconds per block per job).
* ``a_j, m_j`` — first block (0-based here; the paper counts from 1) and number of blocks hosted by
  ``j``: :class:`Placement` maps a server name to ``(a_j, m_j)``.
* ``m_ij`` — blocks processed at ``j`` when ``j`` follows ``i`` on a chain (Eq. 2 and (3)).
* ``T_k`` = :attr:`Chain.service_time` (seconds per job, Eq. 2); ``mu_k = 1/T_k`` = :attr:`Chain.rate`
  (jobs per second); ``c_k`` = :attr:`Chain.capacity` (concurrent jobs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping


WHOLE_TOLERANCE = 1e-9  # a quotient this close below a whole number counts as it (see units_that_fit)


def units_that_fit(amount: float, unit: float) -> int:
    """``floor(amount / unit)``, the one rounding of Eq. 3 and Eq. 8 everywhere (GBP-CR, GCA, tuning, servers): a
    quotient within :data:`WHOLE_TOLERANCE` of a whole number counts as that number (``1.0 / 0.1`` is 10, where
    ``1.0 // 0.1`` is 9 and ``floor(1.0 / 0.1)`` 10: two roundings once let a tuned plan count a slot a server did
    not have). Array code adds the same tolerance before its ``np.floor``."""
    return math.floor(amount / unit + WHOLE_TOLERANCE)


@dataclass(frozen=True)
class ModelSpec:
    """A model as a chain of ``num_blocks`` blocks of ``block_size`` with ``cache_size`` per slot."""

    num_blocks: int  # L
    block_size: float  # s_m, memory unit
    cache_size: float  # s_c, memory unit per block per job

    def __post_init__(self) -> None:
        if int(self.num_blocks) != self.num_blocks or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if not (self.block_size > 0 and math.isfinite(self.block_size)):
            raise ValueError(f"block_size must be positive and finite, got {self.block_size!r}")
        if not (self.cache_size > 0 and math.isfinite(self.cache_size)):
            raise ValueError(f"cache_size must be positive and finite, got {self.cache_size!r}")


@dataclass(frozen=True)
class ServerSpec:
    """A server ``j``: memory budget ``M_j``, ``tau_c_j`` (s/job) and ``tau_p_j`` (s/block/job).

    ``block_limit`` (beyond the paper; 0 = none) is the volunteer's cap on hosted blocks (``--max-blocks``):
    ``m_j`` never exceeds it, and the memory it leaves free holds more cache slots (Eq. 3).
    """

    name: str
    memory: float  # M_j, same unit as ModelSpec.block_size
    tau_c: float  # seconds per job
    tau_p: float  # seconds per block per job
    block_limit: int = 0  # blocks at most (0: no cap)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("server name must be non-empty")
        for attr in ("memory", "tau_c", "tau_p"):
            value = getattr(self, attr)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{attr} of server {self.name!r} must be finite and >= 0, got {value!r}")
        if self.tau_c + self.tau_p <= 0:  # a chain of such servers would serve in no time (GBP-CR divides by it)
            raise ValueError(f"server {self.name!r} takes no time per job (tau_c = tau_p = 0)")
        if int(self.block_limit) != self.block_limit or self.block_limit < 0:
            raise ValueError(f"block_limit of server {self.name!r} must be an integer >= 0, got {self.block_limit!r}")

    def block_cap(self, model: ModelSpec) -> int:
        """Most blocks this server may host: ``L``, or its ``block_limit`` if smaller."""
        return min(model.num_blocks, self.block_limit) if self.block_limit > 0 else model.num_blocks

    def max_blocks(self, model: ModelSpec, capacity: int) -> int:
        """``m_j(c) = min(floor(M_j / (s_m + s_c c)), L)`` (Eq. 8), capped by ``block_limit``."""
        return min(units_that_fit(self.memory, model.block_size + model.cache_size * capacity), self.block_cap(model))

    def residual_slots(self, model: ModelSpec, num_blocks: int) -> int:
        """``M~_j = floor((M_j - s_m m_j) / s_c)`` cache slots left after hosting ``num_blocks`` (Eq. 3)."""
        return max(0, units_that_fit(self.memory - model.block_size * num_blocks, model.cache_size))


class Placement(Mapping[str, tuple[int, int]]):
    """Block placement: server name -> ``(a_j, m_j)`` with ``a_j`` 0-based. Servers without blocks are absent."""

    def __init__(self, spans: Mapping[str, tuple[int, int]] | None = None, num_blocks: int | None = None):
        self._spans: dict[str, tuple[int, int]] = {}
        for name, (start, count) in (spans or {}).items():
            start, count = int(start), int(count)
            if start < 0 or count < 1 or (num_blocks is not None and start + count > num_blocks):
                raise ValueError(f"invalid span for {name!r}: start={start}, num_blocks={count}, L={num_blocks}")
            self._spans[name] = (start, count)
        self.num_blocks = num_blocks

    def __getitem__(self, name: str) -> tuple[int, int]:
        return self._spans[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)

    def end(self, name: str) -> int:
        """One past the last block hosted by ``name`` (0-based, exclusive)."""
        start, count = self._spans[name]
        return start + count

    def coverage(self, num_blocks: int) -> list[int]:
        """How many servers host each block ``0..num_blocks-1``."""
        counts = [0] * num_blocks
        for start, count in self._spans.values():
            for b in range(start, min(start + count, num_blocks)):
                counts[b] += 1
        return counts

    def __repr__(self) -> str:
        return f"Placement({self._spans!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Placement):
            return self._spans == other._spans
        if isinstance(other, Mapping):
            return self._spans == dict(other)
        return NotImplemented


@dataclass(frozen=True)
class Chain:
    """A server chain ``k``: hops in order, blocks per hop, ``T_k`` and ``c_k``.

    ``spans[h] = (start, end)`` are the 0-based blocks ``[start, end)`` hop ``h`` processes; their
    lengths are ``blocks[h] = m_ij`` and together they cover ``0..L-1`` exactly once.
    """

    servers: tuple[str, ...]
    blocks: tuple[int, ...]  # m_ij per hop
    service_time: float  # T_k, seconds per job (Eq. 2)
    capacity: int  # c_k, concurrent jobs
    spans: tuple[tuple[int, int], ...] = field(default=())

    @property
    def rate(self) -> float:
        """``mu_k = 1 / T_k`` in jobs per second."""
        return 1.0 / self.service_time if self.service_time > 0 else math.inf
