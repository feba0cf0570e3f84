"""Session 32, the scripts and the simulator CLI: numbers refused as parsed (scripts/_args.py), the overall
comparison's unstable loads."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from petals_chain.sim import __main__ as simcli
from petals_chain.sim import experiments as ex

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"s32_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------ scripts/_args.py


@pytest.mark.parametrize("fn,text,want", [
    ("positive_int", "3", 3), ("nonnegative_int", "0", 0), ("positive_float", "0.5", 0.5),
    ("nonnegative_float", "0", 0.0), ("probability", "1", 1.0), ("probability_list", "0, 0.5,1", [0.0, 0.5, 1.0]),
])
def test_argument_types_accept_good_values(fn, text, want):
    args = _script("_args")
    assert getattr(args, fn)(text) == want


@pytest.mark.parametrize("fn,text", [
    ("positive_int", "0"), ("positive_int", "-2"), ("positive_int", "1.5"), ("nonnegative_int", "-1"),
    ("positive_float", "0"), ("positive_float", "nan"), ("positive_float", "inf"), ("positive_float", "x"),
    ("nonnegative_float", "-0.1"), ("nonnegative_float", "nan"), ("probability", "1.01"), ("probability", "nan"),
    ("probability_list", "0,,1"), ("probability_list", ""), ("probability_list", "0,2"),
])
def test_argument_types_refuse_bad_values(fn, text):
    args = _script("_args")
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace("(", r"\(")):
        getattr(args, fn)(text)


def test_name_list_keeps_the_order_and_refuses_a_typo():
    parse = _script("_args").name_list(("fcfs", "edf", "flex"))
    assert parse(" edf,fcfs ") == ["edf", "fcfs"]
    for bad in ("edf,flx", ",", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="one or more of fcfs, edf, flex"):
            parse(bad)


class _Parsed(Exception):
    """Raised right after a script's parse_args: its arguments, without running anything."""


@pytest.mark.parametrize("name,checks", [
    ("bench_audit", {"phases": ["fp", "detect", "cost"], "cost_rates": [0.0, 0.02, 0.1]}),
    ("bench_orchestrator", {"only": ["overhead", "dispatch", "concurrency"]}),
    ("bench_deadlines", {"modes": ["fcfs", "edf"]}),
    ("bench_fairness", {"policies": ["fcfs", "dlpm"]}),
])
def test_the_default_lists_parse(monkeypatch, name, checks):
    # argparse passes a string default through its type: a default the type refused would stop every plain run
    monkeypatch.syspath_prepend(str(SCRIPTS))  # bench_deadlines imports bench_fairness
    mod = _script(name)
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    with pytest.raises(_Parsed) as e:
        mod.main()
    ns = e.value.args[0]
    assert {k: getattr(ns, k) for k in checks} == checks


# Each was run with the code before: a traceback after seconds (statistics of nothing, a ZeroDivisionError, float()
# of a typo) or exit 0 having done nothing (a phase's or section's typo). Cheap: argparse refuses before any import
# of torch, model build or swarm.
@pytest.mark.parametrize("argv,message", [
    (["bench_span_memory.py", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got '0'"),
    (["bench_paged_swarm.py", "--requests", "0"], "argument --requests: must be an integer >= 1, got '0'"),
    (["bench_latency.py", "--hops", "0"], "argument --hops: must be an integer >= 1, got '0'"),
    (["bench_audit.py", "--model", "none", "--phases", "typo"], "argument --phases: must name one or more of fp"),
    (["bench_audit.py", "--model", "none", "--phases", "cost", "--cost-rates", "0,x"],
     "argument --cost-rates: must be comma-separated numbers in [0, 1], got '0,x'"),
    (["bench_orchestrator.py", "--only", "dispath"], "argument --only: must name one or more of overhead"),
])
def test_bench_scripts_refuse_bad_numbers_at_once(argv, message):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPTS / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{argv[0]}: error: ")
    assert time.monotonic() - t0 < 60  # refused while parsing (a generous margin for a loaded machine)


# ------------------------------------------------------------------------------------- overall, unstable loads


def test_overall_above_capacity_says_which_policies_are_unstable(capsys):
    # finite means were printed for 1e9 req/s with nothing saying that every queue grew without bound
    argv = ["overall", "--runs", "1", "--jobs", "200", "--no-progress"]
    assert simcli.main([*argv, "--arrival-rate", "1e9"]) == 0
    out = capsys.readouterr().out
    for p in ("proposed", "petals", "bprr"):
        assert f"unstable: {p}: the arrival rate is not below" in out
    assert simcli.main([*argv, "--arrival-rate", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "unstable" not in out
    assert "petals, bprr: per-request routes have no simple capacity" in out
    assert simcli.main([*argv, "--arrival-rate", "1e9", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["proposed"]["unstable_runs"] == 1 and 0 < res["proposed"]["service_rate"] < 1e9
    assert res["bprr"]["unstable_runs"] == 1 and "service_rate" not in res["bprr"]
    assert "service_rate_bound" not in res["proposed"] and "unstable_runs" not in res["jffc-only"]  # infeasible


def test_the_capacities_bound_what_a_saturated_run_serves():
    # every job arrives at once: the completion rate is at most the chains' rate, and at most the routed bound
    from petals_chain.sim import data as simdata
    from petals_chain.sim.engine import Workload
    from petals_chain.sim.scenarios import bloom_scenario, plan_policy

    anchors = simdata.get_anchors()
    for r in range(2):
        scen = bloom_scenario(20, 0.2, 1e9, rng=ex.run_rng(0, r), anchors=anchors)
        wl = Workload.poisson(1e9, 2000, ex.run_rng(0, r, 1))
        for p in ("proposed", "petals", "bprr"):
            plan = plan_policy(p, scen, ex.run_rng(0, r, 2))
            served = 2000 / plan.simulate(wl, scen, ex.run_rng(0, r, 3)).response.max()
            if plan.chains is not None:
                rate = ex.chains_service_rate(plan.chains)
                assert 0.8 * rate < served < 1.05 * rate, (p, served, rate)
            else:
                assert served <= ex.routed_service_rate_bound(scen, plan.placement, plan.slots), p
