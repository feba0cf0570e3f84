"""Measure ``tau_p``: seconds one block takes to serve one job (the paper's footnote 11 workload).

The reference job is a prefill of ``l_in`` tokens followed by ``l_out - 1`` single-token decode steps
through ONE block (the first decode's input is the prefill's last output, so ``l_out`` tokens are produced).
Results are cached on disk per (model, device, dtype, quant, l_in, l_out, compute_scale) in
``~/.cache/petals-chain/tau_p.json`` (``$XDG_CACHE_HOME`` for ``~/.cache``; ``$PETALS_CHAIN_CACHE_DIR`` overrides the
directory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from petals_chain.server.emulated import EmulatedRunner
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.registry import cache_dir

DEFAULT_L_IN = 128
DEFAULT_L_OUT = 16
_file_lock = threading.Lock()
logger = logging.getLogger(__name__)


def default_cache_path() -> Path:
    """``tau_p.json`` in the per-user cache the models and derived data share (``swarm.registry.cache_dir``; it was
    a second folder, ``~/.cache/petals_chain``: a server there measures again once)."""
    return cache_dir() / "tau_p.json"


def device_name(device: str | torch.device) -> str:
    """A stable description of the device (GPU model for CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _model_key(runner: BlockRunner) -> str:
    cfg = runner.config
    shape = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                                "num_attention_heads", "num_key_value_heads", "head_dim")}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{runner.model_path.resolve()}#{digest}"


def cache_key(runner: BlockRunner, l_in: int, l_out: int) -> str:
    """Disk-cache key of a measurement on ``runner``'s model, device, dtype and quantisation."""
    dtype = str(runner.dtype).replace("torch.", "")
    return "|".join([_model_key(runner), device_name(runner.device), dtype, runner.quant, f"l_in={l_in}",
                     f"l_out={l_out}", f"scale={getattr(runner, 'compute_scale', 1.0):g}"])


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _usable(tau_p: Any) -> bool:
    """Whether a cached ``tau_p`` is a measurement: a finite number > 0. JSON reads ``Infinity`` and ``true``; an
    infinite one was taken, and every record the server published after it was refused (it left the swarm)."""
    return (isinstance(tau_p, (int, float)) and not isinstance(tau_p, bool) and math.isfinite(tau_p)
            and tau_p > 0)


def _store(path: Path, key: str, value: dict[str, Any]) -> None:
    """Add ``key`` to the cache file; a cache that cannot be written is said and skipped (the measurement stands: a
    read-only ~/.cache made the server exit with a traceback after profiling)."""
    tmp = None
    with _file_lock:
        try:
            data = _load_cache(path)
            data[key] = value
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tau_p.", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
            os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
        except OSError as e:
            logger.warning(f"cannot cache tau_p in {path} ({e}): it is measured again at the next start "
                           "(--profile-cache FILE or --tau-p S avoid that)")
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _one_job(runner: BlockRunner, session_id: str, x: torch.Tensor, l_out: int) -> float:
    t0 = time.perf_counter()
    h = runner.forward(session_id, x, 0)
    step = h[:, -1:]
    for i in range(l_out - 1):
        step = runner.forward(session_id, step, x.shape[1] + i)
    return time.perf_counter() - t0


def measure_tau_p(
    runner_or_path: BlockRunner | str | os.PathLike,
    l_in: int = DEFAULT_L_IN,
    l_out: int = DEFAULT_L_OUT,
    *,
    repeats: int = 3,
    warmup: int = 1,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    quant: str = "none",
    compute_scale: float = 1.0,
    block: int | None = None,
    cache_path: str | os.PathLike | None = None,
    use_cache: bool = True,
    progress: bool | None = None,
) -> float:
    """``tau_p`` in seconds per block per job: median over ``repeats`` of one reference job through one block.

    With a :class:`BlockRunner`, its first block is used (one free cache slot is needed, held only during
    the measurement). With a model path, a temporary one-block runner is built from ``dtype``/``device``/
    ``quant``/``compute_scale`` (block 0 unless ``block`` is given), so a server can profile before it
    has an assignment. Cached on disk unless ``use_cache`` is False.
    """
    for name, v in (("l_in", l_in), ("l_out", l_out), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(runner_or_path, BlockRunner):
        runner = runner_or_path
        if runner.max_length < l_in + l_out:
            raise ValueError(f"the runner's max_length {runner.max_length} < l_in + l_out = {l_in + l_out}")
    else:
        args = (runner_or_path, block or 0, 1)
        kwargs = dict(num_slots=1, max_length=l_in + l_out, dtype=dtype, device=device, quant=quant, progress=False)
        runner = (EmulatedRunner(*args, compute_scale=compute_scale, **kwargs) if compute_scale != 1.0
                  else BlockRunner(*args, **kwargs))
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key = cache_key(runner, l_in, l_out)
    if use_cache:
        hit = _load_cache(path).get(key)
        if isinstance(hit, dict) and _usable(hit.get("tau_p")):
            return float(hit["tau_p"])

    sid = f"__tau_p_{uuid.uuid4().hex}"
    first = runner.start_block
    runner.allocate(sid, first, first + 1)  # NoCapacityError if the runner is full
    try:
        x = torch.randn(1, l_in, runner.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.5
        times = []
        for i in tqdm(range(warmup + repeats), desc="profiling tau_p", unit="job",
                      disable=None if progress is None else not progress):
            t = _one_job(runner, sid, x, l_out)
            if i >= warmup:
                times.append(t)
    finally:
        runner.release(sid)
    tau_p = statistics.median(times)
    if use_cache:
        _store(path, key, {"tau_p": tau_p, "samples": times, "measured_at": time.time()})
    return tau_p
