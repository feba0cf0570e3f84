"""Python client of a petals-chain orchestrator.

```python
from petals_chain.client import Client
client = Client("http://127.0.0.1:8000")   # or Client([url1, url2]): the next one takes over if one is lost
print(client.generate("The quick brown fox", max_tokens=16))          # greedy by default
for piece in client.stream("Once upon a time", max_tokens=32, temperature=0.8, seed=1):
    print(piece, end="", flush=True)
with client.session(max_length=512) as s:                              # keeps its KV between turns
    s.chat("I live in Rome.")                                          # chat turns: the template is applied
    print(s.chat("Where do I live?").text)                             # by the orchestrator, token-exact

class City(pydantic.BaseModel):                                        # structured outputs: the output is
    name: str                                                          # JSON of the model's schema
c = client.chat_completion([{"role": "user", "content": "Paris?"}], response_format=City)
print(c.parsed)                                                        # City(name='Paris')
```

PETALS-style code ports by changing one import (token ids in, token ids out, as ``transformers``):

```python
from petals_chain.client import AutoDistributedModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained("smollm2-135m")
model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", url="http://127.0.0.1:8000")
ids = tokenizer("A cat sat", return_tensors="pt")["input_ids"]
print(tokenizer.decode(model.generate(ids, max_new_tokens=8)[0]))
```
"""

from __future__ import annotations

import contextlib
import email.utils
import html
import json
import math
import numbers
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import httpx

from petals_chain.swarm.media import is_event_stream

T = TypeVar("T")

__all__ = ["Client", "ClientSession", "ClientError", "Completion", "AutoDistributedModelForCausalLM", "AutoTokenizer"]


class ClientError(RuntimeError):
    """The orchestrator refused a request (4xx) or could not serve it (5xx). ``retry_after``: the seconds its reply's
    ``Retry-After`` asked to wait before sending it again (None without one, or when it said ``x-should-retry:
    false``); the client waited so itself where that fit in ``retry_s``."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after


@dataclass
class Completion:
    """One generated sequence and how it was served."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict
    wait_s: float = 0.0
    service_s: float = 0.0
    chain: list[str] = field(default_factory=list)
    failovers: int = 0
    logprobs: Optional[Any] = None  # the choice's "logprobs" object when asked for
    output_type: Optional[type] = field(default=None, repr=False)  # the pydantic model given as response_format

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of service (time on the chain, queueing excluded)."""
        return len(self.token_ids) / self.service_s if self.service_s > 0 else 0.0

    @property
    def parsed(self) -> Any:
        """The text as an instance of the pydantic model given as ``response_format`` (None without one), as the
        openai package's ``.parsed``. ValueError when the output did not end on its own (``finish_reason``
        "length": its JSON is cut); pydantic's ValidationError when it does not validate (a ``stop`` string cut it,
        or a constraint the grammar does not enforce). ``text`` keeps the output either way."""
        if self.output_type is None:
            return None
        if self.finish_reason != "stop":
            raise ValueError(f"the structured output did not end on its own (finish_reason {self.finish_reason!r}): "
                             "its JSON is cut; ask for more max_tokens (the output is in .text)")
        return self.output_type.model_validate_json(self.text)


MAX_MESSAGE_CHARS = 200  # of a reply that is not an orchestrator's error object (a proxy's HTML page), in a message
# Linear in the text: a lazy ``<script ...</script>`` or a ``<[^>]*>`` that must reach the end scanned the rest of the
# text from each unclosed ``<`` (300 kB of "a < b " took 10 s to become a 200-character message)
_BLOCK_OPEN = re.compile(r"<(script|style)\b", re.IGNORECASE)
_BLOCK_CLOSE = {name: re.compile(rf"</{name}\s*>", re.IGNORECASE) for name in ("script", "style")}
_TAG = re.compile(r"<[^<>]*>")


def _strip_tags(text: str) -> str:
    """``text`` without its tags and its ``<script>`` and ``<style>`` blocks (an unclosed one runs to the end, as a
    browser reads it)."""
    kept, pos = [], 0
    while (block := _BLOCK_OPEN.search(text, pos)) is not None:
        kept.append(text[pos:block.start()])
        end = _BLOCK_CLOSE[block.group(1).lower()].search(text, block.end())
        pos = len(text) if end is None else end.end()
    kept.append(text[pos:])
    return _TAG.sub(" ", " ".join(kept))


def _shown_text(text: str) -> str:
    """``text`` as an error message shows it: tags stripped, whitespace collapsed, at most :data:`MAX_MESSAGE_CHARS`
    (a proxy's 502 page was the whole message, kilobytes of HTML)."""
    plain = " ".join(html.unescape(_strip_tags(text)).split())
    return plain if len(plain) <= MAX_MESSAGE_CHARS else plain[:MAX_MESSAGE_CHARS - 3] + "..."


def _error_of(resp: httpx.Response) -> tuple[str, Optional[str]]:
    """The message and code of an error reply: its ``{"error": {...}}`` object's, else its text as
    :func:`_shown_text` shows it (no code)."""
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return _shown_text(resp.text), None
    if isinstance(err, str) and err:
        return _shown_text(err), None
    if not isinstance(err, dict):
        return _shown_text(resp.text), None
    message, code = err.get("message"), err.get("code")
    return (message if isinstance(message, str) else _shown_text(resp.text)), (code if isinstance(code, str) else None)


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    wait = None if _told_not_to_retry(resp) else _retry_after(resp)
    message, code = _error_of(resp)
    raise ClientError(resp.status_code, message, code, wait)


def _retry_after(resp: httpx.Response) -> Optional[float]:
    """The reply's ``Retry-After`` in seconds (delay seconds or an HTTP date), None without a valid one."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - datetime.now(timezone.utc)).total_seconds()
    return max(0.0, seconds) if not math.isnan(seconds) else None


def _told_not_to_retry(resp: httpx.Response) -> bool:
    """``x-should-retry: false``: sending the request again cannot cure this error (OpenAI's convention)."""
    return resp.headers.get("x-should-retry", "").strip().lower() == "false"


# 429 codes about the answering orchestrator's own queue (its group's chains): another orchestrator's group may have
# room, so with several the next one is asked before waiting. The API key's limits (tokens_per_minute,
# client_inflight_limit, client_session_limit) are not among them: each orchestrator holds the key to its own limits,
# and a client that moved on to the next one at each refusal got the key's budget once per orchestrator
_QUEUE_REFUSALS = frozenset({"queue_full", "client_queue_share", "deadline_unreachable", "too_many_sessions"})


def _queue_refusal(resp: httpx.Response) -> bool:
    """A 429 about the orchestrator's own queue (:data:`_QUEUE_REFUSALS`) that does not say ``x-should-retry: false``
    (the body must have been read)."""
    return resp.status_code == 429 and not _told_not_to_retry(resp) and _error_of(resp)[1] in _QUEUE_REFUSALS


def _wait_to_resend(resp: httpx.Response, deadline: float, only_orchestrator: bool,
                    floor: float = 0.0) -> Optional[float]:
    """Seconds to wait before sending ``resp``'s request again to the same orchestrator, or None to take the reply:
    a 429 (or, from the client's only orchestrator, a 503) whose ``Retry-After`` (at least ``floor``) ends before
    ``deadline`` (a ``time.monotonic()``), unless it says ``x-should-retry: false``. A 503 from one of several goes
    to the next, as does a 429 about that one's queue (:func:`_queue_refusal`)."""
    if resp.status_code == 429:
        if not only_orchestrator and _queue_refusal(resp):
            return None
    elif not (resp.status_code == 503 and only_orchestrator):
        return None
    wait = None if _told_not_to_retry(resp) else _retry_after(resp)
    if wait is None:
        return None
    wait = max(wait, floor)
    return wait if time.monotonic() + wait <= deadline else None


def _resend_floors() -> Iterator[float]:
    """The least wait before each resend of one request (s): ``Retry-After: 0`` (a proxy's, or a date just past) sent
    it again at once, over and over: 4,000 requests in 2 s, until ``retry_s`` ran out."""
    pause = RETRY_PAUSE_S[0]
    while True:
        yield pause
        pause = min(2 * pause, RETRY_PAUSE_S[1])


def _send(http: httpx.Client, deadline: float, only_orchestrator: bool, method: str, path: str,
          **kwargs: Any) -> httpx.Response:
    """``http.request(method, path)``, sent again after each ``Retry-After`` that :func:`_wait_to_resend` takes."""
    floors = _resend_floors()
    while True:
        r = http.request(method, path, **kwargs)
        wait = _wait_to_resend(r, deadline, only_orchestrator, next(floors))
        if wait is None:
            return r
        r.close()
        time.sleep(wait)


@contextlib.contextmanager
def _open_stream(http: httpx.Client, deadline: float, only_orchestrator: bool, path: str,
                 body: dict) -> Iterator[httpx.Response]:
    """``http.stream("POST", path)``, opened again after each ``Retry-After`` that :func:`_wait_to_resend` takes.
    An error reply's body is read (it is small, and its code says whether to wait)."""
    floors = _resend_floors()
    while True:
        with http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                r.read()
            wait = _wait_to_resend(r, deadline, only_orchestrator, next(floors))
            if wait is None:
                yield r
                return
        time.sleep(wait)


class _Refusals:
    """One call's 429s about orchestrators' own queues (:func:`_queue_refusal`): when each orchestrator asked to be
    sent the request again (never, without ``Retry-After``), and its reply (or the error raised of it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.until: dict[int, float] = {}
        self.replies: dict[int, Any] = {}

    def add(self, i: int, resp: httpx.Response, reply: Any) -> None:
        wait = _retry_after(resp)
        self.until[i] = math.inf if wait is None else time.monotonic() + max(wait, RETRY_PAUSE_S[0])
        self.replies[i] = reply

    def forget(self, i: int) -> None:
        """Orchestrator ``i`` answered otherwise since: its refusal is no longer the news."""
        self.until.pop(i, None)
        self.replies.pop(i, None)

    def waiting(self, i: int) -> bool:
        """Orchestrator ``i`` asked to be sent the request later than now."""
        return self.until.get(i, 0.0) > time.monotonic()

    def not_before(self) -> float:
        """The soonest time (``time.monotonic()``) an orchestrator is due again: 0 while one was not refused."""
        return min(self.until.get(i, 0.0) for i in range(self.n))

    def soonest(self) -> Optional[tuple[int, Any]]:
        """The orchestrator whose refusal ends first, and its reply; None without refusals."""
        if not self.until:
            return None
        i = min(self.until, key=self.until.__getitem__)
        return i, self.replies[i]


@contextlib.contextmanager
def _transport_errors(http: httpx.Client,
                      on_read_timeout: Optional[Callable[[httpx.ReadTimeout], None]] = None) -> Iterator[None]:
    """An orchestrator that cannot be reached (or that cut the connection) is a ClientError 503, as for one-shot
    requests, not an httpx exception. ``on_read_timeout(e)`` first, for a read timeout: it may raise another."""
    try:
        yield
    except httpx.TransportError as e:
        if on_read_timeout is not None and isinstance(e, httpx.ReadTimeout):
            on_read_timeout(e)
        raise _unavailable([f"{http.base_url}: {type(e).__name__}: {e}"]) from e


def _one_completion(prompt: Any, extra: dict) -> None:
    """A call that returns one completion (or one stream) is asked for one: ``n`` > 1 or a batch of prompts gave the
    first choice (or, streamed, every choice's pieces interleaved). ValueError otherwise."""
    n = extra.get("n")
    if n is not None and n != 1:  # None: JSON null, the default (one), as OpenAI takes it
        raise ValueError(f"this call returns one completion, got n={n!r}: call it once per completion (with "
                         "different seeds to sample), or use the OpenAI API for several choices")
    batch = isinstance(prompt, (list, tuple)) and not all(isinstance(t, int) for t in prompt)
    if batch and len(prompt) > 1:  # a list of one text (or of one list of ids) is one prompt, as OpenAI takes it
        raise ValueError("this call takes one prompt (text or token ids), got a batch: call it once per prompt, "
                         "or use AutoDistributedModelForCausalLM.generate for a batch")


def _no_stream_switch(extra: dict, streams: bool) -> None:
    """``stream=`` is each method's own: a value that agrees is dropped, one that does not is a TypeError
    (``complete(stream=True)`` failed decoding the reply; ``stream(stream=False)`` yielded nothing)."""
    if "stream" in extra and bool(extra.pop("stream")) != streams:
        raise TypeError("use stream() to stream, complete() or chat_completion() otherwise" if not streams else
                        "stream() always streams: use complete() or chat_completion() for one reply")


def _plain(value: Any) -> Any:
    """``value`` with numbers of other types (numpy's ``float32``, ``int64``, ...) as Python ints and floats, in
    lists and dicts too: JSON (httpx's encoder) carries only Python's."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _number(name: str, value: Any, *, integer: bool = False, optional: bool = False) -> Any:
    """``value`` of ``name`` as a Python int or float (numpy's ``float32(0.7)`` or ``int64(16)`` too: they were
    refused as "not a number"). TypeError for what is not a number (an integer with ``integer``; None with
    ``optional``), ValueError for NaN or infinity: they failed deep in httpx's JSON encoder ("Out of range float values
    are not JSON compliant"), naming no argument; a text or a float where an int goes was the orchestrator's 422."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise TypeError(f"{name} must be {'an integer' if integer else 'a number'}"
                        f"{' or None' if optional else ''}, got {type(value).__name__} {value!r:.80}")
    value = _plain(value)
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _token_ids(value: Any) -> Optional[list[int]]:
    """``value`` as a list of Python ints when it is a list, tuple or range of integers (numpy's too), else None."""
    if isinstance(value, range):
        return list(value)
    if isinstance(value, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                for t in value):
        return [int(t) for t in value]
    return None


def _check_prompt(prompt: Any) -> Any:
    """``prompt`` as it is sent (token ids as Python ints); TypeError for one that is not text or token ids (or a list
    of one of them, as OpenAI takes it)."""
    if isinstance(prompt, str):
        return prompt
    if (ids := _token_ids(prompt)) is not None:
        return ids
    if isinstance(prompt, (list, tuple)) and prompt:
        each = [p if isinstance(p, str) else _token_ids(p) for p in prompt]
        if all(p is not None for p in each):
            return each  # one text (or list of ids) in a list, or a batch: _one_completion names it
    raise TypeError(f"prompt must be text (str) or token ids (a list of int), got {type(prompt).__name__} "
                    f"{prompt!r:.80}" + (": decode bytes first" if isinstance(prompt, (bytes, bytearray)) else ""))


def _check_messages(messages: Any) -> None:
    """TypeError for ``messages`` that are not a list of message dicts (a bare text was sent as is: a 422)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, got "
                        f"{type(messages).__name__} {messages!r:.80}")
    _check_extra({"messages": list(messages)})


def _check_extra(extra: dict) -> dict:
    """The extra body fields as sent (numbers as Python's, :func:`_plain`); ValueError or TypeError, naming the
    argument, for one JSON cannot carry (NaN, bytes)."""
    plain = {}
    for name, value in extra.items():
        plain[name] = _plain(value)
        try:
            json.dumps(plain[name], allow_nan=False)
        except ValueError:
            raise ValueError(f"{name} must be finite (JSON has no NaN or infinity), got {value!r:.80}") from None
        except TypeError:
            raise TypeError(f"{name} must be what JSON carries (numbers, text, lists, dicts), got "
                            f"{type(value).__name__} {value!r:.80}") from None
    return plain


def _typed_format(extra: dict) -> Optional[type]:
    """A pydantic model given as ``response_format`` (the openai package's ``parse(response_format=Model)``): replaced
    in ``extra`` by the ``json_schema`` format of its JSON schema, objects closed to other properties (as OpenAI's
    strict schemas: a small model given room added properties until ``max_tokens``), and returned for
    :attr:`Completion.parsed`. None for anything else (sent as it is)."""
    model = extra.get("response_format")
    if not isinstance(model, type):
        return None
    import pydantic  # only when a model class is given: the client imports without it

    if not issubclass(model, pydantic.BaseModel):
        raise TypeError(f"response_format must be a pydantic model class or a dict, got the class {model.__name__}")
    extra["response_format"] = {"type": "json_schema", "json_schema": {
        "name": model.__name__[:64], "schema": _closed(model.model_json_schema()), "strict": True}}
    return model


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object schema that says nothing of them."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _sampling(max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, extra) -> dict:
    """The sampling fields of a request body; TypeError or ValueError naming the argument that cannot be sent."""
    # None: JSON null, the orchestrator's default (as OpenAI's clients send it)
    temperature, top_p, repetition_penalty = (_number(name, value, optional=True) for name, value in (
        ("temperature", temperature), ("top_p", top_p), ("repetition_penalty", repetition_penalty)))
    max_tokens, top_k, seed = (_number(name, value, integer=True, optional=True) for name, value in (
        ("max_tokens", max_tokens), ("top_k", top_k), ("seed", seed)))
    if not (stop is None or isinstance(stop, str)
            or isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop)):
        raise TypeError(f"stop must be text or a list of texts, got {type(stop).__name__} {stop!r:.80}")
    extra = _check_extra(extra)
    body = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
    if max_tokens is not None:  # None: the orchestrator's default (chat: the rest of the context)
        body["max_tokens"] = max_tokens
    if seed is not None:
        body["seed"] = seed
    if stop:
        body["stop"] = list(stop) if isinstance(stop, tuple) else stop
    body.update(extra)
    return body


def _not_an_orchestrator(resp: httpx.Response) -> ClientError:
    """ClientError 502 ``bad_reply`` for a reply that is not what an orchestrator sends (a web page, a proxy's page):
    a URL that is not an orchestrator's raised a bare JSONDecodeError, and a stream from it yielded nothing."""
    kind = resp.headers.get("content-type") or "no content type"
    return ClientError(502, f"{resp.request.url} answered HTTP {resp.status_code} with {kind}, not what an "
                       "orchestrator sends: is it the orchestrator's URL?", "bad_reply")


def _json(resp: httpx.Response) -> Any:
    """The reply's JSON body (ClientError 502 ``bad_reply`` for anything else)."""
    try:
        return resp.json()
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise _not_an_orchestrator(resp) from None


def _read_reply(resp: httpx.Response, read: Callable[[Any], T]) -> T:
    """``read`` of the reply's JSON body; one without what ``read`` takes (another server's JSON) is ClientError 502
    ``bad_reply``, as a reply that is not JSON is: it was a bare KeyError ('choices'), IndexError or TypeError."""
    data = _json(resp)
    try:
        return read(data)
    except (KeyError, IndexError, TypeError, AttributeError):
        raise _not_an_orchestrator(resp) from None


def _one_shot(data: dict, chat: bool, output_type: Optional[type] = None) -> Completion:
    """The first choice of a ``/v1/completions`` (``chat``: ``/v1/chat/completions``) reply, with its details."""
    ch = data["choices"][0]
    info = (data.get("petals_chain") or [{}])[0]
    return Completion(text=ch["message"]["content"] if chat else ch["text"], token_ids=info.get("token_ids", []),
                      finish_reason=ch["finish_reason"], usage=data["usage"], wait_s=info.get("wait_s", 0.0),
                      service_s=info.get("service_s", 0.0), chain=info.get("chain", []),
                      failovers=info.get("failovers", 0), logprobs=ch.get("logprobs"), output_type=output_type)


def _event(resp: httpx.Response, data: str) -> dict:
    """One event's JSON object; anything else is ClientError 502 ``bad_reply`` (it was a bare JSONDecodeError)."""
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise ClientError(502, f"{resp.request.url} sent a stream event that is not an orchestrator's: "
                          f"{data[:200]!r}", "bad_reply")
    return obj


def _iter_sse(resp: httpx.Response) -> Iterator[dict]:
    """The JSON events of a stream, up to ``[DONE]``. No event within the request's read timeout is an
    ``httpx.ReadTimeout``, whatever else came: an orchestrator's ``: keepalive`` comments (every 15 s while a stream
    waits in its queue) reset httpx's own timer, so a stream queued for an hour waited the hour, the client's
    ``timeout`` never met. It is noticed at the first line past the timeout (within a keepalive's interval)."""
    # orchestrators name theirs (a body without one is read)
    if "content-type" in resp.headers and not is_event_stream(resp.headers):
        resp.read()
        raise _not_an_orchestrator(resp)
    limit = (resp.request.extensions.get("timeout") or {}).get("read")
    last = time.monotonic()
    for line in resp.iter_lines():
        if not line.startswith("data:"):
            if limit is not None and time.monotonic() - last > limit:
                raise httpx.ReadTimeout(f"no event within the read timeout ({limit} s), only comments or blank "
                                        "lines", request=resp.request)
            continue
        last = time.monotonic()
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = _event(resp, data)
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            status = err.get("status")  # the HTTP status the error would have had (older orchestrators: none)
            if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status < 600:
                status = 503 if err.get("type") in ("server_error", "service_unavailable") else 400
            raise ClientError(status, err.get("message", ""), err.get("code"))
        yield obj


# An orchestrator that answers these could not serve the request (it has no chain, is shutting down, or a proxy in
# front of it lost it): another orchestrator may.
_TRY_ANOTHER = {502, 503, 504}
# With several orchestrators: how long to keep going round them (s) when none can serve, and the pause between rounds
# (s, doubling): a lost orchestrator's group is taken over within --group-ttl-s plus a round (about 10 s by default)
DEFAULT_RETRY_S = 30.0
RETRY_PAUSE_S = (0.5, 4.0)
HEALTH_PROBE_S = 5.0  # after a generation's read timeout, how long GET /healthz may take for the orchestrator to be up
# At most this long to connect (s), whatever ``timeout`` (the wait for a generation) is: an orchestrator whose host
# does not answer a TCP handshake within it is not reachable now (a SYN retried 3 times has had 7 s), and the
# next one takes over. With ``timeout`` alone, a host gone dark (powered off, cut off: its SYNs unanswered) held
# each request for the whole ``timeout`` (600 s by default; the kernel's own limit, about 130 s) before failover.
CONNECT_TIMEOUT_S = 10.0
# No cap on pooled connections: httpcore 1.0.9's pool closes an idle connection it has just handed to a waiting
# thread when it holds more than the keep-alive cap (or needs room under the connection cap), cutting that
# thread's request ("ReadError: [Errno 9] Bad file descriptor", or a hang until the read timeout): encode/httpcore
# #1110, open. A Client shared by more threads than the caps (a burst of requests) met it.
_POOL_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)


def _check_url(url: str) -> None:
    """ValueError for what is not an orchestrator's root URL: without ``http://`` every request failed as "no
    orchestrator could serve" (after ``retry_s`` of rounds with several URLs); with OpenAI's ``/v1`` base each
    path doubled it, a bare 404."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        v6 = " (an IPv6 address is written in brackets: http://[::1]:8000)" if url.count(":") > 2 else ""
        raise ValueError(f"invalid orchestrator URL {url!r}: {e}{v6}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"an orchestrator URL is http(s)://HOST:PORT, got {url!r}")
    if parsed.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"give the orchestrator's URL without /v1 (the client adds the API paths), got {url!r}")


def _timeouts(timeout: Optional[float] | httpx.Timeout) -> httpx.Timeout:
    """The httpx timeouts of the client's ``timeout``: seconds (or None, no limit) to send a request and read each
    piece of its reply, at most :data:`CONNECT_TIMEOUT_S` to connect; an ``httpx.Timeout`` as it is."""
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S if timeout is None else min(timeout, CONNECT_TIMEOUT_S))


def _check_timeout(timeout: Any) -> None:
    """ValueError for a ``timeout`` that is not None, an ``httpx.Timeout`` or a positive finite number of seconds: 0
    failed every request as "no orchestrator could serve" (a connect that never had time), a negative one, NaN or
    infinity only at the first request, deep in the socket layer."""
    if timeout is None or isinstance(timeout, httpx.Timeout):
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a positive finite number of seconds (None: no timeout), got {timeout!r}")


def _resume_mismatch(url: str, what: str) -> ClientError:
    """A cut stream's rerun at ``url`` did not repeat what the caller already has (another chain's numerics)."""
    return ClientError(502, f"the stream was cut off and its rerun at {url} gave another text: {what}",
                       "resume_mismatch")


def _unavailable(failures: list[str]) -> ClientError:
    return ClientError(503, "no orchestrator could serve the request: " + "; ".join(failures), "unavailable")


class Client:
    """Client of the orchestrator at ``url`` (e.g. ``http://127.0.0.1:8000``), or of the first of several that
    serve the same model (``url`` a list): a one-shot request that one of them cannot take (unreachable, hung, cut
    off mid-request, 502/503/504) is sent again to the next, and the client stays with the one that answered (one
    that got no answer within ``timeout`` from an orchestrator that is up, a generation longer than ``timeout`` or
    a stream with no text within it, is :class:`ClientError` 504 ``timeout``: it would take as long anywhere); when
    none can, it goes round them again for up to ``retry_s`` seconds (the time a survivor takes to adopt a lost
    orchestrator's group). A stream cut off mid-way is resumed there when its output is reproducible (greedy, or
    seeded): the text already yielded is skipped, so the caller sees one uninterrupted stream (a rerun that does not
    repeat it, e.g. another chain's numerics, is :class:`ClientError` 502 ``resume_mismatch``). Sessions stay with
    the orchestrator that opened them, and opening one is sent again only if it never reached the first.

    ``timeout`` is the wait for a reply (for a stream, for its next event: an orchestrator's keepalive comments do
    not count; noticed within one keepalive's interval); connecting takes at most :data:`CONNECT_TIMEOUT_S`. A 429
    (or a 503 from the only orchestrator) with ``Retry-After`` is sent there again after that wait (at least 0.5 s,
    doubling to 4 s) when it ends within ``retry_s`` of the call (sessions' calls too), else raised at once with its
    ``retry_after`` (``retry_s=0``: at once). With several orchestrators, a 429 about one's own queue
    (``queue_full``, ``client_queue_share``, ``deadline_unreachable``, ``too_many_sessions``) goes to the next one
    first, and the wait is for the soonest ``Retry-After`` once each refused; an API key's limits
    (``tokens_per_minute``, ...) are waited out where they were met. A reply that says ``x-should-retry: false`` is
    the answer, sent again nowhere. Arguments that cannot be sent (bytes, NaN) are a TypeError or ValueError naming
    them, before any request (numpy's numbers go as Python's); an error reply that is not an orchestrator's (a proxy's
    page) is cut to :data:`MAX_MESSAGE_CHARS` of its text. A :class:`ClientSession` dropped unclosed is closed from a
    background thread by the process that opened it (at interpreter exit, or dropped in a forked child, it is left to
    its owner or the orchestrator's reaper)."""

    def __init__(self, url: str | Sequence[str], *, timeout: Optional[float] = 600.0, model: Optional[str] = None,
                 api_key: Optional[str] = None, retry_s: float = DEFAULT_RETRY_S):
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or not all(isinstance(u, str) and u for u in urls):
            raise ValueError("url must be an orchestrator URL or a non-empty list of them")
        for u in urls:
            _check_url(u)
        if not retry_s >= 0:
            raise ValueError(f"retry_s must be >= 0, got {retry_s!r}")
        _check_timeout(timeout)
        self.retry_s = float(retry_s)
        self.urls = [u.rstrip("/") for u in urls]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._https = [httpx.Client(base_url=u, timeout=_timeouts(timeout), headers=headers, limits=_POOL_LIMITS)
                       for u in self.urls]
        self._current = 0
        self._model = model

    @property
    def url(self) -> str:
        """The orchestrator this client uses now."""
        return self.urls[self._current]

    @property
    def _http(self) -> httpx.Client:
        return self._https[self._current]

    def _tries(self, not_before: Optional[Callable[[], float]] = None) -> Iterator[int]:
        """The orchestrators to try in turn: the current one, then the others; with several, more rounds after a
        pause until ``retry_s`` has passed (the survivor takes a lost orchestrator's group over in that time,
        and one that forwarded to the lost one answers again once it serves the request itself). ``not_before()``:
        the soonest time (``time.monotonic()``) any orchestrator is due again, the least pause before a round."""
        n, base = len(self._https), self._current  # fixed: a stream moves _current mid-round
        t0, pause = time.monotonic(), RETRY_PAUSE_S[0]
        while True:
            for i in range(n):
                yield (base + i) % n
            wait = pause if not_before is None else max(pause, not_before() - time.monotonic())
            if n == 1 or time.monotonic() - t0 + wait > self.retry_s:
                return
            time.sleep(wait)
            pause = min(2 * pause, RETRY_PAUSE_S[1])

    def _request(self, method: str, path: str, *, resend: bool = True, **kwargs: Any) -> httpx.Response:
        """``method path`` on the current orchestrator, else on the next ones (see the class docstring).
        ``resend=False`` (a request that creates something): tried elsewhere only if it was never sent."""
        return self._request_at(method, path, resend=resend, **kwargs)[1]

    def _request_at(self, method: str, path: str, *, resend: bool = True,
                    **kwargs: Any) -> tuple[int, httpx.Response]:
        """:meth:`_request` and the index of the orchestrator that answered (``_current`` read after it may be
        another thread's by then)."""
        failures: list[str] = []
        last: Optional[tuple[int, httpx.Response]] = None
        deadline = time.monotonic() + self.retry_s
        only = len(self._https) == 1
        refusals = _Refusals(len(self._https))
        for i in self._tries(refusals.not_before):
            if refusals.waiting(i):
                continue
            try:
                r = _send(self._https[i], deadline, only, method, path, **kwargs)
            except httpx.TransportError as e:
                if isinstance(e, httpx.ReadTimeout) and method != "GET":
                    self._raise_if_up(i, e)
                failures.append(f"{self.urls[i]}: {type(e).__name__}: {e}")
                last = None
                refusals.forget(i)
                if not resend and not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    break  # it may have been done there: done twice would leave one behind
                continue
            if not only and _queue_refusal(r):  # its queue is full: another's group may have room (nothing was done)
                failures.append(f"{self.urls[i]}: HTTP 429")
                refusals.add(i, r, r)
                continue
            refusals.forget(i)
            # a 502/504 (a proxy) may come after the request was done there; a 503 is the orchestrator's "not here"
            if r.status_code in _TRY_ANOTHER and (resend or r.status_code == 503) and not _told_not_to_retry(r):
                failures.append(f"{self.urls[i]}: HTTP {r.status_code}")
                last = (i, r)
                continue
            self._current = i
            return i, r
        if (refused := refusals.soonest()) is not None:  # each one's queue was full: when to come back
            last = refused
        if last is not None:  # the last answer was "cannot serve": its own error says why
            self._current = last[0]
            return last
        raise _unavailable(failures)

    def _raise_if_up(self, i: int, e: httpx.ReadTimeout) -> None:
        """After a generation's read timeout at orchestrator ``i``: ClientError 504 ``timeout`` if it is up."""
        if self._answers(i):
            # the generation just takes longer (queued on a busy swarm): sent to the next orchestrator it would wait
            # as long there, and again at each; it was cancelled here as the connection closed. One that does not
            # answer at all is another matter: the caller tries the next
            raise ClientError(504, f"{self.urls[i]} is up but sent no answer within the client's timeout "
                              f"({self._https[i].timeout.read} s); give a longer timeout= for long or queued "
                              "generations", "timeout") from e

    def _answers(self, i: int) -> bool:
        """Orchestrator ``i`` answers ``GET /healthz`` within a few seconds: it is up, not hung (its own 503, "no chain
        yet", counts as up; a proxy's 502 or 504 for it does not, nor one that is stopping: ``shutting_down``)."""
        try:
            wait = min(HEALTH_PROBE_S, self._https[i].timeout.read or HEALTH_PROBE_S)
            r = self._https[i].get("/healthz", timeout=wait)
        except httpx.TransportError:
            return False
        if r.status_code == 503:
            try:
                return not r.json().get("shutting_down")
            except (ValueError, AttributeError):
                return True
        return r.status_code < 500

    # ---- info ----
    @property
    def model(self) -> str:
        if self._model is None:
            r = self._request("GET", "/v1/models")
            _raise_for(r)
            self._model = _read_reply(r, lambda d: d["data"][0]["id"])
        return self._model

    def swarm(self) -> dict:
        """The orchestrator's ``GET /api/v1/swarm`` (servers, chains, queue, plan)."""
        r = self._request("GET", "/api/v1/swarm")
        _raise_for(r)
        return _json(r)

    def healthz(self) -> dict:
        r = self._request("GET", "/healthz")
        _raise_for(r)
        return _json(r)

    # ---- one-shot generation ----
    def complete(self, prompt: str | list[int], *, max_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, repetition_penalty: float = 1.0, seed: Optional[int] = None,
                 stop: Optional[list[str] | str] = None, **extra: Any) -> Completion:
        """Generate one completion (greedy unless ``temperature > 0``) and return it with its serving details."""
        prompt = _check_prompt(prompt)
        _one_completion(prompt, extra)
        _no_stream_switch(extra, False)
        output_type = _typed_format(extra)
        sampling = _sampling(max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, extra)
        body = {"model": self.model, "prompt": prompt, **sampling}
        r = self._request("POST", "/v1/completions", json=body)
        _raise_for(r)
        return _read_reply(r, lambda data: _one_shot(data, chat=False, output_type=output_type))

    def generate(self, prompt: str | list[int], **kwargs: Any) -> str:
        """The generated text (see :meth:`complete` for the arguments)."""
        return self.complete(prompt, **kwargs).text

    def stream(self, prompt: str | list[int], *, max_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, repetition_penalty: float = 1.0, seed: Optional[int] = None,
               stop: Optional[list[str] | str] = None, **extra: Any) -> Iterator[str]:
        """Yield text pieces as tokens are generated (server-sent events). Its arguments are checked at the call
        (it was at the first ``next()``); the request goes out at the first ``next()``."""
        prompt = _check_prompt(prompt)
        _one_completion(prompt, extra)
        _no_stream_switch(extra, True)
        _typed_format(extra)
        sampling = _sampling(max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, extra)
        return self._stream(prompt, sampling, reproducible=temperature == 0 or seed is not None)

    def _stream(self, prompt: str | list[int], sampling: dict, reproducible: bool) -> Iterator[str]:
        """:meth:`stream`'s pieces, its arguments checked."""
        body = {"model": self.model, "prompt": prompt, "stream": True, **sampling}
        sent = ""  # text yielded so far (a resumed stream skips it)
        failures: list[str] = []
        last_error: Optional[ClientError] = None
        deadline = time.monotonic() + self.retry_s
        only = len(self._https) == 1
        refusals = _Refusals(len(self._https))
        for i in self._tries(refusals.not_before):
            if refusals.waiting(i):
                continue
            skip = len(sent)
            try:
                with _open_stream(self._https[i], deadline, only, "/v1/completions", body) as r:
                    if r.status_code >= 400:
                        try:
                            _raise_for(r)
                        except ClientError as e:
                            if not only and _queue_refusal(r):  # its queue is full: another's group may have room
                                failures.append(f"{self.urls[i]}: HTTP 429")
                                refusals.add(i, r, e)
                                continue
                            if r.status_code not in _TRY_ANOTHER or _told_not_to_retry(r):
                                raise
                            refusals.forget(i)
                            failures.append(f"{self.urls[i]}: HTTP {r.status_code}")
                            last_error = e
                            continue
                    refusals.forget(i)
                    self._current = i
                    try:
                        for obj in _iter_sse(r):
                            for ch in obj.get("choices", []):
                                text = ch.get("text") or ""
                                if skip:  # already yielded before the first orchestrator was lost
                                    cut, at = min(skip, len(text)), len(sent) - skip
                                    if text[:cut] != sent[at:at + cut]:  # else the caller got two runs spliced
                                        raise _resume_mismatch(self.urls[i], f"{text[:cut]!r} where the stream had "
                                                               f"{sent[at:at + cut]!r}")
                                    text, skip = text[cut:], skip - cut
                                if text:
                                    sent += text
                                    yield text
                        if skip:
                            raise _resume_mismatch(self.urls[i], f"it ended {skip} characters short of the text "
                                                   "already yielded")
                    except ClientError as e:  # an error event: "no chain here" is another orchestrator's to try
                        if e.status != 503 or (sent and not reproducible):
                            raise
                        failures.append(f"{self.urls[i]}: {e}")
                        last_error = e
                        continue
                    return
            except httpx.TransportError as e:
                if isinstance(e, httpx.ReadTimeout) and not sent:  # no event within the timeout: as for a one-shot
                    self._raise_if_up(i, e)  # request (after text came, a stall is a stream cut off: below)
                failures.append(f"{self.urls[i]}: {type(e).__name__}: {e}")
                last_error = None
                refusals.forget(i)
                if sent and not reproducible:
                    raise ClientError(503, "the stream was cut off and cannot be resumed elsewhere: it samples "
                                      f"without a seed ({failures[-1]})", "unavailable") from e
        if (refused := refusals.soonest()) is not None:  # each one's queue was full: when to come back
            raise refused[1]
        if last_error is not None:
            raise last_error
        raise _unavailable(failures)

    def chat_completion(self, messages: list[dict], *, max_tokens: Optional[int] = None, temperature: float = 0.0,
                        top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0, seed: Optional[int] = None,
                        stop: Optional[list[str] | str] = None, **extra: Any) -> Completion:
        """One chat completion with its serving details (the orchestrator applies the model's chat template).
        ``max_tokens=None`` lets the answer run to its end of turn or the end of the context."""
        _check_messages(messages)
        _one_completion(None, extra)
        _no_stream_switch(extra, False)
        output_type = _typed_format(extra)
        sampling = _sampling(max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, extra)
        body = {"model": self.model, "messages": messages, **sampling}
        r = self._request("POST", "/v1/chat/completions", json=body)
        _raise_for(r)
        return _read_reply(r, lambda data: _one_shot(data, chat=True, output_type=output_type))

    def chat(self, messages: list[dict], *, max_tokens: Optional[int] = None, temperature: float = 0.0,
             **kwargs: Any) -> str:
        """The text of one chat completion (see :meth:`chat_completion`)."""
        return self.chat_completion(messages, max_tokens=max_tokens, temperature=temperature, **kwargs).text

    # ---- multi-turn ----
    def session(self, max_length: Optional[int] = None) -> "ClientSession":
        """A multi-turn session that keeps its KV between calls (held on its chain, or as the servers' cached prefix
        when the chain is given back between turns); use as a context manager."""
        return ClientSession(self, max_length)

    def close(self) -> None:
        for h in self._https:
            h.close()

    def __del__(self) -> None:
        # a Client dropped unclosed (AutoDistributedModelForCausalLM's has no other owner) left its pooled sockets
        # to the garbage collector: "ResourceWarning: unclosed <socket.socket ...>" each
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Closer:
    """One daemon thread per process that sends the DELETEs of sessions dropped unclosed
    (:meth:`ClientSession.__del__` only queues them: ``SimpleQueue.put`` is safe in a finalizer, a request is not)."""

    TIMEOUT_S = 5.0  # a dropped session's DELETE: best effort, the reaper's otherwise
    _queue: "queue.SimpleQueue[tuple[httpx.Client, str]]" = queue.SimpleQueue()
    _thread: Optional[threading.Thread] = None
    _lock = threading.Lock()

    @classmethod
    def _after_fork(cls) -> None:
        """In a forked child: none of the parent's thread, lock (another thread may have held it at the fork) or
        queued DELETEs (the parent sends those itself); the child's first session starts its own thread."""
        cls._queue, cls._thread, cls._lock = queue.SimpleQueue(), None, threading.Lock()

    @classmethod
    def start(cls) -> None:
        with cls._lock:
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._run, name="petals-chain-session-closer", daemon=True)
                cls._thread.start()

    @classmethod
    def put(cls, http: httpx.Client, path: str) -> None:
        cls._queue.put((http, path))

    @classmethod
    def _run(cls) -> None:
        while True:
            http, path = cls._queue.get()
            try:
                try:
                    http.delete(path, timeout=cls.TIMEOUT_S)
                except RuntimeError:  # its Client was dropped (closed) with it: a connection of its own, same key
                    with httpx.Client(base_url=http.base_url, headers=http.headers, timeout=cls.TIMEOUT_S) as once:
                        once.delete(path)
            except Exception:  # noqa: BLE001 - best effort: the reaper closes it in the end
                pass
            del http  # not held while waiting for the next one


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_Closer._after_fork)


class ClientSession:
    """A session opened on the orchestrator; every call continues the same token sequence. ``logprobs=k`` (0 to 20)
    asks a turn for its generated tokens' logprobs with k top alternatives, in ``/v1/completions``' format (chat
    turns too); ``last`` is the last turn's :class:`Completion` (None while a turn runs or after one failed)."""

    def __init__(self, client: Client, max_length: Optional[int] = None):
        self.client = client
        body: dict[str, Any] = {} if max_length is None else {"max_length": max_length}
        if client._model is not None:  # on an orchestrator of several models, the one asked for (not the first)
            body["model"] = client._model
        # the orchestrator that answered: client._current may be another thread's failover by the time it is read
        # (the session then went to an orchestrator that never held it: 404 session_not_found at every turn)
        self._index, r = client._request_at("POST", "/api/v1/sessions", json=body, resend=False)
        _raise_for(r)
        self._http = client._https[self._index]  # the session lives on this orchestrator
        self.id: str
        self.max_length: int
        self.id, self.max_length = _read_reply(r, lambda d: (d["session_id"], d["max_length"]))
        self.closed = False
        self.last: Optional[Completion] = None
        self._pid = os.getpid()  # a forked child's copy is the parent's session: never closed when the child drops it
        _Closer.start()  # ready for __del__, which must not start a thread (it may run inside the threading lock)

    def _body(self, prompt, input_ids, max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, extra,
              streams: bool = False, logprobs: Optional[int] = None):
        if prompt is not None and input_ids is not None:  # the prompt was dropped without a word
            raise ValueError("give prompt or input_ids, not both")
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"a session's prompt is text (token ids go in input_ids=), got {type(prompt).__name__} "
                            f"{prompt!r:.80}")
        ids = None if input_ids is None else _token_ids(input_ids)
        if input_ids is not None and ids is None:
            raise TypeError(f"input_ids must be a list of int, got {type(input_ids).__name__} {input_ids!r:.80}")
        _one_completion(prompt, extra)
        _no_stream_switch(extra, streams)
        body = _sampling(max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, extra)
        logprobs = _number("logprobs", logprobs, integer=True, optional=True)
        self.last = None  # never the previous turn's result (and logprobs) for this one
        if logprobs is not None:
            body["logprobs"] = logprobs
        if ids is not None:
            body["input_ids"] = ids
        elif prompt is not None:
            body["prompt"] = prompt
        return body

    def _timed_out(self, e: httpx.ReadTimeout) -> None:
        """A turn's read timeout: ClientError 504 ``timeout`` if the orchestrator is up, as for one-shot requests
        (it was 503 ``unavailable``: the turn just takes longer than the client's timeout)."""
        self.client._raise_if_up(self._index, e)

    def _deadline(self) -> float:
        """Until when a turn refused with ``Retry-After`` is sent again (the client's ``retry_s`` from now)."""
        return time.monotonic() + self.client.retry_s

    def _post(self, body: dict, output_type: Optional[type] = None) -> Completion:
        # a refused turn (429, 503) left the session as it was: sent again, it is the same turn
        with _transport_errors(self._http, self._timed_out):
            r = _send(self._http, self._deadline(), True, "POST", f"/api/v1/sessions/{self.id}/generate", json=body)
        _raise_for(r)
        self.last = _read_reply(r, lambda d: Completion(
            text=d["text"], token_ids=d["token_ids"], finish_reason=d["finish_reason"], usage=d["usage"],
            wait_s=d["wait_s"], service_s=d["service_s"], chain=d["chain"], failovers=d["failovers"],
            logprobs=d.get("logprobs"), output_type=output_type))
        return self.last

    def chat(self, content: str | list[dict], *, role: str = "user", max_tokens: Optional[int] = None,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
             seed: Optional[int] = None, stop: Optional[list[str] | str] = None, logprobs: Optional[int] = None,
             **extra: Any) -> Completion:
        """One chat turn: ``content`` (a ``role`` message) or a list of messages is added to the conversation and
        the assistant answers. The session's tokens always equal the whole conversation templated at once."""
        if not isinstance(content, str):
            _check_messages(content)
        messages = [{"role": role, "content": content}] if isinstance(content, str) else list(content)
        output_type = _typed_format(extra)
        body = self._body(None, None, max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, extra,
                          logprobs=logprobs)
        body["messages"] = messages
        return self._post(body, output_type)

    def complete(self, prompt: Optional[str] = None, *, input_ids: Optional[list[int]] = None, max_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
                 seed: Optional[int] = None, stop: Optional[list[str] | str] = None, logprobs: Optional[int] = None,
                 **extra: Any) -> Completion:
        """Append ``prompt`` (text) or ``input_ids`` to the session and generate."""
        output_type = _typed_format(extra)
        return self._post(self._body(prompt, input_ids, max_tokens, temperature, top_p, top_k, repetition_penalty,
                                     seed, stop, extra, logprobs=logprobs), output_type)

    def generate(self, prompt: Optional[str] = None, **kwargs: Any) -> str:
        """The generated text (see :meth:`complete`; ``last`` holds the whole turn, its logprobs too)."""
        return self.complete(prompt, **kwargs).text

    def stream(self, prompt: Optional[str] = None, *, input_ids: Optional[list[int]] = None, max_tokens: int = 16,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
               seed: Optional[int] = None, stop: Optional[list[str] | str] = None, logprobs: Optional[int] = None,
               **extra: Any) -> Iterator[str]:
        """Yield the turn's text pieces as they are generated; once the stream ends, ``last`` holds its text, token
        ids, finish_reason, usage and logprobs (the chunks' joined, as :meth:`complete` returns them)."""
        output_type = _typed_format(extra)
        body = self._body(prompt, input_ids, max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop,
                          extra, streams=True, logprobs=logprobs)
        body["stream"] = True
        return self._stream(body, logprobs, output_type)

    def _stream(self, body: dict, logprobs: Optional[int], output_type: Optional[type] = None) -> Iterator[str]:
        """:meth:`stream`'s pieces, its arguments checked (at the call: it was at the first ``next()``)."""
        pieces: list[str] = []
        ids: list[int] = []
        joined: Optional[dict[str, list]] = None if logprobs is None else {}  # this turn's chunks only
        finish, used = None, {}

        def timed_out(e: httpx.ReadTimeout) -> None:
            if not pieces:  # no text within the timeout: as for a one-shot request (after text, a stall is a cut)
                self._timed_out(e)

        with _transport_errors(self._http, timed_out), \
                _open_stream(self._http, self._deadline(), True, f"/api/v1/sessions/{self.id}/generate", body) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for(r)
            for obj in _iter_sse(r):
                finish = obj.get("finish_reason") or finish
                ids.extend(obj.get("token_ids") or ())
                used = obj.get("usage") or used
                if joined is not None and obj.get("logprobs"):
                    for key, values in obj["logprobs"].items():  # text_offset already runs on over the chunks
                        joined.setdefault(key, []).extend(values)
                if obj.get("text"):
                    pieces.append(obj["text"])
                    yield obj["text"]
        if joined is not None and not joined:  # nothing generated that has logprobs (e.g. a stop token at once)
            joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.last = Completion(text="".join(pieces), token_ids=ids, finish_reason=finish or "", usage=used,
                               logprobs=joined, output_type=output_type)

    def info(self) -> dict:
        with _transport_errors(self._http):
            r = self._http.get(f"/api/v1/sessions/{self.id}")
        _raise_for(r)
        return _json(r)

    def close(self) -> None:
        if self.closed:
            return
        with _transport_errors(self._http):  # a DELETE that never arrived leaves closed False: close() again
            r = self._http.delete(f"/api/v1/sessions/{self.id}")
        if r.status_code != 404:
            _raise_for(r)
        self.closed = True

    def __del__(self) -> None:
        # A session dropped unclosed held its place in its key's max_sessions (and the orchestrator's) until the
        # orchestrator's reaper, 5 min idle. Closed from a thread of its own: a DELETE here could block whatever
        # thread the garbage collector runs in (or deadlock it, inside the connection pool's lock); at interpreter
        # exit nothing is sent, nor from a forked child (a worker that replaced its inherited session closed the
        # parent's, which was still in use: 404 session_not_found at its next turn)
        try:
            if (not getattr(self, "closed", True) and getattr(self, "_pid", None) == os.getpid()
                    and not sys.is_finalizing()):
                _Closer.put(self._http, f"/api/v1/sessions/{self.id}")
        except Exception:  # noqa: BLE001 - best effort: the reaper closes it in the end
            pass

    def __enter__(self) -> "ClientSession":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # leaving on an error: that error is the caller's, not a failed close (the orchestrator may be gone)
            self.close()
        except ClientError:
            pass


class AutoTokenizer:
    """``AutoTokenizer.from_pretrained(model)`` for any model petals-chain serves (short name, .gguf, HF dir)."""

    @staticmethod
    def from_pretrained(model: str, **_: Any):
        from petals_chain.swarm.sources import resolve_source

        return resolve_source(model).load_tokenizer()


class AutoDistributedModelForCausalLM:
    """A ``transformers``-like model object whose ``generate`` runs in a petals-chain swarm.

    PETALS code ports by changing one import: ``from_pretrained(model, url=ORCHESTRATOR_URL)`` then
    ``generate(input_ids, max_new_tokens=..., do_sample=..., temperature=..., top_p=..., top_k=...,
    repetition_penalty=...)`` returns ``[batch, prompt + new]`` token ids like ``transformers``: rows that
    end early are right-padded with ``pad_token_id``; left padding in ``input_ids`` (with ``attention_mask``)
    is removed before sending. As in ``transformers``, sampling defaults to ``top_k=50``.
    """

    def __init__(self, client: "Client", model: str, pad_token_id: Optional[int] = None):
        self.client = client
        self.name_or_path = model
        self.pad_token_id = pad_token_id

    @classmethod
    def from_pretrained(cls, model: str, *, url: Optional[str] = None, api_key: Optional[str] = None,
                        timeout: float = 600.0, pad_token_id: Optional[int] = None,
                        **_: Any) -> "AutoDistributedModelForCausalLM":
        """``model``: the served model's name (or the orchestrator URL itself); ``url``: the orchestrator
        (default ``$PETALS_CHAIN_URL`` or ``http://127.0.0.1:8000``); ``api_key``: default ``$PETALS_CHAIN_API_KEY``."""
        import os

        if model.startswith(("http://", "https://")):
            url, model = model, None
        client = Client(url or os.environ.get("PETALS_CHAIN_URL", "http://127.0.0.1:8000"), timeout=timeout,
                        api_key=api_key or os.environ.get("PETALS_CHAIN_API_KEY"), model=model)
        return cls(client, model or client.model, pad_token_id)

    def generate(self, input_ids: Any, attention_mask: Any = None, *, max_new_tokens: int = 20,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 50,
                 repetition_penalty: float = 1.0, min_p: float = 0.0, seed: Optional[int] = None,
                 pad_token_id: Optional[int] = None, eos_token_id: Any = None, **unsupported: Any):
        """Generate for every row of ``input_ids`` (a LongTensor ``[batch, len]`` or lists of ids)."""
        import torch

        if unsupported:
            raise TypeError(f"generate() got unsupported arguments: {', '.join(sorted(unsupported))}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids.unsqueeze(0)
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).bool()
        prompts = [row[m].tolist() if mask is not None else row.tolist() for row, m in
                   zip(ids, mask if mask is not None else [None] * len(ids))]
        for name, value in (("temperature", temperature), ("top_p", top_p), ("repetition_penalty", repetition_penalty),
                            ("min_p", min_p)):
            if not math.isfinite(float(value)):  # it failed in httpx's JSON encoder, naming no argument
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        body: dict[str, Any] = {"model": self.client.model, "prompt": prompts, "max_tokens": int(max_new_tokens),
                                "repetition_penalty": float(repetition_penalty)}
        if do_sample:
            body.update(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k or 0),
                        min_p=float(min_p))
            if seed is not None:
                body["seed"] = int(seed)
        else:
            body["temperature"] = 0.0
        if eos_token_id is not None:
            stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
            body["stop_token_ids"] = [int(x) for x in stops]
        r = self.client._request("POST", "/v1/completions", json=body)
        _raise_for(r)
        new = _read_reply(r, lambda data: [info["token_ids"] for info in data["petals_chain"]])
        pad = pad_token_id if pad_token_id is not None else self.pad_token_id
        width = max(len(t) for t in new)
        if pad is None and any(len(t) != width for t in new):
            raise ValueError("rows ended at different lengths: give pad_token_id to pad them")
        out = [row.tolist() + t + [pad] * (width - len(t)) for row, t in zip(ids, new)]
        return torch.tensor(out, dtype=torch.long)
