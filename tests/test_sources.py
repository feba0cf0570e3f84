"""Model sources: short names, GGUF files read per tensor, fingerprints, the family allow-list."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from petals_chain.swarm import registry
from petals_chain.swarm.checkpoint import load_block, load_head
from petals_chain.swarm.keys import default_dht_prefix
from petals_chain.swarm.sources import GGUFSource, HFSource, UnsupportedModelError, check_family, resolve_source


def test_short_name_resolves_to_the_fetched_gguf(smollm2_path):
    src = resolve_source("smollm2-135m")
    assert isinstance(src, GGUFSource) and src.path == smollm2_path
    assert src.name == "smollm2-135m" and default_dht_prefix(src.name) == "smollm2-135m"
    # the same file by path keeps the short name (so servers and orchestrator agree on the DHT prefix)
    assert resolve_source(str(smollm2_path)) is src
    cfg = src.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == ("llama", 30, 576, 9, 3, 49152)
    assert len(src.tensor_names()) == 30 * 9 + 2  # tied embeddings: no lm_head tensor


def test_missing_short_name_says_how_to_fetch(tmp_path, monkeypatch, capsys):
    from petals_chain.server.__main__ import main  # (in this process: a `python -m` start imports torch, ~6 s)

    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"python3 -m petals_chain\.fetch smollm2-135m"):
        resolve_source("smollm2-135m")
    # the command-line tools say the same, with a clean exit code instead of a traceback
    env = {**__import__("os").environ, "PETALS_CHAIN_MODELS_DIR": str(tmp_path / "empty")}
    assert main(["--model", "smollm2-135m"]) == 2
    assert "petals_chain.fetch smollm2-135m" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "petals_chain.fetch", "--list"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "smollm2-135m" in proc.stdout and "not fetched" in proc.stdout


def test_fetch_keeps_a_verified_file_without_downloading(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path))
    shutil.copy(smollm2_path, tmp_path / smollm2_path.name)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("fetch downloaded a file it already had"))
    assert registry.fetch("smollm2-135m", quiet=True) == tmp_path / smollm2_path.name
    # a corrupted file is not accepted as the model (it would be fetched again)
    with open(tmp_path / smollm2_path.name, "r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 16)
    with pytest.raises(pytest.fail.Exception):
        registry.fetch("smollm2-135m", quiet=True)


def test_gguf_blocks_and_head_equal_transformers(smollm2_reference):
    """Per-tensor dequantization gives exactly the tensors transformers' own GGUF loader gives."""
    src = resolve_source("smollm2-135m")
    ref = smollm2_reference.state_dict()
    for index in (0, 13, 29):
        layer = load_block(src, index, "float32")
        assert layer.self_attn.layer_idx == index
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, ref[f"model.layers.{index}.{name}"]), (index, name)
    head = load_head(src, "float32")
    assert torch.equal(head.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(head.norm.weight, ref["model.norm.weight"])
    assert head.lm_head.weight is head.embed_tokens.weight


def test_gguf_tokenizer_cache_round_trips(tmp_path, monkeypatch):
    """The tokenizer converted from the GGUF vocabulary and the copy saved in the cache tokenize alike."""
    from transformers import AutoTokenizer

    src = resolve_source("smollm2-135m")
    direct = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    cached = src.load_tokenizer()
    msgs = [{"role": "user", "content": "What is the capital of France? ünïcödé, emoji 🙂, code `x = 1`"}]
    for text in ["Hello world", "  leading spaces\tand tabs\n", msgs[0]["content"]]:
        assert cached(text)["input_ids"] == direct(text)["input_ids"]
    a = cached.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    b = direct.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert list(getattr(a, "input_ids", a)) == list(getattr(b, "input_ids", b))
    assert cached.eos_token == "<|im_end|>"


def test_fingerprints_tell_models_apart(tiny_model_factory, tmp_path):
    a = resolve_source(tiny_model_factory("llama", num_layers=4))
    b = resolve_source(tiny_model_factory("llama", num_layers=4, seed=1))
    c = resolve_source(tiny_model_factory("qwen2", num_layers=4))
    assert isinstance(a, HFSource) and len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    copy = tmp_path / "copy"
    shutil.copytree(a.path, copy)
    assert resolve_source(copy).fingerprint == a.fingerprint  # a copy is the same model
    # one weight changed -> another model
    from safetensors.torch import load_file, save_file

    shard = sorted(copy.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, shard, metadata={"format": "pt"})
    shutil.copytree(copy, tmp_path / "changed")
    assert resolve_source(tmp_path / "changed").fingerprint != a.fingerprint
    assert len(resolve_source("smollm2-135m").fingerprint) == 16


def test_unsupported_family_is_refused(tiny_model_factory, tmp_path, capsys):
    path = tmp_path / "gemma"
    shutil.copytree(tiny_model_factory("llama", num_layers=4), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gemma2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gemma2.*not supported"):
        check_family(resolve_source(path).config)
    from petals_chain.orchestrator.__main__ import main  # (in this process: a `python -m` start imports torch, ~6 s)

    assert main(["--model", str(path), "--port", "0"]) != 0  # said, not raised (no traceback)
    err = capsys.readouterr().err
    assert "gemma2" in err and "Traceback" not in err


def test_weight_files_outside_the_model_folder_are_refused(tiny_model_factory, tmp_path):
    """An index naming ``../x.safetensors`` or an absolute path is refused: they were read from wherever they
    pointed."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama", num_layers=4), path)
    single = path / "model.safetensors"
    if single.is_file():  # make it a one-file index
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            names = list(f.keys())
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names,
                                                                                               single.name)}))
    from petals_chain.swarm.sources import HFSource

    assert HFSource(path, "m").tensor_names()  # a fresh source each time (resolve_source keeps one per path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for bad in ("../elsewhere/private.safetensors", str(tmp_path / "abs.safetensors")):
        first = next(iter(index["weight_map"]))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**index["weight_map"],
                                                                                      first: bad}}))
        with pytest.raises(ValueError, match="not a file name inside"):
            HFSource(path, "m").tensor_names()


def test_a_corrupt_gguf_file_is_refused_at_once_with_its_name(smollm2_path, tmp_path, capsys):
    """A truncated file, or one whose header declares an array of 2^40 entries, is a ValueError naming the file
    within a second: the metadata parser trusted the count (it looped for minutes, GBs growing) and a truncated
    file ended in an IndexError traceback from the CLIs."""
    import struct
    import time

    from petals_chain.server.__main__ import main as server_main

    head = smollm2_path.read_bytes()[:2_000_000]  # the header, metadata and tensor table, without the data
    key = b"tokenizer.ggml.token_type"
    at = head.index(key) + len(key) + 8  # past the value type (array) and the element type
    huge = head[:at] + struct.pack("<Q", 1 << 40) + head[at + 8:]
    for name, data in (("truncated", head), ("huge-count", huge)):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="corrupt or truncated GGUF file"):
            GGUFSource(path, name)._config_dict()
        assert time.monotonic() - t0 < 5.0
    assert server_main(["--model", str(tmp_path / "huge-count.gguf")]) == 2
    err = capsys.readouterr().err
    assert "corrupt or truncated GGUF file" in err and "Traceback" not in err


def test_bad_model_arguments(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_source(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError):
        resolve_source(tmp_path / "missing.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_source(tmp_path / "empty")
