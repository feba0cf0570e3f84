"""The OpenAI-compatible API as an OpenAI client sees it: field types, error shapes, refusals before any work
(an in-process orchestrator without servers)."""

from __future__ import annotations

import pytest

from test_api import run_with_api


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def test_booleans_and_numbers_are_not_each_other(model_path):
    """OpenAI refuses a boolean for a number and anything but a boolean for a boolean; lax parsing read
    completions' ``logprobs: true`` as 1 alternative, ``echo: "yes"`` as true, chat's ``logprobs: 1`` as true and
    ``n: true`` as 1. A multi-prompt stream is refused before its prompts are tokenized (it was after). An image
    content part was "unsupported parameter(s): messages.0.content.list[ContentPart].0.image_url"."""
    async def fn(orch, c):
        encoded = []
        encode = orch.encode
        orch.encode = lambda text, **kw: encoded.append(text) or encode(text, **kw)
        msgs = [{"role": "user", "content": "hi"}]
        cases = [("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "number"),
                 ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo", "true or false"),
                 ("/v1/completions", {"prompt": "x", "echo": 1}, "echo", "true or false"),
                 ("/v1/completions", {"prompt": "x", "n": True}, "n", "number"),
                 ("/v1/completions", {"prompt": "x", "temperature": False}, "temperature", "number"),
                 ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
                  "stream_options.include_usage", "true or false"),
                 ("/v1/chat/completions", {"messages": msgs, "logprobs": 1}, "logprobs", "true or false"),
                 ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": True},
                  "top_logprobs", "number"),
                 ("/v1/chat/completions", {"messages": msgs, "max_completion_tokens": True}, "max_completion_tokens",
                  "number")]
        for path, body, param, kind in cases:
            r = await c.post(path, json={"model": orch.model_id, **body})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, r.text)
            assert param.split(".")[-1] in err["message"] and kind in err["message"], r.text
        assert encoded == []
        r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": ["a", "b"], "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and encoded == []
        # an image part (a multimodal client) is refused as one, named by the body's own path
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        for messages, param in ((image, "messages.0.content.0"), ([{"role": "assistant", "content": None}],
                                                                   "messages.0.content")):
            r = await c.post("/v1/chat/completions", json={"model": orch.model_id, "messages": messages})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, r.text
            assert "list[" not in err["message"] and ".str" not in err["message"], r.text
        r = await c.post("/v1/chat/completions", json={"model": orch.model_id, "messages": image})
        assert 'only text content parts are supported, not "image_url"' in r.json()["error"]["message"], r.text
        # what stays accepted: JSON's numbers for numbers, booleans for booleans, null for a default
        r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": "x", "max_tokens": 0,
                                                  "echo": True, "logprobs": None, "temperature": 1, "n": None})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x", r.text

    run_with_api(model_path, fn)
