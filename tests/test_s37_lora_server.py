"""LoRA adapters on the server side: peft's format read and refused clearly, the adapter fingerprint, per-row deltas
in a batch mixing the base model and two adapters (base rows bit-identical, adapter rows as each alone and as the
weights merged by hand, on a tiny model and on SmolLM2), the prefix cache kept apart per adapter, opens naming an
adapter the server does not serve refused, and adapters given to the models they fit, counted in s_m and announced.
(The real path, server processes on P2P, is tests/test_s37_lora_swarm.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lora_helpers import merged_reference, write_adapter

from petals_chain.server.batching import BatchItem, run_batch
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.lora import AdapterError, check_adapter_fits, parse_adapter_arg, read_adapter
from petals_chain.swarm.prefix import prefix_hashes

TOL = dict(atol=2e-4, rtol=2e-4)  # packed matmuls and a delta added apart from W round differently: fp32 close


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"fr": write_adapter(root / "fr", tiny, seed=1),
            "de": write_adapter(root / "de", tiny, seed=2, r=2, alpha=4, rslora=True,
                                targets=("k_proj", "o_proj", "gate_proj", "up_proj"), layers=[1, 2, 3])}


# ---- the format ----------------------------------------------------------------------------------------------------
def test_fingerprint_is_content_not_name_or_place(adapters, tmp_path, tiny):
    a = read_adapter(adapters["fr"], "fr")
    copy = shutil.copytree(adapters["fr"], tmp_path / "elsewhere")
    assert read_adapter(copy, "other-name").fingerprint == a.fingerprint
    assert len(a.fingerprint) == 32 and a.fingerprint != read_adapter(adapters["de"]).fingerprint
    cfg = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 16}))  # changes the math
    assert read_adapter(copy).fingerprint != a.fingerprint
    (copy / "adapter_config.json").write_text(json.dumps({**cfg, "lora_dropout": 0.3, "base_model_name_or_path": "x"}))
    assert read_adapter(copy).fingerprint == a.fingerprint  # training-only and informational fields do not
    assert a.modules[(0, "self_attn.q_proj")].scaling == 8.0 / 4
    de = read_adapter(adapters["de"])
    assert de.modules[(1, "self_attn.k_proj")].scaling == pytest.approx(4 / 2 ** 0.5)  # rslora: alpha / sqrt(r)
    assert de.layers == [1, 2, 3]
    check_adapter_fits(a, _config(tiny))


def _config(path):
    from petals_chain.swarm.checkpoint import load_config

    return load_config(path)


def _refused(tmp_path, tiny, **kw) -> str:
    path = write_adapter(tmp_path / f"bad{len(list(tmp_path.iterdir()))}", tiny, seed=3, **kw)
    with pytest.raises(AdapterError) as e:
        check_adapter_fits(read_adapter(path, "bad"), _config(tiny))
    text = str(e.value)
    assert "\n" not in text and text.startswith("adapter bad: ")
    return text


def test_what_cannot_be_served_is_refused_in_one_line_naming_it(tmp_path, tiny, tiny_model_factory):
    nan = torch.full((4, 64), float("nan"))
    cases = [
        (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (dict(config={"use_dora": True}), "use_dora"),
        (dict(config={"bias": "all"}), "bias"),
        (dict(config={"fan_in_fan_out": True}), "fan_in_fan_out"),
        (dict(config={"peft_type": "IA3"}), "peft_type"),
        (dict(config={"alpha_pattern": {"q_proj": 3}}), "alpha_pattern"),
        (dict(config={"r": 8}), "the config's r is 8"),
        (dict(config={"target_modules": ["k_proj"]}), "target_modules"),
        (dict(tensors={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), "LM head"),
        (dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 64)}), "embeddings"),
        (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}),
         "DoRA"),
        (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": nan}), "NaN"),
        (dict(tensors={"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}),
         "no lora_B"),
        (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 96)},
              config={"target_modules": ["q_proj", "v_proj", "down_proj"]}), "the model's Linear is 64 -> 64"),
        (dict(tensors={"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                       "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}),
         "the model has 4 layers"),
    ]
    for kw, needle in cases:
        assert needle in _refused(tmp_path, tiny, **kw), kw
    # an adapter of another model (other widths) is refused by its shapes, whatever its config calls its base
    other = tiny_model_factory("llama", num_layers=4, hidden_size=96, intermediate_size=192)
    path = write_adapter(tmp_path / "other", other, seed=4, config={"base_model_name_or_path": str(tiny)})
    with pytest.raises(AdapterError, match="an adapter of another model"):
        check_adapter_fits(read_adapter(path), _config(tiny))
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        read_adapter(path)


def test_adapter_arg_forms():
    assert parse_adapter_arg("fr=/a/b=c") == (None, "fr", "/a/b=c")
    assert parse_adapter_arg("chat:fr=/x") == ("chat", "fr", "/x")
    for bad in ("fr", "=/x", "fr=", "a b=/x", "chat:=/x"):
        with pytest.raises(AdapterError):
            parse_adapter_arg(bad)


# ---- the math in a batch -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(tiny, adapters):
    fr, de = read_adapter(adapters["fr"], "fr"), read_adapter(adapters["de"], "de")
    r = BlockRunner(tiny, 0, 4, num_slots=40, max_length=48, progress=False, page_size=16, adapters=[fr, de])
    return r, fr.fingerprint, de.fingerprint


def _open(r, sid, adapter=None, prefix=b"", tokens=48):
    cached = r.allocate(sid, 0, 4, max_tokens=tokens, prefix_hashes=prefix, adapter=adapter)
    return r._sessions[sid].pages_of, cached


def test_a_batch_mixing_base_and_two_adapters(runner, tiny, adapters):
    r, fr, de = runner
    H = r.hidden_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randn(1, n, H, generator=g) for n in (5, 3, 4, 6)]
    kinds = [None, fr, de, fr]
    # each alone (its own pages), then all in one batch (their own pages again), then the same batch with no adapter
    alone = [r._run_blocks(x, 0, _open(r, f"alone{i}", a, tokens=16)[0], 0, 4, **({"adapter": a} if a else {}))
             for i, (x, a) in enumerate(zip(prompts, kinds))]
    mixed = run_batch(r, [BatchItem(x, 0, _open(r, f"mix{i}", a, tokens=16)[0], 0, 4, a)
                          for i, (x, a) in enumerate(zip(prompts, kinds))])
    plain = run_batch(r, [BatchItem(x, 0, _open(r, f"plain{i}", tokens=16)[0], 0, 4) for i, x in enumerate(prompts)])
    assert torch.equal(mixed[0], plain[0])  # the base row: bit for bit the batch without adapters
    for i in range(4):
        torch.testing.assert_close(mixed[i], alone[i], **TOL)
    assert not torch.allclose(mixed[1], plain[1], atol=1e-2) and not torch.allclose(mixed[2], plain[2], atol=1e-2)
    # decode steps of the same sessions, mixed again (one token each: the gathered attention path)
    steps = [torch.randn(1, 1, H, generator=g) for _ in prompts]
    mixed_step = run_batch(r, [BatchItem(x, p.shape[1], r._sessions[f"mix{i}"].pages_of, 0, 4, a)
                               for i, (x, p, a) in enumerate(zip(steps, prompts, kinds))])
    alone_step = [r._run_blocks(x, p.shape[1], r._sessions[f"alone{i}"].pages_of, 0, 4, **({"adapter": a} if a else {}))
                  for i, (x, p, a) in enumerate(zip(steps, prompts, kinds))]
    for i in range(4):
        torch.testing.assert_close(mixed_step[i], alone_step[i], **TOL)
    # against the weights merged by hand (W + scaling * B @ A): the hidden states after the 4 blocks
    for name, fp, i in (("fr", fr, 1), ("de", de, 2)):
        ref = merged_reference(tiny, adapters[name])
        with torch.no_grad():
            h = prompts[i]
            pos = torch.arange(h.shape[1])[None]
            emb = ref.model.rotary_emb(h, pos)
            for layer in ref.model.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=emb)
                h = h[0] if isinstance(h, tuple) else h
        torch.testing.assert_close(mixed[i], h, **TOL)
    for sid in list(r._sessions):
        r.release(sid)


def test_prefix_cache_never_shared_across_adapters(runner):
    r, fr, de = runner
    H = r.hidden_size
    tokens = list(range(40))
    named = prefix_hashes(tokens[:-1])  # two full pages of 16
    x = torch.randn(1, 39, H, generator=torch.Generator().manual_seed(3))
    for sid, adapter in (("p-base", None), ("p-fr", fr)):
        pages, cached = _open(r, sid, adapter, named)
        assert cached == 0
        r.forward(sid, x, 0)
        r.release(sid, prefix_hashes=named)
    assert _open(r, "q-base", None, named)[1] == 32  # the same prompt on the base model: its pages
    assert _open(r, "q-fr", fr, named)[1] == 32  # ... and on fr: fr's
    assert _open(r, "q-de", de, named)[1] == 0  # never the base's or fr's K/V
    # and what is reused is that adapter's own K/V: the next step equals a session that computed everything
    step = torch.randn(1, 1, H, generator=torch.Generator().manual_seed(4))
    out_cached = r.forward("q-fr", torch.cat([x[:, 32:], step], dim=1), 32)[:, -1:]
    _open(r, "fresh-fr", fr)
    out_fresh = r.forward("fresh-fr", torch.cat([x, step], dim=1), 0)[:, -1:]
    torch.testing.assert_close(out_cached, out_fresh, **TOL)
    with pytest.raises(ValueError, match="does not serve adapter"):
        r.allocate("nope", 0, 4, adapter="0" * 32)
    for sid in list(r._sessions):
        r.release(sid)
    assert r.adapter_bytes == sum(t.numel() * 4 for (a, b, _) in _weights(r) for t in (a, b))


def _weights(r):
    return [w for per in r.lora._weights.values() for w in per.values()]


# ---- the server's parts ----------------------------------------------------------------------------------------------
def test_sessions_of_an_adapter_the_server_does_not_serve_are_refused(runner):
    from petals_chain.server.sessions import SessionService
    from petals_chain.swarm.rpc import RefusedError

    r, fr, de = runner
    svc = SessionService(hidden_size=r.hidden_size, trusted={"orch"}, allow_any_client=False, state=lambda: "online",
                         on_change=lambda: None, describe=dict)
    svc.runner = r
    with pytest.raises(RefusedError) as e:
        svc.open_session("x", 0, 4, 16, "orch", adapter="f" * 32)
    assert e.value.code == "unavailable"
    assert f"does not serve LoRA adapter {'f' * 32} (it serves fr ({fr}), de ({de}))" in str(e.value)
    svc.open_session("y", 0, 4, 16, "orch", adapter=fr)
    r.forward("y", torch.randn(1, 3, r.hidden_size), 0)
    with pytest.raises(RefusedError, match="cannot fork 'y': it runs with adapter .* this open with the base model"):
        svc.open_session("z", 0, 4, 16, "orch", fork_from="y", fork_length=3)
    svc.open_session("z", 0, 4, 16, "orch", fork_from="y", fork_length=3, adapter=fr)
    assert r._sessions["z"].adapter == fr
    for sid in ("y", "z"):
        svc.close_session(sid)


def test_adapters_are_given_to_the_models_they_fit_counted_and_announced(tiny, adapters, tiny_model_factory):
    from petals_chain.server.announce import build_record
    from petals_chain.server.config import ServerConfig
    from petals_chain.server.models import StandbyView, attach_adapters, load_hosted
    from petals_chain.swarm.emulation import Emulation
    from petals_chain.swarm.memory import block_bytes

    other = tiny_model_factory("llama", num_layers=2, hidden_size=96, intermediate_size=192)
    kw = dict(dtype="auto", quant="none", cache_tokens_per_block=0, kv_cache="paged", page_size=16)
    hosted = load_hosted([str(tiny), str(other)], **kw)
    attach_adapters(hosted, [f"fr={adapters['fr']}", f"{hosted[0].prefix}:de={adapters['de']}"])
    fr, de = read_adapter(adapters["fr"]), read_adapter(adapters["de"])
    assert hosted[0].adapter_names == {fr.fingerprint: "fr", de.fingerprint: "de"}
    assert hosted[1].adapters == []  # fr does not fit the other model's shapes: not given to it
    h = hosted[0]
    h.memory.measure(2**30, "cpu")
    per_block = fr.block_bytes(torch.float32) + de.block_bytes(torch.float32)
    assert h.memory.adapter_bytes == per_block and h.memory.s_m == block_bytes(h.config, torch.float32) + per_block
    record = build_record(StandbyView(h, 64, Emulation(), ServerConfig(model=str(tiny)), [], "unknown"), "peer")
    assert record.adapters == h.adapter_names and record.s_m_bytes == h.memory.s_m
    for values, needle in (([f"{hosted[1].prefix}:fr={adapters['fr']}"], "another model"),
                           ([f"nope:fr={adapters['fr']}"], "not one this server offers"),
                           ([f"fr={adapters['fr']}", f"fr2={adapters['fr']}"], "already")):
        with pytest.raises(AdapterError, match=needle):
            attach_adapters(load_hosted([str(tiny), str(other)], **kw), values)


# ---- the real model -------------------------------------------------------------------------------------------------
def test_smollm2_adapter_and_base_in_one_batch_are_token_exact(smollm2_path, smollm2_reference, tmp_path):
    """SmolLM2-135M's 30 blocks with a random adapter on q_proj and v_proj: the base and the adapter decoded greedily
    side by side in every batch equal transformers on the model and on the model with the adapter merged by hand."""
    from lora_helpers import merge_into

    from petals_chain.swarm.checkpoint import load_head

    path = write_adapter(tmp_path / "smol", smollm2_path, seed=5, r=8, alpha=16, targets=("q_proj", "v_proj"),
                         scale=0.05)
    adapter = read_adapter(path, "smol")
    r = BlockRunner(smollm2_path, 0, 30, num_slots=60, max_length=32, progress=False, adapters=[adapter])
    head = load_head(smollm2_path)
    prompt, n = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47], 8  # a short English sentence's tokens

    seqs = {None: list(prompt), adapter.fingerprint: list(prompt)}
    for a in seqs:
        r.allocate(a or "base", 0, 30, adapter=a)
    pos = 0
    for _ in range(n):
        items = [BatchItem(head.embed(torch.tensor([s[pos:]])), pos, r._sessions[a or "base"].pages_of, 0, 30, a)
                 for a, s in seqs.items()]
        outs = run_batch(r, items)
        pos = len(seqs[None])
        for (a, s), out in zip(seqs.items(), outs):
            s.append(int(head.logits(out[:, -1]).argmax()))

    def greedy_of(model):  # every token fed, end-of-text ones too (generate would stop there)
        from transformers import DynamicCache

        from petals_chain.swarm.checkpoint import cache_kwarg

        cache, out, x = DynamicCache(config=model.config), [], torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(n):
                out.append(int(model(x, use_cache=True, **{cache_kwarg(model): cache}).logits[0, -1].argmax()))
                x = torch.tensor([[out[-1]]])
        return out

    base = greedy_of(smollm2_reference)
    # merged in place, then the exact weights put back: the reference is the session's (test_real_model uses it)
    saved = {k: v.clone() for k, v in smollm2_reference.state_dict().items() if k.endswith(("q_proj.weight",
                                                                                             "v_proj.weight"))}
    try:
        merged = greedy_of(merge_into(smollm2_reference, path))
    finally:
        smollm2_reference.load_state_dict(saved, strict=False)
    assert seqs[None][len(prompt):] == base
    assert seqs[adapter.fingerprint][len(prompt):] == merged
    assert merged != base
