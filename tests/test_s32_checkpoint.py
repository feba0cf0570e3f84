"""Per-block loading equals transformers' own load, tensor for tensor, across family features and checkpoint formats.

Tiny random models written by transformers' ``save_pretrained`` (single file or sharded with an index) are loaded
block by block (:func:`load_block`), head (:func:`load_head`) and whole (:func:`load_causal_lm`) and compared with
``AutoModelForCausalLM.from_pretrained`` of the same folder: same values, same dtype, same rotary frequencies.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from petals_chain.swarm.checkpoint import ignored_tensor, load_block, load_causal_lm, load_head
from petals_chain.swarm.sources import resolve_source
from petals_chain.swarm.tiny_model import build_tiny_model


def _save(path, config, dtype: torch.dtype, max_shard_size: str = "10GB"):
    """A random-weight model of ``config`` saved by transformers in ``dtype`` (sharded below ``max_shard_size``)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # biases and norms away from their init values: they must load
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    return path


def _assert_loads_as_transformers(path, dtype=None):
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto").eval()
    want = ref.state_dict()
    src = resolve_source(path)
    for i in range(int(src.config.num_hidden_layers)):
        got = load_block(src, i, dtype).state_dict()
        assert got.keys() == {k[len(f"model.layers.{i}."):] for k in want if k.startswith(f"model.layers.{i}.")}
        for name, t in got.items():
            r = want[f"model.layers.{i}.{name}"]
            assert t.dtype == r.dtype and torch.equal(t, r), (i, name, t.dtype, r.dtype)
    head = load_head(src, dtype)
    for got, r in ((head.embed_tokens.weight, ref.model.embed_tokens.weight), (head.norm.weight, ref.model.norm.weight),
                   (head.lm_head.weight, ref.lm_head.weight)):
        assert got.dtype == r.dtype and torch.equal(got, r)
    assert (head.lm_head.weight is head.embed_tokens.weight) == (ref.lm_head.weight is ref.model.embed_tokens.weight)
    assert torch.equal(head.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert head.rotary_emb.attention_scaling == ref.model.rotary_emb.attention_scaling


_SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize("case", ["llama-head_dim-bias-untied", "llama3-rope-fp16-sharded", "qwen2-tied-bf16-sharded"])
def test_blocks_and_head_equal_transformers_load(tmp_path, case):
    """Explicit ``head_dim`` (not hidden / heads) with attention and MLP biases; llama3 rope scaling in an fp16
    checkpoint kept fp16 and cast to fp32; Qwen2's q/k/v biases with tied embeddings in bf16, sharded."""
    if case.startswith("llama-head_dim"):
        cfg = LlamaConfig(**_SIZES, head_dim=24, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
        path, dtype, shard = _save(tmp_path, cfg, torch.float32), torch.float32, None
    elif case.startswith("llama3"):
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
        cfg = LlamaConfig(**_SIZES, rope_scaling=rope, rope_theta=500000.0)
        path, dtype, shard = _save(tmp_path, cfg, torch.float16, "40KB"), torch.float16, True
    else:
        cfg = Qwen2Config(**_SIZES, tie_word_embeddings=True)
        path, dtype, shard = _save(tmp_path, cfg, torch.bfloat16, "40KB"), torch.bfloat16, True
    assert (path / "model.safetensors.index.json").is_file() == bool(shard)
    _assert_loads_as_transformers(path)  # the checkpoint's own dtype
    if dtype != torch.float32:
        _assert_loads_as_transformers(path, torch.float32)


def legacy_inv_freq_model(tmp_path):
    """A tiny 2-layer Llama (2 shards) whose layers also hold a legacy ``self_attn.rotary_emb.inv_freq`` tensor each
    (wrong values: they must not be used either)."""
    path = build_tiny_model(tmp_path / "m", "llama", num_layers=2, hidden_size=32, num_shards=2)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for i in range(2):
        name = f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
        fname = index["weight_map"][f"model.layers.{i}.self_attn.q_proj.weight"]
        tensors = load_file(path / fname)
        tensors[name] = torch.full((4,), 123.0)
        save_file(tensors, path / fname, metadata={"format": "pt"})
        index["weight_map"][name] = fname
    index_file.write_text(json.dumps(index))
    return path


def test_legacy_per_layer_inv_freq_tensors_are_ignored_like_transformers(tmp_path):
    """Checkpoints written before transformers moved the rotary module to the model level hold a
    ``model.layers.N.self_attn.rotary_emb.inv_freq`` per layer (e.g. ahxt/LiteLlama-460M-1T, unsloth#270).
    transformers ignores them; ``load_block`` refused every block ("unexpected ['self_attn.rotary_emb.inv_freq']")
    and ``load_causal_lm`` (the draft model) the whole model."""
    path = legacy_inv_freq_model(tmp_path)
    name = "model.layers.1.self_attn.rotary_emb.inv_freq"
    assert ignored_tensor(name) and not ignored_tensor("model.layers.0.self_attn.q_proj.weight")

    ref = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    want = ref.state_dict()
    src = resolve_source(path)
    # The source's config check refuses these tensors too (a change asked of sources.py); given the config, what
    # this module does is checked alone.
    config = AutoConfig.from_pretrained(str(path))
    for i in range(2):
        got = load_block(src, i, "float32", config=config).state_dict()
        assert all(torch.equal(t, want[f"model.layers.{i}.{n}"]) for n, t in got.items()), i
    src.__dict__.setdefault("config", config)
    model = load_causal_lm(src)
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0),
                       ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))


def _permute(w, n_head: int):
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute): each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_written_as_llama_cpp_does_loads_the_original_weights(tmp_path, monkeypatch, family):
    """An HF model written to GGUF as llama.cpp converts it (Llama: q and k rows permuted per head, k by its own
    GQA head count; Qwen2: not permuted, q/k/v biases) loads back block by block to the original tensors. An
    independent check of the q/k un-permutation (the other GGUF test compares with transformers' GGUF loader,
    which runs the same code)."""
    import gguf
    import numpy as np

    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))
    cls = LlamaConfig if family == "llama" else Qwen2Config
    cfg = cls(**{**_SIZES, "max_position_embeddings": 128}, tie_word_embeddings=family == "qwen2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape))
    want = model.state_dict()
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), family)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(300)
    w.add_tokenizer_model("gpt2")
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for hf_name in want:
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
        if m:
            gguf_names[hf_name] = f"blk.{m[1]}.{parts[m[2]]}.{m[3]}"
    for hf_name, gguf_name in gguf_names.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = want[hf_name].numpy()
        if family == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, 4 if "q_proj" in hf_name else 2)
        w.add_tensor(gguf_name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    src = resolve_source(tmp_path / "m.gguf")
    for i in range(2):
        for name, t in load_block(src, i, "float32").state_dict().items():
            assert torch.equal(t, want[f"model.layers.{i}.{name}"]), (i, name)
    head = load_head(src, "float32")
    assert torch.equal(head.embed_tokens.weight, want["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head.weight, want["lm_head.weight"])
    assert (head.lm_head.weight is head.embed_tokens.weight) == cfg.tie_word_embeddings


def test_a_stored_lm_head_unlike_the_embeddings_is_used_though_the_config_ties_them(tmp_path):
    """A model fine-tuned with its head untied, saved with both tensors but ``tie_word_embeddings`` still true in
    its config: transformers keeps the stored head (it warns, and does not tie); the orchestrator's head and the
    draft model tied it to the embeddings, every logit differed from transformers' and so did the tokens."""
    path = build_tiny_model(tmp_path / "m", "qwen2", num_layers=2, hidden_size=32, num_shards=1)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = 0.2 * torch.randn(tensors["model.embed_tokens.weight"].shape,
                                                  generator=torch.Generator().manual_seed(3))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    assert torch.equal(ref.lm_head.weight, tensors["lm_head.weight"])  # what transformers does

    head = load_head(path, "float32")
    assert torch.equal(head.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(head.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    draft = load_causal_lm(path)
    assert torch.equal(draft.lm_head.weight, tensors["lm_head.weight"])
    assert draft.lm_head.weight is not draft.model.embed_tokens.weight
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        hidden = head.embed(ids)
        pos = torch.arange(ids.shape[1])[None]
        emb = head.rotary_emb(hidden, pos)
        for i in range(2):
            out = load_block(path, i, "float32")(hidden, attention_mask=None, position_ids=pos,
                                                 position_embeddings=emb)
            hidden = out[0] if isinstance(out, tuple) else out
        assert torch.equal(head.logits(hidden), ref(ids).logits)
        assert torch.equal(draft.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0),
                           ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))
    # both stored, equal (as .bin-era exports write them): tied, as transformers ties them
    path = build_tiny_model(tmp_path / "e", "qwen2", num_layers=2, hidden_size=32, num_shards=1)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    head = load_head(path, "float32")
    assert head.lm_head.weight is head.embed_tokens.weight
    draft = load_causal_lm(path)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
