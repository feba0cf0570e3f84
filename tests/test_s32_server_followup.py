"""Follow-ups in the server: the CLI names the flag it refuses; a default memory budget too small for one block is
an error at start, as an explicit one is."""

import asyncio
import logging

from petals_chain.server.__main__ import main
from petals_chain.server.server import Server, ServerConfig


def test_a_memory_gb_under_one_byte_names_memory_gb(capsys):
    assert main(["--model", "/nonexistent", "--memory-gb", "1e-10"]) == 2
    err = capsys.readouterr().err
    assert "--memory-gb" in err and "--memory-bytes" not in err


def test_a_default_budget_that_holds_no_block_is_an_error_at_start(tiny_model_dir, monkeypatch, caplog):
    """No --memory-gb and a default budget (a share of the free memory, measured once the DHT runs) holding not even
    one block and one KV slot: the server joined and only warned, minutes later, that it got no blocks."""
    monkeypatch.setattr("petals_chain.server.memory.default_memory_bytes", lambda device: 1000)
    server = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.01, allow_any_client=True))
    with caplog.at_level(logging.ERROR, logger="petals_chain.server.server"):
        assert asyncio.run(asyncio.wait_for(server.run(), 60)) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "the default memory budget" in errors[0] and "--memory-gb" in errors[0], errors
    assert server.announcer is None  # refused before it announced itself


def test_a_default_budget_keeps_the_models_it_holds(tiny_model_dir):
    server = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.01, allow_any_client=True))
    server.active.memory.measure(1 << 30, "cpu")
    assert server._default_budget_holds() and server.hosted == [server.active]
    server.active.memory.measure(1000, "cpu")
    assert not server._default_budget_holds()


def test_identity_keys_are_never_readable_by_others_and_stale_temporary_ones_go(tmp_path, monkeypatch):
    """hivemind wrote a new key with the umask's permissions, then chmodded it 0400: under ``umask 0`` anyone could
    read it meanwhile; the temporary key was written by name in /tmp after its mkstemp file was deleted; and the
    temporary keys of a process killed by SIGKILL stayed there for good."""
    import os
    import stat
    import tempfile

    from petals_chain.swarm.dht import SwarmDHT, load_identity

    import multiprocessing.util

    multiprocessing.util.get_temp_dir()  # made (once per process) where it would be, not in the tmp below
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        dead = int(open("/proc/sys/kernel/pid_max").read()) + 1  # no process has it
    except OSError:
        dead = 1 << 23
    target = tmp_path / "not-ours"
    target.write_bytes(b"x")
    stale = tmp / f"petals-chain-identity-{dead}-abc"
    kept = [tmp / f"petals-chain-identity-{os.getpid()}-abc", tmp / f"petals-chain-identity-{os.getppid()}-abc",
            tmp / "petals-chain-identity-abc12345", tmp / f"petals-chain-identity-{dead}-dir", tmp / "other"]
    for path in [stale, *kept]:
        path.mkdir() if path.name.endswith("dir") else path.write_bytes(b"key")
    link = tmp / f"petals-chain-identity-{dead}-link"
    link.symlink_to(target)
    kept.append(link)

    seen: list[tuple[str, int]] = []  # (identity file, its permissions when it was made read-only)
    chmod, fchmod = os.chmod, os.fchmod

    def spy_chmod(path, mode, *args, **kwargs):
        if "identity" in str(path) or str(path) == str(tmp_path / "key"):
            seen.append((str(path), stat.S_IMODE(os.stat(path).st_mode)))
        return chmod(path, mode, *args, **kwargs)

    def spy_fchmod(fd, mode):
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), stat.S_IMODE(os.fstat(fd).st_mode)))
        return fchmod(fd, mode)

    monkeypatch.setattr(os, "chmod", spy_chmod)
    monkeypatch.setattr(os, "fchmod", spy_fchmod)
    umask = os.umask(0)
    try:
        ids = []
        for identity_path in (str(tmp_path / "key"), str(tmp_path / "key"), None):
            node = SwarmDHT.create(identity_path=identity_path)
            try:
                ids.append(node.peer_id)
            finally:
                node.shutdown()
    finally:
        os.umask(umask)
    assert ids[0] == ids[1] != ids[2]  # the same key, read again; a temporary one is new
    assert load_identity(str(tmp_path / "key")).get_public_key() is not None
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o400
    assert len(seen) == 2 and all(mode & 0o077 == 0 for _path, mode in seen), seen
    assert not stale.exists() and all(p.exists() or p.is_symlink() for p in kept) and target.exists()
    assert sorted(tmp.iterdir()) == sorted(kept)  # nor is the temporary key of this start left


def test_the_announced_tau_p_includes_the_emulated_delays_of_the_reference_job(tiny_model_dir, monkeypatch):
    """With --emulate-decode-ms 50 a server announced the tau_p measured on the real CPU (0.05 s), while one
    reference job through one of its blocks took >= 0.75 s: the planner saw it 15 times faster than it was."""
    import pytest

    monkeypatch.setattr("petals_chain.server.profiling.measure_tau_p", lambda *args, **kwargs: 0.01)
    emulated = dict(emulate_step_ms=10.0, emulate_prefill_ms_per_token=1.0, emulate_decode_ms=50.0,
                    emulate_compute_scale=2.0, profile_l_in=8, profile_l_out=4, allow_any_client=True)
    server = Server(ServerConfig(model=str(tiny_model_dir), **emulated))
    # the real compute scaled, plus a prefill of 8 tokens (10 + 8 x 1 ms) and 3 one-token steps (3 x 50 ms)
    assert server.emulation.announced_tau_p(server.measure_tau_p()) == pytest.approx(0.01 * 2 + 0.168)
    given = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.5, **emulated))  # a given --tau-p is taken as is
    assert given.emulation.announced_tau_p(given.measure_tau_p()) == pytest.approx(1.0)
