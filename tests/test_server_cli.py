"""Command-line validation and memory defaults of the server (no processes, no DHT)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from petals_chain.server.__main__ import build_parser, main
from petals_chain.server.server import (CPU_MEMORY_FRACTION, DEFAULT_MAX_LENGTH, Server, ServerConfig,
                                        default_memory_bytes)
from petals_chain.swarm.local import memory_for, model_memory

ED25519_PEER_ID = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # an identity multihash (key inline)


@pytest.fixture(autouse=True)
def started(monkeypatch) -> list:
    """No test here starts a swarm: a server past every check is recorded and ``main`` returns 0."""
    servers: list = []

    async def run(self) -> int:
        servers.append(self)
        return 0

    monkeypatch.setattr(Server, "run", run)
    return servers


def rsa_peer_id(tmp_path: Path) -> tuple[str, Path]:
    """A real peer id (sha2-256 of an RSA key, as every petals-chain peer has) and its identity file."""
    from hivemind.p2p import P2P, PeerID

    path = tmp_path / "key.id"
    P2P.generate_identity(str(path))
    return PeerID.from_identity(path.read_bytes()).to_base58(), path


@pytest.mark.parametrize("argv, message", [
    (["--memory-gb", "-1"], "--memory-gb must be a positive number"),
    (["--memory-gb", "inf"], "--memory-gb must be a positive number"),
    (["--tau-p", "-1"], "--tau-p must be a finite number > 0"),
    (["--tau-p", "nan"], "--tau-p must be a finite number > 0"),
    (["--idle-timeout-s", "0"], "--idle-timeout-s must be a finite number > 0"),
    (["--refresh-s", "0"], "--refresh-s must be a finite number > 0"),
    (["--assignment-poll-s", "-1"], "--assignment-poll-s must be a finite number > 0"),
    (["--drain-timeout-s", "nan"], "--drain-timeout-s must be a finite number >= 0"),
    (["--max-wait-s", "inf"], "--max-wait-s must be a finite number > 0"),
    (["--profile-l-in", "0"], "--profile-l-in must be an integer >= 1"),
    (["--page-size", "0"], "--page-size must be an integer >= 1"),
    (["--max-length", "10000000"], "exceeds max_position_embeddings"),
    (["--memory-bytes", "0"], "--memory-bytes must be positive"),
    (["--emulate-compute-scale", "0.5"], "--emulate-compute-scale must be finite and >= 1, got 0.5"),
    (["--emulate-compute-scale", "nan"], "--emulate-compute-scale must be finite and >= 1, got nan"),
    (["--emulate-rtt-ms", "-3"], "--emulate-rtt-ms must be finite and >= 0, got -3.0"),
    (["--emulate-rtt-ms", "inf"], "--emulate-rtt-ms must be finite and >= 0, got inf"),
    (["--emulate-step-ms", "-1"], "--emulate-step-ms must be finite and >= 0"),
    (["--emulate-prefill-ms-per-token", "inf"], "--emulate-prefill-ms-per-token must be finite and >= 0"),
    (["--emulate-decode-ms", "nan"], "--emulate-decode-ms must be finite and >= 0, got nan"),
    (["--emulate-reply-fault", "nan", "--emulate-reply-fault-rate", "1.5"], "--emulate-reply-fault-rate must be in"),
    (["--emulate-reply-fault-rate", "nan"], "--emulate-reply-fault-rate must be in [0, 1], got nan"),
    (["--emulate-faulty-rate", "2"], "--emulate-faulty-rate must be in [0, 1], got 2.0"),  # named the other flag
    (["--emulate-faulty-rate", "nan"], "--emulate-faulty-rate must be in [0, 1], got nan"),
    (["--emulate-tau-p-lie", "0"], "--emulate-tau-p-lie must be finite and > 0, got 0.0"),
    (["--emulate-tau-p-lie", "inf"], "--emulate-tau-p-lie must be finite and > 0, got inf"),
    (["--max-waiters", "-1"], "--max-waiters must be an integer >= 0, got -1"),  # named no flag
    (["--cache-tokens-per-block", "-1"], "--cache-tokens-per-block must be an integer >= 0, got -1"),
    (["--max-blocks", "-1"], "--max-blocks must be an integer >= 0, got -1"),
    (["--max-wait-s", "-1"], "--max-wait-s must be a finite number > 0"),
    (["--page-size", "-16"], "--page-size must be an integer >= 1"),
    (["--refresh-s", "inf"], "--refresh-s must be a finite number > 0"),
    (["--assignment-poll-s", "nan"], "--assignment-poll-s must be a finite number > 0"),
    (["--idle-timeout-s=-inf"], "--idle-timeout-s must be a finite number > 0"),
    (["--drain-timeout-s", "-1"], "--drain-timeout-s must be a finite number >= 0"),
    (["--max-length", "0"], "--max-length must be an integer >= 1, got 0"),
    (["--dht-prefix", "bad prefix!"], "invalid DHT prefix"),
    (["--public-name", "volunteer\nINFO forged line"], "--public-name must be at most 128 printable characters"),
    (["--public-name", "x" * 129], "--public-name must be at most 128 printable characters"),  # was cut silently
    (["--memory-gb", "100000"], "of RAM available"),  # allocated whole at start: it took the host's RAM
    pytest.param(["--device", "cuda"], "no CUDA device is available",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_flags_exit_2_with_a_message(argv, message, tiny_model_dir, capsys):
    assert main(["--model", str(tiny_model_dir), *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_model_is_an_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_named_model_as_the_orchestrator_takes_it_names_its_source(tmp_path, capsys):
    """``--model NAME=SOURCE`` (the orchestrator's form) is the SOURCE: it was read whole ('alpha=...' not found)."""
    assert main(["--model", f"alpha={tmp_path / 'nope'}", "--initial-peers"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "alpha=" not in err and str(tmp_path / "nope") in err


def test_parser_rejects_both_memory_flags_and_bad_choices():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--memory-gb", "1", "--memory-bytes", "5"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--quant", "int4"])
    with pytest.raises(SystemExit) as e:  # was a ValueError traceback from logging
        main(["--model", "m", "--log-level", "bogus"])
    assert e.value.code == 2


def test_defaults_trust_and_memory(tiny_model_dir):
    import psutil

    orch = "/ip4/10.0.0.1/tcp/31337/p2p/QmOrchestratorPeerIdXXXXXXXXXXXXXXXXXXXXXXXXXX"
    server = Server(ServerConfig(model=str(tiny_model_dir), initial_peers=[orch]))
    assert server.trusted == {"QmOrchestratorPeerIdXXXXXXXXXXXXXXXXXXXXXXXXXX"}
    assert server.authorize("QmOrchestratorPeerIdXXXXXXXXXXXXXXXXXXXXXXXXXX") and not server.authorize("QmOther")
    assert Server(ServerConfig(model=str(tiny_model_dir), allow_any_client=True)).authorize("QmOther")
    explicit = Server(ServerConfig(model=str(tiny_model_dir), initial_peers=[orch],
                                   trust_orchestrator=[ED25519_PEER_ID]))
    assert explicit.trusted == {ED25519_PEER_ID}
    available = psutil.virtual_memory().available
    assert abs(default_memory_bytes("cpu") - CPU_MEMORY_FRACTION * available) < 0.1 * available
    # Eq. 3 with the model's own s_m and s_c.
    server.memory.memory_bytes, server.memory.s_m = 10_000_000, 164_352
    s_c = server.memory.s_c(64)
    assert server.memory.slots_for(2, 64) == (10_000_000 - 2 * 164_352) // s_c
    # paged (default): one slot's pages open a session over 2 blocks; slots mode takes a slot in each block, so 2
    # blocks with one slot would open none
    server.memory.cache_tokens_per_block = 32
    assert server.memory.slots_for(2, 64) == 1 and server.memory.holds(2, 64)
    server.memory.kv_cache = "slots"
    assert not server.memory.holds(2, 64)
    server.memory.cache_tokens_per_block = 64
    assert server.memory.slots_for(2, 64) == 2 and server.memory.holds(2, 64)


def test_valid_edge_values_still_start(tiny_model_dir, started):
    argv = ["--max-waiters", "0", "--cache-tokens-per-block", "4096", "--max-blocks", "0", "--drain-timeout-s", "0",
            "--emulate-faulty-rate", "1", "--emulate-rtt-ms", "0", "--emulate-compute-scale", "1", "--max-length", "64"]
    assert main(["--model", str(tiny_model_dir), *argv]) == 0 and len(started) == 1
    assert main(["--model", str(tiny_model_dir), "--emulate-reply-fault", "shape", "--emulate-reply-fault-rate", "0",
                 "--emulate-faulty-rate", "0"]) == 0


# --memory-bytes / --memory-gb: one block and one KV slot of some model offered, or exit 2 at start (it was accepted
# and every assignment then failed to load)

def test_a_budget_below_one_block_and_a_slot_exits_2_naming_the_flag_model_and_least(tiny_model_dir, capsys):
    _, s_m, s_c = model_memory(tiny_model_dir, DEFAULT_MAX_LENGTH)
    assert main(["--model", str(tiny_model_dir), "--memory-bytes", str(s_m)]) == 2
    err = capsys.readouterr().err
    # the least that would do at the server's default max length, as the slots are sized before an assignment
    assert f"--memory-bytes {s_m} cannot hold one block" in err and str(tiny_model_dir) in err
    assert f"{s_m + s_c} bytes" in err and f"of {DEFAULT_MAX_LENGTH} tokens" in err


def test_with_max_length_the_budget_must_hold_a_slot_that_long(tiny_model_dir, capsys, started):
    _, s_m, s_c = model_memory(tiny_model_dir, 64)
    gb = (s_m + s_c - 1) / 2**30
    assert main(["--model", str(tiny_model_dir), "--memory-gb", repr(gb), "--max-length", "64"]) == 2
    err = capsys.readouterr().err
    assert "--memory-gb" in err and "--max-length 64" in err and f"{s_m + s_c} bytes" in err
    assert str(tiny_model_dir) in err and "--memory-gb 0.000" in err  # the least, in the flag given
    assert main(["--model", str(tiny_model_dir), "--memory-bytes", str(s_m + s_c), "--max-length", "64"]) == 0
    assert started[0].hosted[0].spec == str(tiny_model_dir)


def test_without_max_length_a_budget_for_a_short_swarm_starts_and_says_its_longest_slot(tiny_model_dir, caplog,
                                                                                        started):
    """The swarm's max length is learnt from its first assignment: a budget sized for 64 tokens (as the swarm tests
    give) is not refused for the default 2048, but the volunteer is told the longest slot it holds."""
    budget = memory_for(tiny_model_dir, 64, 2, 4)
    _, s_m, s_c = model_memory(tiny_model_dir, DEFAULT_MAX_LENGTH)
    longest = (budget - s_m) // (s_c // DEFAULT_MAX_LENGTH) // 16 * 16  # whole pages of --page-size 16
    with caplog.at_level(logging.WARNING, logger="petals_chain.server"):
        assert main(["--model", str(tiny_model_dir), "--memory-bytes", str(budget)]) == 0
    assert len(started) == 1
    assert f"--memory-bytes {budget} holds one block of {tiny_model_dir} with a KV slot of at most {longest} " \
           "tokens" in caplog.text


def test_several_models_the_budget_holds_some_of_are_offered_without_the_others(tiny_model_factory, tiny_model_dir,
                                                                              caplog, capsys, started):
    """A volunteer offering several models expects the server to serve those its budget holds: one it cannot is said
    and dropped (kept first, it was served first and never given blocks); none held: exit 2 naming each."""
    big = tiny_model_factory("llama", num_layers=2, hidden_size=256)
    _, s_m, s_c = model_memory(tiny_model_dir, DEFAULT_MAX_LENGTH)
    _, big_s_m, _ = model_memory(big, DEFAULT_MAX_LENGTH)
    assert big_s_m > s_m + s_c
    with caplog.at_level(logging.WARNING, logger="petals_chain.server"):
        assert main(["--model", str(big), "--model", str(tiny_model_dir), "--memory-bytes", str(s_m + s_c)]) == 0
    server = started[0]
    assert [h.spec for h in server.hosted] == [str(tiny_model_dir)] and server.active.spec == str(tiny_model_dir)
    assert f"not offering model {big}: --memory-bytes {s_m + s_c} cannot hold one of its blocks" in caplog.text
    assert main(["--model", str(big), "--model", str(tiny_model_dir), "--memory-bytes", str(s_m)]) == 2
    err = capsys.readouterr().err
    assert "of any model offered" in err and f"{big}: " in err and f"{tiny_model_dir}: {s_m + s_c} bytes" in err


# --trust-orchestrator: libp2p peer ids, checked at start (hivemind's PeerID.from_base58 takes 'notapeerid')

@pytest.mark.parametrize("value, hint", [
    ("notapeerid", "the base58 id"),
    ("QmA", "the base58 id"),
    ("/ip4/1.2.3.4/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "only the part after /p2p/"),
])
def test_a_bad_trusted_peer_id_exits_2_naming_flag_and_value(value, hint, tiny_model_dir, capsys, started):
    assert main(["--model", str(tiny_model_dir), "--trust-orchestrator", ED25519_PEER_ID, value]) == 2
    err = capsys.readouterr().err
    assert f"--trust-orchestrator {value!r} is not a libp2p peer id" in err and hint in err and not started
    with pytest.raises(ValueError, match="--trust-orchestrator"):
        Server(ServerConfig(model=str(tiny_model_dir), trust_orchestrator=[value]))


def test_real_peer_ids_are_trusted(tiny_model_dir, tmp_path, started):
    rsa, _ = rsa_peer_id(tmp_path)
    assert main(["--model", str(tiny_model_dir), "--trust-orchestrator", rsa, ED25519_PEER_ID]) == 0
    assert started[0].trusted == {rsa, ED25519_PEER_ID}


# --identity-path: a usable key file, or a missing one whose directory can hold it (it read as a join failure)

def _identity_exit(tiny_model_dir: Path, path: Path, capsys) -> tuple[int, str]:
    rc = main(["--model", str(tiny_model_dir), "--identity-path", str(path)])
    return rc, capsys.readouterr().err


def test_an_identity_path_that_is_a_directory_or_no_file_exits_2(tiny_model_dir, tmp_path, capsys, started):
    assert _identity_exit(tiny_model_dir, tmp_path, capsys) == (
        2, f"error: --identity-path {tmp_path} is a directory: give the path of the key file in it (created if "
           "missing)\n")
    fifo = tmp_path / "fifo.id"
    os.mkfifo(fifo)  # the DHT's key write would block on it
    rc, err = _identity_exit(tiny_model_dir, fifo, capsys)
    assert rc == 2 and f"--identity-path {fifo} is not a regular file" in err and not started


@pytest.mark.parametrize("content", [b"garbage, not a key", b""])
def test_a_corrupt_identity_file_exits_2_and_is_left_as_it_is(content, tiny_model_dir, tmp_path, capsys, started):
    path = tmp_path / "bad.id"
    path.write_bytes(content)
    rc, err = _identity_exit(tiny_model_dir, path, capsys)
    assert rc == 2 and f"--identity-path {path} is not a libp2p RSA identity key" in err and not started
    assert path.read_bytes() == content


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_identity_file_exits_2(tiny_model_dir, tmp_path, capsys, started):
    _, path = rsa_peer_id(tmp_path)
    path.chmod(0)
    rc, err = _identity_exit(tiny_model_dir, path, capsys)
    assert rc == 2 and f"--identity-path {path} cannot be read (Permission denied)" in err and not started


def test_an_identity_path_whose_directory_cannot_be_made_exits_2(tiny_model_dir, tmp_path, capsys, started):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "keys" / "server.id"
    rc, err = _identity_exit(tiny_model_dir, path, capsys)
    assert rc == 2 and f"--identity-path {path}: its directory {path.parent} cannot be created" in err
    assert not started


def test_usable_identity_paths_start(tiny_model_dir, tmp_path, started):
    """An existing key is read and left as it is; a missing one is left to the DHT to create (its missing directory
    is made now: hivemind makes none)."""
    _, key = rsa_peer_id(tmp_path)
    before = key.read_bytes()
    missing = tmp_path / "new" / "keys" / "server.id"
    for path in (key, tmp_path / "server.id", missing):
        assert main(["--model", str(tiny_model_dir), "--identity-path", str(path)]) == 0
    assert key.read_bytes() == before and missing.parent.is_dir() and not missing.exists() and len(started) == 3


def test_an_identity_path_with_a_tilde_is_the_home_directorys(tiny_model_dir, tmp_path, monkeypatch, started):
    """``--identity-path=~/...`` (or a quoted ``~``) reaches the server unexpanded: a directory named ``~`` was made
    in the working directory, the key in it (a restart elsewhere got a new peer id)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert main(["--model", str(tiny_model_dir), "--identity-path=~/.petals/server.id"]) == 0
    assert (home / ".petals").is_dir() and not (cwd / "~").exists()
    assert started[0].cfg.identity_path == str(home / ".petals" / "server.id")
