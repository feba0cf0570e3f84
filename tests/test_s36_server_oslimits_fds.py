"""A server near its open-files limit (``ulimit -n``): opens are refused ``no_capacity`` while fewer than
``DESCRIPTOR_RESERVE`` descriptors are left (at ``ulimit -n 128``, 150 concurrent requests hung until their clients
gave up: past the limit no stream could be accepted, none was refused), and the record announces no more slots
than the limit holds sessions (it announced 800 at ``ulimit -n 128``)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from petals_chain.server import admission
from petals_chain.server.announce import build_record
from petals_chain.server.sessions import SessionService
from petals_chain.swarm.emulation import Emulation
from petals_chain.swarm.rpc import RefusedError


class _Counter:
    """Fake open descriptors under a fake limit."""

    def __init__(self, in_use: int, limit: int | None):
        self.in_use, self.limit = in_use, limit


def _descriptors(c: _Counter, **kw):
    return admission.Descriptors(in_use=lambda: c.in_use, limit=lambda: c.limit, **kw)


class _Runner:
    start_block, end_block, max_length = 0, 4, 256
    slots_total, slots_free = 800, 800
    cache_tokens_total = cache_tokens_free = 800 * 256
    page_size, prefix_cache, prefix_offered_tokens, prefix_reused_tokens, kv_cache = 16, True, 0, 0, "paged"

    def __init__(self):
        self.allocated: list[str] = []

    def allocate(self, session_id, start, end, *, max_tokens, prefix_hashes=()):
        self.allocated.append(session_id)
        return 0

    def release(self, session_id, prefix_hashes=()):
        self.allocated.remove(session_id)


def _service(c: _Counter) -> SessionService:
    svc = SessionService(hidden_size=8, trusted={"orch"}, allow_any_client=False, state=lambda: "online",
                         on_change=lambda: None, describe=dict, descriptors=_descriptors(c))
    svc.runner = _Runner()
    return svc


def test_an_open_near_the_open_files_limit_is_refused_no_capacity_and_served_once_they_free_up(caplog):
    c = _Counter(in_use=128 - admission.DESCRIPTOR_RESERVE, limit=128)
    svc = _service(c)
    with caplog.at_level(logging.WARNING, logger="petals_chain.server"):
        for i in range(50):  # a storm: refused at once, each with a reply, one log line
            with pytest.raises(RefusedError) as e:
                svc.open_session(f"s{i}", 0, 4, 256, "orch")
            assert e.value.code == "no_capacity" and "ulimit -n" in str(e.value), e.value
            assert "of its limit of 128" in str(e.value)
    assert len([r for r in caplog.records if "descriptors" in r.getMessage()]) == 1
    assert svc.runner.allocated == [] and svc.descriptors.refused == 50

    async def wait_open():  # an open that would wait for slots holds its stream's descriptor too: refused, not queued
        with pytest.raises(RefusedError) as e:
            await svc.open_session_wait("w", 0, 4, 256, "orch", wait_s=5.0)
        assert e.value.code == "no_capacity" and len(svc.admission) == 0

    asyncio.run(wait_open())
    c.in_use -= 1  # one descriptor freed up: the next open is served
    assert svc.open_session("s", 0, 4, 256, "orch")["start_block"] == 0 and svc.runner.allocated == ["s"]


def test_sessions_past_what_the_limit_holds_are_refused_before_their_later_streams_run_it_out():
    """A push relay's streams come after the open: the sessions open or waiting are capped, not only the descriptors
    in use at the open (at ulimit -n 128 the pushes then failed with EMFILE and a server was declared failed)."""
    svc = _service(_Counter(in_use=20, limit=128))
    total = svc.descriptors.sessions_total()
    for i in range(total):
        svc.open_session(f"s{i}", 0, 4, 256, "orch")
    with pytest.raises(RefusedError) as e:
        svc.open_session("one-more", 0, 4, 256, "orch")
    assert e.value.code == "no_capacity" and f"{total} sessions open or waiting" in str(e.value)
    svc.close_session("s0")
    svc.open_session("one-more", 0, 4, 256, "orch")


def test_no_limit_known_refuses_nothing():
    svc = _service(_Counter(in_use=10**6, limit=None))
    svc.open_session("s", 0, 4, 256, "orch")
    assert svc.descriptors.sessions_free() is None and svc.descriptors.sessions_total() is None


def _record(c: _Counter, runner: _Runner):
    return _record_of(SimpleNamespace(descriptors=_descriptors(c), stranger_slots_free=lambda: runner.slots_free,
                                      runner=runner))


def _record_of(svc):
    """The record of a server serving ``svc.runner`` through ``svc``."""
    runner = svc.runner
    cfg = SimpleNamespace(device="cpu", quant="none", public_name="a", max_blocks=0, kv_cache="paged", page_size=16,
                          cache_tokens_per_block=0)
    src = SimpleNamespace(runner=runner, span=(0, 4), cfg=cfg, service=svc, state="online",
                          memory=SimpleNamespace(memory_bytes=10**8, s_m=10**6, s_c=lambda n: 10**4),
                          emulation=Emulation(), tau_p=0.01, dtype_name="float32", max_length=256, epoch=1,
                          model_fingerprint="f", maddrs=[], reachability="direct")
    return build_record(src, "peer")


def test_the_record_announces_no_more_slots_than_the_open_files_limit_holds():
    runner = _Runner()
    per, idle, reserve = admission.DESCRIPTORS_PER_SESSION, admission.DESCRIPTORS_IDLE, admission.DESCRIPTOR_RESERVE
    rec = _record(_Counter(in_use=20, limit=128), runner)
    total = (128 - idle - reserve) // per
    assert rec.slots_total == total < 800 and rec.cache_tokens_total == total * 256
    assert rec.slots_free == min(total, (128 - reserve - 20) // per) and rec.stranger_slots_free <= rec.slots_free
    rec = _record(_Counter(in_use=128, limit=128), runner)  # at its limit: nothing free, capacity unchanged
    assert (rec.slots_total, rec.slots_free, rec.cache_tokens_free) == (total, 0, 0)
    rec = _record(_Counter(in_use=20, limit=1 << 16), runner)  # a limit that holds them all: as the runner says
    assert (rec.slots_total, rec.slots_free, rec.cache_tokens_total) == (800, 800, 800 * 256)


_CHILD = textwrap.dedent("""
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    from test_s36_server_oslimits_fds import _Runner, _record_of
    from petals_chain.server.sessions import SessionService
    from petals_chain.swarm.rpc import RefusedError
    svc = SessionService(hidden_size=8, trusted={"orch"}, allow_any_client=False, state=lambda: "online",
                         on_change=lambda: None, describe=dict)
    svc.runner = _Runner()
    print("slots_total", _record_of(svc).slots_total)
    held = []
    try:
        while True:  # the streams of sessions that took every descriptor
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(8):  # 8 left to the process: fewer than it needs for its own work
        os.close(held.pop())
    try:
        svc.open_session("s1", 0, 4, 256, "orch")
        print("opened")
    except RefusedError as e:
        print("refused", e.code)
    for _ in range(64):
        os.close(held.pop())
    svc.open_session("s2", 0, 4, 256, "orch")
    print("opened", svc.runner.allocated)
""")


def test_a_server_at_ulimit_n_128_refuses_opens_near_it_and_announces_what_it_holds():
    """A child process at ``ulimit -n 128`` with the real counter: an open with 8 descriptors left is refused
    ``no_capacity`` (it was allocated: the next streams could not even be accepted), one with 72 left is served, and
    the record announces fewer slots than the 800 of its KV pool."""
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parent.parent))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    total = int(lines[0].split()[1])
    assert 0 < total < 800, lines
    assert lines[1:] == ["refused no_capacity", "opened ['s2']"], lines
