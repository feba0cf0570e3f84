"""tau_p measurement (footnote 11 workload) and its on-disk cache."""

import json

import pytest

from petals_chain.server.runner import BlockRunner, NoCapacityError
from petals_chain.server.profiling import measure_tau_p
from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=4)


def test_tau_p_workload_counts_and_cache(model, tmp_path, monkeypatch):
    r = BlockRunner(model, 1, 2, num_slots=1, max_length=64, progress=False)
    calls = []
    real = r.forward
    monkeypatch.setattr(r, "forward", lambda sid, h, pos: calls.append((h.shape[1], pos)) or real(sid, h, pos))
    cache = tmp_path / "tau.json"
    tau = measure_tau_p(r, l_in=20, l_out=5, repeats=2, warmup=1, cache_path=cache)
    assert tau > 0
    # each job: prefill of l_in at 0, then l_out-1 single-token decodes at l_in, l_in+1, ...
    job = [(20, 0), (1, 20), (1, 21), (1, 22), (1, 23)]
    assert calls == job * 3
    assert r.slots_free == 1  # the profiling session was released
    data = json.loads(cache.read_text())
    (key, entry), = data.items()
    assert "l_in=20" in key and "l_out=5" in key and "float32" in key and "cpu" in key
    assert entry["tau_p"] == tau and len(entry["samples"]) == 2
    calls.clear()
    assert measure_tau_p(r, l_in=20, l_out=5, cache_path=cache) == tau and calls == []  # cache hit
    measure_tau_p(r, l_in=21, l_out=5, repeats=1, cache_path=cache)  # different workload -> new entry
    assert len(json.loads(cache.read_text())) == 2


def test_tau_p_from_path_and_compute_scale(model, tmp_path):
    # 4x expected. Two measurements taken apart compare a loaded moment with a quiet one (a stress run saw base
    # 4.9 ms, slow 5.9 ms: the base run was slowed 3x by the busy loops), so up to three fresh pairs are measured
    for attempt in range(3):
        cache = tmp_path / f"tau{attempt}.json"
        base = measure_tau_p(model, l_in=32, l_out=4, repeats=3, cache_path=cache)
        slow = measure_tau_p(model, l_in=32, l_out=4, repeats=3, compute_scale=4.0, cache_path=cache)
        assert len(json.loads(cache.read_text())) == 2
        if slow > 1.5 * base:
            break
    assert slow > 1.5 * base, (base, slow)


def test_emulated_compute_scale_keeps_the_device_busy_that_many_times_its_compute(model):
    """The mechanism alone, independent of the machine's load: the device stays busy ``compute_scale`` times the
    compute it just did (a sleep only ever lasts longer)."""
    import time

    from petals_chain.server.emulated import EmulatedRunner

    r = EmulatedRunner(model, 0, 1, num_slots=1, max_length=16, progress=False, compute_scale=4.0)
    took = []

    def work() -> int:
        t0 = time.perf_counter()
        acc = sum(i * i for i in range(20_000))
        took.append(time.perf_counter() - t0)
        return acc

    t0 = time.perf_counter()
    r._on_device(work)
    assert time.perf_counter() - t0 >= 4.0 * took[0] * 0.99


def test_tau_p_errors(model, tmp_path):
    r = BlockRunner(model, 0, 1, num_slots=1, max_length=16, progress=False)
    with pytest.raises(ValueError, match="max_length"):
        measure_tau_p(r, l_in=16, l_out=4, cache_path=tmp_path / "t.json")
    with pytest.raises(ValueError, match="l_out"):
        measure_tau_p(r, l_in=4, l_out=0, cache_path=tmp_path / "t.json")
    r.allocate("busy", 0, 1)
    with pytest.raises(NoCapacityError):
        measure_tau_p(r, l_in=4, l_out=2, cache_path=tmp_path / "t.json")
    (tmp_path / "bad.json").write_text("{not json")
    assert measure_tau_p(model, l_in=4, l_out=2, repeats=1, cache_path=tmp_path / "bad.json") > 0


def test_tau_p_is_cached_beside_the_models_and_derived_data(monkeypatch, tmp_path):
    """One per-user cache folder: tau_p.json went to ~/.cache/petals_chain, the models to ~/.cache/petals-chain."""
    from petals_chain.server.profiling import default_cache_path
    from petals_chain.swarm.registry import cache_dir

    monkeypatch.delenv("PETALS_CHAIN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_path() == cache_dir() / "tau_p.json" == tmp_path / ".cache" / "petals-chain" / "tau_p.json"
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_path() == tmp_path / "c" / "tau_p.json"
