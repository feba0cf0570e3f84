"""``GgufSource.load_reference`` (transformers' own load of a GGUF file, the suite's token-exactness reference) reads
the file once and builds gguf's tensor name map once: transformers parsed it twice and built the map once per
submodule (SmolLM2-135M: 35 s of CPU, now 17 s; the same weights)."""

from __future__ import annotations

import gguf
import torch
from transformers import AutoModelForCausalLM

from petals_chain.swarm.sources import resolve_source
from test_s31_sources import write_tiny_gguf


def test_the_reference_parses_its_gguf_once_and_loads_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", n_layers=3)
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    reads, maps = [], []

    def counting_reader(p, *a, **k):
        reads.append(str(p))
        return reader(p, *a, **k)

    def counting_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return name_map(arch, n_blocks)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)
    model = resolve_source(path).load_reference(torch.float32)
    assert reads == [str(path)], reads  # was twice: the config, then the tensors
    assert len(maps) == 1, len(maps)  # was once per module of the model (46 here)
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is counting_map  # put back
    monkeypatch.undo()
    plain = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    want, got = plain.state_dict(), model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
