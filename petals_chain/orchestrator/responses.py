"""OpenAI's Responses API (``POST /v1/responses``) on the wire: the response object and the server-sent events of a
streamed one, as the ``openai`` package parses them (``openai/types/responses``: ``Response``,
``ResponseStreamEvent``). The generation is chat's (api.py); this module only shapes what it produced.

One response holds one assistant message with one ``output_text`` part. A stream runs ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per piece of text, then ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (``response.incomplete`` when the output limit ended it);
every event carries its ``sequence_number`` (from 0). A failure ends it with ``response.failed`` and an ``error``
event, no cut stream. Nothing is stored (``store: false``): a response cannot be retrieved afterwards.

With tools (tools.py), a reply that took the call branch is one ``function_call`` output item per call (``id``
``fc_...``, ``call_id`` ``call_...``, ``name``, ``arguments`` as JSON text), and no message. Streamed
(:class:`ToolStream`), an item is added only once the reply shows what it is: a call's
``response.output_item.added`` (arguments empty), its ``response.function_call_arguments.delta`` events, then
``response.function_call_arguments.done`` and ``response.output_item.done`` before the next call's; a text reply's
message and part as above, with the text a possible call marker held back.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from petals_chain.orchestrator.sse import error_object, sse
from petals_chain.orchestrator.tools import HERMES, Call, CallFormat, CallScanner

# finish_reason -> (status, incomplete_details.reason); "length": the output limit (or the context's end) was reached
_ENDS = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens")}
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value this server has


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict:
    """The Responses API's usage object (``cached``: prompt tokens whose KV was not computed)."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def failure_code(status: int) -> str:
    """``response.error.code`` for a request that failed with HTTP ``status`` (the type admits a closed set)."""
    return "rate_limit_exceeded" if status == 429 else "server_error"


class ResponseBuilder:
    """The response object and the stream events of one request. ``echo``: the request's parameters a response
    repeats (instructions, metadata, temperature, ...), put in every response object it builds."""

    def __init__(self, model: str, echo: dict[str, Any]):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.echo = echo
        self.created_at = int(time.time())
        self.seq = 0  # the next event's sequence_number
        self.text: list[str] = []  # what the deltas carried
        self.logprobs: list[dict] = []
        self.call_ids: list[str] = []  # each function_call item's id (``fc_...``), by the call's index
        self.calls: Optional[CallScanner] = None  # a streamed reply with tools: its reading (ToolStream's)

    # ---- objects -------------------------------------------------------------------------------
    def message(self, text: str, status: str, logprobs: Optional[list[dict]] = None) -> dict:
        """The assistant message output item."""
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [self.part(text, logprobs)]}

    @staticmethod
    def part(text: str, logprobs: Optional[list[dict]] = None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def response(self, status: str, output: list[dict], *, usage_: Optional[dict] = None,
                 incomplete: Optional[str] = None, error: Optional[dict] = None,
                 extras: Optional[dict] = None) -> dict:
        """The response object in ``status`` (``extras``: this server's own fields, e.g. the deadline report)."""
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "completed_at": int(time.time()) if status == "completed" else None,
               "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
               "model": self.model, "output": output, "usage": usage_, **self.echo}
        if extras:
            out.update(extras)
        return out

    def call_item(self, index: int, call: Call, status: Optional[str] = None) -> dict:
        """The ``function_call`` output item of the reply's call ``index`` (``status``: ``completed`` once its JSON
        closed, else ``incomplete``)."""
        while len(self.call_ids) <= index:
            self.call_ids.append(f"fc_{uuid.uuid4().hex}")
        return {"id": self.call_ids[index], "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.arguments,
                "status": status or ("completed" if call.complete else "incomplete")}

    def finished(self, text: str, finish_reason: str, usage_: dict, logprobs: Optional[list[dict]] = None,
                 extras: Optional[dict] = None, calls: Optional[list[Call]] = None) -> dict:
        """The response of a generation that ended with ``finish_reason`` (non-streamed, or a stream's last event):
        its message, or its ``calls``' items when it took the call branch (none if cut before the first)."""
        status, incomplete = _ENDS.get(finish_reason, ("completed", None))
        output = [self.call_item(i, c) for i, c in enumerate(calls)] if calls is not None \
            else [self.message(text, status, logprobs)]
        return self.response(status, output, usage_=usage_, incomplete=incomplete, extras=extras)

    # ---- events --------------------------------------------------------------------------------
    def event(self, type_: str, **fields: Any) -> str:
        """One server-sent event (named, as OpenAI sends them) with the next sequence number."""
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(obj, event=type_)

    def opening(self, items: bool = True) -> str:
        """The events before the first text: the response created and in progress, then (``items``) its message
        and part added."""
        return (self.event("response.created", response=self.response("in_progress", []))
                + self.event("response.in_progress", response=self.response("in_progress", []))
                + (self.message_opening() if items else ""))

    def message_opening(self) -> str:
        """The message and its part added."""
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return (self.event("response.output_item.added", output_index=0,
                           item={**self.message("", "in_progress"), "content": []})
                + self.event("response.content_part.added", part=self.part(""), **at))

    def delta(self, text: str, logprobs: Optional[list[dict]] = None) -> str:
        """A piece of text (and its tokens' logprobs, when asked for); nothing for an empty piece without any."""
        if not text and not logprobs:
            return ""
        self.text.append(text)
        self.logprobs.extend(logprobs or [])
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=logprobs or [])

    def closing(self, finish_reason: str, usage_: dict, extras: Optional[dict] = None) -> str:
        """The events after the last text: the text, part and message done, then the response completed (or
        incomplete), with the text the deltas carried."""
        text = "".join(self.text)
        done = self.finished(text, finish_reason, usage_, self.logprobs, extras)
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return (self.event("response.output_text.done", text=text, logprobs=self.logprobs, **at)
                + self.event("response.content_part.done", part=self.part(text, self.logprobs), **at)
                + self.event("response.output_item.done", output_index=0, item=done["output"][0])
                + self.end(done))

    def end(self, done: dict) -> str:
        """The last event: the response completed, or incomplete."""
        return self.event("response.completed" if done["status"] == "completed" else "response.incomplete",
                          response=done)

    # ---- function calls -------------------------------------------------------------------------
    def call_added(self, index: int, call: Call) -> str:
        return self.event("response.output_item.added", output_index=index,
                          item={**self.call_item(index, call, "in_progress"), "arguments": ""})

    def call_delta(self, index: int, piece: str) -> str:
        return self.event("response.function_call_arguments.delta", item_id=self.call_ids[index], output_index=index,
                          delta=piece)

    def call_done(self, index: int, call: Call) -> str:
        """A call's arguments and item done (``incomplete`` when the reply was cut inside it)."""
        return (self.event("response.function_call_arguments.done", item_id=self.call_ids[index], output_index=index,
                           arguments=call.arguments)
                + self.event("response.output_item.done", output_index=index, item=self.call_item(index, call)))

    def failed(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               output: Optional[list[dict]] = None) -> str:
        """The end of a stream that failed: ``response.failed`` (its ``error``, and the message as far as it went),
        then the ``error`` event: the documented fields (``code``, ``message``, ``param``) and, as OpenAI's servers
        send it, the error object, with the HTTP status the request would have had (on it the openai package raises
        ``APIError``; the limits middleware answers a stream failed before admission with that status).
        ``output``: the response's output items, where not the text and calls this builder made."""
        err = error_object(status, message, param=param, code=code)["error"]
        if output is None:
            output = [self.message("".join(self.text), "incomplete", self.logprobs)] if self.text else []
            if self.calls is not None and self.calls.calls:  # the calls as far as they went: a whole one completed,
                output = [self.call_item(i, c) for i, c in enumerate(self.calls.calls)]  # as its item's done said
        failed = self.response("failed", output, error={"code": failure_code(status), "message": message})
        return (self.event("response.failed", response=failed)
                + self.event("error", code=code, message=message, param=param, error={**err, "status": status}))


class ToolStream:
    """The events of a streamed reply decoded with tools (``layout``, ``fmt``: its :class:`~.tools.ToolSet`'s): the
    reply's text read by a :class:`~.tools.CallScanner` into a message's deltas or calls' items (the module's
    docstring), over ``shape``'s numbering and ids."""

    def __init__(self, shape: ResponseBuilder, layout: str, fmt: CallFormat = HERMES):
        self.shape = shape
        self.scanner = shape.calls = CallScanner(layout, fmt)
        self.message_open = False
        self.pending: list[dict] = []  # logprobs of text held back (a possible call marker), sent with the text

    def opening(self) -> str:
        return self.shape.opening(items=False)

    def feed(self, text: str, logprobs: Optional[list[dict]] = None) -> str:
        """The events of the reply's next piece of text."""
        self.pending += logprobs or []
        return self._events(self.scanner.feed(text))

    def _events(self, events: list[tuple]) -> str:
        shape, out = self.shape, []
        for e in events:
            if e[0] == "content":
                if not self.message_open:
                    self.message_open = True
                    out.append(shape.message_opening())
                out.append(shape.delta(e[1], self.pending))
                self.pending = []
            elif e[0] == "call":
                if e[1] > 0:
                    out.append(shape.call_done(e[1] - 1, self.scanner.calls[e[1] - 1]))
                out.append(shape.call_added(e[1], self.scanner.calls[e[1]]))
            else:
                out.append(shape.call_delta(e[1], e[2]))
        return "".join(out)

    def closing(self, finish_reason: str, usage_: dict, extras: Optional[dict] = None) -> str:
        """The reply's last events: its last call's (or its message's) done, then the response's end."""
        shape, out = self.shape, [self._events(self.scanner.finish())]
        calls = self.scanner.calls
        if self.scanner.is_calls:
            if calls:
                out.append(shape.call_done(len(calls) - 1, calls[-1]))
            out.append(shape.end(shape.finished("", finish_reason, usage_, extras=extras, calls=calls)))
            return "".join(out)
        if not self.message_open:  # an empty text reply: its message, with nothing in it
            out.append(shape.message_opening())
        if self.pending:
            shape.logprobs.extend(self.pending)
            self.pending = []
        return "".join(out) + shape.closing(finish_reason, usage_, extras)
