"""Orchestrator parts without processes: dispatch manager, sampling and stop strings, planner decisions."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from petals_chain.model import Chain, ModelSpec
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager
from petals_chain.orchestrator.sampling import Sampler, SamplingParams, StopMatcher


def chain(servers, T, cap, L=4):
    n = len(servers)
    cuts = [round(i * L / n) for i in range(n + 1)]
    spans = tuple((cuts[i], cuts[i + 1]) for i in range(n))
    return Chain(servers=tuple(servers), blocks=tuple(b - a for a, b in spans), service_time=T, capacity=cap,
                 spans=spans)


@pytest.mark.parametrize("policy", ["jffc", "jsq", "sed", "sa-jsq", "jiq"])
def test_dispatch_never_exceeds_capacity_and_serves_everyone(policy):
    async def main():
        dm = DispatchManager(policy=policy)
        dm.set_chains([chain(["a"], 1.0, 2), chain(["b", "c"], 2.0, 1)])
        active = {0: 0, 1: 0}
        peak = {0: 0, 1: 0}
        order = []

        async def job(i):
            lease = await dm.acquire(DispatchJob(job_id=str(i)))
            active[lease.index] += 1
            peak[lease.index] = max(peak[lease.index], active[lease.index])
            assert active[lease.index] <= lease.chain.capacity
            order.append(i)
            await asyncio.sleep(0.01)
            active[lease.index] -= 1
            dm.release(lease)

        await asyncio.gather(*(job(i) for i in range(20)))
        assert sorted(order) == list(range(20))
        assert dm.running == 0 and dm.queue_length == 0
        assert peak[0] <= 2 and peak[1] <= 1
        return order

    order = asyncio.run(main())
    if True:
        assert len(order) == 20


@pytest.mark.parametrize("policy", ["jffc", "jsq", "sed", "sa-jsq", "jiq"])
def test_a_requeued_job_starts_at_once_where_a_chain_has_room(policy):
    """A job back from a failover or a pause (re-queued, never refused) starts on any chain with room. (SED scored
    the full fast chain below the free slow one and the job waited in the lane beside the free slot.)"""
    async def main():
        dm = DispatchManager(policy=policy)
        dm.set_chains([chain(["fast"], 1.0, 4), chain(["slow"], 3.0, 1)])
        held = [await dm.acquire(DispatchJob(str(i))) for i in range(4)]
        assert {lease.chain.servers for lease in held} <= {("fast",), ("slow",)}
        free = [k for k in (0, 1) if dm.active(k) < (4, 1)[k]]
        assert len(free) == 1  # one slot left, on one chain or the other
        lease = await asyncio.wait_for(dm.acquire(DispatchJob("back", requeue=True)), 1.0)
        assert lease.index == free[0] and dm.requeued == 0
        for one in held + [lease]:
            dm.release(one)
        assert dm.running == 0

    asyncio.run(main())


def test_jffc_fastest_first_fifo_and_cancel():
    async def main():
        dm = DispatchManager(policy="jffc")
        dm.set_chains([chain(["slow"], 5.0, 1), chain(["fast"], 1.0, 1)])
        j1 = DispatchJob("1")
        l1 = await dm.acquire(j1)
        assert l1.chain.servers == ("fast",)  # the fastest free chain
        l2 = await dm.acquire(DispatchJob("2"))
        assert l2.chain.servers == ("slow",)
        waiting = [asyncio.create_task(dm.acquire(DispatchJob(str(i)))) for i in (3, 4, 5)]
        await asyncio.sleep(0)
        assert dm.queue_length == 3
        waiting[1].cancel()  # a client gives up while queued: removed, nothing leaks
        await asyncio.sleep(0)
        assert dm.queue_length == 2
        dm.release(l1)
        l3 = await waiting[0]
        assert l3.job.job_id == "3" and l3.chain.servers == ("fast",)  # FIFO head takes the freed chain
        assert l3.job.wait_s > 0
        dm.release(l2)
        l5 = await waiting[2]
        assert l5.job.job_id == "5"
        dm.release(l3)
        dm.release(l5)
        assert dm.running == 0 and dm.queue_length == 0

    asyncio.run(main())


def test_set_chains_carries_running_jobs_and_queue():
    async def main():
        dm = DispatchManager(policy="jffc")
        a = chain(["a"], 1.0, 1)
        dm.set_chains([a])
        l1 = await dm.acquire(DispatchJob("1"))
        q = asyncio.create_task(dm.acquire(DispatchJob("2")))
        await asyncio.sleep(0)
        assert dm.queue_length == 1
        # re-plan: chain a unchanged (its running job is adopted), b new -> the queued job starts on b
        dm.set_chains([a, chain(["b"], 2.0, 1)])
        l2 = await asyncio.wait_for(q, 1)
        assert l2.chain.servers == ("b",)
        assert dm.active(0) == 1 and l1.generation == dm.generation
        # a third job must queue: a is still occupied by the adopted job
        q3 = asyncio.create_task(dm.acquire(DispatchJob("3")))
        await asyncio.sleep(0)
        assert dm.queue_length == 1
        dm.release(l1)
        l3 = await asyncio.wait_for(q3, 1)
        assert l3.chain.servers == ("a",)
        # no chains at all: jobs wait (not fail) until chains come back
        dm.release(l2)
        dm.release(l3)
        dm.set_chains([])
        q4 = asyncio.create_task(dm.acquire(DispatchJob("4")))
        await asyncio.sleep(0.01)
        assert not q4.done() and dm.queue_length == 1
        dm.set_chains([a])
        l4 = await asyncio.wait_for(q4, 1)
        dm.release(l4)

    asyncio.run(main())


def test_jffc_decision_time_at_10k_chains(slowdown):
    from petals_chain.algorithms import JFFCDispatcher

    chains = [(1.0 + (k % 97) / 10, 1 + k % 3) for k in range(10_000)]
    d = JFFCDispatcher(chains)
    n = 20_000
    t0 = time.perf_counter()
    started = []
    for i in range(n):
        k = d.arrive(i)
        if k is not None:
            started.append(k)
    for k in started[: n // 2]:
        d.complete(k)
    per_op = (time.perf_counter() - t0) / (n + n // 2)
    assert per_op < 1e-3 * slowdown  # O(log K): microseconds, far below a token's time


class _Tok:
    """Character-level stand-in for a tokenizer (ids are code points)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_matcher_holds_back_partial_stop_strings():
    m = StopMatcher(_Tok(), ["END"])
    out = "".join(m.feed(ord(c)) for c in "hello E")
    assert out == "hello "  # "E" could start "END": held back
    out += "".join(m.feed(ord(c)) for c in "xEN")
    assert out == "hello ExEN"[: len(out)] and not m.stopped
    out += m.feed(ord("D"))
    assert m.stopped and out == "hello Ex"
    assert m.text == "hello Ex"
    m2 = StopMatcher(_Tok(), [])
    assert "".join(m2.feed(ord(c)) for c in "abc") + m2.flush() == "abc"


def test_stop_matcher_cuts_at_the_earliest_stop_whatever_their_order():
    """One token holding two stop strings (a merged ".\n"): the text ends before the first in the text, not before
    the first listed (which left "." in the answer with stop=["\n", "."])."""
    class Merged:
        vocab = {0: "Hi", 1: ".\n", 2: " there"}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.vocab[i] for i in ids)

    for stop in (["\n", "."], [".", "\n"]):
        m = StopMatcher(Merged(), stop)
        streamed = "".join(m.feed(t) for t in (0, 1, 2)) + m.flush()
        assert m.text == streamed == "Hi", stop


def test_sampler_greedy_seeded_and_processors():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert Sampler(SamplingParams(temperature=0)).next_token(logits, [0]) == 1
    # repetition penalty pushes an already-seen token down
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=10.0)).next_token(logits, [1]) == 2
    p = SamplingParams(temperature=1.0, top_k=2, seed=3)
    draws = [Sampler(p).next_token(logits, [0]) for _ in range(5)]
    assert len(set(draws)) == 1 and draws[0] in (1, 2)  # same seed, same token; top_k keeps only 1 and 2
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=None))
    assert all(s.next_token(logits, [0]) in (1, 2) for _ in range(50))
    s = Sampler(SamplingParams(temperature=0.7, top_p=0.01, seed=1))
    assert all(s.next_token(logits, [0]) == 1 for _ in range(20))


class _FakeRecord:
    def __init__(self, memory, tau_p, start=0, num=0, slots=0, state="joining", name="", max_blocks=0):
        self.memory_bytes, self.tau_p, self.start_block, self.num_blocks = memory, tau_p, start, num
        self.max_blocks, self.model_fingerprint = max_blocks, ""
        self.slots_total, self.slots_free, self.state, self.public_name = slots, slots, state, name
        self.emulate_rtt_ms, self.emulate_compute_scale, self.device, self.dtype = 0.0, 1.0, "cpu", "float32"
        self.kv_cache, self.page_size, self.cache_tokens_total = "slots", 0, 0  # capacities in slots (Eq. 3)
        self.timestamp = time.time()


def test_a_server_sized_for_shorter_jobs_is_left_out_of_the_chains(caplog):
    """A server started with ``--max-length 32`` in a swarm of 64 refuses a longer job's open: the job took the same
    chain again until its queue time ran out (ten minutes, nothing logged). It is left out of the chains, said once."""
    import logging

    from petals_chain.orchestrator.planner import Planner, ServerView

    pl = Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=1.0)
    for name, length in (("whole", 64), ("short", 32), ("long", 128)):
        rec = _FakeRecord(100.0, 0.01, start=0, num=4, slots=2, state="online", name=name)
        rec.max_length = length
        pl.servers[name] = ServerView(peer_id=name, record=rec)
        pl.assignment[name] = (0, 4)
    with caplog.at_level(logging.WARNING):
        assert sorted(v.peer_id for v in pl.online_views()) == ["long", "whole"]
        pl.online_views()
    said = [r for r in caplog.records if "below this swarm's max_length" in r.getMessage()]
    assert len(said) == 1 and "short" in said[0].getMessage()


def test_planner_incremental_join_and_margin():
    from petals_chain.orchestrator.planner import Planner, ServerView

    model = ModelSpec(num_blocks=8, block_size=10.0, cache_size=1.0)
    pl = Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=1.0,
                 model_spec_fallback=lambda: model)
    views = [ServerView(peer_id=n, record=_FakeRecord(m, tp, name=n)) for n, m, tp in
             [("a", 120.0, 0.01), ("b", 60.0, 0.02), ("c", 60.0, 0.02)]]
    for v in views:
        v.rtt_s = 0.001
    plan = pl.full_plan(views)
    assert plan is not None and plan.chains and plan.c >= 1
    cover = plan.placement.coverage(8)
    assert min(cover) >= 1
    # a fast newcomer alone gets the span that minimizes the lower bound; nobody else moves
    newcomer = ServerView(peer_id="d", record=_FakeRecord(120.0, 0.001, name="d"))
    newcomer.rtt_s = 0.001
    inc = pl.incremental(views + [newcomer], plan.placement, newcomer, plan.c)
    assert inc is not None
    for name in plan.placement:
        assert inc.placement[name] == plan.placement[name]
    assert "d" in inc.placement and inc.lower < plan.lower
    # the specs carry the paper's quantities: tau_c from RTT x steps per job, tau_p from the record
    spec = pl.specs([views[0]])[0]
    assert spec.tau_p == pytest.approx(0.01)
    assert spec.tau_c == pytest.approx((0.001 + pl.serialization_s) * pl.steps_per_job)
    pl.observe_job(33)
    assert pl.steps_per_job > 17


def test_planner_places_a_wave_of_newcomers_as_chains_of_their_own():
    """Three servers form the plan's one chain; three more like them join later. None of them alone completes a
    second chain (each incremental span predicts no gain), but placed together by GBP-CR they do, and nobody
    already planned moves."""
    from petals_chain.orchestrator.planner import Planner, ServerView

    model = ModelSpec(num_blocks=9, block_size=10.0, cache_size=1.0)
    pl = Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=3.0,
                 model_spec_fallback=lambda: model)

    def view(n):
        v = ServerView(peer_id=n, record=_FakeRecord(60.0, 0.05, name=n, max_blocks=3))
        v.rtt_s = 0.001
        return v

    first = [view(n) for n in "abc"]
    plan = pl.full_plan(first)
    assert plan is not None and len(plan.chains) == 1
    wave = [view(n) for n in "def"]
    views = first + wave
    for v in wave:
        inc = pl.incremental(views, plan.placement, v, plan.c)
        assert inc is not None and len(inc.chains) == 1 and not inc.lower < plan.lower * (1 - 1e-9)
    together = pl.joint(views, plan.placement, wave, plan.c)
    assert together is not None and len(together.chains) == 2 and together.lower < plan.lower
    for name in plan.placement:
        assert together.placement[name] == plan.placement[name]
    assert pl.joint(views, plan.placement, wave[:2], plan.c) is None  # two thirds of a chain: nothing to add


def test_planner_splits_hops_into_compute_and_communication():
    """With the server's reported compute time, tau_p and tau_c are refined from sessions, never from a ping
    RTT that (under load) can exceed a fast step and drive the compute estimate to zero."""
    from petals_chain.orchestrator.planner import Planner, ServerView

    pl = Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=1.0,
                 model_spec_fallback=lambda: ModelSpec(num_blocks=8, block_size=10.0, cache_size=1.0))
    v = ServerView(peer_id="a", record=_FakeRecord(120.0, 0.5, name="a"))
    v.rtt_s = 0.050  # a stale, inflated ping
    pl.servers["a"] = v
    for _ in range(30):
        pl.observe_hop("a", 1, 4, seconds=0.010, compute_s=0.004)  # 4 blocks: 1 ms/block, 6 ms on the wire
    assert v.step_s_per_block == pytest.approx(0.001, rel=0.05)
    assert v.comm_s_per_step == pytest.approx(0.006, rel=0.05)
    assert pl.tau_p(v) == pytest.approx(0.001 * pl.steps_per_job, rel=0.05)
    assert pl.tau_c(v) == pytest.approx(0.006 * pl.steps_per_job, rel=0.05)
    # prefill steps and inconsistent reports are ignored
    pl.observe_hop("a", 16, 4, seconds=5.0, compute_s=4.0)
    pl.observe_hop("a", 1, 4, seconds=0.010, compute_s=0.5)
    assert v.comm_s_per_step == pytest.approx(0.006, rel=0.05)
    assert v.step_s_per_block == pytest.approx(0.001, rel=0.05)


def test_planner_whole_model_placement_policy():
    from petals_chain.orchestrator.planner import Planner, ServerView

    model = ModelSpec(num_blocks=8, block_size=10.0, cache_size=1.0)
    pl = Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=1.0,
                 placement="whole-model", model_spec_fallback=lambda: model)
    views = [ServerView(peer_id=n, record=_FakeRecord(m, 0.01, name=n)) for n, m in [("a", 120.0), ("b", 60.0)]]
    plan = pl.full_plan(views)
    assert plan is not None and dict(plan.placement) == {"a": (0, 8)}  # b cannot hold the whole model
    assert [ch.servers for ch in plan.chains] == [("a",)] and plan.chains[0].capacity == (120 - 80) // 8


def test_head_batcher_batches_sessions_samples_and_embeds():
    """Rows ready together share one LM-head call; each gets its own sample and that token's embedding."""
    from petals_chain.orchestrator.relay import HeadBatcher
    from petals_chain.orchestrator.sampling import SamplingParams, SequenceSampler

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed_tokens = torch.nn.Embedding(50, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.lm_head = torch.nn.Linear(16, 50, bias=False)

        def embed(self, ids):
            return self.embed_tokens(torch.as_tensor(ids))

        def logits(self, h):
            return self.lm_head(self.norm(h)).float()

    head = Head()
    hb = HeadBatcher(head)
    xs = [torch.randn(16) for _ in range(12)]
    greedy = [SequenceSampler(SamplingParams(temperature=0.0, logprobs=2)) for _ in xs]

    async def main():
        return await asyncio.gather(*(hb.sample(x, s) for x, s in zip(xs, greedy)))

    outs = asyncio.run(main())
    with torch.no_grad():
        for x, (choice, emb) in zip(xs, outs):
            ref = head.logits(x.reshape(1, 1, -1))[0, -1]
            assert choice.token == int(ref.argmax())
            assert choice.logprob == pytest.approx(float(torch.log_softmax(ref, -1).max()), abs=1e-5)
            assert emb.shape == (1, 1, 16) and torch.equal(emb[0, 0], head.embed([choice.token])[0])
    assert hb.rows == 12 and hb.batches < 12  # requests ready together shared a matmul
    emb = asyncio.run(hb.embed([1, 2, 3]))
    assert emb.shape == (1, 3, 16)
    hb.close()


def test_planner_respects_max_blocks():
    """A volunteer's --max-blocks caps its span; the memory it leaves holds more cache slots."""
    from petals_chain.orchestrator.planner import Planner, ServerView

    model = ModelSpec(num_blocks=8, block_size=10.0, cache_size=1.0)
    pl = Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=1.0,
                 model_spec_fallback=lambda: model)
    views = [ServerView(peer_id=n, record=_FakeRecord(200.0, 0.01, name=n, max_blocks=cap)) for n, cap in
             [("a", 3), ("b", 3), ("c", 0)]]
    for v in views:
        v.rtt_s = 0.001
    plan = pl.full_plan(views)
    assert plan is not None and plan.chains
    assert all(plan.placement[n][1] <= 3 for n in ("a", "b") if n in plan.placement)
    uncapped = pl.full_plan([ServerView(peer_id=n, record=_FakeRecord(200.0, 0.01, name=n)) for n in "abc"])
    assert max(n for _, n in uncapped.placement.values()) > 3  # without the cap, a server takes more


def test_planner_spare_servers_use_or_idle():
    """At a light load the paper's GBP-CR needs one server; ``use_all_servers`` places the others too."""
    from petals_chain.orchestrator.planner import Planner, ServerView

    model = ModelSpec(num_blocks=8, block_size=10.0, cache_size=1.0)
    views = [ServerView(peer_id=n, record=_FakeRecord(120.0, tp, name=n)) for n, tp in
             [("a", 0.01), ("b", 0.02), ("c", 0.03)]]
    for v in views:
        v.rtt_s = 0.001
    plans = {}
    for use_all in (False, True):
        pl = Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=0.01,
                     use_all_servers=use_all, model_spec_fallback=lambda: model)
        plans[use_all] = pl.full_plan(views)
    idle, every = plans[False], plans[True]
    assert set(idle.placement) == {"a"}
    assert set(every.placement) == {"a", "b", "c"}
    assert sum(ch.capacity for ch in every.chains) > sum(ch.capacity for ch in idle.chains)
    assert every.lower <= idle.lower * (1 + 1e-9)
    assert every.chains[0].servers == ("a",)  # the fastest chain is still first for JFFC


def test_stop_matcher_incremental_decoding_equals_full_decode():
    """Streaming pieces concatenate to the full decode (multi-byte characters split over tokens included)."""
    import random

    from petals_chain.swarm.tiny_model import build_tokenizer

    tok = build_tokenizer()
    rng = random.Random(0)
    texts = ["héllo wörld, 日本語 テキスト ✓ and some ascii", "  leading spaces\nnew line\ttab  "]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        m = StopMatcher(tok, [])
        out = "".join(m.feed(i) for i in ids) + m.flush()
        assert out == tok.decode(ids, skip_special_tokens=True) == m.text
    for _ in range(20):  # random token soup, incomplete byte sequences included
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
        m = StopMatcher(tok, [])
        out = "".join(m.feed(i) for i in ids) + m.flush()
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_stop_matcher_decodes_after_the_prompt_as_the_whole_sequence_does():
    """With the prompt's last tokens as context, prompt + generated text equals decoding the whole sequence, also
    with a SentencePiece-style tokenizer ("▁" word starts: Llama-2, Mistral), whose first generated word lost its
    leading space when decoded alone; byte-level BPE (our test tokenizer) is unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from petals_chain.swarm.tiny_model import build_tokenizer

    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    spm.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    spm.train_from_iterator(["The capital of France is Paris. Paris is a city."] * 50,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    spm = PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    for tok in (spm, build_tokenizer()):
        prompt = tok("The capital of France is")["input_ids"]
        full = tok("The capital of France is Paris. Paris is")["input_ids"]
        assert full[:len(prompt)] == prompt
        gen = full[len(prompt):]
        m = StopMatcher(tok, [" is"], prompt)
        streamed = "".join(m.feed(t) for t in gen) + m.flush()
        whole = tok.decode(full, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
        assert streamed == m.text == whole[:whole.index(" is")] == " Paris. Paris", (streamed, whole)
        assert streamed.startswith(" Paris")


def test_planner_after_restart_keeps_the_spans_servers_serve():
    """A restarted orchestrator adopts the spans servers already hold (no reload) unless a new placement is
    clearly better, continues above their epoch, and a returning server keeps its span."""
    import asyncio

    from petals_chain.orchestrator.planner import Planner, ServerView

    class _DHT:
        peer_id = "orch"
        published: list = []

        def publish_assignment(self, prefix, rec, expiration):
            self.published.append(rec)

    model = ModelSpec(num_blocks=8, block_size=10.0, cache_size=1.0)
    # three equal servers, each serving 4 blocks as a previous orchestrator assigned (not what GBP-CR picks now)
    spans = {"a": (4, 4), "b": (0, 4), "c": (2, 4)}
    views = []
    for n, (st, num) in spans.items():
        rec = _FakeRecord(60.0, 0.01, start=st, num=num, slots=(60 - 40) // 4, state="online", name=n)
        rec.max_length, rec.epoch = 64, 7
        views.append(ServerView(peer_id=n, record=rec))
        views[-1].rtt_s = 0.001
    pl = Planner(dht=_DHT(), prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=0.5,
                 model_spec_fallback=lambda: model, settle_s=0.0)
    for v in views:
        pl.servers[v.peer_id] = v
    asyncio.run(pl._decide([], []))
    assert dict(pl.assignment) == spans and pl.epoch == 8
    assert pl.current is not None and pl.current.chains
    # a returning server that holds blocks keeps its span (incremental placement)
    rec = _FakeRecord(60.0, 0.01, start=3, num=4, slots=5, state="online", name="d")
    rec.max_length, rec.epoch = 64, 7
    d = ServerView(peer_id="d", record=rec)
    d.rtt_s = 0.001
    inc = pl.incremental(views + [d], pl.plan.placement, d, pl.plan.c)
    assert inc.placement["d"] == (3, 4)
    # spans sized for another max_length are not kept
    for v in views:
        v.record.max_length = 128
    assert pl.served_plan(views, 1) is None



def test_a_turn_finished_as_its_client_left_is_forgotten():
    """The session endpoint undoes a turn that completed while the client's disconnect was being noticed (the client
    never got it): exactly that one turn, never one that is running or a later one."""
    from petals_chain.orchestrator import sessions

    s = sessions.UserSession.__new__(sessions.UserSession)  # no chain needed for the bookkeeping
    s.history, s.messages, s.turns, s.lock = [1, 2, 3], [{"role": "user", "content": "hi"}], 1, asyncio.Lock()
    before = s.snapshot()
    assert not s.forget_turn(before)  # no turn completed since
    s.history, s.messages, s.turns = [1, 2, 3, 4, 5, 6], [*s.messages, {"role": "assistant", "content": "x"}], 2
    assert s.forget_turn(before)
    assert (s.history, s.messages, s.turns) == ([1, 2, 3], [{"role": "user", "content": "hi"}], 1)
    s.turns = 3  # two turns since: not ours to undo
    assert not s.forget_turn(before) and s.turns == 3

    async def running() -> bool:
        s.turns = 2
        async with s.lock:  # a turn in progress: nothing is undone under it
            return s.forget_turn(before)

    assert asyncio.run(running()) is False and s.turns == 2


def test_an_open_that_fails_as_its_server_is_declared_failed_leaves_no_unread_exception():
    """The server's stream ends (the open fails) in the same loop turn as the orchestrator declares it failed and
    cancels the open. Python 3.11's ``wait_for`` turned that cancellation into the read's ConnectionError inside a
    task its canceller no longer read: asyncio logged "Task exception was never retrieved" (the chaos run's
    orchestrator log). The open must fail as a HopFailure and leave nothing unread behind."""
    import gc

    from petals_chain.orchestrator.relay import ChainSession, HopFailure
    from petals_chain.swarm.rpc import _await_next

    async def main():
        loop = asyncio.get_running_loop()
        unread = []
        loop.set_exception_handler(lambda _loop, ctx: unread.append(ctx.get("message")))
        ended = loop.create_future()

        class Replies:
            def __anext__(self):
                return ended

        class Client:
            async def open_session(self, peer, **kw):
                return await _await_next(Replies(), 600.0, f"open on {peer}")

        cs = ChainSession(Client(), [("dead", 0, 4)], "job.1", 64, wait_s=600.0)
        opening = asyncio.ensure_future(cs.open())
        await asyncio.sleep(0.05)
        ended.set_exception(StopAsyncIteration())  # the server closed the stream ...
        assert cs.abort("dead")  # ... as it is declared failed
        with pytest.raises(HopFailure) as info:
            await opening
        assert info.value.peer_id == "dead" and isinstance(info.value.cause, ConnectionError)
        del opening, info
        for _ in range(3):
            await asyncio.sleep(0)
            gc.collect()
        assert unread == []

    asyncio.run(main())


@pytest.mark.parametrize("wait_s", [0.0, 600.0])
def test_a_chain_open_cancelled_midway_closes_the_hops_it_opened(wait_s):
    """The job is cancelled (its client left) while one hop's open is still under way: the hops already open are
    closed, and so is one whose open gets through after the cancellation. (Opened concurrently, the open hops were
    dropped unclosed: the servers held them until their idle timeout while their slot counted as free here.)"""
    from petals_chain.orchestrator.relay import ChainSession

    sessions = []

    class Session:
        def __init__(self, peer):
            self.peer, self.closed = peer, False
            sessions.append(self)

        async def close(self, **kw):
            self.closed = True

    class Client:
        async def open_session(self, peer, **kw):
            if peer == "slow":
                await asyncio.sleep(10)
            return Session(peer)

    async def main():
        cs = ChainSession(Client(), [("fast", 0, 2), ("slow", 2, 4)], "job.1", 64, wait_s=wait_s)
        opening = asyncio.ensure_future(cs.open())
        await asyncio.sleep(0.05)
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert [(x.peer, x.closed) for x in sessions] == [("fast", True)]

    asyncio.run(main())


def test_an_open_waiting_on_a_server_declared_failed_is_aborted_at_once(scaled):
    """An open queued at a server (``wait_s``: it may wait minutes for pages) is cancelled when the server is
    declared failed: a dead peer's stream may never end, and the job must fail over now, not at the open's timeout.
    The other hop's open, which succeeded, is closed."""
    from petals_chain.orchestrator.relay import ChainSession, HopFailure

    closed = []

    class Session:
        def __init__(self, peer):
            self.peer = peer

        async def close(self, **kw):
            closed.append(self.peer)

    class Client:
        async def open_session(self, peer, **kw):
            if peer == "dead":
                await asyncio.Event().wait()  # no reply, no end of stream
            return Session(peer)

    async def main():
        cs = ChainSession(Client(), [("alive", 0, 2), ("dead", 2, 4)], "job.1", 64, wait_s=600.0)
        opening = asyncio.ensure_future(cs.open())
        await asyncio.sleep(0.05)
        assert not opening.done()
        t0 = time.monotonic()
        assert cs.abort("dead")
        with pytest.raises(HopFailure) as info:
            await opening
        assert time.monotonic() - t0 < scaled(1.0) and info.value.peer_id == "dead" and info.value.hop == 1
        assert "declared failed" in str(info.value.cause) and closed == ["alive"]
        # a later open on the same chain session refuses the failed server at once
        with pytest.raises(HopFailure):
            await asyncio.wait_for(cs.open(), timeout=1.0)

    asyncio.run(main())


def test_per_request_records_stay_within_their_windows_whoever_reads_them(monkeypatch):
    """Arrival times (a fixed --arrival-rate never asks the rate), the model mix (placements that never ask for
    it) and a client's last-minute tokens (read only with a limit or a state request) were trimmed only when
    read: they grew by one entry per request."""
    import time as time_mod

    from petals_chain.algorithms.multimodel import MixDriftDetector
    from petals_chain.orchestrator.planner import RateEstimator
    from petals_chain.orchestrator.stats import Stats

    rates, mix = RateEstimator(window_s=300.0), MixDriftDetector(window_s=120.0)
    for i in range(5000):  # 5000 s of arrivals, one a second
        rates.arrive(1e6 + i)
        mix.arrive("a", 1e6 + i)
    assert len(rates.arrivals) <= 301 and len(mix._events) <= 121
    stats = Stats()
    now = [1e6]
    monkeypatch.setattr(time_mod, "monotonic", lambda: now[0])
    for _ in range(3000):  # an hour of requests, one every 1.2 s
        now[0] += 1.2
        stats.record(wait_s=0.0, service_s=0.1, tokens=5, prompt_tokens=3, ok=True)
    assert max(len(w) for w in stats._window.values()) <= 51
