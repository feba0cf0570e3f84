"""The server's command line (review of the full-byte fingerprint and of SIGHUP).

* A model offered but not served (``--model A --model B``) had its weights hashed (every byte since the full-byte
  fingerprint) when its first standby record was published, on the event loop: the served model's sessions and
  heartbeats stalled for the hash (about a second per GB here) at a first start. They are hashed before the loop.
* SIGHUP stops the server as SIGTERM does; a tool that sends it to reload a configuration saw the server stop with
  no word of why. It now says so in the log.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from test_s31_proc import _FakeServer

from petals_chain.server import __main__ as server_main
from petals_chain.swarm.tiny_model import build_tiny_model


def test_every_offered_models_weights_are_hashed_before_the_event_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))  # no digest cached from another run
    models = [build_tiny_model(tmp_path / name, family=family, num_layers=2, num_shards=1)
              for name, family in (("served", "llama"), ("offered", "qwen2"))]
    seen: list[tuple[str, bool]] = []

    async def fake_serve(server, lost=None):  # the loop runs: what is not hashed yet would be hashed on it
        seen.extend((h.prefix, "fingerprint" in h.source.__dict__) for h in server.hosted)
        return 0

    monkeypatch.setattr(server_main, "_serve", fake_serve)
    code = server_main.main(["--model", str(models[0]), "--model", str(models[1]), "--memory-bytes", "50000000",
                             "--tau-p", "0.01", "--allow-any-client", "--no-progress"])
    assert code == 0
    assert seen == [("served", True), ("offered", True)]


def test_sighup_says_in_the_log_that_it_stops_the_server_and_that_nothing_is_reloaded(caplog):
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        fake = _FakeServer(wait_s=60.0)
        with caplog.at_level(logging.WARNING, logger="petals_chain.server"):
            assert asyncio.run(server_main._serve(fake)) == 0
        assert fake.signals == 1
        said = [r.getMessage() for r in caplog.records if r.name == "petals_chain.server"]
        assert any("SIGHUP" in m and "stopping" in m and "reload" in m for m in said), said
    finally:
        signal.signal(signal.SIGHUP, before)
