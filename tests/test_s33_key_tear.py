"""A key file caught mid-write removes no key (auth.KeyFile reads a change only once it is stable), and the deadline
book's JSON is one pass over the clients (DeadlineBook.json was quadratic)."""

from __future__ import annotations

import logging
import os
import time

import pytest
from test_s33_key_reload_review import _write

from petals_chain.orchestrator import auth, deadlines
from petals_chain.orchestrator.deadlines import DeadlineBook, RequestDeadline

OLD_NS = 1_000_000_000 * 1_000_000_000  # a modification time long past (2001): settled
LINES = [f"user{i} {'k' * 12}{i:08d} max_concurrent=4\n" for i in range(6)]
NAMES = {f"user{i}" for i in range(6)}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _names(keys: auth.KeyFile) -> set[str]:
    return {k.name for k in keys._ring.keys}


def _listen(keys: auth.KeyFile) -> list[tuple[set, set, set]]:
    calls: list[tuple[set, set, set]] = []
    keys.listeners.append(lambda added, removed, changed: calls.append((added, removed, changed)))
    return calls


def test_a_rewrite_in_place_caught_between_its_writes_removes_no_key(tmp_path, caplog):
    """``cat new > keys``: truncated, the first lines written, and the poll comes before the rest. The old code read
    the two lines and removed the four other names for a poll (401s, their sessions closed, their state forgotten).
    Now the poll waits for the file to settle, sees it changed meanwhile, and reads it at the next poll."""
    path = _write(tmp_path / "keys", "".join(LINES))
    waits: list[float] = []
    writer = {"f": None}

    def sleep(seconds: float) -> None:  # the writer goes on while the poll waits
        waits.append(seconds)
        if writer["f"] is not None:
            writer["f"].writelines(LINES[2:])
            writer["f"].close()
            writer["f"] = None

    keys = auth.KeyFile(path, reload_s=1.0, clock=Clock(), sleep=sleep)
    calls = _listen(keys)
    with caplog.at_level(logging.INFO, logger=auth.__name__):
        writer["f"] = open(path, "w")  # truncates, as the shell's '>' does
        writer["f"].writelines(LINES[:2])
        writer["f"].flush()
        assert not keys.poll()
        assert _names(keys) == NAMES and calls == []  # nothing removed, not even for a poll
        assert len(waits) == 1 and 0 < waits[0] <= auth.SETTLE_S
        assert not keys.poll()  # the whole new version: the same keys
        assert _names(keys) == NAMES and calls == []
        # a real edit done the same way is loaded at the poll after its last write (here: the next one)
        with open(path, "w") as f:
            f.writelines(LINES[:5])
        assert keys.poll()
    assert calls == [(set(), {"user5"}, set())] and _names(keys) == NAMES - {"user5"}
    assert keys.failures == 0 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_file_written_while_it_is_read_is_read_again_at_the_next_poll(tmp_path, monkeypatch, caplog):
    """The stat before and after the read differ: the text read may be torn (cut at a line boundary, or inside a
    UTF-8 character); it is neither loaded nor reported as an error, and the file is read again at the next poll.
    The file's times are old (a copy keeping them), so no settle wait: the stat after the read is what catches it."""
    full = "".join(LINES).encode()
    path = _write(tmp_path / "keys", full.decode(), mtime_ns=OLD_NS)
    keys = auth.KeyFile(path, reload_s=1.0, clock=Clock())
    calls = _listen(keys)
    real_read = auth._read_key_text
    seen_by_the_read: list[bytes] = []

    def read_while_written(p):
        if not seen_by_the_read:
            return real_read(p)
        path.write_bytes(seen_by_the_read.pop())
        try:
            return real_read(p)
        finally:  # the writer finishes as the read ends
            path.write_bytes(full)
            os.utime(path, ns=(OLD_NS + 9 * 10**9,) * 2)

    monkeypatch.setattr(auth, "_read_key_text", read_while_written)
    half = "".join(LINES[:2]).encode()
    with caplog.at_level(logging.INFO, logger=auth.__name__):
        for k, torn in enumerate((half, half + "user2 \u00e9".encode()[:-1])):  # a line boundary; a character
            _write(path, half.decode(), mtime_ns=OLD_NS + (k + 1) * 10**9)  # the rewrite has begun
            seen_by_the_read.append(torn)
            keys.poll()
            assert _names(keys) == NAMES and calls == [], k
            assert not keys.poll()  # read again: the finished file, the same keys
    assert _names(keys) == NAMES and calls == [] and keys.failures == 0
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_settled_edit_is_read_without_waiting_and_a_clock_skew_costs_one_wait(tmp_path):
    waits: list[float] = []
    path = _write(tmp_path / "keys", "".join(LINES), mtime_ns=OLD_NS)
    keys = auth.KeyFile(path, reload_s=1.0, clock=Clock(), sleep=waits.append)
    _write(path, "".join(LINES[:3]), mtime_ns=OLD_NS + 10**9)  # modified long ago (copied with its time)
    assert keys.poll() and _names(keys) == {"user0", "user1", "user2"} and waits == []
    # a network file system whose clock is an hour ahead: its times are always "recent"; one wait, not the skew
    ahead = time.time_ns() + 3600 * 10**9
    _write(path, "".join(LINES), mtime_ns=ahead)
    assert keys.poll() and _names(keys) == NAMES and waits == [auth.SETTLE_S]
    assert not keys.poll() and waits == [auth.SETTLE_S]  # the same version read again (racy): no second wait
    with pytest.raises(ValueError, match="settle_s"):
        auth.KeyFile(path, settle_s=-1.0)


def test_a_file_that_keeps_changing_is_not_loaded_until_it_stops(tmp_path):
    path = _write(tmp_path / "keys", "".join(LINES))
    grow = [LINES[2:3], LINES[3:4], []]  # one line more at each wait, then quiet

    def sleep(seconds: float) -> None:
        if grow and grow[0]:
            with open(path, "a") as f:
                f.writelines(grow[0])
        grow.pop(0)

    keys = auth.KeyFile(path, reload_s=1.0, clock=Clock(), sleep=sleep)
    calls = _listen(keys)
    _write(path, "".join(LINES[:2]))
    assert not keys.poll() and not keys.poll()  # changed during each wait: nothing read
    assert _names(keys) == NAMES and calls == []
    assert keys.poll()  # quiet through its wait: loaded (the two last names were really removed)
    assert calls == [(set(), {"user4", "user5"}, set())]


# ---- DeadlineBook.json: one pass ------------------------------------------------------------------------------------

def _book(n: int, now: float) -> DeadlineBook:
    book = DeadlineBook(window_s=60.0)
    for i in range(n):
        for j in range(i % 4):  # client i: i % 4 requests, on time unless j == 2, one of them out of the window
            dl = RequestDeadline.from_ms(f"c{i:04d}", 5000, None, arrival=now - 70 + 30 * j)
            dl.first_token(dl.arrival + 1)
            book.settle(dl, now=dl.arrival + (9 if j == 2 else 2))
    return book


def test_the_deadline_books_json_is_one_pass_with_the_same_values(monkeypatch):
    now = 1000.0
    book = _book(300, now)
    book.forget("c0003")  # a forgotten client: its on-time completions of the window stay in the total
    calls = []
    real_trim = deadlines._trim
    monkeypatch.setattr(deadlines, "_trim", lambda times, cutoff: (calls.append(1), real_trim(times, cutoff)))
    js = book.json(now=now)
    assert len(calls) <= 300 + 1  # every list trimmed once (the old code: 300 x 301)
    # the values, from the definition: completions after now - 60 s, per second
    per = {i % 4: sum(1 for j in range(i % 4) if j != 2 and now - 70 + 30 * j + 2 >= now - 60) for i in range(4)}
    for i in range(300):
        name = f"c{i:04d}"
        if name == "c0003" or i % 4 == 0:  # forgotten; never decided
            assert name not in js["clients"]
            continue
        c = js["clients"][name]
        assert c["goodput_per_s"] == per[i % 4] / 60.0, name
        decided = i % 4
        assert c["met"] == decided - (decided == 3) and c["missed"] == (decided == 3)
        assert c["attainment"] == (c["met"] / decided if decided else None)
    total_in_window = sum(per[i % 4] for i in range(300))  # the forgotten client's included
    assert per == {0: 0, 1: 0, 2: 1, 3: 1} and total_in_window == 150
    assert js["goodput_per_s"] == total_in_window / 60.0 == book.goodput(now)
    assert js["met"] == sum(i % 4 - (i % 4 == 3) for i in range(300)) and js["missed"] == 75
    assert book.goodput(now, "c0002") == per[2] / 60.0
    assert book.goodput(now, "nobody") == 0.0 and "nobody" not in book.json(now=now)["clients"]
    later = book.json(now=now + 61.0)  # everything left the window; the forgotten client's lists are dropped
    assert later["goodput_per_s"] == 0.0 and book._former_met == []
