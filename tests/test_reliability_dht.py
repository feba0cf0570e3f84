"""Regression: large DHT commands (a swarm summary of hundreds of KiB) must not kill the DHT process.

hivemind 1.1.12 reads its command pipe non-blocking (uvloop add_reader); a command bigger than one pipe write
was read half-written and the DHT process died, after which the orchestrator hung (found by scripts/chaos.py).
"""

from __future__ import annotations

import time

from petals_chain.swarm.dht import SwarmDHT


def test_large_summaries_keep_the_dht_alive():
    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix="big")
    try:
        summary = {"model": "big", "history": [{"t": time.time() + i, "response_s": 0.123456789, "wait_s": 0.1,
                                                "service_s": 0.2} for i in range(2000)]}
        for i in range(30):
            assert sd.publish_summary("big", {**summary, "n": i}, 30, return_future=True).result(timeout=30)
        assert sd.dht.is_alive()
        assert sd.fetch_summary("big", trusted=[sd.peer_id])["n"] == 29
    finally:
        sd.shutdown()


def test_large_commands_from_several_threads_keep_the_dht_alive():
    """hivemind sends commands without a lock: large ones from several threads interleaved and killed the DHT."""
    import threading

    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix="big")
    errors: list[str] = []
    summary = {"model": "big", "history": [{"t": float(i), "response_s": 0.123456789} for i in range(3000)]}

    def work() -> None:
        for _ in range(10):
            try:
                # False is fine (a concurrent store with a later expiration won); an exception or a hang is not.
                sd.publish_summary("big", summary, 30, return_future=True).result(timeout=30)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and sd.dht.is_alive()
        assert sd.fetch_summary("big", trusted=[sd.peer_id])["model"] == "big"
    finally:
        sd.shutdown()
