"""Which build of petals-chain this process runs: ``petals-chain/<package version>[+g<commit>[.dirty]]``.

Peers announce it in their records (``ServerRecord.version``), so an operator can tell which volunteers run old
code. The package version comes from the installed metadata; when the package runs from a git checkout (an
editable install, how volunteers run it), the commit checked out is appended, read from ``.git`` without running
git (HEAD, its ref, packed-refs; worktrees and ``.git`` files included), and ``.dirty`` when a tracked file differs
from the index (a stat per file, a hash only of those whose stat changed). Changes staged but not committed are not
seen (that needs the object store). A wheel or sdist install has no checkout beside it: the package version only.
Computed once per process (:func:`build_version`); never raises.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import struct
from pathlib import Path
from typing import Optional

NAME = "petals-chain"
DIST = "petals_chain"
#: the longest version a record carries (records.py's ``_SHORT_MAX``)
VERSION_MAX = 64
_HEX_RE = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_MAX_SYMREF_DEPTH = 5
# the dirty check gives up (says nothing) past these: a checkout with huge tracked files is not worth the start time
_MAX_INDEX_ENTRIES = 100_000
_MAX_HASHED_BYTES = 64 << 20


def package_version() -> str:
    """The installed distribution's version ("0+unknown" when the package is not installed, e.g. run off a copy)."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def source_root() -> Path:
    """The directory holding the ``petals_chain`` package: a git checkout's root when it runs from one."""
    return Path(__file__).resolve().parent.parent.parent


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def git_dirs(root: Path) -> Optional[tuple[Path, Path]]:
    """``(gitdir, commondir)`` of the checkout at ``root`` (a ``.git`` directory, or a ``.git`` file saying
    ``gitdir: PATH`` as worktrees and submodules have), or None when ``root`` is not one."""
    dot = Path(root) / ".git"
    if dot.is_dir():
        gitdir = dot
    elif dot.is_file():
        text = _read(dot)
        if not text or not text.startswith("gitdir:"):
            return None
        gitdir = (Path(root) / text[len("gitdir:"):].strip()).resolve()
    else:
        return None
    common = _read(gitdir / "commondir")
    return gitdir, (gitdir / common).resolve() if common else gitdir


def _packed_ref(common: Path, name: str) -> Optional[str]:
    text = _read(common / "packed-refs")
    for line in (text or "").splitlines():
        if line.startswith(("#", "^")):
            continue
        sha, _, ref = line.partition(" ")
        if ref.strip() == name:
            return sha
    return None


def git_commit(root: Path) -> Optional[str]:
    """The full hash of the commit checked out at ``root`` (HEAD, following symbolic refs to a loose or packed
    ref), or None: no checkout there, an unborn branch, or anything unreadable."""
    dirs = git_dirs(root)
    if dirs is None:
        return None
    gitdir, common = dirs
    value = _read(gitdir / "HEAD")
    for _ in range(_MAX_SYMREF_DEPTH):
        if value is None:
            return None
        if not value.startswith("ref:"):
            return value if _HEX_RE.fullmatch(value) else None  # a detached HEAD (or a ref's hash)
        name = value[len("ref:"):].strip()
        if (not name.startswith("refs/") and name != "HEAD") or ".." in name.split("/"):
            return None  # not a ref name: never read a path out of the checkout
        # a per-worktree ref, else a shared one, else packed
        value = _read(gitdir / name) or _read(common / name) or _packed_ref(common, name)
    return None


def _blob_hash(data: bytes, algo: str) -> bytes:
    h = hashlib.new(algo)
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.digest()


def worktree_dirty(root: Path) -> Optional[bool]:
    """Whether a tracked file at ``root`` differs from git's index (modified, deleted or in a merge conflict); None
    when it cannot tell cheaply (no checkout, an index format other than 2 or 3, an unreadable index, too much to
    hash). A file whose size and mtime match its index entry is taken as unchanged, as ``git status`` does, unless
    it changed in the index's second (racy); others are hashed, CRLF line ends also read as LF (autocrlf)."""
    dirs = git_dirs(root)
    if dirs is None:
        return None
    index = dirs[0] / "index"
    try:
        data = index.read_bytes()
        index_mtime = index.stat().st_mtime_ns
    except OSError:
        return None
    if len(data) < 12 or data[:4] != b"DIRC":
        return None
    version, count = struct.unpack(">II", data[4:12])
    if version not in (2, 3) or count > _MAX_INDEX_ENTRIES:
        return None
    config = _read(dirs[1] / "config") or ""
    sha_len, algo = (32, "sha256") if re.search(r"objectformat\s*=\s*sha256", config, re.I) else (20, "sha1")
    budget = _MAX_HASHED_BYTES
    pos = 12
    try:
        for _ in range(count):
            fields = struct.unpack(">10I", data[pos:pos + 40])
            mtime_ns = fields[2] * 10**9 + fields[3]
            mode, size = fields[6], fields[9]
            sha = data[pos + 40:pos + 40 + sha_len]
            (flags,) = struct.unpack(">H", data[pos + 40 + sha_len:pos + 42 + sha_len])
            head = 42 + sha_len
            extended = 0
            if version == 3 and flags & 0x4000:
                (extended,) = struct.unpack(">H", data[pos + head:pos + head + 2])
                head += 2
            end = data.index(b"\0", pos + head)
            path = data[pos + head:end].decode("utf-8", "surrogateescape")
            pos += (end - pos + 8) & ~7  # the NUL-padded entry, a multiple of 8 bytes
            if flags & 0x3000:
                return True  # a merge conflict's stage
            if flags & 0x8000 or extended & 0x4000 or mode >> 12 == 0o16:
                continue  # assume-unchanged, skip-worktree, a submodule
            full = Path(root) / path
            try:
                st = os.lstat(full)
            except OSError:
                return True  # deleted
            if st.st_size == size and st.st_mtime_ns == mtime_ns and mtime_ns < index_mtime:
                continue
            if mode >> 12 == 0o12:  # a symlink's blob is its target
                content = os.readlink(full).encode("utf-8", "surrogateescape")
            else:
                budget -= st.st_size
                if budget < 0:
                    return None
                content = full.read_bytes()
            if _blob_hash(content, algo) != sha and (b"\r\n" not in content
                                                     or _blob_hash(content.replace(b"\r\n", b"\n"), algo) != sha):
                return True
    except (struct.error, ValueError, OSError):
        return None
    return False


def version_string(package: str, commit: Optional[str] = None, dirty: Optional[bool] = None) -> str:
    """``petals-chain/<package>[+g<commit[:7]>[.dirty]]`` within :data:`VERSION_MAX` characters (a long package
    version is cut, the commit kept). A package version with a local part already joins the commit with a dot."""
    local = ""
    if commit:
        local = f"g{commit[:7]}" + (".dirty" if dirty else "")
        local = ("." if "+" in package else "+") + local
    package = package[:max(1, VERSION_MAX - len(NAME) - 1 - len(local))]
    return f"{NAME}/{package}{local}"


@functools.cache
def build_version() -> str:
    """This process's version string (computed once): the package version, plus the commit of the checkout the
    code runs from, if any."""
    root = source_root()
    commit = git_commit(root)
    return version_string(package_version(), commit, worktree_dirty(root) if commit else None)


__all__ = ["build_version", "version_string", "git_commit", "worktree_dirty", "package_version", "source_root",
           "VERSION_MAX", "NAME"]
