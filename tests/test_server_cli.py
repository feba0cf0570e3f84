"""Command-line validation and memory defaults of the server (no processes, no DHT)."""

from __future__ import annotations

import pytest

from petals_chain.server.__main__ import build_parser, main
from petals_chain.server.server import CPU_MEMORY_FRACTION, Server, ServerConfig, default_memory_bytes


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
    (["--emulate-compute-scale", "0.5"], "emulate_compute_scale"),
    (["--emulate-rtt-ms", "-3"], "emulate_rtt_ms"),
    (["--emulate-decode-ms", "nan"], "emulate_decode_ms"),
    (["--emulate-reply-fault", "nan", "--emulate-reply-fault-rate", "1.5"], "emulate_reply_fault_rate"),
    (["--emulate-tau-p-lie", "0"], "emulate_tau_p_lie"),
    (["--max-length", "0"], "--max-length"),
    (["--dht-prefix", "bad prefix!"], "invalid DHT prefix"),
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
    explicit = Server(ServerConfig(model=str(tiny_model_dir), initial_peers=[orch], trust_orchestrator=["QmA"]))
    assert explicit.trusted == {"QmA"}
    available = psutil.virtual_memory().available
    assert abs(default_memory_bytes("cpu") - CPU_MEMORY_FRACTION * available) < 0.1 * available
    # Eq. 3 with the model's own s_m and s_c.
    server.memory.memory_bytes, server.memory.s_m = 10_000_000, 164_352
    s_c = server.memory.s_c(64)
    assert server.memory.slots_for(2, 64) == (10_000_000 - 2 * 164_352) // s_c
