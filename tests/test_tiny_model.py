"""The tiny-model factory writes HF-format dirs that transformers loads and generates from."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tiny_model_loads_and_generates(tmp_path, family):
    path = build_tiny_model(tmp_path / family, family=family, num_layers=4, seed=1)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["dtype"] == "float32" and "torch_dtype" not in cfg
    if family != "llama":
        assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2
    for fname in files:  # every key in the index is really in its shard
        with safe_open(str(path / fname), "pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == fname}
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in index["weight_map"]
        assert "lm_head.weight" not in index["weight_map"]  # tied embeddings

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert len(tok) == model.config.vocab_size
    text = "Hello! How are you today? The sea is wide."
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|assistant|>\n") and chat.startswith(tok.bos_token)

    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    new = out[0, len(ids):].tolist()
    assert len(set(new)) > 3, f"degenerate greedy output {new}"


def test_tiny_model_is_deterministic_and_single_shard(tmp_path):
    a = build_tiny_model(tmp_path / "a", family="llama", num_layers=2, seed=3, num_shards=1)
    b = build_tiny_model(tmp_path / "b", family="llama", num_layers=2, seed=3, num_shards=1)
    c = build_tiny_model(tmp_path / "c", family="llama", num_layers=2, seed=4, num_shards=1)
    assert not (a / "model.safetensors.index.json").exists()
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb, \
            safe_open(str(c / "model.safetensors"), "pt") as fc:
        key = "model.layers.1.mlp.up_proj.weight"
        assert torch.equal(fa.get_tensor(key), fb.get_tensor(key))
        assert not torch.equal(fa.get_tensor(key), fc.get_tensor(key))


def test_tiny_model_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="family"):
        build_tiny_model(tmp_path / "x", family="gpt2")
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(tmp_path / "x", hidden_size=66, num_attention_heads=4)
