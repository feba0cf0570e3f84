"""Review of c8fc43e (files a command line names for writing, checked with the arguments).

A path ending in a slash whose directory did not exist passed the check, and failed as before after the whole start
or run: ``--ready-file ready/`` (the orchestrator writes ``ready/.tmp``), ``--plot plots/`` (matplotlib saves
``plots/.png``); the writers through ``Path`` wrote a file of another name (``--json out/``: ``out``).
A symbolic link to a file not made yet passed the writers (``open`` makes the link's target; the rename of
``--ready-file``/``--profile-cache`` replaces the link) but was refused as "cannot be written by this user" or "not a
regular file (a FIFO or a device)"."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from petals_chain.swarm.paths import output_file_problem

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"s40_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("tail", ["results/", "results/.", "results/.."])
def test_a_missing_directory_s_path_is_refused(tmp_path, tail):
    text = f"{tmp_path}/{tail}"
    for kw in ({}, {"make_dirs": True}, {"replace": True}):
        assert output_file_problem(text, **kw).startswith("names a directory"), kw


def test_a_ready_file_ending_in_a_slash_is_a_usage_error(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import petals_chain.orchestrator.__main__ as orch_main

    class Started(Exception):
        pass

    async def serve(*args, **kwargs):  # (the old code took the path: it fails here at once, not after a start)
        raise Started

    monkeypatch.setattr(orch_main, "serve", serve)
    with pytest.raises(SystemExit) as e:
        orch_main.main(["--model", str(tiny_model_dir), "--port", "0", "--ready-file", f"{tmp_path}/ready/"])
    assert e.value.code == 2
    assert f"--ready-file {tmp_path}/ready/: names a directory" in capsys.readouterr().err


def test_a_script_refuses_a_plot_path_ending_in_a_slash_while_parsing(tmp_path, capsys):
    # ("--no-such-flag": the old code, which took the path, stops at argparse instead of running the benchmark)
    with pytest.raises(SystemExit) as e:
        _script("bench_swarm").main(["--plot", f"{tmp_path}/plots/", "--no-such-flag"])
    assert e.value.code == 2
    assert f"argument --plot: {tmp_path}/plots/: names a directory" in capsys.readouterr().err


def test_a_symbolic_link_to_a_file_not_made_yet_is_accepted_as_its_writers_take_it(tmp_path):
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "runs" / "1.json")
    (tmp_path / "runs").mkdir()
    for kw in ({}, {"make_dirs": True}, {"replace": True}, {"replace": True, "make_dirs": True}):
        assert output_file_problem(link, **kw) is None, kw
    link.write_text("{}")  # a script's writer: it makes the target
    assert (tmp_path / "runs" / "1.json").read_text() == "{}"


def test_a_symbolic_link_into_a_missing_directory_is_refused_by_its_target(tmp_path):
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "runs" / "1.json")
    assert output_file_problem(link) == f"is a symbolic link to {tmp_path}/runs/1.json: no such directory"
    # the writers that rename a file into place replace the link itself, in its own (writable) directory
    assert output_file_problem(link, replace=True) is None


def test_a_loop_of_links_is_refused_in_place_and_replaced_by_a_rename(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "loop of links" in output_file_problem(loop)
    assert output_file_problem(loop, replace=True) is None


def test_a_dangling_profile_cache_link_is_accepted(tiny_model_dir, tmp_path, monkeypatch):
    import petals_chain.server.__main__ as server_main
    import petals_chain.server.server as server_mod

    class Started(Exception):
        pass

    def server(*args, **kwargs):
        raise Started

    monkeypatch.setattr(server_mod, "Server", server)
    link = tmp_path / "tau_p.json"
    link.symlink_to(tmp_path / "persistent" / "tau_p.json")
    with pytest.raises(Started):
        server_main.main(["--model", str(tiny_model_dir), "--profile-cache", str(link)])
    assert os.path.islink(link)
