"""``tau_p`` of this server: seconds of one block for one job, on the paper's reference workload
(footnote 11: a prefill of ``l_in`` tokens plus ``l_out - 1`` single-token decode steps), cached on disk
per (model, device, dtype, quant, l_in, l_out).

If the runtime's profiler (``petals_chain.server.profiling.measure_tau_p``) is available it does the
measurement; otherwise one block is loaded into a 1-slot :class:`BlockRunner` and timed here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def default_cache_path() -> Path:
    base = os.environ.get("PETALS_CHAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "petals_chain")
    return Path(base) / "tau_p.json"


def _cache_key(model_path: Path, device: str, dtype: torch.dtype, quant: str, l_in: int, l_out: int) -> str:
    config_file = Path(model_path) / "config.json"
    config_hash = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16] if config_file.exists() else "?"
    dev = torch.device(device)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu{os.cpu_count()}"
    return f"{Path(model_path).resolve()}|{config_hash}|{dev_name}|{dtype}|{quant}|{l_in}|{l_out}"


def measure_tau_p_locally(model_path: Path, config: Any, *, dtype: torch.dtype, device: str, quant: str,
                          l_in: int, l_out: int, repeats: int = 2, progress: Optional[bool] = None) -> float:
    """Median over ``repeats`` of (prefill ``l_in`` + ``l_out - 1`` decode steps) on block 0, in seconds."""
    from petals_chain.server.runner import BlockRunner

    max_length = l_in + l_out
    runner = BlockRunner(model_path, 0, 1, num_slots=1, max_length=max_length, dtype=dtype, device=device,
                         quant=quant, config=config, progress=False)
    gen = torch.Generator().manual_seed(0)
    hidden = int(config.hidden_size)
    prompt = torch.randn(1, l_in, hidden, generator=gen).to(dtype)
    token = torch.randn(1, 1, hidden, generator=gen).to(dtype)
    times = []
    bar = tqdm(total=repeats + 1, desc="measuring tau_p", unit="run", disable=None if progress is None else not progress)
    try:
        for rep in range(repeats + 1):  # the first run warms up kernels and allocators
            runner.allocate("profile", 0, 1)
            t0 = time.perf_counter()
            runner.forward("profile", prompt, 0)
            for pos in range(l_in, l_in + l_out - 1):
                runner.forward("profile", token, pos)
            elapsed = time.perf_counter() - t0
            runner.release("profile")
            if rep > 0:
                times.append(elapsed)
            bar.update(1)
    finally:
        bar.close()
        runner.close()
    times.sort()
    return times[len(times) // 2]


def cached_tau_p(model_path: Path, config: Any, *, dtype: torch.dtype, device: str, quant: str, l_in: int = 128,
                 l_out: int = 32, cache_path: Optional[str] = None, progress: Optional[bool] = None) -> float:
    """tau_p from the cache, or measured (and cached). Unscaled: emulation is applied by the caller."""
    if l_in < 1 or l_out < 1:
        raise ValueError("l_in and l_out must be >= 1")
    path = Path(cache_path) if cache_path else default_cache_path()
    key = _cache_key(Path(model_path), device, dtype, quant, l_in, l_out)
    cache: dict[str, float] = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            logger.warning(f"ignoring unreadable tau_p cache {path}")
            cache = {}
    if isinstance(cache.get(key), (int, float)) and cache[key] > 0:
        logger.info(f"tau_p from cache {path}")
        return float(cache[key])
    logger.info(f"measuring tau_p: prefill {l_in} tokens + {l_out - 1} decode steps on one block")
    try:
        from petals_chain.server import profiling  # the runtime's profiler, when present

        measure = getattr(profiling, "measure_tau_p")
        tau_p = float(measure(model_path, dtype=dtype, device=device, quant=quant, l_in=l_in, l_out=l_out))
    except (ImportError, AttributeError, TypeError):
        tau_p = measure_tau_p_locally(Path(model_path), config, dtype=dtype, device=device, quant=quant,
                                      l_in=l_in, l_out=l_out, progress=progress)
    cache[key] = tau_p
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning(f"cannot write tau_p cache {path}: {e}")
    return tau_p
