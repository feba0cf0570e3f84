"""LoRA adapters in peft's on-disk format: reading, validating against a model, and fingerprinting them.

An adapter is a directory holding ``adapter_config.json`` and ``adapter_model.safetensors`` (what peft's
``save_pretrained`` writes), read here with ``safetensors`` alone (no ``peft`` at run time). Servers load the
tensors of their span's layers (``server/lora.py``); the orchestrator reads an adapter only to validate and
fingerprint it. Definitions used everywhere else:

* **adapter fingerprint**: 32 hex characters, blake2b-128 of the config fields that change the math
  (``lora_alpha``, ``use_rslora``) and of every tensor (its name, dtype, shape and bytes, in name order). It is the
  same whichever span a server holds, and it is what names an adapter in server records and RPCs; an adapter's
  *name* (``--adapter NAME=PATH``) is only a label.
* **scaling** of a targeted Linear: ``lora_alpha / r`` (``use_rslora``: ``lora_alpha / sqrt(r)``), ``r`` that
  module's rank (its ``lora_A`` rows; ``rank_pattern`` may give modules different ranks).
* **delta**: a targeted Linear's output gains ``scaling * (x @ A^T) @ B^T`` for the rows of sessions using the
  adapter; ``A`` is ``[r, in_features]``, ``B`` ``[out_features, r]``. Merged, that is ``W + scaling * B @ A``.

What cannot be served is refused with one line naming the field or tensor: another peft type, ``modules_to_save``,
``use_dora`` (DoRA), ``bias`` other than ``"none"``, ``lora_bias``, ``fan_in_fan_out``, ``alpha_pattern``,
``layer_replication``, trainable token indices, targets outside the transformer blocks (embeddings, ``lm_head``),
shapes that do not match the model, non-finite weights, tensors of another dtype than float32/16, bfloat16 or
float64. ``base_model_name_or_path`` is informational: the shapes decide whether an adapter fits a model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from petals_chain.swarm.sources import MODEL_NAME_RE

__all__ = ["AdapterError", "LoraAdapter", "LoraModule", "read_adapter", "check_adapter_fits", "parse_adapter_arg",
           "MAX_ADAPTERS", "FINGERPRINT_CHARS", "adapter_salt"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ADAPTERS = 8  # per model on one server (its record lists them) and per model on an orchestrator
FINGERPRINT_CHARS = 32
MAX_CONFIG_BYTES = 1 << 20
_TENSOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what LoRA matrices are stored in
# peft's key of a block's LoRA matrix: base_model.model (the PeftModel's LoraModel) .model (the CausalLM) .model.layers
_KEY_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.([A-Za-z0-9_.]+)\.lora_([AB])\.weight$")
# config fields that must be empty/false/none to be served: field -> what its presence means
_REFUSED_TRUE = {"use_dora": "DoRA adapters are not served", "fan_in_fan_out": "Conv1D-style (transposed) weights are "
                 "not served: the served families use nn.Linear", "lora_bias": "LoRA biases are not served"}
_REFUSED_NONEMPTY = {"modules_to_save": "fully trained modules beside the adapter are not served",
                     "alpha_pattern": "per-module lora_alpha is not served", "layer_replication": "layer replication "
                     "is not served", "trainable_token_indices": "trained embedding rows are not served",
                     "target_parameters": "LoRA on parameters (not modules) is not served"}


class AdapterError(ValueError):
    """An adapter that cannot be served, or a bad ``--adapter`` value: one line, naming the field or tensor."""


@dataclass(frozen=True)
class LoraModule:
    """One targeted Linear: ``module`` is its path inside decoder layer ``layer`` (e.g. ``self_attn.q_proj``)."""

    layer: int
    module: str
    rank: int
    in_features: int
    out_features: int
    scaling: float
    a_key: str
    b_key: str


@dataclass
class LoraAdapter:
    """An adapter read from disk (its tensors stay there: :meth:`read_layers` loads a span's)."""

    name: str
    path: Path
    fingerprint: str
    lora_alpha: float
    use_rslora: bool
    modules: dict[tuple[int, str], LoraModule]
    dtype: torch.dtype  # of its tensors on disk
    base_model: str = ""  # the config's base_model_name_or_path (informational)
    config: dict = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> list[int]:
        """The decoder layers it changes, in order."""
        return sorted({layer for layer, _ in self.modules})

    def layer_params(self, layer: int) -> int:
        """Parameters (elements of ``A`` and ``B``) it holds for decoder layer ``layer``."""
        return sum(m.rank * (m.in_features + m.out_features) for (i, _), m in self.modules.items() if i == layer)

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes its tensors take in the block that holds the most of them, cast to ``dtype`` (what a server counts
        per block in its memory accounting: the span it will be given is not known in advance)."""
        size = torch.empty((), dtype=dtype).element_size()
        return max((self.layer_params(layer) for layer in self.layers), default=0) * size

    def read_layers(self, layers: range | list[int], dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """``{(layer, module): (A, B)}`` of the layers in ``layers``, cast to ``dtype`` on ``device``. The file is read
        whole again and must still have this fingerprint: a file changed since it was read is refused (the server
        would serve weights its record does not name)."""
        from safetensors import safe_open

        if read_adapter(self.path, self.name).fingerprint != self.fingerprint:
            raise AdapterError(f"adapter {self.name}: {self.path} changed since it was read (another fingerprint): "
                               f"restart to serve the new adapter")
        keep = set(layers)
        out = {}
        with safe_open(str(self.path / WEIGHTS_FILE), framework="pt") as f:
            for (layer, module), m in sorted(self.modules.items()):
                if layer in keep:
                    out[(layer, module)] = (f.get_tensor(m.a_key).to(device=device, dtype=dtype),
                                            f.get_tensor(m.b_key).to(device=device, dtype=dtype))
        return out


def adapter_salt(fingerprint: Optional[str], name: bytes) -> bytes:
    """A prefix-cache page name (:mod:`~petals_chain.swarm.prefix`) for a session of adapter ``fingerprint``: the
    same tokens under another adapter (or the base model, None) have other K/V, so never the same name."""
    if not fingerprint:
        return name
    return hashlib.blake2b(b"lora:" + fingerprint.encode() + name, digest_size=len(name)).digest()


def parse_adapter_arg(value: str) -> tuple[Optional[str], str, str]:
    """``--adapter`` as ``(model, name, path)``: ``NAME=PATH`` or ``MODEL:NAME=PATH`` (``model`` None in the first
    form). AdapterError naming the value otherwise."""
    head, sep, path = value.partition("=")
    if not sep or not path:
        raise AdapterError(f"--adapter must be NAME=PATH or MODEL:NAME=PATH, got {value!r}")
    model, colon, name = head.rpartition(":")
    if not colon:
        model, name = "", head
    for what, text in (("model", model), ("adapter name", name)):
        if (text or what == "adapter name") and not MODEL_NAME_RE.match(text):
            raise AdapterError(f"--adapter {value!r}: {what} {text!r} must be letters, digits, '.', '_' and '-' "
                               f"(at most 64)")
    return model or None, name, path


def _fail(name: str, what: str) -> AdapterError:
    return AdapterError(f"adapter {name}: {what}")


def _target_matches(targets: Any, layer: int, module: str) -> bool:
    """Whether peft's ``target_modules`` names ``module`` of decoder layer ``layer``: a list of names (as peft
    matches them: the module's full name ``model.layers.N.<module>`` is one of them or ends with ``.`` and one),
    ``"all-linear"``, or a regex matched against the whole name."""
    if targets is None:
        return True  # peft fills it from the architecture; the tensors say which modules
    key = f"model.layers.{layer}.{module}"
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, key) is not None
    return any(key == t or key.endswith("." + t) for t in targets)


def _read_config(path: Path, name: str) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise _fail(name, f"no {CONFIG_FILE} in {path} (an adapter is a directory peft's save_pretrained wrote)")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise _fail(name, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_text())
    except RecursionError:  # not a ValueError: the server's start printed a traceback
        raise _fail(name, f"{CONFIG_FILE} nests deeper than the JSON parser goes") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(name, f"{CONFIG_FILE} is not JSON: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise _fail(name, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict, name: str) -> tuple[int, float, bool]:
    """``(r, lora_alpha, use_rslora)`` of a config peft's LoRA math covers as served here; AdapterError naming the
    first field that is not."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(name, f"peft_type {peft_type!r}: only LORA adapters are served")
    for key, why in _REFUSED_TRUE.items():
        if config.get(key):
            raise _fail(name, f"{key} is {config[key]!r}: {why}")
    for key, why in _REFUSED_NONEMPTY.items():
        if config.get(key):
            raise _fail(name, f"{key} is {config[key]!r}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _fail(name, f"bias is {bias!r}: only bias \"none\" is served (trained biases change the base layers)")
    r = config.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(name, f"r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise _fail(name, f"lora_alpha must be a finite number > 0, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise _fail(name, f"use_rslora must be true or false, got {rslora!r}")
    targets = config.get("target_modules")
    if targets is not None and not (isinstance(targets, str) or (isinstance(targets, list)
                                                                 and all(isinstance(t, str) for t in targets))):
        raise _fail(name, f"target_modules must be a list of module names or a regex, got {targets!r}")
    if isinstance(targets, str) and targets != "all-linear":
        try:
            re.compile(targets)
        except re.error as e:  # not a ValueError: the server's start printed a traceback
            raise _fail(name, f"target_modules {targets!r} is not a regex: {e}") from None
    layers = config.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) or (isinstance(layers, list)
                                                               and all(isinstance(i, int) for i in layers))):
        raise _fail(name, f"layers_to_transform must be an int or a list of ints, got {layers!r}")
    return r, float(alpha), rslora


def _tensor_digest(h: Any, key: str, t: torch.Tensor) -> None:
    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    for part in (key.encode(), str(t.dtype).encode(), json.dumps(list(t.shape)).encode(), data):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)


def read_adapter(path: str | Path, name: str = "") -> LoraAdapter:
    """Read and validate the adapter at ``path`` (not yet against a model: :func:`check_adapter_fits`), reading
    every tensor once to check it is finite and to compute the fingerprint. AdapterError if it cannot be served."""
    from safetensors import SafetensorError, safe_open

    path = Path(path).expanduser()
    name = name or path.name
    if not path.is_dir():
        raise _fail(name, f"{path} is not a directory (an adapter is a directory peft's save_pretrained wrote)")
    config = _read_config(path, name)
    r, alpha, rslora = _check_config(config, name)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        also = " (adapter_model.bin is not read: save it with safe_serialization)" if (
            path / "adapter_model.bin").exists() else ""
        raise _fail(name, f"no {WEIGHTS_FILE} in {path}{also}")
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    h = hashlib.blake2b(digest_size=FINGERPRINT_CHARS // 2)
    h.update(json.dumps({"lora_alpha": alpha, "use_rslora": rslora}, sort_keys=True).encode())
    dtypes = set()
    try:
        with safe_open(str(weights), framework="pt") as f:
            keys = sorted(f.keys())
            if not keys:
                raise _fail(name, f"{WEIGHTS_FILE} holds no tensors")
            for key in keys:
                m = _KEY_RE.match(key)
                if m is None:
                    raise _fail(name, _why_not_served(key))
                t = f.get_tensor(key)
                if t.dtype not in _TENSOR_DTYPES:  # (float8's isfinite raised NotImplementedError: a traceback)
                    raise _fail(name, f"tensor {key} is {t.dtype}, not float32, float16, bfloat16 or float64")
                if not bool(torch.isfinite(t).all()):
                    raise _fail(name, f"tensor {key} holds NaN or infinite values")
                if t.ndim != 2:
                    raise _fail(name, f"tensor {key} has shape {list(t.shape)}, a LoRA matrix is 2-D")
                pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = key
                shapes[key] = tuple(t.shape)
                dtypes.add(t.dtype)
                _tensor_digest(h, key, t)
    except SafetensorError as e:
        raise _fail(name, f"{WEIGHTS_FILE} is not a safetensors file: {' '.join(str(e).split())}") from None
    if len(dtypes) > 1:
        raise _fail(name, f"its tensors mix dtypes {sorted(str(d) for d in dtypes)}")
    targets, only = config.get("target_modules"), config.get("layers_to_transform")
    only = None if only is None else ({only} if isinstance(only, int) else set(only))
    rank_pattern = bool(config.get("rank_pattern"))
    modules: dict[tuple[int, str], LoraModule] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"model.layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise _fail(name, f"{where} has no {missing} tensor (each targeted module needs lora_A and lora_B)")
        (ra, fan_in), (fan_out, rb) = shapes[ab["A"]], shapes[ab["B"]]
        if ra != rb:
            raise _fail(name, f"{where}: lora_A is {list(shapes[ab['A']])}, lora_B {list(shapes[ab['B']])}: their "
                              f"ranks differ")
        if ra < 1:  # (rank_pattern lets a module's rank differ from r) its scaling would divide by zero
            raise _fail(name, f"{where}: rank 0 (lora_A {list(shapes[ab['A']])}): a LoRA matrix has at least one row")
        if not rank_pattern and ra != r:
            raise _fail(name, f"{where}: rank {ra} (lora_A {list(shapes[ab['A']])}), the config's r is {r}")
        if not _target_matches(targets, layer, module):
            raise _fail(name, f"{where} is not among target_modules {targets!r}")
        if only is not None and layer not in only:
            raise _fail(name, f"{where} is outside layers_to_transform {sorted(only)}")
        scaling = alpha / math.sqrt(ra) if rslora else alpha / ra
        modules[(layer, module)] = LoraModule(layer, module, ra, fan_in, fan_out, scaling, ab["A"], ab["B"])
    base = config.get("base_model_name_or_path")
    return LoraAdapter(name=name, path=path, fingerprint=h.hexdigest(), lora_alpha=alpha, use_rslora=rslora,
                       modules=modules, dtype=dtypes.pop(), base_model=base if isinstance(base, str) else "",
                       config=config)


def _why_not_served(key: str) -> str:
    """The one-line reason a tensor of an adapter file is not served."""
    if "lora_magnitude_vector" in key:
        return f"tensor {key} is a DoRA magnitude: DoRA adapters are not served"
    if "modules_to_save" in key:
        return f"tensor {key} is a fully trained module (modules_to_save): not served"
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        return (f"tensor {key} targets {'the LM head' if 'lm_head' in key else 'the embeddings'}, outside the "
                f"transformer blocks: only the blocks' Linear layers are served")
    if re.search(r"\.lora_[AB]\.bias$", key):
        return f"tensor {key} is a LoRA bias (lora_bias): not served"
    if ".lora_" in key and not key.startswith("base_model.model.model.layers."):
        return (f"tensor {key} targets a module outside the transformer blocks: only the blocks' Linear layers are "
                f"served")
    return (f"unexpected tensor {key} (peft's keys are base_model.model.model.layers.N.<module>.lora_A.weight and "
            f"lora_B.weight)")


def check_adapter_fits(adapter: LoraAdapter, config: Any) -> None:
    """AdapterError unless every module ``adapter`` targets is a Linear of the model's decoder layers (``config``,
    a transformers config) with the shapes of its ``A`` and ``B``: the shapes decide which model an adapter is of
    (the config's ``base_model_name_or_path`` may name a copy stored elsewhere)."""
    from torch import nn

    from petals_chain.swarm.checkpoint import decoder_layer_class
    from petals_chain.swarm.sources import empty_weights

    layers = int(config.num_hidden_layers)
    with empty_weights():
        block = decoder_layer_class(config)(config, 0)
    for (layer, module), m in sorted(adapter.modules.items()):
        where = f"model.layers.{layer}.{module}"
        if layer >= layers:
            raise _fail(adapter.name, f"targets {where}, but the model has {layers} layers (an adapter of another "
                                      f"model?)")
        try:
            target = block.get_submodule(module)
        except AttributeError:
            raise _fail(adapter.name, f"targets {where}, which the model's decoder layers do not have (an adapter of "
                                      f"another model?)") from None
        if not isinstance(target, nn.Linear):
            raise _fail(adapter.name, f"targets {where}, a {type(target).__name__}: only Linear layers are served")
        if (m.in_features, m.out_features) != (target.in_features, target.out_features):
            raise _fail(adapter.name, f"{where}: lora_A is [{m.rank}, {m.in_features}] and lora_B [{m.out_features}, "
                                      f"{m.rank}], the model's Linear is {target.in_features} -> "
                                      f"{target.out_features} (an adapter of another model?)")
