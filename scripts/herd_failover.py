"""Two orchestrators on one swarm (HERD groups, issue 18), the one serving SIGKILLed and restarted again and again.

One server holds the only copy of the model, so one orchestrator's group has it and the other forwards every
request there. Each round kills the serving orchestrator: the other must take the group over within 30 s, and its
clients must see nothing. Clients, all greedy over token-id prompts (every output must equal the reference):

* OpenAI-style streaming clients that know one orchestrator only (raw SSE over httpx, as any OpenAI client). A
  client of the *killed* orchestrator loses the requests in flight there (counted apart, as expected); a client
  of the survivor must lose none: its streams forwarded to the killed one are finished by the survivor.
* the Python client given both URLs (streams and one-shot completions): none of its requests may fail.

The killed orchestrator is restarted at once (same identity and ports) and forwards from then on; the next round
kills the other one. With ``--freeze`` every second round SIGSTOPs it instead (its host gone with its connections
open: nothing tells the survivor's relays, only its group record going stale), and kills it once the group moved.

    python scripts/herd_failover.py --json                 # 3 rounds, ~4 min
    python scripts/herd_failover.py --rounds 1 --json      # ~1.5 min

Exit status 1 if a survivor's client lost or got a wrong output, the Python client failed once, or a group took
longer than 30 s to move.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from petals_chain.swarm.local import LocalServer, LocalSwarm, free_port, memory_for, signal_role  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_int, positive_float, positive_int  # noqa: E402

MOVE_LIMIT_S = 30.0  # the bound on how long a lost orchestrator's group takes to move


def identity(path: Path) -> str:
    from hivemind.p2p import P2P, PeerID

    P2P.generate_identity(str(path))
    return PeerID.from_identity(path.read_bytes()).to_base58()


def sse_text(url: str, model: str, prompt: list[int], max_tokens: int) -> str:
    """A streamed completion read as an OpenAI client reads it; raises on a cut or an error event."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"error event: {obj['error']}")
            text.extend(c.get("text") or "" for c in obj.get("choices", []))
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(text)


class Orchestrators:
    """The two orchestrators' swarms (the first also starts the server) and when each was down."""

    def __init__(self, a: LocalSwarm, b: LocalSwarm):
        self.swarms = {"a": a, "b": b}
        self.down: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}  # [killed, back up] monotonic times
        self.lock = threading.Lock()

    def url(self, name: str) -> str:
        return self.swarms[name].url

    def serving(self) -> Optional[str]:
        for name, sw in self.swarms.items():
            try:
                if sw.swarm()["chains"]:
                    return name
            except httpx.HTTPError:
                pass
        return None

    def was_down(self, name: str, t0: float, t1: float) -> bool:
        with self.lock:
            return any(k <= t1 and (up is None or up >= t0) for k, up in self.down[name])


def stream_client(orchs: Orchestrators, name: str, model: str, prompts: list[list[int]], want: list[str],
                  max_tokens: int, stats: dict, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        i = rng.randrange(len(prompts))
        t0 = time.monotonic()
        try:
            url = orchs.url(name)
            text = sse_text(url, model, prompts[i], max_tokens)
        except Exception as e:  # noqa: BLE001 - classified below
            if orchs.was_down(name, t0, time.monotonic()):
                stats["own_orchestrator_killed"] += 1  # expected: this client's only orchestrator died
                time.sleep(0.5)
            else:
                stats["failed"] += 1
                stats["errors"].append(f"{name}: {type(e).__name__}: {e}"[:300])
            continue
        stats["ok"] += 1
        if text != want[i]:
            stats["wrong"] += 1
            stats["errors"].append(f"{name}: prompt {i}: {text!r} != {want[i]!r}"[:300])


def python_client(orchs: Orchestrators, prompts: list[list[int]], want_ids: list[list[int]], want: list[str],
                  max_tokens: int, stats: dict, stop: threading.Event, seed: int) -> None:
    from petals_chain.client import Client

    rng = random.Random(seed)
    client = Client([orchs.url("a"), orchs.url("b")], timeout=180)
    n = 0
    while not stop.is_set():
        i = rng.randrange(len(prompts))
        n += 1
        try:
            if n % 2:
                ok = "".join(client.stream(prompts[i], max_tokens=max_tokens, ignore_eos=True)) == want[i]
            else:
                ok = client.complete(prompts[i], max_tokens=max_tokens, ignore_eos=True).token_ids == want_ids[i]
        except Exception as e:  # noqa: BLE001 - every failure counts
            stats["failed"] += 1
            stats["errors"].append(f"python client: {type(e).__name__}: {e}"[:300])
            continue
        stats["ok"] += 1
        if not ok:
            stats["wrong"] += 1
            stats["errors"].append(f"python client: prompt {i}: wrong output")


def new_stats() -> dict:
    return {"ok": 0, "wrong": 0, "failed": 0, "own_orchestrator_killed": 0, "errors": []}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=positive_int, default=3, help="orchestrator kills (alternating)")
    p.add_argument("--settle-s", type=positive_float, default=8.0, help="load before each kill and after each restart")
    p.add_argument("--streams", type=positive_int, default=2, help="single-URL streaming clients per orchestrator")
    p.add_argument("--max-tokens", type=positive_int, default=40)
    p.add_argument("--freeze", action="store_true", help="every second round SIGSTOPs the orchestrator instead "
                   "(a host gone with its connections open), killing it only after the group moved")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))

    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.tiny_model import build_tiny_model

    work = tempfile.TemporaryDirectory(prefix="petals-chain-herd-")
    root = Path(work.name)
    model = str(build_tiny_model(root / "model", family="llama", num_layers=4, seed=0))
    vocab = int(load_config(model).vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 16))] for _ in range(6)]
    max_length = 96
    ids = {n: root / f"{n}.id" for n in "ab"}
    peer = {n: identity(ids[n]) for n in "ab"}
    group = ["--group-ttl-s", "3"]

    def orch_args(me: str, other: str) -> list[str]:
        return ["--identity-path", str(ids[me]), "--group-with", peer[other], *group,
                "--host-maddrs", f"/ip4/127.0.0.1/tcp/{free_port()}", "--port", str(free_port())]

    base = {"a": orch_args("a", "b"), "b": orch_args("b", "a")}  # fixed identities and ports
    logs = Path(args.log_dir) if args.log_dir else root / "logs"
    server = LocalServer("s0", memory_for(model, max_length, 4, 4), tau_p=0.01, emulate_rtt_ms=20)
    a = LocalSwarm(model, [server], max_length=max_length, log_dir=logs / "a",
                   server_args=["--trust-orchestrator", peer["a"], peer["b"]], orchestrator_args=base["a"])
    b: Optional[LocalSwarm] = None
    report: dict[str, Any] = {"rounds": []}
    stop = threading.Event()
    threads: list[threading.Thread] = []
    stats = {"a": new_stats(), "b": new_stats(), "python": new_stats()}
    try:
        a.start()
        b = LocalSwarm(model, [], max_length=max_length, log_dir=logs / "b",
                       orchestrator_args=[*base["b"], "--initial-peers", *a.initial_peers])
        b.start()
        orchs = Orchestrators(a, b)
        deadline = time.monotonic() + 180
        while orchs.serving() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("no group got the server's chain in 180 s")
            time.sleep(0.5)

        def other_knows_group(name: str) -> bool:
            st = orchs.swarms[name].swarm()
            return any(o["servers"] for o in (st["groups"] or {}).get("orchestrators", [])
                       if o["peer_id"] != st["groups"]["me"] and o["live"])

        serving = orchs.serving()
        idle = "b" if serving == "a" else "a"
        orchs.swarms[idle].wait_until(lambda s: other_knows_group(idle), 60, "the idle orchestrator to see the group")
        name = a.swarm()["model"]
        from petals_chain.client import Client

        ref = [Client(orchs.url(serving), timeout=120).complete(pr, max_tokens=args.max_tokens, ignore_eos=True)
               for pr in prompts]
        want_ids, want = [r.token_ids for r in ref], [r.text for r in ref]
        from chaos import reference_greedy  # the whole model in this process: the swarm's outputs are exact

        assert reference_greedy(model, prompts, args.max_tokens) == want_ids, "the swarm's greedy outputs differ"
        for n in "ab":
            for k in range(args.streams):
                threads.append(threading.Thread(target=stream_client, daemon=True, args=(
                    orchs, n, name, prompts, want, args.max_tokens, stats[n], stop, args.seed * 100 + k)))
        threads.append(threading.Thread(target=python_client, daemon=True, args=(
            orchs, prompts, want_ids, want, args.max_tokens, stats["python"], stop, args.seed)))
        for t in threads:
            t.start()
        log(f"load on: {len(threads)} clients; {serving} serves, {idle} forwards")
        for k in range(args.rounds):
            time.sleep(args.settle_s)
            victim = orchs.serving()
            if victim is None:
                raise RuntimeError("no orchestrator serves")
            survivor = "b" if victim == "a" else "a"
            before = orchs.swarms[survivor].swarm()["groups"]
            killed = time.monotonic()
            with orchs.lock:
                orchs.down[victim].append((killed, None))
            freeze = args.freeze and k % 2 == 1
            pid = orchs.swarms[victim].orchestrator.popen.pid
            # frozen: its host is gone but its connections stay open (no reset reaches the survivor's relays)
            signal_role(pid, signal.SIGSTOP if freeze else signal.SIGKILL)
            orchs.swarms[survivor].wait_until(lambda s: bool(s["chains"]), 120, "the survivor to serve the group")
            took = time.monotonic() - killed
            if freeze:
                time.sleep(args.settle_s)  # the survivor's streams relayed from the frozen one are finished meanwhile
                signal_role(pid, signal.SIGKILL)
            orchs.swarms[victim].orchestrator.popen.wait(10)
            # restarted as an operator would: given the swarm's addresses (the survivor's), else its DHT node waits
            # for the others to call it before it sees anything (it was the first one, started with none)
            vs = orchs.swarms[victim]
            vs.orchestrator_args = [*base[victim], "--initial-peers", *orchs.swarms[survivor].initial_peers]
            vs.start_orchestrator(timeout=120)
            with orchs.lock:
                orchs.down[victim][-1] = (killed, time.monotonic())
            orchs.swarms[victim].wait_until(lambda s: other_knows_group(victim) or bool(s["chains"]), 60,
                                            "the restarted orchestrator to rejoin the groups")
            time.sleep(2.0)  # the survivor's streams forwarded before the kill have finished by now
            after = orchs.swarms[survivor].swarm()["groups"]
            resumed = after["resumed"] - before["resumed"]
            report["rounds"].append({"killed": victim, "how": "SIGSTOP" if freeze else "SIGKILL",
                                     "group_moved_s": round(took, 1),
                                     "survivor_streams_finished_after_the_cut": resumed})
            log(f"round {k + 1}: {'froze' if freeze else 'killed'} {victim}; its group moved to {survivor} in {took:.1f} s; "
                f"{resumed} cut streams finished by {survivor}")
        time.sleep(args.settle_s)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=200)
        if b is not None:
            b.stop()
        a.stop()
        work.cleanup()
    survivors = {"ok": 0, "wrong": 0, "failed": 0}
    for n in "ab":  # a client of an orchestrator counts as a survivor's client whenever its own was not killed
        for key in survivors:
            survivors[key] += stats[n][key]
    report.update({"single_url_stream_clients": {n: {k: v for k, v in stats[n].items() if k != "errors"} for n in "ab"},
                   "python_client_both_urls": {k: v for k, v in stats["python"].items() if k != "errors"},
                   "errors": (stats["a"]["errors"] + stats["b"]["errors"] + stats["python"]["errors"])[:20],
                   "command": "python scripts/herd_failover.py " + " ".join(argv if argv is not None else sys.argv[1:])})
    ok = (survivors["failed"] == 0 and survivors["wrong"] == 0 and stats["python"]["failed"] == 0
          and stats["python"]["wrong"] == 0 and all(r["group_moved_s"] <= MOVE_LIMIT_S for r in report["rounds"]))
    report["ok"] = ok
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
