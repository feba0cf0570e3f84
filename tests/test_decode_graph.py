"""The static-shape decode step (server/decode_graph.py, ``--decode-graph``).

The CUDA graph itself needs a GPU (``scripts/gpu_swarm_check.py --decode-graph cuda``); here its static-shape step
runs without capture (mode ``eager``), which is what a graph records: the same page writes, gathers and masks."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy_from

from petals_chain.server.decode_graph import check_decode_graph
from petals_chain.server.kv_cache import NO_PAGE
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

MAX_LENGTH = 64


@pytest.mark.parametrize("kv_cache, page_size, attn", [("paged", 4, "sdpa"), ("slots", 16, "sdpa"),
                                                        ("paged", 4, "eager")])
def test_static_steps_equal_the_eager_path(tiny_model_factory, kv_cache, page_size, attn):
    """Two sessions on different spans, taking turns (the tables in the buffer change), a rollback, and tables
    that are not one run of pages: every one-token step equals the eager path's up to rounding. With eager
    attention the mask is added to the scores (a boolean one attended to stale K/V: off by 1.8)."""
    path = tiny_model_factory("llama", num_layers=4)
    kw = dict(dtype="float32", batching=False, progress=False, kv_cache=kv_cache, page_size=page_size,
              attn_implementation=attn)
    eager = BlockRunner(str(path), 0, 4, 12, MAX_LENGTH, **kw)
    static = BlockRunner(str(path), 0, 4, 12, MAX_LENGTH, decode_graph="eager", **kw)
    torch.manual_seed(0)
    for r in (eager, static):
        r.allocate("gap", 0, 4, max_tokens=8)  # taken and freed below: later tables skip its pages
        r.allocate("x", 0, 4)
        r.release("gap")
        r.allocate("y", 1, 4)
    h = eager.hidden_size
    prompt = torch.randn(1, 9, h)
    pos = {"x": 9, "y": 5}
    for r in (eager, static):
        r.forward("x", prompt, 0)
        r.forward("y", prompt[:, :5], 0)
    worst, steps = 0.0, 0
    for step in range(40):
        sid = "y" if step % 3 == 0 else "x"
        if step == 25:
            pos["x"] -= 6  # roll back and overwrite
        x = torch.randn(1, 1, h)
        a, b = eager.forward(sid, x, pos[sid]), static.forward(sid, x, pos[sid])
        assert a.shape == b.shape == (1, 1, h)
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
        pos[sid] += 1
        steps += 1
    assert worst < 1e-5
    assert static.static_decode.stats()["steps"] == steps
    # multi-token steps keep the eager path
    more = torch.randn(1, 3, h)
    assert torch.allclose(eager.forward("x", more, pos["x"]), static.forward("x", more, pos["x"]), atol=1e-5)
    assert static.static_decode.stats()["steps"] == steps


def test_tables_the_static_step_cannot_take_go_to_the_eager_path(tiny_model_factory):
    """A page not taken yet (NO_PAGE) or a table longer than max_length's pages: run() declines (None), so the
    runner computes that step eagerly; on a GPU an out-of-range page index would be a fatal device error."""
    path = tiny_model_factory("llama", num_layers=4)
    r = BlockRunner(str(path), 0, 4, 4, MAX_LENGTH, dtype="float32", batching=False, progress=False, page_size=16,
                    decode_graph="eager")
    sd, x = r.static_decode, torch.zeros(1, 1, r.hidden_size)
    assert sd.run(x, 0, {0: [NO_PAGE, 3]}, 0, 1) is None
    assert sd.run(x, 0, {0: list(range(sd.pages + 1))}, 0, 1) is None
    assert sd.run(x, 0, {0: [1, 2]}, 0, 1) is not None and sd.steps == 1


def test_modes_are_checked():
    check_decode_graph("off", "cpu")
    check_decode_graph("eager", "cpu")
    with pytest.raises(ValueError, match="needs --device cuda"):
        check_decode_graph("cuda", "cpu")
    with pytest.raises(ValueError, match="unquantized"):
        check_decode_graph("eager", "cpu", quant="int8")
    with pytest.raises(ValueError, match="one of off, cuda, eager"):
        check_decode_graph("graph", "cpu")


def test_server_refuses_cuda_graphs_without_a_gpu(tiny_model_factory, capsys):
    from petals_chain.server.__main__ import main  # (in this process: a `python -m` start imports torch, ~6 s)

    path = tiny_model_factory("llama", num_layers=4)
    assert main(["--model", str(path), "--device", "cpu", "--decode-graph", "cuda"]) == 2
    assert "--decode-graph cuda needs --device cuda" in capsys.readouterr().err


@pytest.mark.slow
def test_swarm_with_static_decode_steps_equals_transformers(tiny_model_factory, tmp_path):
    """Two servers with ``--decode-graph eager`` (one paged by 4 tokens, one with slots): greedy output through the
    chain equals transformers' generate."""
    from transformers import AutoTokenizer

    path = tiny_model_factory("llama", num_layers=6)
    mem = memory_for(path, MAX_LENGTH * 2, 4, 2)
    servers = [LocalServer("x", mem, tau_p=0.001, extra_args=["--decode-graph", "eager", "--page-size", "4"]),
               LocalServer("y", mem, tau_p=0.001, extra_args=["--decode-graph", "eager", "--kv-cache", "slots"])]
    tok = AutoTokenizer.from_pretrained(str(path))
    with LocalSwarm(path, servers, max_length=MAX_LENGTH * 2, arrival_rate=1.0, log_dir=tmp_path) as sw:
        st = sw.wait_ready(timeout=150)
        assert all(len(ch["servers"]) == 2 for ch in st["chains"])
        client = sw.client()
        for prompt in ["The quick brown fox", "What is two plus two?"]:
            want = hf_greedy_from(path, tok(prompt)["input_ids"], 20)
            assert client.complete(prompt, max_tokens=20).token_ids == want, prompt
    assert sw.leftover_processes() == []
    for name in ("x", "y"):
        assert "decode steps run with static shapes" in (tmp_path / f"server-{name}.log").read_text(), name
