"""Two pytest-xdist workers share the machine: the timing scale each measures at its start must foresee the other.

Both workers measure at the same moment, one busy loop a core on two cores, so each saw no contention (slowdown
1.0), then ran its swarms beside the other worker's: every ``scaled(...)`` bound was tuned for a test that had the
machine to itself."""

from __future__ import annotations

import pytest

import conftest


@pytest.fixture
def quiet_host(monkeypatch):
    """The reference workload as fast as on the quiet reference host, nothing forced."""
    monkeypatch.delenv("PETALS_CHAIN_TEST_SLOWDOWN", raising=False)
    monkeypatch.setattr(conftest, "_reference_workload", lambda: (conftest._REFERENCE_CPU_S, conftest._REFERENCE_CPU_S))


def test_each_worker_scales_its_timeouts_by_the_number_of_workers(quiet_host, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert conftest.measure_slowdown.__wrapped__() == 1.0  # one process: the machine is its own
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert conftest.measure_slowdown.__wrapped__() == 2.0  # a test may get half of it
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert conftest.measure_slowdown.__wrapped__() == conftest._MAX_SLOWDOWN  # still capped


def test_a_forced_slowdown_is_taken_as_given(quiet_host, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("PETALS_CHAIN_TEST_SLOWDOWN", "1.5")
    assert conftest.measure_slowdown.__wrapped__() == 1.5
