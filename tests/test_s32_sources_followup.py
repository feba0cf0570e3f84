"""Follow-ups in swarm/sources.py: legacy rotary inv_freq tensors pass the source check; a config naming no dtype
loads in the weights' dtype."""

import json

import torch
from transformers import AutoModelForCausalLM

from petals_chain.swarm.checkpoint import load_block, load_head, parse_dtype
from petals_chain.swarm.sources import resolve_source
from petals_chain.swarm.tiny_model import build_tiny_model


def test_auto_dtype_of_a_config_without_one_is_the_weights_dtype(tmp_path):
    """config.json naming no dtype (neither dtype nor torch_dtype) over fp16 weights: "auto" loaded float32 (twice
    the memory, not transformers' model, which takes the weights' dtype)."""
    path = build_tiny_model(tmp_path / "m", "llama", num_layers=2, hidden_size=32, num_shards=2, dtype="float16")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(str(path))
    assert ref.dtype == torch.float16
    src = resolve_source(path)
    assert parse_dtype(None, src.config) == torch.float16
    assert load_block(src, 1).mlp.up_proj.weight.dtype == torch.float16
    assert load_head(src).dtype == torch.float16


def test_legacy_inv_freq_checkpoint_passes_the_source_check(tmp_path):
    from test_s32_checkpoint import legacy_inv_freq_model

    path = legacy_inv_freq_model(tmp_path)
    src = resolve_source(path)
    assert src.config.num_hidden_layers == 2
    ref = AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    for i in range(2):
        assert all(torch.equal(t, ref[f"model.layers.{i}.{n}"]) for n, t in load_block(src, i).state_dict().items())


def test_inferred_dtype_leaves_the_fingerprint_alone(tmp_path):
    """The dtype the weights give a config naming none is not part of the model's identity (the config digest
    leaves dtype out), so servers with and without it in config.json still announce one model."""
    paths = [build_tiny_model(tmp_path / name, "llama", num_layers=2, hidden_size=32, dtype="bfloat16")
             for name in ("named", "unnamed")]
    for path, dtype in zip(paths, ("bfloat16", None)):
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
        (path / "config.json").write_text(json.dumps(cfg if dtype is None else {**cfg, "dtype": dtype}))
    named, unnamed = (resolve_source(p) for p in paths)
    assert parse_dtype(None, unnamed.config) == parse_dtype(None, named.config) == torch.bfloat16
    assert named.fingerprint == unnamed.fingerprint


def test_sources_and_checkpoint_ignore_the_same_tensors():
    """sources.py checks the tensors checkpoint.py loads, by the one rule (checkpoint imports it from sources)."""
    from petals_chain.swarm import checkpoint, sources

    names = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq", "rotary_emb.inv_freq",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.rotary_emb.inv_freq.x",
             "model.layers.0.self_attn.my_rotary_emb.inv_freq"]
    assert checkpoint.ignored_tensor is sources.ignored_tensor
    assert [sources.ignored_tensor(n) for n in names] == [True, True, True, False, False, False]
