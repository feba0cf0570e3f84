"""In-process emulation for testbeds on one machine (no ``tc netem`` here): what a server pretends to be.

Slower links and devices:

* ``rtt_ms``: every RPC round trip between a client and this server takes ``rtt_ms`` longer. The server
  sleeps ``rtt_ms/2`` after receiving each request message and ``rtt_ms/2`` before sending each reply
  (so one session step, one ping or one info call costs one full extra RTT; chunked messages pay once).
* ``compute_scale``: compute is stretched to ``compute_scale`` times its measured duration by holding the
  device ``(compute_scale - 1) * elapsed`` longer (values < 1 cannot speed anything up and are refused).
* ``step_ms``, ``prefill_ms_per_token``, ``decode_ms``: the footnote-11 compute model ``t_o + t_I l_I`` per
  block for a prefill and ``t_O`` per block per decoded token, added after each step's real compute
  (``t_o`` once per session, on its first step).

Faults, for chaos runs (a misbehaving server on purpose):

* ``reply_fault`` ``nan`` | ``shape`` at ``reply_fault_rate``: that fraction of step replies (evenly spread:
  reply k is faulty when ``floor(k * rate)`` grows) carries NaN in its last token, or a hidden dimension one
  short (``[1, n, hidden - 1]``), or (``noise``, ``--emulate-faulty-rate``) plausible hidden states with Gaussian
  noise of :data:`NOISE_SCALE` times their RMS added: a wrong answer that passes every validity check, which only
  an audit against another server catches. The server's own state stays right; only the reply is wrong.
  ``push``: the reply is right and the noised copy goes to the next hop (push relay): a server that would let the
  next hop take the blame for its lie.
* ``tau_p_lie``: the server announces a ``tau_p`` this many times smaller (better) than it measured, while
  it computes at its real speed.

Every knob is published in the server record, so emulated results are never mistaken for real hardware.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

REPLY_FAULTS = ("none", "nan", "shape", "noise", "push")
NOISE_SCALE = 0.1  # ``noise`` replies: Gaussian noise of this fraction of the reply's RMS, per element


@dataclass(frozen=True)
class Emulation:
    rtt_ms: float = 0.0
    compute_scale: float = 1.0
    step_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    decode_ms: float = 0.0
    reply_fault: str = "none"
    reply_fault_rate: float = 0.0
    tau_p_lie: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise ValueError(f"emulate_rtt_ms must be finite and >= 0, got {self.rtt_ms}")
        if not (math.isfinite(self.compute_scale) and self.compute_scale >= 1.0):
            raise ValueError(f"emulate_compute_scale must be finite and >= 1, got {self.compute_scale}")
        for name in ("step_ms", "prefill_ms_per_token", "decode_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"emulate_{name} must be finite and >= 0, got {v}")
        if self.reply_fault not in REPLY_FAULTS:
            raise ValueError(f"emulate_reply_fault must be one of {REPLY_FAULTS}, got {self.reply_fault!r}")
        if not (0.0 <= self.reply_fault_rate <= 1.0):
            raise ValueError(f"emulate_reply_fault_rate must be in [0, 1], got {self.reply_fault_rate}")
        if not (math.isfinite(self.tau_p_lie) and self.tau_p_lie > 0):
            raise ValueError(f"emulate_tau_p_lie must be finite and > 0, got {self.tau_p_lie}")

    @property
    def active(self) -> bool:
        return (self.rtt_ms > 0 or self.compute_scale > 1.0 or self.delays or self.faults
                or self.tau_p_lie != 1.0)

    @property
    def delays(self) -> bool:
        """Whether the footnote-11 compute model adds time to steps."""
        return self.step_ms > 0 or self.prefill_ms_per_token > 0 or self.decode_ms > 0

    @property
    def faults(self) -> bool:
        """Whether some step replies are corrupted."""
        return self.reply_fault != "none" and self.reply_fault_rate > 0

    async def half_rtt(self) -> None:
        """Sleep half of the emulated round-trip time (call once per direction)."""
        if self.rtt_ms > 0:
            await asyncio.sleep(self.rtt_ms / 2000.0)

    def step_delay_s(self, first_step: bool, num_blocks: int, num_tokens: int) -> float:
        """Footnote-11 time of one step through ``num_blocks`` blocks (added after the real compute)."""
        ms = self.step_ms if first_step else 0.0
        ms += (self.prefill_ms_per_token if num_tokens > 1 else self.decode_ms) * num_tokens
        return ms * num_blocks / 1000.0

    def reference_job_delay_s(self, l_in: int, l_out: int) -> float:
        """Footnote-11 time one block adds to the tau_p reference job, as the profiler runs it: a prefill of ``l_in``
        tokens, then ``l_out - 1`` one-token steps."""
        return self.step_delay_s(True, 1, l_in) + max(0, l_out - 1) * self.step_delay_s(False, 1, 1)

    def scaled_tau_p(self, tau_p: float) -> float:
        """tau_p of the emulated device: the measured value times ``compute_scale``."""
        return tau_p * self.compute_scale

    def announced_tau_p(self, tau_p: float) -> float:
        """tau_p as this server announces it: :meth:`scaled_tau_p`, divided by ``tau_p_lie``."""
        return self.scaled_tau_p(tau_p) / self.tau_p_lie

    def record_fields(self) -> dict:
        """The server record's emulation fields (see :class:`~petals_chain.swarm.records.ServerRecord`)."""
        return {"emulate_rtt_ms": float(self.rtt_ms), "emulate_compute_scale": float(self.compute_scale),
                "emulate_reply_fault": self.reply_fault, "emulate_reply_fault_rate": float(self.reply_fault_rate),
                "emulate_tau_p_lie": float(self.tau_p_lie)}
