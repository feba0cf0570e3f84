"""Review of 2606b4f (admission by open descriptors): the record's free slots are those admission takes (it offered
slots its opens were refused), the descriptors are not listed at every open (5 ms an open at 10,000 descriptors, on
the event loop), and ``info`` shows the slots the record announces, with the open-files picture."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from petals_chain.server import admission
from petals_chain.swarm.rpc import RefusedError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_s36_server_oslimits_fds import _Counter, _record_of, _Runner, _service  # noqa: E402


def test_the_record_offers_no_more_free_slots_than_admission_takes():
    """At ``ulimit -n 128`` with 10 sessions open the record said all its slots free: fewer more opens were taken
    (21 of 21 and 11 at 3 descriptors a session; 64 and 54 at 1, the default relay's)."""
    c = _Counter(in_use=20, limit=128)
    svc = _service(c)
    for i in range(10):
        svc.open_session(f"s{i}", 0, 4, 256, "orch")
        c.in_use += 1  # each open session's stream holds a descriptor
    rec = _record_of(svc)
    admitted = 0
    with pytest.raises(RefusedError) as e:
        while True:
            svc.open_session(f"t{admitted}", 0, 4, 256, "orch")
            c.in_use += 1
            admitted += 1
    assert e.value.code == "no_capacity"
    assert rec.slots_total == svc.descriptors.sessions_total() == 64
    assert rec.slots_free == admitted == 54, (rec.slots_free, admitted)
    assert rec.cache_tokens_free == 54 * 256 and _record_of(svc).slots_free == 0


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_descriptors_are_counted_at_most_once_a_second_far_from_the_limit_and_at_every_open_near_it():
    """Each open listed ``/proc/self/fd`` (twice when refused): 10,000 descriptors open, 5 ms of event loop an open.
    Far from the limit the last count is taken again for a second, each session held since counted in full."""
    calls = []
    c = _Counter(in_use=10_000, limit=65_536)
    clock = _Clock()
    d = admission.Descriptors(in_use=lambda: calls.append(1) or c.in_use, limit=lambda: c.limit, clock=clock)
    for sessions in range(200):
        assert d.refusal(sessions) is None
    assert len(calls) == 1 and d.counts == 1
    assert d.free(200) == 65_536 - d.reserve - 10_000 - 200 * d.per_session  # the sessions since: estimated
    clock.t += admission.DESCRIPTOR_COUNT_MAX_AGE_S
    d.refusal(200)
    assert len(calls) == 2  # a second later: counted again
    c.in_use = 60_000  # near the limit: counted at every open, and refused at the reserve
    clock.t += 5.0
    d.refusal(0)
    c.in_use = 65_536 - d.reserve
    assert d.refusal(0) is not None and d.counts == 4
    assert len(calls) == 4  # a refusal counted once, not twice


def test_the_real_count_is_cheap_at_ten_thousand_descriptors(monkeypatch):
    """The real counter under 10,000 open descriptors: 1,000 opens list ``/proc/self/fd`` once, not 1,000 times."""
    import resource

    listed = []
    listdir = os.listdir
    monkeypatch.setattr(admission.os, "listdir", lambda path: listed.append(path) or listdir(path))

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd here")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 20_000:
        pytest.skip(f"hard open-files limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (65_536 if hard == resource.RLIM_INFINITY else min(hard, 65_536),
                                                 hard))
    held: list[int] = []
    try:
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(10_000)]
        d = admission.Descriptors()
        for sessions in range(1_000):
            assert d.refusal(sessions) is None
        assert listed == ["/proc/self/fd"], len(listed)
        assert d.free() is not None and d.free() < d._limit() - 10_000
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_no_descriptor_count_still_caps_sessions_by_the_limit_alike_in_the_record_and_at_admission():
    """Where the platform does not say how many are open, the record's free slots follow the sessions cap that
    admission applies (it announced every slot free up to the cap, whatever was held)."""
    c = _Counter(in_use=None, limit=128)
    svc = _service(c)
    total = svc.descriptors.sessions_total()
    for i in range(total - 2):
        svc.open_session(f"s{i}", 0, 4, 256, "orch")
    assert _record_of(svc).slots_free == 2
    svc.open_session("a", 0, 4, 256, "orch")
    svc.open_session("b", 0, 4, 256, "orch")
    with pytest.raises(RefusedError):
        svc.open_session("c", 0, 4, 256, "orch")


class _PagedRunner(_Runner):
    num_blocks, num_slots = 4, 800
    static_decode = None
    adapter_bytes = 0

    def cache_stats(self) -> dict:
        return {"pages_total": 800}


def test_info_shows_the_slots_the_record_announces_and_the_open_files(tiny_model_dir):
    """``info`` said 800 slots total and free while the record announced 64 (the open-files limit's cap)."""
    from petals_chain.server.server import Server, ServerConfig

    server = Server(ServerConfig(model=str(tiny_model_dir), tau_p=0.01))
    c = _Counter(in_use=20, limit=128)
    server.service.descriptors = admission.Descriptors(in_use=lambda: c.in_use, limit=lambda: c.limit)
    server.service.runner = _PagedRunner()
    info = server.service.info()
    assert (info["slots_total"], info["slots_free"]) == (64, 64), info  # was the runner's (800, 800)
    rec = _record_of(SimpleNamespace(runner=server.service.runner, descriptors=server.service.descriptors,
                                     stranger_slots_free=lambda: 800))
    assert (rec.slots_total, rec.slots_free) == (64, 64)
    assert info["open_files"] == {"limit": 128, "in_use": 20, "sessions_total": 64, "sessions_free": 64,
                                  "refused": 0, "per_session": 1}
