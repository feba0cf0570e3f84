"""What the thirty-sixth session left in deadlines and their metrics.

* A cut forwarded stream's rerun refused 429 ``deadline_unreachable`` (the target's load dooms it now) while time was
  left ended the stream with that 429, a refusal inviting a retry of a stream the client cannot resume. It is tried
  again, as a job that lost its chain here waits for another: finished if the load clears in time, else the 504
  ``deadline_exceeded`` of a late rerun (as ``deadline_infeasible`` and a rerun past the deadline read).
* A job re-queued after it started (its chain lost) that gave up waiting was left out of
  ``petals_chain_client_wait_seconds`` altogether (session 36 stopped counting it as one more job that gave up, and
  its wait went with it): its wait is observed, and ``gave_up`` still counts only jobs that never started."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client import CollectorRegistry
from test_resume import DONE, cmpl, feed, parsed, record, sse

import petals_chain.orchestrator.resume as rs
from petals_chain.algorithms.fairness import FairPolicy
from petals_chain.orchestrator.errors import Unavailable
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.fairness import ClientShares
from test_s36_deadline_never_ran import make_orch

_CLIENT = httpx.AsyncClient
UNREACHABLE = {"error": {"code": "deadline_unreachable", "message": "the deadline cannot be met: predicted 9000 ms",
                         "type": "rate_limit_error"}}


def _finish(rec, monkeypatch, handler, limit_s: float = 20.0):
    """``finish`` with every rerun sent to ``handler(request, n)``; the events sent, the requests, seconds taken."""
    seen = []

    class Client(_CLIENT):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(lambda req: seen.append(req) or handler(req, len(seen))),
                             **kw)

    monkeypatch.setattr(rs.httpx, "AsyncClient", Client)
    monkeypatch.setattr(rs, "RESUME_PAUSE_S", 0.05)

    async def main():
        return [e async for e in rs.finish(rec, "/v1/completions", {}, lambda refused: ("http://peer:1", False),
                                           lambda u: True, "http://lost")]
    t0 = time.monotonic()
    out = asyncio.run(asyncio.wait_for(main(), limit_s))
    return out, seen, time.monotonic() - t0


def test_a_rerun_refused_unreachable_is_tried_again_and_finishes_once_the_load_clears(monkeypatch):
    rec = record(deadline_ms=10_000)
    first = feed(rec, [cmpl("Hel")])

    def handler(req, n):
        if n <= 2:  # the target's queue dooms it twice, then has room
            return httpx.Response(429, json=UNREACHABLE, headers={"retry-after": "1"})
        return sse(cmpl("Hel"), cmpl("lo", finish="length"), DONE)

    out, seen, _ = _finish(rec, monkeypatch, handler)
    got = parsed(first + out)
    # was: one try, and the stream ended with the 429 deadline_unreachable
    assert got[-1] == "data: [DONE]" and len(seen) == 3, got
    assert "".join(c["text"] for g in got[:-1] for c in g["choices"]) == "Hello" and rec.finished_by


def test_a_rerun_refused_unreachable_until_its_deadline_ends_with_504_deadline_exceeded(monkeypatch):
    rec = record(deadline_ms=600)
    feed(rec, [cmpl("Hel")])
    out, seen, took = _finish(rec, monkeypatch, lambda req, n: httpx.Response(429, json=UNREACHABLE))
    err = parsed(out)[-2]["error"]
    assert (err["status"], err["code"]) == (504, "deadline_exceeded"), err  # was: 429 deadline_unreachable
    assert "deadline_ms passed" in err["message"] and "deadline_unreachable" in err["message"], err
    assert len(seen) > 1 and took < 10.0
    # each rerun carries what is left of the deadline, less each time
    left = [float(json.loads(r.content)["deadline_ms"]) for r in seen]
    assert left == sorted(left, reverse=True) and left[0] <= 600


def test_a_rerun_refused_unreachable_without_a_deadline_of_its_own_passes_the_refusal_on(monkeypatch):
    """Best effort: no deadline applies to the stream here, so nothing bounds the tries: the answer is passed on."""
    rec = record(deadline_ms=5_000, best_effort=True)
    out, seen, _ = _finish(rec, monkeypatch, lambda req, n: httpx.Response(429, json=UNREACHABLE))
    err = parsed(out)[0]["error"]
    assert (err["status"], err["code"]) == (429, "deadline_unreachable") and len(seen) == 1


def test_a_requeued_jobs_wait_before_it_gives_up_is_in_the_client_wait_histogram():
    async def main():
        reg = CollectorRegistry()
        shares = ClientShares(FairPolicy("fcfs"), registry=reg, keyed=True)
        orch = make_orch(shares)
        orch.cfg.queue_timeout_s = 0.3
        orch.dispatch.set_chains([])  # its chain was lost: it waits in the re-queue lane for another
        holder = ChainHolder(orch, "j", 64)
        holder.client, holder.admitted, holder.ran = "c", True, True
        t0 = time.monotonic()
        try:
            await holder._ensure_chain([1, 2, 3], 3)
        except Unavailable:
            pass
        else:
            raise AssertionError("a chain came from nowhere")
        took = time.monotonic() - t0
        count = reg.get_sample_value("petals_chain_client_wait_seconds_count", {"client": "c"})
        total = reg.get_sample_value("petals_chain_client_wait_seconds_sum", {"client": "c"})
        assert count == 1, count  # was: None (no sample at all)
        assert 0.2 < total <= took, (total, took)  # its wait for a chain (--queue-timeout-s 0.3)
        row = shares.json()["clients"]["c"]
        # not one more job that gave up (it was counted as started when it started); its wait is in the mean
        assert (row["started"], row["gave_up"]) == (0, 0) and row["wait_mean_s"] == row["wait_max_s"] == total, row

    asyncio.run(asyncio.wait_for(main(), 20))


def test_waits_that_end_started_or_given_up_keep_their_counts_and_mean():
    shares = ClientShares(FairPolicy("fcfs"), registry=CollectorRegistry(), keyed=True)

    class Job:
        client = "c"

    shares._waited("c", 1.0, started=True)
    shares.abandoned(Job(), 3.0)
    shares.abandoned(Job(), 2.0, gave_up=False)
    row = shares.json()["clients"]["c"]
    assert (row["started"], row["gave_up"], row["wait_max_s"]) == (1, 1, 3.0)
    assert row["wait_mean_s"] == 2.0  # (1 + 3 + 2) / 3 waits, as the histogram's sum / count
