"""Baselines: PETALS placement/routing, BPRR (CG-BP + WS-RR), whole-model-per-server, dispatch baselines."""

from petals_chain.algorithms.baselines.bprr import cg_bp_placement, ws_rr_route
from petals_chain.algorithms.baselines.dispatch import (DISPATCHERS, JIQDispatcher, JSQDispatcher, make_dispatcher,
                                                        SAJSQDispatcher, SEDDispatcher)
from petals_chain.algorithms.baselines.petals import (petals_cache_slots, petals_num_blocks, petals_placement,
                                                      petals_route, petals_throughput)
from petals_chain.algorithms.baselines.routing import Hop, route_service_time
from petals_chain.algorithms.baselines.whole_model import whole_model_placement

__all__ = [
    "Hop", "petals_placement", "petals_route", "petals_num_blocks", "petals_cache_slots", "petals_throughput",
    "cg_bp_placement", "ws_rr_route", "whole_model_placement", "route_service_time",
    "JSQDispatcher", "JIQDispatcher", "SEDDispatcher", "SAJSQDispatcher", "DISPATCHERS", "make_dispatcher",
]
