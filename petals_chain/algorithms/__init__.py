"""Pure algorithms of the paper: GBP-CR, GCA, JFFC, Theorem 3.7 bounds, c tuning, and baselines."""

from petals_chain.model import Chain, ModelSpec, Placement, ServerSpec
from petals_chain.algorithms.bounds import exact_k2_response_time, response_time_bounds
from petals_chain.algorithms.gbp_cr import blocks_per_server, gbp_cr, gbp_cr_chain_count
from petals_chain.algorithms.gca import gca
from petals_chain.algorithms.jffc import FIFOQueue, JFFCDispatcher
from petals_chain.algorithms.tuning import max_capacity, tune_capacity
from petals_chain.algorithms.baselines import (DISPATCHERS, Hop, JIQDispatcher, make_dispatcher, JSQDispatcher, SAJSQDispatcher,
                                               SEDDispatcher, cg_bp_placement, petals_cache_slots,
                                               petals_num_blocks, petals_placement, petals_route,
                                               route_service_time, whole_model_placement, ws_rr_route)

__all__ = [
    "Chain", "ModelSpec", "Placement", "ServerSpec",
    "gbp_cr", "gbp_cr_chain_count", "blocks_per_server", "gca",
    "response_time_bounds", "exact_k2_response_time", "tune_capacity", "max_capacity",
    "JFFCDispatcher", "FIFOQueue",
    "JSQDispatcher", "JIQDispatcher", "SEDDispatcher", "SAJSQDispatcher", "DISPATCHERS", "make_dispatcher",
    "Hop", "petals_placement", "petals_route", "petals_num_blocks", "petals_cache_slots",
    "cg_bp_placement", "ws_rr_route", "whole_model_placement", "route_service_time",
]
