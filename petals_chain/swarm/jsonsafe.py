"""JSON without non-finite floats: what the orchestrator publishes and every dashboard serves."""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced by None (JSON has no inf/nan; browsers reject them), keys as
    strings and numpy scalars as Python numbers."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy scalar
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
