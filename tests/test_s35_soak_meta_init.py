"""Found by the soak (scripts/soak.py, two servers in one process): two threads loading blocks at once. accelerate's
init_empty_weights patches nn.Module for every thread, so a block assigned its weights in one thread while another
thread built its layer on the meta device kept meta tensors: "block 0: tensors left uninitialised", at every retry."""

from __future__ import annotations

import threading

import pytest

from petals_chain.swarm import checkpoint
from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("meta") / "m", num_layers=2, num_shards=1))


def test_a_block_loads_whole_while_another_thread_builds_on_the_meta_device(tiny, monkeypatch):
    """Thread A stops inside its layer's construction (on the meta device) until thread B's load of another block
    has finished: B neither waits for A (loads of one process run in parallel) nor gets meta weights (before the
    lock: B's were put on meta; with it, B waited for A)."""
    real_class = checkpoint.decoder_layer_class
    inside, b_done, a_left = threading.Event(), threading.Event(), threading.Event()

    def slow_class(config):
        cls = real_class(config)

        def build(*a, **k):
            if threading.current_thread().name == "loader-a":
                inside.set()
                b_done.wait(30)  # (a B that waited for A is released after 30 s, and fails below)
                a_left.set()
            return cls(*a, **k)

        return build

    monkeypatch.setattr(checkpoint, "decoder_layer_class", slow_class)
    out: dict[str, object] = {}

    def load(name: str, index: int) -> None:
        try:
            out[name] = checkpoint.load_block(tiny, index)
            out[f"{name}_before_a_went_on"] = not a_left.is_set()
        except Exception as e:  # noqa: BLE001 - asserted below
            out[name] = e

    a = threading.Thread(target=load, args=("a", 0), name="loader-a")
    a.start()
    assert inside.wait(60)
    b = threading.Thread(target=load, args=("b", 1), name="loader-b")
    b.start()
    b.join(60)
    b_done.set()
    a.join(60)
    for name in ("a", "b"):
        layer = out[name]
        assert not isinstance(layer, Exception), f"{name}: {layer!r}"
        assert not any(p.is_meta for p in layer.parameters()), name
    assert out["b_before_a_went_on"], "B's load waited for A's"
