"""Memory model of one block (``s_m``) and one cache slot (``s_c``) in bytes, from a transformers config.

``s_m`` counts the parameters of one decoder layer, built on the meta device (so the count is exact for
any family transformers knows) and sized by dtype / quantization. ``s_c`` is the K and V of one layer for
one job at the swarm's ``max_length``: ``2 * num_key_value_heads * head_dim * max_length * dtype_bytes``.
A server with budget ``M_j`` hosting ``m_j`` blocks has ``floor((M_j - s_m m_j) / s_c)`` slots (Eq. 3).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from petals_chain.swarm.checkpoint import QUANT_MODES, decoder_layer_class, parse_dtype
from petals_chain.swarm.sources import empty_weights

# bitsandbytes defaults: nf4 uses blocks of 64 weights with one fp32 absmax each (no double quantisation);
# int8 (LLM.int8) keeps one fp32 scale per output row.
NF4_BLOCKSIZE = 64
DEFAULT_PAGE_SIZE = 16  # tokens per KV page of a paged server (its --page-size default, server/kv_cache.py)


def head_dim(config: Any) -> int:
    """Per-head dimension (explicit ``head_dim`` if the config has one)."""
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else int(config.hidden_size) // int(config.num_attention_heads)


def num_kv_heads(config: Any) -> int:
    """Number of key/value heads (GQA); equals the attention heads when the config has none."""
    kv = getattr(config, "num_key_value_heads", None)
    return int(kv) if kv else int(config.num_attention_heads)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _layer_param_shapes(config: Any) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_linear_weight) for every parameter of one decoder layer, built on meta (this thread only)."""
    with empty_weights():
        layer = decoder_layer_class(config)(config, 0)
    linear_weights = {id(m.weight) for m in layer.modules() if isinstance(m, nn.Linear)}
    return [(n, tuple(p.shape), id(p) in linear_weights) for n, p in layer.named_parameters()]


def block_bytes(config: Any, dtype: str | torch.dtype | None = None, quant: str = "none") -> int:
    """``s_m``: bytes of one decoder layer's parameters in ``dtype`` under ``quant`` (none|int8|nf4).

    Quantised sizes follow bitsandbytes: int8 = 1 byte per linear weight + 4 bytes per output row;
    nf4 = 0.5 byte per linear weight + 4 bytes per block of 64. Norms and biases stay in ``dtype``.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"unsupported quant {quant!r}; use one of {QUANT_MODES}")
    nbytes = _dtype_bytes(parse_dtype(dtype, config))
    total = 0
    for _, shape, is_linear in _layer_param_shapes(config):
        numel = math.prod(shape)
        if not is_linear or quant == "none":
            total += numel * nbytes
        elif quant == "int8":
            total += numel + 4 * shape[0]
        else:
            total += (numel + 1) // 2 + 4 * math.ceil(numel / NF4_BLOCKSIZE)
    return total


def page_size_for(mode: str, max_length: int, page_size: int) -> int:
    """Tokens per page: ``max_length`` in ``slots`` mode (a page is a slot), else ``page_size`` (at most
    ``max_length``)."""
    return max_length if mode == "slots" else min(page_size, max_length)


def slot_tokens(kv_cache: str, max_length: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Tokens of K and V one session of ``max_length`` tokens takes in each block: ``max_length`` rounded up to whole
    pages of ``page_size`` tokens (at most ``max_length``) in ``paged`` mode, ``max_length`` in ``slots`` mode (a page
    is a slot). ``s_c`` is :func:`cache_slot_bytes` at this length, for the servers and the orchestrator alike (one
    at ``max_length`` counted up to ``page_size / max_length`` slots too many)."""
    if int(max_length) != max_length or max_length < 1 or int(page_size) != page_size or page_size < 1:
        raise ValueError(f"max_length and page_size must be positive integers, got {max_length!r}, {page_size!r}")
    ps = page_size_for(kv_cache, int(max_length), int(page_size))
    return -(-int(max_length) // ps) * ps


def cache_slot_bytes(config: Any, dtype: str | torch.dtype | None = None, max_length: int = 2048) -> int:
    """``s_c``: bytes of one layer's K and V for one job at ``max_length`` tokens in ``dtype``."""
    if int(max_length) != max_length or max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    return 2 * num_kv_heads(config) * head_dim(config) * int(max_length) * _dtype_bytes(parse_dtype(dtype, config))


def check_device(device: str) -> torch.device:
    """``torch.device(device)``; ValueError, in one line, for a CUDA device on a machine without CUDA (the roles
    check it before anything starts, not with a traceback once they have joined)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        dev = None  # torch's message lists twenty device types, and not the flag
    if dev is None or dev.type not in ("cpu", "cuda"):  # meta, xpu, ...: a server joined, announcing one
        raise ValueError(f"--device {device!r}: give cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available (use --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev


def slots_for_budget(memory_bytes: float, num_blocks: int, s_m: float, s_c: float) -> int:
    """``floor((M_j - s_m m_j) / s_c)``, at least 0 (Eq. 3)."""
    if s_c <= 0:
        raise ValueError("s_c must be positive")
    return max(0, int((memory_bytes - s_m * num_blocks) // s_c))


def capped_slots(slots: int, num_blocks: int, cache_tokens_per_block: int, max_length: int) -> int:
    """``slots`` under a volunteer's ``--cache-tokens-per-block`` (PETALS' fixed attention cache, 0: none): at most
    ``num_blocks x cache_tokens_per_block // max_length`` slots of ``max_length`` tokens, whatever its memory. The
    server loads with it and the planner plans with it."""
    if cache_tokens_per_block <= 0:
        return slots
    return min(slots, num_blocks * cache_tokens_per_block // max(1, max_length))
