"""In-process emulation of wide-area links and slower accelerators (no ``tc netem`` on our testbeds).

* ``rtt_ms``: every RPC round trip between a client and this server takes ``rtt_ms`` longer. The server
  sleeps ``rtt_ms/2`` after receiving each request message and ``rtt_ms/2`` before sending each reply
  (so one session step, one ping or one info call costs one full extra RTT; chunked messages pay once).
* ``compute_scale``: compute is stretched to ``compute_scale`` times its measured duration by sleeping
  ``(compute_scale - 1) * elapsed`` after it (values < 1 cannot speed anything up and are refused).

Both knobs are published in the server record, so emulated results are never mistaken for real hardware.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Emulation:
    rtt_ms: float = 0.0
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise ValueError(f"emulate_rtt_ms must be finite and >= 0, got {self.rtt_ms}")
        if not (math.isfinite(self.compute_scale) and self.compute_scale >= 1.0):
            raise ValueError(f"emulate_compute_scale must be finite and >= 1, got {self.compute_scale}")

    @property
    def active(self) -> bool:
        return self.rtt_ms > 0 or self.compute_scale > 1.0

    async def half_rtt(self) -> None:
        """Sleep half of the emulated round-trip time (call once per direction)."""
        if self.rtt_ms > 0:
            await asyncio.sleep(self.rtt_ms / 2000.0)

    def extra_compute_s(self, elapsed_s: float) -> float:
        """Extra seconds to wait after a compute of ``elapsed_s`` seconds."""
        return max(0.0, (self.compute_scale - 1.0) * elapsed_s)

    async def stretch(self, elapsed_s: float) -> None:
        extra = self.extra_compute_s(elapsed_s)
        if extra > 0:
            await asyncio.sleep(extra)

    def scaled_tau_p(self, tau_p: float) -> float:
        """tau_p as seen by the swarm: the measured value times ``compute_scale``."""
        return tau_p * self.compute_scale
