"""Verified chains: who is lying when two servers holding the same blocks disagree, and when to ban one.

The orchestrator re-runs a sample of hop steps on a second server holding the same span (an *audit*) and
compares the two outputs. Agreement within the tolerance clears both. A disagreement is broken by a third
server (:func:`verdict`): the server in the minority gets a *strike*; without a third server, or when all three
disagree, nobody does. Strikes decay exponentially (:class:`StrikeBook`, half-life in seconds), so rare float
accidents never add up, while a server that keeps lying crosses the ban threshold within a few audits of its
bad replies. Pure logic: the caller runs the servers and measures the differences.
"""

from __future__ import annotations

import math
from collections.abc import Container, Hashable
from dataclasses import dataclass


def verdict(primary_vs_auditor: bool, primary_vs_referee: bool | None, auditor_vs_referee: bool | None
            ) -> tuple[str, ...]:
    """Which of ``("primary", "auditor", "referee")`` to strike, given whether each pair agreed (``None``: the
    referee was not asked or could not answer). Agreement clears everyone; a 2-1 split strikes the one; no
    referee, or three different answers, strike nobody (the caller may count it as inconclusive)."""
    if primary_vs_auditor:
        return ()
    if primary_vs_referee is None or auditor_vs_referee is None:
        return ()
    if auditor_vs_referee and not primary_vs_referee:
        return ("primary",)
    if primary_vs_referee and not auditor_vs_referee:
        return ("auditor",)
    return ()


@dataclass
class _Score:
    value: float = 0.0
    at: float = 0.0
    strikes: int = 0  # since start, not decayed
    audits: int = 0  # audits this server took part in (as primary, auditor or referee)


class StrikeBook:
    """Strikes per server, decaying with ``half_life_s``; a server whose decayed score reaches ``threshold`` is
    to be banned (:meth:`strike` returns True once per crossing)."""

    def __init__(self, threshold: float = 3.0, half_life_s: float = 3600.0):
        if not (threshold > 0 and math.isfinite(threshold)):
            raise ValueError(f"threshold must be positive, got {threshold!r}")
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s!r}")
        self.threshold, self.half_life_s = float(threshold), float(half_life_s)
        self._scores: dict[Hashable, _Score] = {}
        self.banned: set[Hashable] = set()

    def _decayed(self, s: _Score, now: float) -> float:
        return s.value * 0.5 ** (max(0.0, now - s.at) / self.half_life_s)

    def score(self, server: Hashable, now: float) -> float:
        s = self._scores.get(server)
        return 0.0 if s is None else self._decayed(s, now)

    def audited(self, server: Hashable) -> None:
        """``server`` took part in an audit (whatever its outcome)."""
        self._scores.setdefault(server, _Score()).audits += 1

    def strike(self, server: Hashable, now: float, weight: float = 1.0) -> bool:
        """Add a strike; True if ``server`` just reached the threshold (it is then in :attr:`banned`)."""
        s = self._scores.setdefault(server, _Score())
        s.value = self._decayed(s, now) + weight
        s.at = now
        s.strikes += 1
        if s.value >= self.threshold and server not in self.banned:
            self.banned.add(server)
            return True
        return False

    def forget(self, server: Hashable) -> None:
        """Drop ``server``'s record and ban (an operator's pardon)."""
        self._scores.pop(server, None)
        self.banned.discard(server)

    def __len__(self) -> int:
        return len(self._scores)

    def prune(self, keep: Container[Hashable], now: float, below: float = 0.01) -> list[Hashable]:
        """Forget each server not in ``keep`` (those known now), not banned, whose decayed score is under ``below``
        strikes (audits of a long run met every peer id its volunteers ever had); returns those forgotten."""
        gone = [k for k, s in self._scores.items()
                if k not in keep and k not in self.banned and self._decayed(s, now) < below]
        for k in gone:
            del self._scores[k]
        return gone

    def snapshot(self, server: Hashable, now: float) -> dict:
        s = self._scores.get(server, _Score())
        return {"audits": s.audits, "strikes": s.strikes, "score": round(self._decayed(s, now), 4),
                "banned": server in self.banned}


__all__ = ["verdict", "StrikeBook"]
