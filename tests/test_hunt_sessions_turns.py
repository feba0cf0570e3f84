"""A session's turns through the real ``session_generate`` and decode loop, with a stub chain and head (the
sessions/multi-model hunt): what each turn adds to the orchestrator's relay statistics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from petals_chain.orchestrator.generation import GenerationMixin
from petals_chain.orchestrator.sampling import SamplingParams, TokenChoice
from petals_chain.orchestrator.sessions import SessionMixin, UserSession


class StubChain:
    hops = [("a", 0, 4)]
    prefix_cache = False  # held between turns: no dispatcher involved

    async def close(self, named=b""):
        pass


class StubBatcher:
    async def sample(self, hidden, seq):
        return TokenChoice(5), None


class Orch(SessionMixin, GenerationMixin):
    def __init__(self, tokenizer):
        self.sessions, self.planner, self.auditor, self.drafter = {}, None, None, None
        self.cfg = SimpleNamespace(output_reserve_tokens=0, hold_sessions=False, max_length=64, speculative=None,
                                   speculative_k=4)
        self.stats = SimpleNamespace(record=lambda **kw: None, relay_steps=0)
        self.deadlines = SimpleNamespace(settle=lambda *a, **kw: None)
        self.replay_cache = SimpleNamespace(new=lambda: SimpleNamespace(clear=lambda: None, close=lambda: None))
        self.prefix_directory = SimpleNamespace(add=lambda *a: None)
        self.dispatch = SimpleNamespace()
        self.chain_sessions = set()
        self.tokenizer, self._eos, self.batcher = tokenizer, set(), StubBatcher()

    def validate_prompt(self, *a, **kw):
        pass

    def check_speculative(self, *a, **kw):
        pass

    def _max_tokens(self, n, *a, **kw):
        return n


def test_each_turn_counts_its_own_relay_passes(tiny_model_dir):
    """``relay_steps`` (and ``tokens_per_relay_step`` from it) took the session's holder's step count at every turn's
    end, which counts every earlier turn too: three turns of three passes each counted 3 + 6 + 9 = 18 passes."""
    from transformers import AutoTokenizer

    async def main():
        orch = Orch(AutoTokenizer.from_pretrained(tiny_model_dir))
        s = UserSession(orch, 64)
        orch.sessions[s.id] = s
        holder = s.holder
        holder.cs = StubChain()

        async def feed(ids, hidden=None, **kw):  # one pass through the chain
            holder.kv_ids.extend(ids)
            holder.kv_valid = len(holder.kv_ids)
            holder.steps += 1
            holder.batch_steps += 1
            return "hidden"

        holder.feed = feed
        for turn in range(3):
            g = await orch.session_generate(s, s.history + [1, 2], SamplingParams(max_tokens=3))
            assert g.token_ids == [5, 5, 5]  # a prefill and two decode passes
            assert orch.stats.relay_steps == 3 * (turn + 1)

    asyncio.run(main())
