"""Model sources: where a model's config, tensors and tokenizer come from.

``--model`` everywhere (server, orchestrator, demo, testbeds, client tokenizer) takes a short name from the
registry (``smollm2-135m``), a ``.gguf`` file, an HF-format directory (``config.json`` + safetensors), or an
HF hub name. :func:`resolve_source` turns it into a :class:`ModelSource`:

* :class:`HFSource` reads tensors from safetensors shards by name.
* :class:`GGUFSource` reads tensors from a GGUF file with the ``gguf`` package's reader (memory-mapped) and
  dequantizes only the tensors asked for, so a server's memory follows its span. Names, the Llama q/k
  un-permutation and the config follow transformers' own GGUF loader, so the result equals
  ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` tensor for tensor.

Every source has a :attr:`~ModelSource.fingerprint`: a hash of the architecture, the tensor index (names,
types, shapes) and every byte of every tensor (hashed once per file, then cached). It is part of every server
record, so two different models, or two files differing in one weight, never share a swarm by accident. It names
the stored weights: the same model as GGUF and as safetensors are two models (other bytes, other types).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import re
import struct
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)
_EMPTY_INIT = threading.local()  # .depth: how many empty_weights() blocks the current thread is inside
_EMPTY_INIT_HOOK: list = []  # the torch hook's handle, once installed
_EMPTY_INIT_HOOK_LOCK = threading.Lock()


def _param_to_meta(module: torch.nn.Module, name: str, param: "torch.nn.Parameter | None") -> Any:
    """Module-parameter registration hook: in a thread inside :func:`empty_weights`, the parameter moved to meta."""
    if param is None or param.is_meta or not getattr(_EMPTY_INIT, "depth", 0):
        return None
    new = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)  # (e.g. transformers' _is_hf_initialized)
    return new


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Modules built in this block get their parameters on the meta device (no memory), their buffers real: as
    accelerate's ``init_empty_weights``, but for the calling thread only. accelerate's swaps
    ``nn.Module.register_parameter`` for every thread, so a weight assigned or a module built in another thread of
    the process meanwhile landed on meta (two servers of one process: "tensors left uninitialised"), and two
    overlapping blocks left the swap installed for good when the first one opened closed first (every module built
    afterwards in the process on meta). A parameter-registration hook (installed once) that looks at a
    thread-local depth touches no other thread, so loads need no lock and run in parallel."""
    if not _EMPTY_INIT_HOOK:
        with _EMPTY_INIT_HOOK_LOCK:
            if not _EMPTY_INIT_HOOK:
                _EMPTY_INIT_HOOK.append(
                    torch.nn.modules.module.register_module_parameter_registration_hook(_param_to_meta))
    _EMPTY_INIT.depth = getattr(_EMPTY_INIT, "depth", 0) + 1
    try:
        yield
    finally:
        _EMPTY_INIT.depth -= 1

# Families whose blocks are proven token-exact against transformers by tests (tests/test_e2e_families.py,
# tests/test_real_model.py). Others (Gemma2's soft-capping, Granite's multipliers, Cohere, ...) would be served
# silently wrong by the generic block runner, so they are refused at start.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")

_CONFIG_VOLATILE = {"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache", "name_or_path",
                    "_name_or_path", "_attn_implementation", "_commit_hash", "auto_map", "output_attentions",
                    "output_hidden_states", "return_dict"}


# safetensors header dtype -> torch dtype, of the floating types transformers' "auto" may pick (not float8/4);
# None: float64, which transformers would take but we do not serve (such weights keep loading as float32)
_SAFETENSORS_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": None}


# Checkpoints written before the rotary module moved to the model level hold each layer's
# ``self_attn.rotary_emb.inv_freq`` (e.g. ahxt/LiteLlama-460M-1T); transformers recomputes it from the config.
# (Here, not only in checkpoint.py, which imports this module: swarm allows no import cycle.)
_IGNORED_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def ignored_tensor(name: str) -> bool:
    """Whether transformers ignores the checkpoint tensor ``name`` when it loads a model (and so do we)."""
    return _IGNORED_TENSOR.search(name) is not None


class UnsupportedModelError(ValueError):
    """A model family the block runner is not proven exact for."""


MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$")  # a model's name in --model NAME=SOURCE


def split_model_arg(value: str) -> tuple[str | None, str]:
    """``--model`` as ``(name, source)``: ``NAME=SOURCE`` when what comes before the first ``=`` is a model name,
    else the whole value is the source (a path may hold ``=``)."""
    name, sep, source = value.partition("=")
    if sep and source and MODEL_NAME_RE.match(name):
        return name, source
    return None, value


def check_family(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config.model_type`` is in :data:`SUPPORTED_FAMILIES`."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r} is not supported: petals-chain serves {', '.join(SUPPORTED_FAMILIES)} "
            f"(families proven token-exact against transformers by its tests)")


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Sizes a decoder layer is built from: each a positive integer where the config has it (None: derived).
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                "num_key_value_heads", "head_dim", "max_position_embeddings")
_REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _one_line(e: BaseException, limit: int = 300) -> str:
    return " ".join(str(e).split())[:limit]


def _shape_text(shape: Any) -> str:
    return "missing" if shape is None else f"[{', '.join(map(str, shape))}]"


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (a few runs at most)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:6])
    return (text + ", ...") if len(runs) > 6 else (text or "none")


def _check_sizes(sizes: dict[str, Any], path: Path, required: tuple[str, ...] = _REQUIRED_SIZES) -> None:
    """ValueError unless every size of :data:`_SIZE_FIELDS` in ``sizes`` (a config's, or a config.json's before
    transformers' validators divide by them) is a positive integer, the ``required`` ones given, and the attention
    heads are a multiple of the key/value heads."""
    for name in _SIZE_FIELDS:
        value = sizes.get(name)
        if value is None and name not in required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: invalid model config: {name} must be a positive integer, got {value!r}")
    heads, kv = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(f"{path}: invalid model config: num_attention_heads ({heads}) is not a multiple of "
                         f"num_key_value_heads ({kv})")


def _config_digest(config: Any) -> dict:
    d = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_VOLATILE and not k.startswith("_")}
    return json.loads(json.dumps(d, sort_keys=True, default=str))


class ModelSource(ABC):
    """A model's config, tensors (by HF name) and tokenizer; thread-safe, cached per path (see resolve_source)."""

    kind: str = ""

    def __init__(self, path: Path, name: str):
        self.path = path
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    @functools.cached_property
    def config(self) -> Any:
        """The transformers config (a private copy per source; callers deep-copy before changing it).

        ValueError, naming the source, for a config transformers refuses, sizes that are not positive integers, or
        (for a supported family) a config the weights do not match: their blocks, or one tensor's shape. Else a
        server announced a model of 10^9 blocks, or failed with a traceback once assigned a block.
        """
        try:
            config = self._load_config()
        except (OSError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - transformers' validators raise TypeError, ZeroDivisionError, ...
            raise ValueError(f"{self.path}: invalid model config ({type(e).__name__}: {_one_line(e)})") from None
        if getattr(config, "model_type", None) in SUPPORTED_FAMILIES:  # others are refused by check_family
            _check_sizes({name: getattr(config, name, None) for name in _SIZE_FIELDS}, self.path)
            self._check_tensors(config)
        return config

    @abstractmethod
    def _load_config(self) -> Any: ...

    @abstractmethod
    def _tensor_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor, from the file headers (no tensor data read)."""

    def _check_tensors(self, config: Any) -> None:
        """ValueError unless the weights hold blocks ``0..L-1`` of the config's ``L``, each with the tensors and
        shapes of the config's decoder layer, and embeddings of ``vocab_size x hidden_size``."""
        from transformers import AutoModelForCausalLM

        # legacy per-layer rotary ``inv_freq`` buffers: transformers ignores them on load, and so does load_block
        shapes = {n: s for n, s in self._tensor_shapes(config).items() if not ignored_tensor(n)}
        n_layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
        blocks: dict[int, dict[str, tuple[int, ...]]] = defaultdict(dict)
        for name, shape in shapes.items():
            m = _LAYER_RE.match(name)
            if m:
                blocks[int(m.group(1))][name[m.end():]] = tuple(shape)
        held = sorted(blocks)
        if len(held) != n_layers or held[-1] != n_layers - 1:  # (not list(range(n)): n may be 10^9)
            raise ValueError(f"{self.path}: the config says num_hidden_layers={n_layers}, the weights hold "
                             f"{len(held)} blocks ({_spans(held)})")
        one = copy.deepcopy(config)  # block 0 of a one-block skeleton: what load_block expects of every block
        one.num_hidden_layers = 1
        if getattr(one, "layer_types", None) is not None:
            one.layer_types = one.layer_types[:1]
        with empty_weights():
            skeleton = AutoModelForCausalLM.from_config(one)
        prefix = "model.layers.0."
        tensors = [*skeleton.named_parameters(), *skeleton.named_buffers()]
        expected = {n[len(prefix):]: tuple(t.shape) for n, t in tensors
                    if n.startswith(prefix) and not n.endswith("inv_freq")}
        for i in range(n_layers):
            if blocks[i] != expected:
                bad = sorted(n for n in expected.keys() | blocks[i].keys() if expected.get(n) != blocks[i].get(n))
                first = bad[0]
                raise ValueError(f"{self.path}: block {i} does not match the config: tensor {first!r} is "
                                 f"{_shape_text(blocks[i].get(first))} in the weights, the config makes it "
                                 f"{_shape_text(expected.get(first))}" + (f" (and {len(bad) - 1} more)" if bad[1:]
                                                                          else ""))
        vocab = int(config.vocab_size)
        for name, want in (("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,)),
                           ("lm_head.weight", (vocab, hidden))):
            if name == "lm_head.weight" and name not in shapes:
                continue  # tied to the embeddings
            if tuple(shapes.get(name, ())) != want:
                raise ValueError(f"{self.path}: tensor {name!r} is {_shape_text(shapes.get(name))} in the weights, "
                                 f"the config (vocab_size {vocab}, hidden_size {hidden}) makes it {_shape_text(want)}")

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """HF names of every tensor the source holds (``model.layers.N.…``, ``model.embed_tokens.weight``, …)."""

    @abstractmethod
    def read_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Exactly ``names`` (HF names), as stored (safetensors) or dequantized to float32 (GGUF)."""

    @abstractmethod
    def load_tokenizer(self) -> Any: ...

    @abstractmethod
    def load_reference(self, dtype: torch.dtype = torch.float32) -> Any:
        """transformers' own whole model of this source (eval mode): what token-exactness is checked against."""

    @abstractmethod
    def _fingerprint_parts(self) -> list[bytes]: ...

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex digits identifying this model (architecture + tensor index + all weight bytes)."""
        h = hashlib.sha256()
        h.update(json.dumps(_config_digest(self.config), sort_keys=True).encode())
        for part in self._fingerprint_parts():
            h.update(part)
        return h.hexdigest()[:16]

    @abstractmethod
    def _legacy_fingerprint_parts(self) -> list[bytes]: ...

    @functools.cached_property
    def legacy_fingerprint(self) -> str:
        """The fingerprint petals-chain gave this model before it hashed every weight byte (before commit 14a2ac8:
        architecture + tensor index + the first and last 4 KiB of each tensor). A peer of such a version announces
        it for this very model: it is then told to upgrade, not that it serves another model."""
        h = hashlib.sha256()
        h.update(json.dumps(_config_digest(self.config), sort_keys=True).encode())
        for part in self._legacy_fingerprint_parts():
            h.update(part)
        return h.hexdigest()[:16]

    def eos_token_ids(self) -> set[int]:
        """End-of-sequence ids from the config (and generation config when the source has one)."""
        eos = getattr(self.config, "eos_token_id", None)
        ids = eos if isinstance(eos, (list, tuple)) else [eos]
        return {int(e) for e in ids if e is not None}


class HFSource(ModelSource):
    """An HF-format directory: ``config.json`` and safetensors weights (sharded or not)."""

    kind = "hf"

    def _load_config(self) -> Any:
        from transformers import AutoConfig

        try:
            raw = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            raw = None  # transformers says what is wrong with it
        if isinstance(raw, dict) and raw.get("model_type") in SUPPORTED_FAMILIES:
            _check_sizes(raw, self.path, required=())
        config = AutoConfig.from_pretrained(str(self.path))
        if getattr(config, "dtype", None) is None:
            # "auto" then means the weights' dtype (as transformers' from_pretrained decides it), not float32
            config.dtype = self._weights_dtype()
        return config

    def _weights_dtype(self) -> torch.dtype | None:
        """The dtype transformers' ``from_pretrained(dtype="auto")`` takes for a config naming none: the index's
        ``metadata.dtype``, else the first floating tensor's of the first weight file (by name); None if unknown
        (no or bad weights: _check_tensors says what is wrong with them)."""
        try:
            index = self.path / "model.safetensors.index.json"
            if index.is_file():
                named = (json.loads(index.read_text()).get("metadata") or {}).get("dtype")
                if isinstance(named, str):
                    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(named)
            files = sorted(set(self.weight_map.values()))
            if not files:
                return None
            with _open_safetensors(self.path / files[0]) as f:
                for k in f.keys():
                    if (kind := f.get_slice(k).get_dtype()) in _SAFETENSORS_FLOAT_DTYPES:
                        return _SAFETENSORS_FLOAT_DTYPES[kind]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None

    @functools.cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> safetensors file name (from ``model.safetensors.index.json`` or the single file)."""

        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            wmap = dict(json.loads(index.read_text())["weight_map"])
            for fname in set(wmap.values()):
                # names inside the folder only (by name: a Hugging Face cache links its files to blobs elsewhere)
                if not isinstance(fname, str) or PurePath(fname).is_absolute() or ".." in PurePath(fname).parts:
                    raise ValueError(f"{index}: weight file {fname!r} is not a file name inside {self.path}")
            return wmap
        single = self.path / "model.safetensors"
        if single.is_file():
            with _open_safetensors(single) as f:
                return {k: single.name for k in f.keys()}
        raise FileNotFoundError(f"no safetensors weights in {self.path} (expected model.safetensors or an index)")

    def tensor_names(self) -> list[str]:
        return list(self.weight_map)

    def read_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        wmap = self.weight_map
        missing = [n for n in names if n not in wmap]
        if missing:
            raise KeyError(f"tensors not in {self.path}: {missing[:5]}")
        by_file: dict[str, list[str]] = defaultdict(list)
        for n in names:
            by_file[wmap[n]].append(n)
        out: dict[str, torch.Tensor] = {}
        for fname, keys in by_file.items():
            with _open_safetensors(self.path / fname) as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

    def load_reference(self, dtype: torch.dtype = torch.float32) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.path), dtype=dtype).eval()

    def eos_token_ids(self) -> set[int]:
        ids = super().eos_token_ids()
        if (self.path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            try:
                g = GenerationConfig.from_pretrained(str(self.path)).eos_token_id
            except (OSError, ValueError):
                g = None
            ids |= {int(e) for e in (g if isinstance(g, (list, tuple)) else [g]) if e is not None}
        return ids

    def _tensor_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, fname in self.weight_map.items():
            by_file[fname].append(name)
        shapes: dict[str, tuple[int, ...]] = {}
        for fname, names in sorted(by_file.items()):
            with _open_safetensors(self.path / fname) as f:
                held = set(f.keys())
                absent = [n for n in names if n not in held]
                if absent:
                    raise ValueError(f"{self.path / fname}: model.safetensors.index.json places {absent[:3]} in this "
                                     f"file, which does not hold {'them' if absent[1:] else 'it'}")
                for n in names:
                    shapes[n] = tuple(f.get_slice(n).get_shape())
        return shapes

    def _fingerprint_parts(self) -> list[bytes]:
        # name -> [dtype, shape, SHA-256 of its bytes] over all files: every byte of every tensor counts
        tensors: dict[str, list] = {}
        for fname in sorted(set(self.weight_map.values())):
            tensors.update(_cached_file_digest(self.path / fname, "safetensors", _safetensors_digests))
        return [json.dumps(sorted(tensors.items())).encode()]

    def _legacy_fingerprint_parts(self) -> list[bytes]:
        self.fingerprint  # noqa: B018 - checks the files (header, data covering it) before they are read here
        parts = []
        for fname in sorted(set(self.weight_map.values())):
            with open(self.path / fname, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
                header.pop("__metadata__", None)
                parts.append(json.dumps({k: [v["dtype"], v["shape"]] for k, v in header.items()},
                                        sort_keys=True).encode())
                base = 8 + n
                parts.extend(_legacy_sample(f, base + header[k]["data_offsets"][0], base + header[k]["data_offsets"][1])
                             for k in sorted(header))
        return parts


def _legacy_sample(f, start: int, end: int, size: int = 4096) -> bytes:
    """The first and last ``size`` bytes of ``[start, end)`` of the open file ``f``: what the fingerprint of
    versions before 14a2ac8 hashed of each tensor."""
    f.seek(start)
    head = f.read(min(size, end - start))
    tail_start = max(start, end - size)
    f.seek(tail_start)
    return head + f.read(end - tail_start)


def fingerprint_problem(theirs: str, ours: str, ours_legacy: str = "", ours_is: str = "this swarm's") -> str:
    """Why a peer announcing model fingerprint ``theirs`` is not one for this model (fingerprint ``ours``, or
    ``ours_legacy`` as versions before 14a2ac8 computed it): "" when it is ``ours``. ``ours_is`` names whose
    ``ours`` is (a server says "this server's")."""
    if theirs == ours:
        return ""
    if theirs and theirs == ours_legacy:
        return (f"it runs an older petals-chain, which fingerprints this same model as {theirs} (sampled weights; "
                f"this version hashes every weight byte: {ours}): upgrade it")
    return f"it serves model {theirs or '(unknown)'}, not {ours_is} {ours}"


def _ggml_type_name(type_id: int) -> str:
    """``"Q5_0 (6)"``: a ggml type id with its name where the ``gguf`` package knows it."""
    from gguf import GGMLQuantizationType

    try:
        return f"{GGMLQuantizationType(type_id).name} ({type_id})"
    except ValueError:
        return f"{type_id} (unknown)"


def _supported_ggml_types() -> list[str]:
    """Names of the ggml types a GGUF's tensors may use: what transformers' header reader takes."""
    from transformers.integrations.gguf.dequant import GGML_BLOCK

    return [_ggml_type_name(t).split(" ")[0] for t in sorted({0, 1, 30, *GGML_BLOCK})]  # F32, F16, BF16, blocks


def _open_safetensors(path: Path) -> Any:
    """``safe_open(path)`` (it checks the header and that the data covers the file); ValueError naming the file for a
    corrupt or truncated one (safetensors raises its own error type, which the command lines showed as a traceback).
    The file is opened here first: safetensors reports any file it cannot open, an unreadable one too, as "No such
    file or directory"."""
    with open(path, "rb"):
        pass
    try:
        return safe_open(str(path), "pt", device="cpu")
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError, ...
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({_one_line(e, 200)})") from None


def _safetensors_digests(path: Path) -> dict[str, list]:
    """Tensor name -> ``[dtype, shape, SHA-256 of its bytes]`` of one safetensors file."""
    with _open_safetensors(path):  # the header parses and the data covers the file: the offsets below are sound
        pass
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        base = 8 + n
        return {k: [v["dtype"], v["shape"], _range_digest(f, *(base + x for x in v["data_offsets"]))]
                for k, v in sorted(header.items())}


def _range_digest(f, start: int, end: int, chunk: int = 1 << 22) -> str:
    """SHA-256 (hex) of bytes ``[start, end)`` of the open file ``f``; ValueError if the file ends first."""
    h = hashlib.sha256()
    f.seek(start)
    left = end - start
    while left > 0:
        block = f.read(min(chunk, left))
        if not block:
            raise ValueError(f"{f.name}: truncated while hashing its weights (the file changed?)")
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def _file_stamp(st: os.stat_result) -> str:
    """What tells a file's versions apart for the caches keyed by it: size, mtime, inode and ctime. The mtime alone
    can be set back (``os.utime``, ``touch -r``, a copy keeping times) over a byte changed in place, which then kept
    the old fingerprint; the ctime cannot be set by a user, and a file replaced by another has a new inode."""
    return f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"


def _cached_file_digest(path: Path, kind: str, compute: Any) -> Any:
    """``compute(path)``, cached in the user cache by the file's path and :func:`_file_stamp` (hashing every weight
    byte of a large model takes seconds to minutes: once per file, not at every start)."""
    from petals_chain.swarm.registry import cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{kind}|{path.resolve()}|{_file_stamp(st)}".encode()).hexdigest()[:24]
    saved = cache_dir() / "fingerprints" / f"{key}.json"
    try:
        return json.loads(saved.read_text())
    except (OSError, ValueError):
        pass
    if st.st_size > 1 << 30:
        logger.info("hashing the weights of %s (%.1f GB; once, then cached)", path, st.st_size / 1e9)
    value = compute(path)
    _save_json(saved, value)  # (a read-only cache only costs time)
    return value


def _save_json(path: Path, value: Any) -> None:
    """Write ``value`` to the cache file ``path`` atomically, through a temporary file of its own (threads of one
    process shared a pid-named one), removed if the write fails; a cache that cannot be written is skipped."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _cache_temp(path)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(value))
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _cache_temp(path: Path, folder: bool = False) -> tuple[int, str]:
    """A new temporary file (open for writing: its descriptor, -1 for a folder) or folder of its own beside ``path``,
    with the mode a plain ``open`` or ``mkdir`` gives under the umask: mkstemp's 0600 and mkdtemp's 0700 hid the
    entries renamed from them from the other users of a shared cache (``$PETALS_CHAIN_CACHE_DIR``), whose start then
    failed on the tokenizer's folder and hashed the weights again."""
    for _ in range(100):
        name = str(path.parent / f"{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            if folder:
                os.mkdir(name, 0o777)
                return -1, name
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


class GGUFSource(ModelSource):
    """A GGUF file (llama.cpp format), dequantized to float32 tensor by tensor as they are read (thread-safe).

    The config and fingerprint are cached in the user cache (keyed by path and :func:`_file_stamp`), and the tokenizer
    converted from the GGUF vocabulary is saved there once, so later starts skip the metadata parse.
    """

    kind = "gguf"

    def __init__(self, path: Path, name: str):
        super().__init__(path, name)
        self._file_stamp = _file_stamp(path.stat())  # it changed if this did
        key = hashlib.sha256(f"{path.resolve()}|{self._file_stamp}".encode()).hexdigest()[:24]
        from petals_chain.swarm.registry import cache_dir

        self._meta_path = cache_dir() / "gguf" / f"{key}.json"
        self._meta_cache: dict | None = None

    # ---- cached metadata ----
    def _meta(self) -> dict:
        if self._meta_cache is None:
            try:
                self._meta_cache = json.loads(self._meta_path.read_text())
            except (OSError, ValueError):
                self._meta_cache = {}
        return self._meta_cache

    def _save_meta(self, **updates: Any) -> None:
        meta = {**self._meta(), **updates}
        self._meta_cache = meta
        _save_json(self._meta_path, meta)  # (a read-only cache only costs speed)

    def _config_dict(self) -> dict:
        meta = self._meta()
        if "config" not in meta:
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

            self.check_file()
            try:
                cfg = load_gguf_checkpoint(str(self.path), return_tensors=False)["config"]
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - a malformed file fails anywhere in the parser
                raise ValueError(f"{self.path}: corrupt GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
            self._save_meta(config=cfg)
        return copy.deepcopy(self._meta()["config"])

    def check_file(self) -> None:
        """ValueError unless the header parses and every tensor lies inside the file. Checked before the metadata
        parse: its reader trusts the header's counts (a count of 2^40 in a corrupt or hostile file looped for
        minutes, GBs growing), where the header reader stops at the end of the file."""
        try:
            table = self._table
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - struct.error, UnicodeDecodeError, ... of a malformed header
            unsupported = re.search(r"tensors of ggml type (\d+), which is not supported", str(e))
            if unsupported:  # a sound file of a quantization the loader cannot read: say which, not "corrupt"
                raise ValueError(f"{self.path}: its tensors use the GGUF quantization type "
                                 f"{_ggml_type_name(int(unsupported.group(1)))}, which petals-chain cannot load "
                                 f"(supported: {', '.join(_supported_ggml_types())})") from None
            raise ValueError(f"{self.path}: corrupt or truncated GGUF file ({type(e).__name__}: {str(e)[:200]})"
                             ) from None
        size = self.path.stat().st_size
        for name, (_, _, start, nbytes) in table.items():
            if start + nbytes > size:
                raise ValueError(f"{self.path}: corrupt or truncated GGUF file: tensor {name!r} ends at byte "
                                 f"{start + nbytes}, the file has {size}")

    def _load_config(self) -> Any:
        from transformers import AutoConfig

        d = self._config_dict()
        model_type = d.pop("model_type")
        d.pop("_model_name_or_path", None)
        config = AutoConfig.for_model(model_type, **d)
        return config

    @functools.cached_property
    def _table(self) -> dict[str, tuple[tuple[int, ...], int, int, int]]:
        """GGUF name -> (shape in torch order, ggml type, absolute byte offset, byte count).

        transformers' header reader skips the vocabulary while parsing; the ``gguf`` package's reader would
        build ~160 MB of Python objects for a 49k vocabulary, which a server holding a few blocks must not pay.
        """
        from transformers.integrations.gguf.reader import GgufHeader

        header = GgufHeader.from_file(str(self.path))
        self._arch = header.architecture
        return {t.name: (t.shape, t.ggml_type, header.data_start + t.offset, t.nbytes) for t in header.tensors}

    @property
    def _architecture(self) -> str:
        if not hasattr(self, "_arch"):
            self._table  # noqa: B018 - parses the header, sets _arch
        return self._arch

    @functools.cached_property
    def _names(self) -> dict[str, str]:
        """GGUF tensor name -> HF name, as transformers maps them (on a model skeleton on the meta device)."""
        return self._map_names(self.config)

    def _tensor_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        names = self._map_names(config)
        self.__dict__["_names"] = names  # the cached property's value: mapped once
        return {h: tuple(self._table[g][0]) for g, h in names.items()}

    def _map_names(self, config: Any) -> dict[str, str]:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        # transformers' mapper walks every submodule's state dict (seconds for 30 layers): map a one-layer
        # skeleton and repeat its block-0 names for every block the file holds (the allow-listed families name
        # blocks alike; the config's count is checked against them by _check_tensors, and may be absurd).
        held = sorted({int(m.group(1)) for m in map(re.compile(r"^blk\.(\d+)\.").match, self._table) if m})
        one = copy.deepcopy(config)
        one.num_hidden_layers = 1
        if getattr(one, "layer_types", None) is not None:
            one.layer_types = one.layer_types[:1]
        with empty_weights():
            skeleton = AutoModelForCausalLM.from_config(one)
        processor = TENSOR_PROCESSORS.get(self._architecture, TensorProcessor)(config=self._config_dict())
        gguf_to_hf: dict[str, str] = {}
        for g, h in get_gguf_hf_weights_map(skeleton, processor, num_layers=1).items():
            if g.startswith("blk.0.") and h.startswith("model.layers.0."):
                for i in held:
                    gguf_to_hf[f"blk.{i}.{g[6:]}"] = f"model.layers.{i}.{h[15:]}"
            else:
                gguf_to_hf[g] = h
        return {g: h for g, h in gguf_to_hf.items() if g in self._table}

    def tensor_names(self) -> list[str]:
        return list(self._names.values())

    def _raw(self, gguf_name: str) -> Any:
        """The stored bytes of one tensor as ``[..., bytes per row]`` uint8 (what ``gguf.dequantize`` takes)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        import numpy as np

        shape, ggml_type, start, nbytes = self._table[gguf_name]
        block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        # A plain read, not a memory map: mapped file pages would stay in the process's RSS after loading.
        raw = np.fromfile(self.path, dtype=np.uint8, count=nbytes, offset=start)
        return raw.reshape(*shape[:-1], shape[-1] // block_elements * block_bytes)

    def read_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        import numpy as np
        from gguf import GGMLQuantizationType, dequantize
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        hf_to_gguf = {h: g for g, h in self._names.items()}
        missing = [n for n in names if n not in hf_to_gguf]
        if missing:
            raise KeyError(f"tensors not in {self.path}: {missing[:5]}")
        processor = TENSOR_PROCESSORS.get(self._architecture, TensorProcessor)(config=self._config_dict())
        out: dict[str, torch.Tensor] = {}
        for hf_name in names:
            g = hf_to_gguf[hf_name]
            # The same steps as transformers' GGUF loader (dequantize, then the family's processor, e.g. the
            # Llama q/k un-permutation), so the tensors equal from_pretrained(..., gguf_file=...).
            weights = dequantize(self._raw(g), GGMLQuantizationType(self._table[g][1]))
            result = processor.process(weights=weights, name=g, tensor_key_mapping=self._names, parsed_parameters={})
            out[hf_name] = torch.from_numpy(np.array(result.weights, dtype=np.float32, copy=True))
        return out

    def load_reference(self, dtype: torch.dtype = torch.float32) -> Any:
        from transformers import AutoModelForCausalLM

        with _gguf_parsed_once():
            return AutoModelForCausalLM.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                        dtype=dtype).eval()

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        from petals_chain.swarm.registry import cache_dir

        # the fingerprint names the weights, not the tokenizer: a file with the same weights and another vocabulary
        # or chat template must not get this one's (the file's stamp tells such a file apart)
        file_id = hashlib.sha256(self._file_stamp.encode()).hexdigest()[:12]
        saved = cache_dir() / "tokenizers" / f"{self.fingerprint}-{file_id}"
        try:  # (a folder this user cannot read, another's in a shared cache, is converted again)
            if (saved / "tokenizer.json").is_file():
                return AutoTokenizer.from_pretrained(str(saved))
        except (OSError, ValueError):
            pass
        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        import shutil

        tmp = None
        try:
            saved.parent.mkdir(parents=True, exist_ok=True)
            # a folder of its own (two threads of one process converted into the same pid-named one)
            tmp = _cache_temp(saved, folder=True)[1]
            tok.save_pretrained(tmp)
            os.replace(tmp, saved)  # onto one another process saved meanwhile: ENOTEMPTY, and ours is dropped
            tmp = None
        # A cache that cannot be written only costs the conversion at every start: read-only, or full (tokenizers
        # writes tokenizer.json in Rust, and its failure to is a plain Exception: ENOSPC, EFBIG)
        except Exception as e:  # noqa: BLE001
            if not os.path.isdir(saved):  # (else another process saved it meanwhile: the rename lost the race)
                logger.info("the tokenizer converted from %s is not cached in %s (%s)", self.path.name, saved.parent,
                            _one_line(e, 200))
        finally:
            if tmp is not None:  # it was left behind in the cache, one folder per lost race
                shutil.rmtree(tmp, ignore_errors=True)
        return tok

    def _fingerprint_parts(self) -> list[bytes]:
        meta = self._meta()
        if "weights_digest" not in meta:  # every byte of every tensor (a sample of each once let a changed file pass)
            self.check_file()
            if self.path.stat().st_size > 1 << 30:
                logger.info("hashing the weights of %s (once, then cached)", self.path)
            index = []
            with open(self.path, "rb") as f:
                for name, (shape, ggml_type, start, nbytes) in sorted(self._table.items()):
                    index.append([name, int(ggml_type), [int(x) for x in shape],
                                  _range_digest(f, start, start + nbytes)])
            digest = hashlib.sha256(json.dumps([self._architecture, index]).encode()).hexdigest()
            self._save_meta(weights_digest=digest)
        return [self._meta()["weights_digest"].encode()]

    def _legacy_fingerprint_parts(self) -> list[bytes]:
        self.fingerprint  # noqa: B018 - checks the file (its tensors inside it) before it is read here
        h = hashlib.sha256()
        index = []
        with open(self.path, "rb") as f:
            for name, (shape, ggml_type, start, nbytes) in sorted(self._table.items()):
                index.append([name, int(ggml_type), [int(x) for x in shape]])
                h.update(_legacy_sample(f, start, start + nbytes))
        h.update(json.dumps([self._architecture, index]).encode())
        return [h.hexdigest().encode()]


_SOURCES: dict[tuple[str, str], ModelSource] = {}
_GGUF_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF load, half its CPU (SmolLM2-135M: 35 s -> 18 s, the same weights): it parses the file
    twice (its config, then its tensors; the vocabulary's 49k strings each time) and builds gguf's tensor name map
    once per submodule (397 times). Within this block the ``gguf`` package reads each file once and builds each
    name map once. Loads are one at a time (the patched functions are the module's)."""
    import gguf

    with _GGUF_LOAD_LOCK:
        reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple, Any] = {}

        def read_once(path: Any, mode: str = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


_SOURCES_LOCK = threading.Lock()


def _hub_snapshot(name: str, revision: str | None, cache_dir: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
        raise FileNotFoundError(f"{name!r} is not a local model and huggingface_hub is unavailable") from e
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated model, ...: one clear error type for callers
        raise FileNotFoundError(f"{name!r} is not a known short name, a local directory or .gguf file, and could "
                                f"not be fetched from the Hugging Face hub: {type(e).__name__}: {e}") from e


def resolve_source(model: "str | os.PathLike | ModelSource", *, revision: str | None = None,
                   cache_dir: str | None = None) -> ModelSource:
    """The :class:`ModelSource` for ``model`` (one object per path and process, so parsing happens once).

    Order: a :class:`ModelSource` as is; a registry short name; an existing ``.gguf`` file; an existing
    directory with ``config.json``; a directory holding exactly one ``.gguf`` file; an HF hub name.
    """
    if isinstance(model, ModelSource):
        return model
    from petals_chain.swarm.registry import REGISTRY, registry_path

    text = str(model)
    if text in REGISTRY:
        path, kind, name = registry_path(text), "gguf", text
    else:
        p = Path(text).expanduser()
        if p.is_file():
            if p.suffix.lower() != ".gguf":
                raise ValueError(f"{p} is a file but not a .gguf model; give a .gguf file, an HF-format directory "
                                 f"or a short name ({', '.join(sorted(REGISTRY))})")
            # The registry's file under any path keeps its short name, so the DHT prefix matches.
            known = [n for n, e in REGISTRY.items() if e.filename == p.name]
            path, kind, name = p, "gguf", known[0] if known else p.stem
        elif p.is_dir():
            if (p / "config.json").is_file():
                path, kind, name = p, "hf", p.name
            else:
                ggufs = sorted(p.glob("*.gguf"))
                if len(ggufs) != 1:
                    raise FileNotFoundError(f"{p} is a directory without config.json (not an HF-format checkpoint)"
                                            + (f" and with {len(ggufs)} .gguf files" if ggufs else ""))
                path, kind, name = ggufs[0], "gguf", ggufs[0].stem
        elif text.count("/") > 1 or text.startswith((".", "/", "~")) or text.lower().endswith(".gguf"):
            raise FileNotFoundError(f"model {text!r} does not exist")
        else:
            path, kind, name = _hub_snapshot(text, revision, cache_dir), "hf", text.split("/")[-1]
    key = (kind, str(Path(path).resolve()))
    with _SOURCES_LOCK:
        src = _SOURCES.get(key)
        if src is None:
            src = (GGUFSource if kind == "gguf" else HFSource)(Path(path), name)
            _SOURCES[key] = src
    return src
