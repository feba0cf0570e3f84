"""What logprobs and the returned text show at their edges.

* A stop string cuts the text, but the tokens whose text lies past the cut were still listed in ``logprobs``
  (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset`` at or past the text's end; chat's
  ``logprobs.content``), streamed and not: SmolLM2's " Paris." with ``stop: ["."]`` was the text " Paris" and the
  tokens [" Paris", "."]. Now a token is listed only when its text starts before the cut (one the cut goes through
  stays), streamed and non-streamed alike, and ``usage.completion_tokens`` still counts every generated token.
* A token-id prompt whose last ids are the first bytes of a character: the completion lost that character (the
  prompt's U+FFFD took its place in the incremental decoder): SmolLM2 continued ``[..., "Ġæ"]`` with 汽车 and the
  answer was 车. Now the completion shows it whole, and ``whole_text(prompt) + completion`` is the decoding of both.
* ``max_tokens`` reached inside a character: flushed as U+FFFD (the decoding of the generated tokens), streamed
  and not, the partial token's offset at that U+FFFD.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from petals_chain.orchestrator.generation import Generation, GenerationMixin
from petals_chain.orchestrator.sampling import SamplingParams, StopMatcher, TokenChoice
from petals_chain.orchestrator.tokentext import _byte_level_decoder
from test_token_text import _sentencepiece, _slow_offsets

CHINESE = "Chinese: 漢字の読み方 🦜 means 汽车, ok"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from petals_chain.swarm.sources import resolve_source

    return resolve_source("smollm2-135m").load_tokenizer()


def _decode(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=True)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _byte_token(tok, b: int) -> int:
    """SmolLM2's token for the single byte ``b`` (byte-level BPE: one vocabulary piece per byte)."""
    char = {v: k for k, v in _byte_level_decoder().items()}[b]
    return tok.convert_tokens_to_ids(char)


async def decode_loop(tokenizer, context, script, params, emit=None):
    """``GenerationMixin._decode_loop`` over scripted tokens (logprob of token i: -(i + 1) / 10)."""
    it = iter(enumerate(script))

    class Batcher:
        async def sample(self, hidden, seq):
            i, t = next(it)
            return TokenChoice(t, -(i + 1) / 10, [(t, -(i + 1) / 10)]), None

    async def feed(*args, **kwargs):
        return None

    orch = SimpleNamespace(tokenizer=tokenizer, _eos=set(), cfg=SimpleNamespace(speculative="none", speculative_k=0),
                           batcher=Batcher(), stats=SimpleNamespace(relay_steps=0))
    holder = SimpleNamespace(max_length=4096, charge_output=lambda: None, feed=feed, steps=0)
    return await GenerationMixin._decode_loop(orch, holder, list(context), None, params, emit)


def run_loop(tokenizer, context, script, params, stream=True):
    """:func:`decode_loop`'s tokens, text, finish reason and listed choices, and what a stream was sent (the text
    and the tokens of each emit)."""
    sent: list[tuple[str, list[TokenChoice]]] = []

    async def emit(text, choices):
        sent.append((text, list(choices)))

    out = asyncio.run(decode_loop(tokenizer, context, script, params, emit if stream else None))
    return (*out, sent)


# ---- 1. stop strings ---------------------------------------------------------------------------------------------

ANSWER = " Paris.\n\nThe answer is: 201"  # SmolLM2's greedy continuation of "The capital of France is"


@pytest.mark.parametrize("text,stop,want_text,want_listed", [
    (ANSWER, ".", " Paris", 1),  # the stop is a token of its own: not listed
    (ANSWER, " Paris", "", 0),  # the text is empty: nothing listed
    (ANSWER, "ari", " P", 1),  # the cut goes through " Paris": listed (the text it starts is in the answer)
    (ANSWER, "answer is", " Paris.\n\nThe ", None),  # spans tokens
    # a held prefix that failed, then the stop starts inside it: the stream had sent the tokens of "aa" with the first
    # "a" ("|": where tokens are apart)
    ("a|a|a|b then", "aab", "a", 1),
])
def test_a_stop_string_lists_only_the_tokens_the_text_shows(tok, text, stop, want_text, want_listed):
    script = [t for part in text.split("|") for t in _ids(tok, part)]
    context = _ids(tok, "The capital of France is")
    params = SamplingParams(max_tokens=len(script), temperature=0.0, stop=[stop], logprobs=1)
    tokens, got, finish, listed, sent = run_loop(tok, context, script, params)
    assert got == want_text and finish == "stop"
    offsets = StopMatcher(tok, [], context).feed_offsets([c.token for c in listed])
    assert all(o < len(got) for o in offsets), (offsets, got)  # every listed token starts inside the text
    if want_listed is not None:
        assert len(listed) == want_listed
    # the listed tokens are the first ones generated, their own logprobs, and they spell the text (or run past it
    # only inside the token the cut goes through)
    assert [c.token for c in listed] == tokens[:len(listed)]
    assert [c.logprob for c in listed] == [-(i + 1) / 10 for i in range(len(listed))]
    spelled = _decode(tok, context + [c.token for c in listed])[len(_decode(tok, context)):]
    assert spelled.startswith(got)
    assert len(tokens) >= len(listed)  # usage counts every generated token
    # the stream: the same text, and the same tokens
    assert "".join(t for t, _ in sent) == got
    assert [c for _, cs in sent for c in cs] == listed
    # non-streamed: the same
    assert run_loop(tok, context, script, params, stream=False)[1:4] == (got, finish, listed)


def test_a_stop_string_found_at_the_flush_lists_none_of_its_tokens(tok):
    """The last token ends the stop string "x " and starts a character (SmolLM2's "Ġæ": a space and 漢's first
    byte): the flush finds the stop; its tokens were listed, at offsets past the text (empty)."""
    script = [tok.convert_tokens_to_ids("x"), tok.convert_tokens_to_ids("Ġæ")]
    params = SamplingParams(max_tokens=2, temperature=0.0, stop=["x "], logprobs=0)
    tokens, text, finish, listed, sent = run_loop(tok, [], script, params)
    assert (tokens, text, finish, listed) == (script, "", "stop", [])
    assert all(not cs for _, cs in sent)


def test_a_stop_string_inside_a_character_the_prompt_began(tok):
    """The prompt ends with 漢's first byte and ``stop: ["漢"]``: the generated bytes complete it, so the text stops
    there, empty, and lists none of them (the character was lost, the stop never matched: 12 tokens, "字 means…")."""
    ids = _ids(tok, "Chinese: 漢字 means a lot")
    cut = ids.index(tok.convert_tokens_to_ids("Ġæ")) + 1
    params = SamplingParams(max_tokens=len(ids) - cut, temperature=0.0, stop=["漢"], logprobs=0)
    tokens, text, finish, listed, sent = run_loop(tok, ids[:cut], ids[cut:], params)
    assert (text, finish, listed) == ("", "stop", []) and tokens == ids[cut:cut + 2]


# ---- 2. token-id prompts that end inside a character ---------------------------------------------------------------

TOKENIZERS = {"SmolLM2": None, "SentencePiece, byte fallback": _sentencepiece}


@pytest.fixture(params=list(TOKENIZERS))
def any_tok(request, tok):
    return tok if TOKENIZERS[request.param] is None else TOKENIZERS[request.param]()


def test_a_prompt_ending_inside_a_character_leaves_it_to_the_completion(any_tok):
    """Every cut of a text inside a character (CJK and an emoji: 2 to 4 tokens each): the completion shows the
    character whole, never U+FFFD, prompt's whole text and completion are the decoding of the whole, and each
    generated token's offset is where its character starts."""
    from petals_chain.orchestrator.tokentext import whole_text

    tk = any_tok
    full = _ids(tk, CHINESE)
    want = _decode(tk, full)
    assert "\ufffd" not in want
    slow = _slow_offsets(tk, full)
    checked = 0
    for cut in range(1, len(full)):
        prompt, gen = full[:cut], full[cut:]
        if not _decode(tk, prompt).endswith("\ufffd"):
            continue  # ends on a whole character: tests/test_token_text.py
        m = StopMatcher(tk, [], prompt)
        pieces = [m.feed(t) for t in gen] + [m.flush()]
        assert all("\ufffd" not in p for p in pieces), (cut, pieces)
        head = whole_text(tk, prompt)
        assert head + "".join(pieces) == want, (cut, head, pieces)
        assert want.startswith(head) and not head.endswith("\ufffd")
        # token i starts after the longest prefix that decodes to whole characters (tests/test_token_text.py), and
        # not before the completion does
        offsets = StopMatcher(tk, [], prompt).feed_offsets(gen)
        assert offsets == [max(0, slow[cut + i] - len(head)) for i in range(len(gen))], cut
        checked += 1
    assert checked >= 6


def test_where_a_prompt_ends_inside_a_character(tok):
    """Bytes that can still become a character are left to the completion; stray bytes (a lone continuation byte,
    an overlong or surrogate start, 0xFF) and whole characters stay with the prompt."""
    from petals_chain.orchestrator.tokentext import incomplete_end, whole_text

    a = tok.convert_tokens_to_ids("a")
    b = [_byte_token(tok, x) for x in range(256)]
    assert incomplete_end(tok, [a, b[0xE6]]) == (1, "")
    assert incomplete_end(tok, [a, b[0xE6], b[0xBC]]) == (1, "")
    assert incomplete_end(tok, [a, b[0xF0], b[0x9F], b[0xA6]]) == (1, "")  # 3 bytes of 🦜's 4
    assert incomplete_end(tok, [a, tok.convert_tokens_to_ids("Ġæ")]) == (1, " ")
    for stray in ([a, b[0xE6], b[0xBC], b[0xA2]], [a, b[0xBC]], [a, b[0xE0], b[0x80]], [a, b[0xED], b[0xA0]],
                  [a, b[0xFF]], [a, b[0xF0], b[0x9F], b[0xA6], b[0x9C]], [a]):
        assert incomplete_end(tok, stray) is None, stray
        assert whole_text(tok, stray) == _decode(tok, stray)
    assert whole_text(tok, [a, tok.convert_tokens_to_ids("Ġæ")]) == "a "
    assert incomplete_end(tok, [b[0xE6], tok.convert_tokens_to_ids("<|im_end|>")]) is None
    # a prompt's stray byte keeps its U+FFFD in the prompt: the completion is what its own tokens say
    m = StopMatcher(tok, [], [a, b[0xBC]])
    assert "".join(m.feed(t) for t in _ids(tok, " means")) + m.flush() == " means"


# ---- 3. max_tokens inside a character -------------------------------------------------------------------------------

def test_max_tokens_inside_a_character_flushes_it_as_u_fffd_streamed_and_not(tok):
    script = _ids(tok, " Paris") + [tok.convert_tokens_to_ids("Ġæ")]
    params = SamplingParams(max_tokens=len(script), temperature=0.0, logprobs=0)
    tokens, text, finish, listed, sent = run_loop(tok, [], script, params)
    assert (text, finish) == (" Paris \ufffd", "length") and [c.token for c in listed] == tokens == script
    assert sent == [(" Paris", listed[:-1]), (" \ufffd", listed[-1:])]
    assert run_loop(tok, [], script, params, stream=False)[1:4] == (text, finish, listed)
    assert StopMatcher(tok, [], []).feed_offsets(script)[-1] == len(" Paris")


# ---- the API: n > 1, streamed and not, completions and chat (the tiny model's tokenizer) ----------------------------

@pytest.fixture(scope="module")
def api_answers(tiny_model_dir):
    """The app's answers, streamed and not, with the orchestrator's generation replaced by the decode loop over
    scripted tokens (per choice; a prompt that ends with 漢's first byte: the rest of it, then "字 means")."""
    from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.api import create_app

    async def main():
        orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_dir), max_length=64, port=0))
        orch.load_model()
        tk = orch.tokenizer
        scripts = [_ids(tk, " Paris. Then"), _ids(tk, "aaab then")]
        assert [tk.convert_ids_to_tokens(t) for t in scripts[1][:3]] == ["a", "a", "ab"]
        han = _ids(tk, "漢")
        assert len(han) == 3  # one token a byte

        async def fake_generate_n(prompt_ids, params, explicit=True, emits=None, *, prompt_logprobs=None,
                                  scored=None, **kw):
            scored_lp = None
            if prompt_logprobs is not None:  # echo with logprobs: the prompt's own (a stream opens with them)
                scored_lp = [None] + [TokenChoice(t, -1.0, []) for t in prompt_ids[1:]]
                if scored is not None:
                    await scored(scored_lp)
            out = []
            for i, p in enumerate(params):
                script = han[1:] + _ids(tk, "字 means") if prompt_ids[-1] == han[0] else scripts[i]
                p = SamplingParams(**{**p.__dict__, "max_tokens": len(script)})
                tokens, text, finish, choices = await decode_loop(tk, prompt_ids, script, p,
                                                                  emits[i] if emits else None)
                out.append(Generation(token_ids=tokens, text=text, finish_reason=finish, prompt_tokens=len(prompt_ids),
                                      wait_s=0.0, service_s=0.0, chain=[], failovers=0, logprobs=choices,
                                      prompt_logprobs=scored_lp))
            return out

        orch.generate_n = fake_generate_n
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://orch") as c:
            async def both(path, body):
                whole = (await c.post(path, json={"model": orch.model_id, **body})).json()
                events = []
                async with c.stream("POST", path, json={"model": orch.model_id, "stream": True, **body}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[6:]))
                return whole, events

            return {"stop": await both("/v1/completions", {"prompt": "x", "n": 2, "stop": [".", "aab"], "logprobs": 1}),
                    "han": await both("/v1/completions", {"prompt": _ids(tk, "Chinese: ") + han[:1], "logprobs": 0}),
                    "han_echo": await both("/v1/completions", {"prompt": _ids(tk, "Chinese: ") + han[:1], "echo": True,
                                                               "logprobs": 0}),
                    "chat": await both("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "stop": ["."], "logprobs": True})}

    return asyncio.run(main())


def _streamed(events, index):
    """A completions stream's text and logprobs of choice ``index``, joined over its events."""
    got = {"text": "", "tokens": [], "text_offset": [], "token_logprobs": []}
    for e in events:
        for ch in e["choices"]:
            if ch["index"] == index:
                got["text"] += ch["text"]
                for k in ("tokens", "text_offset", "token_logprobs"):
                    got[k] += (ch["logprobs"] or {}).get(k, [])
    return got


def test_api_stop_strings_with_n_choices_list_the_same_tokens_streamed_and_not(api_answers):
    """Two choices, each cut by a stop string: each one's logprobs list the tokens its text shows, at offsets inside
    it, the same streamed and not (chat's ``logprobs.content`` too); usage counts every generated token."""
    (whole, events), (chat, chat_events) = api_answers["stop"], api_answers["chat"]
    texts = [" Paris", "a"]
    assert [ch["text"] for ch in whole["choices"]] == texts
    assert whole["usage"]["completion_tokens"] == 4 + 3  # "Ġ P aris ." and "a a ab": the stop strings' tokens too
    for ch, text in zip(whole["choices"], texts):
        lp = ch["logprobs"]
        assert "".join(lp["tokens"]) == text and all(o < len(text) for o in lp["text_offset"])
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"])
        assert _streamed(events, ch["index"]) == {"text": text, **{k: lp[k] for k in
                                                                   ("tokens", "text_offset", "token_logprobs")}}
    content = chat["choices"][0]["message"]["content"]
    entries = chat["choices"][0]["logprobs"]["content"]
    assert content == " Paris" and "".join(e["token"] for e in entries) == content
    assert [e for ev in chat_events for ch in ev["choices"] if ch.get("logprobs")
            for e in ch["logprobs"]["content"]] == entries


def test_api_token_id_prompt_ending_inside_a_character(api_answers):
    """The prompt's last id is 漢's first byte: the completion starts with 漢 (it was "字 means"), its bytes' offsets
    at 漢, streamed and not."""
    whole, events = api_answers["han"]
    lp = whole["choices"][0]["logprobs"]
    assert whole["choices"][0]["text"] == "漢字 means" and lp["text_offset"][:5] == [0, 0, 1, 1, 1]
    assert _streamed(events, 0) == {"text": "漢字 means", **{k: lp[k] for k in
                                                           ("tokens", "text_offset", "token_logprobs")}}


def test_api_echo_of_a_token_id_prompt_ending_inside_a_character(api_answers):
    """Echoed, that prompt is its whole characters, and the echo and the completion are the decoding of both (the
    echo ended in U+FFFD, and with the completion's 漢 showed the character twice)."""
    whole, events = api_answers["han_echo"]
    lp = whole["choices"][0]["logprobs"]
    assert whole["choices"][0]["text"] == "Chinese: 漢字 means"
    # "C h ines e : Ġ" and 漢's first byte, then its other two and 字's three: each character's bytes where it starts
    assert lp["text_offset"][:12] == [0, 1, 2, 6, 7, 8, 9, 9, 9, 10, 10, 10]
    assert _streamed(events, 0) == {"text": "Chinese: 漢字 means", **{k: lp[k] for k in
                                                                    ("tokens", "text_offset", "token_logprobs")}}
