"""The planner plans each server with the ``s_m`` / ``s_c`` its record announces (its dtype, quantization, KV pages),
not the orchestrator's own: with SmolLM2 and 200 MB servers, a bf16 server under an fp32 orchestrator was given half
the blocks it holds, an fp32 server under a bf16 orchestrator twice as many (it refused them and stayed idle), an nf4
one a fraction. And the orchestrator's own ``s_c`` is rounded up to whole KV pages, as the servers round theirs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from petals_chain.algorithms import gca, tune_capacity
from petals_chain.algorithms.baselines import cg_bp_placement, petals_placement, whole_model_placement
from petals_chain.model import ModelSpec, ServerSpec, units_that_fit
from petals_chain.orchestrator.planner import SizedServerSpec, Planner, ServerView
from petals_chain.swarm.records import ServerRecord

L = 30  # SmolLM2-135M: 30 layers; bytes of one layer and of one 2048-token KV slot (swarm/memory.py)
S_M = {"float32": 14160384, "bfloat16": 7080192, "nf4": 1995264}
S_C = {"float32": 3145728, "bfloat16": 1572864}
MB200 = 200_000_000


def model_of(dtype: str, quant: str = "none") -> ModelSpec:
    return ModelSpec(L, S_M["nf4" if quant == "nf4" else dtype], S_C[dtype])


def record(name: str, dtype: str, quant: str = "none", memory: int = MB200, tau_p: float = 0.01, **kw) -> ServerRecord:
    fields = dict(peer_id=name, public_name=name, memory_bytes=memory, tau_p=tau_p, max_length=2048, dtype=dtype,
                  quant=quant, s_m_bytes=S_M["nf4" if quant == "nf4" else dtype], s_c_bytes=S_C[dtype],
                  state="online")
    return ServerRecord(**{**fields, **kw})


def planner(model: ModelSpec, max_length: int = 2048, **kw) -> Planner:
    return Planner(dht=None, prefix="m", client=None, max_length=max_length, on_chains=lambda chains: None,
                   arrival_rate=2.0, model_spec_fallback=lambda: model, **kw)


def holds(r: ServerRecord, c: int) -> int:
    """Eq. 8 in the server's own sizes: the blocks it holds with ``c`` jobs' slots in each."""
    return min(L, units_that_fit(r.memory_bytes, r.s_m_bytes + r.s_c_bytes * c))


@pytest.mark.parametrize("orchestrator", ["float32", "bfloat16"])
def test_each_server_is_planned_with_the_sizes_its_record_announces(orchestrator):
    views = [ServerView(n, record(n, d, q)) for n, d, q in
             (("fp32", "float32", "none"), ("bf16", "bfloat16", "none"), ("nf4", "float32", "nf4"))]
    pl = planner(model_of(orchestrator))
    model = pl._model_spec()
    specs = {s.name: s for s in pl.specs(views)}
    for v in views:  # before: Eq. 8 and 3 in the orchestrator's sizes (bf16 under fp32: 8 blocks at c=3, not 16)
        r = v.record
        for c in (1, 3, 7):
            assert specs[v.peer_id].max_blocks(model, c) == holds(r, c), (v.peer_id, c)
        for m in (1, 9, 17):
            assert specs[v.peer_id].residual_slots(model, m) == max(0, (r.memory_bytes - r.s_m_bytes * m)
                                                                    // r.s_c_bytes), (v.peer_id, m)
    plan = pl.full_plan(views)
    assert plan is not None and plan.c is not None
    spans = dict(plan.placement.items())
    # every span fits its server (before, under bf16: the fp32 server was given 16 blocks, and holds 8 at c=3) ...
    assert all(spans[n][1] <= holds(v.record, plan.c) for v in views for n in [v.peer_id] if n in spans), spans
    # ... and the smaller ones are given what they hold (before, under fp32: 8 blocks each, as fp32's)
    assert spans["bf16"][1] == holds(views[1].record, plan.c) and spans["nf4"][1] == holds(views[2].record, plan.c)
    # the orchestrator's dtype no longer matters when every server says its sizes
    other = planner(model_of("bfloat16" if orchestrator == "float32" else "float32")).full_plan(views)
    assert dict(other.placement.items()) == spans and other.c == plan.c
    assert [(ch.servers, ch.capacity) for ch in other.chains] == [(ch.servers, ch.capacity) for ch in plan.chains]


def test_older_records_and_sizes_equal_to_the_orchestrators_are_planned_as_before():
    model = model_of("float32")
    pl = planner(model)
    old = ServerView("old", ServerRecord(peer_id="old", memory_bytes=MB200, tau_p=0.01, state="online"))
    same = ServerView("same", record("same", "float32"))
    capped = ServerView("cap", record("cap", "float32", cache_tokens_per_block=4096))
    for v, spec in zip((old, same, capped), pl.specs([old, same, capped])):
        assert not isinstance(spec, SizedServerSpec), v.peer_id
        assert spec.memory == MB200 and spec.max_blocks(model, 2) == units_that_fit(MB200, S_M["float32"]
                                                                                   + 2 * S_C["float32"])
    # a capped cache with its own sizes keeps its cap (2 jobs of 2048 tokens in 4096 tokens per block)
    both = pl.specs([ServerView("cb", record("cb", "bfloat16", cache_tokens_per_block=4096))])[0]
    assert isinstance(both, SizedServerSpec) and both.most_jobs() == 2
    assert both.max_blocks(model, 3) == 0 and both.max_blocks(model, 2) == holds(record("x", "bfloat16"), 2)
    assert both.residual_slots(model, 10) == 10 * 4096 // 2048


def test_sizes_nobody_would_announce_are_not_believed():
    model = model_of("float32")
    pl = planner(model)
    for fields in (dict(s_m_bytes=1), dict(s_c_bytes=1), dict(s_m_bytes=S_M["float32"] * 100)):
        spec = pl.specs([ServerView("odd", record("odd", "bfloat16", **fields))])[0]
        assert type(spec) is ServerSpec and spec.memory == MB200, fields


@pytest.mark.parametrize("kv_cache, tokens", [("paged", 112), ("slots", 100)])
def test_a_record_sized_for_another_max_length_is_planned_at_the_swarms(kv_cache, tokens):
    """A record announced before the server's first assignment carries its default max_length (2048); the swarm's is
    100: a paged server rounds it up to 112 tokens (7 pages of 16), a slots one takes 100."""
    model = ModelSpec(L, S_M["float32"], S_C["float32"] * 112 / 2048)
    pl = planner(model, max_length=100)
    spec = pl.specs([ServerView("s", record("s", "bfloat16", kv_cache=kv_cache))])[0]
    assert isinstance(spec, SizedServerSpec)
    assert (spec.block_size, spec.cache_size) == (S_M["bfloat16"], S_C["bfloat16"] * tokens / 2048)
    # loaded, it says its page size (32: 4 pages, 128 tokens)
    loaded = pl.specs([ServerView("s", record("s", "bfloat16", kv_cache=kv_cache, page_size=32))])[0]
    assert loaded.cache_size == S_C["bfloat16"] * (128 if kv_cache == "paged" else 100) / 2048


def sized(name: str, memory: float, tau_p: float, own: ModelSpec, model: ModelSpec) -> SizedServerSpec:
    return SizedServerSpec.of(name=name, memory=memory, tau_c=0.02, tau_p=tau_p, block_size=own.block_size,
                              cache_size=own.cache_size, model=model)


@pytest.mark.parametrize("orchestrator", ["float32", "bfloat16"])
def test_algorithms_plan_sized_servers_exactly_as_in_their_own_units(orchestrator):
    """Servers that all announce nf4 sizes, planned beside an fp32 or bf16 model (its ``s_m`` 7 or 3.5 times theirs,
    its ``s_c`` alike or half): c tuning, GBP-CR, GCA and the baselines give what they give planned in nf4's units."""
    own, model = model_of("float32", "nf4"), model_of(orchestrator)
    rng = random.Random(5)
    params = [(f"s{i}", rng.uniform(40e6, 300e6), rng.uniform(0.005, 0.05)) for i in range(12)]
    plain = [ServerSpec(n, m, 0.02, t) for n, m, t in params]
    mixed = [sized(n, m, t, own, model) for n, m, t in params]
    for lam in (0.5, 5.0):
        for use_all in (False, True):
            a = tune_capacity(plain, own, lam, use_all_servers=use_all)
            b = tune_capacity(mixed, model, lam, use_all_servers=use_all)
            assert a[0] == b[0] and dict(a[1].items()) == dict(b[1].items())
            assert [(ch.servers, ch.blocks, ch.capacity) for ch in a[2]] == [(ch.servers, ch.blocks, ch.capacity)
                                                                            for ch in b[2]]
    assert [(c.servers, c.capacity) for c in gca(plain, own, a[1])] == [(c.servers, c.capacity)
                                                                        for c in gca(mixed, model, a[1])]
    assert dict(cg_bp_placement(plain, own, 3).items()) == dict(cg_bp_placement(mixed, model, 3).items())
    big = [ServerSpec("w", 1e9, 0.02, 0.01)]
    wa, wb = whole_model_placement(big, own), whole_model_placement([sized("w", 1e9, 0.01, own, model)], model)
    assert dict(wa[0].items()) == dict(wb[0].items()) and wa[1][0].capacity == wb[1][0].capacity
    # PETALS' rule, as the planner feeds it (per_block_memory)
    x = 4096 / 2048
    petals_view = [ServerSpec(s.name, s.per_block_memory(model, x), s.tau_c, s.tau_p) for s in mixed]
    assert dict(petals_placement(plain, own, rng=random.Random(0)).items()) == \
        dict(petals_placement(petals_view, model, rng=random.Random(0)).items())


def test_the_planners_petals_placement_sizes_servers_by_their_own_sizes():
    views = [ServerView(f"n{i}", record(f"n{i}", "float32", "nf4", tau_p=0.01 * (i + 1))) for i in range(3)]
    plan = planner(model_of("float32"), placement="petals").full_plan(views)
    # PETALS reserves 4096 tokens per block: 200 MB hold 200e6 // (s_m + 2 s_c) nf4 blocks (24), 9 of fp32
    per = MB200 // (S_M["nf4"] + 2 * S_C["float32"])
    assert plan is not None and {m for _, m in plan.placement.values()} == {min(L, per)}, dict(plan.placement.items())


def test_the_orchestrators_kv_slot_is_rounded_up_to_whole_pages():
    """At max_length 100 a default (paged, 16-token pages) server's slot holds 112 tokens: the orchestrator counted
    100, up to 16 % more slots than the servers have."""
    from transformers import LlamaConfig

    from petals_chain.orchestrator.core import Orchestrator
    from petals_chain.server.kv_cache import slot_tokens as server_slot_tokens
    from petals_chain.swarm.memory import cache_slot_bytes, slot_tokens

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    for length, tokens in ((100, 112), (2048, 2048), (8, 8), (17, 32)):
        fake = SimpleNamespace(cfg=SimpleNamespace(dtype="float32", max_length=length), config=config)
        spec = Orchestrator.model_spec(fake)
        assert spec.cache_size == cache_slot_bytes(config, "float32", tokens), length
    # one rounding, the servers' (server/kv_cache.py) and the orchestrator's
    for mode in ("paged", "slots"):
        for length in (1, 7, 16, 100, 2048, 2049):
            for page in (1, 16, 32, 3000):
                assert slot_tokens(mode, length, page) == server_slot_tokens(mode, length, page), (mode, length, page)
    with pytest.raises(ValueError):
        slot_tokens("paged", 0, 16)
