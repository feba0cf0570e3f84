"""Files a command line names for the program to write are refused while the arguments are checked (exit 2, one line
naming the option), not after the model loaded or the run ended: a directory, a directory missing or not one, a
directory this user cannot write, and (for a file renamed into place) a FIFO or device. In-process, nothing started:
what would start (the orchestrator's ``serve``, the server's ``Server``) is replaced by a sentinel, so that the old
code, which accepted these paths, fails here at once instead of loading a model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from petals_chain.swarm.paths import output_file_problem

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
NOT_ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any directory")


class Started(Exception):
    """The slow work was reached: the path was accepted."""


@pytest.fixture
def no_orchestrator_start(monkeypatch):
    import petals_chain.orchestrator.__main__ as orch_main

    async def serve(*args, **kwargs):
        raise Started

    monkeypatch.setattr(orch_main, "serve", serve)
    return orch_main.main


@pytest.fixture
def no_server_start(monkeypatch):
    import petals_chain.server.__main__ as server_main
    import petals_chain.server.server as server_mod

    def server(*args, **kwargs):
        raise Started

    monkeypatch.setattr(server_mod, "Server", server)
    return server_main.main


@pytest.fixture
def paths(tmp_path) -> dict[str, Path]:
    (tmp_path / "a-file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return {"dir": tmp_path, "under_file": tmp_path / "a-file" / "x.json", "missing": tmp_path / "no" / "x.json",
            "fifo": tmp_path / "fifo", "locked": locked / "x.json", "good": tmp_path / "x.json"}


# ------------------------------------------------------------------------------- orchestrator --ready-file

@pytest.mark.parametrize("case, reason", [
    ("dir", "is a directory"),  # before: the full start, then IsADirectoryError from os.replace, exit 1
    ("fifo", "is not a regular file"),  # before: renamed over it (as root, --ready-file /dev/null replaced the device)
    ("under_file", "a-file is not a directory"),  # before: "no such directory" for a directory that is a file
])
def test_a_ready_file_that_cannot_be_one_is_a_usage_error(tiny_model_dir, no_orchestrator_start, paths, capsys,
                                                         case, reason):
    path = paths[case]
    with pytest.raises(SystemExit) as e:
        no_orchestrator_start(["--model", str(tiny_model_dir), "--port", "0", "--ready-file", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--ready-file {path}: " in err and reason in err, err


def test_a_good_ready_file_is_accepted(tiny_model_dir, no_orchestrator_start, paths):
    with pytest.raises(Started):
        no_orchestrator_start(["--model", str(tiny_model_dir), "--port", "0", "--ready-file", str(paths["good"])])


# ------------------------------------------------------------------------------- server --profile-cache

@pytest.mark.parametrize("case, reason", [
    ("dir", "is a directory"),  # before: loaded, profiled, "cannot cache tau_p" warned, profiled at every start
    ("under_file", "a-file is not a directory"),
    ("fifo", "is not a regular file"),
])
def test_a_profile_cache_that_cannot_be_written_exits_2(tiny_model_dir, no_server_start, paths, capsys, case,
                                                        reason):
    path = paths[case]
    assert no_server_start(["--model", str(tiny_model_dir), "--profile-cache", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: --profile-cache {path}: " in err and reason in err, err


def test_good_profile_caches_are_accepted(tiny_model_dir, no_server_start, paths):
    """A missing directory is made (as before); an existing file is only read until a miss, and with --tau-p the
    cache is not used at all: none of these is refused."""
    paths["good"].write_text("{}")
    for args in (["--profile-cache", str(paths["missing"])], ["--profile-cache", str(paths["good"])],
                 ["--profile-cache", str(paths["dir"]), "--tau-p", "0.01"]):
        with pytest.raises(Started):
            no_server_start(["--model", str(tiny_model_dir), *args])


# ------------------------------------------------------------------------------- scripts and the screenshot

def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"s39_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# "--no-such-flag": the old code, which took the path, stops at argparse ("unrecognized arguments") instead of
# running the benchmark; the new one refuses the path first, while converting it
@pytest.mark.parametrize("script, flag", [("bench_orchestrator", "--json"), ("soak", "--json"),
                                          ("bench_swarm", "--out"), ("bench_swarm", "--plot")])
def test_a_script_output_that_is_a_directory_is_refused_while_parsing(paths, capsys, script, flag):
    main = _script(script).main
    with pytest.raises(SystemExit) as e:
        main([flag, str(paths["dir"]), "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {paths['dir']}: is a directory" in err, err


def test_the_screenshot_paths_are_checked_before_the_browser_starts(paths, capsys):
    from petals_chain.dashboard.screenshot import main

    for flag in ("--out", "--phone-out"):
        args = ["--url", "http://127.0.0.1:9", "--out", str(paths["good"]), flag, str(paths["dir"]), "--no-such-flag"]
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2 and f"argument {flag}: {paths['dir']}: is a directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------- the checker itself

def test_the_checker_on_each_case(paths):
    assert output_file_problem(paths["good"]) is None and output_file_problem(paths["good"], replace=True) is None
    assert output_file_problem(paths["missing"]) == "no such directory"
    assert output_file_problem(paths["missing"], make_dirs=True) is None  # the writer makes it
    assert output_file_problem(paths["under_file"], make_dirs=True).endswith("a-file is not a directory")
    assert output_file_problem(paths["fifo"]) is None  # written in place (as --json /dev/stdout is)
    assert output_file_problem(paths["fifo"], replace=True).startswith("is not a regular file")
    assert output_file_problem("").startswith("is empty")


@NOT_ROOT
def test_unwritable_directories_are_refused_for_other_users(tiny_model_dir, no_orchestrator_start, no_server_start,
                                                           paths, capsys):
    locked = paths["locked"]
    assert output_file_problem(locked) == "its directory is not writable by this user"
    assert "cannot be made" in output_file_problem(locked.parent / "sub" / "x.json", make_dirs=True)
    read_only = paths["dir"] / "ro.json"
    read_only.write_text("")
    read_only.chmod(0o444)
    assert output_file_problem(read_only) == "cannot be written by this user"
    assert no_server_start(["--model", str(tiny_model_dir), "--profile-cache", str(locked)]) == 2
    assert f"--profile-cache {locked}: its directory is not writable by this user" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        no_orchestrator_start(["--model", str(tiny_model_dir), "--port", "0", "--ready-file", str(locked)])
    assert e.value.code == 2
