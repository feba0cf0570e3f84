"""Finishing a streamed completion that another orchestrator cut off (forward.py relays it; that one died).

A stream whose output is reproducible (greedy, ``top_k`` 1, or seeded) is run again where a chain is (this
orchestrator once its group has one, or a third), and the rerun's events are passed on without what the client
already has: each choice's text and logprob entries are counted as they are delivered, the rerun's are checked
against them, and only what is new goes on, under the first run's id. A rerun that does not repeat the text ends
the stream with an error event (``resume_mismatch``) rather than a corrupted text; a stream that samples without a
seed ends with one (``stream_cut``) at once. The deadline a client gave keeps counting from its first arrival.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import re
import secrets
import ssl
import time
from typing import Any, AsyncIterator, Callable, Optional

import httpx

from petals_chain.orchestrator import sse
from petals_chain.orchestrator.deadlines import MAX_DEADLINE_MS
from petals_chain.orchestrator.responses import ResponseBuilder, failure_code
from petals_chain.orchestrator.sampling import GREEDY_BELOW_TEMPERATURE
from petals_chain.orchestrator.sse import NO_RETRY_HEADER
from petals_chain.swarm.media import is_event_stream

logger = logging.getLogger(__name__)

RESUME_S = 60.0  # how long a cut stream looks for somewhere to finish (a lost group moves within ~30 s)
RESUME_PAUSE_S = 1.0  # between its tries
TICK_S = 1.0  # how often a silent stream checks that the orchestrator sending it is alive
KEEPALIVE_S = 10.0  # an SSE comment to the client after this long without a byte (proxies drop idle streams)
# A stream this process reruns on itself is already counted in its client's requests under way: the header, with a
# secret only this process knows, lets it past the per-client cap once more (limits.py); forged, it is ignored.
RESUME_HEADER = "x-petals-chain-resume"
_RESUME_SECRET = secrets.token_urlsafe(24)
RESUMABLE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_RESPONSES_PATH = "/v1/responses"  # its stream is the Responses API's named events: ResponsesRecord
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DONE = sse.DONE.encode()
_KEEPALIVE = b": waiting to finish this stream\n\n"


@functools.cache
def client_tls() -> ssl.SSLContext:
    """The TLS settings of the connections to other orchestrators (forwards and reruns), made once (httpx's
    defaults: certifi's CAs, or ``SSL_CERT_FILE``): a client made with its own read and parsed the CA bundle, ~20 ms
    of CPU on the event loop, for each request forwarded and each rerun of a cut stream."""
    return httpx.create_ssl_context()


def resume_headers() -> dict[str, str]:
    """The header marking a rerun on this process (never sent to another orchestrator)."""
    return {RESUME_HEADER: _RESUME_SECRET}


def is_resume(headers: Any) -> bool:
    """Whether a request is this process rerunning a cut stream on itself (see :data:`RESUME_HEADER`)."""
    return hmac.compare_digest(str(headers.get(RESUME_HEADER, "")).encode(), _RESUME_SECRET.encode())


class Cut(Exception):
    """The orchestrator sending a stream stopped refreshing its group record while the stream was silent, or ended
    it because it stops (an error event :data:`SHUTTING_DOWN`)."""


# The error code of a request an orchestrator does not serve or finish because it stops (core.ShuttingDown): a
# stream it ends so is cut as a lost orchestrator's is (it was a TCP reset), finished elsewhere
SHUTTING_DOWN = "shutting_down"


class _Mismatch(Exception):
    """A rerun did not repeat what the client already has."""


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole server-sent events (LF line ends, each with its blank-line end) from a byte stream; a partial last one
    is dropped."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while (m := _EVENT_END.search(buf)) is not None:
            yield buf[:m.start()].replace(b"\r\n", b"\n") + b"\n\n"
            buf = buf[m.end():]


async def ticking(items: AsyncIterator[Any], every: float = TICK_S) -> AsyncIterator[Any]:
    """``items``, with a None each ``every`` seconds none comes (so a caller can look around while it waits)."""
    it = items.__aiter__()
    pending: Optional[asyncio.Future] = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


def _num(value: Any, default: float) -> float:
    return default if value is None else float(value)


def _lp_entries(lp: Any) -> Optional[list]:
    """A choice's logprob entries in stream order (completions: ``tokens``; chat: ``content``), or None."""
    if not isinstance(lp, dict):
        return None
    entries = lp.get("tokens") if "tokens" in lp else lp.get("content")
    return entries if isinstance(entries, list) else None


def _lp_from(lp: dict, k: int) -> dict:
    """``lp`` without its first ``k`` entries (every per-token list cut alike)."""
    if "tokens" in lp:
        return {key: (v[k:] if isinstance(v, list) else v) for key, v in lp.items()}
    return {**lp, "content": lp["content"][k:]}


class StreamRecord:
    """What a relayed completion stream gave its client, to finish it elsewhere without repeating any of it."""

    def __init__(self, body: dict, arrived: float) -> None:
        self.n = int(_num(body.get("n"), 1))
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        greedy = (_num(body.get("temperature"), 1.0) < GREEDY_BELOW_TEMPERATURE or _num(body.get("top_p"), 1.0) == 0
                  or body.get("top_k") == 1)
        self.reproducible = greedy or body.get("seed") is not None
        self.body = body
        self.arrived = arrived  # monotonic, at this orchestrator: a deadline counts from here
        self.text: dict[int, str] = {}  # choice index -> text delivered
        self.text_events: dict[int, int] = {}  # choice index -> events that delivered some of it
        self.echo = body.get("echo") is True  # a choice's first text is its prompt, not a generated token
        self.lps: dict[int, int] = {}  # choice index -> logprob entries delivered
        self.opened: set[int] = set()  # choices with an event delivered (a chat stream's role event comes once)
        # a chat stream's tool calls delivered: (choice, call index) -> [id, name, arguments]; the rerun's calls
        # have ids of their own, so its openings are dropped and its fragments trimmed as text is
        self.calls: dict[tuple[int, int], list] = {}
        self.ended: set[int] = set()  # choices whose finish_reason was delivered
        self.usage_sent = False
        self.head: dict[str, Any] = {}  # the first run's id and created time
        self.rerun = False  # events now come from a run of the request elsewhere
        self.at: dict[int, int] = {}  # this run: characters of each choice's text seen
        self.call_at: dict[tuple[int, int], int] = {}  # this run: characters of each call's arguments seen
        self.lp_at: dict[int, int] = {}  # this run: logprob entries of each choice seen
        self.finished = False  # [DONE] or an error event delivered
        self.finished_by: Optional[str] = None  # the URL of the rerun that finished it

    @classmethod
    def of(cls, method: str, path: str, body: bytes, status: int, headers: Any, arrived: float,
           defaults: Optional[dict] = None) -> Optional["StreamRecord"]:
        """A record when this reply is a completion stream the relay understands, else None (relayed as bytes).
        ``defaults``: the deadlines that apply where the body names none (the client's API key's), so a rerun
        keeps counting them from the first arrival instead of starting them again."""
        if (method != "POST" or path.rstrip("/") not in RESUMABLE_PATHS or status != 200
                or "content-encoding" in headers or not is_event_stream(headers)):
            return None
        try:
            req = json.loads(body)
            if not isinstance(req, dict) or req.get("stream") is not True:
                return None
            kind = ResponsesRecord if path.rstrip("/") == _RESPONSES_PATH else cls
            return kind(_with_defaults(req, defaults), arrived)
        except (ValueError, TypeError):
            return None

    @property
    def complete(self) -> bool:
        """Every choice ended (and the usage event came, if asked for): only ``[DONE]`` is missing."""
        return len(self.ended) >= self.n and (self.usage_sent or not self.include_usage)

    def restart(self) -> None:
        """A rerun begins: its events are matched against what was delivered from the start."""
        self.at, self.lp_at, self.call_at, self.rerun = {}, {}, {}, True

    def ending(self, status: int, code: str, message: str, type_: Optional[str] = None) -> bytes:
        """The events that end this stream when it cannot be finished."""
        return stream_ending(status, code, message, type_)

    def take(self, event: bytes) -> Optional[bytes]:
        """The event to pass on (of a rerun: without what the client has), or None; raises :class:`_Mismatch`."""
        payload = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if payload == b"[DONE]":
            self.finished = True
            return event
        try:
            obj = json.loads(payload)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            if "error" in obj:
                self.finished = True
                return event
            if not self.head:
                self.head = {k: obj[k] for k in ("id", "created") if k in obj}
            choices = obj.get("choices") or []
            kept = [c for c in choices if isinstance(c, dict) and self._trim(c)]
            usage = obj.get("usage") is not None
            if usage and self.rerun and self.usage_sent:
                obj = {**obj, "usage": None}
                usage = False
            self.usage_sent |= usage
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError):  # not ours to understand
            return None if self.rerun else event
        if not self.rerun:
            return event
        if not kept and not usage:
            return None
        return sse.sse({**obj, **self.head, "choices": kept}).encode()

    def _trim(self, choice: dict) -> bool:
        """Cut from ``choice`` what was already delivered (text and logprob entries); whether any of it goes on."""
        i = choice.get("index", 0)
        delta = choice.get("delta")
        holder, key = (delta, "content") if isinstance(delta, dict) else (choice, "text")
        text = holder.get(key) or ""
        at, have = self.at.get(i, 0), self.text.get(i, "")
        seen = min(len(text), max(0, len(have) - at))
        if text[:seen] != have[at:at + seen]:
            raise _Mismatch(f"choice {i}: the rerun gave {text[:seen]!r} where the client had {have[at:at + seen]!r}")
        self.at[i] = at + len(text)
        self.text[i] = have + text[seen:]
        if text[seen:]:
            self.text_events[i] = self.text_events.get(i, 0) + 1
        entries = _lp_entries(choice.get("logprobs"))
        n_lp = len(entries) if entries is not None else 0
        lp_at, lp_have = self.lp_at.get(i, 0), self.lps.get(i, 0)
        old_lp = min(n_lp, max(0, lp_have - lp_at))
        self.lp_at[i] = lp_at + n_lp
        self.lps[i] = lp_have + n_lp - old_lp
        ends = choice.get("finish_reason") is not None
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        new_calls = [c for c in calls if self._trim_call(i, c)] if isinstance(calls, list) else []
        if self.rerun:
            if ends and self.at[i] < len(self.text[i]):
                raise _Mismatch(f"choice {i}: the rerun ended after {self.at[i]} characters; the client had "
                                f"{len(self.text[i])}")
            short = [k for (j, k), call in self.calls.items() if j == i and self.call_at.get((j, k), -1) < len(call[2])]
            if ends and short:
                raise _Mismatch(f"choice {i}: the rerun ended before the end of tool call {short[0]} the client had")
            if isinstance(calls, list):
                if new_calls:
                    delta["tool_calls"] = new_calls
                else:
                    del delta["tool_calls"]
            new = (bool(text[seen:]) or n_lp > old_lp or (ends and i not in self.ended) or i not in self.opened
                   or bool(new_calls))
            if not new:
                return False
            if seen:
                holder[key] = text[seen:]
            if old_lp:
                choice["logprobs"] = _lp_from(choice["logprobs"], old_lp)
            if ends and i in self.ended:
                choice["finish_reason"] = None
        self.opened.add(i)
        if ends:
            self.ended.add(i)
        return True

    def _trim_call(self, i: int, call: Any) -> bool:
        """Cut from one of a chat delta's ``tool_calls`` entries what was already delivered (its opening: index, id
        and name; its arguments' fragments), in place; whether any of it goes on. Raises :class:`_Mismatch` when a
        rerun's call is not the one the client has (another function, other arguments)."""
        if not isinstance(call, dict) or not isinstance(call.get("index"), int):
            return True  # not ours to understand: passed on as it came
        key = (i, call["index"])
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        args = fn.get("arguments") if isinstance(fn.get("arguments"), str) else ""
        have = self.calls.get(key)
        opening = call.get("id") is not None or fn.get("name") is not None
        if have is None:
            have = self.calls[key] = [call.get("id"), fn.get("name"), ""]
        elif opening and self.rerun:
            if fn.get("name") is not None and fn.get("name") != have[1]:
                raise _Mismatch(f"choice {i}: the rerun called {fn.get('name')!r} as tool call {key[1]}; the client "
                                f"had {have[1]!r}")
            for k in ("id", "type"):  # the client's accumulation would append them to what it has
                call.pop(k, None)
            fn.pop("name", None)
            opening = False
        at = self.call_at.get(key, 0)
        seen = min(len(args), max(0, len(have[2]) - at))
        if args[:seen] != have[2][at:at + seen]:
            raise _Mismatch(f"choice {i}: the rerun gave tool call {key[1]} the arguments {args[:seen]!r} where the "
                            f"client had {have[2][at:at + seen]!r}")
        self.call_at[key] = at + len(args)
        have[2] += args[seen:]
        if seen and "arguments" in fn:
            fn["arguments"] = args[seen:]
        return opening or bool(args[seen:]) or not self.rerun

    @property
    def first_token_sent(self) -> bool:
        """A generated token reached the client (an echoed prompt is none): the TTFT deadline is spent."""
        return any(k > (1 if self.echo else 0) for k in self.text_events.values())

    def rerun_body(self) -> bytes:
        """The request to run again: its deadlines shortened by the time already gone (the TTFT one spent once a
        generated token was delivered); raises :class:`DeadlineGone` when one has passed (unless best effort)."""
        return json.dumps(_shortened(self.body, self.arrived, self.first_token_sent)).encode()

    def deadline(self) -> Optional[tuple[float, str]]:
        """``(monotonic time, field)`` of the nearest deadline that still applies to the stream (the TTFT one only
        until a generated token went out); None when none does or the request is best effort."""
        if self.body.get("best_effort") is True:
            return None
        fields = ("deadline_ms",) if self.first_token_sent else ("deadline_ms", "ttft_deadline_ms")
        due = [(self.arrived + ms / 1000.0, f) for f in fields
               if (ms := _ms(self.body.get(f))) is not None and ms == ms]  # (NaN: the API's validation answers it)
        return min(due) if due else None


class ResponsesRecord(StreamRecord):
    """What a relayed Responses API stream (``POST /v1/responses``) gave its client. Its events are named and
    numbered (``sequence_number`` from 0) and name the response and its output items (``id``, ``item_id``, a
    function call's ``call_id``, by ``output_index``): a rerun's go on under the first run's ids and numbers, its
    opening events (created, in progress, each item and part added) and the text and call arguments the client has
    left out. A rerun whose item at an index is another (a message for a call, another function) is a mismatch. No
    ``[DONE]``: ``response.completed`` / ``response.incomplete`` end it. A ``response.failed`` is held until its
    ``error`` event (a shutdown's cut or a lost chain there is rerun, not shown)."""

    _OPENING = ("response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added")
    _ENDS = ("response.completed", "response.incomplete")
    # the events that end what an item holds: the rerun must have given all of it the client has by then
    _ITEM_ENDS = ("response.output_text.done", "response.content_part.done", "response.output_item.done",
                  "response.function_call_arguments.done")

    def __init__(self, body: dict, arrived: float) -> None:
        super().__init__({**body, "n": 1, "stream_options": None}, arrived)
        self.body = body
        self.seq = 0  # the next sequence_number the client gets
        self.response_id: Optional[str] = None
        self.created_at: Any = None
        # the client's output items by output_index: id, type, and a function call's call_id and name
        self.items: dict[int, dict] = {}
        self.args: dict[int, str] = {}  # output_index -> a function call's arguments delivered
        self.args_at: dict[int, int] = {}  # this run: characters of each call's arguments seen
        self.added: set[int] = set()  # this run: the output indexes whose item was added
        self.sent: set[tuple[str, int]] = set()  # the (kind, output_index) of events delivered, but deltas
        self.held: Optional[dict] = None  # a response.failed until its error event
        self.lp_entries: list = []  # the logprob entries delivered (a failed response made here carries them)

    @property
    def item_id(self) -> Optional[str]:
        """The first output item's id (a text reply's message)."""
        return self.items.get(0, {}).get("id")

    @property
    def complete(self) -> bool:
        return False  # its last event ends it (finished): nothing but it is ever missing

    def restart(self) -> None:
        super().restart()
        self.held, self.args_at, self.added = None, {}, set()

    def take(self, event: bytes) -> Optional[bytes]:
        payload = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        try:
            obj = json.loads(payload)
            kind = obj["type"]
            if not isinstance(kind, str) or not isinstance(obj.get("sequence_number", 0), int):
                raise ValueError("not an event of the Responses API")
        except (ValueError, TypeError, KeyError, RecursionError):  # not ours to understand
            return None if self.rerun else event
        if kind == "response.failed":
            self.held = obj
            return None
        if kind == "error":
            self.finished = True
            held, self.held = self.held, None
            return b"".join(self._out(o) for o in (held, obj) if o is not None)
        index = obj.get("output_index", 0)
        index = index if isinstance(index, int) and not isinstance(index, bool) else 0
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            obj = self._delta(kind, index, obj, payload)
            if obj is None:
                return None
        else:
            if self.rerun and kind not in self._OPENING:
                self._check_whole(list(self.items) if kind in self._ENDS else [index]
                                  if kind in self._ITEM_ENDS else [])
            if kind == "response.output_item.added":
                self._added(index, obj)
            # each of these comes once in a response (opening and closing ones alike): a rerun's repeat of one the
            # client has is dropped (cut after output_text.done, the rerun sent it, the part's and item's again)
            key = (kind, index if "output_index" in obj else -1)
            if key in self.sent and self.rerun:
                return None
            self.sent.add(key)
            if kind in self._OPENING:
                self._learn(obj, index)
        if kind in self._ENDS:
            self.finished = True
        return self._out(obj) if self.rerun else self._seen(obj, event)

    def _delta(self, kind: str, index: int, obj: dict, payload: bytes) -> Optional[dict]:
        """A text or arguments delta without what the client has of it (None: nothing new); raises
        :class:`_Mismatch` when it disagrees with that."""
        text = obj.get("delta") or ""
        lps = (obj.get("logprobs") or []) if kind == "response.output_text.delta" else []
        if not isinstance(text, str) or not isinstance(lps, list):
            if not self.rerun:  # not ours to understand
                return obj
            raise _Mismatch(f"a delta event the relay does not understand: {payload[:200]!r}")
        calls = kind == "response.function_call_arguments.delta"
        seen_at, have = (self.args_at, self.args) if calls else (self.at, self.text)
        at, had = seen_at.get(index, 0), have.get(index, "")
        seen = min(len(text), max(0, len(had) - at))
        if text[:seen] != had[at:at + seen]:
            raise _Mismatch(f"the rerun gave {text[:seen]!r} where the client had {had[at:at + seen]!r}")
        done = "response.function_call_arguments.done" if calls else "response.output_text.done"
        if self.rerun and text[seen:] and (done, index) in self.sent:
            raise _Mismatch(f"the rerun gave more text ({text[seen:]!r}) than the client had when it ended")
        lp_at, lp_have = self.lp_at.get(0, 0), len(self.lp_entries)
        old_lp = min(len(lps), max(0, lp_have - lp_at))
        seen_at[index], self.lp_at[0] = at + len(text), lp_at + len(lps)
        if not text[seen:] and len(lps) == old_lp:
            return None
        have[index] = had + text[seen:]
        self.lp_entries += lps[old_lp:]
        if text[seen:]:
            self.text_events[0] = self.text_events.get(0, 0) + 1  # a generated token went out (the TTFT's)
        return {**obj, "delta": text[seen:], **({} if calls else {"logprobs": lps[old_lp:]})}

    def _check_whole(self, indexes: list[int]) -> None:
        """A rerun at the end of these items gave all the client has of them."""
        for i in indexes:
            if i in self.items and i not in self.added:
                raise _Mismatch(f"the rerun ended without output item {i}, which the client has")
            for seen_at, have, what in ((self.at, self.text, "characters"), (self.args_at, self.args,
                                                                              "characters of arguments")):
                if seen_at.get(i, 0) < len(have.get(i, "")):
                    raise _Mismatch(f"the rerun ended after {seen_at.get(i, 0)} {what}; the client had "
                                    f"{len(have[i])}")

    def _added(self, index: int, obj: dict) -> None:
        """An item added: a rerun's must be the one the client has at its index (a message, the same function)."""
        self.added.add(index)
        item, have = obj.get("item"), self.items.get(index)
        if not self.rerun or have is None or not isinstance(item, dict):
            return
        if item.get("type") != have.get("type") or item.get("name") != have.get("name"):
            raise _Mismatch(f"the rerun's output item {index} is {item.get('type')} {item.get('name')!r}; the client "
                            f"has {have.get('type')} {have.get('name')!r}")

    def _learn(self, obj: dict, index: int) -> None:
        """The first run's ids, from its opening events (an item first added by a rerun: the rerun's)."""
        response, item = obj.get("response"), obj.get("item")
        if isinstance(response, dict) and self.response_id is None:
            self.response_id, self.created_at = response.get("id"), response.get("created_at")
        if isinstance(item, dict) and index not in self.items:
            self.items[index] = {k: item.get(k) for k in ("id", "type", "call_id", "name")}
        if index not in self.items and isinstance(obj.get("item_id"), str):
            self.items[index] = {"id": obj["item_id"], "type": "message"}

    def _seen(self, obj: dict, event: bytes) -> bytes:
        """A first run's event, passed on as sent."""
        self.seq = max(self.seq, int(obj.get("sequence_number", self.seq)) + 1)
        return event

    def _ids(self, item: Any, index: int) -> Any:
        """A rerun's output item under the first run's ids (its id, a call's call_id)."""
        have = self.items.get(index)
        if not isinstance(item, dict) or have is None:
            return item
        out = {**item, "id": have["id"]}
        if have.get("call_id") is not None and "call_id" in item:
            out["call_id"] = have["call_id"]
        return out

    def _out(self, obj: dict) -> bytes:
        """``obj`` under the first run's ids, numbered next."""
        obj = {**obj, "sequence_number": self.seq}
        self.seq += 1
        if self.rerun:
            index = obj.get("output_index", 0) if isinstance(obj.get("output_index"), int) else 0
            if index in self.items:
                if "item_id" in obj:
                    obj["item_id"] = self.items[index]["id"]
                if isinstance(obj.get("item"), dict):
                    obj["item"] = self._ids(obj["item"], index)
            if isinstance(obj.get("response"), dict) and self.response_id is not None:
                response = {**obj["response"], "id": self.response_id, "created_at": self.created_at}
                if isinstance(response.get("output"), list):
                    response["output"] = [self._ids(o, j) for j, o in enumerate(response["output"])]
                obj["response"] = response
        return sse.sse(obj, event=obj["type"]).encode()

    def delivered_calls(self) -> list[dict]:
        """The function_call items the client has, as far as their arguments went: ``completed`` where its
        ``response.output_item.done`` went out (as that event said), else ``incomplete``."""
        return [{"id": item["id"], "type": "function_call", "call_id": item.get("call_id"), "name": item.get("name"),
                 "arguments": self.args.get(i, ""),
                 "status": "completed" if ("response.output_item.done", i) in self.sent else "incomplete"}
                for i, item in sorted(self.items.items()) if item.get("type") == "function_call"]

    def ending(self, status: int, code: str, message: str, type_: Optional[str] = None) -> bytes:
        """``response.failed`` (with the text or calls the client has) and an ``error`` event, numbered on: the
        Responses API's end of a failed stream, not chat's error object and ``[DONE]``."""
        self.finished = True
        text = self.text.get(0, "")
        output = [] if not text or self.item_id is None else [{
            "id": self.item_id, "type": "message", "role": "assistant", "status": "incomplete",
            "content": [ResponseBuilder.part(text, self.lp_entries)]}]
        output = self.delivered_calls() or output
        if self.response_id is None:  # cut before its first event: named here
            self.response_id, self.created_at = f"resp_{secrets.token_hex(16)}", int(time.time())
        tools = self.body.get("tools") if isinstance(self.body.get("tools"), list) else []
        failed = {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": "failed",
                  "error": {"code": failure_code(status), "message": message},
                  "incomplete_details": None, "model": self.body.get("model"), "output": output,
                  "parallel_tool_calls": bool(tools) and self.body.get("parallel_tool_calls") is not False,
                  "tool_choice": self.body.get("tool_choice") or ("auto" if tools else "none"), "tools": tools,
                  "metadata": {}, "instructions": self.body.get("instructions"),
                  "temperature": self.body.get("temperature"), "top_p": self.body.get("top_p")}
        err = sse.error_object(status, message, code=code, type_=type_)["error"]
        self.rerun = True  # numbered on, as a rerun's events
        return (self._out({"type": "response.failed", "response": failed})
                + self._out({"type": "error", "code": code, "message": message, "param": None,
                             "error": {**err, "status": status}}))


class DeadlineGone(Exception):
    """A deadline of the request passed before it could be sent on."""


def _with_defaults(body: dict, defaults: Optional[dict]) -> dict:
    """``body`` with ``defaults`` (the API key's deadlines) for the fields it leaves out or sets to null."""
    missing = {f: ms for f, ms in (defaults or {}).items() if ms is not None and body.get(f) is None}
    return {**body, **missing} if missing else body


def _shortened(body: dict, arrived: float, first_token_sent: bool = False) -> dict:
    out = dict(body)
    gone_ms = (time.monotonic() - arrived) * 1000.0
    for field in ("deadline_ms", "ttft_deadline_ms"):
        ms = out.get(field)
        if ms is None:
            continue
        if field == "ttft_deadline_ms" and first_token_sent:
            # its first token is with the client (met or missed already); left out, the field would take the key's
            # default again, counted afresh: the time to the last token (or the longest deadline) stands in for it
            out[field] = out.get("deadline_ms") or MAX_DEADLINE_MS
            continue
        if (value := _ms(ms)) is None:
            continue  # the API's validation answers it (float() made "5000" and true deadlines again)
        left = value - gone_ms
        if left <= 0:
            if out.get("best_effort") is not True:
                raise DeadlineGone(field)
            left = 1.0  # missed already, and served late as asked
        out[field] = left
    return out


def with_time_gone(body: bytes, arrived: float, defaults: Optional[dict] = None) -> bytes:
    """A JSON request body with its deadlines (its own, else ``defaults``: its API key's) shortened by the time since
    ``arrived`` (monotonic); unchanged if it is not a JSON object or none applies. Raises :class:`DeadlineGone`
    when one has passed (unless the request is ``best_effort``)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict):
        return body
    obj = _with_defaults(obj, defaults)
    if not any(obj.get(f) is not None for f in ("deadline_ms", "ttft_deadline_ms")):
        return body
    return json.dumps(_shortened(obj, arrived)).encode()


def first_deadline_s(body: bytes, defaults: Optional[dict] = None) -> Optional[float]:
    """The nearer of a JSON request body's deadlines (its own, else ``defaults``: its API key's) in seconds from its
    arrival; None when none applies, the request is ``best_effort``, or the body is not a JSON object (the API's
    validation answers those)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("best_effort") is True:
        return None
    obj = _with_defaults(obj, defaults)
    ms = [v for v in map(_ms, (obj.get("deadline_ms"), obj.get("ttft_deadline_ms"))) if v is not None and v == v]
    return min(ms) / 1000.0 if ms else None


def _ms(value: Any) -> Optional[float]:
    """A deadline field's number as a float; None for what is not a number, or an integer too large for one (a
    400-digit one raised OverflowError: a 500 for what the API's validation answers with a 400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def stream_ending(status: int, code: str, message: str, type_: Optional[str] = None) -> bytes:
    """The error event and ``[DONE]`` that end a stream which could not be finished."""
    return (sse.error_event(status, message, code=code, type_=type_) + sse.DONE).encode()


def _error_of(event: bytes) -> Optional[dict]:
    """An error event's error object, or None."""
    if b'"error"' not in event:
        return None
    try:
        err = json.loads(event.split(b"data:", 1)[1]).get("error")
    except (ValueError, IndexError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


async def relay_events(record: StreamRecord, chunks: AsyncIterator[bytes],
                       alive: Callable[[], bool]) -> AsyncIterator[bytes]:
    """``chunks``' whole events through ``record``; raises :class:`Cut` if the sender stops being ``alive()``
    while its stream is silent (its host gone with the connection open)."""
    async for event in ticking(sse_events(chunks)):
        if event is None:
            if not alive():
                raise Cut("it no longer refreshes its group record")
            continue
        if (err := _error_of(event)) is not None and err.get("code") == SHUTTING_DOWN:
            raise Cut(f"it stops: {err.get('message', '')}"[:300])
        if (out := record.take(event)) is not None:
            yield out


async def finish(record: StreamRecord, path: str, headers: dict,
                 where: Callable[[bool], tuple[Optional[str], bool]], alive: Callable[[str], bool],
                 lost: str) -> AsyncIterator[bytes]:
    """The rest of a stream cut off by ``lost``. ``where(local_refused)`` names where to rerun it now, ``(url,
    on_this_process)`` (after this process refused it, somewhere else if there is somewhere); ``alive(url)``: whether
    another orchestrator still refreshes its group record. Tries for up to :data:`RESUME_S` (503 ``stream_cut``),
    and never past the request's deadline (504 ``deadline_exceeded``, unless best effort)."""
    if record.complete:  # cut between its last event and [DONE]
        yield _DONE
        return
    if not record.reproducible:
        yield record.ending(503, "stream_cut", f"the orchestrator serving this stream ({lost}) was lost, and the "
                      "stream cannot be finished elsewhere: it samples without a seed")
        return
    give_up = time.monotonic() + RESUME_S
    why, local_refused, quiet_since = "no orchestrator with a chain", False, time.monotonic()
    tried = False  # a rerun was sent: ``why`` says how the last one ended
    while True:
        url, here = where(local_refused)
        if url is not None:
            sent = {**headers, **(resume_headers() if here else {})}
            try:
                body = record.rerun_body()
            except DeadlineGone as e:
                yield record.ending(504, "deadline_exceeded", f"the stream's {e} passed before it could be finished "
                              f"elsewhere (its orchestrator {lost} was lost{'; ' + why if tried else ''})")
                return
            record.restart()
            tried = True
            # the wait for the rerun's head (connecting, then its answer) ends at the deadline: a target that accepts
            # TCP but answers slowly held the stream past it (read=None: until it answered)
            due = record.deadline()
            left = None if due is None else max(0.001, due[0] - time.monotonic())
            try:
                # this process itself is reached at its local URL, which its certificate need not name
                tls = False if here else client_tls()
                async with httpx.AsyncClient(timeout=httpx.Timeout(10.0 if left is None else min(10.0, left),
                                                                   read=None), verify=tls) as client:
                    r = await asyncio.wait_for(client.send(client.build_request(
                        "POST", url.rstrip("/") + path, content=body, headers=sent), stream=True), left)
                    try:  # answered: a stream holding its chain is not cut at the deadline
                        if r.status_code != 200:
                            reply = await r.aread()
                            code, type_ = _reply_error(reply)
                            if code == "deadline_infeasible" and due is not None:
                                # the time left is too short for any chain: the request is late, not refused
                                yield record.ending(504, "deadline_exceeded", f"the stream's {due[1]} left too little "
                                                    f"time to finish it after its orchestrator {lost} was lost "
                                                    f"(its rerun at {url} was refused as infeasible)")
                                return
                            # doomed by the load now, with time left: the load may clear, or another orchestrator
                            # take it, so it is tried again until the deadline's 504 (a job that lost its chain here
                            # waits so), or RESUME_S's 503; passed on, a 429 inviting a retry ended a stream the
                            # client could not resume
                            later = code == "deadline_unreachable" and due is not None
                            if not later and (r.status_code not in (429, 502, 503, 504)
                                              or code in ("deadline_unreachable", "deadline_infeasible")
                                              or r.headers.get(NO_RETRY_HEADER, "").lower() == "false"):  # never fits
                                yield record.ending(r.status_code, code or "resume_refused", "the stream was cut off "
                                                    f"and its rerun at {url} was refused: "
                                                    f"{reply[:300].decode(errors='replace')}", type_)
                                return
                            why, local_refused = f"{url}: HTTP {r.status_code} {code}", here
                        else:
                            local_refused = False
                            async for event in ticking(sse_events(r.aiter_raw())):
                                if event is None:
                                    if not here and not alive(url):
                                        raise Cut(f"{url} no longer refreshes its group record")
                                    if time.monotonic() - quiet_since >= KEEPALIVE_S:
                                        quiet_since = time.monotonic()
                                        yield _KEEPALIVE
                                    continue
                                err = _error_of(event)
                                if err is not None and err.get("status") == 503:  # that group lost its chain too
                                    why = f"{url}: {err.get('message', 'unavailable')}"
                                    break
                                if (out := record.take(event)) is not None:
                                    quiet_since = time.monotonic()
                                    yield out
                                if record.finished:
                                    if err is None:
                                        record.finished_by = url
                                        logger.info("a cut forwarded stream was finished by %s", url)
                                    return
                            else:
                                why = f"{url}: its stream ended early"
                    finally:
                        await r.aclose()
            except _Mismatch as e:
                logger.error("a cut forwarded stream could not be finished: %s", e)
                yield record.ending(502, "resume_mismatch", "the stream was cut off and its rerun gave another text "
                              f"than the one already sent ({e})")
                return
            except (httpx.HTTPError, Cut) as e:
                why = f"{url}: {type(e).__name__}: {e}"
            except asyncio.TimeoutError:  # no head by the deadline (wait_for above): ended by the check below
                why = f"{url}: no answer before the deadline"
            if record.complete:
                yield _DONE
                return
        # ... and never past the request's deadline, as a request waiting for a chain here is dropped at it; read
        # each time: a rerun that delivered the first token spent the TTFT one
        due = record.deadline()
        due_at = due[0] if due is not None else math.inf
        if time.monotonic() >= due_at:
            yield record.ending(504, "deadline_exceeded", f"the stream's {due[1]} passed while no orchestrator could "
                                f"finish it (its orchestrator {lost} was lost; {why})")
            return
        if time.monotonic() >= give_up:
            yield record.ending(503, "stream_cut", f"the orchestrator serving this stream ({lost}) was lost and "
                          f"no other could finish it within {RESUME_S:.0f} s ({why})")
            return
        if time.monotonic() - quiet_since >= KEEPALIVE_S:
            quiet_since = time.monotonic()
            yield _KEEPALIVE
        await asyncio.sleep(min(RESUME_PAUSE_S, max(0.0, due_at - time.monotonic())))


def _reply_error(reply: bytes) -> tuple[str, Optional[str]]:
    """An error reply's ``(code, type)`` ("" and None where it names none)."""
    try:
        err = json.loads(reply).get("error") or {}
        return str(err.get("code") or ""), (str(err["type"]) if isinstance(err.get("type"), str) else None)
    except (ValueError, AttributeError):
        return "", None
