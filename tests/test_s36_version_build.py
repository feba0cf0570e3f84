"""The build a peer runs (swarm/version.py): package version + the git commit checked out, read from ``.git``
without running git (loose, packed and symbolic refs, detached HEAD, worktrees), ``.dirty`` from the index; what
records carry within their length limit, what ``--version`` prints and the DHT's "written by" line."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from petals_chain.swarm import version
from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.records import RECORD_VERSION, ServerRecord, _ServerValueV1
from petals_chain.swarm.version import build_version, git_commit, version_string, worktree_dirty

SHA = "1a2b3c4d" + "e" * 32
OTHER = "9f8e7d6c" + "0" * 32


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_commit_is_read_from_a_loose_a_packed_a_detached_and_a_worktree_head(tmp_path):
    loose = tmp_path / "loose"
    _write(loose / ".git/HEAD", "ref: refs/heads/main\n")
    _write(loose / ".git/refs/heads/main", SHA + "\n")
    _write(loose / ".git/packed-refs", f"{OTHER} refs/heads/main\n")  # the loose ref is newer: it wins
    assert git_commit(loose) == SHA

    packed = tmp_path / "packed"
    _write(packed / ".git/HEAD", "ref: refs/heads/main\n")
    _write(packed / ".git/packed-refs", f"# pack-refs with: peeled fully-peeled sorted\n{OTHER} refs/heads/dev\n"
                                        f"{SHA} refs/heads/main\n^{OTHER}\n")
    assert git_commit(packed) == SHA

    detached = tmp_path / "detached"
    _write(detached / ".git/HEAD", SHA + "\n")
    assert git_commit(detached) == SHA

    # `git worktree add`: a .git file pointing at the worktree's gitdir, refs shared through commondir
    _write(tmp_path / "main/.git/worktrees/wt/HEAD", "ref: refs/heads/feature\n")
    _write(tmp_path / "main/.git/worktrees/wt/commondir", "../..\n")
    _write(tmp_path / "main/.git/refs/heads/feature", SHA)
    _write(tmp_path / "wt/.git", "gitdir: ../main/.git/worktrees/wt\n")
    assert git_commit(tmp_path / "wt") == SHA


def test_no_checkout_an_unborn_branch_or_a_bad_head_give_the_package_version_only(tmp_path, monkeypatch):
    assert git_commit(tmp_path) is None and worktree_dirty(tmp_path) is None  # a wheel/sdist install
    _write(tmp_path / "unborn/.git/HEAD", "ref: refs/heads/main\n")
    assert git_commit(tmp_path / "unborn") is None
    _write(tmp_path / "escape/.git/HEAD", "ref: ../../../etc/hostname\n")
    _write(tmp_path / "garbage/.git/HEAD", "not a hash\n")
    _write(tmp_path / "loop/.git/HEAD", "ref: refs/heads/a\n")
    _write(tmp_path / "loop/.git/refs/heads/a", "ref: refs/heads/a\n")
    for name in ("escape", "garbage", "loop"):
        assert git_commit(tmp_path / name) is None, name
    pkg = importlib.metadata.version("petals_chain")
    monkeypatch.setattr(version, "source_root", lambda: tmp_path / "unborn")
    assert build_version.__wrapped__() == f"petals-chain/{pkg}"
    _write(tmp_path / "unborn/.git/refs/heads/main", SHA)  # no index: clean or not is unknown, so not said
    assert build_version.__wrapped__() == f"petals-chain/{pkg}+g1a2b3c4"


def test_the_version_string_fits_the_records_field():
    assert version_string("0.1.0") == "petals-chain/0.1.0"
    assert version_string("0.1.0", SHA, False) == "petals-chain/0.1.0+g1a2b3c4"
    assert version_string("0.1.0", SHA, True) == "petals-chain/0.1.0+g1a2b3c4.dirty"
    assert version_string("0.2.0+local", SHA, True) == "petals-chain/0.2.0+local.g1a2b3c4.dirty"  # one '+' only
    long = version_string("1.2.3.dev456789+" + "x" * 80, SHA, True)
    assert len(long) == version.VERSION_MAX and long.endswith(".g1a2b3c4.dirty")  # cut, the commit kept
    for v in (long, build_version()):
        value = ServerRecord(peer_id="QmX", state="online", memory_bytes=1, tau_p=0.01, version=v).to_value()
        assert ServerRecord.from_value(value).version == v
        _ServerValueV1.parse_obj(value)  # the DHT validator's schema stores it
    assert RECORD_VERSION == build_version() == ServerRecord(peer_id="QmX", state="online", memory_bytes=1,
                                                             tau_p=0.01).version


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to build an index")
def test_dirty_means_a_tracked_file_differs_from_the_index(tmp_path):
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, env=env,
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/b.txt").write_text("b\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    assert worktree_dirty(tmp_path) is False
    (tmp_path / "untracked.log").write_text("ignored\n")  # as `git describe --dirty`: untracked files do not count
    os.utime(tmp_path / "a.py", (1, 1))  # touched, same bytes: still clean
    assert worktree_dirty(tmp_path) is False
    (tmp_path / "a.py").write_text("x = 2\n")  # same size, new content
    assert worktree_dirty(tmp_path) is True
    (tmp_path / "a.py").write_text("x = 1\n")
    assert worktree_dirty(tmp_path) is False
    (tmp_path / "sub/b.txt").unlink()
    assert worktree_dirty(tmp_path) is True


def test_version_flags_print_the_build(capsys):
    from petals_chain.dashboard.__main__ import build_parser as dashboard_parser
    from petals_chain.orchestrator.__main__ import build_parser as orchestrator_parser
    from petals_chain.server.__main__ import build_parser as server_parser

    for parser in (server_parser, orchestrator_parser, dashboard_parser):
        with pytest.raises(SystemExit) as done:
            parser().parse_args(["--version"])  # before the required --model / --initial-peers
        assert done.value.code == 0
        assert capsys.readouterr().out.strip() == build_version()


def test_a_record_this_peer_cannot_read_is_logged_with_both_builds(caplog):
    value = ServerRecord(peer_id="QmOld", state="online", memory_bytes=1, tau_p=0.01,
                         version="petals-chain/0.0.9+g0badc0d").to_value()
    value["memory_bytes"] = "lots"  # what this version cannot read
    reader = SimpleNamespace(_reported_invalid=set())
    with caplog.at_level(logging.WARNING, logger="petals_chain.swarm.dht"):
        assert SwarmDHT._read(reader, ServerRecord, value, "QmOld", "server record") is None
    line = caplog.records[-1].getMessage()
    assert f"written by 'petals-chain/0.0.9+g0badc0d', this peer runs {build_version()}" in line, line
