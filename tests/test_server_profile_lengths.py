"""A tau_p workload longer than the model's positions is refused at start, naming the flags: the server joined the
swarm, announced itself and exited with a traceback when it profiled (the one-block runner refused the length)."""

from __future__ import annotations

import pytest

from petals_chain.server.config import ServerConfig
from petals_chain.server.server import Server


def test_a_profile_workload_longer_than_the_model_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--profile-l-in 4090 \+ --profile-l-out 16 exceeds max_position_embeddings"):
        Server(ServerConfig(model=str(tiny_model_dir), allow_any_client=True, profile_l_in=4090))
    # with --tau-p nothing is profiled: the same flags are fine
    Server(ServerConfig(model=str(tiny_model_dir), allow_any_client=True, profile_l_in=4090, tau_p=0.01))
