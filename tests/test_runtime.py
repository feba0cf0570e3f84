"""Block runtime: per-block loading, the slot pool, and a chain of BlockRunners vs the full HF model."""

from __future__ import annotations

import asyncio

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import petals_chain.swarm.sources as sources
from petals_chain.server.emulated import EmulatedRunner
from petals_chain.server.runner import BlockRunner, NoCapacityError
from petals_chain.swarm.checkpoint import (cache_kwarg, load_block, load_config, load_head, resolve_model_path,
                                         weight_map)
from petals_chain.swarm.memory import block_bytes, cache_slot_bytes, slots_for_budget
from petals_chain.swarm.tiny_model import build_tiny_model

SPANS = [(0, 3), (3, 6), (6, 8)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {fam: build_tiny_model(root / fam, family=fam, num_layers=8, seed=0) for fam in ("llama", "mistral", "qwen2")}


def _chain(path, max_length=64, num_slots=3, **kw):
    runners = [BlockRunner(path, a, b - a, num_slots=num_slots, max_length=max_length, progress=False, **kw)
               for a, b in SPANS]
    for r, (a, b) in zip(runners, SPANS):
        r.allocate("s", a, b)
    return runners


def _through(runners, hidden, position, sid="s"):
    for r in runners:
        hidden = r.forward(sid, hidden, position)
    return hidden


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("mistral", "sdpa"), ("qwen2", "sdpa"),
                                         ("llama", "eager"), ("qwen2", "eager")])
def test_chain_matches_full_model_logits(models, family, attn):
    path = models[family]
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    head = load_head(path, "float32")
    runners = _chain(path, attn_implementation=attn)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        # prefill of 9 tokens, then a 3-token chunk on top of a prefix (exercises the explicit mask), then decode
        ref = model(ids[:, :9], use_cache=True, **{cache_kwarg(model): cache}).logits
        got = head.logits(_through(runners, head.embed(ids[:, :9]), 0))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        ref = model(ids[:, 9:], use_cache=True, **{cache_kwarg(model): cache}).logits
        got = head.logits(_through(runners, head.embed(ids[:, 9:]), 9))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        tok, pos = ref[:, -1:].argmax(-1), 12
        for _ in range(6):
            ref = model(tok, use_cache=True, **{cache_kwarg(model): cache}).logits
            got = head.logits(_through(runners, head.embed(tok), pos))
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
            tok, pos = ref[:, -1:].argmax(-1), pos + 1
    assert [r.session_length("s") for r in runners] == [pos] * 3


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_greedy_generation_matches_generate(models, family):
    from transformers import AutoTokenizer

    path = models[family]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok("Once upon a time there was a", return_tensors="pt").input_ids
    new_tokens = 20
    ref = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()

    head = load_head(path)
    runners = _chain(path)
    out: list[int] = []
    inp, pos = ids, 0
    for _ in range(new_tokens):
        hidden = _through(runners, head.embed(inp), pos)
        nxt = int(head.logits(hidden[:, -1]).argmax(-1))
        out.append(nxt)
        pos += inp.shape[1]
        inp = torch.tensor([[nxt]])
    assert out == ref
    assert len(set(out)) > 3


def test_load_block_reads_only_its_own_keys(models, monkeypatch):
    path = models["llama"]
    wmap = weight_map(path)
    assert len(set(wmap.values())) >= 2
    reads: list[tuple[str, str]] = []
    real = sources.safe_open

    class Spy:
        def __init__(self, fname, *a, **k):
            self.fname, self.f = fname, real(fname, *a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, k):
            reads.append((self.fname.rsplit("/", 1)[-1], k))
            return self.f.get_tensor(k)

    monkeypatch.setattr(sources, "safe_open", Spy)
    for index in (0, 4, 7):
        reads.clear()
        layer = load_block(path, index, "float32")
        assert layer.self_attn.layer_idx == index
        expected = {k for k in wmap if k.startswith(f"model.layers.{index}.")}
        assert {k for _, k in reads} == expected and len(reads) == len(expected)
        assert {f for f, _ in reads} == {wmap[k] for k in expected}
    # some block lives in a different shard than block 0: per-block loading really spans files
    assert len({wmap[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(8)}) >= 2


def test_load_block_errors(models):
    path = models["llama"]
    with pytest.raises(ValueError, match="out of range"):
        load_block(path, 8)
    with pytest.raises(ValueError, match="CUDA"):
        load_block(path, 0, quant="nf4")
    with pytest.raises(ValueError, match="quant"):
        load_block(path, 0, quant="int4")
    with pytest.raises(ValueError, match="dtype"):
        load_block(path, 0, dtype="int8")


def test_resolve_model_path(models, tmp_path):
    assert resolve_model_path(str(models["qwen2"])) == models["qwen2"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "nope" / "deeper"))


def test_resolve_model_path_hub(models, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, revision=None, cache_dir=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        if repo_id == "org/missing":
            raise OSError("offline")
        return str(models["llama"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_path("org/tiny", revision="main") == models["llama"]
    assert calls[0][:2] == ("org/tiny", "main") and "*.safetensors" in calls[0][2]
    with pytest.raises(FileNotFoundError, match="hub.*offline"):
        resolve_model_path("org/missing")


def test_head_tied_and_untied(models):
    for fam, tied in (("llama", False), ("qwen2", True)):
        head = load_head(models[fam], "bfloat16")
        assert head.dtype == torch.bfloat16
        assert (head.lm_head.weight is head.embed_tokens.weight) == tied
        logits = head.logits(head.embed(torch.tensor([[1, 2, 3]])))
        assert logits.shape == (1, 3, head.config.vocab_size) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="token ids"):
        head.embed(torch.tensor([[head.config.vocab_size]]))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_formulas_match_tensors(models, family, dtype):
    path = models[family]
    cfg = load_config(path)
    r = BlockRunner(path, 2, 3, num_slots=5, max_length=48, dtype=dtype, progress=False)
    s_m, s_c = block_bytes(cfg, dtype), cache_slot_bytes(cfg, dtype, 48)
    assert r.blocks_bytes == 3 * s_m
    assert r.pool.nbytes == 5 * s_c and r.s_c == s_c
    kv, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    assert s_c == 2 * kv * hd * 48 * (4 if dtype == "float32" else 2)
    assert block_bytes(cfg, "float16", "int8") < block_bytes(cfg, "float16") / 1.5
    assert block_bytes(cfg, "float16", "nf4") < block_bytes(cfg, "float16", "int8")
    # Eq. 3: a budget of exactly 3 blocks + 5 slots gives 5 slots; one byte less gives 4
    assert slots_for_budget(3 * s_m + 5 * s_c, 3, s_m, s_c) == 5
    assert slots_for_budget(3 * s_m + 5 * s_c - 1, 3, s_m, s_c) == 4
    assert slots_for_budget(s_m, 3, s_m, s_c) == 0


def test_slot_accounting(models):
    r = BlockRunner(models["llama"], 2, 4, num_slots=7, max_length=32, progress=False, kv_cache="slots")
    assert (r.slots_total, r.slots_free) == (7, 7)
    r.allocate("a", 2, 6)  # 4 slots
    r.allocate("b", 4, 6)  # 2 slots
    assert r.slots_free == 1
    with pytest.raises(NoCapacityError, match="no capacity"):
        r.allocate("c", 3, 5)
    assert r.slots_free == 1 and "c" not in r.sessions()
    r.allocate("d", 5, 6)
    assert r.slots_free == 0
    with pytest.raises(NoCapacityError):
        r.allocate("e", 5, 6)
    # distinct sessions never share a slot
    slots = [p for sess in r._sessions.values() for t in sess.pages_of.values() for p in t]
    assert sorted(slots) == list(range(7)) and r.cache_stats()["pages_used"] == 7
    assert r.release("a") and r.slots_free == 4
    assert not r.release("a")  # unknown now
    r.allocate("c", 3, 5)
    assert r.slots_free == 2
    for bad in [(1, 3), (2, 2), (5, 7), (4, 3)]:
        with pytest.raises(ValueError, match="span"):
            r.allocate("x", *bad)
    with pytest.raises(ValueError, match="already open"):
        r.allocate("b", 4, 5)
    assert r.slots_free == 2
    r.close()
    assert r.slots_free == 7 and r.sessions() == {}


def test_paged_admission_counts_tokens_not_max_length(models):
    """Equal memory: slots admit one session per slot; pages admit by declared length, never over-commit, and a
    step past a session's declared length is refused."""
    kw = dict(num_slots=8, max_length=64, progress=False)
    slots = BlockRunner(models["llama"], 0, 2, kv_cache="slots", **kw)
    paged = BlockRunner(models["llama"], 0, 2, kv_cache="paged", page_size=8, **kw)
    assert slots.pool.nbytes == paged.pool.nbytes and paged.cache_tokens_total == 8 * 64
    for r in (slots, paged):
        n = 0
        while True:
            try:
                r.allocate(f"s{n}", 0, 2, max_tokens=20)  # 3 pages of 8 per block
            except NoCapacityError:
                break
            n += 1
        assert n == (4 if r is slots else 10), r.kv_cache  # 8 slots / 2 blocks; 64 pages / (2 x 3)
    assert paged.cache_tokens_free == 4 * 8 and paged.slots_free == 0 and paged.cache_stats()["pages_used"] == 60
    H = paged.hidden_size
    paged.forward("s0", torch.randn(1, 17, H), 0)  # crosses two page boundaries
    paged.forward("s0", torch.randn(1, 3, H), 17)  # fills its 20 tokens exactly
    with pytest.raises(ValueError, match="token limit 20"):
        paged.forward("s0", torch.randn(1, 1, H), 20)
    paged.allocate("short", 0, 1, max_tokens=30)  # 4 pages: exactly what is left
    with pytest.raises(NoCapacityError):
        paged.allocate("one-more", 0, 1, max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        paged.allocate("too-long", 0, 1, max_tokens=65)
    paged.close()
    assert paged.cache_stats()["pages_used"] == 0 and paged.slots_free == 8


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_fork_copies_the_prefix_kv(models, kv_cache):
    """A forked session continues exactly like the session it copies, and like a fresh one fed the same tokens."""
    r = BlockRunner(models["llama"], 0, 4, num_slots=16, max_length=32, progress=False, kv_cache=kv_cache)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randn(1, 7, r.hidden_size, generator=g)
    nxt = [torch.randn(1, 1, r.hidden_size, generator=g) for _ in range(3)]
    r.allocate("a", 0, 4)
    r.forward("a", prefix, 0)
    r.fork("a", "b", 7)
    assert r.session_length("b") == 7 and r.slots_free == 8
    r.allocate("fresh", 0, 4)
    r.forward("fresh", prefix, 0)
    for i, x in enumerate(nxt):
        ya, yb, yf = (r.forward(s, x, 7 + i) for s in ("a", "b", "fresh"))
        torch.testing.assert_close(yb, ya, rtol=0, atol=0)
        torch.testing.assert_close(yb, yf, rtol=0, atol=0)
    # a shorter fork sees only the first 5 tokens: it matches a fresh session fed those 5 (up to float noise:
    # the fresh prefill multiplies 5 rows, the source's 7)
    r.release("fresh")
    r.fork("a", "c", 5)
    r.allocate("five", 0, 4)
    r.forward("five", prefix[:, :5], 0)
    torch.testing.assert_close(r.forward("c", nxt[0], 5), r.forward("five", nxt[0], 5), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="cannot fork"):
        r.fork("a", "d", 11)
    with pytest.raises(KeyError):
        r.fork("nope", "d", 1)
    with pytest.raises(NoCapacityError):
        r.fork("a", "d", 3)  # a, b, c and five hold all 16 slots
    assert "d" not in r.sessions()


def test_a_cancelled_step_without_batching_keeps_its_pages_until_the_thread_ends(models, monkeypatch):
    """Without batching a step computes in an executor thread, which a cancelled caller cannot stop: the session
    stays busy (its pages its own) until that thread ends. (It was finished at once, so a close could hand the
    pages to a new session while the orphaned step still wrote them.)"""
    r = BlockRunner(models["llama"], 0, 2, num_slots=4, max_length=32, progress=False, batching=False)
    release, entered = threading.Event(), threading.Event()
    compute = r._compute_alone

    def slow(*args):
        entered.set()
        release.wait(10)
        return compute(*args)

    monkeypatch.setattr(r, "_compute_alone", slow)

    async def main():
        r.allocate("a", 0, 2)
        step = asyncio.ensure_future(r.forward_async("a", torch.randn(1, 12, r.hidden_size), 0, inline_max_tokens=0))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        step.cancel()
        await asyncio.sleep(0.2)
        assert not step.done() and r.sessions()["a"]["busy"]
        assert not r.release("a") or r.slots_free == 2  # released while busy: its slots wait for the thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert r.slots_free == 4

    asyncio.run(main())


def test_zero_slot_runner_refuses(models):
    r = BlockRunner(models["llama"], 0, 1, num_slots=0, max_length=16, progress=False)
    with pytest.raises(NoCapacityError):
        r.allocate("a", 0, 1)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_invalid_inputs_change_nothing(models, kv_cache):
    r = BlockRunner(models["qwen2"], 0, 2, num_slots=2, max_length=16, progress=False, kv_cache=kv_cache,
                    page_size=4)
    H = r.hidden_size
    r.allocate("s", 0, 2)
    x = torch.randn(1, 4, H, generator=torch.Generator().manual_seed(0))
    out1 = r.forward("s", x, 0)
    keys_before = r.pool.keys.clone()
    bad_calls = [
        (torch.randn(2, 1, H), 4, "shape"),
        (torch.randn(1, 1, H + 1), 4, "shape"),
        (torch.randn(1, 0, H), 4, "shape"),
        (torch.randn(1, H), 4, "shape"),
        (torch.ones(1, 1, H, dtype=torch.int64), 4, "float"),
        (torch.full((1, 1, H), float("nan")), 4, "NaN"),
        ([[0.0] * H], 4, "Tensor"),
        (torch.randn(1, 1, H), 5, "skip ahead"),
        (torch.randn(1, 1, H), -1, "position"),
        (torch.randn(1, 1, H), 4.0, "int"),
        (torch.randn(1, 13, H), 4, "max_length"),
    ]
    for hidden, pos, msg in bad_calls:
        with pytest.raises(ValueError, match=msg):
            r.forward("s", hidden, pos)
        assert r.session_length("s") == 4
        assert torch.equal(r.pool.keys, keys_before)
    with pytest.raises(KeyError):
        r.forward("nope", torch.randn(1, 1, H), 0)
    # the session still works and is consistent: recomputing the prefix gives the same result
    torch.testing.assert_close(r.forward("s", x, 0), out1, atol=0, rtol=0)
    r.forward("s", torch.randn(1, 12, H), 4)  # fills to max_length exactly
    assert r.session_length("s") == 16
    with pytest.raises(ValueError, match="max_length"):
        r.forward("s", torch.randn(1, 1, H), 16)


def test_rollback_recomputes_from_earlier_position(models):
    path = models["mistral"]
    r = BlockRunner(path, 0, 8, num_slots=16, max_length=32, progress=False)
    H = r.hidden_size
    g = torch.Generator().manual_seed(3)
    prefix, a, b = torch.randn(1, 6, H, generator=g), torch.randn(1, 3, H, generator=g), torch.randn(1, 2, H, generator=g)
    r.allocate("x", 0, 8)
    r.allocate("y", 0, 8)
    r.forward("x", prefix, 0)
    r.forward("x", a, 6)  # a branch we later abandon
    assert r.session_length("x") == 9
    out_x = r.forward("x", b, 6)  # roll back to position 6 and continue differently
    assert r.session_length("x") == 8
    r.forward("y", prefix, 0)
    out_y = r.forward("y", b, 6)  # the same sequence without the detour
    torch.testing.assert_close(out_x, out_y, atol=1e-6, rtol=0)


def test_dtype_round_trip_and_bf16(models):
    r = BlockRunner(models["llama"], 0, 2, num_slots=2, max_length=16, dtype="bfloat16", progress=False)
    r.allocate("s", 0, 2)
    x = torch.randn(1, 3, r.hidden_size)
    out = r.forward("s", x, 0)
    assert out.dtype == torch.float32 and out.shape == x.shape and torch.isfinite(out).all()
    assert r.pool.keys.dtype == torch.bfloat16


def test_runner_constructor_validation(models):
    path = models["llama"]
    with pytest.raises(ValueError, match="outside"):
        BlockRunner(path, 6, 3, num_slots=1, max_length=8, progress=False)
    with pytest.raises(ValueError, match="compute_scale"):
        EmulatedRunner(path, 0, 1, num_slots=1, max_length=8, compute_scale=0.5, progress=False)
    with pytest.raises(TypeError):  # emulation is a wrapper, not a knob of the real runner
        BlockRunner(path, 0, 1, num_slots=1, max_length=8, compute_scale=2.0, progress=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        BlockRunner(path, 0, 1, num_slots=1, max_length=10**6, progress=False)


def test_compute_scale_slows_steps(models, monkeypatch):
    import time

    import petals_chain.server.runner as runner_mod

    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(runner_mod.time, "sleep", lambda s: slept.append(s) or real_sleep(s))
    path = models["llama"]
    fast = BlockRunner(path, 0, 8, num_slots=8, max_length=128, progress=False)
    slow = EmulatedRunner(path, 0, 8, num_slots=8, max_length=128, compute_scale=3.0, progress=False)
    x = torch.randn(1, 32, fast.hidden_size)
    fast.allocate("t", 0, 8)
    fast.forward("t", x, 0)
    assert slept == []  # no emulation at scale 1
    slow.allocate("t", 0, 8)
    t0 = time.perf_counter()
    out = slow.forward("t", x, 0)
    wall = time.perf_counter() - t0
    # sleep = (scale - 1) * compute, so the step's wall time is at least scale/(scale-1) times the sleep
    assert len(slept) == 1 and slept[0] > 0 and wall >= 1.5 * slept[0]
    torch.testing.assert_close(out, fast.forward("t", x, 0), atol=0, rtol=0)


def test_concurrent_sessions_from_threads(models):
    path = models["qwen2"]
    r = BlockRunner(path, 0, 8, num_slots=32, max_length=32, progress=False)
    H = r.hidden_size
    xs = [torch.randn(1, 5, H, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = []
    for i, x in enumerate(xs):
        r.allocate(f"ref{i}", 0, 8)
        expected.append([r.forward(f"ref{i}", x, 0), r.forward(f"ref{i}", x[:, :1], 5)])
        r.release(f"ref{i}")
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            r.allocate(f"t{i}", 0, 8)
            results[i] = [r.forward(f"t{i}", xs[i], 0), r.forward(f"t{i}", xs[i][:, :1], 5)]
            r.release(f"t{i}")
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(4):
        for got, want in zip(results[i], expected[i]):
            # concurrent steps are batched (packed matmuls round differently from one session's): fp32 close
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert r.slots_free == 32


def test_one_page_cache_writes_in_place_and_returns_pool_views():
    """Slots mode: a session's layer is one page of max_length tokens; a step reads a view of it, no copy."""
    from petals_chain.server.kv_cache import PagedCache, PagePool

    pool = PagePool(3, num_kv_heads=2, page_size=10, head_dim=4, dtype=torch.float32)
    pool.reserve(2)
    p0, p2 = pool.take(2)
    cache = PagedCache(pool, {7: [p2], 8: [p0]}, position=4, n_tokens=2)
    k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    ko, vo = cache.update(k, v, 7)
    assert ko.shape == (1, 2, 6, 4) and cache.get_seq_length() == 4
    assert ko.untyped_storage().data_ptr() == pool.keys.untyped_storage().data_ptr()  # a view, no copy of the past
    assert torch.equal(pool.keys[:, p2, 4:6], k[0]) and torch.equal(pool.values[:, p2, 4:6], v[0])
    assert torch.count_nonzero(pool.keys[:, p0]) == 0
    with pytest.raises(KeyError):
        cache.update(k, v, 9)  # a layer this session holds no page for
    with pytest.raises(ValueError, match="exceed the pages"):
        PagedCache(pool, {7: [p2]}, position=9, n_tokens=2)
    free = [p for p in range(3) if p not in (p0, p2)]
    with pytest.raises(ValueError, match="not allocated"):
        pool.release(free)
    with pytest.raises(NoCapacityError):
        pool.reserve(2)  # one page free
    with pytest.raises(ValueError, match="reserved"):
        pool.take(1)  # nothing reserved
    pool.release([p0, p2])
    assert pool.pages_available == 3


def test_pages_in_any_order_read_back_as_one_sequence():
    """Paged mode: K/V written across page boundaries, into pages scattered in the pool, reads back in order."""
    from petals_chain.server.kv_cache import PagedCache, PagePool

    pool = PagePool(8, num_kv_heads=2, page_size=4, head_dim=3, dtype=torch.float32)
    pool.reserve(8)
    pages = pool.take(8)
    table_a, table_b = [pages[5], pages[1], pages[7]], [pages[0], pages[6], pages[2]]
    g = torch.Generator().manual_seed(0)
    full_a, full_b = torch.randn(2, 11, 3, generator=g), torch.randn(2, 11, 3, generator=g)
    for start, end in ((0, 3), (3, 9), (9, 10), (10, 11)):  # steps that cross page boundaries
        for table, full in ((table_a, full_a), (table_b, full_b)):
            cache = PagedCache(pool, {0: table}, position=start, n_tokens=end - start)
            ko, vo = cache.update(full[None, :, start:end], -full[None, :, start:end], 0)
            assert torch.equal(ko[0], full[:, :end]) and torch.equal(vo[0], -full[:, :end])
    kb, vb = pool.read_batch([table_a, table_b[:2]], 7)  # the second table is padded: only its 7 tokens count
    assert kb.shape == (2, 2, 7, 3) and torch.equal(kb[0], full_a[:, :7]) and torch.equal(kb[1], full_b[:, :7])
    dst = pages[3:4] + pages[4:5]
    pool.copy(table_a, dst, 6)
    assert torch.equal(pool.read(dst, 6)[0][0], full_a[:, :6])


def test_reading_a_batch_copies_only_its_rows_pages():
    """A decode step's gather must cost the rows' tokens, not the pool's size: reading the one-page prefixes of two
    rows from a 4096-page pool allocates about their size (index_select on a strided view of the pool made the
    whole pool contiguous first, every step: a volunteer with a large memory budget and a small model decoded ~80x
    slower under load). Checked by the bytes the profiler sees allocated, not by timing."""
    from torch.profiler import ProfilerActivity, profile

    from petals_chain.server.kv_cache import PagePool

    pool = PagePool(4096, num_kv_heads=2, page_size=16, head_dim=8, dtype=torch.float32)
    pool.reserve(2)
    a, b = pool.take(2)
    g = torch.Generator().manual_seed(1)
    ka, kb = torch.randn(2, 9, 8, generator=g), torch.randn(2, 9, 8, generator=g)
    pool.write([a], 0, ka, -ka)
    pool.write([b], 0, kb, -kb)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        k, v = pool.read_batch([[a], [b]], 9)
    assert torch.equal(k[0], ka) and torch.equal(k[1], kb) and torch.equal(v[1], -kb)
    allocated = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    rows = 2 * 2 * 9 * 8 * 4  # two rows' K (or V) prefixes, bytes
    assert allocated <= 4 * rows, (allocated, pool.nbytes)


def test_runner_does_not_mutate_callers_config(models):
    cfg = load_config(models["llama"])
    cfg._attn_implementation = "eager"
    r = BlockRunner(models["llama"], 0, 1, num_slots=1, max_length=8, config=cfg, progress=False)
    assert cfg._attn_implementation == "eager" and r.config._attn_implementation == "sdpa"


def test_bfloat16_chain_matches_bfloat16_model(models):
    path = models["qwen2"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    head = load_head(path, "bfloat16")
    runners = _chain(path, dtype="bfloat16")
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        ref = model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits.float()
        torch.testing.assert_close(head.logits(_through(runners, head.embed(ids), 0)), ref, atol=2e-2, rtol=0)
        tok = ref[:, -1:].argmax(-1)
        ref = model(tok, use_cache=True, **{cache_kwarg(model): cache}).logits.float()
        torch.testing.assert_close(head.logits(_through(runners, head.embed(tok), 7)), ref, atol=2e-2, rtol=0)


def test_mistral_sliding_window(tmp_path):
    path = build_tiny_model(tmp_path / "m", family="mistral", num_layers=2, sliding_window=32)
    with pytest.raises(ValueError, match="sliding_window"):
        BlockRunner(path, 0, 2, num_slots=1, max_length=33, progress=False)
    # within the window the full-prefix cache is exact
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    head = load_head(path)
    r = BlockRunner(path, 0, 2, num_slots=2, max_length=32, progress=False)
    r.allocate("s", 0, 2)
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    got = torch.cat([head.logits(r.forward("s", head.embed(ids[:, :20]), 0)),
                     head.logits(r.forward("s", head.embed(ids[:, 20:]), 20))], dim=1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_release_during_step_and_idle_release(models, monkeypatch):

    r = BlockRunner(models["llama"], 0, 2, num_slots=4, max_length=16, progress=False)
    H = r.hidden_size
    r.allocate("s", 0, 2)
    entered, go = threading.Event(), threading.Event()
    real = r._run_blocks

    def blocking(*a, **k):
        entered.set()
        assert go.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(r, "_run_blocks", blocking)
    result: list = []
    t = threading.Thread(target=lambda: result.append(r.forward("s", torch.randn(1, 2, H), 0)))
    t.start()
    assert entered.wait(10)
    with pytest.raises(ValueError, match="in progress"):  # one step at a time per session
        r.forward("s", torch.randn(1, 1, H), 0)
    assert r.release("s") and r.slots_free == 2  # slots still in use by the running step
    with pytest.raises(KeyError):
        r.forward("s", torch.randn(1, 1, H), 0)
    go.set()
    t.join(10)
    assert result and result[0].shape == (1, 2, H)
    assert r.slots_free == 4 and r.sessions() == {}
    monkeypatch.setattr(r, "_run_blocks", real)

    r.allocate("old", 0, 1)
    r.allocate("new", 0, 1)
    r._sessions["old"].last_used -= 100
    assert r.release_idle(50) == ["old"]
    assert list(r.sessions()) == ["new"] and r.slots_free == 3


def test_cuda_runners_keep_attention_off_cudnn():
    """cuDNN's SDPA builds a plan per shape, 13x slower decode at new lengths on an H200 (docs/results.md): a runner on
    CUDA turns that backend off; one on the CPU leaves the flag alone."""
    from petals_chain.server.runner import _avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        _avoid_cudnn_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        _avoid_cudnn_attention(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
