"""An orchestrator the server does not trust hears ``stranger_quota`` as "full for me" (it waits or is preempted),
not as a failed chain (a failover counted, its tokens replayed, the job given up after the failover budget)."""

from petals_chain.orchestrator.relay import HopFailure
from petals_chain.swarm.rpc import NoCapacityError, RemoteError, _raise_if_error

import pytest


@pytest.mark.parametrize("code", ["no_capacity", "stranger_quota"])
def test_a_quota_refusal_reads_as_no_capacity_with_its_code(code):
    with pytest.raises(NoCapacityError) as info:
        _raise_if_error({"ok": False, "code": code, "error": "full"})
    assert info.value.code == code and str(info.value) == "full"
    assert HopFailure("p", info.value, no_capacity=isinstance(info.value, NoCapacityError)).no_capacity
    with pytest.raises(RemoteError) as other:
        _raise_if_error({"ok": False, "code": "invalid", "error": "bad"})
    assert not isinstance(other.value, NoCapacityError)
