"""KV provenance after a ban (failover.py ``_untrusted``): the replay of a job whose chain reused KV named before a ban
is token-exact. The fake chain computes for real: every hop keeps its KV rows and answers, at each position, its input
plus the sum of every row it holds up to there (float64 on small integers: exact), so an output depends on the whole
history a hop holds. Servers share one prefix cache of KV rows per hop, which the test fills with rows a liar's replies
made (hop 1 off by 1000). Outputs after the ban must equal those of a job that never met the cache."""

from __future__ import annotations

import asyncio
import types

import torch

from petals_chain.orchestrator import failover
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.swarm.prefix import PREFIX_BLOCK_TOKENS, split_hashes
from test_s31_taint import make_orch

H = 2


async def embed(ids):
    return torch.tensor(ids, dtype=torch.float64).view(1, -1, 1).repeat(1, 1, H)


class ComputingChainSession:
    """Hops that keep KV rows; ``cache``: (hop, page name) -> that page's rows, shared by every chain."""

    cache: dict[tuple[int, bytes], torch.Tensor] = {}

    def __init__(self, client, hops, session_id, max_length, observe=None, wait_s=0.0, push=False):
        self.hops, self.max_length = list(hops), max_length
        self.peers_used = {h[0] for h in self.hops}
        self.prefix_cache, self.push, self.wait_s, self.silent_wait_max_s = True, False, wait_s, 0.0
        self.cached_tokens = 0
        self.kv: list[torch.Tensor] = [torch.zeros(0, H, dtype=torch.float64) for _ in self.hops]

    async def open(self, fork_from=None, fork_length=0, named=b""):
        assert fork_from is None
        pages = split_hashes(named)
        held = 0
        while held < len(pages) and all((i, pages[held]) in self.cache for i in range(len(self.hops))):
            held += 1
        for i in range(len(self.hops)):
            self.kv[i] = torch.cat([self.cache[(i, p)] for p in pages[:held]] or [self.kv[i]])
        self.cached_tokens = held * PREFIX_BLOCK_TOKENS

    async def step(self, i, x, position):
        assert position == len(self.kv[i]), "a hop was sent positions it does not follow"
        self.kv[i] = torch.cat([self.kv[i], x[0]])
        return x + torch.cumsum(self.kv[i], 0)[position:].unsqueeze(0)

    async def close(self, named=b""):
        for n, page in enumerate(split_hashes(named)):
            rows = slice(n * PREFIX_BLOCK_TOKENS, (n + 1) * PREFIX_BLOCK_TOKENS)
            for i in range(len(self.hops)):
                self.cache[(i, page)] = self.kv[i][rows].clone()


def run(monkeypatch, body):
    monkeypatch.setattr(failover, "ChainSession", ComputingChainSession)
    monkeypatch.setattr(ComputingChainSession, "cache", {})
    return asyncio.run(asyncio.wait_for(body(), 60))


def computing_orch():
    orch = make_orch()
    orch.batcher = types.SimpleNamespace(embed=embed)
    return orch


async def poison(prompt: list[int]) -> None:
    """A job through the liar cached the pages of ``prompt``'s first 32 tokens: hop 1's rows came from wrong replies."""
    orch = computing_orch()
    liar = ChainHolder(orch, "liar-job", 64)
    await liar.feed(prompt[:33])
    liar.cs.kv[1] += 1000.0
    await liar.close()


def test_a_replay_after_a_ban_gives_the_outputs_of_a_job_that_never_reused_the_cache(monkeypatch):
    prompt = list(range(1, 51))

    async def outputs(poisoned: bool, session: bool) -> list[torch.Tensor]:
        ComputingChainSession.cache.clear()
        if poisoned:
            await poison(prompt)
        orch = computing_orch()
        holder = ChainHolder(orch, "job", 64)
        got = [await holder.feed(prompt)]
        reused = holder.cached_tokens
        if session:  # a session's turns: the chain goes back between them (its servers keep the KV as cached)
            assert await holder.release_chain()
        if poisoned:
            orch.auditor.ban("L")  # audits caught the liar after the first turn
        got.append(await holder.feed(holder.sync(prompt + [7])))
        got.append(await holder.feed([8]))
        await holder.close()
        return got, reused

    for session in (False, True):
        clean, reused = run(monkeypatch, lambda: outputs(False, session))
        assert reused == 0
        dirty, reused = run(monkeypatch, lambda: outputs(True, session))
        assert reused == 32  # the first feed took the liar's pages: its output is off (nothing could know yet)
        assert not torch.equal(dirty[0], clean[0])
        assert torch.equal(dirty[1], clean[1]) and torch.equal(dirty[2], clean[2]), (session, dirty, clean)
