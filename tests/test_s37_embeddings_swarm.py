"""``/v1/embeddings``, ``/tokenize`` and ``/detokenize`` through a real swarm on loopback (an orchestrator with API
keys and a server process, the tiny Llama): each embedding equals transformers' forward of the same weights, pooled as
vLLM pools a decoder LM (the final norm's output at the last token, L2-normalized); the openai package's
``embeddings.create`` reads both encodings; the chain holds nothing once the answer is out. SmolLM2 through a 3-hop
chain: test_real_model.py (its shared swarm); routing by ``model`` and the API's refusals: test_s37_embeddings.py."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

KEY = "bob-secret-0123456789ab"
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def swarm(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"bob {KEY}\n")
    keys.chmod(0o600)
    with LocalSwarm(tiny_model_dir, [LocalServer("t0", memory_for(tiny_model_dir, MAX_LENGTH, 4, 8), tau_p=0.001)],
                    max_length=MAX_LENGTH, log_dir=tmp_path_factory.mktemp("logs"),
                    orchestrator_args=["--api-keys", str(keys)]) as sw:
        sw.wait_ready(timeout=300)
        yield sw


def post(sw, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{sw.url}{path}", json=body, headers=headers, timeout=300)


def pooled(model, ids: list[int]) -> np.ndarray:
    """transformers' embedding of ``ids`` as vLLM pools it: the last hidden state (after the final norm) of the last
    token, L2-normalized."""
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(h, dim=-1).numpy()


def test_embeddings_equal_transformers_in_every_input_shape_and_encoding(swarm, tiny_model_dir):
    """Texts, token ids and lists of them, through the chain, asked with httpx and with the openai package (its
    default base64, and floats): each input's embedding is transformers' pooled last hidden state. The inputs of one
    request ran as concurrent jobs on the chain (its peak of jobs at once); once the answer is out no job holds the
    chain (a job's lease goes back only once its server sessions are closed)."""
    from petals_chain.swarm.sources import resolve_source

    hf = resolve_source(tiny_model_dir).load_reference(torch.float32)
    tok = resolve_source(tiny_model_dir).load_tokenizer()
    model = swarm.swarm()["model"]
    texts = ["the quick brown fox", "hello", "a somewhat longer sentence about nothing in particular"]
    lists = [[5, 6, 7, 8], [9], list(range(20, 20 + MAX_LENGTH))]  # the last fills the whole context
    r_lists = post(swarm, "/v1/embeddings", {"model": model, "input": lists})
    assert r_lists.status_code == 200, r_lists.text
    client = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key=KEY, max_retries=0)
    b64 = client.embeddings.create(model=model, input=texts)
    floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
    one = client.embeddings.create(model=model, input=[5, 6, 7, 8], encoding_format="float")
    ids = [tok(t)["input_ids"] for t in texts]
    assert b64.usage.prompt_tokens == floats.usage.prompt_tokens == sum(map(len, ids))
    assert [d.embedding for d in b64.data] == [d.embedding for d in floats.data]
    assert one.data[0].embedding == r_lists.json()["data"][0]["embedding"]
    got = [d.embedding for d in b64.data] + [d["embedding"] for d in r_lists.json()["data"]]
    for want, vector in zip(ids + lists, got):
        assert np.allclose(vector, pooled(hf, want), atol=1e-4), want
    state = swarm.wait_until(lambda st: all(ch["active"] == 0 for ch in st["chains"]), 60, "the chain released")
    assert state["running"] == 0 and max(ch["max_active"] for ch in state["chains"]) >= 3
    assert state["measured"]["completed"] == 10  # one job per input


def test_tokenize_detokenize_and_keys(swarm, tiny_model_dir):
    """``/tokenize`` is the model's tokenizer (and chat template: the tokens a chat completion is fed, which its
    usage counts), ``/detokenize`` its decoding; without a key every one of them is a 401."""
    from petals_chain.swarm.sources import resolve_source

    tok = resolve_source(tiny_model_dir).load_tokenizer()
    model = swarm.swarm()["model"]
    msgs = [{"role": "user", "content": "Hi!"}]
    text = post(swarm, "/tokenize", {"model": model, "prompt": "Hello there"}).json()
    chat = post(swarm, "/tokenize", {"messages": msgs}).json()
    back = post(swarm, "/detokenize", {"tokens": chat["tokens"]}).json()
    assert text == {"count": len(tok("Hello there")["input_ids"]), "tokens": tok("Hello there")["input_ids"],
                    "max_model_len": MAX_LENGTH, "token_strs": None}
    completion = post(swarm, "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 1})
    assert completion.status_code == 200 and chat["count"] == completion.json()["usage"]["prompt_tokens"]
    assert back["prompt"] == tok.decode(chat["tokens"]) and "Hi!" in back["prompt"]
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}),
                       ("/v1/embeddings", {"model": model, "input": "x"})):
        assert post(swarm, path, body, key=None).status_code == 401, path
