"""Tiny random-weight HF-format causal LMs (Llama, Mistral, Qwen2) built in code, for tests and demos.

:func:`build_tiny_model` writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load: ``config.json`` (with ``dtype``), ``generation_config.json``,
safetensors weights (optionally sharded with ``model.safetensors.index.json`` so that per-block loading
really reads several files), and a byte-level BPE tokenizer trained on a small embedded English corpus,
with bos/eos/pad tokens and a chat template. Everything is deterministic in ``seed``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2")

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

# Small public-domain-style English text; enough for a BPE of a few hundred merges.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Large language models are served by splitting their layers across many machines. Each server holds a
contiguous span of transformer blocks and a cache of keys and values for the jobs it is working on.
The orchestrator composes servers into chains, sends every request through one chain, and balances the
load so that the mean response time stays low. When a server joins the swarm it measures how long one
block takes to process a job and announces its memory budget to the other peers.
Once upon a time there was a small village at the edge of a great forest. The people of the village
were farmers and hunters, and every evening they gathered around the fire to tell stories about the
mountains, the rivers, the stars and the old kings who had ruled the land long ago.
Hello! How are you today? I am fine, thank you. What is your name? My name is Alice, and this is my
friend Bob. We are learning how computers work, how networks send messages, and how to write programs.
Please write a short poem about the sea. The sea is wide and deep and blue; the waves come in and go
out again; the wind is cold, the sky is grey, and the ships sail far away.
Numbers: one two three four five six seven eight nine ten, 0 1 2 3 4 5 6 7 8 9, 10 100 1000.
Questions and answers: What is the capital of France? Paris. What is two plus two? Four.
The system is designed to be fast, reliable and easy to use. Volunteers run servers on their own
computers and share them with everyone. Users send prompts and receive completions, token by token.
""".strip()


def _corpus_lines() -> list[str]:
    lines = [ln.strip() for ln in _CORPUS.splitlines() if ln.strip()]
    # Repeat with simple variations so frequent words merge into whole-word tokens.
    return lines + [ln.lower() for ln in lines] + [ln.upper() for ln in lines[:4]]


def build_tokenizer(vocab_size: int = 768):
    """Train a deterministic byte-level BPE (``tokenizers``) and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + 8:
        raise ValueError(f"vocab_size must be at least 264 (256 bytes + special tokens), got {vocab_size}")
    # "<|endoftext|>" is in the vocabulary because transformers' Qwen2Tokenizer (picked by AutoTokenizer for
    # qwen2 configs) adds it as unk token otherwise, growing the vocabulary past the embedding matrix.
    special = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS, "<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: any text round-trips
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def make_config(
    family: str,
    *,
    vocab_size: int,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    initializer_range: float,
    tie_word_embeddings: bool,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    dtype: str,
    sliding_window: int | None = None,
):
    """The transformers config object of a tiny model of ``family``."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rms_norm_eps=1e-6,
        dtype=dtype,
    )
    if family == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if family == "mistral":
        # Mistral-7B-v0.1 ships sliding_window=4096; servers refuse a max_length beyond the window.
        return MistralConfig(**common, sliding_window=sliding_window)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _shard_state_dict(state: dict[str, torch.Tensor], num_shards: int) -> list[dict[str, torch.Tensor]]:
    """Split tensors, in order, into ``num_shards`` contiguous groups of roughly equal bytes."""
    names = list(state)
    num_shards = max(1, min(num_shards, len(names)))
    total = sum(t.numel() * t.element_size() for t in state.values())
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    acc = 0
    for name in names:
        t = state[name]
        idx = min(num_shards - 1, int(acc * num_shards // max(total, 1)))
        shards[idx][name] = t
        acc += t.numel() * t.element_size()
    return [s for s in shards if s]


# Random weights shaped like Llama-2-7B's blocks (hidden 4096, 32 heads, MLP 11008, vocab 32,000): GPU checks and
# benchmarks use them where the real 7B weights cannot be fetched (``build_tiny_model(dir, **LLAMA2_7B_SHAPE)``).
LLAMA2_7B_SHAPE = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                       vocab_size=32000, initializer_range=0.02)


def build_tiny_model(
    dir: str | os.PathLike,
    family: str = "llama",
    num_layers: int = 8,
    hidden_size: int = 64,
    seed: int = 0,
    *,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = 768,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool | None = None,
    num_shards: int = 3,
    dtype: str = "float32",
    sliding_window: int | None = None,
    overwrite: bool = True,
) -> Path:
    """Write a tiny random-weight ``family`` causal LM to ``dir`` and return the directory path.

    GQA by default for mistral and qwen2 (``num_key_value_heads = num_attention_heads // 2``); qwen2 also
    has attention biases (as in the real family) and tied embeddings by default. ``num_shards > 1`` writes
    ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``; 1 writes
    ``model.safetensors``. ``sliding_window`` (mistral only) sets the attention window. ``initializer_range`` is large compared with real models so that greedy decoding
    of a random model is not degenerate.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if num_layers < 1 or hidden_size < 1 or num_attention_heads < 1:
        raise ValueError("num_layers, hidden_size and num_attention_heads must be positive")
    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}")
    if num_key_value_heads is None:
        num_key_value_heads = num_attention_heads if family == "llama" else max(1, num_attention_heads // 2)
    if num_attention_heads % num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if sliding_window is not None and family != "mistral":
        raise ValueError("sliding_window is only supported for the mistral family")
    if tie_word_embeddings is None:
        tie_word_embeddings = family == "qwen2"
    out = Path(dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty (pass overwrite=True)")
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()

    tokenizer = build_tokenizer(vocab_size)
    real_vocab = len(tokenizer)
    config = make_config(
        family,
        vocab_size=real_vocab,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
        sliding_window=sliding_window,
    )

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Re-draw every tensor from our own generator: independent of transformers' init order.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(initializer_range * torch.randn(p.shape, generator=gen))
    torch_dtype = getattr(torch, dtype)
    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)

    shards = _shard_state_dict(state, num_shards)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
