"""The orchestrator's command line refuses bad fairness, audit, speculation and relay settings with a message naming
the flag."""

from __future__ import annotations

import pytest

from petals_chain.orchestrator.__main__ import main


@pytest.mark.parametrize("args, flag", [
    (["--audit-rate", "1.5"], "--audit-rate"),
    (["--audit-rate", "-0.1"], "--audit-rate"),
    (["--fairness-w-e", "-1"], "w_e"),
    (["--fairness-w-e", "0", "--fairness-w-q", "0"], "w_e and w_q"),
    (["--fairness", "d2lpm", "--dispatch", "petals"], "--fairness d2lpm"),
    # accepted before: an OverflowError at the first refill, and a refill loop that never ended
    (["--fairness-w-q", "1e308"], "w_e and w_q must be at most"),
    (["--fairness-quantum", "1e-30"], "quantum must be between"),
    (["--fairness-worker-quantum", "1e-30"], "worker_quantum must be between"),
])
def test_bad_settings_exit_2_naming_the_flag(tiny_model_dir, capsys, args, flag):
    assert main(["--model", str(tiny_model_dir), *args]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--fairness", "wfq"], ["--fairness-quantum", "0"], ["--audit-tolerance", "x"],
                                  ["--audit-strikes", "0"], ["--speculative", "eagle"], ["--speculative", "draft"],
                                  ["--speculative", "draft:"], ["--speculative", "draft:a", "--draft-model", "b"],
                                  ["--relay", "carrier"], ["--draft-layers", "0"],
                                  # accepted before, then a stuck or broken orchestrator (no plan ever, a plan error
                                  # logged for ever, opens failing at once, a traceback after the model loaded)
                                  ["--settle-s", "nan"], ["--replan-interval-s", "0"], ["--bprr-r", "0"],
                                  ["--petals-cache-tokens", "-1"], ["--route-wait-s", "nan"],
                                  ["--model-reload-s", "-1"], ["--group-ttl-s", "0"], ["--host-maddrs", "garbage"],
                                  ["--initial-peers", "garbage"], ["--log-level", "bogus"],
                                  ["--ready-file", "/nonexistent/dir/ready.json"], ["--draft-layers", "2"]])
def test_unparseable_values_are_usage_errors(tiny_model_dir, args):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_model_dir), *args])
    assert e.value.code == 2


def test_several_models_need_names_and_distinct_prefixes(tiny_model_dir, capsys):
    m = str(tiny_model_dir)
    for args in (["--model", m, "--model", f"b={m}"], ["--model", f"a={m}", "--model", f"a={m}"],
                 ["--model", f"a={m}", "--model", f"b={m}", "--dht-prefix", "x"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2, args
    # two names for one source would put both models' servers under one DHT prefix
    assert main(["--model", f"a={m}", "--model", f"b={m}"]) == 2
    assert "share a DHT prefix" in capsys.readouterr().err


def test_prefix_salt_retires_every_cached_prefix():
    from petals_chain.swarm.prefix import prefix_hashes

    ids = list(range(40))
    assert prefix_hashes(ids) == prefix_hashes(ids, b"")
    assert prefix_hashes(ids, b"\x01") != prefix_hashes(ids)
    assert len(prefix_hashes(ids, b"\x01")) == len(prefix_hashes(ids))


def test_api_keys_with_a_baseline_dispatch_start(tiny_model_dir, tmp_path):
    """``--api-keys`` added to a working ``--dispatch jsq`` (or petals, bprr) command exited 2 with an error about
    ``--fairness dlpm``, a flag never given: auto fairness is fcfs there."""
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    keys = tmp_path / "keys"
    keys.write_text("alice alice-secret-0123456789\n")
    for dispatch in ("jsq", "petals", "bprr"):
        orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_dir), api_keys=str(keys), dispatch=dispatch))
        assert orch.shares.policy.name == "fcfs"
    with pytest.raises(ValueError, match="--fairness dlpm needs a central queue"):  # asked for: still refused
        Orchestrator(OrchestratorConfig(model=str(tiny_model_dir), api_keys=str(keys), dispatch="petals",
                                        fairness="dlpm"))


def test_auto_fairness_leaves_the_queue_to_the_schedule():
    """``--api-keys`` with ``--schedule edf`` (per-key deadlines exist for it) exited 2: auto picked dlpm, which
    orders the same queue by client shares."""
    from types import SimpleNamespace

    from petals_chain.orchestrator.core import fairness_policy_name

    assert fairness_policy_name(SimpleNamespace(fairness="auto", api_keys="k", schedule="fcfs")) == "dlpm"
    for schedule in ("edf", "flex", "db", "mlfq"):
        assert fairness_policy_name(SimpleNamespace(fairness="auto", api_keys="k", schedule=schedule)) == "fcfs"
    assert fairness_policy_name(SimpleNamespace(fairness="auto", api_keys=None, schedule="fcfs")) == "fcfs"
    # nor with a baseline dispatch (--api-keys added to a working --dispatch jsq command exited 2 about dlpm)
    for dispatch in ("jsq", "petals", "bprr"):
        cfg = SimpleNamespace(fairness="auto", api_keys="k", schedule="fcfs", dispatch=dispatch)
        assert fairness_policy_name(cfg) == "fcfs"
