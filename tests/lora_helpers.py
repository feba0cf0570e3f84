"""Random LoRA adapters in peft's on-disk format, and the reference they must match: the model with the adapter's
deltas merged into its weights by hand (``W + scaling * B @ A``), as peft's ``merge_and_unload`` gives."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linear_shapes(model_dir: Path | str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, {module: (in_features, out_features)}) of the model's decoder layers."""
    from petals_chain.swarm.checkpoint import decoder_layer_class
    from petals_chain.swarm.sources import empty_weights, resolve_source

    config = resolve_source(model_dir).config
    with empty_weights():
        layer = decoder_layer_class(config)(config, 0)
    shapes = {m: (layer.get_submodule(m).in_features, layer.get_submodule(m).out_features) for m in ATTN + MLP}
    return int(config.num_hidden_layers), shapes


def write_adapter(out: Path | str, model_dir: Path | str, *, seed: int, r: int = 4, alpha: float = 8.0,
                  targets: Sequence[str] = ("q_proj", "v_proj", "down_proj"), layers: Sequence[int] | None = None,
                  rslora: bool = False, scale: float = 0.2, config: dict | None = None,
                  tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A random adapter of ``model_dir`` at ``out`` (``adapter_config.json`` + ``adapter_model.safetensors`` with
    peft's keys). ``B`` is random too (peft starts it at zero; a trained one is not): the adapter changes the output.
    ``config`` overrides config fields; ``tensors`` replaces or adds tensors (by key)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n_layers, shapes = linear_shapes(model_dir)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in (range(n_layers) if layers is None else layers):
        for module, (fan_in, fan_out) in shapes.items():
            if module.split(".")[-1] not in targets:
                continue
            key = f"base_model.model.model.layers.{i}.{module}"
            state[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * scale
            state[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * scale
    state.update(tensors or {})
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": r,
           "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
           "use_rslora": rslora, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
           "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
           **(config or {})}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def merge_into(model: Any, adapter_dir: Path | str) -> Any:
    """``model`` (a transformers causal LM, changed in place and returned) with the adapter merged by hand:
    ``W += scaling * B @ A`` for every targeted Linear, ``scaling = alpha / r`` (rslora: ``alpha / sqrt(r)``)."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            rank = a.shape[0]
            scaling = cfg["lora_alpha"] / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
            path = key[len("base_model.model."):-len(".lora_A.weight")]
            linear = model.get_submodule(path)
            linear.weight += (scaling * (b.double() @ a.double())).to(linear.weight.dtype)
    return model


def merged_reference(model_dir: Path | str, adapter_dir: Path | str | None) -> Any:
    """The model at ``model_dir`` in float32 with ``adapter_dir`` merged (None: the base model)."""
    from petals_chain.swarm.sources import resolve_source

    model = resolve_source(model_dir).load_reference(torch.float32)
    return merge_into(model, adapter_dir) if adapter_dir is not None else model


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """``model``'s greedy continuation of ``prompt`` (``n`` tokens)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
