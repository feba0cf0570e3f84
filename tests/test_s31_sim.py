"""Session 31, the simulator and its scripts: huge capacities in the Theorem 3.7 bounds, unstable planner loads, the
deadline prediction on an idle system, options a sub-command ignored, and benchmark arguments (in-process, cheap)."""

from __future__ import annotations

import heapq
import importlib.util
import json
import random
import sys
import tracemalloc
from pathlib import Path

import pytest

from petals_chain.algorithms import bounds, response_time_bounds
from petals_chain.algorithms.edf import ChainLoad, predict
from petals_chain.sim import __main__ as simcli
from petals_chain.sim import experiments as ex

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"s31_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------- Theorem 3.7 bounds


def test_bounds_of_a_billion_slots_near_capacity_take_little_memory():
    # the sum ran from n = 0 up to the mode near C: arrays of 2^28 and more (MemoryError, or gigabytes)
    tracemalloc.start()
    try:
        lo, hi = response_time_bounds([(1.0, 10**9)], 0.99e9)
        lo2, hi2 = response_time_bounds([(2.0, 10**9), (1.0, 10**9)], 2.5e9)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 512 * 2**20
    assert lo == pytest.approx(1.0, rel=1e-9) and hi == pytest.approx(1.0, rel=1e-9)  # M/M/c: no one waits
    assert 0.5 <= lo2 <= hi2 <= 1.0 + 1e-9


def test_bounds_too_wide_to_sum_are_refused_clearly():
    with pytest.raises(ValueError, match="too many to sum"):
        response_time_bounds([(1.0, 10**12)], 0.9e12)


@pytest.mark.parametrize("chains,load", [([(1.0, 200_000)], 0.99), ([(2.0, 40_000), (1.0, 50_000), (0.3, 9_000)], 0.9),
                                          ([(2.0, 40_000), (1.0, 50_000), (0.3, 9_000)], 0.999999),
                                          ([(1.0, 70_000), (5.0, 3)], 0.3)])
def test_the_window_around_the_mode_matches_the_full_sum(monkeypatch, chains, load):
    nu = sum(mu * c for mu, c in chains)
    got = response_time_bounds(chains, load * nu)
    monkeypatch.setattr(bounds, "_EXACT_C", 10**7)  # every term summed
    want = response_time_bounds(chains, load * nu)
    assert got == pytest.approx(want, rel=1e-9)


# ------------------------------------------------------------------------------------------------ planner scale


def test_planner_scale_at_an_unstable_rate_says_so(capsys):
    assert simcli.main(["planner-scale", "--servers", "20", "--planner-rate", "1000"]) == 0
    out = capsys.readouterr().out
    assert "unstable" in out and "1000 req/s" in out
    res = ex.planner_scale(20, arrival_rate=1000.0)
    assert res["stable"] is False and 0 < res["service_rate"] < 1000
    assert ex.planner_scale(20)["stable"] is True


def test_bench_planner_marks_an_unstable_rate(capsys):
    mod = _script("bench_planner")
    assert mod.main(["--servers", "20", "--arrival-rate", "0.2", "1000", "--jffc-chains", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["planner"]
    assert [r["stable"] for r in rows] == [True, False] and rows[1]["service_rate"] < 1000
    assert mod.main(["--servers", "20", "--arrival-rate", "1000", "--jffc-chains", "2"]) == 0
    assert "UNSTABLE" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- edf.predict, idle


def _idle_system(chains: list[ChainLoad], output_tokens: int, siblings: int) -> tuple[float, float]:
    """An idle system served exactly: ``1 + siblings`` choices, each on the free slot of the chain with the smallest
    ``job_s`` (JFFC), a later one on the first slot freed; a choice opens its chain, then steps ``1 + tokens``
    times. Returns (first choice's first token, last choice's last token)."""
    slots = [(0.0, c.job_s, k) for k, c in enumerate(chains) for _ in range(c.capacity)]
    heapq.heapify(slots)
    first, last = None, 0.0
    for _ in range(1 + siblings):
        t, key, k = heapq.heappop(slots)
        c = chains[k]
        end = t + c.open_s + c.step_s * (1 + output_tokens)
        first = t + c.open_s + c.step_s if first is None else first
        last = max(last, end)
        heapq.heappush(slots, (end, key, k))
    return first, last


def test_predict_refuses_nothing_an_idle_system_serves_in_time():
    # n choices on fewer slots waited (n - free) jobs of the planner's mean length, and a first token was timed on
    # the chain best for the last one: deadlines an idle system meets were refused
    rng = random.Random(31)
    for _ in range(3000):
        chains = []
        for _ in range(rng.randint(1, 3)):
            step = rng.uniform(0.01, 0.2)
            chains.append(ChainLoad(capacity=rng.randint(1, 3), active=0, step_s=step,
                                    job_s=step * rng.uniform(1, 50) + rng.uniform(0, 0.3),
                                    open_s=rng.choice([0.0, rng.uniform(0, 0.5)])))
        out, siblings = rng.randint(0, 30), rng.choice([0, 0, rng.randint(1, 5)])
        first, last = _idle_system(chains, out, siblings)
        for kw in ({"ttft_deadline": first * (1 + 1e-9)}, {"deadline": last * (1 + 1e-9)}):
            p = predict(0.0, chains, 0, out, siblings=siblings, **kw)
            assert not p.doomed, (chains, out, siblings, first, last, p)


def test_predict_of_n_short_choices_on_one_idle_slot():
    one = ChainLoad(capacity=1, active=0, job_s=1.7, step_s=0.1)  # a mean job 1.7 s, these 0.2 s each
    assert predict(0.0, [one], 0, 1, siblings=2).total_s == pytest.approx(0.6)
    assert not predict(0.0, [one], 0, 1, siblings=2, deadline=1.0).doomed
    # long choices: as many mean jobs' time as before; a busy chain still waits at the queue's rate
    assert predict(0.0, [one], 0, 16, siblings=1).total_s == pytest.approx(3.4)
    busy = ChainLoad(capacity=1, active=1, job_s=1.7, step_s=0.1)
    assert predict(0.0, [busy], 0, 1, siblings=2).total_s == pytest.approx(3 * 1.7 + 0.2)


def test_predict_times_the_first_token_on_the_chain_that_gives_it_soonest():
    quick_open = ChainLoad(capacity=1, active=0, job_s=3.0, step_s=0.1)
    slow_open = ChainLoad(capacity=1, active=0, job_s=3.0, step_s=0.01, open_s=1.0)  # best for 200 tokens
    p = predict(0.0, [quick_open, slow_open], 0, 200, ttft_deadline=0.5)
    assert not p.doomed and p.ttft_s == pytest.approx(0.1) and p.total_s == pytest.approx(3.01)
    assert predict(0.0, [slow_open], 0, 200, ttft_deadline=0.5).doomed


def test_an_idle_chain_admits_n_short_choices_with_a_deadline_it_meets():
    import asyncio

    from petals_chain.model import Chain
    from petals_chain.orchestrator.deadlines import RequestDeadline
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)  # step 0.1 s, a mean job 1.7 s, one slot
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))])
        lease = await dm.acquire(DispatchJob("n0", deadline=RequestDeadline.from_ms("x", 1_000, None),
                                             output_tokens=1, siblings=2))  # 3 x 0.2 s: 0.6 s; was refused (3.6 s)
        assert lease.index == 0 and dm.deadline_refused == 0
        dm.release(lease)

    asyncio.run(main())


# -------------------------------------------------------------------------------------- options a command ignores


@pytest.mark.parametrize("argv,message", [
    (["fig3", "--trace", "x.csv"], "--trace is not used by fig3"),
    (["multimodel", "--trace", "x.csv"], "--trace is not used by multimodel"),
    (["fairness", "--experiment", "prefix", "--trace", "x.csv"], "--trace is read only by fairness --experiment heavy"),
    (["deadlines", "--experiment", "herd", "--trace", "x.csv"], "--trace is read only by deadlines --experiment load"),
    (["fairness", "--rtt-file", "x.csv"], "--rtt-file is not used by fairness"),
    (["fig3", "--jobs", "10"], "--jobs is not used by fig3"),
    (["overall", "--requests", "5"], "--requests is not used by overall"),
    (["planner-scale", "--quick"], "--quick is not used by planner-scale"),
    (["fig4", "--experiment", "heavy"], "--experiment is not used by fig4"),
])
def test_an_option_the_command_ignores_is_refused(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(simcli, "run_command", lambda *a: pytest.fail("ran with an option it ignores"))
    assert simcli.main([*argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_options_a_command_reads_pass_the_check():
    given = simcli._given(["reproduce", "--requests", "5", "--eta", "0.3", "--rtt-file", "r.csv", "--quick"])
    assert given == {"requests", "eta", "rtt_file", "quick"}
    assert simcli.unused_option("reproduce", "all", given) is None
    assert simcli.unused_option("deadlines", "load", {"trace", "quick"}) is None
    assert simcli.unused_option("fairness", "all", {"trace"}) is None


def test_fairness_heavy_reads_the_trace_it_is_given(tmp_path, capsys):
    # --trace was ignored (the shared file or the synthetic one ran instead); a trace too short for the experiment
    # then divided by zero
    path = tmp_path / "short.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0000000,100,10\n"
                    "2023-11-16 18:15:47.0000000,200,20\n2023-11-16 18:15:49.5000000,50,5\n")
    assert simcli.main(["fairness", "--experiment", "heavy", "--trace", str(path), "--quick", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "too few rows for the heavy experiment" in err


# ------------------------------------------------------------------------------------------------ bench_fairness


@pytest.fixture
def fake_bench_fairness(monkeypatch, tmp_path):
    """bench_fairness with no model and no swarm: every request served in 1 s."""
    mod = _script("bench_fairness")
    monkeypatch.setattr(mod, "model_and_prompt", lambda args, work, rng: [1, 2, 3])

    def run_policy(args, policy, plan, keys_file, prompt):
        return {"capacity": 3, "wall_s": 1.0, "fairness": {"clients": {"x": {"service": 1.0}}},
                "results": [{"client": c, "sent": t, "latency": 1.0, "wait": 0.1, "service": 1.0, "text": "x"}
                            for t, c, _ in plan]}

    monkeypatch.setattr(mod, "run_policy", run_policy)
    monkeypatch.setattr(mod.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    return mod


@pytest.mark.parametrize("argv", [["--overload", "0"], ["--overload", "-1"], ["--overload", "nan"],
                                  ["--heavy-factor", "0"], ["--duration-s", "0"], ["--light", "0"], ["--seed", "-1"],
                                  ["--rtt-ms", "inf"], ["--policies", ","]])
def test_bench_fairness_bad_arguments_exit_2_before_any_work(monkeypatch, fake_bench_fairness, argv):
    # --overload 0 divided by zero after the first probe run, nan hung drawing arrivals, -1 failed in numpy
    monkeypatch.setattr(fake_bench_fairness, "run_policy", lambda *a: pytest.fail("ran a swarm"))
    monkeypatch.setattr(sys, "argv", ["bench_fairness.py", *argv])
    with pytest.raises(SystemExit) as e:
        fake_bench_fairness.main()
    assert e.value.code == 2


def test_bench_fairness_without_a_heavy_client_prints_its_table(monkeypatch, capsys, fake_bench_fairness):
    # the heavy latency row formatted None with :.3f after every run (TypeError)
    monkeypatch.setattr(sys, "argv", ["bench_fairness.py", "--heavy", "0", "--duration-s", "4"])
    assert fake_bench_fairness.main() == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("heavy mean latency"))
    assert row.split()[-2:] == ["-", "-"]


def test_bench_fairness_with_a_short_window_exits_2_with_a_message(monkeypatch, capsys, fake_bench_fairness):
    # a short --duration-s drew no probe request: statistics.mean of nothing after the swarm ran (a traceback)
    monkeypatch.setattr(sys, "argv", ["bench_fairness.py", "--duration-s", "4"])
    assert fake_bench_fairness.main() == 2
    assert "no light client's request arrives in --duration-s 4" in capsys.readouterr().err


def test_bench_fairness_refuses_an_unknown_policy_before_any_work(monkeypatch, fake_bench_fairness):
    # the orchestrator's --fairness refused the typo, after the probe runs
    monkeypatch.setattr(fake_bench_fairness, "run_policy", lambda *a: pytest.fail("ran a swarm"))
    monkeypatch.setattr(sys, "argv", ["bench_fairness.py", "--policies", "fcfs,dlmp"])
    with pytest.raises(SystemExit) as e:
        fake_bench_fairness.main()
    assert e.value.code == 2


@pytest.mark.parametrize("argv", [["--overload", "0"], ["--overload", "-1"], ["--duration-s", "0"], ["--slo", "0"],
                                  ["--modes", "edf,flx"], ["--modes", ","], ["--background", "-1"]])
def test_bench_deadlines_bad_arguments_exit_2_before_any_work(monkeypatch, argv):
    # --overload 0 divided by zero after the probe's swarm; a mode's typo failed to start its orchestrator
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports bench_fairness
    mod = _script("bench_deadlines")
    monkeypatch.setattr(mod, "model_and_prompt", lambda *a: pytest.fail("built a model"))
    monkeypatch.setattr(sys, "argv", ["bench_deadlines.py", *argv])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2


def test_check_herd_split_refuses_no_instances(monkeypatch):
    # --instances -5 checked nothing and exited 0, as if every instance had passed
    monkeypatch.setattr(sys, "argv", ["check_herd_split.py", "--instances", "-5"])
    with pytest.raises(SystemExit) as e:
        _script("check_herd_split").main()
    assert e.value.code == 2
