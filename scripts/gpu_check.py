"""The GPU checklist's in-process parts (../shared/docs/gpu-checklist.md items 2, 4, 5) in one run, for a lent GPU.

    python scripts/gpu_check.py [--device cuda] [--layers 8] [--json out.json] [--quick]
    python scripts/gpu_check.py --decode-graph [--device cuda]

1. ``exact``: greedy tokens of our path (three ``BlockRunner`` spans on the device, as a 3-hop chain's servers
   run them, plus the orchestrator's head from ``load_head``) against transformers' own model on the same device:
   a tiny random Llama in float32 and a Llama-2-7B-shaped random model (hidden 4096, 32 heads, MLP 11008, vocab
   32000; ``--layers`` blocks) in bfloat16. Reports the agreeing prefix of 32 greedy tokens and the largest logit
   difference at the prefill.
2. ``batching``: decode steps/s of one 7B-shaped span (4 blocks, bf16) at 1, 8 and 32 concurrent sessions, the
   server's continuous batching on vs off (``scripts/bench_batching.py``'s measurement); goal >= 8x at 32.
3. ``decode_graph`` (``--decode-graph``, alone): one session's decode step over a span, eager vs the static-shape
   step (``--decode-graph eager``) vs its CUDA graph (``--decode-graph cuda``): ms per step and the largest relative
   difference from the eager path's output, on a SmolLM2-shaped span (10 blocks, hidden 576, 9 heads, 3 KV heads,
   fp32) and a Llama-2-7B-shaped one (4 blocks, bf16), random weights.
4. ``head``: the orchestrator's LM head (hidden 4096 x vocab 128256, bf16) plus batched sampling per step at batch
   1, 8, 32 on the device, and the batched sampler vs a per-request loop (``scripts/bench_sampling.py``'s mix).

Every section records its error instead of stopping the run; the JSON has everything printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from petals_chain.swarm.tiny_model import LLAMA2_7B_SHAPE

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import output_file, positive_int  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exact(path: str, device: torch.device, dtype: torch.dtype, layers: int, new_tokens: int = 32) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    from petals_chain.server.runner import BlockRunner
    from petals_chain.swarm.checkpoint import cache_kwarg, load_head

    cuts = [0, layers // 3, 2 * layers // 3, layers]
    runners = [BlockRunner(path, a, b - a, num_slots=b - a, max_length=64, dtype=dtype, device=device, progress=False)
               for a, b in zip(cuts, cuts[1:])]
    for r, (a, b) in zip(runners, zip(cuts, cuts[1:])):
        r.allocate("s", a, b)
    head = load_head(path, dtype=dtype, device=device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=g).to(device)
    ours, ref, diffs = [], [], []
    cache = DynamicCache(config=model.config)
    inp_o, inp_r, pos = ids, ids, 0
    with torch.no_grad():
        for _ in range(new_tokens):
            hidden = head.embed(inp_o)
            for r in runners:
                hidden = r.forward("s", hidden, pos)
            lo = head.logits(hidden[:, -1]).float()
            lr = model(inp_r, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1].float()
            diffs.append(float((lo - lr).abs().max()))
            to, tr = int(lo.argmax(-1)), int(lr.argmax(-1))
            ours.append(to)
            ref.append(tr)
            pos += inp_o.shape[1]
            inp_o = torch.tensor([[to]], device=device)
            inp_r = torch.tensor([[tr]], device=device)
    agree = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    del model, runners, head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"dtype": str(dtype), "layers": layers, "tokens": new_tokens, "agreeing_prefix": agree,
            "identical": ours == ref, "distinct_tokens": len(set(ref)), "max_logit_diff_prefill": diffs[0],
            "max_logit_diff_any": max(diffs), "ours": ours, "ref": ref}


def batching(path: str, device: torch.device, dtype: torch.dtype, sessions: list[int], steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_batching import decode_rate

    from petals_chain.server.runner import BlockRunner

    blocks = 4
    out = {}
    common = dict(num_slots=max(sessions) * blocks, max_length=32 + steps + 8, progress=False, dtype=dtype,
                  device=device)
    on = BlockRunner(path, 0, blocks, batching=True, **common)
    off = BlockRunner(path, 0, blocks, batching=False, **common)
    for n in sessions:
        decode_rate(on, n, 32, 4)  # warm-up
        decode_rate(off, n, 32, 4)
        b, rows = decode_rate(on, n, 32, steps, seed=1)
        u, _ = decode_rate(off, n, 32, steps, seed=1)
        out[n] = {"batched_steps_per_s": round(b, 1), "unbatched_steps_per_s": round(u, 1), "ratio": round(b / u, 2),
                  "rows_per_batch": round(rows, 1)}
        print(f"  batching {n:>3} sessions: on {b:8.1f} steps/s, off {u:8.1f} steps/s, {b / u:5.2f}x "
              f"({rows:.1f} rows/batch)", flush=True)
    on.close() if hasattr(on, "close") else None
    off.close() if hasattr(off, "close") else None
    base = out[sessions[0]]["batched_steps_per_s"]
    out["scaling_at_max"] = round(out[max(sessions)]["batched_steps_per_s"] / base, 2)
    return out


SMOLLM2_SHAPE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                     vocab_size=49152, initializer_range=0.02)


def decode_graph(path: str, device: torch.device, dtype: torch.dtype, blocks: int, steps: int = 60) -> dict:
    """ms per one-token step of one session over ``blocks`` blocks per ``--decode-graph`` mode, and each mode's
    largest difference from the eager path (relative to the output's largest value)."""
    from petals_chain.server.runner import BlockRunner

    modes = ["off", "eager"] + (["cuda"] if device.type == "cuda" else [])
    runners = {m: BlockRunner(path, 0, blocks, num_slots=2 * blocks, max_length=512, dtype=dtype, device=device,
                              batching=False, progress=False, decode_graph=m) for m in modes}
    g = torch.Generator().manual_seed(0)
    h = runners["off"].hidden_size
    prompt = torch.randn(1, 32, h, generator=g).to(dtype)
    inputs = [torch.randn(1, 1, h, generator=g).to(dtype) for _ in range(steps)]
    outs: dict[str, list[torch.Tensor]] = {}
    times: dict[str, list[float]] = {}
    for m, r in runners.items():
        r.allocate("s", 0, blocks)
        r.forward("s", prompt, 0)
        outs[m], times[m] = [], []
        for i, x in enumerate(inputs):
            _sync(device)
            t0 = time.perf_counter()
            y = r.forward("s", x, 32 + i)
            _sync(device)
            times[m].append(time.perf_counter() - t0)
            outs[m].append(y.float())
    out: dict = {"blocks": blocks, "dtype": str(dtype).replace("torch.", ""), "steps": steps}
    for m in modes:
        ms = statistics.median(times[m][5:]) * 1e3  # the first steps include the capture
        diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(outs["off"], outs[m]))
        out[m] = {"ms_per_step": round(ms, 3), "max_rel_diff": diff,
                  **({"stats": runners[m].static_decode.stats()} if m != "off" else {})}
    if "cuda" in modes:
        out["speedup_cuda_vs_off"] = round(out["off"]["ms_per_step"] / out["cuda"]["ms_per_step"], 2)
    return out


def profile_decode(path: str, device: torch.device, dtype: torch.dtype, steps: int = 20) -> dict:
    """Where one session's decode step goes on a 4-block span: wall ms per step (input on the CPU, as the server
    receives it, and on the device), and torch.profiler's top operators by self CPU and by device time."""
    from torch.profiler import ProfilerActivity, profile

    from petals_chain.server.runner import BlockRunner

    r = BlockRunner(path, 0, 4, num_slots=8, max_length=512, progress=False, dtype=dtype, device=device)
    H = r.hidden_size
    out = {}
    if device.type == "cuda":
        # SDPA's backends on decode lengths never seen before (cuDNN builds a plan per shape) and seen again
        for label, start, cudnn in (("default_new_lengths", 100, True), ("default_seen_lengths", 100, True),
                                    ("no_cudnn_new_lengths", 300, False)):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            r.allocate("q", 0, 4)
            r.forward("q", torch.randn(1, start, H, device=device), 0)
            x = torch.randn(1, 1, H, device=device)
            _sync(device)
            t0 = time.perf_counter()
            for k in range(steps):
                x = r.forward("q", x, start + k)
            _sync(device)
            out[f"ms_per_step_{label}"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
            r.release("q")
        torch.backends.cuda.enable_cudnn_sdp(True)
    for where in ("cpu", str(device)):
        r.allocate("p", 0, 4)
        r.forward("p", torch.randn(1, 32, H, device=where), 0)
        x = torch.randn(1, 1, H, device=where)
        for k in range(3):
            x = r.forward("p", x, 32 + k)
        _sync(device)
        t0 = time.perf_counter()
        for k in range(steps):
            x = r.forward("p", x, 35 + k)
        _sync(device)
        out[f"ms_per_step_input_on_{where}"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
        r.release("p")
    r.allocate("p", 0, 4)
    r.forward("p", torch.randn(1, 32, H), 0)
    x = torch.randn(1, 1, H)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for k in range(steps):
            x = r.forward("p", x, 32 + k)
    r.release("p")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
    print(f"  decode step, one session, 4 blocks: {out}", flush=True)
    return out


def head_and_sampling(device: torch.device, batches: list[int], steps: int, hidden: int = 4096,
                      vocab: int = 128256) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_sampling import CONTEXT, MIX, make_logits

    from petals_chain.orchestrator.sampling import PerRequestSampler, SamplingParams, SequenceSampler, sample_batch

    lm_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16, device=device)
    out = {}
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        h = torch.randn(batch, hidden, generator=gen).to(device, torch.bfloat16)
        pool = [make_logits(batch, vocab, gen).to(device) for _ in range(steps)]
        params = [SamplingParams(**MIX[i % len(MIX)][1], seed=i) for i in range(batch)]
        prompts = [torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist() for _ in range(batch)]

        def head() -> float:
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in pool:
                    lm_head(h)  # the orchestrator's LM head matmul for the batch's last hidden states
            _sync(device)
            return (time.perf_counter() - t0) / steps * 1e3

        def batched() -> float:
            seqs = [SequenceSampler(p, c) for p, c in zip(params, prompts)]
            _sync(device)
            t0 = time.perf_counter()
            for x in pool:
                for s, c in zip(seqs, sample_batch(x, seqs)):
                    s.append(c.token)
            _sync(device)
            return (time.perf_counter() - t0) / steps * 1e3

        pool_cpu = [x.cpu() for x in pool]  # the per-request reference sampler runs on the CPU

        def loop() -> float:
            samplers = [PerRequestSampler(p) for p in params]
            ctxs = [list(c) for c in prompts]
            t0 = time.perf_counter()
            for x in pool_cpu:
                for i, s in enumerate(samplers):
                    ctxs[i].append(s.next_token(x[i], ctxs[i]))
            return (time.perf_counter() - t0) / steps * 1e3

        head(), batched(), loop()
        th = statistics.median([head() for _ in range(3)])
        tb = statistics.median([batched() for _ in range(3)])
        tl = statistics.median([loop() for _ in range(3)])
        out[batch] = {"lm_head_ms": round(th, 3), "batched_sampling_ms": round(tb, 3),
                      "head_plus_sampling_ms": round(th + tb, 3), "cpu_loop_sampling_ms": round(tl, 3),
                      "batched_over_cpu_loop": round(tb / tl, 3)}
        print(f"  batch {batch:>3}: LM head {th:7.3f} ms + batched sampling {tb:7.3f} ms per step; per-request loop on "
              f"the CPU {tl:7.3f} ms ({tb / tl:.3f}x)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=positive_int, default=8,
                    help="blocks of the 7B-shaped model for the exactness check")
    ap.add_argument("--quick", action="store_true", help="small shapes (to try the script on a CPU)")
    ap.add_argument("--json", type=output_file, default=None)
    ap.add_argument("--only-head", action="store_true", help="only the head and sampling section")
    ap.add_argument("--profile", action="store_true", help="only a profile of one session's decode steps")
    ap.add_argument("--decode-graph", action="store_true", help="only the decode-graph section")
    args = ap.parse_args()
    device = torch.device(args.device)
    from petals_chain.swarm.tiny_model import build_tiny_model

    res: dict = {"torch": torch.__version__}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    import transformers

    res["transformers"] = transformers.__version__
    print(json.dumps(res), flush=True)
    big = dict(LLAMA2_7B_SHAPE) if not args.quick else dict(hidden_size=128, num_attention_heads=4,
                                                             intermediate_size=256, vocab_size=512,
                                                             initializer_range=0.02)

    def section(name, fn, *a):
        t0 = time.perf_counter()
        try:
            res[name] = fn(*a)
        except Exception as e:  # noqa: BLE001 - recorded, the next section still runs
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        res[name + "_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps({k: v for k, v in res[name].items() if k not in ("ours", "ref", "trace")}
                               if isinstance(res[name], dict) else res[name]), flush=True)
        if isinstance(res[name], dict) and "trace" in res[name]:
            print(res[name]["trace"], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))

    if args.decode_graph:
        with tempfile.TemporaryDirectory() as d:
            small = build_tiny_model(Path(d) / "smollm2", family="llama", num_layers=10, **SMOLLM2_SHAPE)
            section("decode_graph_smollm2_fp32", decode_graph, str(small), device, torch.float32, 10)
            seven = build_tiny_model(Path(d) / "seven", family="llama", num_layers=4, **big)
            section("decode_graph_7b_bf16", decode_graph, str(seven), device, torch.bfloat16, 4)
        return 0
    if args.profile:
        with tempfile.TemporaryDirectory() as d:
            seven = build_tiny_model(Path(d) / "seven", family="llama", num_layers=4, **big)
            section("profile_decode", profile_decode, str(seven), device, torch.bfloat16)
        return 0
    if not args.only_head:
        with tempfile.TemporaryDirectory() as d:
            tiny = build_tiny_model(Path(d) / "tiny", family="llama", num_layers=8)
            section("exact_tiny_fp32", exact, str(tiny), device, torch.float32, 8)
            seven = build_tiny_model(Path(d) / "seven", family="llama", num_layers=args.layers, **big)
            section("exact_7b_bf16", exact, str(seven), device, torch.bfloat16, args.layers)
            section("batching_7b_bf16", batching, str(seven), device, torch.bfloat16, [1, 8, 32] if not args.quick
                    else [1, 4], 24 if not args.quick else 4)
    if args.quick:
        section("head_sampling", head_and_sampling, device, [1, 4], 2, 128, 4096)
    else:
        section("head_sampling", head_and_sampling, device, [1, 8, 32], 8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
