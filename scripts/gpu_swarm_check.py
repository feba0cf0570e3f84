"""A real P2P swarm on one GPU: three server processes share it (gpu-checklist item 2, swarm part).

    python scripts/gpu_swarm_check.py [--layers 32] [--servers 3] [--new-tokens 32] [--json out.json]
    python scripts/gpu_swarm_check.py --model smollm2-135m --dtype float32     # the real model (GGUF)

A Llama-2-7B-shaped random-weight model (hidden 4096, 32 heads, MLP 11008; ``--layers`` blocks) is written in
bfloat16, or ``--model`` names a real one (a short name, a .gguf file, an HF directory); transformers generates
greedily on the GPU (the reference); then an orchestrator (head and sampling on ``cuda``) and ``--servers`` server
processes (``--device cuda --dtype DTYPE``, each allowed at most
``ceil(layers / servers)`` blocks, so the chain has ``--servers`` hops) serve the same prompts through hivemind on
loopback. Reports token agreement with the reference (run with the attention kernels our servers use: cuDNN's
SDPA off, see ``runner._avoid_cudnn_attention``; and with transformers' defaults) and tokens/s at 1 and 8
concurrent requests.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from petals_chain.swarm.checkpoint import cache_kwarg, load_config, resolve_model_path
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for
from petals_chain.swarm.sources import resolve_source
from petals_chain.swarm.tiny_model import LLAMA2_7B_SHAPE, build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import output_file, positive_int  # noqa: E402


def reference(path: str, prompts: list[list[int]], n: int, device: str, dtype: torch.dtype) -> list[list[int]]:
    """Greedy ``n`` tokens per prompt with transformers on the GPU, end-of-sequence fed like any token."""
    from transformers import DynamicCache

    model = resolve_source(path).load_reference(dtype).to(device)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            cache, out, x = DynamicCache(config=model.config), [], torch.tensor([ids], device=device)
            for _ in range(n):
                tok = int(model(x, use_cache=True, **{cache_kwarg(model): cache}).logits[0, -1].argmax())
                out.append(tok)
                x = torch.tensor([[tok]], device=device)
            outs.append(out)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=positive_int, default=32)
    ap.add_argument("--servers", type=positive_int, default=3)
    ap.add_argument("--new-tokens", type=positive_int, default=32)
    ap.add_argument("--max-length", type=positive_int, default=512)
    ap.add_argument("--json", type=output_file, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="a real model instead of the random 7B-shaped one")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--decode-graph", default="off", choices=["off", "cuda", "eager"], help="the servers' mode")
    ap.add_argument("--quick", action="store_true", help="small shapes (to try the script on a CPU)")
    args = ap.parse_args()
    dev = args.device
    dtype = getattr(torch, args.dtype)
    res: dict = {"gpu": torch.cuda.get_device_name(0) if dev != "cpu" else "cpu", "servers": args.servers,
                 "model": args.model or "llama-2-7b-shaped", "dtype": args.dtype,
                 "decode_graph": args.decode_graph}
    shape = LLAMA2_7B_SHAPE if not args.quick else dict(hidden_size=128, num_attention_heads=4, intermediate_size=256,
                                                 vocab_size=512, initializer_range=0.02)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        if args.model:
            path = str(resolve_model_path(args.model))
        else:
            path = str(build_tiny_model(Path(d) / "seven", family="llama", num_layers=args.layers, dtype=args.dtype,
                                        max_position_embeddings=args.max_length, **shape))
        res["build_s"] = round(time.perf_counter() - t0, 1)
        config = load_config(path)
        layers = res["layers"] = config.num_hidden_layers
        vocab = config.vocab_size  # the tokenizer's, at most shape["vocab_size"] for the random model
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (17, 40)]
        t0 = time.perf_counter()
        # transformers' default attention kernels first, then with cuDNN's SDPA off as our servers run it
        ref_default = reference(path, prompts, args.new_tokens, dev, dtype)
        if dev != "cpu":
            torch.backends.cuda.enable_cudnn_sdp(False)
        ref = reference(path, prompts, args.new_tokens, dev, dtype)
        res["reference_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(res), flush=True)
        per = math.ceil(layers / args.servers)
        mem = memory_for(path, args.max_length, per, 16)
        servers = [LocalServer(f"gpu{i}", mem, extra_args=["--device", dev, "--dtype", args.dtype,
                                                           "--max-blocks", str(per), "--decode-graph",
                                                           args.decode_graph]) for i in range(args.servers)]
        sw = LocalSwarm(path, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=Path(d) / "logs",
                        orchestrator_args=["--device", dev, "--dtype", args.dtype])
        t0 = time.perf_counter()
        sw.start()
        try:
            st = sw.wait_ready(timeout=420)
            res["swarm_ready_s"] = round(time.perf_counter() - t0, 1)
            res["chains"] = [ch["names"] for ch in st["chains"]]
            client = sw.client(timeout=300)
            agree = []
            for ids, want in zip(prompts, ref):
                got = client.complete(ids, max_tokens=args.new_tokens, ignore_eos=True).token_ids
                agree.append(sum(a == b for a, b in zip(got, want)))
                res.setdefault("first_mismatch", []).append(next((i for i, (a, b) in enumerate(zip(got, want))
                                                                   if a != b), None))
                same = sum(a == b for a, b in zip(got, ref_default[len(agree) - 1]))
                res.setdefault("equal_to_default_kernels", []).append(same)
            res["greedy_tokens_equal"] = agree
            res["greedy_tokens_total"] = [len(w) for w in ref]
            print(json.dumps(res), flush=True)
            for conc in (1, 8):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(conc) as ex:
                    outs = list(ex.map(lambda i: client.complete(prompts[i % 2], max_tokens=64, ignore_eos=True),
                                       range(conc)))
                dt = time.perf_counter() - t0
                res[f"tokens_per_s_{conc}"] = round(sum(len(o.token_ids) for o in outs) / dt, 2)
                res[f"exact_{conc}"] = all(o.token_ids[:args.new_tokens] == ref[i % 2] for i, o in enumerate(outs))
            res["max_memory_note"] = "per-process GPU memory is in each server's log"
        except Exception as e:  # noqa: BLE001 - report what ran
            res["error"] = f"{type(e).__name__}: {e}"
            for log in sorted((Path(d) / "logs").glob("*.log")):
                print(f"--- {log.name}\n" + log.read_text()[-3000:], flush=True)
        finally:
            sw.stop()
        print(json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
