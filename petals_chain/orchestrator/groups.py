"""Several orchestrators on one swarm: HERD serving groups (seed 003 §4, mapped as docs/scheduling-seeds.md §3.7).

Each orchestrator started with ``--group-with PEER_ID ...`` announces itself under ``{prefix}.groups`` (a short
expiration, republished every third of it) with its HTTP URL and the jobs/s arriving at it. The live orchestrator
of smallest peer id is the *leader*: it splits the servers into one group per live orchestrator by HERD's ILP
(:func:`~petals_chain.algorithms.herd.solve_server_groups`: every group a complete copy of the model where the
servers allow it, then the best worst burst tolerance, then the fewest servers moved; the greedy
:func:`~petals_chain.algorithms.herd.assign_server_groups` as a fallback) and publishes the split in its own entry;
a leader adopts any newer split it reads before it computes its own, so its epochs stay above every one seen (every
entry carries the split its orchestrator follows: a restarted leader continues from it). Every orchestrator plans only
the servers of its group (``Planner.group``) and publishes its assignment for them; a server follows the assignment
that gives it a span (``SwarmDHT.fetch_assignment``). When an orchestrator stops announcing, it is dropped after
``ttl_s`` of silence (no new entry of it read, by this orchestrator's clock), and the leader (a new one if the leader
died) hands its servers to the others: they keep serving.

An orchestrator that stops on purpose (SIGTERM's drain) does not wait for that: :meth:`GroupCoordinator.leave`
replaces its entry with a *leave* (epoch ``EPOCH_MAX``, no split, no URL), and from then on only follows the splits
it reads, publishing nothing and leading nothing. A peer that reads a leave drops its writer at once: it forwards
nothing more to it, and its leader (a new one if the leaver led) splits the servers over the others in that round;
the leaver's planner lets its servers go when it reads that split (before it, they stay planned: none idles). Every
version since epochs were bounded ignores an entry at ``EPOCH_MAX`` as a whole, so an older peer just hears no more
heartbeats of the leaver and drops it ``ttl_s`` later, as for a crash.

Until a split that names this orchestrator exists, it plans nothing (two planners must never assign one server).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Sequence

from petals_chain.algorithms.herd import GroupServer, assign_server_groups, solve_server_groups, split_score
from petals_chain.orchestrator.forward import SessionOwners, warm_up
from petals_chain.swarm.periodic import run_every

logger = logging.getLogger(__name__)

_STAMPS_KEPT = 16  # distinct entry timestamps remembered per orchestrator (a stale replica holds one of its last)


def _is_leave(rec: Any) -> bool:
    """Whether a group entry is a leave (:meth:`GroupCoordinator.leave`): at ``EPOCH_MAX`` (which every version
    ignores as a whole) with no split (a leader's entry names every live orchestrator)."""
    from petals_chain.swarm.records import EPOCH_MAX

    return rec.epoch >= EPOCH_MAX and not rec.groups


class GroupCoordinator:
    """This orchestrator's part in the groups: announce, elect, split (as leader), follow the split.

    ``peers``: the other orchestrators' peer ids (trusted for their entries and splits). ``planner``: its ``group``
    is set to this orchestrator's servers; its ``servers`` views, ``arrival_rate``, ``tau_c`` and ``tau_p`` feed
    the split. ``http_url()``: where this orchestrator's API is, for the entry."""

    def __init__(self, *, dht: Any, prefix: str, peers: Sequence[str], planner: Any, http_url: Callable[[], str],
                 ttl_s: float = 6.0, refresh_s: float = 1.0, margin: float = 0.1, ilp_time_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0 or not refresh_s > 0:
            raise ValueError("ttl_s and refresh_s must be positive")
        if not ilp_time_s > 0:  # the split's whole time budget (solve_server_groups refuses it at each split)
            raise ValueError(f"ilp_time_s must be a positive number, got {ilp_time_s!r}")
        self.dht = dht
        self.prefix = prefix
        self.me: str = dht.peer_id
        self.peers = set(peers) - {self.me}
        self.planner = planner
        self.http_url = http_url
        self.ttl_s = float(ttl_s)
        self.refresh_s = float(refresh_s)
        self.margin = float(margin)  # a server moves only if that raises the worst burst tolerance by this much
        self.ilp_time_s = float(ilp_time_s)
        self._split_key: tuple | None = None
        self.split_method = ""  # how the newest split of this leader was found: ilp | greedy
        self.clock = clock
        self.last_seen: dict[str, float] = {}  # orchestrator -> when a new entry of it was last read (this clock)
        # orchestrator -> the last distinct timestamps read in its entries (its clock), oldest first
        self._stamps: dict[str, dict[float, None]] = {}
        self.urls: dict[str, str] = {}
        self.rates: dict[str, float] = {}
        self.leader: str | None = None
        self.split: dict[str, str] = {}  # server -> orchestrator, the newest split seen
        self.epoch = 0  # of that split
        self.forwarded = 0  # requests sent on to another orchestrator (forward.py)
        self.resumed = 0  # forwarded streams cut off there and finished from here
        self.session_owners = SessionOwners()  # sessions opened elsewhere through a forward: their orchestrator
        self._published_at = -float("inf")
        self._published: tuple | None = None
        self._view_since: float | None = None  # when the planner first read the servers' records (this clock)
        self._started_at: float | None = None  # this coordinator's first step (this clock)
        self.leaving = False  # leave() ran: nothing more is published, only splits are followed
        self._publishing = asyncio.Lock()  # a round's entry is never stored after the leave (it would undo it)
        warm_up()  # requests are forwarded only with groups: the first one no longer pays for httpx's setup

    # ---- state ---------------------------------------------------------------------------------
    def live(self) -> list[str]:
        """Orchestrators heard from within ``ttl_s`` (this one always), sorted by peer id."""
        now = self.clock()
        return sorted({self.me} | {o for o, t in self.last_seen.items() if now - t <= self.ttl_s})

    def members(self) -> set[str]:
        """Servers of this orchestrator's group (none before a split: two planners must not share a server)."""
        return {s for s, o in self.split.items() if o == self.me}

    def json(self) -> dict:
        """For ``/api/v1/swarm``: who leads, the split's epoch, the live orchestrators and each group's size."""
        live = set(self.live())
        sizes: dict[str, int] = {o: 0 for o in live}
        for o in self.split.values():
            sizes[o] = sizes.get(o, 0) + 1
        return {"me": self.me, "leader": self.leader, "epoch": self.epoch, "forwarded": self.forwarded,
                "resumed": self.resumed, "leaving": self.leaving,
                "split_method": self.split_method,
                "orchestrators": [{"peer_id": o, "http_url": self.urls.get(o, self.http_url() if o == self.me else ""),
                                   "arrival_rate": self.rates.get(o, 0.0), "servers": sizes.get(o, 0),
                                   "live": o in live} for o in sorted(sizes)]}

    # ---- the split -----------------------------------------------------------------------------
    def _servers(self) -> list[GroupServer]:
        """The servers the planner sees (every one, not only this group's), as the split weighs them."""
        model = self.planner._model_spec()
        if model is None:
            return []
        plan = self.planner.plan
        c = plan.c if plan is not None and plan.c else 1  # blocks a server holds at the cache reservation in force
        # banned servers too: left out, a banned server was in no group, the leader's planner dropped its view (and
        # its ban with it) and the next round planned it again, fresh
        views = [v for v in self.planner.all_views() if v.record.state != "offline"]
        out = []
        for v, spec in zip(views, self.planner.specs(views)):
            blocks = max(0, spec.max_blocks(model, c))
            step = spec.tau_c + spec.tau_p * blocks
            out.append(GroupServer(v.peer_id, blocks, blocks / step if step > 0 else float(blocks)))
        return out

    async def compute_split(self, live: Sequence[str]) -> dict[str, str]:
        """HERD's split of the servers over ``live`` orchestrators: the ILP (in a thread, ``ilp_time_s`` in all),
        unless the greedy split beats it by more than the ILP's own move margin (or the solver fails). Solved
        again only when the orchestrators, the servers or a demand (by a factor of about 1.4) change."""
        spec = self.planner._model_spec()
        num_blocks = spec.num_blocks if spec is not None else 1
        servers = self._servers()
        demand = {o: (self.planner.arrival_rate if o == self.me else self.rates.get(o, 0.0)) for o in live}
        # A view only just read (this orchestrator restarted, its DHT node still joining) may lack servers the
        # others see and serve: for ``ttl_s`` those keep their group instead of being split away.
        young = self._view_since is None or self.clock() - self._view_since < self.ttl_s
        key = (tuple(live), tuple(sorted((s.peer_id, s.blocks) for s in servers)), num_blocks,
               tuple(round(2 * math.log2(max(demand[o], 1e-3))) for o in live), young)
        if key == self._split_key:
            return self.split
        greedy = assign_server_groups(servers, demand, num_blocks, previous=self.split, margin=self.margin)
        ilp = await asyncio.to_thread(solve_server_groups, servers, demand, num_blocks, self.split,
                                      margin=self.margin, time_limit_s=self.ilp_time_s)
        split, how = greedy, "greedy"
        if ilp is not None:
            (ci, ti), (cg, tg) = (split_score(servers, demand, num_blocks, x) for x in (ilp, greedy))
            if (ci, ti * (1 + self.margin)) >= (cg, tg):
                split, how = ilp, "ilp"
        if young:
            seen = {sv.peer_id for sv in servers}
            split = {**{sv: o for sv, o in self.split.items() if sv not in seen and o in live}, **split}
        self._split_key, self.split_method = key, how
        return split

    # ---- loop ----------------------------------------------------------------------------------
    async def step(self) -> None:
        from petals_chain.swarm.records import EPOCH_MAX, GroupRecord

        read = await self.dht.afetch_groups(self.prefix, self.peers | {self.me})
        now = self.clock()
        for o, rec in read.items():
            if o != self.me and _is_leave(rec):
                self._read_leave(o, rec)
        # an entry at the largest epoch a record carries cannot be continued above (the next could not be published)
        entries = {o: rec for o, rec in read.items() if rec.epoch < EPOCH_MAX}
        # the highest split epoch anyone published (followers publish the one they follow; our own entry may be
        # from before a restart): a leader continues above it, else followers ignore its splits until it passes it
        seen_epoch = max((rec.epoch for rec in entries.values()), default=0)
        for o, rec in entries.items():
            if o == self.me:
                continue
            # alive while it writes new entries (it republishes every ttl_s / 3), timed by this clock: an entry the
            # DHT still holds is no sign of life (it lasts until the expiration its writer set by the writer's clock:
            # a dead orchestrator whose clock ran ahead kept its group, unplanned, for as long as it ran ahead).
            # New = a timestamp not among the last ones read: replicas of its last entries read in turn are no
            # heartbeat, and a writer whose clock stepped back (NTP) stays alive ("newer than the newest" made it
            # dead for as long as its clock had run ahead: two leaders, the split re-published every round).
            stamps = self._stamps.setdefault(o, {})
            if rec.timestamp not in stamps:
                self.last_seen[o] = now
                stamps[rec.timestamp] = None
                if len(stamps) > _STAMPS_KEPT:  # only a live writer adds stamps: a dead one's stay
                    del stamps[next(iter(stamps))]
            self.urls[o], self.rates[o] = rec.http_url, rec.arrival_rate
            if rec.groups and rec.epoch > self.epoch:  # a leader's split (a new leader continues above it)
                self.epoch, self.split = rec.epoch, rec.group_of()
                self._split_key = None  # the split cached is not this one: a leader again, solve afresh
        # another split at the epoch followed or above (two leaders while the orchestrators could not hear each
        # other, each took the servers at the same epoch): a leader publishes above it, else those following it never
        # moved and two planners assigned one server for good
        rival = any(o != self.me and rec.groups and rec.epoch >= self.epoch and rec.group_of() != self.split
                    for o, rec in entries.items())
        if self.leaving:  # it follows the split that hands its servers over, and leads or announces nothing more
            self.planner.group = self.members()
            return
        live = self.live()
        leader = live[0]
        if leader != self.leader:
            logger.info("orchestrator group leader: %s%s (live: %s)", leader[:12], " (this one)" if leader == self.me
                        else "", ", ".join(o[:12] for o in live))
            self.leader = leader
        if self._started_at is None:
            self._started_at = now
        if self._view_since is None and self.planner.refreshes > 0:
            self._view_since = now
        # A leader just started splits only once it has read the server records (else it split nothing: every
        # server left the groups serving with it) and heard the others for ttl_s (they republish every ttl_s / 3;
        # its DHT node still joining, it took itself for the only one and split every server to itself)
        if leader == self.me and self._view_since is not None and now - self._started_at >= self.ttl_s:
            split = await self.compute_split(live)
            if split != self.split or self.epoch == 0 or self.epoch < seen_epoch or rival:
                self.epoch = max(self.epoch, seen_epoch) + 1
                self.split = split
                sizes = {o: sum(1 for x in split.values() if x == o) for o in live}
                logger.info("group split epoch %d (%s): %s", self.epoch, self.split_method,
                            ", ".join(f"{o[:12]}={n} servers" for o, n in sizes.items()))
        # every entry carries the split its orchestrator follows (the leader's: its own), so a leader that restarts
        # continues from it instead of from nothing, which let it move servers away from the groups serving them
        groups: dict[str, list[str]] = {}
        for s, o in sorted(self.split.items()):
            groups.setdefault(o, []).append(s)
        if self.split or leader == self.me:
            for o in live:
                groups.setdefault(o, [])
        key = (self.epoch, leader == self.me, round(self.planner.arrival_rate, 3))
        if key != self._published or now - self._published_at >= self.ttl_s / 3:
            rec = GroupRecord(orchestrator_peer_id=self.me, http_url=self.http_url(),
                              arrival_rate=float(self.planner.arrival_rate), epoch=self.epoch, groups=groups)
            async with self._publishing:
                if self.leaving:  # leave() ran while this round read or split
                    return
                if await self.dht.apublish_group(self.prefix, rec, self.ttl_s):
                    self._published, self._published_at = key, now
        self.planner.group = self.members()

    def _read_leave(self, o: str, rec: Any) -> None:
        """``o`` left (its entry is a leave): not live from now on, unless a later entry of it is read (it came
        back). A leave already read (a replica that still holds it) changes nothing: a restarted ``o`` whose new
        entries alternate with it stays live."""
        stamps = self._stamps.setdefault(o, {})
        if rec.timestamp in stamps:
            return
        stamps[rec.timestamp] = None
        if len(stamps) > _STAMPS_KEPT:
            del stamps[next(iter(stamps))]
        if self.last_seen.pop(o, None) is not None:
            logger.info("orchestrator %s left the groups (stopping): its servers go to the others now", o[:12])

    async def leave(self) -> bool:
        """Leave the groups now (a planned stop; idempotent): this orchestrator's entry becomes a leave, so that
        the others stop forwarding to it and split its servers over themselves at once instead of ``ttl_s`` after
        its last entry. Its planner keeps its servers until it reads that split (an older leader, which ignores the
        leave, takes them ``ttl_s`` later: they keep serving meanwhile). Whether the leave was stored; on a DHT
        error, the others drop this orchestrator after ``ttl_s``, as for a crash."""
        from petals_chain.swarm.records import EPOCH_MAX, GroupRecord

        if self.leaving:
            return False
        self.leaving = True
        # the same expiration as a round's entry: the DHT keeps a subkey's value of latest expiration, so a shorter
        # one would be refused in favour of the last heartbeat
        rec = GroupRecord(orchestrator_peer_id=self.me, http_url="", arrival_rate=0.0, epoch=EPOCH_MAX, groups={})
        async with self._publishing:
            try:
                stored = bool(await self.dht.apublish_group(self.prefix, rec, self.ttl_s))
            except Exception as e:  # noqa: BLE001 - the stop goes on: the others time this orchestrator out
                logger.warning("leaving the orchestrator groups failed (%s: %s): the others drop this one after "
                               "%g s", type(e).__name__, e, self.ttl_s)
                return False
        if stored:
            logger.info("left the orchestrator groups: the others take this group's %d server(s) over",
                        len(self.members()))
        else:
            logger.warning("the DHT did not store this orchestrator's leave: the others drop it after %g s",
                           self.ttl_s)
        return stored

    async def run(self, stop: asyncio.Event) -> None:
        await run_every(stop, self.refresh_s, self.step, logger, "orchestrator group round")
