"""Review of 77ad2b3 and c1a9d92 (the GGUF caches written through temporary files of their own).

mkstemp's and mkdtemp's modes (0600, 0700) went with the entries renamed from them: in a cache shared by several
users (``$PETALS_CHAIN_CACHE_DIR``) another user's orchestrator failed at start on the tokenizer's folder
(``Path.is_file`` raised PermissionError) and hashed the weights again. And a disk that filled while the converted
tokenizer was saved raised out of ``load_tokenizer`` (tokenizers writes tokenizer.json in Rust: a plain Exception),
where a cache that cannot be written only costs the conversion."""

from __future__ import annotations

import os
import pathlib
import stat

import pytest
import transformers

from petals_chain.swarm.sources import _save_json, resolve_source


class _Converted:
    """Stands for the tokenizer converted from the GGUF vocabulary; ``fail`` is raised after its first file, as
    tokenizers raises when tokenizer.json does not fit on the disk."""

    def __init__(self, fail: BaseException | None = None):
        self.fail = fail

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            f.write("{}")
        if self.fail is not None:
            raise self.fail
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")


@pytest.fixture
def source(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))
    src = resolve_source("smollm2-135m")
    src.__dict__["fingerprint"] = "0123456789abcdef"  # (hashing every weight byte takes seconds)
    return src


def _modes(folder) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*")}


def test_cache_entries_get_the_mode_the_umask_gives(source, tmp_path, monkeypatch):
    old = os.umask(0o022)
    try:
        _save_json(tmp_path / "cache" / "fingerprints" / "k.json", {"a": 1})
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: _Converted())
        source.load_tokenizer()
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "cache")
    saved = next(k for k in modes if k.startswith("tokenizers/") and k.count("/") == 1)
    assert modes == {"fingerprints": 0o755, "fingerprints/k.json": 0o644, "tokenizers": 0o755, saved: 0o755,
                     f"{saved}/tokenizer_config.json": 0o644, f"{saved}/tokenizer.json": 0o644}, modes


def test_a_tokenizer_folder_this_user_cannot_read_is_converted_again(source, tmp_path, monkeypatch):
    real_is_file = pathlib.Path.is_file

    def unreadable(self):  # (as root every folder is readable: its search permission denied as to another user)
        if self.name == "tokenizer.json" and self.parent.parent.name == "tokenizers":
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(pathlib.Path, "is_file", unreadable)
    converted = _Converted()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: converted)
    assert source.load_tokenizer() is converted


@pytest.mark.parametrize("fail", [Exception("No space left on device (os error 28)"),
                                  OSError(28, "No space left on device")])
def test_a_full_disk_while_the_tokenizer_is_saved_costs_only_the_cache(source, tmp_path, monkeypatch, fail):
    converted = _Converted(fail)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: converted)
    assert source.load_tokenizer() is converted
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == []  # no half-saved folder left behind


def test_a_full_disk_while_a_json_cache_is_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    real_fdopen = os.fdopen

    class _Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda *a, **kw: _Full(real_fdopen(*a, **kw)))
    _save_json(tmp_path / "gguf" / "k.json", {"config": {}})
    assert list((tmp_path / "gguf").iterdir()) == []
