"""Model sources given bad input, and fingerprints that see every weight byte.

* A config.json with sizes that are not positive integers, or that the weights do not match (block count, tensor
  shapes), is a one-line ValueError naming the folder (exit 2 at the command line), not a traceback at start or once
  a block is assigned, nor a server announcing a model of 10^9 blocks.
* A corrupt or truncated safetensors file is a ValueError naming the file (safetensors raised its own error type).
* One changed byte in the middle of a tensor changes the fingerprint (only 4 KiB at each end of a tensor were hashed,
  so a server with a corrupted file joined the others' namespace and computed wrong tokens in their chains).
* A GGUF quantization type the loader cannot read is named (it was called a corrupt or truncated file).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from petals_chain.swarm import sources
from petals_chain.swarm.sources import GGUFSource, HFSource


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own user cache (GGUF metadata and weight digests are cached there)."""
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))


def write_tiny_gguf(path: Path, n_layers: int = 2, hidden: int = 32, ff: int = 512, vocab: int = 64, *,
                    block_count: int | None = None, meta_hidden: int | None = None) -> Path:
    """A tiny Llama GGUF (Q4_1 linears, F32 norms and embeddings) written with the ``gguf`` package; the
    metadata's block count and hidden size can be made to disagree with the tensors."""
    import gguf

    rng = np.random.default_rng(0)
    heads = 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers if block_count is None else block_count)
    w.add_context_length(128)
    w.add_embedding_length(hidden if meta_hidden is None else meta_hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")

    def tensor(name: str, shape: tuple[int, ...], quantized: bool = False) -> None:
        a = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if quantized:
            q = gguf.quantize(a, gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, a)

    tensor("token_embd.weight", (vocab, hidden))
    tensor("output_norm.weight", (hidden,))
    for i in range(n_layers):
        for name in ("attn_norm", "ffn_norm"):
            tensor(f"blk.{i}.{name}.weight", (hidden,))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{name}.weight", (hidden, hidden), True)
        for name in ("ffn_gate", "ffn_up"):
            tensor(f"blk.{i}.{name}.weight", (ff, hidden), True)
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ff), True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def flip_middle_byte(path: Path, start: int, nbytes: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start + nbytes // 2)
        byte = f.read(1)
        f.seek(start + nbytes // 2)
        f.write(bytes([byte[0] ^ 0x5A]))


# ---- fingerprints ----

def test_one_byte_in_the_middle_of_a_gguf_tensor_changes_the_fingerprint(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf")
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / "a.gguf"
    shutil.copy(a, copy)
    changed = tmp_path / "changed.gguf"
    shutil.copy(a, changed)
    src = GGUFSource(a, "a")
    assert GGUFSource(copy, "a").fingerprint == src.fingerprint  # the same bytes elsewhere: the same model
    _, _, start, nbytes = src._table["blk.1.ffn_up.weight"]
    assert nbytes > 2 * 4096  # bigger than what hashing 4 KiB at each end covered
    flip_middle_byte(changed, start, nbytes)
    other = GGUFSource(changed, "a")
    name = "model.layers.1.mlp.up_proj.weight"
    assert not torch.equal(src.read_tensors([name])[name], other.read_tensors([name])[name])
    assert other.fingerprint != src.fingerprint


def test_one_byte_in_the_middle_of_a_safetensors_tensor_changes_the_fingerprint(tiny_model_factory, tmp_path):
    base = tiny_model_factory("llama", num_layers=2, hidden_size=64)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(base, a)
    shutil.copytree(base, b)
    fa = HFSource(a, "m").fingerprint
    assert HFSource(b, "m").fingerprint == fa
    src = HFSource(b, "m")
    name = "model.layers.1.self_attn.q_proj.weight"
    shard = b / src.weight_map[name]
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
    assert end - begin > 2 * 4096
    flip_middle_byte(shard, 8 + n + begin, end - begin)
    changed = HFSource(b, "m")
    assert not torch.equal(changed.read_tensors([name])[name], HFSource(a, "m").read_tensors([name])[name])
    assert changed.fingerprint != fa


def test_weight_digests_are_cached_per_file(tiny_model_factory, tmp_path, monkeypatch):
    """Hashing every byte happens once per file: a later start (a fresh source) reads the cached digest."""
    gguf_path = write_tiny_gguf(tmp_path / "a.gguf")
    hf = tmp_path / "hf"
    shutil.copytree(tiny_model_factory("llama", num_layers=2), hf)
    first = GGUFSource(gguf_path, "a").fingerprint, HFSource(hf, "m").fingerprint

    def no_hashing(*args, **kwargs):
        raise AssertionError("the weights were hashed again")

    monkeypatch.setattr(sources, "_range_digest", no_hashing)
    assert (GGUFSource(gguf_path, "a").fingerprint, HFSource(hf, "m").fingerprint) == first


# ---- bad configs ----

BAD_CONFIGS = [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({"num_hidden_layers": -2}, "num_hidden_layers must be a positive integer"),
    ({"num_hidden_layers": 10 ** 9}, r"num_hidden_layers=1000000000, the weights hold 2 blocks \(0-1\)"),
    ({"num_hidden_layers": 3}, r"num_hidden_layers=3, the weights hold 2 blocks"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be a positive integer, got '2'"),
    ({"hidden_size": -32}, "hidden_size must be a positive integer, got -32"),
    ({"hidden_size": 64}, r"block 0 does not match the config: tensor '.*' is \[32\] in the weights, .* \[64\]"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
    ({"intermediate_size": 96}, "block 0 does not match the config"),
    ({"vocab_size": 10}, r"'model.embed_tokens.weight' is \[\d+, 32\] in the weights"),
]


@pytest.mark.parametrize("change,message", BAD_CONFIGS, ids=[f"{next(iter(c))}={c[next(iter(c))]}"
                                                             for c, _ in BAD_CONFIGS])
def test_a_config_that_is_absurd_or_does_not_match_the_weights_is_refused(tiny_model_factory, tmp_path, change,
                                                                         message):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama", num_layers=2, hidden_size=32), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message) as info:
        HFSource(path, "m").config
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_gguf_whose_metadata_does_not_match_its_tensors_is_refused(tmp_path):
    many = write_tiny_gguf(tmp_path / "many.gguf", block_count=10 ** 9)
    with pytest.raises(ValueError, match=r"num_hidden_layers=1000000000, the weights hold 2 blocks"):
        GGUFSource(many, "many").config
    wide = write_tiny_gguf(tmp_path / "wide.gguf", meta_hidden=64)
    with pytest.raises(ValueError, match="does not match the config"):
        GGUFSource(wide, "wide").config
    good = GGUFSource(write_tiny_gguf(tmp_path / "good.gguf"), "good")
    assert good.config.num_hidden_layers == 2 and len(good.tensor_names()) == 2 * 9 + 2


def test_the_server_command_line_refuses_a_bad_config_in_one_line(tiny_model_factory, tmp_path, capsys):
    from petals_chain.server.__main__ import main as server_main

    path = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama", num_layers=2, hidden_size=32), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    assert server_main(["--model", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads must be a positive integer" in err and "Traceback" not in err


# ---- corrupt weight files ----

@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_corrupt_safetensors_file_is_a_value_error_naming_it(tiny_model_factory, tmp_path, damage):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama", num_layers=2, num_shards=1), path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"empty": b"", "truncated": data[: len(data) // 2],
                         "garbage": bytes(range(256)) * 8}[damage])
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated safetensors file"):
        HFSource(path, "m").config


def test_an_index_placing_a_tensor_in_a_shard_without_it_is_refused(tiny_model_factory, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama", num_layers=2, num_shards=2), path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"places \\['{name}'\\] in this file"):
        HFSource(path, "m").config


# ---- GGUF quantization types ----

def test_an_unsupported_gguf_quantization_type_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "q.gguf")
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (ndim,) = struct.unpack_from("<I", data, at)
    type_at = at + 4 + 8 * ndim
    assert struct.unpack_from("<I", data, type_at) == (3,)  # Q4_1
    for type_id, named in ((6, "Q5_0 (6)"), (99, "99 (unknown)")):
        struct.pack_into("<I", data, type_at, type_id)
        bad = tmp_path / f"type{type_id}.gguf"
        bad.write_bytes(bytes(data))
        with pytest.raises(ValueError) as info:
            GGUFSource(bad, "q").config
        text = str(info.value)
        assert f"quantization type {named}" in text and "Q4_1" in text and "corrupt" not in text
