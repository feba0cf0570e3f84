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
types, shapes) and a sample of every tensor's bytes. It is part of every server record and of the default
DHT prefix, so two different models never share a swarm by accident.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import struct
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from pathlib import Path, PurePath
from typing import Any

import torch
from safetensors import safe_open

# Families whose blocks are proven token-exact against transformers by tests (tests/test_e2e_families.py,
# tests/test_real_model.py). Others (Gemma2's soft-capping, Granite's multipliers, Cohere, ...) would be served
# silently wrong by the generic block runner, so they are refused at start.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")

_FINGERPRINT_SAMPLE = 4096  # bytes hashed from each end of every tensor
_CONFIG_VOLATILE = {"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache", "name_or_path",
                    "_name_or_path", "_attn_implementation", "_commit_hash", "auto_map", "output_attentions",
                    "output_hidden_states", "return_dict"}


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
        """The transformers config (a private copy per source; callers deep-copy before changing it)."""
        return self._load_config()

    @abstractmethod
    def _load_config(self) -> Any: ...

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
        """16 hex digits identifying this model (architecture + tensor index + sampled weight bytes)."""
        h = hashlib.sha256()
        h.update(json.dumps(_config_digest(self.config), sort_keys=True).encode())
        for part in self._fingerprint_parts():
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

        return AutoConfig.from_pretrained(str(self.path))

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
            with safe_open(str(single), "pt") as f:
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
            with safe_open(str(self.path / fname), "pt", device="cpu") as f:
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

    def _fingerprint_parts(self) -> list[bytes]:
        parts = []
        for fname in sorted(set(self.weight_map.values())):
            with open(self.path / fname, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
                base = 8 + n
                header.pop("__metadata__", None)
                parts.append(json.dumps({k: [v["dtype"], v["shape"]] for k, v in header.items()},
                                        sort_keys=True).encode())
                for key in sorted(header):
                    start, end = header[key]["data_offsets"]
                    parts.append(_sample(f, base + start, base + end))
        return parts


def _sample(f, start: int, end: int) -> bytes:
    """The first and last ``_FINGERPRINT_SAMPLE`` bytes of ``[start, end)`` of the open file ``f``."""
    f.seek(start)
    head = f.read(min(_FINGERPRINT_SAMPLE, end - start))
    tail_start = max(start, end - _FINGERPRINT_SAMPLE)
    f.seek(tail_start)
    return head + f.read(end - tail_start)


class GGUFSource(ModelSource):
    """A GGUF file (llama.cpp format), dequantized to float32 tensor by tensor as they are read (thread-safe).

    The config and fingerprint are cached in the user cache (keyed by path, size and mtime), and the tokenizer
    converted from the GGUF vocabulary is saved there once, so later starts skip the metadata parse.
    """

    kind = "gguf"

    def __init__(self, path: Path, name: str):
        super().__init__(path, name)
        st = path.stat()
        self._file_stamp = f"{st.st_size}:{st.st_mtime_ns}"  # the file's size and time: it changed if they did
        key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
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
        try:
            self._meta_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._meta_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(meta))
            os.replace(tmp, self._meta_path)
        except OSError:  # a read-only cache only costs speed
            pass

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
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        # transformers' mapper walks every submodule's state dict (seconds for 30 layers): map a one-layer
        # skeleton and repeat its block-0 names for every block (the allow-listed families name blocks alike).
        n_layers = int(self.config.num_hidden_layers)
        one = copy.deepcopy(self.config)
        one.num_hidden_layers = 1
        if getattr(one, "layer_types", None) is not None:
            one.layer_types = one.layer_types[:1]
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(one)
        processor = TENSOR_PROCESSORS.get(self._architecture, TensorProcessor)(config=self._config_dict())
        gguf_to_hf: dict[str, str] = {}
        for g, h in get_gguf_hf_weights_map(skeleton, processor, num_layers=n_layers).items():
            if g.startswith("blk.0.") and h.startswith("model.layers.0."):
                for i in range(n_layers):
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

        return AutoModelForCausalLM.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                    dtype=dtype).eval()

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        from petals_chain.swarm.registry import cache_dir

        # the fingerprint names the weights, not the tokenizer: a file with the same weights and another vocabulary
        # or chat template must not get this one's (the file's size and time tell such a file apart)
        file_id = hashlib.sha256(self._file_stamp.encode()).hexdigest()[:12]
        saved = cache_dir() / "tokenizers" / f"{self.fingerprint}-{file_id}"
        if (saved / "tokenizer.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(saved))
            except (OSError, ValueError):
                pass
        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        try:
            tmp = saved.with_name(f"{saved.name}.tmp{os.getpid()}")
            tok.save_pretrained(str(tmp))
            if saved.exists():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, saved)
        except OSError:
            pass
        return tok

    def _fingerprint_parts(self) -> list[bytes]:
        meta = self._meta()
        if "fingerprint_parts" not in meta:
            h = hashlib.sha256()
            index = []
            with open(self.path, "rb") as f:
                for name, (shape, ggml_type, start, nbytes) in sorted(self._table.items()):
                    index.append([name, int(ggml_type), [int(x) for x in shape]])
                    h.update(_sample(f, start, start + nbytes))
            h.update(json.dumps([self._architecture, index]).encode())
            self._save_meta(fingerprint_parts=h.hexdigest())
        return [self._meta()["fingerprint_parts"].encode()]


_SOURCES: dict[tuple[str, str], ModelSource] = {}
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
