"""Head cost of structured outputs: tokens/s of the same requests with and without a JSON schema, side by side.

The orchestrator runs in this process with the model's real LM head, sampler and tokenizer over chains whose hops
return their input (no server, no network): what is measured is the orchestrator's own per-token work (LM head,
sampling, the grammar's mask and its state), the part structured outputs add to. Each round sends ``--concurrency``
chat requests at once (one batch of the head per step), ``--max-tokens`` each, greedy, with a schema whose one string
field is long enough that no output ends before ``max_tokens``, and the same requests without a schema
(``ignore_eos``: the same number of tokens).

    python scripts/bench_structured.py --model smollm2-135m --concurrency 1 4 --max-tokens 64

``--draft-layers N``: instead, draft-model speculative decoding under a schema (``--speculative draft:self`` with the
model's first N layers as the draft), drafts taken under the grammar's mask (``DraftModel.constrained``) or not, side
by side: accepted drafts, tokens/s, and whether both gave the same tokens (greedy: they must). Its chain computes the
model's blocks in this process (one hop, no server).

    python scripts/bench_structured.py --model smollm2-135m --draft-layers 8 --max-tokens 64 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"],
          "additionalProperties": False}


class _EchoChainSession:
    """A chain session whose hops return their input (the blocks' work is not what is measured)."""

    def __init__(self, client, hops, session_id, max_length, observe=None, wait_s=0.0, push=False):
        self.hops = list(hops)
        self.peers_used = {h[0] for h in self.hops}
        self.max_length = max_length
        self.cached_tokens, self.prefix_cache, self.push, self.wait_s = 0, False, False, wait_s
        self.silent_wait_max_s = float("inf")
        self.push_rescues = self.push_mismatches = 0

    async def open(self, fork_from=None, fork_length=0, named=b""):
        pass

    async def step(self, i, x, position):
        return x.clone()

    async def extend(self, max_length):
        self.max_length = max(self.max_length, max_length)

    async def close(self, named=b""):
        pass


async def _round(c: httpx.AsyncClient, model: str, concurrency: int, max_tokens: int, structured: bool) -> float:
    """Generated tokens per second of ``concurrency`` requests sent at once."""
    body = {"model": model, "messages": [{"role": "user", "content": "Write a story."}], "max_tokens": max_tokens,
            "temperature": 0}
    body.update({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
                if structured else {"ignore_eos": True})
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    for r in replies:
        r.raise_for_status()
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in replies)
    return tokens / wall


async def main_async(args: argparse.Namespace) -> list[dict]:
    from petals_chain.model import Chain
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    failover.ChainSession = _EchoChainSession
    orch = Orchestrator(OrchestratorConfig(model=args.model, max_length=args.max_tokens + 64, port=0))
    orch.load_model()
    orch.batcher = HeadBatcher(orch.head)
    n = orch.config.num_hidden_layers
    orch.dispatch.set_chains([Chain(servers=("a",), blocks=(n,), service_time=0.1, capacity=max(args.concurrency),
                                    spans=((0, n),))])
    rows = []
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://o",
                                     timeout=600) as c:
            await _round(c, orch.model_id, 1, 4, True)  # warm-up: the tokenizer's grammar build (once per model)
            await _round(c, orch.model_id, 1, 4, False)
            for conc in args.concurrency:
                plain, constrained = [], []
                for _ in range(args.repeat):  # interleaved: a machine's load drifts over both alike
                    plain.append(await _round(c, orch.model_id, conc, args.max_tokens, False))
                    constrained.append(await _round(c, orch.model_id, conc, args.max_tokens, True))
                best_plain, best_constrained = max(plain), max(constrained)
                rows.append({"concurrency": conc, "max_tokens": args.max_tokens,
                             "tokens_per_s_plain": round(best_plain, 1),
                             "tokens_per_s_schema": round(best_constrained, 1),
                             "schema_cost_ms_per_token": round(1000 / best_constrained - 1000 / best_plain, 3)})
    finally:
        orch.batcher.close()
    return rows


PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}}, "bio": {"type": "string"}},
    "required": ["name", "age", "city", "hobbies", "bio"], "additionalProperties": False}
PERSON_PROMPTS = ["Describe a fictional person as JSON.", "Invent a character for a novel, as JSON.",
                  "Give me a JSON profile of a made-up chef."]


class _ComputingChainSession(_EchoChainSession):
    """One hop that runs all of the model's decoder layers (:data:`BLOCKS`, no final norm) in this process, with a KV
    cache rolled back to each step's position (rejected drafts' rows are overwritten, as a server's are)."""

    BLOCKS = None  # the model's decoder stack (a transformers base model whose final norm is an identity)

    def __init__(self, *a, **kw):
        from transformers import DynamicCache

        super().__init__(*a, **kw)
        self.cache = DynamicCache()

    async def step(self, i, x, position):
        import torch

        held = self.cache.get_seq_length()
        if held > position:
            self.cache.crop(position - held)  # a negative count: tokens removed from the end
        with torch.inference_mode():
            ids = torch.arange(position, position + x.shape[1]).unsqueeze(0)
            out = self.BLOCKS(inputs_embeds=x.to(torch.float32), past_key_values=self.cache, position_ids=ids,
                              use_cache=True).last_hidden_state
        return out.to(x.dtype)


async def drafts_async(args: argparse.Namespace) -> list[dict]:
    """Draft-model speculation under a schema, drafts under the grammar's mask or not (see the module docstring)."""
    import torch

    from petals_chain.model import Chain
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher
    from petals_chain.swarm.checkpoint import load_causal_lm

    full = load_causal_lm(args.model, dtype=torch.float32)
    full.model.norm = torch.nn.Identity()  # the orchestrator's head applies the final norm
    _ComputingChainSession.BLOCKS = full.model
    failover.ChainSession = _ComputingChainSession
    orch = Orchestrator(OrchestratorConfig(model=args.model, max_length=args.max_tokens + 256, port=0,
                                           speculative="draft", draft_model="self", draft_layers=args.draft_layers))
    orch.load_model()
    orch.batcher = HeadBatcher(orch.head)
    n = orch.config.num_hidden_layers
    orch.dispatch.set_chains([Chain(servers=("a",), blocks=(n,), service_time=0.1, capacity=1, spans=((0, n),))])
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    totals = {mode: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0} for mode in (False, True)}
    same = True
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://o",
                                     timeout=600) as c:
            for _ in range(args.repeat):
                for prompt in PERSON_PROMPTS:
                    got = {}
                    for mode in (False, True):  # interleaved: a machine's load drifts over both alike
                        orch.drafter.constrained = mode
                        d0, a0 = orch.stats.spec_drafted, orch.stats.spec_accepted
                        t0 = time.perf_counter()
                        r = await c.post("/v1/chat/completions", json={
                            "model": orch.model_id, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": args.max_tokens, "temperature": 0, "response_format": fmt})
                        wall = time.perf_counter() - t0
                        r.raise_for_status()
                        got[mode] = r.json()["petals_chain"][0]["token_ids"]
                        t = totals[mode]
                        t["tokens"] += len(got[mode])
                        t["seconds"] += wall
                        t["drafted"] += orch.stats.spec_drafted - d0
                        t["accepted"] += orch.stats.spec_accepted - a0
                    same = same and got[False] == got[True]
    finally:
        orch.batcher.close()
    return [{"drafts": "under the grammar" if mode else "unconstrained", "tokens": t["tokens"],
             "seconds": round(t["seconds"], 1), "tokens_per_s": round(t["tokens"] / t["seconds"], 3),
             "drafted": t["drafted"],
             "accepted": t["accepted"], "accepted_per_draft_token": round(t["accepted"] / max(1, t["drafted"]), 3),
             "same_tokens": same} for mode, t in totals.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registry name or path (default smollm2-135m)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="requests at once (default 1 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="rounds per setting; the best is reported (default 3)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="measure draft-model drafts under the grammar vs unconstrained instead (draft: these layers)")
    args = ap.parse_args()
    if args.draft_layers is not None:
        rows = asyncio.run(drafts_async(args))
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            f"{r['drafts']:>18}: {r['tokens']} tokens in {r['seconds']} s ({r['tokens_per_s']} tok/s), "
            f"{r['accepted']}/{r['drafted']} "
            f"drafts accepted ({r['accepted_per_draft_token']}), same tokens: {r['same_tokens']}" for r in rows))
        return
    rows = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'concurrency':>11} {'max_tokens':>10} {'tok/s plain':>12} {'tok/s schema':>13} {'ms/token added':>15}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['max_tokens']:>10} {r['tokens_per_s_plain']:>12} "
              f"{r['tokens_per_s_schema']:>13} {r['schema_cost_ms_per_token']:>15}")


if __name__ == "__main__":
    main()
