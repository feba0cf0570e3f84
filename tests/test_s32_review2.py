"""Review of the echoed prompts' ``text_offset`` (commit e3cf8bc) and of the API's invalid_json mapping (413a1b9):
a token-id prompt's echo (its decoding) whose tokens spell a special token's text, a BOS-adding tokenizer with a
prompt that starts with the BOS text, and a body whose number has more digits than Python reads."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from petals_chain.orchestrator.generation import Generation
from petals_chain.orchestrator.sampling import StopMatcher, TokenChoice, offsets_in_text
from test_s32_api import run_with_api


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def _scored(orch):
    """A stand-in for ``orch.generate_n`` that scores the prompt (every token -1) and generates nothing."""
    async def generate_n(ids, params, explicit=True, emits=None, *, prompt_logprobs=None, settle=True, scored=None):
        plp = [None] + [TokenChoice(t, -1.0, []) for t in ids[1:]]
        if scored is not None:
            await scored(plp)
        return [Generation(token_ids=[], text="", finish_reason="length", prompt_tokens=len(ids), wait_s=0.0,
                           service_s=0.0, chain=[], failovers=0, logprobs=[], prompt_logprobs=plp) for _ in params]

    orch.generate_n = generate_n


def test_a_token_id_prompts_echo_offsets_are_those_of_its_decoding(model_path):
    """A token-id prompt is echoed as its decoding (special tokens skipped). A special token followed by plain
    tokens that spell its text (``<|user|>`` then ``<``, ``|``, ``u``, ...) took the decoding's ``<|user|>`` for
    its own: every later offset was pushed past the end of the text (all equal to its length). Streamed too."""
    async def fn(orch, c):
        _scored(orch)
        tok = orch.tokenizer
        user = tok.convert_tokens_to_ids("<|user|>")
        spelled = tok("<|user|>hi", split_special_tokens=True, add_special_tokens=False)["input_ids"]
        ids = [user, *spelled]
        body = {"model": orch.model_id, "max_tokens": 0, "echo": True, "logprobs": 0}
        plain = await c.post("/v1/completions", json={**body, "prompt": [ids, ids[1:]]})
        assert plain.status_code == 200, plain.text
        streamed = []
        async with c.stream("POST", "/v1/completions", json={**body, "prompt": ids, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:]))
        return tok, ids, plain.json()["choices"], streamed[0]["choices"]

    tok, ids, choices, opened = run_with_api(model_path, fn, no_chain_wait_s=0.2)
    for choice, prompt in ((choices[0], ids), (choices[1], ids[1:]), (opened[0], ids)):
        text, lp = choice["text"], choice["logprobs"]
        assert text == tok.decode(prompt, skip_special_tokens=True) == "<|user|>hi"
        assert lp["text_offset"] == StopMatcher(tok, []).feed_offsets(prompt), lp["text_offset"]
        assert lp["text_offset"][-1] == len("<|user|>h")


def test_a_bos_adding_tokenizers_added_bos_takes_no_room_before_the_texts_own(model_path):
    """The tiny Llama's tokenizer adds ``<s>``: a prompt written as ``<s>hi`` is ``[<s>, <s>, h, i]``. The added
    one took the text's ``<s>`` (offsets 0, 3, 3, 4: the text's own ``<s>`` at 3, where ``hi`` is); now the added
    one takes no room (0, 0, 3, 4). A prompt without it is unchanged."""
    tok = AutoTokenizer.from_pretrained(str(model_path))
    bos = tok.bos_token_id
    for text, want in (("<s>hi", [0, 0, 3, 4]), ("<s><s>hi", [0, 0, 3, 6, 7]), ("hi<s>", [0, 0, 1, 2]),
                       ("<|user|>hi", [0, 0, 8, 9])):
        ids = tok(text)["input_ids"]
        assert ids[0] == bos and len(ids) == len(want), tok.convert_ids_to_tokens(ids)
        offsets = offsets_in_text(tok, ids, text)
        assert offsets == want, (text, offsets)
        for t, o in zip(ids[1:], offsets[1:]):  # each token's text is where its offset says (the added BOS aside)
            piece = tok.decode([t]) if t not in tok.all_special_ids else tok.convert_ids_to_tokens(t)
            assert text[o:o + len(piece)] == piece, (text, t, o)
    # ids without the tokenizer's own opening (add_special_tokens=False): the first <s> is the text's
    ids = tok("<s>hi", add_special_tokens=False)["input_ids"]
    assert ids[0] == bos and offsets_in_text(tok, ids, "<s>hi", special_added=False) == [0, 3, 4]


def test_a_number_past_pythons_digit_limit_is_not_called_invalid_json(model_path):
    """A JSON body with an integer of 5000 digits is valid JSON that Python's int() refuses (ValueError, not a
    JSONDecodeError): the 400 said "not valid JSON: Exceeds the limit (4300 digits) for integer string conversion
    ... use sys.set_int_max_str_digits() to increase the limit" (advice for the server's code, to the client)."""
    async def fn(orch, c):
        body = b'{"model": "m", "prompt": "x", "seed": ' + b"9" * 5000 + b"}"
        return await c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})

    r = run_with_api(model_path, fn, no_chain_wait_s=0.2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and "sys." not in err["message"] and "not valid JSON" not in err["message"]
    assert "digits" in err["message"], err
