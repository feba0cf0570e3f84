"""``python -m petals_chain.demo``: a whole swarm on this machine, in one command.

By default it serves the real model, SmolLM2-135M-Instruct (30 blocks, fetched by ``scripts/setup.sh``):
an orchestrator and heterogeneous servers (different memory budgets, hence spans; emulated network delays)
start as separate processes on loopback, the orchestrator plans (c* by the Theorem 3.7 lower bound,
GBP-CR, GCA), and the demo asks real questions: a fact, a short instruction, a two-turn conversation in a
session and a small burst, printing each answer with the chain that served it, its waiting and service time
and tokens/s. ``--tiny`` runs the old random-weight demo instead (a burst of sampled requests).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from petals_chain.swarm.console import check_working_directory, tolerant_stdout

# Real model: name, blocks of s_m the budget M_j holds, KV slots per hosted block, emulated RTT (ms).
# No server can hold all 30 blocks: every chain has at least two hops.
REAL_SERVERS = [
    ("gpu-a100", 16, 8, 4.0),
    ("gpu-3090", 12, 8, 8.0),
    ("gpu-t4", 10, 6, 12.0),
    ("laptop", 8, 6, 20.0),
]
BURST_QUESTIONS = [
    "Name a planet in our solar system.", "What color is the sky on a clear day?", "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?", "Name a famous painter.", "What is 7 times 8?",
    "Name a fruit that is yellow.", "What do bees make?", "How many days are in a week?", "Name an ocean.",
    "What is the opposite of hot?", "Which animal is known as the king of the jungle?",
]

# Tiny model: name, memory budget M_j as (blocks of s_m + cache slots of s_c) for an 8-block model, tau_p
# (s/block/job before emulation), emulated RTT (ms), emulated compute slowdown.
DEMO_SERVERS = [
    ("a100", 8, 16, 0.0010, 1.0, 1.0),
    ("rtx3090", 4, 8, 0.0015, 4.0, 1.0),
    ("rtx4070", 4, 8, 0.0015, 6.0, 1.0),
    ("t4", 6, 8, 0.0010, 10.0, 2.0),
    ("laptop", 3, 4, 0.0020, 15.0, 1.5),
    ("mac-mini", 3, 4, 0.0020, 15.0, 1.5),
]

PROMPTS = [
    "The quick brown fox", "Once upon a time there was", "Hello! How are you today?", "What is the capital of France?",
    "Please write a short poem about the sea.", "Large language models are served by", "The people of the village",
    "Numbers: one two three", "The orchestrator composes servers into chains", "My name is Alice, and",
    "Questions and answers:", "Volunteers run servers on their own computers",
]


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def print_plan(state: dict) -> None:
    pred = state.get("predicted_response_s") or {}
    print(f"\nPlan: epoch {state['epoch']}, c* = {state['c']}, arrival rate {state['arrival_rate']:.3g} req/s, "
          f"rho_bar {state['rho_bar']}; predicted mean response (Thm 3.7) "
          f"{_fmt_s(pred.get('lower'))} .. {_fmt_s(pred.get('upper'))}")
    print("\nServers (placement):")
    print(f"  {'name':<10} {'blocks':<9} {'slots':>9} {'memory':>10} {'tau_p/job':>10} {'tau_c/job':>10} "
          f"{'emulation':<18}")
    for s in sorted(state["servers"], key=lambda s: s["public_name"]):
        span = f"{s['start_block']}-{s['start_block'] + s['num_blocks'] - 1}" if s["num_blocks"] else "none"
        emu = f"rtt {s['emulate_rtt_ms']:g}ms x{s['emulate_compute_scale']:g}"
        print(f"  {s['public_name']:<10} {span:<9} {s['slots_free']:>4}/{s['slots_total']:<4} "
              f"{s['memory_bytes'] / 2**20:>8.1f}MB {_fmt_s(s['tau_p']):>10} {_fmt_s(s['tau_c']):>10} {emu:<18}")
    print("\nChains (GCA order; JFFC sends each job to the fastest chain with a free slot):")
    for ch in state["chains"]:
        route = " -> ".join(f"{n}[{a}:{b})" for n, (a, b) in zip(ch["names"], ch["spans"]))
        print(f"  #{ch['id']:<3} capacity {ch['capacity']:>2}  service {_fmt_s(ch['service_time']):>9}  {route}")


def run_burst(client, n: int, max_tokens: int, tick: Callable[[], None] | None = None) -> list[dict]:
    """Send ``n`` requests at once; return per-request results in submission order. ``tick()``: called every
    :data:`TICK_S` while they run."""
    results: list[dict] = [{} for _ in range(n)]

    def one(i: int) -> None:
        t0 = time.monotonic()
        try:
            c = client.complete(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, temperature=0.8, seed=i)
            results[i] = {"ok": True, "wait_s": c.wait_s, "service_s": c.service_s, "tokens": len(c.token_ids),
                          "chain": c.chain, "text": c.text, "total_s": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001 - reported in the table
            results[i] = {"ok": False, "error": str(e), "total_s": time.monotonic() - t0}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(TICK_S)
            if tick is not None:
                tick()
    return results


TICK_S = 0.2


class _ChainPeaks:
    """Each chain's most jobs at once, as the orchestrator counts them (``max_active`` in ``/api/v1/swarm``: since
    start, per chain id and capacity), read at each :meth:`tick`. GCA composes the chains anew as the servers'
    measurements come in (in the tiny demo, during the burst), and ``/api/v1/swarm`` shows only the chains of now:
    read once after the burst, it showed chains that had run nothing (``#0 0/10``) in place of those that ran it, so
    a chain over its capacity went unseen. A chain replaced between two ticks loses at most its last ``TICK_S``."""

    def __init__(self, swarm):
        self.swarm = swarm
        self.peaks: dict[tuple, tuple[int, int]] = {}  # (id, capacity) -> (most at once, capacity)

    def tick(self) -> None:
        try:
            chains = self.swarm.swarm()["chains"]
        except Exception:  # noqa: BLE001 - a missed reading: the next one has the same counts (they only grow)
            return
        for ch in chains:
            key = (ch["id"], ch["capacity"])
            self.peaks[key] = (max(self.peaks.get(key, (0, 0))[0], int(ch.get("max_active") or 0)), ch["capacity"])

    def over(self) -> bool:
        return any(most > cap for most, cap in self.peaks.values())

    def text(self) -> str:
        return ", ".join(f"#{key[0]} {most}/{cap}" for key, (most, cap) in self.peaks.items())


def _report_peaks(peaks: _ChainPeaks, chains_now: int) -> bool:
    """Print each chain's most jobs at once against its capacity, as the orchestrator counted them (every chain the
    burst had); False if one ran more."""
    if len({key[0] for key in peaks.peaks}) < len(peaks.peaks) or len(peaks.peaks) > chains_now:
        print("  (GCA composed the chains anew during the burst: each chain is shown at each capacity it had)")
    if peaks.over():
        print(f"  ERROR: a chain ran more jobs at once than its GCA capacity (most at once/capacity: {peaks.text()})")
        return False
    print(f"  no chain ran more jobs at once than its GCA capacity (most at once/capacity: {peaks.text()})")
    return True


class _Printer:
    """Prints answers with how they were served (chain names, wait, service, tokens/s)."""

    def __init__(self, swarm):
        self.names = {s["peer_id"]: s["public_name"] for s in swarm.swarm()["servers"]}

    def chain(self, peers: list[str]) -> str:
        return " -> ".join(self.names.get(p, p[:8]) for p in peers)

    def answer(self, label: str, question: str, c) -> None:
        print(f"\n  {label}: {question}")
        text = c.text.strip().replace("\n", "\n      ")
        print(f"    > {text}")
        print(f"      chain {self.chain(c.chain)} | wait {_fmt_s(c.wait_s)} | service {_fmt_s(c.service_s)} | "
              f"{len(c.token_ids)} tokens, {c.tokens_per_s:.1f} tokens/s"
              + (f" | {c.failovers} failover(s)" if c.failovers else ""))


def _work_dir(arg: str | None) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    if arg is None:
        tmp = tempfile.TemporaryDirectory(prefix="petals-chain-demo-")
        return Path(tmp.name), tmp
    work = Path(arg)
    work.mkdir(parents=True, exist_ok=True)
    return work, None


def _cleanup(tmp: tempfile.TemporaryDirectory | None) -> None:
    if tmp is not None:
        tmp.cleanup()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _say(*text: object, file=None) -> None:
    """``print`` that never raises: a closed pipe (``demo | head``) or terminal (SIGHUP) made the shutdown's first
    line raise, and the swarm was never stopped."""
    try:
        print(*text, file=file or sys.stdout, flush=True)
    except (OSError, ValueError):  # ValueError: the stream is closed
        pass


def _keep_running(args, swarm) -> None:
    if args.keep_running:
        print("      --keep-running: the swarm stays up; press Ctrl+C to stop")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


def _shutdown(swarm, t_start: float, tmp) -> None:
    """Stop the swarm whatever comes meanwhile. Ctrl-C (SIGTERM, SIGHUP) while it stops is answered, not raised:
    raised, it cut ``swarm.stop()`` short and the orchestrator (or every node) ran on in its own session."""
    def still_stopping(signum, frame) -> None:
        _say("      still stopping the swarm (about 20 s at most), please wait ...", file=sys.stderr)

    saved = {sig: signal.signal(sig, still_stopping) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        _say("Shutting down the swarm ...")
        swarm.stop()
        left = swarm.leftover_processes()
        _say("Stopped cleanly." if not left else f"warning: processes left: {left}")
        _say(f"Total time {time.monotonic() - t_start:.1f} s")
    finally:
        _cleanup(tmp)
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def run_real(args) -> int:
    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory
    from petals_chain.swarm.registry import REGISTRY, ModelNotFetched, fetch_command, registry_path, sha256_of

    t_start = time.monotonic()
    work, tmp = _work_dir(args.work_dir)
    error = None
    try:
        # a known model's file is checked (~0.5 s): a corrupt copy whose header still parsed served garbage, and a
        # truncated one was refused without saying that fetching again repairs it
        if args.model in REGISTRY and sha256_of(path := registry_path(args.model)) != REGISTRY[args.model].sha256:
            raise ValueError(f"{path} is not the file fetch verified (its SHA-256 differs: a corrupt or partial "
                             f"copy); fetch it again with: {fetch_command(args.model)}")
        num_blocks, s_m, s_c = model_memory(args.model, args.max_length)
        max_pos = getattr(load_config(args.model), "max_position_embeddings", None)
    except (ModelNotFetched, OSError, ValueError) as e:  # not fetched, no such model: say so, no traceback
        error = f"--model {args.model}: {e}"
    except BaseException:  # Ctrl-C while reading the model: main() says so; the temp dir goes now
        _cleanup(tmp)
        raise
    if error is None and max_pos and args.max_length > max_pos:  # else found only after starting every node
        error = f"--max-length {args.max_length} exceeds the model's max_position_embeddings {max_pos}"
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        _cleanup(tmp)
        return 2
    print(f"[1/5] Model {args.model}: {num_blocks} blocks, s_m = {s_m / 2**20:.1f} MB per block, "
          f"s_c = {s_c / 2**20:.2f} MB per KV slot at max_length {args.max_length}")
    servers = [LocalServer(name, int(min(blocks, num_blocks - 1) * (s_m + slots * s_c)), emulate_rtt_ms=rtt)
               for name, blocks, slots, rtt in REAL_SERVERS[:args.servers]]
    swarm = LocalSwarm(args.model, servers, max_length=args.max_length, arrival_rate=float(args.arrival_rate),
                       log_dir=work / "logs")
    code = 0
    try:
        print(f"[2/5] Starting the orchestrator and {len(servers)} servers as processes (logs in {work / 'logs'})")
        swarm.start()
        print(f"      orchestrator: {swarm.url}  initial peers: {swarm.initial_peers[0]}")
        print("[3/5] Waiting for the plan: servers measure tau_p and announce M_j, the orchestrator measures tau_c,")
        print("      picks c*, places blocks with GBP-CR, servers load their spans, GCA composes chains ...")
        state = swarm.wait_ready(timeout=300)
        print(f"      ready after {time.monotonic() - t_start:.1f} s")
        print_plan(state)
        client = swarm.client()
        show = _Printer(swarm)
        print("\n[4/5] Questions (greedy unless stated; each answer shows the chain that served it)")
        q = "What is the capital of France?"
        c = client.chat_completion([{"role": "user", "content": q}], max_tokens=48)
        show.answer("fact", q, c)
        if "paris" not in c.text.lower():
            print("      (unexpected: the answer does not name Paris)")
            code = 1
        q = "Write a one-sentence description of the sea."
        show.answer("instruction, temperature 0.7, seed 1", q,
                    client.chat_completion([{"role": "user", "content": q}], max_tokens=64, temperature=0.7, seed=1))
        with client.session() as s:
            for i, q in enumerate(["Hi, I am Ada. I live in Rome.", "Which city do I live in?"], 1):
                show.answer(f"session turn {i}", q, s.chat(q, max_tokens=48))
        # one more question than the chains have slots: JFFC fills the fastest chain, then the next, and the last
        # waits in the central queue for the first slot to free
        slots = sum(ch["capacity"] for ch in state["chains"])
        questions = [BURST_QUESTIONS[i % len(BURST_QUESTIONS)] for i in range(max(2, min(slots + 1, 32)))]
        rest = "; the rest wait in the central queue" if len(questions) > slots else ""
        print(f"\n  burst: {len(questions)} questions at once, {slots} chain slots (JFFC fills the fastest chain's "
              f"slots, then the next chain's{rest})")
        results: list = [None] * len(questions)

        def ask(i: int) -> None:
            try:
                results[i] = client.chat_completion([{"role": "user", "content": questions[i]}], max_tokens=32)
            except Exception as e:  # noqa: BLE001 - reported below
                results[i] = e

        t0 = time.monotonic()
        peaks = _ChainPeaks(swarm)  # as --tiny: a chain over its capacity is said, not left to the timeline
        peaks.tick()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(TICK_S)
                peaks.tick()
        elapsed = time.monotonic() - t0
        for i, r in enumerate(results):
            if isinstance(r, Exception):
                print(f"  {questions[i]!r}: FAILED: {r}")
                code = 1
            else:
                print(f"  {_fmt_s(r.wait_s):>9} wait {_fmt_s(r.service_s):>9} service  {show.chain(r.chain):<34} "
                      f"{questions[i][:34]!r:<36} -> {r.text.strip()[:40]!r}")
        tokens = sum(len(r.token_ids) for r in results if not isinstance(r, Exception))
        m = swarm.swarm()["measured"]
        print(f"  burst done in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s over all); since start: mean wait "
              f"{_fmt_s(m['mean_wait_s'])}, mean service {_fmt_s(m['mean_service_s'])}")
        print("  (wait: in the central queue and opening the chain; service: from then to the last token)")
        peaks.tick()
        if not _report_peaks(peaks, len(swarm.swarm()["chains"])):
            code = 1
        print(f"\n[5/5] Dashboard: {swarm.url}/   OpenAI API: {swarm.url}/v1   swarm JSON: {swarm.url}/api/v1/swarm")
        _keep_running(args, swarm)
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 - print a clear failure, then clean up
        _say(f"demo failed: {e}", file=sys.stderr)
        code = 1
    finally:
        _shutdown(swarm, t_start, tmp)
    return code


def run_tiny(args) -> int:
    from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory
    from petals_chain.swarm.tiny_model import build_tiny_model

    work, tmp = _work_dir(args.work_dir)
    t_start = time.monotonic()
    print(f"[1/5] Building a tiny random-weight {args.family} model ({args.layers} blocks) in {work / 'model'}")
    try:
        path = build_tiny_model(work / "model", family=args.family, num_layers=args.layers, seed=0,
                                max_position_embeddings=TINY_MAX_POSITIONS)
        _, s_m, s_c = model_memory(path, args.max_length)
    except BaseException:  # Ctrl-C while building: main() says so; the temp dir goes now
        _cleanup(tmp)
        raise
    servers = []
    for name, blocks, slots, tau_p, rtt, scale in DEMO_SERVERS:
        blocks = max(1, min(args.layers, round(blocks * args.layers / 8)))
        servers.append(LocalServer(name, blocks * s_m + slots * s_c, emulate_rtt_ms=rtt, emulate_compute_scale=scale,
                                   tau_p=tau_p))
    rate = None if args.arrival_rate == "auto" else float(args.arrival_rate)
    swarm = LocalSwarm(path, servers, max_length=args.max_length, arrival_rate=rate, log_dir=work / "logs")
    code = 0
    try:
        print(f"[2/5] Starting the orchestrator and {len(servers)} servers as processes (logs in {work / 'logs'})")
        swarm.start()
        print(f"      orchestrator: {swarm.url}  initial peers: {swarm.initial_peers[0]}")
        print("[3/5] Waiting for the plan: servers announce M_j and tau_p, the orchestrator measures tau_c, picks c*,")
        print("      places blocks with GBP-CR, servers load their spans, GCA composes chains ...")
        state = swarm.wait_ready(timeout=240)
        print(f"      ready after {time.monotonic() - t_start:.1f} s")
        print_plan(state)
        client = swarm.client()
        print(f"\n[4/5] Sending a burst of {args.requests} requests at once ({args.max_tokens} tokens each, sampled)")
        t0 = time.monotonic()
        peaks = _ChainPeaks(swarm)
        peaks.tick()
        results = run_burst(client, args.requests, args.max_tokens, peaks.tick)
        elapsed = time.monotonic() - t0
        name_of = {s["peer_id"]: s["public_name"] for s in swarm.swarm()["servers"]}
        print(f"\n  {'#':>3} {'wait':>9} {'service':>9} {'tokens':>6}  chain / text")
        for i, r in enumerate(results):
            if r.get("ok"):
                chain = "->".join(name_of.get(x, x[:8]) for x in r["chain"])
                print(f"  {i:>3} {_fmt_s(r['wait_s']):>9} {_fmt_s(r['service_s']):>9} {r['tokens']:>6}  {chain:<28} "
                      f"{r['text'][:40]!r}")
            else:
                print(f"  {i:>3} FAILED: {r['error']}")
                code = 1
        ok = [r for r in results if r.get("ok")]
        final = swarm.swarm()
        m = final["measured"]
        print(f"\n  {len(ok)}/{len(results)} completed in {elapsed:.2f} s; mean wait {_fmt_s(m['mean_wait_s'])}, "
              f"mean service {_fmt_s(m['mean_service_s'])}, mean response {_fmt_s(m['mean_response_s'])}")
        busy = sum(1 for r in ok if r["wait_s"] > 0.1)
        print(f"  {busy} requests waited over 100 ms in the central queue for a free chain (JFFC)")
        peaks.tick()
        if not _report_peaks(peaks, len(final["chains"])):
            code = 1
        print(f"\n[5/5] Dashboard: {swarm.url}/   API: {swarm.url}/v1   swarm JSON: {swarm.url}/api/v1/swarm")
        _keep_running(args, swarm)
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 - print a clear failure, then clean up
        _say(f"demo failed: {e}", file=sys.stderr)
        code = 1
    finally:
        _shutdown(swarm, t_start, tmp)
    return code


# The shortest --max-length the questions fit in: the real demo's two-turn chat session (the template's system
# prompt, two questions, two answers of up to 48 tokens) takes about 200 tokens; a tiny burst's prompt up to 64
MIN_MAX_LENGTH = 256
TINY_PROMPT_TOKENS = 64
TINY_MAX_POSITIONS = 4096  # the tiny model's max_position_embeddings: a longer --max-length failed after start
# A burst is one thread per request from one anonymous client: past the orchestrator's --client-max-inflight
# (default 256) requests failed with HTTP 429 after the whole run; 100000 started 100000 threads.
MAX_REQUESTS = 256
MAX_LAYERS = 64  # 10^6 layers built a model until memory ran out


def _arrival_rate(text: str) -> str:
    """``--arrival-rate`` as the orchestrator takes it, kept as text (the demo passes it on)."""
    from petals_chain.orchestrator.__main__ import arrival_rate_arg

    arrival_rate_arg(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m petals_chain.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="random-weight tiny model and a burst of sampled requests")
    p.add_argument("--model", default="smollm2-135m", help="the real model (default: smollm2-135m)")
    p.add_argument("--servers", type=int, default=len(REAL_SERVERS), choices=range(3, len(REAL_SERVERS) + 1),
                   help="real model: how many servers to start")
    p.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2"], help="--tiny: model family")
    p.add_argument("--layers", type=int, default=8, help="--tiny: transformer blocks of the tiny model")
    p.add_argument("--requests", type=int, default=16, help="--tiny: requests in the burst")
    p.add_argument("--max-tokens", type=int, default=24, help="--tiny: tokens per request")
    p.add_argument("--max-length", type=int, default=None, help="tokens per job (default: 1024, --tiny: 256)")
    p.add_argument("--arrival-rate", default=None, type=_arrival_rate,
                   help="arrival rate the planner assumes (req/s; default 0.5, --tiny 8) or 'auto' (--tiny)")
    p.add_argument("--keep-running", action="store_true", help="keep the swarm up at the end (Ctrl+C to stop)")
    p.add_argument("--work-dir", default=None, help="where to put logs (and the tiny model); default: a temp dir")
    args = p.parse_args(argv)
    tolerant_stdout()
    try:  # its roles (and torch's import) die without one
        check_working_directory("demo")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stop the swarm as Ctrl+C does (it outlived a killed demo)
        signal.signal(sig, _interrupt)
    # a demo started in the background by a shell script inherits SIGINT ignored: `kill -INT` did nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.work_dir is not None:  # an unusable one failed with a traceback, after the swarm was set up
        try:
            Path(args.work_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"--work-dir {args.work_dir}: {e.strerror or e}")
    if args.tiny:
        if not (2 <= args.layers <= MAX_LAYERS and 1 <= args.requests <= MAX_REQUESTS and args.max_tokens >= 1):
            p.error(f"--layers must be in 2..{MAX_LAYERS}, --requests in 1..{MAX_REQUESTS} (the orchestrator's "
                    f"requests per client), --max-tokens >= 1; got {args.layers}, {args.requests}, {args.max_tokens}")
        floor = args.max_tokens + TINY_PROMPT_TOKENS
        args.max_length = 256 if args.max_length is None else args.max_length  # 0 ran at the default, unsaid
        if args.max_length < floor:
            p.error(f"--max-length must be >= {floor} (a prompt of up to {TINY_PROMPT_TOKENS} tokens plus "
                    f"--max-tokens {args.max_tokens}), got {args.max_length}")
        if args.max_length > TINY_MAX_POSITIONS:
            p.error(f"--max-length must be <= {TINY_MAX_POSITIONS} (the tiny model's max_position_embeddings), "
                    f"got {args.max_length}")
        args.arrival_rate = args.arrival_rate or "8"
        return _run(run_tiny, args)
    args.max_length = 1024 if args.max_length is None else args.max_length
    if args.max_length < MIN_MAX_LENGTH:
        p.error(f"--max-length must be >= {MIN_MAX_LENGTH} (the demo's chat session needs about 200 tokens), "
                f"got {args.max_length}")
    args.arrival_rate = args.arrival_rate or "0.5"
    if args.arrival_rate == "auto":
        p.error("--arrival-rate auto is for --tiny; give a number")
    return _run(run_real, args)


def _run(demo, args) -> int:
    """``demo(args)``; Ctrl-C (SIGTERM, SIGHUP) before its swarm starts ends it with 130 and a line, no traceback."""
    try:
        return demo(args)
    except KeyboardInterrupt:
        _say("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
