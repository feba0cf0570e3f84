"""quiet_peer_disconnects: hivemind's unretrieved "peer gone" stream errors become one DEBUG line; others stay."""

from __future__ import annotations

import asyncio
import gc
import logging

from petals_chain.swarm.aio import quiet_peer_disconnects


class P2P:  # the qualname hivemind's stream-handler tasks carry: P2P._iterate_protobuf_stream_handler...
    @staticmethod
    async def _write_to_stream(exc: BaseException) -> None:
        raise exc


async def _other(exc: BaseException) -> None:
    raise exc


def _unretrieved(caplog, coro_fn, exc: BaseException) -> list[logging.LogRecord]:
    async def main() -> None:
        quiet_peer_disconnects(asyncio.get_running_loop())
        task = asyncio.create_task(coro_fn(exc))
        await asyncio.sleep(0.01)
        assert task.done()
        del task
        gc.collect()  # the task's destructor reports the exception nobody retrieved
        await asyncio.sleep(0)

    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    return [r for r in caplog.records if "never retrieved" in r.getMessage() or "a peer left" in r.getMessage()]


def test_a_peer_gone_mid_stream_is_one_debug_line(caplog):
    records = _unretrieved(caplog, P2P._write_to_stream, ConnectionResetError("Connection lost"))
    assert [(r.levelno, r.name) for r in records] == [(logging.DEBUG, "petals_chain.swarm.aio")], records
    assert "P2P._write_to_stream" in records[0].getMessage()


def test_other_unretrieved_errors_still_reach_asyncio(caplog):
    records = _unretrieved(caplog, P2P._write_to_stream, ValueError("a real bug"))
    assert [r.levelno for r in records] == [logging.ERROR]
    records = _unretrieved(caplog, _other, ConnectionResetError("not hivemind's"))
    assert [r.levelno for r in records] == [logging.ERROR]


def test_p2pd_shutdown_error_relayed_by_hivemind_is_debug():
    """p2pd's "use of closed network connection" at shutdown (relayed by hivemind at ERROR into every role's log)
    is downgraded, and dropped below DEBUG; other p2pd errors are not."""
    import petals_chain.swarm.dht  # noqa: F401 - installs the filter

    relay = logging.getLogger("hivemind.p2p.p2p_daemon")  # hivemind's loggers do not propagate to the root
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    relay.addHandler(handler)
    level = relay.level
    closing = ("error accepting connection: accept unix /tmp/hivemind-p2pd-x.sock: use of closed network "
               "connection")
    try:
        relay.setLevel(logging.INFO)
        relay.error(closing)
        relay.error("failed to dial: no route")
        assert [(r.getMessage(), r.levelno) for r in seen] == [("failed to dial: no route", logging.ERROR)]
        seen.clear()
        relay.setLevel(logging.DEBUG)
        relay.error(closing)
        assert [(r.getMessage(), r.levelno) for r in seen] == [(closing, logging.DEBUG)]
    finally:
        relay.removeHandler(handler)
        relay.setLevel(level)
