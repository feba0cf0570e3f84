"""``python -m petals_chain.orchestrator``: the swarm's frontend (planner, JFFC dispatch, relay, HTTP API)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import urllib.parse
from typing import Any

from petals_chain.swarm.console import say
from petals_chain.swarm.logs import log_level
from petals_chain.swarm.version import build_version, version_asked

logger = logging.getLogger("petals_chain.orchestrator")

# Running requests' grace at a stop: with the stop after it (servers' sessions closed, the DHT node stopped, the
# process gone: ~0.5-1 s measured on a busy 2-core host) within docker stop's 10 s (Kubernetes gives 30 s), after which
# the process is killed: no stream gets its last event, no server session is closed.
DEFAULT_SHUTDOWN_GRACE_S = 5.0


def arrival_rate_arg(text: str) -> float | None:
    """``--arrival-rate``: ``auto`` (None) or a positive finite number of requests per second."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive number, got {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"arrival rate must be positive and finite, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_float(text: str) -> float:
    v = _number(text)
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return v


def _cors_origins(text: str) -> list[str]:
    from petals_chain.orchestrator.api import cors_origins

    try:
        return cors_origins(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _nonnegative_float(text: str) -> float:
    v = _number(text)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text}")
    return v


def _speculative(text: str) -> tuple[str, str | None]:
    """``none`` | ``ngram`` | ``draft:MODEL`` -> (mode, draft model or None)."""
    if text in ("none", "ngram", "draft"):
        return text, None
    if text.startswith("draft:") and text[len("draft:"):].strip():
        return "draft", text[len("draft:"):].strip()
    raise argparse.ArgumentTypeError(f"expected none, ngram, draft or draft:MODEL, got {text!r}")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _auto_or_positive_int(text: str) -> int | None:
    """``auto`` (None) or a positive integer."""
    if text == "auto":
        return None
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}") from None


def _auto_or_positive_float(text: str) -> float | None:
    return None if text == "auto" else _positive_float(text)


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (:func:`ignored_flags` names those the others make moot;
    a default compared by value cannot tell a flag given its default value from one left out)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


# the policies with DLPM's quantum Q^u (d2lpm runs DLPM on each chain) and D2LPM's per-chain Q^w
QUANTUM_POLICIES, WORKER_QUANTUM_POLICIES = ("dlpm", "d2lpm"), ("d2lpm",)


def ignored_flags(args: argparse.Namespace, fairness: str) -> list[str]:
    """The flags given that nothing reads with the other options (``fairness``: ``--fairness`` resolved, auto
    included), each with why: accepted (scripts pass them for every policy), but an operator is told at start."""
    given = getattr(args, "given", frozenset())
    out = []
    if "fairness_quantum" in given and fairness not in QUANTUM_POLICIES:
        out.append(f"--fairness-quantum: --fairness {fairness} has no quantum (only "
                   f"{' and '.join(QUANTUM_POLICIES)} have)")
    if "fairness_worker_quantum" in given and fairness not in WORKER_QUANTUM_POLICIES:
        out.append(f"--fairness-worker-quantum: only --fairness d2lpm has a per-chain quantum, not {fairness}")
    if "schedule_classes" in given and args.schedule not in ("db", "mlfq"):
        out.append(f"--schedule-classes: only --schedule db and mlfq form services by length, not {args.schedule}")
    return out


def _max_length(text: str) -> int:
    v = _positive_int(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 tokens, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    # imported here, not at the top: they take seconds (torch), and a Ctrl-C meanwhile is then main()'s to answer
    from petals_chain.algorithms.fairness import FAIRNESS_POLICIES
    from petals_chain.algorithms.multimodel import PLACEMENT_RULES
    from petals_chain.orchestrator.dispatch import DISPATCH_POLICIES as DISPATCHES
    from petals_chain.orchestrator.dispatch import PLACEMENT_POLICIES as PLACEMENTS
    from petals_chain.orchestrator.dispatch import SCHEDULES
    from petals_chain.orchestrator.drafting import DRAFT_TIMEOUT_S
    from petals_chain.orchestrator.placement import PLACEMENT_INDEXES, PLACEMENT_POLICIES
    from petals_chain.orchestrator.planner import SERVER_RECORD_TTL_S
    from petals_chain.swarm.webpage import host_arg

    p = argparse.ArgumentParser(prog="python -m petals_chain.orchestrator", description=__doc__)
    p.add_argument("--version", action="version", version=build_version(),
                   help="print the build this orchestrator runs (as /healthz says it) and exit")
    p.add_argument("--model", required=True, action="append", metavar="[NAME=]SOURCE",
                   help="a short name (smollm2-135m; fetched by scripts/setup.sh), a .gguf file, an HF-format "
                        "directory or a hub name. Repeat as NAME=SOURCE to serve several models: each has its own "
                        "servers (those started with that model), chains and queue; requests choose by 'model'")
    p.add_argument("--adapter", action="append", default=[], metavar="[MODEL:]NAME=PATH",
                   help="serve a LoRA adapter (a directory in peft's format) as the model id NAME, on the servers "
                        "that announce it (started with --adapter); read here only to validate it and learn its "
                        "fingerprint. Repeatable (at most 8 per model); with several --model, MODEL:NAME=PATH")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"],
                   help="libp2p multiaddrs to listen on (the swarm's initial peers); e.g. /ip4/0.0.0.0/tcp/31337")
    p.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR",
                   help="the addresses servers on other hosts should dial (e.g. behind a port forward); default: "
                        "the addresses the daemon listens on")
    p.add_argument("--public-ip", default=None, metavar="IP",
                   help="shorthand: listen on all interfaces at --p2p-port and announce IP there")
    p.add_argument("--public-url", default=None, metavar="URL",
                   help="where others reach this HTTP API: the swarm directory, other orchestrators (--group-with) "
                        "and the dashboard use it (default: http(s)://HOST:PORT, with --public-ip as the host when "
                        "--host is 0.0.0.0); e.g. the reverse proxy's https://swarm.example.org")
    p.add_argument("--p2p-port", type=int, default=0, metavar="PORT",
                   help="TCP port for peer-to-peer traffic (with --public-ip: default a free one, picked once)")
    p.add_argument("--no-relay-service", action="store_true",
                   help="do not relay for servers that nobody can dial (servers behind NAT then cannot serve)")
    p.add_argument("--ssl-certfile", default=None, help="serve the HTTP API and dashboard over HTTPS with this "
                                                        "certificate (PEM; with --ssl-keyfile)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    p.add_argument("--initial-peers", nargs="*", default=[], help="join an existing DHT instead of starting one")
    p.add_argument("--identity-path", default=None, help="RSA identity file (created if missing): a stable peer id")
    p.add_argument("--group-with", nargs="+", default=[], metavar="PEER_ID", type=_peer_id,
                   help="the other orchestrators of this swarm (their peer ids): the servers are split into one "
                        "group per live orchestrator (HERD), each orchestrator plans its own; a lost one's group "
                        "goes to the others. Servers must trust every one (--trust-orchestrator)")
    p.add_argument("--group-ttl-s", type=_positive_float, default=6.0, metavar="S",
                   help="with --group-with: an orchestrator silent this long is taken for gone")
    p.add_argument("--host", default="127.0.0.1", type=host_arg,
                   help="HTTP bind address (0.0.0.0: every IPv4 interface; ::, every interface, IPv6 and IPv4)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="where the embeddings, LM head and sampling run: cpu, cuda, cuda:N")
    p.add_argument("--arrival-rate", type=arrival_rate_arg, default=None, metavar="auto|X",
                   help="request arrival rate for planning (req/s); auto: estimated online")
    p.add_argument("--rho-bar", type=float, default=0.7, help="target load factor of GBP-CR (0, 1]")
    p.add_argument("--max-length", type=_max_length, default=1024,
                   help="tokens per job (prompt + output); one cache slot holds this many")
    p.add_argument("--placement", default="gbp-cr", choices=list(PLACEMENTS))
    p.add_argument("--spare-servers", default="use", choices=["use", "idle"],
                   help="--placement gbp-cr: 'use' also gives blocks to the servers GBP-CR does not need for the "
                        "arrival rate (more capacity behind the fastest chains, for bursts); 'idle' leaves them "
                        "without blocks, exactly as the paper's Alg. 1")
    p.add_argument("--dispatch", default="jffc", choices=list(DISPATCHES))
    p.add_argument("--petals-cache-tokens", type=_positive_int, default=4096,
                   help="--placement petals: PETALS' fixed attention cache per block, in tokens")
    p.add_argument("--bprr-r", type=_positive_int, default=None,
                   help="--placement bprr: CG-BP target concurrency R (default: the c* GBP-CR picks)")
    p.add_argument("--route-wait-s", type=_nonnegative_float, default=600.0,
                   help="--dispatch petals|bprr: how long a routed request may wait at its servers for slots")
    p.add_argument("--queue-timeout-s", type=_positive_float, default=600.0,
                   help="longest wait of a request for a chain (then 503)")
    p.add_argument("--sse-keepalive-s", type=_nonnegative_float, default=15.0, metavar="S",
                   help="send an SSE keepalive comment on a stream silent this long (waiting in the queue: proxies "
                        "such as nginx cut a stream silent for 60 s); 0: never")
    p.add_argument("--cors-origins", type=_cors_origins, default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="let web pages from these origins (scheme://host[:port], as a browser sends them; * for any) "
                        "call the API from a browser: preflights answered without a key, replies readable by the "
                        "page; cookies never (keys go in Authorization). Off by default (no page of another origin "
                        "can read a reply)")
    p.add_argument("--shutdown-grace-s", type=_nonnegative_float, default=DEFAULT_SHUTDOWN_GRACE_S, metavar="S",
                   help="on SIGTERM or Ctrl-C: new requests get 503 (and /healthz too) and queued ones at once, "
                        "running ones get this long to finish, then are cut (a stream with a last error event); the "
                        "stop after it takes ~1-3 s more, within docker's 10 s by default (a second signal ends the "
                        "grace at once; one more exits at once)")
    p.add_argument("--no-chain-wait-s", type=_nonnegative_float, default=30.0,
                   help="a new request while no chain serves its model (no server ready) waits this long, then 503")
    p.add_argument("--max-choices", type=_positive_int, default=8,
                   help="completions one request may ask for (prompts x n); more get 400")
    p.add_argument("--max-queue", type=_positive_int, default=1024,
                   help="generation requests admitted beyond the chains' capacity; more get 429 + Retry-After (with "
                        "--api-keys and a client-fair --fairness, one client may hold 4x the places left free after "
                        "it)")
    p.add_argument("--client-max-inflight", type=_positive_int, default=256,
                   help="running + queued requests per client (API key; without --api-keys every request is one "
                        "anonymous client); more get 429")
    p.add_argument("--client-max-sessions", type=_positive_int, default=64,
                   help="open multi-turn sessions per client (API key; without --api-keys every request is one "
                        "anonymous client)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=8 * 1024 * 1024, help="request body limit (413)")
    p.add_argument("--max-sessions", type=_positive_int, default=1024,
                   help="open multi-turn sessions in total, all clients together; more get 429")
    p.add_argument("--session-idle-timeout-s", type=_positive_float, default=300.0,
                   help="a session without a turn for this long is closed (its chain and KV released)")
    p.add_argument("--speculative", default="none", type=_speculative, metavar="none|ngram|draft[:MODEL]",
                   help="speculative decoding: ngram drafts up to k tokens by prompt lookup (the tokens that followed "
                        "the latest earlier occurrence of the last 1-3 tokens), draft:MODEL by a draft model's greedy "
                        "choices (a registry name, a path, or 'self': the served model; same tokenizer; with "
                        "--draft-layers only its first layers run); the chain verifies them with the token just "
                        "sampled in one relay step; greedy output is unchanged, sampled output keeps its "
                        "distribution. A request's \"speculative\" field overrides it ('draft' needs a draft model: "
                        "draft:MODEL or --draft-model). Default: none")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="load a draft model for requests asking for \"speculative\": \"draft\" without making it "
                        "the default (--speculative draft:MODEL does both)")
    p.add_argument("--draft-layers", type=_positive_int, default=None, metavar="N",
                   help="run only the draft model's first N decoder layers (self-speculative with draft:self)")
    p.add_argument("--draft-timeout-s", type=_positive_float, default=None, metavar="S",
                   help="a draft model call that finishes no forward (of a token, or of a piece of the prompt) for "
                        "S seconds, or waits that long for the draft model, gives up: that generation goes on "
                        f"without drafts (a hung draft model). Default: {DRAFT_TIMEOUT_S:g}")
    p.add_argument("--relay", default="orchestrator", choices=["orchestrator", "push"],
                   help="how a step crosses a chain: orchestrator (every hop's output comes back here and goes on to "
                        "the next hop; the paper's mode) or push (each server pushes its output straight to the next "
                        "one over routes only this orchestrator can make; hops + 1 network legs per step instead of "
                        "2 x hops). Default: orchestrator")
    p.add_argument("--speculative-k", type=int, default=4, metavar="K",
                   help="first draft length; it adapts per request (+2 when all drafts are kept, -1 otherwise, "
                        "at most 16). Default: 4")
    p.add_argument("--hold-sessions", action="store_true",
                   help="a multi-turn session keeps its chain and server sessions between turns (its next turn "
                        "starts at once, but the chain's capacity stays taken while the user types). Default: "
                        "release the chain after each turn where every hop has a prefix cache; the next turn "
                        "reuses the cached KV and recomputes only what was evicted")
    p.add_argument("--output-reserve-tokens", type=int, default=256, metavar="N",
                   help="a job's chain is opened for its prompt plus N tokens (at most its max_tokens), not for the "
                        "whole max_tokens: a job that outgrows it asks its servers for more (N doubling), and one a "
                        "server has no pages for gives its chain back and resumes later, reusing its cached KV. "
                        "0: open for prompt + max_tokens")
    p.add_argument("--job-tokens", type=_auto_or_positive_int, default=None, metavar="auto|N",
                   help="L^: KV tokens per job that a paged server's chain capacity counts (its token budget over "
                        "L^). auto: the mean declared length (prompt + max_tokens) of the last 256 jobs, "
                        "max_length until 16 were seen. A burst of longer jobs waits at the servers, never "
                        "over-commits. Slot-mode servers count max_length slots either way")
    p.add_argument("--fairness", default="auto", choices=["auto", *FAIRNESS_POLICIES],
                   help="how waiting requests share the chains among clients (API key names; without keys all "
                        "requests are one client): fcfs (the paper's FIFO), vtc (least service first), lpm "
                        "(longest cached prefix first), dlpm (VTC-style fairness that keeps prefix locality, seed "
                        "002), d2lpm (dlpm per chain, requests bound to the chain holding their prefix), d-vtc, "
                        "rr-lpm. auto: dlpm with --api-keys, else fcfs")
    p.add_argument("--schedule", default="fcfs", choices=list(SCHEDULES),
                   help="the central queue's order: fcfs (the paper's FIFO), edf (earliest deadline first: requests "
                        "with deadline_ms / ttft_deadline_ms, or their API key's defaults, go first; needs "
                        "--fairness fcfs), flex (edf, and a request that would miss its deadline takes the slot of "
                        "a running request without one, paused between two steps and resumed later; seed 003's "
                        "best-effort lane); db (seed 001's doubling budget: a job's priority is its remaining budget "
                        "times the mean execution time, the budget doubling a level down each time it is used up; a "
                        "waiting job with at most half its priority value pauses the running job of lowest between two "
                        "steps, on chains whose servers keep its KV as a cached prefix: paged, with the prefix "
                        "cache) or mlfq "
                        "(skip-join multi-level feedback queue, the same way). With edf/flex a request whose deadline "
                        "the queue and the chains' speed say it cannot meet is refused at once (429 "
                        "deadline_unreachable, with Retry-After; deadline_infeasible, without, when even an idle swarm "
                        "would miss it) unless it asks for best_effort")
    p.add_argument("--schedule-classes", type=_positive_int, action=_Given, default=4, metavar="K",
                   help="with --schedule db|mlfq: a model's requests form K services by length (K-means of (prompt "
                        "tokens, max_tokens), learnt online from the requests seen; seed 001's services), each with "
                        "its own learnt mean execution time, so short kinds of request go before long ones. 1: one "
                        "service per model")
    p.add_argument("--fairness-quantum", type=_auto_or_positive_float, action=_Given, default=None, metavar="auto|X",
                   help="DLPM's quantum Q^u in service units (a client's credit per round); auto: the median "
                        "request's cost over the last 256 requests, times 1 (no prompt found a cached prefix) to 4 "
                        "(all input cached)")
    p.add_argument("--fairness-worker-quantum", type=_positive_float, action=_Given, default=20000.0, metavar="X",
                   help="D2LPM's per-chain quantum Q^w in service units")
    p.add_argument("--fairness-w-e", type=float, default=1.0, metavar="X",
                   help="service units per input token a chain computes (cached prefix tokens are free)")
    p.add_argument("--fairness-w-q", type=float, default=2.0, metavar="X", help="service units per output token")
    p.add_argument("--audit-rate", type=float, default=0.02, metavar="P",
                   help="fraction of hop steps re-run on a second server holding the same blocks (when one has "
                        "spare room) and compared; a disagreement is settled by a third, the server in the minority "
                        "gets a strike, and --audit-strikes decayed strikes ban it for good. 0: no audits")
    p.add_argument("--audit-tolerance", type=_auto_or_positive_float, default=None, metavar="auto|X",
                   help="largest per-token relative L2 error between two servers' outputs that counts as agreement "
                        "(auto: 0.01 for fp32 replies, 0.06 for 16-bit ones)")
    p.add_argument("--audit-strikes", type=_positive_float, default=3.0, metavar="X",
                   help="decayed strikes that ban a server for good")
    p.add_argument("--audit-half-life-s", type=_positive_float, default=3600.0, metavar="S",
                   help="half-life of a strike")
    p.add_argument("--audit-probe-s", type=float, default=30.0, metavar="S",
                   help="while no request waits for a chain, send the next server a short random sequence this "
                        "often (its input computed by other servers) and judge its output like an audit: catches a "
                        "server that lies off the sampled traffic. 0: no probes")
    p.add_argument("--replay-cache-mb", type=float, default=256.0,
                   help="memory for the hop inputs kept so a failed hop is replayed alone (all jobs together; "
                        "jobs over the budget fall back to replaying their prefix through the whole chain)")
    p.add_argument("--ban-base-s", type=float, default=5.0,
                   help="a server that failed is not planned for this long, doubling per failure (max --ban-max-s)")
    p.add_argument("--ban-max-s", type=float, default=300.0)
    p.add_argument("--load-deadline-s", type=_nonnegative_float, default=600.0, metavar="S",
                   help="a server not online with the blocks it was assigned S seconds after the assignment (a load "
                        "that hangs, a wedged device, an older server that does not report a failed load) is planned "
                        "around until it serves them (its clock starts again after a drain of its old blocks). "
                        "0: never")
    p.add_argument("--records-lost-s", type=_nonnegative_float, default=SERVER_RECORD_TTL_S, metavar="S",
                   help="a read of the servers' records that names none of the live servers (an empty DHT read in "
                        "a network blip) keeps the servers and the plan until this has lasted S seconds: then they "
                        "are taken for gone (a server's own offline record counts at once). At least the servers' "
                        "record lifetime, 3 x their --refresh-s (for servers with a larger --refresh-s than 30). "
                        f"0: at once. Default: {SERVER_RECORD_TTL_S:g}")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="API keys, one a line: NAME KEY [max_concurrent=N] [tokens_per_minute=N] [max_sessions=N] "
                        "[deadline_ms=X] [ttft_deadline_ms=X]; "
                        "requests need 'Authorization: Bearer KEY' (401 otherwise), limits and sessions are per key. "
                        "Without it the API is open (one anonymous client). The file is watched: an edit (or a "
                        "replace by rename) applies without a restart (--api-keys-reload-s); a removed key gets 401 "
                        "from its next request on and its sessions close once their turn ends; an edit that does not "
                        "parse keeps the keys loaded before (logged)")
    p.add_argument("--api-keys-reload-s", type=_nonnegative_float, default=None, metavar="S",
                   help="check the --api-keys file for changes this often (a regular file: a pipe is read once, and "
                        "this flag with one is a usage error). 0: never. Default: 2")
    p.add_argument("--model-placement", default="ui", choices=list(PLACEMENT_POLICIES),
                   help="with several models, which model a server offering several serves (seed 001): ui (placed "
                        "by the unserved index when it joins, re-placed every replacement interval, when the "
                        "traffic mix drifts and once more a placement window after that, moving only servers whose "
                        "move pays for its reload), static (re-placed "
                        "once, for the first traffic seen, then never moved: a fixed plan), even (round-robin, never "
                        "moved)")
    p.add_argument("--placement-index", default="analytic", choices=list(PLACEMENT_INDEXES),
                   help="how the unserved index judges a placement: analytic (an M/M/C estimate from each model's "
                        "arrival rate) or simulated (seed 001's: the recent requests replayed on the chains the "
                        "placement would give each model, with a step cost fitted from the completed ones)")
    p.add_argument("--placement-rule", default=None, choices=list(PLACEMENT_RULES),
                   help="which model Alg. 1 gives each server: most_unserved (the seed's; default with the analytic "
                        "index) or largest_gain (the one whose index it lowers most; default with the simulated)")
    p.add_argument("--replace-interval-s", type=_positive_float, default=600.0, metavar="S",
                   help="the first replacement interval I_0 (adapted by (1 +- 0.1) per interval, Eq. 8)")
    p.add_argument("--placement-window-s", type=_positive_float, default=120.0, metavar="S",
                   help="arrival rates and the traffic mix are measured over this window")
    p.add_argument("--model-reload-s", type=_nonnegative_float, default=10.0, metavar="S",
                   help="what a server's move to another model costs it (seconds without serving); a move is "
                        "made only if it saves more than that over the interval")
    p.add_argument("--dht-prefix", default=None, help="DHT key prefix (default: from the model name)")
    p.add_argument("--model-id", default=None, help="model id served at /v1 (default: the model's name)")
    p.add_argument("--settle-s", type=_nonnegative_float, default=2.0,
                   help="wait this long without joins before the first plan")
    p.add_argument("--replan-interval-s", type=_positive_float, default=30.0)
    p.add_argument("--move-margin", type=float, default=0.2,
                   help="move blocks only if the predicted mean response time improves by this fraction")
    p.add_argument("--ready-file", default=None,
                   help="write {http_url, initial_peers, peer_id, pid} as JSON here once up")
    p.add_argument("--log-level", default="INFO")
    return p


def _peer_id(text: str) -> str:
    """A libp2p peer id in base58 (as servers and orchestrators print it; hivemind imported only when one is given)."""
    from petals_chain.swarm.dht import peer_id_arg

    return peer_id_arg(text)


def max_http_connections(open_files: int) -> int:
    """HTTP connections let in at an open-files limit of ``open_files``: a running request holds its connection and
    a P2P stream to each hop of its chain, and as many more may be being refused: a quarter of what is left after
    the reserve (at least 16). Past it, a new connection gets 503 (:func:`capped_http_protocol`) instead of the
    descriptors running out: then every P2P call failed (EMFILE) and the orchestrator banned each server in turn,
    stalling the requests it had let in."""
    from petals_chain.swarm.launch import RESERVED_OPEN_FILES

    return max(16, (open_files - RESERVED_OPEN_FILES) // 4)


# How long a refused connection may take to send its request before it is closed (its descriptor freed)
REFUSED_CONNECTION_S = 1.0
# At the cap, a connection that has sent no request this long after it opened may be closed to let a new one in
SILENT_CONNECTION_S = 10.0


def refusal(open_connections: int, limit: int) -> bytes:
    """The whole HTTP response a connection past the cap gets: 503 ``too_many_connections``, ``Retry-After``."""
    body = json.dumps({"error": {
        "message": f"the orchestrator has {open_connections} open connections, the most its open-files limit "
                   f"(ulimit -n) allows for {limit}: try again shortly",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body))


def capped_http_protocol(limit: int) -> type:
    """uvicorn's HTTP protocol, with a connection accepted while ``limit`` others are open answered 503 at once
    (:func:`refusal`) and closed once its request arrives (read, so the close sends no reset that loses the answer),
    or after :data:`REFUSED_CONNECTION_S`; past ``limit`` such answers under way, closed at once (a burst of
    thousands would take every descriptor meanwhile). None holds a descriptor for long or runs any of the app.
    At the cap, an open connection that runs no request makes room instead: the one idle longest between keep-alive
    requests (its client opens another when it needs one, as after uvicorn's keep-alive timeout), else one that has
    sent no request :data:`SILENT_CONNECTION_S` after it opened (one client's idle pool, or sockets that never
    send, locked every other client out: 503 until they closed, if ever)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    refusing: set = set()  # the refused connections not closed yet
    # admitted connections that may run no request, oldest first (checked when one is taken: they may have since)
    between: dict = {}  # -> None: between keep-alive requests
    silent: dict = {}  # -> loop time it opened: no request yet

    def make_room(connections: set, now: float) -> bool:
        """Close one admitted connection that runs no request; whether one was closed."""
        while between:
            conn = next(iter(between))
            del between[conn]
            if (conn.timeout_keep_alive_task is not None and not conn.transport.is_closing()
                    and (conn.cycle is None or conn.cycle.response_complete)):
                conn.timeout_keep_alive_handler()  # uvicorn's own close of an idle keep-alive connection
                connections.discard(conn)  # its descriptor is freed as the loop runs on
                return True
        while silent:
            conn, opened = next(iter(silent.items()))
            if conn.cycle is None and now - opened < SILENT_CONNECTION_S:
                return False  # the others opened later
            del silent[conn]
            if conn.cycle is None and not conn.transport.is_closing():
                conn.transport.close()
                connections.discard(conn)
                return True
        return False

    class CappedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        refused: Any = None  # the transport of a refused connection

        def connection_made(self, transport: Any) -> None:
            now = asyncio.get_running_loop().time()
            if len(self.connections) < limit or make_room(self.connections, now):
                silent[self] = now
                return super().connection_made(transport)
            self.refused = transport
            if len(refusing) >= limit:
                transport.abort()
                return
            refusing.add(self)
            transport.write(refusal(len(self.connections), limit))
            asyncio.get_running_loop().call_later(REFUSED_CONNECTION_S, transport.close)

        def data_received(self, data: bytes) -> None:
            if self.refused is None:
                return super().data_received(data)
            if b"\r\n\r\n" in data or b"\n\n" in data:  # the request's head has arrived: nothing more to wait for
                self.refused.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # kept open for the client's next request
                between.pop(self, None)
                between[self] = None

        def eof_received(self) -> Any:
            if self.refused is None:
                return super().eof_received()
            self.refused.close()
            return None

        def connection_lost(self, exc: Exception | None) -> None:
            if self.refused is None:
                super().connection_lost(exc)
            refusing.discard(self)
            between.pop(self, None)
            silent.pop(self, None)

    return CappedHTTPProtocol


async def serve(cfgs: list, ready_file: str | None = None, placement: dict | None = None,
                lost: threading.Event | None = None, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
    """Serve the models of ``cfgs`` (one config each; several: models.py, with ``placement`` the
    :class:`~petals_chain.orchestrator.placement.ModelPlacer` keywords) until SIGINT, SIGTERM or SIGHUP (unless
    ignored: ``nohup``), or until the DHT process dies: then it stops alike (no grace) and sets ``lost``. A stop
    while serving gives running requests ``grace_s`` (:class:`_GracefulStop`)."""
    from petals_chain.swarm.dht import on_dht_lost

    watch = _DhtWatch(asyncio.get_running_loop(), lost if lost is not None else threading.Event())
    on_dht_lost(watch.from_watch_thread)
    try:
        await _serve(cfgs, ready_file, placement, watch, grace_s)
    finally:
        on_dht_lost(None)


def _stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop the orchestrator: SIGHUP too (its terminal closed, its ssh session ended: by default it
    ended the process at once, the DHT process and p2pd left running), unless ignored (``nohup``)."""
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)


class _DhtWatch:
    """Stops the orchestrator when its DHT process dies under it (``kill -9``, the OOM killer): it ran on blind,
    reading no server records and publishing no plan, and its supervisor never restarted it. Not once a stop was
    asked for (a systemd stop may kill the DHT process at the same time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lost: threading.Event) -> None:
        self.loop, self.lost = loop, lost
        self.starting: _StopWhileStarting | None = None  # while the orchestrators start
        self.stopping: _GracefulStop | None = None  # once serving

    def from_watch_thread(self, sd: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: stopped already
            self.loop.call_soon_threadsafe(self.stop)

    def stop(self) -> None:
        if self.lost.is_set() or (self.starting is not None and self.starting.requested) \
                or (self.stopping is not None and self.stopping.begun):
            return
        self.lost.set()
        if self.stopping is not None:
            self.stopping.begin(grace_s=0.0)  # nothing can be served without the DHT node: cut now
        elif self.starting is not None:
            self.starting.task.cancel()  # stops once the step under way ends, as a stop while starting does


def _http_urls(cfg: Any, scheme: str, port: int) -> tuple[str, str]:
    """``(http_url, local_url)``: where others reach the API (``--public-url``, else ``--host``, or ``--public-ip``
    for a wildcard host) and where this process does. An IPv6 address is bracketed: ``http://::1:8000`` was printed,
    written to the ready file, announced to the other orchestrators (which forwarded nothing there) and linked on
    the dashboard."""
    from petals_chain.swarm.webpage import local_host, url_host

    host = cfg.host if cfg.host not in ("0.0.0.0", "::") else (cfg.public_ip or "127.0.0.1")
    local = local_host(cfg.host)
    return (cfg.public_url or f"{scheme}://{url_host(host)}:{port}", f"{scheme}://{url_host(local)}:{port}")


async def _serve(cfgs: list, ready_file: str | None, placement: dict | None, watch: _DhtWatch,
                 grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
    import uvicorn

    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator
    from petals_chain.swarm.aio import quiet_peer_disconnects
    from petals_chain.orchestrator.models import ModelRouter
    from petals_chain.swarm.reachability import is_loopback
    from petals_chain.swarm.webpage import listen_http

    cfg = cfgs[0]
    orchs = [Orchestrator(c) for c in cfgs]
    orch = orchs[0]
    sock = listen_http(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    scheme = "https" if cfg.ssl_certfile else "http"
    http_url, local_url = _http_urls(cfg, scheme, port)
    for o in orchs:
        o.cfg.port = port
        o.http_url, o.local_url = http_url, local_url
    started: list[Orchestrator] = []
    placer, placer_task = None, None
    loop = asyncio.get_running_loop()
    stop_starting = _StopWhileStarting(asyncio.current_task())
    watch.starting = stop_starting
    stop_signals = _stop_signals()
    for sig in stop_signals:  # SIGTERM's default ended us at once, the DHT node left running
        loop.add_signal_handler(sig, stop_starting, sig)
    try:  # a failure before serving stops what started (the DHT process and p2pd would outlive us)
        for o in orchs:
            say(f"Loading {o.cfg.model} (embeddings, final norm, LM head)...")
            await asyncio.to_thread(o.load_model)
        await _start(orch, started)
        for o in orchs[1:]:  # the other models use the first one's DHT node
            await _start(o, started, shared=orch)
        if len(orchs) == 1:
            app = create_app(orch)
            apps = [app]
        else:
            from petals_chain.orchestrator.placement import ModelPlacer

            placer = ModelPlacer(orchs, refresh_s=max(1.0, cfg.refresh_s), **(placement or {}))
            placer_task = asyncio.create_task(placer.run(orch._stop), name="model-placement")
            from petals_chain.orchestrator.limits import ClientLedger

            ledger = ClientLedger(orchs)  # a key's limits over every model, not each
            for o in orchs:
                o.siblings = orchs  # --max-sessions counts the sessions of every model
                o.placer = placer  # its decisions go into every model's summary (the standalone dashboard shows them)
            from petals_chain.orchestrator.request_id import RequestIds

            # the router's own answers (an unknown model's 404, a 413) carry an x-request-id too; each model's app
            # keeps the router's id and adds no second header
            apps = [create_app(o, ledger) for o in orchs]
            from petals_chain.swarm.httpedge import DecodedBody, HeadAsGet

            # a coded body decoded before the router reads its model; HEAD as GET for the router's own answers too
            router = ModelRouter({o.model_id: a for o, a in zip(orchs, apps)}, {o.model_id: o for o in orchs},
                                 placer=placer)
            app = RequestIds(HeadAsGet(DecodedBody(router, limit=lambda: max(
                a.state.limits.limits.max_body_bytes for a in apps))))
            for o in orchs:
                say(f"Model {o.model_id}: {o.cfg.model} (DHT prefix {o.prefix})")
    except BaseException as e:
        if placer_task is not None:
            placer_task.cancel()
        for o in reversed(started):
            await o.stop()
        if isinstance(e, asyncio.CancelledError) and (stop_starting.requested or watch.lost.is_set()):
            return  # stopped as a stop while serving is: no traceback (exit 0; 1 for a lost DHT process)
        raise
    if getattr(cfg, "cors_origins", None):
        from petals_chain.orchestrator.api import with_cors

        app = with_cors(app, cfg.cors_origins)  # outermost: over the router and every model's keys and limits
    # uvicorn's own grace only for what the drain does not track (a dashboard page): by then every API request has
    # finished or was cut (_GracefulStop)
    import resource

    from petals_chain.swarm.launch import MAX_RAISED_OPEN_FILES, quiet_descriptor_exhaustion

    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    open_files = MAX_RAISED_OPEN_FILES if open_files == resource.RLIM_INFINITY else open_files
    http = capped_http_protocol(max_http_connections(open_files))  # P2P streams keep descriptors to run on
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http, lifespan="off",
                                           timeout_graceful_shutdown=1,
                                           ssl_certfile=cfg.ssl_certfile, ssl_keyfile=cfg.ssl_keyfile))
    # we handle signals ourselves (below): uvicorn >= 0.29 also put its own handler over ours while serving (its
    # first signal stopped the server at once, past any grace) and raised each signal again once it had stopped
    server.install_signal_handlers = lambda: None  # (uvicorn < 0.29)
    server.capture_signals = contextlib.nullcontext
    quiet_peer_disconnects(loop)
    quiet_descriptor_exhaustion(loop, open_files)
    stopping = watch.stopping = _GracefulStop(server, orchs, apps, grace_s)
    for sig in stop_signals:
        loop.add_signal_handler(sig, stopping, sig)
    peers = orch.initial_peers
    say("Orchestrator peer id:", orch.dht.peer_id)
    say("Initial peers (give these to servers as --initial-peers):")
    for m in peers:
        say("   ", m, "   (this host only)" if is_loopback(m) else "")
    if peers and all(is_loopback(m) for m in peers):
        say("Listening on loopback only: servers on other hosts cannot join. Use --public-ip IP (or --host-maddrs "
            "/ip4/0.0.0.0/tcp/PORT /ip6/::/tcp/PORT and --announce-maddrs) for a swarm across hosts.")
    say(f"HTTP API: {orch.http_url}/v1  dashboard: {orch.http_url}/  swarm: {orch.http_url}/api/v1/swarm")
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"http_url": orch.http_url, "initial_peers": peers, "peer_id": orch.dht.peer_id,
                       "pid": os.getpid()}, f)
        os.replace(tmp, ready_file)
    keys = getattr(cfg, "api_key_ring", None)  # polled by requests too; this reloads (and logs) an idle one's edit
    key_watch = asyncio.create_task(keys.watch(), name="api-keys") if keys is not None else None
    try:
        await server.serve(sockets=[sock])
    finally:
        stopping.after_serving()
        say("Shutting down...")
        if key_watch is not None:
            key_watch.cancel()
        if placer_task is not None:
            placer_task.cancel()
            await asyncio.gather(placer_task, return_exceptions=True)
        for o in reversed(orchs):  # the first one, which runs the DHT node, last
            await o.stop()


class _StopWhileStarting:
    """The signal handler while the orchestrators start: the first signal cancels the starting task, which stops
    once the step under way ends (a model load or a DHT join runs on in its thread); a second one stops at once."""

    def __init__(self, task: asyncio.Task) -> None:
        self.task, self.requested = task, False

    def __call__(self, signum: int = signal.SIGINT) -> None:
        if self.requested:
            _stop_now(signum)  # does not return
            return
        self.requested = True
        logger.info("stopping once the model has loaded or the DHT node has started (a second %s stops at once)",
                    "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)
        self.task.cancel()


class _GracefulStop:
    """The signal handler while serving. The first stop signal drains: new API requests get 503 ``shutting_down``
    (``/healthz`` too: load balancers stop sending), queued ones are answered so at once, and running ones get
    ``grace_s`` to finish; those still running then are cut (a stream with a last error event a client resumes
    elsewhere: api.ShutdownGate), and the server stops (the orchestrators' stop closes the servers' sessions and the
    DHT node). Before, uvicorn closed the socket at once (new requests: connection refused), gave running ones 3 s and
    cancelled them (a stream: a TCP reset in mid-event; a queued request: a plain-text 500), and ignored a second
    signal. A second signal ends the grace now; one while the stop after it runs exits at once (:func:`_stop_now`)."""

    def __init__(self, server: Any, orchs: list, apps: list, grace_s: float) -> None:
        self.server, self.grace_s = server, grace_s
        # (an embedder's own app or orchestrator without them has nothing to drain: it stops as before)
        self.gates = [g for a in apps if (g := getattr(getattr(a, "state", None), "gate", None)) is not None]
        self.drains = [d for o in orchs if (d := getattr(o, "begin_drain", None)) is not None]
        self.begun = False
        self.task: asyncio.Task | None = None
        self._now = asyncio.Event()  # the grace ends now

    def __call__(self, signum: int = signal.SIGTERM) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if not self.begun:
            logger.warning("%s: stopping: new requests get 503, queued ones too; running ones get up to %g s to "
                           "finish (%s again stops now)", name, self.grace_s, name)
            self.begin(self.grace_s)
        elif not self._now.is_set() and not self.server.should_exit:
            logger.warning("%s again: cutting the %d running request(s) now", name, self.running)
            self._now.set()
        else:
            _stop_now(signum, "while stopping")  # does not return

    @property
    def running(self) -> int:
        return sum(g.running for g in self.gates)

    def begin(self, grace_s: float) -> None:
        """Start the drain (once); ``grace_s`` 0: cut what runs now."""
        if self.begun:
            return
        self.begun = True
        if grace_s <= 0:
            self._now.set()
        try:  # here, not in the task: no request is queued or let in after the signal
            refused = sum(drain() for drain in self.drains)
        finally:
            self.task = asyncio.get_running_loop().create_task(self._run(grace_s), name="graceful-stop")
        if refused:
            logger.info("answered %d queued request(s) with 503 shutting_down", refused)

    async def _run(self, grace_s: float) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        idle = asyncio.ensure_future(asyncio.gather(*(g.wait_idle() for g in self.gates)))
        now = asyncio.ensure_future(self._now.wait())
        try:
            await asyncio.wait([idle, now], timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
            if not idle.done():
                cut = sum(g.cut() for g in self.gates)
                logger.warning("cut %d request(s) still running after %.1f s (a stream ends with an error event, "
                               "503 shutting_down: its client can send it again elsewhere)", cut, loop.time() - t0)
                # their last bytes go out (a client that reads nothing any more does not hold the stop)
                await asyncio.wait([idle], timeout=2.0)
            logger.info("running requests done after %.1f s; stopping", loop.time() - t0)
        finally:
            self.server.should_exit = True
            for f in (idle, now):
                f.cancel()
            await asyncio.gather(idle, now, return_exceptions=True)

    def after_serving(self) -> None:
        """The server stopped (the drain's end, or its own failure): a drain still under way goes no further."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


def _stop_now(signum: int, when: str = "while starting") -> None:
    """Exit now with ``128 + signum`` (130 for Ctrl-C), without waiting for the thread that loads the model or joins
    the DHT (neither can be interrupted) or for the stop under way, once this process's children are killed (the
    DHT process and its p2pd run in a process group of their own, swarm/dht.py, and would stop only a moment later:
    their watchdog) and a starting DHT node's temporary identity file (a private key) is deleted."""
    print(f"stopped at once ({signal.Signals(signum).name} again {when})", file=sys.stderr, flush=True)
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - best effort: the DHT process's watchdog stops it and p2pd anyway
        children = []
    for child in children:  # psutil checks each one's start time: a pid reused meanwhile is left alone
        try:
            child.kill()
        except Exception:  # noqa: BLE001 - gone already
            pass
    dht = sys.modules.get("petals_chain.swarm.dht")  # not imported yet (slow): no node is starting
    if dht is not None:  # a node's start deletes its temporary identity file (a private key) only once it is over
        dht.remove_temp_identities()
    sys.stdout.flush()
    os._exit(128 + signum)


async def _start(o, started: list, shared=None) -> None:
    """``o.start(shared=shared)``, then append ``o`` to ``started``, also when the caller is cancelled meanwhile
    (a stop while starting): the DHT node joins in a thread that a cancellation does not stop, and the node it
    gives back would be lost, running, its p2pd with it. The start then finishes before the cancellation goes on."""
    task = asyncio.ensure_future(o.start(shared=shared))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is None:
            started.append(o)
        raise
    started.append(o)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before serve() handles signals (imports, checks): no traceback
        print("interrupted while starting", file=sys.stderr)
        return 130


def _tls_files_problem(certfile: str, keyfile: str) -> str | None:
    """Why uvicorn could not load this certificate and key (unreadable, not PEM, a key of another certificate), or
    None. uvicorn loads them only once the model has loaded and the DHT node has joined: the orchestrator then exited
    with "error: [Errno 13] Permission denied" or "[SSL] PEM lib", naming no file."""
    import ssl

    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            return f"{flag} {path} cannot be read ({e.strerror or e})"

    class Encrypted(Exception):
        pass

    def passphrase() -> bytes:  # uvicorn asks for it on the terminal: not to be asked twice, nor judged here
        raise Encrypted

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=passphrase)
    except Encrypted:
        return None
    except (ssl.SSLError, ValueError) as e:
        return (f"--ssl-certfile {certfile} and --ssl-keyfile {keyfile} are not a PEM certificate and its private "
                f"key ({e})")
    return None


def _main(argv: list[str] | None) -> int:
    if version_asked(argv):  # before build_parser's imports (torch, the planner): 11 s to print a line
        print(build_version())
        return 0
    from petals_chain.swarm.console import check_working_directory
    from petals_chain.swarm.launch import check_shared_memory

    try:  # before build_parser: its imports reach hivemind's, which makes locks there (and torch's)
        check_working_directory("orchestrator")
        check_shared_memory("orchestrator")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    from petals_chain.swarm.launch import raise_open_files_limit

    try:  # else the descriptors ran out under load: every P2P call failed and every server was banned
        raise_open_files_limit("orchestrator")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (0 < args.rho_bar <= 1):
        parser.error(f"--rho-bar must be in (0, 1], got {args.rho_bar}")
    if not (0 <= args.move_margin < 1):
        parser.error(f"--move-margin must be in [0, 1), got {args.move_margin}")
    if not (0 <= args.port < 65536):
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.speculative[1] and args.draft_model and args.speculative[1] != args.draft_model:
        parser.error(f"--speculative draft:{args.speculative[1]} and --draft-model {args.draft_model} name different "
                     f"draft models")
    if args.speculative[0] == "draft" and not (args.speculative[1] or args.draft_model):
        parser.error("--speculative draft needs a draft model: draft:MODEL or --draft-model MODEL")
    if not (1 <= args.speculative_k <= 16):
        parser.error(f"--speculative-k must be in [1, 16], got {args.speculative_k}")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    for path in (args.ssl_certfile, args.ssl_keyfile):
        if path and not os.path.isfile(path):
            parser.error(f"no such file: {path}")
    if args.ssl_certfile:
        problem = _tls_files_problem(args.ssl_certfile, args.ssl_keyfile)
        if problem:
            parser.error(problem)
    if args.public_url and not re.match(r"^https?://[^/\s]+(/\S*)?$", args.public_url):
        parser.error(f"--public-url must be an http:// or https:// URL, got {args.public_url!r}")
    if args.public_url:
        try:  # other orchestrators forward requests there (--group-with): each forward failed
            public_port = urllib.parse.urlsplit(args.public_url).port
        except ValueError as e:
            parser.error(f"--public-url {args.public_url!r}: {e}")
        if public_port == 0:  # (no one connects to port 0: the others never forward there, forward.py)
            parser.error(f"--public-url {args.public_url!r}: port 0 is no port to connect to")
    level = log_level(parser, args.log_level)
    if args.ready_file is not None:  # else found only once all had started (a directory: os.replace's IsADirectory)
        from petals_chain.swarm.paths import output_file_problem

        problem = output_file_problem(args.ready_file, replace=True)  # written to F.tmp, then renamed over F
        if problem:
            parser.error(f"--ready-file {args.ready_file}: {problem}")
    if args.draft_layers is not None and not (args.speculative[1] or args.draft_model):
        parser.error("--draft-layers needs a draft model (--speculative draft:MODEL or --draft-model MODEL)")
    if args.draft_timeout_s is not None and not (args.speculative[1] or args.draft_model):
        parser.error("--draft-timeout-s needs a draft model (--speculative draft:MODEL or --draft-model MODEL)")
    if args.api_keys_reload_s is not None and not args.api_keys:
        parser.error("--api-keys-reload-s needs --api-keys")
    from petals_chain.swarm.reachability import listen_and_announce, to_multiaddr

    for flag, values in (("--host-maddrs", args.host_maddrs), ("--initial-peers", args.initial_peers)):
        for m in values:  # else hivemind's daemon fails on them after the model has loaded, with a traceback
            try:
                to_multiaddr(m)
            except ValueError as e:
                parser.error(f"{flag}: {e}")
    try:
        host_maddrs, announce_maddrs = listen_and_announce(args.host_maddrs, args.announce_maddrs, args.public_ip,
                                                           args.p2p_port)
    except ValueError as e:
        parser.error(str(e))
    from petals_chain.orchestrator.core import JoinError, Orchestrator, OrchestratorConfig, fairness_policy_name
    from petals_chain.orchestrator.models import parse_models

    try:
        models = parse_models(args.model)
    except ValueError as e:
        parser.error(str(e))
    if len(models) > 1 and (args.dht_prefix or args.model_id):
        parser.error("--dht-prefix and --model-id name one model; with several, each --model is NAME=SOURCE")

    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    cfg = OrchestratorConfig(
        model=models[0][1], host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
        relay_service=not args.no_relay_service, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        initial_peers=args.initial_peers,
        identity_path=args.identity_path, group_with=list(args.group_with), group_ttl_s=args.group_ttl_s,
        public_url=args.public_url.rstrip("/") if args.public_url else None, public_ip=args.public_ip,
        host=args.host, port=args.port, dtype=args.dtype, device=args.device,
        arrival_rate=args.arrival_rate, rho_bar=args.rho_bar, max_length=args.max_length, placement=args.placement,
        use_all_servers=args.spare_servers == "use", dispatch=args.dispatch, dht_prefix=args.dht_prefix,
        model_id=args.model_id or models[0][0], settle_s=args.settle_s,
        replan_interval_s=args.replan_interval_s, move_margin=args.move_margin, replay_cache_mb=args.replay_cache_mb,
        hold_sessions=args.hold_sessions, job_tokens=args.job_tokens, output_reserve_tokens=args.output_reserve_tokens,
        ban_base_s=args.ban_base_s, ban_max_s=args.ban_max_s, load_deadline_s=args.load_deadline_s,
        records_lost_s=args.records_lost_s,
        fairness=args.fairness, schedule=args.schedule,
        schedule_classes=args.schedule_classes,
        fairness_quantum=args.fairness_quantum, fairness_worker_quantum=args.fairness_worker_quantum,
        fairness_w_e=args.fairness_w_e, fairness_w_q=args.fairness_w_q, api_keys=args.api_keys,
        audit_rate=args.audit_rate, audit_tolerance=args.audit_tolerance, audit_strikes=args.audit_strikes,
        audit_half_life_s=args.audit_half_life_s, audit_probe_s=args.audit_probe_s, speculative=args.speculative[0],
        draft_model=args.speculative[1] or args.draft_model, draft_layers=args.draft_layers,
        speculative_k=args.speculative_k,
        relay=args.relay)
    if args.draft_timeout_s is not None:
        cfg.draft_timeout_s = args.draft_timeout_s
    cfgs = [cfg] + [dataclasses.replace(cfg, model=source, model_id=name) for name, source in models[1:]]
    from petals_chain.orchestrator.adapters import split_adapter_args
    from petals_chain.swarm.lora import AdapterError

    try:  # each model's --adapter values (read and validated by its Orchestrator below)
        by_model = split_adapter_args(args.adapter, [name or source for name, source in models])
    except AdapterError as e:
        parser.error(str(e))
    for c, (name, source) in zip(cfgs, models):
        c.adapters = by_model[name or source]
    for c in cfgs:
        # Baseline knobs (routed.py / planner): plain attributes, read with defaults by the orchestrator.
        c.petals_cache_tokens, c.bprr_r, c.route_wait_s = args.petals_cache_tokens, args.bprr_r, args.route_wait_s
        # Admission limits (limits.py), read with defaults by the API middleware (each model's API its own).
        c.max_queue, c.client_max_inflight = args.max_queue, args.client_max_inflight
        c.queue_timeout_s, c.no_chain_wait_s = args.queue_timeout_s, args.no_chain_wait_s
        c.sse_keepalive_s = args.sse_keepalive_s
        c.cors_origins = args.cors_origins  # the HTTP app's, read by _serve (one app for every model)
        c.client_max_sessions, c.max_body_bytes = args.client_max_sessions, args.max_body_bytes
        c.max_sessions, c.session_idle_timeout_s = args.max_sessions, args.session_idle_timeout_s
        c.max_n = args.max_choices
    if args.api_keys:
        from petals_chain.orchestrator.auth import DEFAULT_RELOAD_S, KeyFile, KeyFileError

        reload_s = DEFAULT_RELOAD_S if args.api_keys_reload_s is None else args.api_keys_reload_s
        try:  # read once, here: a pipe (--api-keys <(...)) reads empty the second time
            keys = KeyFile(args.api_keys, reload_s=reload_s)
        except KeyFileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.api_keys_reload_s and not keys.watching:  # asked for, and silently never done
            parser.error(f"--api-keys-reload-s needs a regular --api-keys file: {args.api_keys} is a pipe or a "
                         "device, read once (leave --api-keys-reload-s out, or give a file)")
        watched = f" (reloaded when it changes: checked every {reload_s:g} s)" if keys.watching else ""
        say(f"API keys: {len(keys)} from {args.api_keys}{watched}")
        for c in cfgs:  # every model's API and limits (limits.LimitsConfig.from_config) use this one
            c.api_key_ring = keys
    elif args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("the HTTP API listens on %s without --api-keys: anyone who can reach it can use the swarm",
                       args.host)
    if args.host == "0.0.0.0" and args.public_ip and ":" in args.public_ip and not args.public_url:
        logger.warning("--public-ip %s is IPv6, but --host 0.0.0.0 serves the HTTP API on IPv4 only: the URL "
                       "announced (http://[%s]:PORT) does not answer; use --host :: (IPv6 and IPv4)",
                       args.public_ip, args.public_ip)
    try:
        prefixes = [Orchestrator(c).prefix for c in cfgs]  # validate the configuration before anything starts
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for flag in ignored_flags(args, fairness_policy_name(cfg)):
        logger.warning("ignored %s", flag)
    if len(set(prefixes)) != len(prefixes):
        print(f"error: two models would share a DHT prefix ({', '.join(prefixes)}): a model's prefix is its file or "
              f"directory name (the servers derive the same), so the same model twice, or two models named alike: "
              f"rename one", file=sys.stderr)
        return 2
    if args.identity_path is not None:  # last: it may make the key's directory, which a bad flag above would not
        from petals_chain.swarm.dht import check_identity_path

        try:  # else a corrupt key was found once the model had loaded, by the DHT node's start (exit 1)
            check_identity_path(os.path.expanduser(args.identity_path))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    lost = threading.Event()
    try:
        asyncio.run(serve(cfgs, args.ready_file, placement=dict(
            policy=args.model_placement, interval_s=args.replace_interval_s, window_s=args.placement_window_s,
            reload_s=args.model_reload_s, index=args.placement_index, rule=args.placement_rule), lost=lost,
            grace_s=args.shutdown_grace_s))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        if not lost.is_set():  # else a failure of a start under way when the DHT process died: said below
            if isinstance(e, (ValueError, OSError, JoinError)):
                from petals_chain.swarm.reachability import join_hint

                hint = join_hint(args.initial_peers) if isinstance(e, JoinError) else ""
                print(f"error: {e}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
                return 1
            raise
        logger.debug("while stopping for the lost DHT process", exc_info=True)
    if lost.is_set():
        print("error: the orchestrator's DHT process died (killed, or out of memory), so it could no longer read "
              "the servers' records or publish its plan: stopped; start it again", file=sys.stderr)
        return 1
    return 0


def _exit(code: int) -> None:
    """Leave with ``code`` as the interpreter would (other threads joined, atexit handlers run, output flushed),
    without its last step, the collection of every module's objects: 2-3 s for torch's and transformers' on a busy
    2-core host after a stop that took 0.2 s, which docker's 10 s stop timeout counts (as a forked role leaves,
    swarm/launch.py)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed or gone (a pipe whose reader left): nothing more to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
