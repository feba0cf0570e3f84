"""Review of 2e0d9ff (server leftovers), each finding pinned by a test that failed on that commit: a stop on a GPU
that hit a sticky CUDA error crashed in the new runner drop (``torch.cuda.empty_cache`` raises then) and skipped the
rest of its cleanup; a failed batch's per-caller exception copies had another message than the error raised (an
``__init__`` that formats its arguments) and shared one list of notes."""

from __future__ import annotations

import asyncio
import logging
import types

import pytest
import torch

from petals_chain.server.batching import _own_error
from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=4, seed=0)


# ---------------------------------------------------------------------------------------------- stop
def test_a_stop_after_a_sticky_cuda_error_still_cleans_up(model, monkeypatch, caplog):
    """The GPU hit an illegal memory access (every later CUDA call fails with it) and the operator stops the server:
    the stop's new runner drop called ``torch.cuda.empty_cache()``, which raised, so the handlers, p2pd and the DHT
    process were never shut down and ``run()`` ended in a traceback. The failure is a warning now; the rest runs."""
    from petals_chain.server.config import ServerConfig
    from petals_chain.server.server import Server
    from petals_chain.swarm.local import model_memory

    def sticky() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call")

    _, s_m, s_c = model_memory(model, 64)
    s = Server(ServerConfig(model=str(model), tau_p=0.002, memory_bytes=4 * s_m + 8 * s_c, max_length=64,
                            progress=False, drain_timeout_s=1.0))
    done: list[str] = []
    s.sd = types.SimpleNamespace(peer_id="me", alive=True, shutdown=lambda: done.append("dht"))
    asg = types.SimpleNamespace(epoch=1, timestamp=1.0, max_length=64, model_fingerprint="",
                                assignments={"me": [0, 4]}, span_of=lambda peer_id: (0, 4))

    class P2P:
        async def shutdown(self) -> None:
            done.append("p2p")

    class Handler:
        async def remove_p2p_handlers(self, p2p) -> None:
            done.append("handlers")

    async def main() -> None:
        for h in s.hosted:
            h.memory.measure(s.cfg.memory_bytes, s.cfg.device)
        await s.apply_assignment(asg)
        assert s.runner is not None
        s.cfg.device = "cuda"  # the runner is on the CPU here: only the device type the stop looks at
        s.p2p = P2P()
        monkeypatch.setattr(torch.cuda, "empty_cache", sticky)
        await s._shutdown(Handler())

    with caplog.at_level(logging.WARNING, logger="petals_chain.server"):
        asyncio.run(main())
    assert done == ["handlers", "p2p", "dht"] and s.runner is None and s.span is None
    said = [r.getMessage() for r in caplog.records if "GPU memory" in r.getMessage()]
    assert len(said) == 1 and "illegal memory access" in said[0] and "\n" not in said[0]


# ---------------------------------------------------------------------------------------------- _own_error
class _DeviceLost(RuntimeError):
    """Builds its message from its arguments, one of them optional: called again with ``args``, it builds another."""

    def __init__(self, device: str, why: str = "unknown"):
        super().__init__(f"{device}: {why}")
        self.device = device


def test_each_callers_copy_says_what_was_raised():
    """A batch failed with ``_DeviceLost("cuda:0", "lost")``: every caller of the batch (and the client, in the
    step's ``internal`` error) read "cuda:0: lost: unknown", a message nobody raised."""
    e = _DeviceLost("cuda:0", "lost")
    own = _own_error(e)
    assert type(own) is _DeviceLost and own is not e and own.__cause__ is e
    assert (str(own), own.args, own.device) == ("cuda:0: lost", ("cuda:0: lost",), "cuda:0")


@pytest.mark.parametrize("make", [lambda: RuntimeError("device lost"), lambda: _DeviceLost("cuda:0", "lost"),
                                  lambda: torch.OutOfMemoryError("CUDA out of memory")],
                         ids=["plain", "formats", "oom"])
def test_a_note_one_caller_adds_stays_its_own(make):
    """The batch's error carried a note; one caller's handler added another: it showed on every other caller's
    copy too (the shallow copy shared the note list)."""
    error = make()
    error.add_note("batch of 2 rows")
    x, y = _own_error(error), _own_error(error)
    x.add_note("x's handler: retried elsewhere")
    assert y.__notes__ == error.__notes__ == ["batch of 2 rows"]
    assert x.__notes__ == ["batch of 2 rows", "x's handler: retried elsewhere"]
    assert str(x) == str(y) == str(error) and type(x) is type(error)
