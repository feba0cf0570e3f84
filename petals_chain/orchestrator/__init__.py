"""The orchestrator (the paper's frontend): planner, JFFC dispatch, relay, OpenAI-compatible HTTP API."""

from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig, RequestError, Unavailable
from petals_chain.orchestrator.sampling import SamplingParams

__all__ = ["Orchestrator", "OrchestratorConfig", "RequestError", "Unavailable", "SamplingParams"]
