"""The real model end to end: SmolLM2-135M-Instruct (GGUF) served by a swarm of real processes on loopback.

Six servers, each able to hold only 10 of the 30 blocks, form two 3-hop chains. Greedy output must equal
``transformers`` on the same dequantized model (tests/conftest.py: ``smollm2_reference``) token for token,
for chat prompts sent one by one and concurrently (batched at the servers and at the LM head), and when a
server is killed mid-generation. The official ``openai`` package drives the API: logprobs, seeds, streaming
with usage, ``n > 1`` sharing one prefill, structured outputs (``chat.completions.parse`` with a pydantic model), and
a 400 for every parameter we do not implement.
The tests run in file order and share one swarm; the last one kills a server.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from typing import Literal

import httpx
import pydantic
import pytest
import torch

from conftest import kill_hop_during
from petals_chain.client import ClientError
from petals_chain.swarm.checkpoint import cache_kwarg
from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory

pytestmark = pytest.mark.slow

MAX_LENGTH = 512
NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "What is 12 plus 30?",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from petals_chain.swarm.sources import resolve_source

    return resolve_source("smollm2-135m").load_tokenizer()


def chat_ids(tokenizer, question: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(getattr(out, "input_ids", out))


def reference(model, tokenizer, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation (stops after the end-of-turn token, like the swarm)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def reference_no_stop(model, ids: list[int], n: int) -> list[int]:
    """Greedy for exactly ``n`` tokens, feeding end-of-turn tokens like any other (the API's ignore_eos)."""
    from transformers import DynamicCache

    cache, out, x = DynamicCache(config=model.config), [], torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(x, use_cache=True, **{cache_kwarg(model): cache}).logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]])
    return out


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory):
    L, s_m, s_c = model_memory("smollm2-135m", MAX_LENGTH)
    assert L == 30
    # --max-blocks 10: no server may hold more than a third of the model; the memory left holds KV slots.
    # tau_p pinned: which plan is best depends on the servers' speed (measured at start on a busy machine, a
    # slow profile makes one long chain of large capacity the better plan); 0.1 s per block per job is in the
    # range where two 3-hop chains are (0.05 to 0.3 s, with the loopback's communication times).
    mem = 10 * s_m + 160 * s_c
    servers = [LocalServer(f"s{i}", mem, emulate_rtt_ms=1 + i % 3, tau_p=0.1, extra_args=["--max-blocks", "10"])
               for i in range(6)]
    sw = LocalSwarm("smollm2-135m", servers, max_length=MAX_LENGTH, arrival_rate=2.0,
                    log_dir=tmp_path_factory.mktemp("real-swarm"),
                    # a draft model for requests that ask for it: the served model's first 24 of 30 layers
                    orchestrator_args=["--replan-interval-s", "3600", "--draft-model", "self", "--draft-layers", "24"])
    sw.start()
    try:
        sw.wait_ready(timeout=400)
        # Servers joining in waves are planned as they come (a later wave forms a chain of its own): wait for
        # the plan over all six rather than sample the first one.
        st = sw.wait_until(lambda st: len(st["chains"]) == 2 and all(len(ch["servers"]) == 3 for ch in st["chains"])
                           and all(s["state"] == "online" for s in st["servers"]), 300, "two 3-hop chains")
        assert len(st["chains"]) == 2, st["chains"]
        yield sw
    finally:
        sw.stop()
        assert sw.leftover_processes() == []


@pytest.fixture(scope="module")
def expected(smollm2_reference, tokenizer):
    return {q: reference(smollm2_reference, tokenizer, chat_ids(tokenizer, q)) for q in QUESTIONS}


def test_greedy_chat_equals_transformers(swarm, expected, tokenizer):
    client = swarm.client()
    for q in QUESTIONS[:5]:
        c = client.chat_completion([{"role": "user", "content": q}], max_tokens=NEW_TOKENS)
        assert c.token_ids == expected[q], (q, tokenizer.decode(c.token_ids), tokenizer.decode(expected[q]))
        assert len(c.chain) == 3
    # Client.chat's text: the greedy answer's tokens up to the one that writes "Paris" (not all 48 again)
    greedy = expected[QUESTIONS[0]]
    n = next(i for i in range(1, len(greedy) + 1) if "Paris" in tokenizer.decode(greedy[:i], skip_special_tokens=True))
    paris = client.chat([{"role": "user", "content": QUESTIONS[0]}], max_tokens=n)
    assert "Paris" in paris and paris == tokenizer.decode(greedy[:n], skip_special_tokens=True), (paris, n)
    before = swarm.swarm()["relay"]["passes"]["push"]
    q = QUESTIONS[1]  # servers pushing to each other (--relay push): the same tokens
    c = client.chat_completion([{"role": "user", "content": q}], max_tokens=NEW_TOKENS, relay="push")
    assert c.token_ids == expected[q], (q, tokenizer.decode(c.token_ids), tokenizer.decode(expected[q]))
    assert swarm.swarm()["relay"]["passes"]["push"] - before >= 10


def test_speculative_greedy_equals_transformers(swarm, smollm2_reference, tokenizer):
    """Prompt-lookup drafts and a draft model's, verified by the real chain (some kept, some rolled back), relayed
    by the orchestrator or pushed from server to server, change no token."""
    before = swarm.swarm()["relay"]["speculative"]
    client = swarm.client()
    text = ("The old lighthouse stands on the cliff above the bay. Every night its lamp turns slowly, and the "
            "ships that pass far out at sea see its light and know where the rocks are.")
    ids = chat_ids(tokenizer, f"Repeat this text word for word:\n\n{text}")
    want = reference(smollm2_reference, tokenizer, ids, 64)
    # (ngram through the orchestrator relay: tests/test_speculative_swarm.py and bench_latency.py's identity check)
    for mode, relay in (("ngram", "push"), ("draft", "orchestrator"), ("draft", "push")):
        c = client.chat_completion([{"role": "user", "content": f"Repeat this text word for word:\n\n{text}"}],
                                   max_tokens=64, speculative=mode, relay=relay)
        assert c.token_ids == want, (mode, relay, tokenizer.decode(c.token_ids), tokenizer.decode(want))
        after = swarm.swarm()["relay"]["speculative"]
        drafted = after["drafted_tokens"] - before["drafted_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        assert 0 < accepted < drafted, (mode, relay, after)  # drafts kept (several tokens a step) and rolled back
        before = after
    assert after["draft_model"] == {"name": "self", "layers": 24}


def test_concurrent_batched_sessions_are_token_exact(swarm, expected):
    """All six at once (twice each): steps of different sessions share forwards and LM-head batches."""
    client = swarm.client()
    jobs = QUESTIONS * 2
    # max_active counts per chain at its current capacity: a re-plan on a loaded host (a record late, then
    # back) starts it afresh, so the most jobs seen at once on one chain while the jobs run counts too.
    seen_active, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen_active[0] = max([seen_active[0]] + [ch["active"] for ch in swarm.swarm()["chains"]])
            done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda q: client.chat_completion([{"role": "user", "content": q}],
                                                                     max_tokens=NEW_TOKENS), jobs))
    finally:
        done.set()
        watcher.join()
    for q, c in zip(jobs, results):
        assert c.token_ids == expected[q], q
    st = swarm.swarm()
    assert st["relay"]["lm_head_rows"] > st["relay"]["lm_head_batches"]  # some LM-head calls were shared
    assert max([seen_active[0]] + [ch["max_active"] for ch in st["chains"]]) >= 2, (st["epoch"], st["chains"])


def test_openai_package_logprobs_seed_stream_n(swarm, expected, tokenizer):
    from openai import OpenAI

    api = OpenAI(base_url=f"{swarm.url}/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    r = api.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    # the text's tokens: a stop token (counted as generated) is not in the text, so not in its logprobs
    eos = r.choices[0].finish_reason == "stop"
    assert len(content) == r.usage.completion_tokens - eos and len(content) > 0
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.token == e.top_logprobs[0].token  # greedy: the chosen token is the most likely one
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content[:10])

    # seed: the same seed gives the same text whatever else runs at the same time
    def sampled(seed: int) -> str:
        return api.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content":
                                           "Tell me a short story about a cat."}], max_tokens=24, temperature=1.0,
                                           top_p=0.95, seed=seed).choices[0].message.content

    alone = sampled(7)
    with ThreadPoolExecutor(6) as pool:
        loaded = list(pool.map(sampled, [7, 8, 7, 9, 7, 10]))
    assert loaded[0] == loaded[2] == loaded[4] == alone
    assert len({alone, loaded[1], loaded[3], loaded[5]}) > 1

    # streaming with usage: pieces concatenate to the greedy answer, usage comes last
    stream = api.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=NEW_TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            pieces.append(ch.delta.content or "")
    greedy = expected[QUESTIONS[0]]
    assert "".join(pieces) == tokenizer.decode(greedy, skip_special_tokens=True)
    assert usage is not None and usage.completion_tokens == len(greedy)
    assert usage.prompt_tokens == len(chat_ids(tokenizer, QUESTIONS[0]))

    # n = 3 shares one prefill (the siblings fork its KV on the same chain)
    forks_before = swarm.swarm()["relay"]["forks"]
    r = api.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=16, temperature=0.9, seed=3, n=3)
    assert len(r.choices) == 3 and {c.index for c in r.choices} == {0, 1, 2}
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, QUESTIONS[0]))
    assert swarm.swarm()["relay"]["forks"] > forks_before
    greedy3 = api.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=NEW_TOKENS, temperature=0,
                                          n=3)
    ref_text = tokenizer.decode(greedy, skip_special_tokens=True)
    assert [c.message.content for c in greedy3.choices] == [ref_text] * 3


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    capital: bool
    size: Literal["small", "medium", "large"]


def test_chat_completions_parse_returns_a_validated_object(swarm):
    """Structured outputs on the real model: the openai package's ``chat.completions.parse`` with a pydantic model,
    greedy and seeded, streamed and not, returns a parsed object that validates (before: a 400, "response_format
    'json_schema' is not supported"). A 135M model does not write valid JSON for a schema on its own; the grammar
    makes it."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{swarm.url}/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Tell me about Paris."}]

    def parsed(kw: dict):
        return api.chat.completions.parse(model="smollm2-135m", messages=msgs, response_format=City,
                                          max_completion_tokens=80, **kw).choices[0]

    def streamed(kw: dict):
        with api.chat.completions.stream(model="smollm2-135m", messages=msgs, response_format=City,
                                         max_completion_tokens=80, **kw) as stream:
            return stream.get_final_completion().choices[0]

    kws = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 3}}
    with ThreadPoolExecutor(4) as pool:  # at once: they share the chains' steps (a seeded one is still reproducible)
        jobs = {name: (pool.submit(parsed, kw), pool.submit(streamed, kw)) for name, kw in kws.items()}
        out = {name: (a.result(), b.result()) for name, (a, b) in jobs.items()}
    for name, (plain, streamed) in out.items():
        assert plain.finish_reason == "stop" and isinstance(plain.message.parsed, City), (name, plain)
        City.model_validate_json(plain.message.content)
        assert streamed.message.parsed == plain.message.parsed, name  # greedy and seeded: reproducible
    assert out["greedy"][0].message.parsed.name.strip() != ""


def test_tool_choice_required_returns_a_call_whose_arguments_validate(swarm):
    """Tool calling on the real model (orchestrator/tools.py): ``tool_choice: "required"`` through the openai
    package returns a ``get_weather`` call whose arguments validate against the tool's schema, finish "tool_calls"
    (before: a 400, "tools is not supported"). The tools are described in SmolLM2's system message (its template
    takes none); the grammar makes the call."""
    import jsonschema
    from openai import OpenAI

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast",
                                               "parameters": schema, "strict": True}}]
    api = OpenAI(base_url=f"{swarm.url}/v1", api_key="none", max_retries=0, timeout=120)
    r = api.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                    tools=tools, tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_completion_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "custom", "custom": {"name": "f"}}]}, {"tool_choice": "auto"},
    {"response_format": {"type": "yaml"}}, {"audio": {"voice": "alloy", "format": "wav"}},
    {"modalities": ["text", "audio"]}, {"functions": [{"name": "f"}]}, {"store": True},
    {"reasoning_effort": "high"}, {"prediction": {"type": "content", "content": "x"}},
    {"no_such_field": 1}, {"service_tier": "flex"},
])
def test_unsupported_parameters_are_400_naming_them(swarm, extra):
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(f"{swarm.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert list(extra)[0] in r.json()["error"]["message"]


def test_completions_logprobs_echo_and_defaults(swarm, tokenizer, smollm2_reference):
    prompt = "The capital of France is"
    ids = tokenizer(prompt)["input_ids"]
    r = httpx.post(f"{swarm.url}/v1/completions", json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0, "logprobs": 2, "echo": True}, timeout=60)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4 and lp["token_logprobs"][0] is None
    assert ch["text"].startswith(prompt)
    # prompt logprobs equal the reference model's log-softmax at each position
    with torch.no_grad():
        ref = torch.log_softmax(smollm2_reference(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
        assert len(lp["top_logprobs"][i]) == 2
    # streamed, it opens with the prompt and its logprobs, and the chunks add up to the same text and entries
    events = []
    with httpx.stream("POST", f"{swarm.url}/v1/completions", timeout=60, json={
            "model": "smollm2-135m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "echo": True, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    first = events[0]["choices"][0]
    assert first["text"] == prompt and len(first["logprobs"]["tokens"]) == len(ids)  # the prompt as sent
    parts = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    assert "".join(e["choices"][0]["text"] for e in events) == ch["text"]
    got = {f: [v for part in parts for v in part["logprobs"][f]] for f in ("tokens", "token_logprobs", "text_offset")}
    assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
    assert got["token_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-3)
    # a chat request without max_tokens runs to its end of turn (not 16 tokens)
    c = swarm.client().chat_completion([{"role": "user", "content": "Describe a cat in three sentences."}])
    assert c.finish_reason == "stop" and len(c.token_ids) > 16


def test_prompt_scoring_as_evaluation_harnesses_ask_for_it(swarm, tokenizer, smollm2_reference):
    """lm-evaluation-harness's loglikelihood request: token-id prompts, ``echo``, ``logprobs``, ``max_tokens: 0``.
    Every prompt token after the first is scored as transformers scores it; tokens that are only part of a
    character (CJK, emoji: byte-level BPE splits them) show as OpenAI's ``bytes:\\xNN`` and start where their
    character does; a chat reply's logprob ``bytes`` make up its text."""
    prompts = [tokenizer("The capital of France is Paris")["input_ids"],
               tokenizer("漢字の読み方 🦜 is a question")["input_ids"]]
    r = httpx.post(f"{swarm.url}/v1/completions", json={"model": "smollm2-135m", "prompt": prompts, "max_tokens": 0,
                                                         "echo": True, "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 0
    for ids, ch in zip(prompts, body["choices"]):
        lp, text = ch["logprobs"], ch["text"]
        assert text == tokenizer.decode(ids) and ch["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        with torch.no_grad():
            ref = torch.log_softmax(smollm2_reference(torch.tensor([ids])).logits[0].float(), -1)
        for i in range(1, len(ids)):
            assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
        for tok, off in zip(lp["tokens"], lp["text_offset"]):
            if not tok.startswith("bytes:"):
                assert text[off:off + len(tok)] == tok
    cjk = body["choices"][1]["logprobs"]
    assert [t for t in cjk["tokens"] if t.startswith("bytes:")]
    assert cjk["text_offset"] == sorted(cjk["text_offset"])
    c = httpx.post(f"{swarm.url}/v1/chat/completions", json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": "Write 漢字 and a parrot emoji."}],
        "max_tokens": 12, "temperature": 0, "logprobs": True}, timeout=60).json()["choices"][0]
    raw = bytes(b for e in c["logprobs"]["content"] for b in e["bytes"])
    assert raw.decode("utf-8", errors="replace") == c["message"]["content"]


def test_transformers_style_client_equals_transformers(swarm, smollm2_reference, tokenizer):
    """PETALS-style code (one import changed) gets transformers' token ids, left-padded batches included."""
    from petals_chain.client import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", url=swarm.url)
    tok = __import__("copy").copy(tokenizer)
    tok.padding_side = "left"
    batch = tok(["The capital of France is", "Water boils at"], return_tensors="pt", padding=True)
    got = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=12,
                         pad_token_id=tok.pad_token_id)
    # each row as transformers continues it alone; the output keeps the input's padding, like transformers
    for row, mask, out in zip(batch["input_ids"], batch["attention_mask"], got):
        ids = row[mask.bool()].tolist()
        new = reference(smollm2_reference, tokenizer, ids, n=12)
        assert out.tolist()[:len(row) + len(new)] == row.tolist() + new
        assert all(t == tok.pad_token_id for t in out.tolist()[len(row) + len(new):])


def test_session_chat_is_token_exact_and_survives_an_aborted_turn(swarm, smollm2_reference, tokenizer):
    """A session's tokens equal the whole conversation templated at once; an aborted turn changes nothing."""
    client = swarm.client()
    with client.session() as s:
        first = s.chat("Hi! My name is Ada.", max_tokens=NEW_TOKENS)
        convo = [{"role": "user", "content": "Hi! My name is Ada."}, {"role": "assistant", "content": first.text},
                 {"role": "user", "content": "What is my name?"}]
        ids = list(getattr(out := tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=True),
                           "input_ids", out))
        # abort a turn mid-generation: the client gives up after a moment
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{swarm.url}/api/v1/sessions/{s.id}/generate",
                       json={"messages": [{"role": "user", "content": "Tell me a very long story."}],
                             "max_tokens": 400, "ignore_eos": True}, timeout=0.5)
        # the aborted turn may still hold the session for a moment (the orchestrator notices the disconnect within
        # about a second, later on a loaded host, and the request may even start after the client left): 409 until
        # it is cancelled
        deadline = time.monotonic() + 60
        while True:
            try:
                second = s.chat("What is my name?", max_tokens=NEW_TOKENS)
                break
            except ClientError as e:
                if e.status != 409 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        info = httpx.get(f"{swarm.url}/api/v1/sessions/{s.id}").json()
        # the aborted turn left nothing behind (else the orchestrator's log says what it saw of the disconnect)
        assert info["turns"] == 2, (info, swarm.log_tail("orchestrator", 60))
        assert second.token_ids == reference(smollm2_reference, tokenizer, ids)
        assert second.failovers == 0  # the aborted turn released its chain; no server was blamed


def test_embeddings_through_three_hops_equal_transformers(swarm, smollm2_reference, tokenizer):
    """``/v1/embeddings`` through a 3-hop chain (tests/test_s37_embeddings*.py: the rest): the last hop's hidden state
    at the last token, through the final norm at the orchestrator and L2-normalized (vLLM's pooling of a decoder LM),
    is transformers' pooled the same way; the openai package's default base64 reads the same floats."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{swarm.url}/v1", api_key="none", max_retries=0)
    texts = ["What is the capital of France?", "Paris is the capital of France."]
    b64 = api.embeddings.create(model="smollm2-135m", input=texts)
    floats = api.embeddings.create(model="smollm2-135m", input=texts, encoding_format="float")
    assert [d.embedding for d in b64.data] == [d.embedding for d in floats.data]
    assert b64.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    for text, d in zip(texts, floats.data):
        with torch.no_grad():
            h = smollm2_reference.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(h.float(), dim=-1)
        got = torch.tensor(d.embedding)
        assert got.shape == want.shape and float(got @ want) > 0.9999 and torch.allclose(got, want, atol=2e-3)


def test_server_killed_mid_generation_keeps_output(swarm, smollm2_reference, tokenizer):
    """The middle hop killed while servers push to each other (--relay push; the orchestrator relay's failover is
    covered with tiny models): another server takes its blocks over, and no token changes."""
    ids = chat_ids(tokenizer, "Write a long story about a dragon.")
    want = reference_no_stop(smollm2_reference, ids, 160)
    client = swarm.client()
    comp, chain = kill_hop_during(swarm, lambda: client.complete(ids, max_tokens=160, temperature=0, ignore_eos=True,
                                                                 relay="push"),
                                  1, find_s=60, settle_s=0.0, join_s=300)  # the middle hop
    victim = chain["names"][1]
    assert comp.token_ids == want
    assert comp.failovers >= 1  # 160 tokens through three hops outlast the poll that found the chain
    assert victim not in [n for ch in swarm.swarm()["chains"] for n in ch["names"]]
