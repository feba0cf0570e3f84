"""SwarmDHT: hivemind's DHT with signed, schema-checked records whose owner key is bound to the peer id.

How ownership is bound (the reason forged records are rejected):

* The libp2p identity of every SwarmDHT is an RSA key (hivemind's identity file format). The same key
  signs our DHT records through :class:`~hivemind.dht.crypto.RSASignatureValidator`; the record's subkey
  carries its public key ``[owner:ssh-rsa ...]``.
* A libp2p peer id *is* the sha256 multihash of that RSA public key, so a reader recomputes the peer id
  from the owner key in the subkey (:func:`peer_id_of_owner`) and keeps a record only if it equals the
  ``peer_id`` the record claims. No RPC challenge is needed: a forged record would need the victim's private
  key, and overwriting another owner's subkey fails the signature check at every honest DHT node.
* Assignment and summary records count only when the owner key hashes to a peer id the reader trusts.

Every entry under our keys must be signed (the schema demands an owner key in every subkey) and match the
pydantic.v1 schema exactly (:class:`~petals_chain.swarm.records.SwarmSchemaV1`).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import stat
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import multihash
import psutil
from cryptography.hazmat.primitives import serialization
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.mpfuture import MPFuture

from petals_chain.swarm.keys import (DIRECTORY_KEY, assignment_key, check_prefix, groups_key, placement_key,
                                     servers_key, summary_key)
from petals_chain.swarm.process_locks import install_robust_hivemind_locks
from petals_chain.swarm.records import (RECORD_VERSION, AssignmentRecord, DirectoryRecord, DirectorySchemaV1,
                                        GroupRecord, PlacementRecord, ServerRecord, SummaryRecord, SwarmSchemaV1)

logger = logging.getLogger(__name__)


class _P2PDaemonShutdownNoise(logging.Filter):
    """p2pd logs its control socket's closing as an ERROR (``error accepting connection: accept unix ...: use of
    closed network connection``) each time a node stops; hivemind relays it at that level into every role's log.
    It is the daemon's normal shutdown: downgraded to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            message = record.getMessage()
            if "error accepting connection" in message and "use of closed network connection" in message:
                record.levelno, record.levelname = logging.DEBUG, "DEBUG"
                return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


# installed at import, before any DHT process is forked (the process that relays p2pd's output inherits it)
_P2PD_LOGGER = logging.getLogger("hivemind.p2p.p2p_daemon")
if not any(isinstance(f, _P2PDaemonShutdownNoise) for f in _P2PD_LOGGER.filters):
    _P2PD_LOGGER.addFilter(_P2PDaemonShutdownNoise())

# before any DHT process is forked: see process_locks (a DHT process killed mid-reply hung every later DHT start)
install_robust_hivemind_locks()

# sun_path holds 108 bytes on Linux, 104 on macOS, its terminating NUL included
_SUN_PATH_BYTES = 104
# hivemind's longest socket name after its prefix: p2pclient-{secrets.token_urlsafe(8): 11 characters}.sock
_P2P_SOCKET_NAME_BYTES = len("p2pclient-.sock") + 11
_HIVEMIND_SOCKET_PREFIX = "/unix/tmp/hivemind-"  # hivemind 1.1.12's own (P2P._UNIX_SOCKET_PREFIX)


def use_temp_dir_for_p2p_sockets() -> str:
    """Make hivemind name p2pd's unix sockets (``hivemind-p2pd-*.sock``, ``hivemind-p2pclient-*.sock``) in the
    temporary directory (``TMPDIR``, :func:`tempfile.gettempdir`) rather than in ``/tmp``, which hivemind 1.1.12
    hard-codes; a folder whose socket paths would not fit ``sun_path`` or a multiaddr keeps ``/tmp``. Returns the
    prefix in use. Called at import and before each DHT node starts (a DHT process forked later inherits it)."""
    folder = tempfile.gettempdir()
    prefix = f"/unix{os.path.join(folder, 'hivemind-')}"
    if (not os.path.isabs(folder) or not re.fullmatch(r"[A-Za-z0-9._+/-]+", folder)
            or len(os.fsencode(prefix)) - len("/unix") + _P2P_SOCKET_NAME_BYTES >= _SUN_PATH_BYTES):
        prefix = _HIVEMIND_SOCKET_PREFIX
    P2P._UNIX_SOCKET_PREFIX = prefix
    return prefix


# a private TMPDIR (systemd's PrivateTmp=, a test session's) then holds them too, and they go with it: p2pd's socket
# and its client's outlive a DHT node whose process was SIGKILLed (no handler runs), one pair per kill
use_temp_dir_for_p2p_sockets()

_OWNER_RE = re.compile(rb"^\[owner:(.+)\]$", re.DOTALL)
# Records that claim to live longer than this, or whose timestamp is older (or further ahead), are not read: hivemind
# sets no bound on an entry's expiration and copies entries to nodes as they join, so a record stored once with a
# far expiration (a hostile or a long-gone peer's) would be read as live for ever. Ours expire within minutes.
MAX_RECORD_TTL_S = 6 * 3600.0
# a writer's record timestamp this far ahead of the reader's clock is reported (once per writer): hivemind refuses a
# join more than 3 s off its first peer, but a clock stepped after the join goes unnoticed
CLOCK_AHEAD_WARN_S = 5.0


class RecordLifetimes:
    """Times each record's life on the reader's monotonic clock as well as by its DHT expiration.

    A record's expiration is set by its writer's wall clock: a writer whose clock runs ``d`` seconds ahead publishes
    records that outlive it by ``d`` (a dead server stayed listed, or a stale state of a live one hid its newer
    records, which DHT nodes refuse while an entry with a later expiration is held). The writer's TTL,
    ``expiration - timestamp``, is skew-free (both on its clock), and the reader first reads a record after it was
    published, so a record also ends that TTL after this reader first read it: never sooner than with right clocks,
    at most one TTL late whatever the writer's clock says.

    Booked by DHT key and writer (the DHT holds one record per key and subkey; nodes that missed a store answer
    with an earlier one): its last :attr:`PER_WRITER` records, each with when it was first read, so a copy read
    again is not taken for a new record, and a republished record always is. Each is kept at most
    :data:`MAX_RECORD_TTL_S` past its TTL's end (a record stamped far in the past has a TTL of years); the book is
    pruned of ended entries as it doubles."""

    PRUNE_AT = 4096
    PER_WRITER = 4

    def __init__(self) -> None:
        # (DHT key, writer) -> {(expiration, timestamp): monotonic time of its first read}
        self._book: dict[tuple[str, str], dict[tuple[float, float], float]] = {}
        self._prune_at = self.PRUNE_AT
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # (the DHT is read from several threads)

    def __len__(self) -> int:
        """The records booked."""
        with self._lock:
            return sum(len(records) for records in self._book.values())

    def live(self, owner_peer: str, timestamp: Any, expiration: float, *, where: str = "",
             wall: Optional[float] = None, mono: Optional[float] = None) -> bool:
        """Whether the record ``owner_peer`` stamped ``timestamp`` (its wall clock), expiring at ``expiration`` (the
        same clock), read under the DHT key ``where``, is still live here. A record without a usable timestamp is
        judged by its expiration alone."""
        if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or not math.isfinite(timestamp):
            return True
        stamp, expiration = float(timestamp), float(expiration)
        ttl = expiration - stamp
        if not ttl > 0:  # (its expiration is before its stamp: no writer of ours does that)
            return False
        wall = time.time() if wall is None else wall
        mono = time.monotonic() if mono is None else mono
        ahead = stamp - wall
        if ahead > CLOCK_AHEAD_WARN_S and owner_peer not in self._warned:
            if len(self._warned) >= 4096:  # bounded: writers can be made up by the thousand
                self._warned.clear()
            self._warned.add(owner_peer)
            logger.warning(f"the clock of peer {owner_peer} runs at least {ahead:.0f} s ahead of this host's (its "
                           f"record is stamped {ahead:.0f} s in the future): its records are timed here from when "
                           "they are read; hivemind's DHT needs clocks within 3 s: fix the clock that is wrong")
        with self._lock:
            records = self._book.setdefault((where, owner_peer), {})
            first = records.get((expiration, stamp))
            if first is None:
                if len(records) >= self.PER_WRITER:  # (a writer republishing: its oldest record read goes)
                    del records[min(records, key=records.__getitem__)]
                first = records[(expiration, stamp)] = mono
            if len(self._book) > self._prune_at:
                self._prune(mono)
        return mono - first <= ttl

    def _prune(self, mono: float) -> None:
        book: dict[tuple[str, str], dict[tuple[float, float], float]] = {}
        for where, records in self._book.items():
            kept = {(exp, stamp): t for (exp, stamp), t in records.items()
                    if mono - t <= min(exp - stamp, MAX_RECORD_TTL_S) + MAX_RECORD_TTL_S}
            if kept:
                book[where] = kept
        self._book = book
        self._prune_at = max(self.PRUNE_AT, 2 * len(book))


# a store expires strictly later than the last one this process stored under its key: hivemind's DHT nodes keep an
# entry unless the new one expires later (``<``, equal is refused); 1 ms is far above a float's resolution at 1.7e9
EXPIRATION_STEP_S = 1e-3
# a step back of the writer's clock smaller than this is not reported (NTP's corrections; two stores racing)
CLOCK_BACK_WARN_S = 1.0


class StoredExpirations:
    """The expirations this process stores, kept increasing per DHT key (our subkey is the same under every key).

    hivemind's DHT nodes keep, per key and subkey, the entry that expires later and refuse a store that expires
    earlier; expirations are set by the writer's wall clock. A writer whose clock ran ``d`` seconds ahead and was
    then stepped back (NTP) had every store refused until its clock passed the expiration it had stored, and readers
    end a record its TTL after they first read it (:class:`RecordLifetimes`): a live server left the swarm for about
    ``d`` minus one TTL. Its stores now expire just after the last one until its clock catches up, so nodes accept
    them.

    The cost, for such a writer only: its records' TTL (expiration - timestamp) is up to ``d`` longer, so if it stops
    meanwhile readers list it up to ``d`` longer, as they did before its clock was corrected (never beyond
    :data:`MAX_RECORD_TTL_S`: readers skip records that expire further ahead). The step back is logged once.

    A new process of the same peer (restarted once its clock was set right) knows nothing of what the last one
    stored: a store refused because a node holds an entry of ours that expires later is made again just after it,
    unless a later store of ours under that key was made meanwhile (:meth:`after`, from :meth:`SwarmDHT._store`)."""

    PRUNE_AT = 64

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # DHT key -> the expiration stored last (on this host's DHT clock)
        self._prune_at = self.PRUNE_AT
        self._warned_until = -math.inf  # a step back is reported once, not again until the clock passes this
        self._lock = threading.Lock()  # (stores come from several threads)

    def next(self, key: str, ttl: float, *, now: Optional[float] = None) -> float:
        """The expiration of a store under ``key`` that should live ``ttl`` seconds from ``now`` (this host's DHT
        time): ``now + ttl``, or just after the last one stored under ``key`` if that is later."""
        with self._lock:  # the clock is read under the lock: two stores racing get their expirations in order
            now = get_dht_time() if now is None else now
            expiration = now + ttl
            last = self._last.get(key)
            if last is not None and expiration <= last:
                self._behind(last, expiration, now)
                expiration = last + EXPIRATION_STEP_S
            self._last[key] = expiration
            if len(self._last) > self._prune_at:  # (an expiration already past constrains nothing)
                self._last = {k: e for k, e in self._last.items() if e >= now}
                self._prune_at = max(self.PRUNE_AT, 2 * len(self._last))
        return expiration

    def after(self, key: str, held: float, refused: float) -> Optional[float]:
        """The expiration of a store under ``key`` again, now that the one expiring at ``refused`` was refused and a
        DHT node holds our entry expiring at ``held`` (stored before this process started, by a clock that was
        ahead): just after ``held``, and after it every later store; None if ``held`` is not the reason, or if a
        later store of ours under ``key`` was made meanwhile (its value is the newer: the entry held may be that
        very store, which reached the node first, and the refused, older value must not be stored after it)."""
        if not held >= refused:
            return None
        with self._lock:
            if self._last.get(key) != refused:
                return None
            now = get_dht_time()
            self._behind(held, refused, now, restarted=True)
            expiration = max(held, self._last.get(key, -math.inf)) + EXPIRATION_STEP_S
            self._last[key] = expiration
        return expiration

    def _behind(self, held: float, expiration: float, now: float, *, restarted: bool = False) -> None:
        """Report (once until the clock passes ``held``) a store that would expire ``held - expiration`` seconds
        before the entry of ours a DHT node holds (``restarted``: one stored before this process started)."""
        behind = held - expiration
        if behind <= CLOCK_BACK_WARN_S:
            return
        if now >= self._warned_until:
            why = (f"DHT nodes hold a record of this peer, stored before this process started, that expires "
                   f"{behind:.0f} s after this one would (this host's clock was ahead then, or the TTL longer)"
                   if restarted else
                   f"this host's clock went back at least {behind:.0f} s (stepped by NTP?) and DHT nodes refuse a "
                   "record that expires before the one they hold")
            logger.warning(f"{why}: ours are stored to expire just after it until the clock catches up (in at most "
                           f"{held - now:.0f} s); if this node stops meanwhile, peers may list it until then")
        self._warned_until = max(self._warned_until, held)


def peer_id_of_owner(owner: bytes) -> Optional[str]:
    """The libp2p peer id (base58) derived from an ``[owner:ssh-rsa ...]`` subkey, or None if malformed."""
    if not isinstance(owner, bytes):
        return None
    match = _OWNER_RE.match(owner)
    if match is None:
        return None
    try:
        public = RSAPublicKey.from_bytes(match.group(1))._public_key
    except Exception:  # noqa: BLE001 - any malformed key is simply not an owner
        return None
    der = public.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


_PEER_ID_HASHES = {0x12: 32, 0x00: None}  # multihash codes of libp2p peer ids: sha2-256 of the key, or the key inline


def is_peer_id(text: str) -> bool:
    """Whether ``text`` is a libp2p peer id: base58 of a sha2-256 or identity multihash. (hivemind's
    ``PeerID.from_base58`` alone takes any base58 text, 'notapeerid' included.)"""
    try:
        mh = multihash.decode(PeerID.from_base58(text).to_bytes())
    except Exception:  # noqa: BLE001 - not base58, or not a multihash: the same user error
        return False
    size = _PEER_ID_HASHES.get(mh.code, 0)
    return bool(mh.digest) and (size is None or len(mh.digest) == size)


def peer_id_arg(text: str) -> str:
    """``argparse`` type of a peer id flag (``--group-with``, the dashboard's ``--trust-orchestrator``)."""
    if not is_peer_id(text):
        raise argparse.ArgumentTypeError(f"not a peer id: {text!r} (the base58 id an orchestrator prints at start)")
    return text


def peer_ids_from_maddrs(maddrs: Iterable[str]) -> list[str]:
    """Peer ids named by ``/p2p/<id>`` components of multiaddrs (order kept, duplicates dropped)."""
    out: list[str] = []
    for maddr in maddrs:
        parts = str(maddr).strip().split("/")
        for i, part in enumerate(parts[:-1]):
            if part in ("p2p", "ipfs") and parts[i + 1] and parts[i + 1] not in out:
                out.append(parts[i + 1])
    return out


def load_identity(identity_path: str) -> RSAPrivateKey:
    """Read a hivemind/libp2p identity file (protobuf PrivateKey with an RSA DER key) as an RSAPrivateKey."""
    with open(identity_path, "rb") as f:
        proto = crypto_pb2.PrivateKey.FromString(f.read())
    if proto.key_type != crypto_pb2.RSA:
        raise ValueError(f"identity {identity_path} is not an RSA key; petals-chain needs RSA identities")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})  # loads the DER key (public hivemind pickling path)
    return key


def _write_identity(fd: int) -> None:
    """Write a new RSA identity into ``fd`` (an empty file only this user may read), serialized as hivemind's
    ``P2P.generate_identity`` does, then make it read-only as hivemind leaves it (0400); closes ``fd``."""
    try:
        proto = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
        data = memoryview(proto.SerializeToString())
        while data:
            data = data[os.write(fd, data):]
        os.fchmod(fd, 0o400)
    finally:
        os.close(fd)


def generate_identity(path: str) -> bool:
    """Create the identity file ``path`` with a new RSA key; False if a file is there already (left as it is).

    Unlike hivemind's ``P2P.generate_identity``, the file is never readable by others, even for a moment (it opened
    it with the umask's permissions, then chmodded it 0400: under ``umask 0`` anyone could read the key meanwhile),
    and never written through a link planted at ``path``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    except FileNotFoundError:
        raise FileNotFoundError(f"The directory `{os.path.dirname(path)}` for saving the identity does not exist")
    try:
        _write_identity(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)  # not a truncated key that every later start fails to read
        raise
    return True


def check_identity_path(path: str) -> None:
    """ValueError naming ``--identity-path`` unless ``path`` is an RSA identity key file the DHT can read, or a missing
    file it can create there (missing directories are made here: hivemind writes a new key but makes no directory).
    An existing file is only read, never replaced: it may be the key a volunteer's peer id comes from.

    Every role's command line calls it before it loads or starts anything (a corrupt key was found when the DHT node
    started: after the orchestrator had loaded its model)."""
    flag = f"--identity-path {path}"
    if not path:
        raise ValueError("--identity-path is empty: give the path of the key file (created if missing)")
    if os.path.isdir(path):
        raise ValueError(f"{flag} is a directory: give the path of the key file in it (created if missing)")
    if os.path.exists(path):
        if not os.path.isfile(path):  # a FIFO or a device: reading or writing a key there blocks or garbles it
            raise ValueError(f"{flag} is not a regular file: give the path of the key file (created if missing)")
        try:
            load_identity(path)
        except OSError as e:
            raise ValueError(f"{flag} cannot be read ({e.strerror or e}): make it readable, or give another path "
                             "(a missing file is created)") from None
        except Exception as e:  # noqa: BLE001 - protobuf, DER or key-type errors: all mean "not our key file"
            raise ValueError(f"{flag} is not a libp2p RSA identity key ({type(e).__name__}: {e}): give another path "
                             "(a missing file is created) or move this file away; it was left as it is") from None
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)  # 0o700: it will hold a private key
    except OSError as e:
        raise ValueError(f"{flag}: its directory {folder} cannot be created ({e.strerror or e}): give a path in a "
                         "directory this user can write") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: the key cannot be created, {folder} is not writable by this user: give a path in "
                         "a directory this user can write")


class _LockedConnection:
    """A multiprocessing connection whose ``send`` is atomic across threads."""

    def __init__(self, conn: Any):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def _blocking_command_pipe(dht: DHT, node: Any) -> bool:
    """Runs in the DHT process: make its command pipe blocking again.

    uvloop's ``add_reader`` leaves the pipe non-blocking, so a command larger than one pipe write (>16 KiB
    pickled, e.g. a swarm summary) can be read half-written: ``recv`` raises EAGAIN, hivemind 1.1.12 logs it
    and reads on mid-message, and the DHT process dies (EOFError) -- every later DHT call hangs. Blocking reads
    wait the microseconds until the writer finishes the message."""
    os.set_blocking(dht._inner_pipe.fileno(), True)
    return True


async def _rejoin_peers(dht: DHT, node: Any, peer_ids: tuple[str, ...], timeout_s: float) -> list[str]:
    """Runs in the DHT process: ping each of ``peer_ids`` that is missing from the routing table.

    Why this is needed: hivemind deletes a peer from the routing table when one RPC to it fails, and it pings
    its initial peers only once, in ``DHTNode.create``. A node learns a peer again only from that peer's own
    RPCs or from a neighbour's answer naming it. An orchestrator restarted at the same address with the same
    identity has an empty routing table (it has no initial peers of its own), so it never calls anyone and
    no neighbour knows it: the two sides never meet again. A ping from us puts the peer back into our table
    (``call_ping``) and puts us into its table (its ``rpc_ping``), after which our stores reach it. Returns the
    peers that answered."""
    table = node.protocol.routing_table
    missing = []
    for raw in peer_ids:
        try:
            peer = PeerID.from_base58(raw)
        except Exception:  # noqa: BLE001 - a malformed id in the initial peers is simply not pinged
            continue
        if peer != node.peer_id and table.get(peer_id=peer) is None:
            missing.append(peer)
    if not missing:
        return []
    answers = await asyncio.gather(*(asyncio.wait_for(node.protocol.call_ping(peer), timeout_s) for peer in missing),
                                   return_exceptions=True)
    back = [peer for peer, answer in zip(missing, answers) if isinstance(answer, DHTID)]
    for peer in back:
        node.blacklist.register_success(peer)  # failures while it was down banned it from lookups (backoff)
    if back:
        await asyncio.sleep(0)  # call_ping adds the peer to the routing table in a task of its own
        with contextlib.suppress(Exception):  # refill the table around our own id through the peers we found
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout_s)
    return [peer.to_base58() for peer in back]


class _DHTProcess(DHT):
    """hivemind's DHT process, forked with default signal handling, in a process group of its own (with its p2pd).

    * The roles fork it after asyncio's ``add_signal_handler(SIGTERM, ...)``, so the child inherited a no-op Python
      handler for SIGTERM and the parent loop's wakeup fd: ``DHT.shutdown``'s "terminating it the hard way" did
      nothing and every slow shutdown waited out ``SwarmDHT.shutdown``'s join (10 s) with the process still alive.
    * A signal to the role's process group (a terminal's Ctrl-C, ``kill -TERM -PGID``) reached the DHT process and
      p2pd too (p2pd handles SIGINT, so ignoring it is not inherited): SIGTERM killed the DHT node under a server
      that was about to announce ``offline``, and SIGINT left the orchestrator's DHT unable to stop. In a group of
      its own only the role gets them, and the role stops its DHT node itself.
    * Out of the role's group, a killpg of the role no longer ends it: it stops itself and p2pd when the role
      is gone (:func:`_exit_with_parent`), and kills p2pd whenever it exits."""

    def run(self) -> None:
        with contextlib.suppress(OSError):  # before p2pd is started: it joins this group
            os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # a background group writing to the terminal under ``stty tostop`` is stopped (SIGTTOU): log lines must not
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        threading.Thread(target=_exit_with_parent, args=(self._parent_pid,), name="exit-with-parent",
                         daemon=True).start()
        try:
            super().run()
        finally:  # a p2pd outlives its DHT process until its next log line (a crash, a pipe from a dead role)
            _kill_orphans(_descendants(os.getpid()))


def _exit_with_parent(parent_pid: int) -> None:
    """Runs in the DHT process (a thread): once the role that started it is gone (SIGKILLed, or killed with its
    process group, which no longer holds us), kill p2pd and exit. multiprocessing's parent sentinel is readable
    as soon as the role exits (or drops this process unstopped); ``getppid`` (re-parented when the parent dies)
    tells it where the sentinel is missing or held open by another process."""
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None and parent.pid == parent_pid else None
    while os.getppid() == parent_pid:
        if sentinel is None:
            time.sleep(0.5)
        elif multiprocessing.connection.wait([sentinel], timeout=0.5):
            break
    _kill_orphans(_descendants(os.getpid()))  # first: p2pd holds the node's port and would answer a moment longer
    logger.warning(f"the process that started this DHT node (pid {parent_pid}) is gone: stopped the node and p2pd")
    os._exit(1)


DHT_READY_TIMEOUT_S = 120.0  # joining over a slow network takes seconds; a start that takes minutes has hung

# The temporary identity files of the nodes this process is starting (each deleted once its p2pd has read it, or the
# start failed): what remove_temp_identities() deletes for a process that exits at once, mid-start
_temp_identities: set[str] = set()


# ``{tempdir}/petals-chain-identity-{pid}-{random}``: the pid of the process whose DHT node it is (remove_stale_...)
_TEMP_IDENTITY_PREFIX = "petals-chain-identity-"
_TEMP_IDENTITY_RE = re.compile(re.escape(_TEMP_IDENTITY_PREFIX) + r"([0-9]+)-[^/]+$")


def remove_stale_temp_identities(folder: Optional[str] = None) -> list[str]:
    """Delete the temporary identity files (private keys) left in ``folder`` (the temporary directory) by this user's
    processes that no longer run: a process killed by SIGKILL while its DHT node started runs no handler. Only
    regular files of our naming (with a pid) owned by this user, never those of a live process; the paths deleted."""
    folder = folder or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _TEMP_IDENTITY_RE.match(name)
        if m is None:
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)  # (a link is not followed: not ours)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or int(m.group(1)) == os.getpid()
                    or psutil.pid_exists(int(m.group(1)))):
                continue
            os.unlink(path)
        except (OSError, ValueError, OverflowError):
            continue  # gone meanwhile, or not ours to delete
        removed.append(path)
    return removed


def remove_temp_identities() -> None:
    """Delete the temporary identity files of the DHT nodes being started, for an exit that does not wait for their
    start (``os._exit``): the private key stayed behind in ``/tmp/petals-chain-identity-*``."""
    for path in list(_temp_identities):  # a copy: a start in another thread may end meanwhile
        with contextlib.suppress(OSError):
            os.unlink(path)
        _temp_identities.discard(path)


_on_lost: Optional[Callable[["SwarmDHT"], None]] = None
_exiting = False  # this interpreter is exiting: multiprocessing's exit handler ends the DHT processes left running


@atexit.register  # registered after multiprocessing's own (imported above), so it runs before it
def _note_exit() -> None:
    global _exiting
    _exiting = True


def on_dht_lost(callback: Optional[Callable[["SwarmDHT"], None]]) -> None:
    """Call ``callback(sd)`` (from a thread of its own) when the DHT process of a :class:`SwarmDHT` of this process
    exits before its :meth:`SwarmDHT.shutdown` (``kill -9``, the OOM killer, a crash; ended by SIGTERM, SIGINT or
    SIGHUP: only once :data:`STOP_SIGNAL_GRACE_S` passed without a shutdown); None: only log it.

    For the roles' entry points: without its DHT process a role can neither publish nor read a record, and kept
    running as a member nobody sees (each DHT call failing with "Broken pipe" or timing out) instead of exiting for
    its supervisor to restart it."""
    global _on_lost
    _on_lost = callback


# A DHT process ended by one of these was most likely stopped with its whole service (systemd's default
# KillMode=control-group signals every process of the unit at once): its role got the same signal, which its loop may
# handle only after the DHT process's death was seen. Such a death is reported only if the role has not stopped it
# (shutdown()) within STOP_SIGNAL_GRACE_S; a kill -9, the OOM killer or a crash is reported at once.
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
STOP_SIGNAL_GRACE_S = 5.0


# what _killed_by returns for a child reaped by another thread that has not recorded its status yet:
# multiprocessing's ``Popen.poll`` sets ``returncode`` only after its ``waitpid`` returned
_STATUS_UNKNOWN = -1


def _signal_of(code: Optional[int]) -> Optional[int]:
    """The signal of a multiprocessing exit code (None: exited; ``_STATUS_UNKNOWN``: not recorded yet)."""
    if code is None:
        return _STATUS_UNKNOWN
    return -code if code < 0 else None


def _killed_by(process: multiprocessing.Process) -> Optional[int]:
    """The signal that ended the child ``process`` (None: it exited, or it is not our child; ``_STATUS_UNKNOWN``:
    reaped by another thread that has not recorded how it ended yet), read without reaping it where it was not
    reaped yet: :meth:`SwarmDHT.shutdown` joins it."""
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile (``is_alive()``, ``join()``): multiprocessing keeps its status
        return _signal_of(process.exitcode)
    except (OSError, AttributeError):
        if hasattr(os, "waitid"):  # not a child of ours: nothing to read
            return None
        # no waitid on this platform (macOS): reaped here (multiprocessing keeps the status for shutdown()'s join);
        # join, not exitcode: its sentinel closes just before it can be waited for
        process.join(timeout=5.0)
        return _signal_of(process.exitcode)
    if info is None or info.si_code not in (os.CLD_KILLED, os.CLD_DUMPED):
        return None
    return info.si_status


def _fail(future: Any, error: BaseException) -> None:
    """Fail a pending MPFuture of this process (one answered meanwhile keeps its answer)."""
    if MPFuture._active_futures is not None:  # a reply still in the pipe is then dropped, not set on it too
        MPFuture._active_futures.pop(future._uid, None)
    with contextlib.suppress(Exception):  # InvalidStateError: answered meanwhile
        if not future.done():
            future.set_exception(error)


def _watch_dht_process(sd: "SwarmDHT") -> None:
    """Runs in the role (a thread): wait until ``sd``'s DHT process exits; unless shutting down, it is lost."""
    multiprocessing.connection.wait([sd.dht.sentinel])  # not joined here: shutdown() reaps it
    fail_pending = getattr(sd, "_fail_pending", None)  # (the tests' stand-ins for a node have none)
    if fail_pending is not None:
        fail_pending()  # first: a stop of the role may wait on them
    if sd._closing or _exiting:  # (a process leaving without shutdown(): not a lost node, no error logged)
        return
    signum = _killed_by(sd.dht)
    # unknown: a thread of the role reaped it, maybe while stopping on the same SIGTERM: it gets the grace too
    if signum in _STOP_SIGNALS or signum == _STATUS_UNKNOWN:
        sd._shut.wait(STOP_SIGNAL_GRACE_S)  # the role's own stop, if one was asked for
        if sd._closing or _exiting:
            return
        if signum == _STATUS_UNKNOWN:
            signum = _killed_by(sd.dht)  # recorded by now
    sd.lost = True
    how = f"was killed by {signal.Signals(signum).name}" if signum in set(signal.Signals) else "exited unexpectedly"
    logger.error(f"the DHT process (pid {sd.dht.pid}) {how}: this node can no longer publish or read swarm records")
    callback = _on_lost
    if callback is not None:
        callback(sd)


def _descendants(pid: int) -> list[psutil.Process]:
    """The processes ``pid`` started, and theirs (a DHT process's p2pd)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _daemons_of(dht: DHT) -> list[psutil.Process]:
    """The processes the DHT process started (its p2pd)."""
    return _descendants(dht.pid)


def _kill_orphans(daemons: Sequence[psutil.Process], timeout_s: float = 5.0) -> None:
    """Kill those of ``daemons`` still running and wait until they are gone or zombies (an orphan's reaping is up
    to init): a p2pd whose DHT process was killed outlives it until its next log line. (psutil checks the
    process's start time, so a reused pid is never signalled.)"""
    for proc in daemons:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + timeout_s
    for proc in daemons:
        while time.monotonic() < deadline:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def _await_ready(dht: DHT, timeout_s: float) -> None:
    """Wait for ``dht`` to report ready; if it does not within ``timeout_s``, or the wait is interrupted (Ctrl-C
    while joining), kill it and its p2pd and raise. (Interrupted, the p2pd outlived its role: multiprocessing's exit
    handler terminates the DHT process, which does not stop its daemon.)"""
    try:
        dht.wait_until_ready(timeout_s)
        return
    except concurrent.futures.TimeoutError:
        pass
    except BaseException:
        _kill_dht(dht)
        raise
    _kill_dht(dht)
    raise RuntimeError(f"the DHT process (pid {dht.pid}) did not become ready within {timeout_s:g} s and was "
                       f"killed; see the log above for what it was doing (p2pd start, bootstrap)")


def _kill_dht(dht: DHT) -> None:
    """Kill the DHT process and the p2pd it started."""
    daemons = _daemons_of(dht)
    dht.kill()
    dht.join(5)
    _kill_orphans(daemons)


class _SwarmSchemaValidator(SchemaValidator):
    """SchemaValidator for the keys ``{prefix}.servers|assignment|summary`` (hivemind's own prefix uses '_')."""

    def __init__(self, prefix: str):
        super().__init__(SwarmSchemaV1, allow_extra_keys=True)
        self._key_id_to_field_name = {
            DHTID.generate(source=f"{check_prefix(prefix)}.{name}").to_bytes(): name
            for name in SwarmSchemaV1.__fields__
        }


class _DirectorySchemaValidator(SchemaValidator):
    """SchemaValidator for the swarm directory key ``petals-chain.swarms``."""

    def __init__(self):
        super().__init__(DirectorySchemaV1, allow_extra_keys=True)
        self._key_id_to_field_name = {DHTID.generate(source=DIRECTORY_KEY).to_bytes(): "swarms"}


class SwarmDHT:
    """A hivemind DHT node with the swarm's validators; see the module docstring for the trust model."""

    def __init__(self, dht: DHT, private_key: RSAPrivateKey, temp_identity: Optional[str], prefixes: Sequence[str]):
        self.dht = dht
        self.private_key = private_key
        self._temp_identity = temp_identity
        self._rsa = RSASignatureValidator(private_key)
        self.owner_key: bytes = self._rsa.local_public_key
        self.peer_id: str = dht.peer_id.to_base58()
        derived = peer_id_of_owner(self.owner_key)
        if derived != self.peer_id:  # would mean hivemind changed its identity format
            raise RuntimeError(f"libp2p peer id {self.peer_id} is not derived from the RSA owner key ({derived})")
        self._prefixes = set(prefixes)
        self._reported_invalid: set[tuple[str, str]] = set()  # (owner peer id, what): warned once each
        self._lifetimes = RecordLifetimes()  # records outlive a writer whose clock is ahead by no more than their TTL
        self._expirations = StoredExpirations()  # ours never expire before those we stored (a clock stepped back)
        self._in_flight: set[Any] = set()  # the DHT process's replies a store waits for (see _store)
        self._daemons = _daemons_of(dht)  # p2pd, killed at shutdown if the DHT process died without stopping it
        self._closing = False
        self._shut = threading.Event()  # set with _closing: ends the watch's grace for a stop signal (below)
        self._pending: "weakref.WeakSet[Any]" = weakref.WeakSet()  # replies awaited from the DHT process
        self._pending_lock = threading.Lock()
        self._exited = False  # the DHT process is gone: no reply will come
        self.lost = False  # the DHT process exited before shutdown() (see on_dht_lost)
        self._watch = threading.Thread(target=_watch_dht_process, args=(self,), name="dht-process-watch", daemon=True)
        self._watch.start()

    @classmethod
    def create(
        cls,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        identity_path: Optional[str] = None,
        client_mode: bool = False,
        *,
        prefix: Optional[str] = None,
        ready_timeout_s: float = DHT_READY_TIMEOUT_S,
        **dht_kwargs: Any,
    ) -> "SwarmDHT":
        """Start a DHT node. ``identity_path``: RSA identity file (created if missing; a temporary one if None).

        ``prefix``: register the schema validator for that model prefix now (others are added on first use).
        ``ready_timeout_s``: a DHT process not ready by then is killed (with its p2pd) and RuntimeError raised,
        instead of waiting forever on a process that hung while starting.
        """
        use_temp_dir_for_p2p_sockets()  # (tempfile.tempdir may have been set since import)
        temp_identity = None
        for path in remove_stale_temp_identities():
            logger.info(f"removed {path}: the temporary identity of a process that no longer runs")
        if identity_path is None:
            # the key goes into the file mkstemp made (0600, ours): deleted, then re-created by name, the file could
            # be planted meanwhile by another user (a predictable name in a shared directory)
            fd, temp_identity = tempfile.mkstemp(prefix=f"{_TEMP_IDENTITY_PREFIX}{os.getpid()}-")
            _temp_identities.add(temp_identity)
            identity_path = temp_identity
        try:  # (from here on a temporary identity file is deleted whatever happens)
            if temp_identity is not None:
                _write_identity(fd)
                fresh = True
            else:
                # every role's --identity-path: a quoted or --flag=~/x path comes with its ~ (the key went to ./~/, a
                # new peer id when started from another directory)
                identity_path = os.path.expanduser(identity_path)
                fresh = not os.path.isfile(identity_path) and generate_identity(identity_path)
            if fresh:  # a key generated this instant cannot be in use elsewhere: skip hivemind's network check
                dht_kwargs.setdefault("check_if_identity_free", False)
            private_key = load_identity(identity_path)
            prefixes = [check_prefix(prefix)] if prefix is not None else []
            validators = ([RSASignatureValidator(private_key), _DirectorySchemaValidator()]
                          + [_SwarmSchemaValidator(p) for p in prefixes])
            dht = _DHTProcess(
                initial_peers=list(initial_peers or []),
                start=True,
                await_ready=False,
                host_maddrs=list(host_maddrs),
                identity_path=identity_path,
                client_mode=client_mode,
                record_validators=validators,
                **dht_kwargs,
            )
            _await_ready(dht, ready_timeout_s)
        except BaseException:
            if temp_identity is not None:
                if os.path.exists(temp_identity):
                    os.unlink(temp_identity)
                _temp_identities.discard(temp_identity)
            raise
        if temp_identity is not None:  # p2pd has read it; the key lives on in memory only
            os.unlink(temp_identity)
            _temp_identities.discard(temp_identity)
            temp_identity = None
        # hivemind sends commands without a lock; commands from several threads (asyncio.to_thread) interleave
        # their bytes when larger than one pipe write and the DHT process dies on the garbled stream.
        dht._outer_pipe = _LockedConnection(dht._outer_pipe)
        dht.run_coroutine(_blocking_command_pipe)
        return cls(dht, private_key, temp_identity, prefixes)

    # ---- plumbing ----

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def replicate_p2p(self) -> P2P:
        return await self.dht.replicate_p2p()

    def _tracked(self, future: Any) -> Any:
        """``future``, a reply of the DHT process, failed by :meth:`_fail_pending` if that process exits before it
        replies: hivemind awaited it for ever (a role's stop hung in its assignment poll, its DHT process gone)."""
        with self._pending_lock:
            if not self._exited:
                self._pending.add(future)
                return future
        _fail(future, self._exit_error())
        return future

    def _exit_error(self) -> RuntimeError:
        return RuntimeError(f"the DHT process (pid {self.dht.pid}) exited: it no longer answers")

    def _fail_pending(self) -> None:
        """The DHT process has exited: fail the replies still awaited from it (and any asked for from now on)."""
        with self._pending_lock:
            self._exited = True
            pending = list(self._pending)
            self._pending.clear()
        for future in pending:
            _fail(future, self._exit_error())

    def _get(self, key: str, return_future: bool = False):
        """``dht.get(key, latest=True)``: the value, or its future; failing once the DHT process has exited."""
        future = self._tracked(self.dht.get(key, latest=True, return_future=True))
        return future if return_future else future.result()

    def _rejoin_future(self, peer_ids: Sequence[str], timeout_s: float):
        """Start :func:`_rejoin_peers` in the DHT process; None when there is nobody (else) to ping."""
        peer_ids = tuple(p for p in peer_ids if p and p != self.peer_id)
        if not peer_ids:
            return None
        return self._tracked(self.dht.run_coroutine(
            functools.partial(_rejoin_peers, peer_ids=peer_ids, timeout_s=timeout_s), return_future=True))

    async def arejoin(self, peer_ids: Sequence[str], timeout_s: float = 5.0) -> list[str]:
        """Ping those of ``peer_ids`` (base58, e.g. the initial peers) that are not in our routing table.

        Call it periodically: a peer that stopped answering was dropped from the table and is found again here
        once it is back (same identity and address), even if it restarted with an empty DHT. Returns the peer
        ids that answered (we are in their routing tables now; re-store records so they hold them)."""
        future = self._rejoin_future(peer_ids, timeout_s)
        return [] if future is None else await future

    def rejoin(self, peer_ids: Sequence[str], timeout_s: float = 5.0) -> list[str]:
        """Blocking :meth:`arejoin` (for threads that poll the DHT, e.g. the dashboard)."""
        future = self._rejoin_future(peer_ids, timeout_s)
        return [] if future is None else future.result(timeout=2 * timeout_s + 5.0)

    def _ensure_prefix(self, prefix: str) -> None:
        check_prefix(prefix)
        if prefix not in self._prefixes:
            self.dht.add_validators([_SwarmSchemaValidator(prefix)])
            self._prefixes.add(prefix)

    def _store(self, key: str, value: dict, expiration_s: float, return_future: bool):
        """Store ``value`` under ``key`` and our subkey for ``expiration_s``: True if stored (or a future of it).

        Never expiring before an entry of ours the DHT holds (:class:`StoredExpirations`): a store that nodes refuse
        is made again just after the entry of ours they hold, if that is why (one stored by this identity before this
        process started, with a clock that was ahead: a server restarted once its clock was set right)."""
        if not (expiration_s > 0):
            raise ValueError(f"expiration_s must be positive, got {expiration_s}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        expiration = self._expirations.next(key, expiration_s)

        def then(reply: Any, on_result: Callable[[Any], None]) -> None:
            """Wait for the DHT process's ``reply`` (held here until it comes: an MPFuture nobody references is
            dropped, its reply with it), then ``on_result(its result)``; errors and cancellation go to ``done``."""
            self._in_flight.add(reply)

            def relay(future: Any) -> None:
                self._in_flight.discard(future)
                if done.done():  # (cancelled by its caller)
                    return
                try:
                    if future.cancelled():
                        done.cancel()
                    else:
                        on_result(future.result())
                except BaseException as e:  # noqa: BLE001 - relayed to whoever waits on ``done``
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        done.set_exception(e)

            reply.add_done_callback(relay)

        def elsewhere(ask: Callable[[], None]) -> None:
            """``ask()`` the DHT process from a thread of its own: the callbacks run in the thread that reads every
            reply of the DHT process, which must not wait on a pipe."""
            def run() -> None:
                try:
                    ask()
                except BaseException as e:  # noqa: BLE001 - relayed to whoever waits on ``done``
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        done.set_exception(e)
            threading.Thread(target=run, name="dht-store-again", daemon=True).start()

        def stored(ok: Any) -> None:
            if ok:
                done.set_result(ok)
            else:  # refused, or no node answered: our entry held there says whether its expiration is why
                elsewhere(lambda: then(self._get(key, return_future=True), held))

        def held(result: Any) -> None:
            item = result.value.get(self.owner_key) if result is not None and isinstance(result.value, dict) else None
            later = self._expirations.after(key, item.expiration_time, expiration) if item is not None else None
            if later is None:
                done.set_result(False)
            else:
                elsewhere(lambda: then(self._tracked(self.dht.store(key, value, later, subkey=self.owner_key,
                                                                    return_future=True)), done.set_result))

        then(self._tracked(self.dht.store(key, value, expiration, subkey=self.owner_key, return_future=True)), stored)
        return done if return_future else done.result()

    def _read(self, model: Any, value: Any, owner_peer: str, what: str) -> Any:
        """``model.from_value(value)``, or None with a warning (once per writer and kind) naming the writer's
        version: a peer whose records this version cannot read is otherwise invisible to it."""
        try:
            record = model.from_value(value)
            age = time.time() - record.timestamp
            if not -MAX_RECORD_TTL_S <= age <= MAX_RECORD_TTL_S:
                raise ValueError(f"its timestamp is {age / 3600:.1f} h old (more than {MAX_RECORD_TTL_S / 3600:.0f} h "
                                 "either way)")
            return record
        except Exception as e:  # noqa: BLE001 - anything a peer wrote must not break the reader
            version = value.get("version") if isinstance(value, dict) else None
            version = version[:64] if isinstance(version, str) else None  # a peer's string (a build), in our log
            key = (owner_peer, what)
            log = logger.debug if key in self._reported_invalid else logger.warning
            if len(self._reported_invalid) >= 4096:  # bounded: writers can be made up by the thousand
                self._reported_invalid.clear()
            self._reported_invalid.add(key)
            writer = f"written by {version!r}, " if isinstance(version, str) else ""
            log(f"ignoring the {what} of {owner_peer} ({writer}this peer runs {RECORD_VERSION}): "
                f"{' '.join(str(e).split())[:300]}")
            return None

    def _owned_entries(self, result, key: str) -> list[tuple[str, Any]]:
        """(peer id derived from the owner key, raw value) for each live subkey entry of the DHT get result of
        ``key``."""
        if result is None or not isinstance(result.value, dict):
            return []
        out = []
        latest = get_dht_time() + MAX_RECORD_TTL_S
        for subkey, item in result.value.items():
            owner_peer = peer_id_of_owner(subkey)
            if owner_peer is None or item.expiration_time > latest:
                continue
            stamp = item.value.get("timestamp") if isinstance(item.value, dict) else None
            if not self._lifetimes.live(owner_peer, stamp, item.expiration_time, where=key):
                continue
            out.append((owner_peer, item.value))
        return out

    # ---- servers ----

    def publish_server(self, prefix: str, record: ServerRecord, expiration_s: float, *, return_future: bool = False):
        """Store our server record (signed; subkey = our owner key). Returns True if stored (or a future)."""
        self._ensure_prefix(prefix)
        if record.peer_id != self.peer_id:
            raise ValueError(f"record.peer_id {record.peer_id} is not this node's peer id {self.peer_id}")
        return self._store(servers_key(prefix), record.to_value(), expiration_s, return_future)

    def _parse_servers(self, result, key: str) -> dict[str, ServerRecord]:
        servers: dict[str, ServerRecord] = {}
        for owner_peer, value in self._owned_entries(result, key):
            record = self._read(ServerRecord, value, owner_peer, "server record")
            if record is None:
                continue
            if record.peer_id != owner_peer:
                logger.warning(f"dropping forged server record: owner key is {owner_peer}, claims {record.peer_id}")
                continue
            servers[owner_peer] = record
        return servers

    def fetch_servers(self, prefix: str) -> dict[str, ServerRecord]:
        """Valid, owner-bound server records: peer_id -> ServerRecord."""
        self._ensure_prefix(prefix)
        key = servers_key(prefix)
        return self._parse_servers(self._get(key), key)

    async def afetch_servers(self, prefix: str) -> dict[str, ServerRecord]:
        self._ensure_prefix(prefix)
        key = servers_key(prefix)
        return self._parse_servers(await self._get(key, return_future=True), key)

    async def apublish_server(self, prefix: str, record: ServerRecord, expiration_s: float) -> bool:
        return await asyncio.wrap_future(self.publish_server(prefix, record, expiration_s, return_future=True))

    # ---- assignment ----

    def publish_assignment(self, prefix: str, record: AssignmentRecord, expiration_s: float, *, return_future=False):
        """Store the orchestrator's assignment (this node must be the orchestrator named in the record)."""
        self._ensure_prefix(prefix)
        if record.orchestrator_peer_id != self.peer_id:
            raise ValueError("record.orchestrator_peer_id must be this node's peer id")
        return self._store(assignment_key(prefix), record.to_value(), expiration_s, return_future)

    def _trusted_records(self, result, key: str, trusted: Iterable[str], model: Any, what: str
                         ) -> list[tuple[str, Any]]:
        """``(owner peer id, record)`` for each entry of the DHT get result of ``key`` written by a ``trusted``
        orchestrator, valid as ``model`` and naming its writer as ``orchestrator_peer_id`` (forged and malformed
        entries are dropped)."""
        trusted = set(trusted)
        out = []
        for owner_peer, value in self._owned_entries(result, key):
            if owner_peer not in trusted:
                continue
            record = self._read(model, value, owner_peer, what)
            if record is None:
                continue
            if record.orchestrator_peer_id == owner_peer:
                out.append((owner_peer, record))
        return out

    def _parse_assignment(self, result, key: str, trusted: Iterable[str], peer_id: Optional[str] = None
                          ) -> Optional[AssignmentRecord]:
        best: Optional[AssignmentRecord] = None
        mine: Optional[AssignmentRecord] = None  # the newest that gives ``peer_id`` a span
        for _, record in self._trusted_records(result, key, trusted, AssignmentRecord, "assignment"):
            if best is None or (record.epoch, record.timestamp) > (best.epoch, best.timestamp):
                best = record
            if peer_id is not None and peer_id in record.assignments and (mine is None
                                                                           or record.timestamp > mine.timestamp):
                mine = record
        return mine or best

    def fetch_assignment(self, prefix: str, trusted: Sequence[str], peer_id: Optional[str] = None
                         ) -> Optional[AssignmentRecord]:
        """The assignment to follow, signed by a trusted orchestrator: the newest that gives ``peer_id`` a span
        (several orchestrators each assign their own group), else the newest-epoch one; None if none."""
        self._ensure_prefix(prefix)
        key = assignment_key(prefix)
        return self._parse_assignment(self._get(key), key, trusted, peer_id)

    async def afetch_assignment(self, prefix: str, trusted: Sequence[str], peer_id: Optional[str] = None
                                ) -> Optional[AssignmentRecord]:
        self._ensure_prefix(prefix)
        key = assignment_key(prefix)
        return self._parse_assignment(await self._get(key, return_future=True), key, trusted, peer_id)

    # ---- groups (several orchestrators) ----

    async def apublish_group(self, prefix: str, record: GroupRecord, expiration_s: float) -> bool:
        """Store this orchestrator's entry under ``{prefix}.groups`` (it must name this node)."""
        self._ensure_prefix(prefix)
        if record.orchestrator_peer_id != self.peer_id:
            raise ValueError("record.orchestrator_peer_id must be this node's peer id")
        return await asyncio.wrap_future(self._store(groups_key(prefix), record.to_value(), expiration_s, True))

    async def afetch_groups(self, prefix: str, trusted: Iterable[str]) -> dict[str, GroupRecord]:
        """``{orchestrator peer id: its entry}`` for the trusted orchestrators with a live entry."""
        self._ensure_prefix(prefix)
        key = groups_key(prefix)
        return dict(self._trusted_records(await self._get(key, return_future=True), key, trusted, GroupRecord,
                                          "group entry"))

    # ---- model placement (several models) ----

    async def apublish_placement(self, prefix: str, record: PlacementRecord, expiration_s: float) -> bool:
        """Store this orchestrator's model placement under ``{prefix}.placement`` (it must name this node)."""
        self._ensure_prefix(prefix)
        if record.orchestrator_peer_id != self.peer_id:
            raise ValueError("record.orchestrator_peer_id must be this node's peer id")
        return await asyncio.wrap_future(self._store(placement_key(prefix), record.to_value(), expiration_s, True))

    async def afetch_placement(self, prefixes: Iterable[str], trusted: Iterable[str], peer_id: str
                               ) -> Optional[PlacementRecord]:
        """The newest placement signed by a trusted orchestrator under any of ``prefixes`` that places ``peer_id``
        (None if none does)."""
        trusted = list(trusted)
        best: Optional[PlacementRecord] = None
        for prefix in prefixes:
            self._ensure_prefix(prefix)
            key = placement_key(prefix)
            result = await self._get(key, return_future=True)
            for _, record in self._trusted_records(result, key, trusted, PlacementRecord, "placement"):
                if peer_id in record.placement and (best is None or record.timestamp > best.timestamp):
                    best = record
        return best

    # ---- summary ----

    def publish_summary(self, prefix: str, summary: dict, expiration_s: float, *, return_future: bool = False):
        """Store the orchestrator's swarm summary (the ``GET /api/v1/swarm`` JSON object)."""
        self._ensure_prefix(prefix)
        record = SummaryRecord.wrap(self.peer_id, summary)
        return self._store(summary_key(prefix), record.to_value(), expiration_s, return_future)

    def _parse_summary(self, result, key: str, trusted: Iterable[str]) -> Optional[dict]:
        best: Optional[SummaryRecord] = None
        for _, record in self._trusted_records(result, key, trusted, SummaryRecord, "summary"):
            try:
                record.summary()
            except Exception:  # noqa: BLE001 - JSON text that does not parse: not a summary
                continue
            if best is None or record.timestamp > best.timestamp:
                best = record
        return best.summary() if best is not None else None

    def fetch_summary(self, prefix: str, trusted: Sequence[str]) -> Optional[dict]:
        """The newest summary signed by a trusted orchestrator, or None."""
        self._ensure_prefix(prefix)
        key = summary_key(prefix)
        return self._parse_summary(self._get(key), key, trusted)

    async def afetch_summary(self, prefix: str, trusted: Sequence[str]) -> Optional[dict]:
        self._ensure_prefix(prefix)
        key = summary_key(prefix)
        return self._parse_summary(await self._get(key, return_future=True), key, trusted)

    # ---- swarm directory ----

    def publish_directory(self, prefix: str, model: str, http_url: str, expiration_s: float, *,
                          return_future: bool = False):
        """Announce (signed) that this orchestrator runs the swarm ``prefix`` serving ``model`` at ``http_url``."""
        record = DirectoryRecord(orchestrator_peer_id=self.peer_id, dht_prefix=check_prefix(prefix),
                                 model=str(model)[:512], http_url=str(http_url)[:512])
        return self._store(DIRECTORY_KEY, record.to_value(), expiration_s, return_future)

    def fetch_directory(self, trusted: Sequence[str]) -> list[DirectoryRecord]:
        """Directory entries signed by trusted orchestrators (newest first); forged or unsigned ones are dropped."""
        out = []
        result = self._get(DIRECTORY_KEY)
        for _, record in self._trusted_records(result, DIRECTORY_KEY, trusted, DirectoryRecord, "directory entry"):
            try:
                check_prefix(record.dht_prefix)
            except ValueError:  # a malformed entry is simply not listed
                continue
            out.append(record)
        return sorted(out, key=lambda r: -r.timestamp)

    @property
    def alive(self) -> bool:
        """Whether the DHT process runs (a signal to the whole process group may have ended it first)."""
        return self.dht.is_alive()

    def shutdown(self) -> None:
        """Stop the DHT process (and its p2pd, also when the DHT process was killed: hivemind's "hard way" after a
        slow shutdown, or a signal)."""
        self._closing = True
        self._shut.set()
        if self.dht.is_alive():
            self.dht.shutdown()
        self.dht.join(timeout=10)
        if not self.dht.is_alive():
            _kill_orphans(self._daemons)
        if self._temp_identity is not None and os.path.exists(self._temp_identity):
            os.unlink(self._temp_identity)
