"""Audits (``orchestrator/audit.py``) the hunt broke: an honest hop judged on a history rebuilt through servers of
another dtype than the ones its KV came from."""

from __future__ import annotations

import asyncio
import types

import torch

from petals_chain.orchestrator.audit import Auditor

H = 8


class _Session:
    """A fake span: blocks [0, 2) add 2 (the bf16 server rounds its answer up by 3 %); blocks [2, 4) add 2 and the
    mean of the inputs before each position (its output depends on its history, as attention's does); the liar
    adds 2 more."""

    def __init__(self, peer: str, start: int):
        self.peer, self.start = peer, start

    async def step(self, x: torch.Tensor, position: int) -> torch.Tensor:
        if self.start == 0:
            return (x + 2.0) * (1.03 if self.peer == "up16" else 1.0)
        past = torch.cumsum(x, dim=1) - x
        count = torch.arange(x.shape[1], dtype=x.dtype).reshape(1, -1, 1).clamp_min(1)
        return x + 2.0 + past / count + (2.0 if self.peer == "liar" else 0.0)

    async def close(self) -> None:
        pass


class _Client:
    async def open_session(self, peer, *, start_block, end_block, **kw):
        return _Session(peer, start_block)


def _orch(views: list) -> types.SimpleNamespace:
    async def embed(tokens):
        return torch.tensor(tokens, dtype=torch.float32).reshape(1, -1, 1).expand(1, len(tokens), H).clone()

    planner = types.SimpleNamespace(online_views=lambda: views, servers={v.peer_id: v for v in views})
    return types.SimpleNamespace(planner=planner, client=_Client(), vocab_size=100,
                                 batcher=types.SimpleNamespace(embed=embed),
                                 cfg=types.SimpleNamespace(step_timeout_s=5.0, max_length=512),
                                 replacement_servers=lambda s, e: [v.peer_id for v in views
                                                                   if v.record.start_block == s and v.peer_id
                                                                   not in ("liar", "h1")])


def _view(peer: str, start: int, end: int, dtype: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(peer_id=peer, record=types.SimpleNamespace(
        start_block=start, num_blocks=end - start, slots_free=2, public_name=peer, dtype=dtype))


def test_an_honest_hop_is_not_struck_for_a_history_rebuilt_through_a_bf16_server():
    """Hop [2, 4) on an fp32 server took its history from an fp32 server before it (the prefix came from its cache:
    the inputs were never relayed). The audit rebuilds that history through the only server now holding [0, 2), a
    bf16 one whose rounding moves the hop's honest output by 1.3 %: past the fp32 tolerance (1 %), so the referee
    sided with the auditor and the honest hop got a strike (three ban it; on SmolLM2, bf16 upstream rounding moved
    an fp32 hop's output by up to 1.1e-2). The tolerance now covers the servers before the span; a liar is still
    struck."""
    views = [_view("up16", 0, 2, "bfloat16"), *(_view(p, 2, 4, "float32") for p in ("h1", "h2", "h3", "liar"))]
    orch = _orch(views)
    tokens = [5] * 7
    position = 6
    no_inputs = types.SimpleNamespace(get=lambda boundary, length: None)  # a prefix reused from caches

    async def audit(peer: str) -> Auditor:
        auditor = Auditor(orch, rate=1.0, seed=0)
        x_all = await orch.batcher.embed(tokens) + 2.0  # what an fp32 server before the span gave, all along
        out = (await _Session(peer, 2).step(x_all, 0))[:, position:]
        auditor.schedule((peer, 2, 4), x_all[:, position:], position, out, tokens, no_inputs)
        await asyncio.gather(*auditor._tasks)
        return auditor

    honest = asyncio.run(audit("h1"))
    assert honest.counts["rebuilt_history"] == 1 and honest.counts["audits"] == 1
    assert 1e-2 < honest.errors[0] < 6e-2, honest.errors
    assert honest.counts["strikes"] == 0 and honest.counts["agreed"] == 1, honest.counts
    liar = asyncio.run(audit("liar"))
    assert liar.counts["strikes"] == 1 and liar.book.score("liar", 0) > 0, liar.counts


def test_probes_fit_the_swarm_max_length():
    """Probe sequences were 8..64 tokens whatever ``--max-length``: with 32, servers refused the longer probes'
    sessions (beyond their max_length) and those probes were wasted. They now fit in max_length."""
    opened = []

    class Client:
        async def open_session(self, peer, *, start_block, end_block, max_length, **kw):
            opened.append(max_length)
            if max_length > 32:
                raise ValueError(f"max_tokens must be an int in [1, 32], got {max_length}")
            return _Session(peer, start_block)

    views = [_view("up1", 0, 2, "float32"), _view("up2", 0, 2, "float32")]
    orch = _orch(views)
    orch.client, orch.cfg.max_length = Client(), 32
    auditor = Auditor(orch, rate=0.0, probe_s=1.0, seed=1)
    for _ in range(20):
        asyncio.run(auditor._probe("up1", 0, 2))
    assert opened and max(opened) <= 32, opened
    assert auditor.counts["skipped_auditor_failed"] == 0 and auditor.counts["audits"] == 20, auditor.counts


def test_a_replacement_hops_answer_is_sampled_for_audit_in_relay_mode():
    """Relay mode: a hop that failed over to another server went on to the next hop without its replacement's answer
    being sampled (push mode audits recovered hops), so a liar lying only on failover replays was never caught.
    Two hops, the second dies and moves to b2, audit rate 1: both answers are audited."""
    import asyncio
    import types

    import torch

    from petals_chain.orchestrator.failover import ChainHolder
    from petals_chain.orchestrator.relay import ChainSession

    class Sess:
        def __init__(self, peer, fail=False):
            self.peer, self.fail, self.session_id, self.last_compute_s = peer, fail, "s", None

        async def step(self, x, position, **kw):
            if self.fail:
                raise ConnectionError("dead")
            return x + 1.0

        async def close(self, **kw):
            pass

    class Client:
        async def open_session(self, peer, **kw):
            return Sess(peer)

    scheduled = []
    auditor = types.SimpleNamespace(sample=lambda: True, distrusted=lambda p: False,
                                    schedule=lambda hop, x, pos, out, toks, inputs: scheduled.append(hop[0]))
    stats = types.SimpleNamespace(add_relay_step=lambda n: None, add_failover=lambda: None,
                                  add_replay=lambda *a, **k: None)
    h = ChainHolder.__new__(ChainHolder)
    h.orch = types.SimpleNamespace(auditor=auditor, stats=stats, server_failed=lambda e: None,
                                   replacement_servers=lambda s, e: ["b2"], batcher=None)
    h.job_id, h.failovers, h.lease = "job", 0, None
    h.inputs = types.SimpleNamespace(truncate=lambda n: None, append=lambda *a: None, get=lambda b, n: None)
    cs = ChainSession(Client(), [("a1", 0, 2), ("b1", 2, 4)], "job.1", 64)
    cs._sessions = [Sess("a1"), Sess("b1", fail=True)]
    h.cs = cs
    out = asyncio.run(h._forward(torch.zeros(1, 1, 4), 0, [3], [5]))
    assert [hop[0] for hop in cs.hops] == ["a1", "b2"] and scheduled == ["a1", "b2"]
    assert torch.equal(out, torch.full((1, 1, 4), 2.0))
