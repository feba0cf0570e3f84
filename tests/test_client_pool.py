"""The Python client's connection pool under many threads (no swarm needed).

httpcore 1.0.9 (encode/httpcore#1110) hands an idle connection to a waiting request and, before that request's
thread starts on it, may close it in another thread's pass: as a keep-alive surplus, or to make room under the
connection cap. The request is then cut ("ReadError: [Errno 9] Bad file descriptor", or a hang until the read
timeout): a CI run's burst through one Client, more threads than the keep-alive cap, lost a request, most likely
so. The race cannot be timed through the public API, so these tests drive the pool's assignment pass the way the
losing interleaving does.
"""

from __future__ import annotations

import httpcore
import pytest

from petals_chain.client import Client

URL = "http://127.0.0.1:9"  # never connected to: the pool's bookkeeping alone is exercised


class IdleConnection:
    """A kept-alive connection to ``URL`` that nobody uses at the moment (what the pool sees between a request
    being handed it and that request's thread starting on it)."""

    def __init__(self) -> None:
        self.closed = False

    def can_handle_request(self, origin) -> bool:
        return True

    def is_available(self) -> bool:
        return not self.closed

    def has_expired(self) -> bool:
        return False

    def is_idle(self) -> bool:
        return not self.closed

    def is_closed(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _pool(client: Client):
    return client._https[0]._transport._pool


def _request():
    from httpcore._sync.connection_pool import PoolRequest

    return PoolRequest(httpcore.Request("POST", URL + "/v1/completions"))


@pytest.mark.parametrize("threads", [25, 120])
def test_a_connection_handed_to_a_waiting_request_is_not_closed_by_another_pass(threads):
    client = Client(URL)
    try:
        pool = _pool(client)
        conns = [IdleConnection() for _ in range(threads)]
        waiting = _request()
        waiting.assign_to_connection(conns[0])  # handed over; its thread has not started on it yet
        pool._connections = list(conns)
        pool._requests = [waiting]
        closing = pool._assign_requests_to_connections()  # another thread's pass (a response it finished)
        assert closing == [] and waiting.connection is conns[0]

        newcomer = _request()  # one more thread's request, every connection idle or spoken for
        pool._requests.append(newcomer)
        closing = pool._assign_requests_to_connections()
        assert conns[0] not in closing, "the pool closed a connection a waiting request was handed"
    finally:
        _pool(client)._connections, _pool(client)._requests = [], []
        client.close()
