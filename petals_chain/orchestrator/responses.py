"""OpenAI's Responses API (``POST /v1/responses``) on the wire: the response object and the server-sent events of a
streamed one, as the ``openai`` package parses them (``openai/types/responses``: ``Response``,
``ResponseStreamEvent``). The generation is chat's (api.py); this module only shapes what it produced.

One response holds one assistant message with one ``output_text`` part. A stream runs ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per piece of text, then ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (``response.incomplete`` when the output limit ended it);
every event carries its ``sequence_number`` (from 0). A failure ends it with ``response.failed`` and an ``error``
event, no cut stream. Nothing is stored (``store: false``): a response cannot be retrieved afterwards.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from petals_chain.orchestrator.sse import error_object, sse

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

    def finished(self, text: str, finish_reason: str, usage_: dict, logprobs: Optional[list[dict]] = None,
                 extras: Optional[dict] = None) -> dict:
        """The response of a generation that ended with ``finish_reason`` (non-streamed, or a stream's last event)."""
        status, incomplete = _ENDS.get(finish_reason, ("completed", None))
        return self.response(status, [self.message(text, status, logprobs)], usage_=usage_, incomplete=incomplete,
                             extras=extras)

    # ---- events --------------------------------------------------------------------------------
    def event(self, type_: str, **fields: Any) -> str:
        """One server-sent event (named, as OpenAI sends them) with the next sequence number."""
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(obj, event=type_)

    def opening(self) -> str:
        """The events before the first text: the response created and in progress, its message and part added."""
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return (self.event("response.created", response=self.response("in_progress", []))
                + self.event("response.in_progress", response=self.response("in_progress", []))
                + self.event("response.output_item.added", output_index=0,
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
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        return (self.event("response.output_text.done", text=text, logprobs=self.logprobs, **at)
                + self.event("response.content_part.done", part=self.part(text, self.logprobs), **at)
                + self.event("response.output_item.done", output_index=0, item=done["output"][0])
                + self.event(kind, response=done))

    def failed(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> str:
        """The end of a stream that failed: ``response.failed`` (its ``error``, and the message as far as it went),
        then the ``error`` event: the documented fields (``code``, ``message``, ``param``) and, as OpenAI's servers
        send it, the error object, with the HTTP status the request would have had (on it the openai package raises
        ``APIError``; the limits middleware answers a stream failed before admission with that status)."""
        err = error_object(status, message, param=param, code=code)["error"]
        output = [self.message("".join(self.text), "incomplete", self.logprobs)] if self.text else []
        failed = self.response("failed", output, error={"code": failure_code(status), "message": message})
        return (self.event("response.failed", response=failed)
                + self.event("error", code=code, message=message, param=param, error={**err, "status": status}))
