"""Clocks: durations on the monotonic clock, and records timed so that a host whose wall clock is wrong, or steps,
neither lingers nor is ignored for as long as its clock is off."""

from __future__ import annotations

import asyncio
import logging
import time
import types

import pytest

from petals_chain.swarm.records import ServerRecord


# ---------------------------------------------------------------- dashboard: the age of its last DHT read

class _FakeDht:
    def fetch_servers(self, prefix: str) -> dict:
        return {}

    def fetch_summary(self, prefix: str, trusted) -> None:
        return None


def test_the_dashboard_age_of_its_last_read_ignores_clock_steps(monkeypatch):
    """The age of the last successful DHT read was measured on the wall clock: stepped forward 10 min, a dashboard
    reading fine showed 'stale, 600 s old' and /health failed; stepped back, the age was -600 s and a dashboard whose
    reads then failed reported itself healthy for 10 min."""
    from petals_chain.dashboard.source import DhtSwarmSource

    source = DhtSwarmSource(_FakeDht(), "pa", trusted=["QmOrch"])
    source.refresh()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600.0)  # an NTP step forward
    assert "stale_s" not in source.view()
    ok, body = source.health()
    assert ok and 0 <= body["last_dht_read_age_s"] < 60
    monkeypatch.setattr(time, "time", lambda: real() - 600.0)  # and back
    ok, body = source.health()
    assert ok and 0 <= body["last_dht_read_age_s"] < 60
    source._last_ok -= 120  # its reads have failed for two minutes: stale, whatever the wall clock says
    assert not source.health()[0] and source.view()["stale_s"] >= 120


# ---------------------------------------------------------------- DHT records of a writer whose clock is ahead

def _booked(book) -> int:
    """Entries in the book's tables (whatever they are called)."""
    return sum(len(v) for v in vars(book).values() if isinstance(v, dict))


def test_a_record_lives_its_writers_ttl_after_it_is_first_read(caplog):
    """Unit: the writer's TTL (expiration - timestamp, both its clock) from the first read, never less than with
    right clocks; a writer stamping records in the future is named once, with its skew."""
    from petals_chain.swarm.dht import MAX_RECORD_TTL_S, RecordLifetimes

    book = RecordLifetimes()
    wall, mono = 1_000_000.0, 50.0
    # right clocks: published 3 s ago with a 15 s TTL: live until its expiration and past it only by the read lag
    assert book.live("QmA", wall - 3, wall + 12, wall=wall, mono=mono)
    assert book.live("QmA", wall - 3, wall + 12, wall=wall + 11.9, mono=mono + 11.9)
    with caplog.at_level(logging.WARNING, logger="petals_chain.swarm.dht"):
        # 600 s ahead: alive 15 s from the first read, not 615
        assert book.live("QmB", wall + 600, wall + 615, wall=wall, mono=mono)
        assert book.live("QmB", wall + 600, wall + 615, wall=wall + 14, mono=mono + 14)
        assert not book.live("QmB", wall + 600, wall + 615, wall=wall + 16, mono=mono + 16)
        # its next publish is a new record: live again
        assert book.live("QmB", wall + 620, wall + 635, wall=wall + 20, mono=mono + 20)
    said = [r.getMessage() for r in caplog.records if "QmB" in r.getMessage()]
    assert len(said) == 1 and "at least 600 s ahead" in said[0]
    assert book.live("QmC", None, wall + 10, wall=wall, mono=mono)  # no timestamp: its expiration alone
    assert not book.live("QmC", wall + 10, wall + 5, wall=wall, mono=mono)  # expires before it was stamped
    # bounded: writers whose last record ended long ago are dropped from the book (a new writer every 2 s, each
    # record living 1 s; kept MAX_RECORD_TTL_S past its end, so that a stale copy of it is not read as new)
    step = 2 * MAX_RECORD_TTL_S / book.PRUNE_AT
    for i in range(3 * book.PRUNE_AT):
        book.live(f"Qm{i}", wall + step * i, wall + step * i + 1, wall=wall + step * i, mono=mono + step * i)
    assert _booked(book) <= book.PRUNE_AT + 1


def test_a_dead_server_whose_clock_ran_ahead_leaves_with_its_ttl(monkeypatch):
    """A server whose clock ran 10 min ahead published records expiring 10 min late (hivemind sets the expiration by
    the writer's clock): once it stopped, orchestrators and dashboards listed it for 10 more minutes. Now it is gone
    its TTL after it was first read."""
    import petals_chain.swarm.dht as dht_mod

    sd = dht_mod.SwarmDHT.create(prefix="clk")
    try:
        real = dht_mod.get_dht_time
        skew = 600.0
        monkeypatch.setattr(dht_mod, "get_dht_time", lambda: real() + skew)  # the writer's clock, 10 min ahead
        rec = ServerRecord(peer_id=sd.peer_id, state="online", memory_bytes=2**30, tau_p=0.01, start_block=0,
                           num_blocks=4, slots_total=8, slots_free=5, public_name="ahead", max_length=256,
                           timestamp=time.time() + skew)
        assert sd.publish_server("clk", rec, expiration_s=2.0)
        monkeypatch.setattr(dht_mod, "get_dht_time", real)  # (read with the right clock)
        assert sd.peer_id in sd.fetch_servers("clk")  # live: read at once
        deadline = time.monotonic() + 20.0
        while sd.peer_id in sd.fetch_servers("clk") and time.monotonic() < deadline:
            time.sleep(0.25)
        assert sd.peer_id not in sd.fetch_servers("clk"), "the record of a writer 600 s ahead stayed for 600 s"
    finally:
        sd.shutdown()


# ---------------------------------------------------------------- a server following placements

def _placement_server(records: list):
    """A Server with two models (model-a served), whose placement fetch returns ``records[-1]``."""
    from petals_chain.server.server import Server

    a, b = (types.SimpleNamespace(prefix=p, hidden_size=64, fingerprint=p) for p in ("model-a", "model-b"))

    async def fetch(prefixes, trusted, peer_id):
        return records[-1]

    async def unload():
        pass

    s = object.__new__(Server)
    s.hosted, s.active, s.trusted, s._misplaced, s.placement_timestamp, s.switches = [a, b], a, {"QmOrch"}, set(), \
        0.0, 0
    s.state, s.span, s.announcer, s._stop = "online", None, None, asyncio.Event()
    s.epoch, s.assignment_timestamp, s._applied_content = -1, 0.0, ()
    s._failed_load, s._failed_loads, s.load_failure = None, 0, None
    s.service = types.SimpleNamespace(hidden_size=64, model_fingerprint="model-a")
    s.sd = types.SimpleNamespace(peer_id="me", afetch_placement=fetch)
    s._unload = unload
    return s, a, b


def _placement(epoch: int, ts: float, model: str, orch: str = "QmOrch"):
    return types.SimpleNamespace(orchestrator_peer_id=orch, epoch=epoch, timestamp=ts, placement={"me": model})


def test_a_restarted_orchestrators_old_placement_does_not_move_the_server_back():
    """An orchestrator counts its placement epochs from 0 at each start (its peer id stays, with --identity-path).
    Following a higher epoch of the same orchestrator whatever its timestamp, a server placed by the new run went
    back to what the last run had said (its record still read under a model the new run does not serve, or from a
    node that missed a store): a drain and a reload of the wrong model, then another back."""
    records: list = []
    s, a, b = _placement_server(records)

    async def main():
        records.append(_placement(7, 1000.0, "model-b"))  # the last run, at its epoch 7
        await s.follow_placement()
        assert s.active is b
        records.append(_placement(0, 1100.0, "model-a"))  # restarted: epoch 0, later
        await s.follow_placement()
        assert s.active is a
        records.append(_placement(7, 1000.0, "model-b"))  # the last run's record read again
        await s.follow_placement()
        assert s.active is a, "the dead run's placement moved the server back"
        records.append(_placement(1, 1200.0, "model-b"))  # the new run's next move
        await s.follow_placement()
        assert s.active is b
        records.append(_placement(9, 900.0, "model-a", orch="QmOther"))  # another orchestrator's older record
        await s.follow_placement()
        assert s.active is b

    asyncio.run(main())
    assert s.switches == 3


def test_dht_nodes_refuse_a_stepped_back_writers_record_while_they_hold_its_later_one():
    """Why a server needs no epoch rule for an orchestrator whose clock stepped back: its records carry the same TTL,
    so the one stamped earlier also expires earlier, and a DHT node keeps the later expiration of a subkey (this is
    hivemind's storage, which the server's rule relied on)."""
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.dht.routing import DHTID

    store, key, ttl = DHTLocalStorage(), DHTID.generate("clk.placement"), 60.0
    now = time.time()
    assert store.store_subkey(key, b"QmOrch", b"epoch 3", now + ttl)  # stamped now
    assert not store.store_subkey(key, b"QmOrch", b"epoch 4", now - 600 + 5 + ttl)  # clock 10 min back, 5 s on
    assert store.get(key).value.get(b"QmOrch").value == b"epoch 3"


# ---------------------------------------------------------------- the orchestrator's uptime

def test_the_orchestrators_uptime_is_not_moved_by_a_clock_step(monkeypatch, tiny_model_factory):
    """``/healthz``'s uptime_s was ``time.time() - started_at``: negative after an NTP step back."""
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=64,
                                           port=0))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 600.0)
    assert 0 <= orch.uptime_s < 60
    monkeypatch.setattr(time, "time", lambda: real() + 600.0)
    assert 0 <= orch.uptime_s < 60


# ---------------------------------------------------------------- the book of record lifetimes

def test_the_book_of_record_lifetimes_holds_a_few_records_per_key_and_writer():
    """The book held one entry per record read ((writer, timestamp, expiration)) until its TTL ended: a peer stamping
    its records 0.0 (a valid float; the reader refuses them only after booking them) and republishing added one entry
    at every read, none ever pruned (12,288 reads: over 12,000 entries). Now a few per DHT key and writer."""
    from petals_chain.swarm.dht import RecordLifetimes

    book, wall, mono = RecordLifetimes(), 1_000_000.0, 50.0
    for i in range(3 * book.PRUNE_AT):
        book.live("QmEvil", 0.0, wall + i + 60, wall=wall + i, mono=mono + i)
        book.live("QmServer", wall + i, wall + i + 15, wall=wall + i, mono=mono + i)
    assert _booked(book) == 2
    assert len(book) <= 2 * book.PER_WRITER
    # the same writer under another key (a placement stored under each model's prefix) is booked apart
    assert book.live("QmServer", wall, wall + 15, where="other.placement", wall=wall, mono=mono)
    assert _booked(book) == 3


def test_a_copy_read_again_keeps_its_first_read():
    """A node that missed the writer's last store answers with its previous record: read again, it is not taken for
    a new one (which would live one more TTL)."""
    from petals_chain.swarm.dht import RecordLifetimes

    book, wall, mono = RecordLifetimes(), 1_000_000.0, 50.0
    assert book.live("QmS", wall + 600, wall + 615, wall=wall, mono=mono)  # ahead 600 s
    assert book.live("QmS", wall + 605, wall + 620, wall=wall + 5, mono=mono + 5)  # its next publish
    assert book.live("QmS", wall + 600, wall + 615, wall=wall + 14, mono=mono + 14)  # the older copy
    assert not book.live("QmS", wall + 600, wall + 615, wall=wall + 21, mono=mono + 21)
    assert book.live("QmS", wall + 605, wall + 620, wall=wall + 19, mono=mono + 19)  # (first read at 5)
    assert not book.live("QmS", wall + 605, wall + 620, wall=wall + 21, mono=mono + 21)


def test_a_live_writer_republishing_every_third_of_its_ttl_never_drops_out():
    """Servers republish every ttl/3 (each a new record); the reader sees the newest, at times the one before, and
    after the writer's clock stepped back 12 s, records stamped before those it read already: each is live its TTL
    from when it was first read."""
    from petals_chain.swarm.dht import RecordLifetimes

    book, wall, mono, ttl = RecordLifetimes(), 1_000_000.0, 50.0, 15.0
    for t in range(0, 600):
        newest = wall + ttl / 3 * (t // 5) + 600 - (12 if t >= 300 else 0)  # 600 s ahead, then 588; every 5 s
        stamp = newest - ttl / 3 if t % 7 == 3 and t >= 5 else newest  # now and then a node answers the one before
        assert book.live("QmS", stamp, stamp + ttl, wall=wall + t, mono=mono + t), t


# ---------------------------------------------------------------- the dashboard: "last seen" on its own clock

class _RecordsDht(_FakeDht):
    def __init__(self):
        self.records: dict = {}
        self.summary = None

    def fetch_servers(self, prefix: str) -> dict:
        return dict(self.records)

    def fetch_summary(self, prefix: str, trusted) -> None:
        return self.summary


def _record(peer: str, ts: float) -> ServerRecord:
    return ServerRecord(peer_id=peer, state="online", memory_bytes=2**30, tau_p=0.01, start_block=0, num_blocks=4,
                        slots_total=8, slots_free=5, public_name=peer, max_length=256, timestamp=ts)


def test_the_dashboard_says_when_it_read_a_servers_record_not_what_its_clock_said(monkeypatch):
    """``last_seen`` was the record's timestamp (its server's clock): a live server whose clock ran 10 min behind read
    "10 min ago" on every poll. Now it is when this dashboard first read that record (its clock, as updated_at)."""
    from petals_chain.dashboard.source import DhtSwarmSource

    dht = _RecordsDht()
    source = DhtSwarmSource(dht, "pa", trusted=[])
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    dht.records = {"QmBehind": _record("QmBehind", clock[0] - 600), "QmRight": _record("QmRight", clock[0])}
    source.refresh()
    view = source.view()
    seen = {s["peer_id"]: s["last_seen"] for s in view["servers"]}
    assert seen == {"QmBehind": clock[0], "QmRight": clock[0]} and view["updated_at"] == clock[0]
    clock[0] += 4  # read again: QmRight published meanwhile, QmBehind did not
    dht.records["QmRight"] = _record("QmRight", clock[0])
    source.refresh()
    view = source.view()
    seen = {s["peer_id"]: s["last_seen"] for s in view["servers"]}
    assert seen == {"QmBehind": clock[0] - 4, "QmRight": clock[0]} and view["updated_at"] == clock[0]
    del dht.records["QmBehind"]
    source.refresh()
    assert "QmBehind" not in source._seen["pa"]  # (forgotten with its record)


def test_a_server_only_the_summary_lists_keeps_its_age_on_the_dashboards_clock(monkeypatch):
    """A server whose record expired is listed from the summary with the orchestrator's last_seen (its clock): read
    against the dashboard's updated_at, it was off by the skew of the two hosts. Moved by the summary's updated_at."""
    from petals_chain.dashboard.source import DhtSwarmSource

    dht = _RecordsDht()
    dht.summary = {"updated_at": 5000.0, "servers": [{"peer_id": "QmGone", "last_seen": 4970.0},
                                                     {"peer_id": "QmOld"}]}
    monkeypatch.setattr(time, "time", lambda: 9000.0)  # the dashboard's clock, 4000 s ahead of the orchestrator's
    source = DhtSwarmSource(dht, "pa", trusted=["QmOrch"])
    source.refresh()
    by = {s["peer_id"]: s for s in source.view()["servers"]}
    assert by["QmGone"]["last_seen"] == 8970.0 and by["QmGone"]["state"] == "offline"
    assert by["QmOld"]["last_seen"] is None


def test_the_page_measures_last_seen_from_the_views_updated_at():
    """The page showed browser-now minus last_seen: with a viewer's (or the view's writer's) clock 1 h off, every live
    server read "1.0 h ago". Now measured from the view's updated_at (both on the writer's clock)."""
    from dashboard_helpers import browser_skip_reason, chromium_page, sample_swarm, serve_app
    from fastapi import FastAPI

    from petals_chain.dashboard import mount_dashboard

    if browser_skip_reason() is not None:
        pytest.skip(browser_skip_reason())
    view = sample_swarm(now=time.time() - 3600)  # its writer's clock 1 h behind this browser's
    view["servers"][0]["last_seen"] = view["updated_at"] - 30
    app = FastAPI()
    app.get("/api/v1/swarm")(lambda: view)
    mount_dashboard(app)
    with serve_app(app) as url, chromium_page() as (page, errors):
        page.goto(f"{url}/?refresh=0")
        cell = '#servers-table tr[data-peer-id="{}"] td[data-label="last seen"]'
        page.wait_for_selector(cell.format(view["servers"][0]["peer_id"]), timeout=60_000)
        assert page.locator(cell.format(view["servers"][0]["peer_id"])).inner_text() == "30 s ago"
        assert page.locator(cell.format(view["servers"][1]["peer_id"])).inner_text() == "2 s ago"
        assert not errors


# ---------------------------------------------------------------- the screenshot tool's waits

def test_the_screenshot_tools_wait_for_a_busy_swarm_ignores_clock_steps(monkeypatch):
    """``_wait_busy`` timed its 30 s on the wall clock: an NTP step forward ended it before its first poll (the
    screenshot then showed an idle swarm); a step back stretched it."""
    import httpx

    from petals_chain.dashboard import screenshot

    polls = []

    def get(url, timeout):
        polls.append(url)
        return types.SimpleNamespace(json=lambda: {"chains": [{"active": int(len(polls) >= 3)}], "queue_length": 0})

    wall = iter(range(0, 10**9, 3600))  # every reading of the wall clock an hour on
    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(screenshot.time, "time", lambda: float(next(wall)))
    monkeypatch.setattr(screenshot.time, "sleep", lambda s: None)
    screenshot._wait_busy("http://127.0.0.1:1", timeout_s=30)
    assert len(polls) == 3


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
