"""Verified chains (issue 21): audits re-run hop steps on other servers, strike and ban a server that lies.

Units: the verdict of a 2-1 split, decaying strikes, the error measure. End to end: three server processes hold
the whole tiny model (three one-hop chains); one adds noise to 30 % of its replies (``--emulate-faulty-rate``),
which passes every validity check. With ``--audit-rate 1`` the orchestrator catches and bans it, honest servers
get no strike, and answers after the ban equal transformers' greedy output.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from petals_chain.algorithms.audit import StrikeBook, verdict
from petals_chain.orchestrator.audit import relative_error
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for


def test_verdict_strikes_the_minority_only():
    assert verdict(True, None, None) == ()
    assert verdict(False, None, None) == ()  # no referee: nobody
    assert verdict(False, False, True) == ("primary",)
    assert verdict(False, True, False) == ("auditor",)
    assert verdict(False, False, False) == ()  # three answers: inconclusive


def test_strikes_decay_and_ban_once():
    book = StrikeBook(threshold=3.0, half_life_s=10.0)
    assert not book.strike("a", 0.0) and not book.strike("a", 0.0)
    assert book.score("a", 10.0) == pytest.approx(1.0)  # two strikes, one half-life later
    assert not book.strike("a", 10.0)  # 2.0 < 3
    assert book.strike("a", 10.0)  # 3.0: banned now
    assert not book.strike("a", 10.0)  # once
    assert book.snapshot("a", 10.0)["banned"] and book.snapshot("a", 10.0)["strikes"] == 5
    # rare accidents far apart never add up
    for t in range(0, 1000, 50):
        assert not book.strike("b", float(t))
    book.forget("a")
    assert "a" not in book.banned
    with pytest.raises(ValueError):
        StrikeBook(threshold=0)


def test_relative_error():
    a = torch.randn(1, 3, 8)
    assert relative_error(a, a) == 0.0
    b = a.clone()
    b[0, 1] *= 1.5
    assert relative_error(b, a) == pytest.approx(0.5, rel=1e-5)
    assert math.isinf(relative_error(a[..., :-1], a))


@pytest.mark.slow
def test_a_lying_server_is_banned_and_later_answers_are_exact(tiny_model_factory, tmp_path, scaled):
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("llama", num_layers=4)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11], [9, 8, 7, 6, 5], [100, 200, 300]]

    def greedy(prompt, n):
        with torch.no_grad():
            return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()

    mem = memory_for(model, 128, 4, 4)
    # the liar announces the best tau_p, so JFFC puts sequential requests on its chain
    servers = [LocalServer("liar", mem, tau_p=0.001, extra_args=["--emulate-faulty-rate", "0.3"]),
               LocalServer("honest1", mem, tau_p=0.002), LocalServer("honest2", mem, tau_p=0.002)]
    sw = LocalSwarm(model, servers, max_length=128, arrival_rate=1.0, log_dir=tmp_path,
                    orchestrator_args=["--audit-rate", "1", "--replan-interval-s", "3600"])
    sw.start(timeout=scaled(120))
    try:
        st = sw.wait_ready(timeout=scaled(150))
        by_name = {s["public_name"]: s for s in st["servers"]}
        assert by_name["liar"]["emulate_reply_fault"] == "noise"  # the emulation is visible in its record
        assert by_name["liar"]["emulate_reply_fault_rate"] == pytest.approx(0.3)
        client = sw.client(timeout=scaled(120))
        for i in range(40):
            client.complete(prompts[i % 3], max_tokens=12, ignore_eos=True)
            audit = sw.swarm()["audit"]
            if audit["bans"]:
                break
        st = sw.swarm()
        audit = st["audit"]
        trust = {s["public_name"]: s["trust"] for s in st["servers"]}
        print(audit, trust)
        assert audit["bans"] == 1 and audit["banned"] == ["liar"], audit
        assert trust["liar"]["banned"] and trust["liar"]["strikes"] >= 3
        assert trust["honest1"]["strikes"] == 0 and trust["honest2"]["strikes"] == 0
        assert trust["honest1"]["audits"] > 0 and audit["agreed"] > 0
        assert audit["max_agreeing_error"] < 1e-3  # honest fp32 servers agree far inside the tolerance
        names = {s["peer_id"]: s["public_name"] for s in st["servers"]}
        assert {s["public_name"]: s["distrusted"] for s in st["servers"]}["liar"] is True
        # the liar is out of every chain, and every answer from now on is exact
        def no_liar(v):
            return v["ready"] and all("liar" not in [names.get(p) for p in ch["servers"]] for ch in v["chains"])
        sw.wait_until(no_liar, scaled(30), "chains without the banned server")
        for prompt in prompts:
            comp = client.complete(prompt, max_tokens=20, ignore_eos=True)
            assert comp.token_ids == greedy(prompt, 20)
        metrics = httpx.get(f"{sw.url}/metrics", timeout=10).text
        assert 'petals_chain_audits_total{outcome="disagreed"}' in metrics
        assert "petals_chain_audit_banned_servers 1.0" in metrics
    finally:
        sw.stop()


@pytest.mark.slow
def test_probes_catch_a_liar_without_any_traffic(tiny_model_factory, tmp_path, scaled):
    """No requests and no sampled audits: the periodic probes alone find and ban the server that lies (a probe of
    a span after block 0 gets its input from servers holding the blocks before it)."""
    model = tiny_model_factory("llama", num_layers=4)
    half = memory_for(model, 128, 2, 4)
    # six servers of half the blocks each: three hold each half, so a disagreement always has a referee
    servers = [LocalServer(f"honest{i}", half, tau_p=0.002) for i in range(5)]
    servers.append(LocalServer("liar", half, tau_p=0.002, extra_args=["--emulate-faulty-rate", "1"]))
    sw = LocalSwarm(model, servers, max_length=128, arrival_rate=1.0, log_dir=tmp_path,
                    orchestrator_args=["--audit-rate", "0", "--audit-probe-s", "0.3", "--replan-interval-s", "3600"])
    sw.start(timeout=scaled(120))
    try:
        sw.wait_ready(timeout=scaled(150))
        st = sw.wait_until(lambda v: v["audit"]["bans"] >= 1, scaled(90), "the probes to ban the liar")
        audit = st["audit"]
        trust = {s["public_name"]: s["trust"] for s in st["servers"]}
        print(audit, trust)
        assert audit["banned"] == ["liar"] and audit["sampled"] == 0 and audit["probes"] >= 3
        assert all(t["strikes"] == 0 for name, t in trust.items() if name != "liar"), trust
    finally:
        sw.stop()


@pytest.mark.slow
def test_a_push_that_is_not_the_reply_is_caught_and_the_step_relayed_exactly(tiny_model_factory, tmp_path, scaled):
    """Push relay: a server replies right to the orchestrator and pushes a noised copy to the next hop. The next
    hop says what it took (a digest); it is not the reply, so that hop's step is redone on the reply, relayed
    through the orchestrator, and the job relays from then on: every answer is exact and no honest hop is audited
    (or struck) for an input the orchestrator never saw. (The answers were wrong, and at three holders per span the
    honest next hop was banned.)"""
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("llama", num_layers=4)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    half = memory_for(model, 128, 2, 4)
    # both servers push noise: whichever holds blocks [0, 2) is the first hop of the one chain
    lie = ["--emulate-reply-fault", "push", "--emulate-reply-fault-rate", "1"]
    servers = [LocalServer(f"s{i}", half, tau_p=0.002, extra_args=lie) for i in range(2)]
    sw = LocalSwarm(model, servers, max_length=128, arrival_rate=1.0, log_dir=tmp_path,
                    orchestrator_args=["--relay", "push", "--replan-interval-s", "3600"])
    sw.start(timeout=scaled(120))
    try:
        sw.wait_ready(timeout=scaled(150))
        client = sw.client(timeout=scaled(120))
        for prompt in ([5, 17, 42, 99, 7, 3, 250, 11], [9, 8, 7, 6, 5]):
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
            assert client.complete(prompt, max_tokens=8, ignore_eos=True).token_ids == want
        relay = sw.swarm()["relay"]
        assert relay["push_mismatches"] == 2 and relay["passes"]["push"] >= 2, relay  # one per job, then relayed
        assert "petals_chain_push_mismatches_total 2.0" in httpx.get(f"{sw.url}/metrics", timeout=10).text
    finally:
        sw.stop()


def test_tolerance_follows_the_dtype_servers_compute_in():
    """bf16 servers reply in fp32: the fp32 tolerance would strike honest bf16 rounding (found by the calibration
    run, which banned an honest server)."""
    import types

    from petals_chain.orchestrator.audit import Auditor

    def view(dtype):
        return types.SimpleNamespace(record=types.SimpleNamespace(dtype=dtype))

    planner = types.SimpleNamespace(servers={"a": view("bfloat16"), "b": view("float32"), "c": view("float32")})
    auditor = Auditor(types.SimpleNamespace(planner=planner), 0.0)
    assert auditor._tolerance(torch.float32, ["b", "c"]) == pytest.approx(1e-2)
    assert auditor._tolerance(torch.float32, ["a", "b"]) == pytest.approx(6e-2)
    assert auditor._tolerance(torch.bfloat16, ["b", "c"]) == pytest.approx(6e-2)
    assert Auditor(types.SimpleNamespace(planner=planner), 0.0, tolerance=0.3)._tolerance(torch.float32, ["a"]) == 0.3


def test_probes_look_like_jobs_and_reach_servers_announcing_no_free_slot():
    """A server that lies only where it is not checked must not tell a probe from a job: probe sessions are named
    as a job's hops are, opened for a length with an output reserve, with probe sequences of varied lengths; and a
    server announcing no free slot is probed all the same ("audit-" ids, exact 16-token lengths and slots_free 0
    let a liar pass every probe)."""
    import asyncio
    import re
    import types

    from petals_chain.orchestrator.audit import Auditor

    opened = []

    class Session:
        async def step(self, x, position):
            return x

        async def close(self):
            pass

    class FakeClient:
        async def open_session(self, peer, **kw):
            opened.append(kw)
            return Session()

    async def embed(tokens):
        return torch.zeros(1, len(tokens), 8)

    rec = types.SimpleNamespace(num_blocks=4, start_block=0, slots_free=0, public_name="full")
    views = [types.SimpleNamespace(peer_id="full", record=rec)]
    planner = types.SimpleNamespace(online_views=lambda: views, servers={})
    orch = types.SimpleNamespace(planner=planner, client=FakeClient(), vocab_size=100,
                                 batcher=types.SimpleNamespace(embed=embed),
                                 cfg=types.SimpleNamespace(step_timeout_s=5.0, max_length=512),
                                 dispatch=types.SimpleNamespace(queue_length=0))
    auditor = Auditor(orch, rate=0.0, probe_s=1.0, seed=3)
    assert auditor._next_probe_target() == ("full", 0, 4)
    for _ in range(12):
        asyncio.run(auditor._probe("full", 0, 4))
    assert len(opened) == 12
    assert all(re.fullmatch(r"r-[0-9a-f]{12}\.\d+", kw["session_id"]) for kw in opened), opened[0]
    assert len({kw["max_length"] for kw in opened}) > 3 and all(kw["max_length"] > 8 for kw in opened)


def test_a_later_hop_after_a_reused_prefix_is_audited_from_a_rebuilt_history():
    """A later hop's step whose earlier inputs were never relayed (a prefix reused from the servers' caches) was
    skipped (``skipped_no_history``): a liar serving the later hops of popular prompts was never audited. The history
    is now rebuilt from the tokens through the blocks before the span on other servers, and the step is judged:
    the liar is struck, an honest hop agrees."""
    import asyncio
    import types

    from petals_chain.orchestrator.audit import Auditor

    H = 8
    opened = []

    class Session:  # each block adds 1 to every number; the liar adds 0.5 more
        def __init__(self, peer, start, end):
            self.peer, self.add = peer, float(end - start) + (0.5 if peer == "liar" else 0.0)

        async def step(self, x, position):
            return x + self.add

        async def close(self):
            pass

    class FakeClient:
        async def open_session(self, peer, *, start_block, end_block, **kw):
            opened.append((peer, start_block, end_block))
            return Session(peer, start_block, end_block)

    async def embed(tokens):
        return torch.tensor(tokens, dtype=torch.float32).reshape(1, -1, 1).expand(1, len(tokens), H).clone()

    def view(peer, start, end):
        return types.SimpleNamespace(peer_id=peer, record=types.SimpleNamespace(
            start_block=start, num_blocks=end - start, slots_free=2, public_name=peer, dtype="float32"))

    views = [view("up1", 0, 2), view("up2", 0, 2), view("h1", 2, 4), view("h2", 2, 4), view("liar", 2, 4)]
    planner = types.SimpleNamespace(online_views=lambda: views, servers={})
    orch = types.SimpleNamespace(planner=planner, client=FakeClient(), vocab_size=100,
                                 batcher=types.SimpleNamespace(embed=embed),
                                 cfg=types.SimpleNamespace(step_timeout_s=5.0, max_length=512),
                                 replacement_servers=lambda s, e: [v.peer_id for v in views
                                                                   if v.record.start_block == s])
    no_inputs = types.SimpleNamespace(get=lambda boundary, length: None)  # the prefix was never relayed
    tokens = [3, 1, 4, 1, 5, 9, 2]
    position = 6  # the step feeds token 6 after a reused prefix of 6

    async def audit(peer, lie):
        auditor = Auditor(orch, rate=1.0, seed=0)
        x = (await embed(tokens))[:, position:] + 2.0  # the step's input at block 2
        out = x + 2.0 + lie
        auditor.schedule((peer, 2, 4), x, position, out, tokens, no_inputs)
        await asyncio.gather(*auditor._tasks)
        return auditor

    liar = asyncio.run(audit("liar", 0.5))
    assert liar.counts["rebuilt_history"] == 1 and liar.counts["skipped_no_history"] == 0
    assert liar.counts["disagreed"] == 1 and liar.counts["strikes"] == 1 and liar.book.score("liar", 0) > 0
    assert ("up1", 0, 2) in opened or ("up2", 0, 2) in opened  # the history came from the blocks before the span
    honest = asyncio.run(audit("h1", 0.0))
    assert honest.counts["agreed"] == 1 and honest.counts["strikes"] == 0


@pytest.mark.slow
def test_honest_later_hops_after_reused_prefixes_agree_with_rebuilt_histories(tiny_model_factory, tmp_path, scaled):
    """Real servers, a prompt sent again (its prefix reused from the servers' caches): the later hop's steps are
    audited from a history rebuilt on other servers, and honest servers agree with it (no strike)."""
    model = tiny_model_factory("llama", num_layers=4)
    half = memory_for(model, 128, 2, 4)
    servers = [LocalServer(f"honest{i}", half, tau_p=0.002) for i in range(4)]
    sw = LocalSwarm(model, servers, max_length=128, arrival_rate=1.0, log_dir=tmp_path,
                    orchestrator_args=["--audit-rate", "1", "--replan-interval-s", "3600"])
    sw.start(timeout=scaled(120))
    try:
        sw.wait_ready(timeout=scaled(150))
        client = sw.client(timeout=scaled(120))
        prompt = [(7 * i + 3) % 250 + 1 for i in range(48)]
        first = client.complete(prompt, max_tokens=4, ignore_eos=True)
        cached = []
        for _ in range(3):
            again = client.complete(prompt, max_tokens=4, ignore_eos=True)
            assert again.token_ids == first.token_ids
            cached.append(again.usage["prompt_tokens_details"]["cached_tokens"])
        assert max(cached) >= 16, cached  # the prefix was reused: its later-hop inputs were never relayed
        st = sw.wait_until(lambda v: v["audit"]["inflight"] == 0, scaled(30), "audits to finish")
        audit = st["audit"]
        print(audit)
        assert audit["rebuilt_history"] >= 1 and audit["skipped_no_history"] == 0, audit
        assert audit["strikes"] == 0 and audit["agreed"] >= audit["rebuilt_history"] > 0
    finally:
        sw.stop()
