"""The simulator's CLI and benchmark scripts on bad or extreme input, as a researcher runs them (defect hunt)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from petals_chain.sim import __main__ as simcli
from petals_chain.sim import data as simdata

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TRACE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
RTT_HEADER = "anchor_id,latency_m1,latitude,longitude\n"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"hunt_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("loader,header", [(simdata.load_trace, TRACE_HEADER), (simdata.load_anchors, RTT_HEADER)])
@pytest.mark.parametrize("body", [b"\xff\xfe not text\n", b'"' + b"x" * 200_000 + b"\n"], ids=["binary", "long-field"])
def test_a_file_that_is_not_csv_text_is_a_data_error(tmp_path, loader, header, body):
    # UnicodeDecodeError and csv.Error escaped as tracebacks (the CLI catches DataError for --rtt-file)
    path = tmp_path / "bad.csv"
    path.write_bytes(header.encode() + body)
    with pytest.raises(simdata.DataError, match="not a CSV text file"):
        loader(path)


def test_cli_rtt_file_not_text_exits_2(tmp_path, capsys):
    path = tmp_path / "rtt.csv"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert simcli.main(["overall", "--rtt-file", str(path), "--no-progress"]) == 2
    assert "not a CSV text file" in capsys.readouterr().err


def test_anchors_with_nan_or_off_globe_coordinates_are_skipped(tmp_path):
    # a NaN latitude made every RTT NaN: planning failed on "tau_c of server 's00' must be finite"
    path = tmp_path / "rtt.csv"
    path.write_text(RTT_HEADER + "a,10,50,10\nb,20,51,11\nc,15,nan,10\nd,12,95,10\ne,13,50,inf\n")
    anchors = simdata.load_anchors(path)
    assert anchors.ids == ["a", "b"]


def test_trace_table_of_two_requests_prints(tmp_path, capsys):
    # two requests have one gap: the std ratio is NaN (null in JSON) and its :.2f crashed the table
    path = tmp_path / "two.csv"
    path.write_text(TRACE_HEADER + "2023-11-16 18:15:46.0000000,100,10\n2023-11-16 18:15:47.0000000,200,10\n")
    assert simcli.main(["trace", "--trace", str(path), "--quick", "--no-progress"]) == 0
    assert "inter-arrival std / exponential's = -" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["trace"], ["deadlines", "--experiment", "load"]])
def test_a_trace_at_one_instant_is_refused_clearly(tmp_path, capsys, argv):
    # the planner said "arrival_rate must be finite and >= 0, got inf", the deadlines run "duration must be positive"
    path = tmp_path / "one.csv"
    path.write_text(TRACE_HEADER + "2023-11-16 18:15:46.0000000,100,10\n2023-11-16 18:15:46.0000000,100,10\n")
    assert simcli.main([*argv, "--trace", str(path), "--quick", "--no-progress"]) == 2
    assert "arrive at one instant" in capsys.readouterr().err


def test_fig8_cells_file_holds_only_the_last_run(tmp_path, monkeypatch):
    # the partial-results file was appended to, so a second run (another seed) mixed its cells with the first's
    def fake_fig8(*, on_cell, **kw):
        on_cell({"servers": 10, "eta": 0.2})
        return {"cells": []}

    monkeypatch.setattr(simcli.ex, "fig8", fake_fig8)
    args = simcli.build_parser().parse_args(["fig8", "--out", str(tmp_path), "--no-progress"])
    for _ in range(2):
        simcli.run_command("fig8", args)
    assert len((tmp_path / "fig8_cells.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("argv,message", [
    (["fairness", "--experiment", "fig11a"], "--experiment must be one of"),  # was a KeyError traceback
    (["fig3", "--seed", "-1"], "--seed must be >= 0"),  # was numpy's "expected non-negative integer"
])
def test_bad_arguments_exit_2_with_a_clear_error(capsys, argv, message):
    assert simcli.main([*argv, "--quick", "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_out_that_is_a_file_exits_2_before_running(tmp_path, capsys, monkeypatch):
    # a FileExistsError traceback came after the (maybe long) runs
    monkeypatch.setattr(simcli, "run_command", lambda *a: pytest.fail("ran before checking --out"))
    target = tmp_path / "file"
    target.write_text("")
    assert simcli.main(["fig3", "--out", str(target), "--no-progress"]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--jobs", "-5", "--servers"], ["--jobs", "10", "--servers", "0"]])
def test_bench_sim_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        _script("bench_sim").main(argv)
    assert e.value.code == 2


def test_bench_sim_planner_too_few_servers_exits_2(capsys):
    assert _script("bench_sim").main(["--jobs", "20", "--servers", "3"]) == 2
    assert "error: planner J=3" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--servers", "0"], ["--arrival-rate", "nan"], ["--rho-bar", "2"]])
def test_bench_planner_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        _script("bench_planner").main(argv)
    assert e.value.code == 2


def test_bench_planner_too_few_servers_exits_2(capsys):
    assert _script("bench_planner").main(["--servers", "3", "--jffc-chains", "1"]) == 2
    assert "cannot form any chain" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--hi", "--burst"])
def test_bench_placement_zero_rate_or_burst_exits_2_before_building(monkeypatch, flag):
    # a ZeroDivisionError in arrivals, after the models were built and their greedy outputs computed
    mod = _script("bench_placement")
    monkeypatch.setattr(sys, "argv", ["bench_placement.py", flag, "0"])
    fake = types.ModuleType("petals_chain.swarm.tiny_model")  # the real one imports torch: seconds
    fake.build_tiny_model = lambda *a, **k: pytest.fail("built a model before checking the arguments")
    monkeypatch.setitem(sys.modules, "petals_chain.swarm.tiny_model", fake)
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2


def test_data_dir_override_is_searched_alone(tmp_path, monkeypatch):
    # pointed at an empty directory to see the synthetic fallbacks, the simulator read ../shared/data's files anyway
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    (shared / simdata.TRACE_FILENAME).write_text(TRACE_HEADER + "2023-11-16 18:15:46.0000000,100,10\n")
    (tmp_path / "project").mkdir()
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "project")  # ../shared/data holds a trace
    monkeypatch.setenv("PETALS_CHAIN_DATA_DIR", str(tmp_path / "empty"))
    assert simdata.default_data_path(simdata.TRACE_FILENAME) is None
    assert simdata.get_trace().source == "synthetic"
    (tmp_path / "empty" / simdata.RTT_FILENAME).write_text(RTT_HEADER + "a,10,50,10\nb,20,51,11\n")
    assert simdata.default_data_path(simdata.RTT_FILENAME) == (tmp_path / "empty" / simdata.RTT_FILENAME).resolve()
