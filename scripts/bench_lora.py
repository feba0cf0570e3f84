"""The cost of LoRA adapters in a server's batches: one decode step of a batch of sessions over a runner's blocks, with
every row on the base model, rows split between the base and two adapters, and every row on one adapter.

    python scripts/bench_lora.py [--model smollm2-135m] [--blocks 4] [--rows 16] [--rank 16] [--rounds 5]

Builds two random adapters in peft's format (rank ``--rank`` on q/k/v/o and the MLP's three projections, every
layer), one runner over the model's first ``--blocks`` blocks serving both, and ``--rows`` sessions with a prefix of
32 tokens. Each round times the same decode batch (``run_batch``, the batcher's call) in the three compositions, A/B/C
in turn because the machine is shared and noisy; prints medians (ms per step) and each composition's ratio to the
all-base batch. ``--model``: a short name, .gguf or HF directory (default: a tiny random Llama, hidden 64); one torch
thread unless ``--threads`` (on a shared 2-core host, 2 threads made every step ~40x slower under load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from petals_chain.server.batching import BatchItem, run_batch
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.lora import read_adapter
from petals_chain.swarm.sources import empty_weights, resolve_source
from petals_chain.swarm.tiny_model import build_tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, config, rank: int, seed: int) -> Path:
    """A random adapter of ``config``'s model on every layer's ``TARGETS`` (peft's keys and config)."""
    from safetensors.torch import save_file

    from petals_chain.swarm.checkpoint import decoder_layer_class

    with empty_weights():
        layer = decoder_layer_class(config)(config, 0)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, mod in layer.named_modules():
        if name.split(".")[-1] not in TARGETS:
            continue
        for i in range(int(config.num_hidden_layers)):
            key = f"base_model.model.model.layers.{i}.{name}"
            state[f"{key}.lora_A.weight"] = torch.randn(rank, mod.in_features, generator=g) * 0.01
            state[f"{key}.lora_B.weight"] = torch.randn(mod.out_features, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(TARGETS), "bias": "none"}))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: a tiny random Llama (hidden 64, 8 layers)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per composition per round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a server's, with LocalSwarm: 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "tiny", num_layers=8)
        config = resolve_source(model).config
        adapters = [read_adapter(write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i), f"a{i}")
                    for i in range(2)]
        fps = [a.fingerprint for a in adapters]
        r = BlockRunner(model, 0, args.blocks, num_slots=args.rows * 3 * args.blocks, max_length=64, progress=False,
                        adapters=adapters)
        H = r.hidden_size
        compositions = {"base": [None] * args.rows,
                        "mixed": [[None, fps[0], fps[1]][i % 3] for i in range(args.rows)],
                        "adapter": [fps[0]] * args.rows}
        sessions = {}
        for name, kinds in compositions.items():  # each composition its own sessions, prefilled alike
            rows = []
            for i, kind in enumerate(kinds):
                sid = f"{name}{i}"
                r.allocate(sid, 0, args.blocks, adapter=kind)
                pages = r._sessions[sid].pages_of
                run_batch(r, [BatchItem(torch.randn(1, 32, H), 0, pages, 0, args.blocks, kind)])
                rows.append((pages, kind))
            sessions[name] = rows
        times: dict[str, list[float]] = {name: [] for name in compositions}
        x = torch.randn(1, 1, H)
        for _ in range(args.rounds):
            for name, rows in sessions.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):  # the same position each time: the step's cost, not a growing cache
                    run_batch(r, [BatchItem(x, 32, pages, 0, args.blocks, kind) for pages, kind in rows])
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
        print(f"model {model if args.model else 'tiny llama (hidden 64)'}, {args.blocks} blocks, {args.rows} rows, "
              f"rank {args.rank}, adapter bytes on the span {r.adapter_bytes}")
        for name in compositions:
            med = statistics.median(times[name])
            ratios = [t / b for t, b in zip(times[name], times["base"])]
            print(f"{name:8s} {med:8.2f} ms/step  x{statistics.median(ratios):.2f} of all-base")
    return 0


if __name__ == "__main__":
    sys.exit(main())
