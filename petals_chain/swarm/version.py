"""Which build of petals-chain this process runs: ``petals-chain/<package version>[+g<commit>[.dirty]]``.

Peers announce it in their records (``ServerRecord.version``), so an operator can tell which volunteers run old
code. The package version comes from the installed metadata; when the package runs from a git checkout (an
editable install, how volunteers run it), the commit checked out is appended, read from ``.git`` without running
git (HEAD, its ref, packed-refs; worktrees and ``.git`` files included), and ``.dirty`` when a tracked file differs
from the index (a stat per file, a hash only of those whose stat changed). Changes staged but not committed are not
seen (that needs the object store). A wheel or sdist install has no checkout beside it: the package version only;
nor does a copy inside another project's repository (``pip install --target``): its index does not track this file.
Computed once per process (:func:`build_version`); never raises.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import stat
import struct
import sys
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

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


def is_own_checkout(root: Path) -> bool:
    """Whether the checkout at ``root`` tracks this very file: False for another project's repository the package
    was merely copied into (``pip install --target``, a vendored copy not committed), whose commit is not the build
    of this code. Taken as True when its index cannot be read (no index yet, a split index)."""
    entries = _load_index(root)
    if entries is None:
        return True
    try:
        own = Path(__file__).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return False  # this file is not in that checkout at all
    return any(entry.path == own for entry in entries)


def version_asked(argv: Optional[Sequence[str]]) -> bool:
    """Whether a command line asks for ``--version`` (before a ``--``): a role answers it before importing its
    heavy modules (torch, the planner: seconds), as its full parser would."""
    args = list(sys.argv[1:] if argv is None else argv)
    return "--version" in args[:args.index("--")] if "--" in args else "--version" in args


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


class _Entry(NamedTuple):
    path: str
    mode: int
    size: int
    mtime_ns: int
    sha: bytes
    flags: int
    extended: int


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """Git's offset varint (index v4's prefix length): ``(value, position after it)``."""
    c = data[pos]
    pos += 1
    value = c & 0x7F
    while c & 0x80:
        c = data[pos]
        pos += 1
        value = ((value + 1) << 7) | (c & 0x7F)
    return value, pos


def _index_entries(data: bytes, sha_len: int) -> Optional[list[_Entry]]:
    """The entries of a git index (versions 2, 3 and 4), or None for one this cannot read whole: a split index
    (its entries live partly in a shared index file), too many entries, a path leaving the checkout, or corrupt.
    Raises ``struct.error``/``ValueError``/``IndexError`` on a truncated one."""
    if len(data) < 12 or data[:4] != b"DIRC":
        return None
    version, count = struct.unpack(">II", data[4:12])
    if version not in (2, 3, 4) or count > _MAX_INDEX_ENTRIES:
        return None
    entries: list[_Entry] = []
    pos, previous = 12, b""
    for _ in range(count):
        fields = struct.unpack(">10I", data[pos:pos + 40])
        sha = data[pos + 40:pos + 40 + sha_len]
        (flags,) = struct.unpack(">H", data[pos + 40 + sha_len:pos + 42 + sha_len])
        head = pos + 42 + sha_len
        extended = 0
        if version >= 3 and flags & 0x4000:
            (extended,) = struct.unpack(">H", data[head:head + 2])
            head += 2
        if version == 4:  # the path is the previous one less N trailing bytes, plus this suffix; no padding
            strip, head = _varint(data, head)
            if strip > len(previous):
                return None
            end = data.index(b"\0", head)
            raw = previous[:len(previous) - strip] + data[head:end]
            pos = end + 1
        else:
            end = data.index(b"\0", head)
            raw = data[head:end]
            pos += (end - pos + 8) & ~7  # the NUL-padded entry, a multiple of 8 bytes
        previous = raw
        path = raw.decode("utf-8", "surrogateescape")
        if not path or path.startswith("/") or ".." in path.split("/"):
            return None  # git never writes one (a split index's replaced entry has no name)
        entries.append(_Entry(path, fields[6], fields[9], fields[2] * 10**9 + fields[3], sha, flags, extended))
    while pos + 8 <= len(data) - sha_len:  # the extensions, before the trailing checksum
        signature = data[pos:pos + 4]
        (size,) = struct.unpack(">I", data[pos + 4:pos + 8])
        if signature == b"link":  # core.splitIndex: most entries are in sharedindex.<hash>
            return None
        pos += 8 + size
    return entries


def _differs(root: Path, entry: _Entry, index_mtime_ns: int, algo: str, budget: list[int]) -> Optional[bool]:
    """Whether the file of one index entry differs from it (None: too much left to hash)."""
    full = Path(root) / entry.path
    try:
        st = os.lstat(full)
    except OSError:
        return True  # deleted
    link = entry.mode >> 12 == 0o12
    if stat.S_ISLNK(st.st_mode) != link or not (link or stat.S_ISREG(st.st_mode)):
        return True  # its type changed (a FIFO or a directory is never read: it would block or fail)
    if st.st_size == entry.size and st.st_mtime_ns == entry.mtime_ns and entry.mtime_ns < index_mtime_ns:
        return False  # as git status: same stat, written before the index was (not racy)
    if link:  # a symlink's blob is its target
        content = os.readlink(full).encode("utf-8", "surrogateescape")
    else:
        budget[0] -= st.st_size
        if budget[0] < 0:
            return None
        fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:  # no symlink swapped in since the lstat, and no more than it said
            content = f.read(st.st_size + 1)
        if len(content) > st.st_size:
            return True  # growing as we read it
    if _blob_hash(content, algo) == entry.sha:
        return False
    return b"\r\n" not in content or _blob_hash(content.replace(b"\r\n", b"\n"), algo) != entry.sha


def _index_path_and_algo(root: Path) -> Optional[tuple[Path, int, str]]:
    dirs = git_dirs(root)
    if dirs is None:
        return None
    config = _read(dirs[1] / "config") or ""
    sha256 = re.search(r"objectformat\s*=\s*sha256", config, re.I)
    return (dirs[0] / "index", 32, "sha256") if sha256 else (dirs[0] / "index", 20, "sha1")


def _load_index(root: Path) -> Optional[list[_Entry]]:
    """The entries of the git index of the checkout at ``root``, or None (no checkout or index, or unreadable)."""
    where = _index_path_and_algo(root)
    if where is None:
        return None
    try:
        return _index_entries(where[0].read_bytes(), where[1])
    except (struct.error, ValueError, IndexError, OSError):
        return None


def worktree_dirty(root: Path) -> Optional[bool]:
    """Whether a tracked file at ``root`` differs from git's index (modified, deleted, its type changed, or in a
    merge conflict); None when it cannot tell cheaply (no checkout, a split index, an unreadable or corrupt index,
    too much to hash). A file whose size and mtime match its index entry is taken as unchanged, as ``git status``
    does, unless it changed in the index's second (racy); others are hashed, CRLF line ends also read as LF
    (autocrlf). Only regular files and symlinks are read (a FIFO at a tracked path would block startup)."""
    where = _index_path_and_algo(root)
    if where is None:
        return None
    index, sha_len, algo = where
    budget = [_MAX_HASHED_BYTES]
    try:
        index_mtime = index.stat().st_mtime_ns
        entries = _index_entries(index.read_bytes(), sha_len)
        if entries is None:
            return None
        for entry in entries:
            if entry.flags & 0x3000:
                return True  # a merge conflict's stage
            if entry.flags & 0x8000 or entry.extended & 0x4000 or entry.mode >> 12 in (0o16, 0o4):
                continue  # assume-unchanged, skip-worktree (sparse checkout), a submodule, a sparse index's dir
            differs = _differs(root, entry, index_mtime, algo, budget)
            if differs is not False:
                return differs
    except (struct.error, ValueError, IndexError, OSError):
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
    commit = git_commit(root) if is_own_checkout(root) else None
    return version_string(package_version(), commit, worktree_dirty(root) if commit else None)


__all__ = ["build_version", "version_string", "git_commit", "worktree_dirty", "package_version", "source_root",
           "is_own_checkout", "version_asked", "VERSION_MAX", "NAME"]
