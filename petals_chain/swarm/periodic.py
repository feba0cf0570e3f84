"""``run_every``: the loop of a role's background task that does one round every few seconds until stopped."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable


async def run_every(stop: asyncio.Event, period_s: float, round_: Callable[[], Awaitable[None]],
                    logger: logging.Logger, what: str) -> None:
    """Await ``round_()`` now and then every ``period_s`` seconds until ``stop`` is set. A round that raises is
    logged (``what`` failed) and the next one runs as usual: one bad round must not end the task."""
    while not stop.is_set():
        try:
            await round_()
        except Exception:  # noqa: BLE001 - see the docstring
            logger.exception("%s failed", what)
        try:
            await asyncio.wait_for(stop.wait(), timeout=period_s)
        except asyncio.TimeoutError:
            pass
