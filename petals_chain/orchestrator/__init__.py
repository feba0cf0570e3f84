"""The orchestrator (the paper's frontend): planner, JFFC dispatch, relay, OpenAI-compatible HTTP API.

Attributes are imported lazily so that ``python -m petals_chain.orchestrator --help`` stays fast.
"""

from typing import Any

__all__ = ["Orchestrator", "OrchestratorConfig", "RequestError", "Unavailable", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("Orchestrator", "OrchestratorConfig", "RequestError", "Unavailable"):
        from petals_chain.orchestrator import core

        return getattr(core, name)
    if name == "SamplingParams":
        from petals_chain.orchestrator.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
