"""'JFFC only' baseline: every server that fits the whole model hosts all L blocks; one chain each."""

from __future__ import annotations

from typing import Sequence

from petals_chain.model import Chain, ModelSpec, Placement, ServerSpec


def whole_model_placement(servers: Sequence[ServerSpec], model: ModelSpec) -> tuple[Placement, list[Chain]]:
    """Servers with room for all L blocks and one job host the model; capacity
    ``floor((M_j - s_m L)/(s_c L))``, service time ``tau_c_j + tau_p_j L``. Others get nothing."""
    L = model.num_blocks
    spans, chains = {}, []
    for s in servers:
        fits = s.memory >= model.block_size * L and s.block_cap(model) == L
        cap = s.residual_slots(model, L) // L if fits else 0
        if cap >= 1:
            spans[s.name] = (0, L)
            chains.append(Chain(servers=(s.name,), blocks=(L,), service_time=s.tau_c + s.tau_p * L,
                                capacity=cap, spans=((0, L),)))
    return Placement(spans, num_blocks=L), chains
