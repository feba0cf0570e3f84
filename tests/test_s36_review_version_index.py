"""Review of 9653bda (a peer's build in its version): the hand-written git index reader must not lie or stall
(split index, index v4, a FIFO or a type change at a tracked path), a copy of the package inside another project's
repository must not announce that project's commit, and ``--version`` answers before the roles' heavy imports."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from petals_chain.swarm import version

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git to build an index")


def _repo(path: Path, files: dict[str, str]):
    """A committed git repository at ``path`` holding ``files``; returns a ``git(*args)`` runner for it."""
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(name, None)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=path, env=env,
                              check=True, capture_output=True, text=True).stdout

    path.mkdir(parents=True, exist_ok=True)
    git("init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
        os.utime(path / name, (1_600_000_000, 1_600_000_000))  # not racily clean: git keeps no entry to re-check
    git("add", ".")
    git("commit", "-q", "-m", "one")
    return git


@needs_git
def test_a_split_index_is_not_called_clean_and_index_v4_is_read(tmp_path):
    git = _repo(tmp_path, {"a.py": "x = 1\n", "sub/b.py": "y = 1\n", "sub/c.py": "z = 1\n"})
    git("update-index", "--split-index")  # core.splitIndex: the entries move to .git/sharedindex.<hash>
    assert b"link" in (tmp_path / ".git/index").read_bytes()  # the split index's extension
    (tmp_path / "a.py").write_text("x = 2\n")
    assert version.worktree_dirty(tmp_path) is not False  # was False: a modified checkout announced as clean
    assert git("status", "--porcelain").strip() == "M a.py"
    git("checkout", "-q", "a.py")
    git("update-index", "--no-split-index")
    git("update-index", "--index-version", "4")  # paths prefix-compressed (feature.manyFiles sets it)
    assert version.worktree_dirty(tmp_path) is False  # was None: .dirty never said
    (tmp_path / "sub/c.py").write_text("z = 2\n")
    assert version.worktree_dirty(tmp_path) is True


@needs_git
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_or_a_type_change_at_a_tracked_path_is_dirty_without_blocking(tmp_path):
    git = _repo(tmp_path, {"a.py": "x = 1\n", "b.py": "y = 1\n"})
    (tmp_path / "b.py").unlink()
    os.mkfifo(tmp_path / "b.py")  # read by the old code: open() blocked until a writer came, so did startup
    out: list = []
    reader = threading.Thread(target=lambda: out.append(version.worktree_dirty(tmp_path)), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # release the blocked reader: a writer opens and closes the FIFO
        os.close(os.open(tmp_path / "b.py", os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("worktree_dirty blocked reading a FIFO at a tracked path")
    assert out == [True]
    (tmp_path / "b.py").unlink()
    git("checkout", "-q", "b.py")
    os.symlink("a.py", tmp_path / "link")
    git("add", "link")
    git("commit", "-q", "-m", "a link")
    assert version.worktree_dirty(tmp_path) is False
    (tmp_path / "link").unlink()
    (tmp_path / "link").write_text("x = 1\n")  # a tracked symlink replaced by a file
    assert version.worktree_dirty(tmp_path) is True  # was None (readlink of a file)


@needs_git
def test_a_copy_inside_another_projects_repository_does_not_announce_its_commit(tmp_path):
    # `pip install --target proj` (or a vendored copy not committed): the package sits at proj/petals_chain
    proj = tmp_path / "proj"
    git = _repo(proj, {"app.py": "print('their app')\n"})
    theirs = git("rev-parse", "HEAD").strip()
    copy = proj / "petals_chain/swarm/version.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(version.__file__, copy)
    spec = importlib.util.spec_from_file_location("_petals_chain_version_copy", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.source_root() == proj and module.git_commit(proj) == theirs
    built = module.build_version.__wrapped__()
    assert f"+g{theirs[:7]}" not in built, built  # was petals-chain/<pkg>+g<their commit>
    assert built == f"petals-chain/{module.package_version()}"
    git("add", "petals_chain")  # committed into their tree: then their commit is this code's build
    git("commit", "-q", "-m", "vendor petals-chain")
    assert module.build_version.__wrapped__().endswith(f"+g{git('rev-parse', 'HEAD').strip()[:7]}")


@pytest.mark.parametrize("role", ["orchestrator", "server", "dashboard"])
def test_version_is_answered_before_the_parsers_heavy_imports(role, monkeypatch, capsys):
    main_module = importlib.import_module(f"petals_chain.{role}.__main__")

    def heavy():  # the orchestrator's imports torch and the planner first: 11 s on this host to print a line
        raise AssertionError("build_parser called for --version")

    monkeypatch.setattr(main_module, "build_parser", heavy)
    run = getattr(main_module, "_main", None) or main_module.main
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == version.build_version()
    monkeypatch.setattr(sys, "argv", ["prog", "--log-level", "DEBUG", "--version"])
    assert version.version_asked(None) and not version.version_asked(["--model", "m", "--", "--version"])
