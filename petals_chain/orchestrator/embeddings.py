"""OpenAI's ``POST /v1/embeddings`` and vLLM's ``POST /tokenize`` / ``POST /detokenize``: what they compute (the
API's request bodies and routes are in :mod:`~petals_chain.orchestrator.api`).

An embedding is computed through the swarm. Each input is a job of its own, as a generation's prompt is: queued for a
chain, dispatched, charged to its client (its tokens are input service for fair sharing and count against
``tokens_per_minute``), audited, dropped at its deadline; the chain prefills the input and its last hop's hidden
states come back; the orchestrator applies the model's final norm to the last token's and L2-normalizes it, which is
vLLM's default pooling of a decoder LM (``LAST``, normalized). Nothing is generated, and the job's server sessions
are closed as soon as the prefill is done (the servers may keep its KV as a cached prefix, as for any job). A
request's inputs run concurrently, at most ``--max-choices`` of them at a time (the jobs one request may hold at
once): the request is admitted, or refused, on its first ones, as the choices of a completion are, and its later
inputs take their places as those end, never refused. A request naming a LoRA adapter's model id embeds with the
adapter: its jobs run on the chains serving it (as a generation's), and the response names the adapter as ``model``.

``/tokenize`` takes a ``prompt`` (tokenized as the completions endpoints do, ``add_special_tokens`` true by default)
or ``messages`` (the chat template, as chat completions render and tokenize it: ``add_generation_prompt`` true and
``add_special_tokens`` as they add them by default, :func:`chat_special_tokens`) and answers ``tokens``, ``count``
and ``max_model_len``; ``/detokenize`` turns ``tokens`` back into ``prompt`` (special tokens kept, as vLLM). Neither
uses the swarm.
"""

from __future__ import annotations

import base64
import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from petals_chain.orchestrator.adapters import ADAPTER
from petals_chain.orchestrator.deadlines import DEADLINE, RequestDeadline
from petals_chain.orchestrator.dispatch import ADMISSION, PLACE, RequestPlaces
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.swarm.aio import gather_or_cancel

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on the inputs of one request


@dataclass
class Embedded:
    """One input's embedding and how its job went."""

    vector: torch.Tensor  # [hidden] float32, unit L2 norm
    tokens: int
    cached_tokens: int  # tokens the servers' prefix caches held (not computed)
    wait_s: float
    service_s: float
    chain: list[str]
    failovers: int


def check_dimensions(orch: Any, dimensions: Optional[int]) -> None:
    """``dimensions`` other than the model's hidden size is a 400: a decoder LM's hidden state cut short is no
    embedding of fewer dimensions (only models trained for it, Matryoshka-style, have those; vLLM refuses it too)."""
    hidden = int(orch.config.hidden_size)
    if dimensions is not None and dimensions != hidden:
        raise RequestError(f"dimensions {dimensions} is not supported: this model's embeddings have {hidden} "
                           "dimensions (it is not trained for shortened embeddings)", param="dimensions",
                           code="unsupported_value")


def check_ids(orch: Any, ids: list[int], param: str) -> None:
    """Every id is in the vocabulary (400 ``invalid_token_id`` naming ``param`` else)."""
    vocab = orch.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param,
                           code="invalid_token_id")


def check_inputs(orch: Any, inputs: list[list[int]]) -> None:
    """Each input has tokens, in the vocabulary, and fits the model's context (the whole of it: nothing is
    generated after it)."""
    max_length = int(orch.cfg.max_length)
    for i, ids in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input.{i}"
        if not ids:  # a text of nothing but what the tokenizer drops
            raise RequestError(f"{where} has no tokens", param="input", code="empty_prompt")
        check_ids(orch, ids, where)
        if len(ids) > max_length:
            which = "the input" if len(inputs) == 1 else f"the input at index {i}"
            raise RequestError(f"this model's maximum context length is {max_length} tokens, but there are "
                               f"{len(ids)} tokens in {which}: {len(ids) - max_length} too many (shorten it)",
                               param="input", code="context_length_exceeded")


def encode_texts(orch: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The texts' token ids, in one call of the tokenizer (blocking: off the event loop for many or long texts)."""
    return [list(ids) for ids in orch.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


async def _embed_one(orch: Any, ids: list[int]) -> Embedded:
    """One input as one job: a chain, a prefill, the pooled last hidden state; the chain given back at once."""
    if orch.planner is not None:
        orch.planner.rates.arrive()
    t0 = time.monotonic()
    holder = ChainHolder(orch, f"e-{uuid.uuid4().hex[:12]}", len(ids), shape=(len(ids), 0))
    ok = False
    try:
        hidden = await holder.feed(list(ids))
        chain, cached = holder.chain_names, holder.reused_tokens
        vector = await orch.batcher.pool(hidden)
        ok = holder.completed = True
    finally:
        orch._background(holder.close())  # its sessions closed now: no KV held for it past the prefill
        service = orch._finish_job(holder, t0, 0, len(ids), ok)
    return Embedded(vector=vector, tokens=len(ids), cached_tokens=cached, wait_s=holder.wait_s, service_s=service,
                    chain=chain, failovers=holder.failovers)


async def embed_inputs(orch: Any, inputs: list[list[int]]) -> list[Embedded]:
    """The embeddings of ``inputs`` (checked token ids), in order: a job each, at most ``--max-choices`` at a time
    (fewer where the chains' slots and the queue could never hold that many: ``most_jobs_admissible``).
    The request's first jobs are admitted (or refused, 429) together; each later one takes the place of one that
    ended (a job of an admitted request: never refused). The first failure cancels the rest."""
    adm = ADMISSION.get()
    places = adm.places if adm is not None else RequestPlaces()
    window = min(len(inputs), max(1, int(orch.cfg.max_n)))
    # an adapter's inputs run only on the chains serving it: their slots bound the window (ADAPTER: the API's)
    most = getattr(orch.dispatch, "most_jobs_admissible", lambda adapter: None)(ADAPTER.get())
    if most is not None:  # a window the swarm's slots and queue never hold at once was refused, 429 "ask for fewer"
        window = min(window, max(1, most))
    tickets = places.expect(window)  # before any await: the first jobs all count the request's places
    results: list[Optional[Embedded]] = [None] * len(inputs)
    order = iter(range(len(inputs)))  # shared: each worker takes the next input

    async def worker(w: int) -> None:
        PLACE.set(tickets[w])  # its first job is one of the request's first; its later ones join the admitted request
        try:
            for i in order:
                results[i] = await _embed_one(orch, inputs[i])
        finally:
            tickets[w].drop()

    orch.stats.begin_request_part(places)
    error: Optional[BaseException] = None
    deadline = DEADLINE.get()
    try:
        await gather_or_cancel(*(worker(w) for w in range(window)))
        if deadline is not None:  # the answer is whole now: its first (and last) part
            deadline.first_token()
            orch.deadlines.settle(deadline)
    except BaseException as e:
        error = e
        if deadline is not None:  # a refusal or a drop is settled already
            orch.deadlines.settle(deadline, "missed")
        raise
    finally:
        for ticket in tickets:
            ticket.drop()
        orch.stats.end_request_part(places, error)
    return results  # type: ignore[return-value]


def encoded(vector: torch.Tensor, encoding_format: str) -> Union[list[float], str]:
    """OpenAI's ``embedding``: floats, or base64 of little-endian float32 (what the openai package decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # JSONResponse's


def response(model: str, done: list[Embedded], encoding_format: str, deadline: Optional[RequestDeadline]) -> bytes:
    """OpenAI's embeddings response of ``model`` (the id it answers as; ``usage`` counts the inputs' tokens), with
    each job's figures (``petals_chain``) and the deadline's report, if any: its JSON body.

    Blocking: run it in a worker thread. 2048 inputs as floats are millions of numbers; returned as a dict, FastAPI's
    jsonable_encoder and one json.dumps held the event loop for seconds (every stream's relay with it). Each vector
    is encoded by its own json.dumps, between which the thread hands the event loop the GIL."""
    tokens = sum(e.tokens for e in done)
    data = ",".join(_dumps({"object": "embedding", "index": i, "embedding": encoded(e.vector, encoding_format)})
                    for i, e in enumerate(done))
    rest: dict[str, Any] = {
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "petals_chain": [{"wait_s": e.wait_s, "service_s": e.service_s, "chain": e.chain, "failovers": e.failovers,
                          "cached_tokens": e.cached_tokens} for e in done]}
    if deadline is not None:
        rest["deadline"] = deadline.report()
    return f'{{"object":"list","model":{_dumps(model)},"data":[{data}],{_dumps(rest)[1:]}'.encode()


def chat_special_tokens(orch: Any) -> bool:
    """Whether chat completions add the tokenizer's special tokens (a BOS) to the rendered conversation
    (``orch.encode_chat``): not to a chat template's text, which holds them; to the plain rendering of a tokenizer
    without a template, yes (``/tokenize`` of messages by default: the tokens chat completions feed the model)."""
    return not getattr(orch.tokenizer, "chat_template", None)


def render_chat(orch: Any, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> str:
    """The conversation as the model's chat template writes it (blocking). Chat completions tokenize this text with
    special tokens as :func:`chat_special_tokens` says: the same tokens as ``/tokenize`` of the messages."""
    tok = orch.tokenizer
    opening = add_generation_prompt and not continue_final_message
    if not getattr(tok, "chat_template", None):  # orch.encode_chat's plain rendering
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text[:-1] if continue_final_message else text + ("assistant: " if opening else "")
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=opening,
                                   continue_final_message=continue_final_message)


def tokenized(orch: Any, ids: list[int], token_strs: bool) -> dict:
    """vLLM's ``/tokenize`` response."""
    strs = orch.tokenizer.convert_ids_to_tokens(ids) if token_strs else None
    return {"count": len(ids), "max_model_len": int(orch.cfg.max_length), "tokens": ids, "token_strs": strs}


def detokenized(orch: Any, tokens: list[int]) -> dict:
    """vLLM's ``/detokenize`` response: the text of ``tokens``, special tokens kept (blocking)."""
    return {"prompt": orch.tokenizer.decode(tokens, skip_special_tokens=False)}
