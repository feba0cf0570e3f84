"""Per-block loading of causal LMs (Llama / Mistral / Qwen2 layout) from any model source (safetensors, GGUF).

A server hosting blocks ``[a, a+m)`` never materialises the whole model: :func:`load_block` builds one
decoder layer on the meta device (:func:`~petals_chain.swarm.sources.empty_weights`, this thread only) and
reads only that layer's tensors from its source (:mod:`petals_chain.swarm.sources`: the shards that hold them,
or the GGUF tensors it dequantizes). :func:`load_head` does the same for the embeddings, final norm and LM
head (what the orchestrator needs), together with the rotary module.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from petals_chain.swarm.sources import HFSource, ModelSource, empty_weights, ignored_tensor, resolve_source

QUANT_MODES = ("none", "int8", "nf4")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# Tensors transformers skips when loading (``PreTrainedModel._adjust_missing_and_unexpected_keys``): checkpoints
# written before the rotary module moved to the model level hold each layer's ``self_attn.rotary_emb.inv_freq``
# (e.g. ahxt/LiteLlama-460M-1T); it is recomputed from the config, so such a checkpoint loads as if it had none.
def ties_lm_head(config: Any, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the LM head is the embedding matrix, decided as transformers' ``from_pretrained`` does: the config
    ties them, or the checkpoint has no ``lm_head.weight``; but a checkpoint holding both with different values
    (a model fine-tuned untied, its config still saying ``tie_word_embeddings``) keeps both, untied. ``tensors``
    holds ``model.embed_tokens.weight`` and, where the checkpoint has it, ``lm_head.weight``, both cast alike.

    (With ``tie_word_embeddings`` false and no ``lm_head.weight``, transformers leaves the head random; the
    embeddings are the one meaningful reading.)"""
    head = tensors.get("lm_head.weight")
    if head is None:
        return True
    embed = tensors["model.embed_tokens.weight"]
    return bool(getattr(config, "tie_word_embeddings", False)) and torch.equal(head, embed)


def resolve_model_path(name_or_path: "str | os.PathLike | ModelSource", *, revision: str | None = None,
                       cache_dir: str | None = None) -> Path:
    """The local path of a model: an HF directory, a ``.gguf`` file, or a short name's / hub snapshot's path."""
    return resolve_source(name_or_path, revision=revision, cache_dir=cache_dir).path


def load_config(model: "str | os.PathLike | ModelSource"):
    """The transformers config of ``model`` (any source :func:`resolve_source` takes); a private copy."""
    return copy.deepcopy(resolve_source(model).config)


def parse_dtype(dtype: str | torch.dtype | None, config: Any = None) -> torch.dtype:
    """``torch.dtype`` from a name; ``None``/``"auto"`` means the checkpoint's own dtype (float32 if unknown)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype is None or dtype == "auto":
        cfg_dtype = getattr(config, "dtype", None) if config is not None else None
        if cfg_dtype is None:
            return torch.float32
        return parse_dtype(cfg_dtype if isinstance(cfg_dtype, torch.dtype) else str(cfg_dtype).replace("torch.", ""))
    if not isinstance(dtype, str) or dtype.lower() not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype.lower()]


def weight_map(path: "str | os.PathLike | ModelSource") -> dict[str, str]:
    """Tensor name -> safetensors file name of an HF-format directory."""
    src = resolve_source(path)
    if not isinstance(src, HFSource):
        raise ValueError(f"{src.path} is a {src.kind} model, not safetensors")
    return src.weight_map


def _prepare_config(config: Any, attn_implementation: str | None) -> Any:
    config = copy.deepcopy(config)
    # A layer built outside PreTrainedModel never gets its attention implementation resolved.
    config._attn_implementation = attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"
    return config


def _causal_lm_class(config: Any):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as e:
        raise ValueError(f"model type {config.model_type!r} is not a causal LM known to transformers") from e


def decoder_layer_class(config: Any) -> type[nn.Module]:
    """The family's decoder layer class (e.g. ``LlamaDecoderLayer``), found next to its ``*ForCausalLM``."""
    cls = _causal_lm_class(config)
    module = sys.modules[cls.__module__]
    name = cls.__name__.replace("ForCausalLM", "DecoderLayer")
    layer_cls = getattr(module, name, None)
    if layer_cls is None:
        raise ValueError(f"cannot find {name} in {module.__name__}; unsupported model family {config.model_type!r}")
    return layer_cls


def _quantize_linears(module: nn.Module, quant: str, compute_dtype: torch.dtype) -> None:
    """Swap every ``nn.Linear`` for a bitsandbytes int8 / nf4 linear; weights quantize on ``.to("cuda")``."""
    import bitsandbytes as bnb

    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            has_bias = child.bias is not None
            if quant == "int8":
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=has_bias,
                                          has_fp16_weights=False, threshold=6.0)
                new.weight = bnb.nn.Int8Params(child.weight.data.to(torch.float16), requires_grad=False,
                                               has_fp16_weights=False)
            else:
                # No double quantisation: memory.block_bytes counts one fp32 absmax per 64 weights.
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=has_bias,
                                        compute_dtype=compute_dtype, compress_statistics=False, quant_type="nf4")
                new.weight = bnb.nn.Params4bit(child.weight.data.to(compute_dtype), requires_grad=False,
                                               compress_statistics=False, quant_type="nf4")
            if has_bias:
                new.bias = nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            setattr(parent, child_name, new)


def _check_quant(quant: str, device: torch.device) -> None:
    if quant not in QUANT_MODES:
        raise ValueError(f"unsupported quant {quant!r}; use one of {QUANT_MODES}")
    if quant != "none":
        if device.type != "cuda":
            raise ValueError(f"quant={quant!r} needs a CUDA device (bitsandbytes); got device {device}")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise ValueError(f"quant={quant!r} needs bitsandbytes: pip install 'petals_chain[cuda]'") from e


def load_block(
    path: "str | os.PathLike | ModelSource",
    index: int,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    quant: str = "none",
    *,
    config: Any = None,
    attn_implementation: str | None = None,
    wmap: dict[str, str] | None = None,
) -> nn.Module:
    """Decoder layer ``index`` of the model at ``path`` (any source), loaded alone, cast to ``dtype``, on ``device``.

    ``self_attn.layer_idx`` keeps the global index ``index`` (KV caches address layers by it). ``quant`` is
    ``"none"``, or ``"int8"``/``"nf4"`` (bitsandbytes, CUDA only). The layer is in eval mode without grads.
    ``wmap`` is accepted for backward compatibility and ignored (the source caches its index).
    """
    src = resolve_source(path)
    config = _prepare_config(config if config is not None else src.config, attn_implementation)
    n_layers = int(config.num_hidden_layers)
    if not isinstance(index, int) or not 0 <= index < n_layers:
        raise ValueError(f"block index {index!r} out of range [0, {n_layers})")
    device = torch.device(device)
    _check_quant(quant, device)
    torch_dtype = parse_dtype(dtype, config)

    prefix = f"model.layers.{index}."
    names = [k for k in src.tensor_names() if k.startswith(prefix) and not ignored_tensor(k)]
    if not names:
        raise KeyError(f"no tensors with prefix {prefix!r} in {src.path}")
    tensors = src.read_tensors(names)
    state = {k[len(prefix):]: v.to(torch_dtype) for k, v in tensors.items()}
    del tensors
    with empty_weights():  # (this thread only: another's loads and modules stay real)
        layer = decoder_layer_class(config)(config, index)
    expected = set(dict(layer.named_parameters()).keys()) | {
        n for n, _ in layer.named_buffers() if not n.endswith("inv_freq")}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise KeyError(f"block {index} of {src.path}: missing tensors {sorted(missing)}, "
                       f"unexpected {sorted(unexpected)}")
    layer.load_state_dict(state, strict=False, assign=True)
    meta_left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
    if meta_left:
        raise RuntimeError(f"block {index}: tensors left uninitialised: {meta_left}")
    if quant != "none":
        _quantize_linears(layer, quant, torch_dtype)
    layer = layer.to(device)
    layer.eval().requires_grad_(False)
    return layer


class ModelHead(nn.Module):
    """Embeddings, final norm and LM head of a causal LM, plus its rotary module (what is not a block)."""

    def __init__(self, config: Any, embed_tokens: nn.Module, norm: nn.Module, lm_head: nn.Module,
                 rotary_emb: nn.Module):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb = rotary_emb

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch, n]`` -> hidden states ``[batch, n, hidden]``."""
        input_ids = torch.as_tensor(input_ids, device=self.device)
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        vocab = self.embed_tokens.num_embeddings
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return self.embed_tokens(input_ids)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[..., hidden]`` (output of the last block) -> fp32 logits ``[..., vocab]``."""
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        return self.lm_head(self.norm(hidden)).float()


@functools.cache
def _cache_kwarg_of(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwarg(module: nn.Module) -> str:
    """The keyword a transformers layer or model takes its KV cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` warns and goes in 5.40), ``past_key_values`` before."""
    return _cache_kwarg_of(type(module))


def build_rotary(config: Any, device: str | torch.device = "cpu") -> nn.Module:
    """The family's rotary embedding module for ``config`` (e.g. ``LlamaRotaryEmbedding``)."""
    cls = _causal_lm_class(config)
    module = sys.modules[cls.__module__]
    rot_cls = getattr(module, cls.__name__.replace("ForCausalLM", "RotaryEmbedding"), None)
    if rot_cls is None:
        raise ValueError(f"no rotary embedding class for model type {config.model_type!r}")
    return rot_cls(config=config).to(device)


def load_head(path: "str | os.PathLike | ModelSource", dtype: str | torch.dtype | None = None,
              device: str | torch.device = "cpu", *, config: Any = None) -> ModelHead:
    """Load ``model.embed_tokens``, ``model.norm`` and ``lm_head`` (the embeddings where :func:`ties_lm_head`)."""
    src = resolve_source(path)
    config = _prepare_config(config if config is not None else src.config, None)
    torch_dtype = parse_dtype(dtype, config)
    device = torch.device(device)
    skeleton_cfg = copy.deepcopy(config)
    skeleton_cfg.num_hidden_layers = 0
    if getattr(skeleton_cfg, "layer_types", None) is not None:
        skeleton_cfg.layer_types = []
    names = [k for k in src.tensor_names() if k.startswith(("model.embed_tokens.", "model.norm.", "lm_head."))]
    tensors = {k: v.to(torch_dtype) for k, v in src.read_tensors(names).items()}
    tied = ties_lm_head(config, tensors)
    with empty_weights():
        skeleton = _causal_lm_class(config)(skeleton_cfg)
    embed, norm, lm_head = skeleton.model.embed_tokens, skeleton.model.norm, skeleton.lm_head
    embed.load_state_dict({k[len("model.embed_tokens."):]: v for k, v in tensors.items()
                           if k.startswith("model.embed_tokens.")}, assign=True)
    norm.load_state_dict({k[len("model.norm."):]: v for k, v in tensors.items() if k.startswith("model.norm.")},
                         assign=True)
    if tied:
        lm_head.weight = embed.weight
        if lm_head.bias is not None:
            raise ValueError("tied embeddings with an lm_head bias are not supported")
    else:
        lm_head.load_state_dict({k[len("lm_head."):]: v for k, v in tensors.items()
                                 if k.startswith("lm_head.")}, assign=True)
    head = ModelHead(config, embed, norm, lm_head, build_rotary(config, device))
    head = head.to(device)
    head.eval().requires_grad_(False)
    return head


def load_causal_lm(path: "str | os.PathLike | ModelSource", num_layers: int | None = None,
                   dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """The whole causal LM at ``path`` (any source) as one transformers model, or only its first ``num_layers``
    decoder layers with the embeddings, final norm and LM head (a self-speculative draft model: same tokenizer,
    cheaper, close to the full model's choices). Eval mode, no grads."""
    src = resolve_source(path)
    config = _prepare_config(src.config, None)
    total = int(config.num_hidden_layers)
    n = total if num_layers is None else int(num_layers)
    if not 1 <= n <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    config.num_hidden_layers = n
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:n]
    torch_dtype = parse_dtype(dtype, config)
    keep = ("model.embed_tokens.", "model.norm.", *(f"model.layers.{i}." for i in range(n)), "lm_head.")
    state = {k: v.to(torch_dtype) for k, v in src.read_tensors([k for k in src.tensor_names() if k.startswith(keep)
                                                                 and not ignored_tensor(k)]).items()}
    with empty_weights():
        model = _causal_lm_class(config)(config)
    tied = ties_lm_head(config, state)
    if tied:
        state.pop("lm_head.weight", None)
    else:
        config.tie_word_embeddings = False  # (the model's private copy) a later tie_weights() must not tie them
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise KeyError(f"{src.path}: missing tensors {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    meta_left = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta_left:
        raise RuntimeError(f"tensors left uninitialised: {meta_left[:8]}")
    model = model.to(device)
    model.eval().requires_grad_(False)
    return model
