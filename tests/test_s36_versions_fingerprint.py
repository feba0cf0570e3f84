"""A swarm of mixed versions: peers of petals-chain before commit 14a2ac8 fingerprint a model by samples of its
weights (the first and last 4 KiB of each tensor), later ones by every byte. For the very same model an older
server announced another fingerprint, and a current orchestrator refused it as a server of "model 5cf830432cfe50ee,
not this swarm's 08b59b65b88402fa" (and an older orchestrator said the same of current servers): nothing said the
peer was merely too old. The literals below are what revision 3514bfb computes for the same files."""

from __future__ import annotations

from pathlib import Path

import pytest

from petals_chain.swarm.sources import fingerprint_problem, resolve_source
from test_s31_sources import write_tiny_gguf

# ``python -c "from petals_chain.swarm.sources import resolve_source; print(resolve_source(PATH).fingerprint)"`` run
# with PYTHONPATH at a copy of revision 3514bfb (400 commits before session 36), PATH each model below
OLD_TINY_LLAMA = "5cf830432cfe50ee"  # conftest's tiny_model_dir (build_tiny_model, llama, 4 layers, seed 0)
OLD_TINY_GGUF = "9a3b400740174306"  # test_s31_sources.write_tiny_gguf with its defaults


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own user cache (GGUF metadata and weight digests are cached there)."""
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))


def test_an_old_servers_fingerprint_of_an_hf_model_is_recognized(tiny_model_dir):
    src = resolve_source(tiny_model_dir)
    assert src.legacy_fingerprint == OLD_TINY_LLAMA
    assert src.fingerprint != OLD_TINY_LLAMA  # every byte is hashed now: the two schemes differ
    problem = fingerprint_problem(OLD_TINY_LLAMA, src.fingerprint, src.legacy_fingerprint)
    assert "older petals-chain" in problem and "upgrade" in problem and OLD_TINY_LLAMA in problem
    assert "not this swarm's" not in problem


def test_an_old_servers_fingerprint_of_a_gguf_is_recognized(tmp_path):
    src = resolve_source(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert src.legacy_fingerprint == OLD_TINY_GGUF
    assert "upgrade" in fingerprint_problem(OLD_TINY_GGUF, src.fingerprint, src.legacy_fingerprint)


def test_another_model_and_the_same_one_are_told_as_before():
    assert fingerprint_problem("aaaa", "aaaa", "bbbb") == ""
    assert fingerprint_problem("cccc", "aaaa", "bbbb") == "it serves model cccc, not this swarm's aaaa"
    assert fingerprint_problem("", "aaaa", "bbbb") == "it serves model (unknown), not this swarm's aaaa"
    assert fingerprint_problem("", "aaaa", "") == "it serves model (unknown), not this swarm's aaaa"


def test_an_old_peer_is_refused_whatever_its_weights(tmp_path):
    """The legacy fingerprint only names an older peer, it admits none: a byte changed mid-tensor keeps the sampled
    fingerprint (why it was replaced), so such a peer is told to upgrade, and is refused until it has."""
    path = write_tiny_gguf(tmp_path / "a.gguf")
    original = resolve_source(path)
    fp, legacy = original.fingerprint, original.legacy_fingerprint
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    other = tmp_path / "b.gguf"
    other.write_bytes(bytes(data))
    changed = resolve_source(other)
    assert changed.fingerprint != fp
    assert changed.legacy_fingerprint == legacy  # the byte is outside the samples
    assert "upgrade" in fingerprint_problem(legacy, changed.fingerprint, changed.legacy_fingerprint)
    assert fingerprint_problem(fp, changed.fingerprint, changed.legacy_fingerprint).startswith("it serves model")
