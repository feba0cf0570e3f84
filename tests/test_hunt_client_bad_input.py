"""The Python client: bad arguments are refused where they are given, with a clear error."""

from __future__ import annotations

import math

import httpx
import pytest

from petals_chain.client import Client


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, "10", True])
def test_a_timeout_that_is_not_a_positive_finite_number_is_refused_at_once(timeout):
    """0 failed every request as "no orchestrator could serve" (ConnectError: a connect given no time; with several
    URLs after retry_s of rounds); -1, NaN and infinity raised ValueError or OverflowError from the socket layer at
    the first request; "10" a TypeError there."""
    with pytest.raises(ValueError, match="timeout must be a positive finite number"):
        Client("http://127.0.0.1:9", timeout=timeout)


@pytest.mark.parametrize("timeout", [None, 2.5, 600, httpx.Timeout(5.0, read=None)])
def test_a_timeout_of_seconds_none_or_an_httpx_timeout_is_taken(timeout):
    Client("http://127.0.0.1:9", timeout=timeout).close()
