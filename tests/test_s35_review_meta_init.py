"""Review of 75df117 (META_INIT_LOCK): accelerate's init_empty_weights swaps nn.Module.register_parameter for every
thread, so a lock around the project's own loads left (a) every module another thread built meanwhile on meta and
(b) memory.block_bytes (its own init_empty_weights, outside the lock) able to interleave with a load: the swap it
saved was restored last, so every module built afterwards in the process had meta weights and every load failed.
Loads now build on meta for their own thread only (sources.empty_weights)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from petals_chain.swarm import checkpoint, memory
from petals_chain.swarm.sources import resolve_source
from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("meta_review") / "m", num_layers=2, num_shards=1))


@pytest.fixture
def register_parameter_restored():
    """A failing run of the old code leaves accelerate's swap installed: put torch's own back for later tests."""
    original = nn.Module.register_parameter
    yield
    nn.Module.register_parameter = original


def _paused(real_class, thread_name: str, inside: threading.Event, go: threading.Event):
    """``decoder_layer_class`` whose layer construction (on meta) in thread ``thread_name`` waits for ``go``."""
    def wrapped(config):
        cls = real_class(config)

        def build(*a, **k):
            if threading.current_thread().name == thread_name:
                inside.set()
                assert go.wait(30), "not released"
            return cls(*a, **k)

        return build

    return wrapped


def _run(name: str, fn, out: dict) -> threading.Thread:
    def target() -> None:
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - asserted by the caller
            out[name] = e

    t = threading.Thread(target=target, name=name)
    t.start()
    return t


def test_modules_built_in_another_thread_during_a_load_are_real(tiny, monkeypatch, register_parameter_restored):
    """While a load builds its layer on meta, another thread's module (a quantizer's Linear, a user's model) and
    another thread's load get real weights (before: the Linear's weight was on meta)."""
    inside, go = threading.Event(), threading.Event()
    monkeypatch.setattr(checkpoint, "decoder_layer_class", _paused(checkpoint.decoder_layer_class, "loader", inside,
                                                                   go))
    out: dict[str, object] = {}
    t = _run("loader", lambda: checkpoint.load_block(tiny, 0), out)
    try:
        assert inside.wait(60)
        linear = nn.Linear(3, 3)
        other = checkpoint.load_block(tiny, 1)  # not paused: another thread, while the loader's window is open
    finally:
        go.set()
        t.join(60)
    assert not linear.weight.is_meta and not linear.bias.is_meta
    assert not any(p.is_meta for p in other.parameters())
    assert isinstance(out["loader"], nn.Module), out["loader"]
    assert not any(p.is_meta for p in out["loader"].parameters())


def test_block_bytes_interleaved_with_a_load_leaves_the_process_sound(tiny, monkeypatch, register_parameter_restored):
    """block_bytes (a server sizing its blocks, or the orchestrator's plan) opens its meta window, a load opens one,
    block_bytes closes first. Before: the load restored block_bytes' swap on leaving, failed with "tensors left
    uninitialised", and so did every later load; every nn.Linear of the process was on meta."""
    config = resolve_source(tiny).config
    expected_bytes = memory.block_bytes(config)
    in_size, go_size, in_load, go_load = (threading.Event() for _ in range(4))
    monkeypatch.setattr(memory, "decoder_layer_class", _paused(memory.decoder_layer_class, "sizer", in_size,
                                                               go_size))
    monkeypatch.setattr(checkpoint, "decoder_layer_class", _paused(checkpoint.decoder_layer_class, "loader",
                                                                   in_load, go_load))
    out: dict[str, object] = {}
    sizer = _run("sizer", lambda: memory.block_bytes(config), out)
    loader = None
    try:
        assert in_size.wait(60)
        loader = _run("loader", lambda: checkpoint.load_block(tiny, 0), out)
        assert in_load.wait(60)
        go_size.set()
        sizer.join(60)  # the first window opened closes first
    finally:
        go_size.set()
        go_load.set()
        sizer.join(60)
        if loader is not None:
            loader.join(60)
    assert out["sizer"] == expected_bytes
    assert isinstance(out["loader"], nn.Module), out["loader"]
    assert not any(p.is_meta for p in out["loader"].parameters())
    assert not nn.Linear(2, 2).weight.is_meta
    assert not any(p.is_meta for p in checkpoint.load_block(tiny, 1).parameters())


def test_empty_weights_is_per_thread_nested_and_left_on_errors():
    from petals_chain.swarm.sources import empty_weights

    with empty_weights():
        with empty_weights():
            inner = nn.Linear(2, 2)
        outer = nn.Linear(2, 2)
        rms = nn.Module()
        rms.register_buffer("scale", torch.ones(2))
        box: list[nn.Module] = []
        t = threading.Thread(target=lambda: box.append(nn.Linear(2, 2)))
        t.start()
        t.join(60)
    assert inner.weight.is_meta and outer.weight.is_meta and outer.bias.is_meta
    assert not rms.scale.is_meta  # buffers stay real (rotary inv_freq, embedding scales), as accelerate's default
    assert not box[0].weight.is_meta
    with pytest.raises(RuntimeError, match="boom"):
        with empty_weights():
            raise RuntimeError("boom")
    assert not nn.Linear(2, 2).weight.is_meta


def test_soak_refuses_tracemalloc_without_two_measured_rounds(monkeypatch, capsys):
    """``soak.py --rounds 1 --tracemalloc`` ran the whole soak and printed no comparison (the second snapshot is
    taken at the last measured round, the first after round 1: the same round), leaving tracemalloc on."""
    import importlib.util
    import sys
    from pathlib import Path

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts scripts/ on it
    spec = importlib.util.spec_from_file_location("_soak_script",
                                                  Path(__file__).resolve().parents[1] / "scripts" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)

    def no_swarm(args, work):
        raise AssertionError("the soak started")

    monkeypatch.setattr(soak, "_soak", no_swarm)
    with pytest.raises(SystemExit) as e:
        soak.main(["--rounds", "1", "--tracemalloc"])
    assert e.value.code == 2
    assert "--rounds 2" in capsys.readouterr().err


def test_a_load_while_block_bytes_sizes_a_block_in_another_thread(tiny, monkeypatch, register_parameter_restored):
    """A server loading its blocks while another server of the process (or the orchestrator's plan) sizes a block:
    before, memory.block_bytes' accelerate window put the loaded block's weights on meta ("tensors left
    uninitialised")."""
    config = resolve_source(tiny).config
    inside, go = threading.Event(), threading.Event()
    monkeypatch.setattr(memory, "decoder_layer_class", _paused(memory.decoder_layer_class, "sizer", inside, go))
    out: dict[str, object] = {}
    sizer = _run("sizer", lambda: memory.block_bytes(config), out)
    try:
        assert inside.wait(60)
        layer = checkpoint.load_block(tiny, 0)
    finally:
        go.set()
        sizer.join(60)
    assert not any(p.is_meta for p in layer.parameters())
    assert isinstance(out["sizer"], int) and out["sizer"] > 0
