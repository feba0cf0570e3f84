"""A tau_p cache that cannot be written (a read-only ~/.cache, --profile-cache naming a path under a file): the
measurement stands and the volunteer is told, instead of the server exiting with a traceback after profiling."""

from __future__ import annotations

import logging

from petals_chain.server.profiling import measure_tau_p
from petals_chain.swarm.tiny_model import build_tiny_model


def test_an_unwritable_tau_p_cache_is_said_not_fatal(tmp_path, caplog):
    model = build_tiny_model(tmp_path / "tiny", family="llama", num_layers=2, seed=0)
    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "tau_p.json"  # its directory cannot be made: OSError on every write
    with caplog.at_level(logging.WARNING, logger="petals_chain.server.profiling"):
        tau_p = measure_tau_p(model, 8, 4, repeats=1, warmup=0, cache_path=cache)
    assert tau_p > 0
    assert any("cannot cache tau_p" in r.getMessage() and str(cache) in r.getMessage() for r in caplog.records)
