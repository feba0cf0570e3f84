"""HTTP API of the orchestrator: OpenAI-compatible ``/v1``, sessions, swarm state, metrics, dashboard.

Requests are strict: an unknown field, or an OpenAI field we do not implement (audio, ``functions``, ...), gets a 400
that names it, never silent acceptance. Structured outputs (structured.py): chat's and completions'
``response_format`` (``json_object``, ``json_schema``), the Responses API's ``text.format``, and vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``). Beside OpenAI's fields the
bodies take ``repetition_penalty``, ``min_p``, ``top_k``, ``stop_token_ids`` and ``ignore_eos`` (vLLM's
extras), deadlines (``deadline_ms``, ``ttft_deadline_ms``, ``best_effort``) and ``speculative`` (``none`` or
``ngram``). Logprobs are of the raw model distribution (before penalties and temperature), as in vLLM; a
temperature below 1e-5 is greedy (vLLM's epsilon) and ``repetition_penalty`` is at least 0.001. Completions'
``logprobs`` takes 0 to 20 alternatives, as chat's ``top_logprobs`` (OpenAI's legacy endpoint stops at 5; vLLM
takes 20 too). A number sent as a string (``"n": "2"``) is a 400 as in OpenAI; an integral float (``2.0``) is read
as the integer.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import re
import sys
import time
import types
import typing
import uuid
from typing import Any, AsyncIterator, Callable, Literal, Optional, Union

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from petals_chain.orchestrator.adapters import ADAPTER
from petals_chain.orchestrator.auth import CLIENT
from petals_chain.orchestrator.deadlines import DEADLINE, MAX_DEADLINE_MS, RequestDeadline, key_defaults
from petals_chain.orchestrator.dispatch import ADMISSION
from petals_chain.orchestrator import embeddings as _embeddings
from petals_chain.orchestrator.embeddings import MAX_EMBEDDING_INPUTS
from petals_chain.orchestrator.core import Generation, Orchestrator, RequestError, ShuttingDown, Unavailable
from petals_chain.orchestrator.errors import (context_length_error, default_code, shown_model_name,
                                              unavailable_retry_after_s)
from petals_chain.orchestrator.forward import (SERVED_BY_HEADER, forward_session_call, maybe_forward,
                                               unless_disconnected)
from petals_chain.orchestrator.limits import GENERATE_PATH, ReadBodyRoute
from petals_chain.orchestrator import responses as _responses
from petals_chain.orchestrator.resume import ResponsesRecord
from petals_chain.orchestrator.request_id import (HEADER as REQUEST_ID_HEADER, RequestIds, RequestTrace,
                                                  install_log_ids, scope_request_id, shown_path)
from petals_chain.orchestrator.sampling import (IGNORE_EOS_WITH_GRAMMAR, MIN_REPETITION_PENALTY, SamplingParams,
                                                StopMatcher, TokenChoice, choice_seed, offsets_in_text)
from petals_chain.orchestrator.sessions import TURN_GRACE_S
from petals_chain.orchestrator.structured import (StructuredSpec, check_spec_async, compile_spec_async,
                                                  request_counter)
from petals_chain.orchestrator.sse import DONE, KEEPALIVE, NO_RETRY_HEADER, error_event, error_object, sse
from petals_chain.orchestrator.tokentext import whole_text
from petals_chain.orchestrator import tools as _tools
from petals_chain.orchestrator.tools import ToolSet, parse_tools
from petals_chain.orchestrator.stats import status_outcome
from petals_chain.swarm.aio import gather_or_cancel
from petals_chain.swarm.httpedge import DecodedBody, HeadAsGet
from petals_chain.swarm.jsonsafe import json_safe
from petals_chain.swarm.media import is_event_stream
from petals_chain.swarm.version import build_version

logger = logging.getLogger(__name__)

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_PROMPT_CHARS = 1_000_000
MAX_LOGIT_BIAS = 300
MAX_TOKEN_ID_DIGITS = 19  # int64
INLINE_TOKENIZE_CHARS = 2000  # longer texts are tokenized / templated off the event loop
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest of the context)
# A stream silent this long (queued, its prompt being scored) gets an SSE comment: proxies cut a stream with nothing
# on the wire for their read timeout (nginx's proxy_read_timeout: 60 s), and every SSE parser skips comments.
# The orchestrator's ``sse_keepalive_s`` overrides it (None or 0: none sent).
SSE_KEEPALIVE_S = 15.0
_API_PATH = re.compile(r"^/(v1/|api/v1/sessions|(de)?tokenize/?$)")


class _Base(pydantic.BaseModel):
    # Python's JSON reads NaN and Infinity: refused as not finite (a NaN temperature was "should be <= 2")
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """JSON ``null`` for a field with a default is that default (OpenAI types its optional parameters "... or
        null", and its client sends null for a parameter given as None); a required field stays required."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and not fields[k].is_required()
                            and fields[k].default is not None)}
            for k, v in data.items():
                _check_json_kind(k, v, fields[k].annotation if k in fields else None)
        return data


def _only(annotation: Any, kinds: tuple) -> bool:
    """Whether ``annotation`` (``Optional`` aside) admits only ``kinds``."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    args = [a for a in args if a is not type(None)]
    return bool(args) and all(a in kinds for a in args)


def _check_json_kind(name: str, value: Any, annotation: Any) -> None:
    """JSON's booleans, strings and numbers are not each other (OpenAI refuses them: "expected an integer, but got
    a string instead"): lax parsing read completions' ``logprobs: true`` as 1 alternative, ``n: true`` or ``n: "2"``
    as a number and ``echo: "yes"`` or chat's ``logprobs: 1`` as true; inside lists and objects too
    (``stop_token_ids: [true]`` was token 1, ``logit_bias: {"5": "1"}`` a bias of 1, ``prompt: ["1", 2]`` tokens).
    An integral float (``n: 2.0``) stays a number, as in pydantic (and vLLM)."""
    if value is None or annotation is None:
        return
    if isinstance(value, (bool, str)) and _only(annotation, (int, float)):
        raise FieldError(name, f"{name} must be a number, not {_shown(value)}")
    if not isinstance(value, bool) and _only(annotation, (bool,)):
        raise FieldError(name, f"{name} must be true or false, not {_shown(value)}")
    inner = _bool_for_number(value, annotation)
    if inner:
        path = ".".join([name, *map(str, inner[:-1])])
        raise FieldError(path, f"{path} must be a number, not {_shown(inner[-1])}")


def _shown(value: Any) -> str:
    """``value`` as an error quotes it: a scalar's JSON (40 characters at most), an array's or object's kind (their
    JSON can nest past the recursion limit: ``json.dumps`` raised RecursionError, a 500)."""
    if isinstance(value, (list, dict)):
        return _json_kind(value)
    return json.dumps(value[:40] if isinstance(value, str) else value)[:40]


def _members(annotation: Any) -> list:
    """The types ``annotation`` admits (a union's members, ``None`` left out), ``Annotated`` constraints dropped."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
            for a in args if a is not type(None)]


@functools.lru_cache(maxsize=256)
def _item_plan(annotation: Any, origin: type) -> tuple[Any, bool, bool, bool] | None:
    """What the items of an ``origin`` (list or dict) that ``annotation`` admits may be: ``(item annotation, whether
    a boolean there stands for a number, whether a string does, whether a string beside numbers does)``, None if it
    admits no such container. A string beside numbers: no one container type takes both (``prompt: ["1", 2]`` is
    no ``list[str]``, and lax parsing read it as ``list[int]``). Cached: a prompt of 100k one-token lists asked it
    per list, which took longer than pydantic's whole validation of the body."""
    items = [typing.get_args(m)[-1] for m in _members(annotation)
             if typing.get_origin(m) is origin and typing.get_args(m)]
    if not items:
        return None
    item = items[0] if len(items) == 1 else Union[tuple(items)]
    kinds = _members(item)
    if Any in kinds:
        return item, False, False, False
    each = [set(_members(i)) for i in items]
    numbers = [bool(k & {int, float}) for k in each]
    text = [str in k for k in each]
    return (item, any(numbers) and bool not in kinds, any(numbers) and not any(text),
            any(numbers) and not any(n and t for n, t in zip(numbers, text)))


def _bool_for_number(value: Any, annotation: Any) -> list | None:
    """Where in ``value`` (a list or dict) a JSON boolean or string stands for a number ``annotation`` takes there
    (pydantic's lax mode reads them as 0 or 1, or parses the string): that item's path, then the value; None if
    nowhere."""
    for container, origin, key_of in ((list, list, enumerate), (dict, dict, lambda d: d.items())):
        if not isinstance(value, container):
            continue
        try:
            plan = _item_plan(annotation, origin)
        except TypeError:  # an unhashable annotation: not cached
            plan = _item_plan.__wrapped__(annotation, origin)
        if plan is None:
            return None
        item, bools, strings, mixed = plan
        present = set(map(type, value if container is list else value.values()))  # at C speed: a prompt's ids
        text = str in present and (strings or mixed and bool(present & {int, float}))
        if not (bool in present and bools or text or list in present or dict in present):
            return None
        for key, v in key_of(value):
            if isinstance(v, bool):
                if bools:
                    return [key, v]
            elif isinstance(v, str):
                if text:
                    return [key, v]
            elif isinstance(v, (list, dict)) and (inner := _bool_for_number(v, item)) is not None:
                return [key, *inner]
    return None


class FieldError(ValueError):
    """A model validator's error about one field: ``param`` names it in the error object (a model validator's own
    location is the whole body)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _unsupported(value: Any, name: str, allowed: tuple = (None,), what: str | None = None) -> None:
    if value not in allowed:
        raise FieldError(name, f"{what or name} is not supported by this server")


class ResponsesStreamOptions(_Base):
    """``stream_options`` of ``/v1/responses`` (and, with ``include_usage``, of the other endpoints)."""
    # OpenAI pads its events with an ``obfuscation`` field unless this is false (the openai package types it for
    # every endpoint); ours carry none: false is what this server does, true is refused
    include_obfuscation: Optional[bool] = None

    @pydantic.model_validator(mode="after")
    def _no_obfuscation(self):
        _unsupported(self.include_obfuscation, "include_obfuscation", (None, False),
                     "stream obfuscation (include_obfuscation: true)")
        return self


class StreamOptions(ResponsesStreamOptions):
    include_usage: bool = False


class SamplingFields(_Base):
    """Sampling fields shared by every generation endpoint."""

    max_tokens: Optional[int] = pydantic.Field(default=None, ge=1)
    temperature: float = pydantic.Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = pydantic.Field(default=1.0, ge=0.0, le=1.0)  # 0: greedy (OpenAI takes 0..1)
    top_k: int = pydantic.Field(default=0, ge=-1, le=100_000)  # -1 (vLLM) and 0: disabled
    min_p: float = pydantic.Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = pydantic.Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=10.0)
    presence_penalty: float = pydantic.Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = pydantic.Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = pydantic.Field(default=None, ge=-2**63, le=2**63 - 1)  # OpenAI's int64
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[pydantic.NonNegativeInt]] = pydantic.Field(default=None, max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = pydantic.Field(default=1, ge=1)
    user: Optional[str] = pydantic.Field(default=None, max_length=256)  # end-user id (OpenAI): informational
    # Deadlines from arrival (orchestrator/deadlines.py); None: the API key's default, if any.
    # Strict: our own fields, so no OpenAI client sends them loosely typed; lax parsing read true as a 1 ms deadline
    deadline_ms: Optional[float] = pydantic.Field(default=None, gt=0, le=MAX_DEADLINE_MS, strict=True)
    ttft_deadline_ms: Optional[float] = pydantic.Field(default=None, gt=0, le=MAX_DEADLINE_MS, strict=True)
    best_effort: bool = pydantic.Field(default=False, strict=True)  # never refused or dropped: served, late if need be
    # Speculative decoding for this request (generation.py); None: the orchestrator's --speculative.
    speculative: Optional[Literal["none", "ngram", "draft"]] = None
    # How steps cross the chain for this request (relay.py); None: the orchestrator's --relay.
    relay: Optional[Literal["orchestrator", "push"]] = None
    # Structured outputs (structured.py): OpenAI's response_format (json_object, json_schema), vLLM's
    # structured_outputs (json, regex, choice, grammar); at most one of them
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    _spec: Optional[StructuredSpec] = pydantic.PrivateAttr(default=None)

    @pydantic.model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")  # as OpenAI
        return self

    @pydantic.model_validator(mode="after")
    def _structured_output(self):
        try:
            specs = self._specs()
        except RequestError as e:
            raise FieldError(e.param or "response_format", str(e)) from None
        self._set_spec(specs)
        return self

    def _specs(self) -> list:
        """The structured outputs the body's fields ask for (None for a field that asks for none)."""
        specs = [StructuredSpec.from_response_format(self.response_format)] if self.response_format is not None else []
        return specs + [StructuredSpec.from_structured_outputs(self.structured_outputs)]

    def _set_spec(self, specs: list) -> None:
        given = [s for s in specs if s is not None]
        if len(given) > 1:
            raise FieldError(given[1].param.split(".")[0], "give one structured output: "
                             f"{given[0].param.split('.')[0]} and {given[1].param.split('.')[0]} both constrain it")
        self._spec = given[0] if given else None

    @property
    def structured_spec(self) -> Optional[StructuredSpec]:
        """The structured output this request asks for (None: plain text)."""
        return self._spec

    @pydantic.field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_LEN} characters")
        return v

    @pydantic.field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for key, bias in v.items():
            # str.isdigit() takes "²" and "١", which int() misreads; int() refuses more than 4300 digits (a 500)
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return v

    @property
    def limit_field(self) -> str:
        """The body field the output limit came in, for errors: a chat request may send ``max_completion_tokens``
        (the chat API's newer name, copied into ``max_tokens``)."""
        return "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"

    def sampling(self, limit_tokens: int, default_max_tokens: int | None, logprobs: int | None = None
                 ) -> tuple[SamplingParams, bool]:
        """``(params, explicit)``; ``default_max_tokens`` None means the rest of the context."""
        explicit = self.max_tokens is not None
        max_tokens = self.max_tokens if explicit else (default_max_tokens or limit_tokens)
        if explicit and max_tokens > limit_tokens:
            raise RequestError(f"{self.limit_field} must be at most {limit_tokens}", param=self.limit_field,
                               code="integer_above_max_value")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        greedy = self.top_p == 0.0  # nucleus of probability 0: the most likely token alone
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0 if greedy else self.temperature, top_p=1.0 if greedy else self.top_p,
            top_k=max(0, self.top_k),
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=stop,
            logit_bias={int(k): float(b) for k, b in (self.logit_bias or {}).items()},
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            speculative=self.speculative, relay=self.relay)
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e), code="invalid_value") from None
        return params, explicit


class CompletionRequest(SamplingFields):
    model: str
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = pydantic.Field(default=None, ge=0, le=20)
    # 0: nothing generated (with echo and logprobs: the prompt's own logprobs, how evaluation harnesses score text)
    max_tokens: Optional[int] = pydantic.Field(default=None, ge=0)
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @pydantic.model_validator(mode="after")
    def _unsupported_fields(self):
        _unsupported(self.suffix, "suffix")
        _unsupported(self.best_of, "best_of", (None, 1), "best_of (other than 1)")
        return self


class PromptCacheBreakpoint(_Base):
    """OpenAI's explicit end of a cached prompt prefix (openai 3.x types it on text parts): a hint about OpenAI's
    cache; the servers' prefix caches find shared prefixes on their own, so it changes nothing here."""

    mode: Literal["explicit"]
    ttl: Optional[Literal["30m", "12h"]] = None


class PromptCacheOptions(_Base):
    """Chat's ``prompt_cache_options`` (openai 3.x): how OpenAI's prompt cache keeps prefixes; a hint, as above."""

    mode: Optional[Literal["implicit", "explicit"]] = None
    ttl: Optional[Literal["30m"]] = None


class ContentPart(_Base):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Optional[PromptCacheBreakpoint] = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":  # an image: said so, not "unknown field image_url"
            raise ValueError(f"only text content parts are supported, not {_shown(data.get('type'))}")
        return data


def text_or_parts(part: type, tag: str) -> Any:
    """A message's ``content``: a string or a list of ``part``. The member is picked by the value's type, where
    pydantic tried both and reported both (an image part was "content: Input should be a valid string; content.0:
    only text content parts ..."); ``tag`` is named as pydantic names the list member, so that _path leaves it out of
    an error's location."""
    def kind(value: Any) -> str | None:
        return "str" if isinstance(value, str) else tag if isinstance(value, list) else None

    return typing.Annotated[
        Union[typing.Annotated[str, pydantic.Tag("str")], typing.Annotated[list[part], pydantic.Tag(tag)]],
        pydantic.Discriminator(kind, custom_error_type="content_type",
                               custom_error_message="Input should be a string or an array of content parts")]


MessageContent = text_or_parts(ContentPart, "list[ContentPart]")


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "developer"]
    content: MessageContent
    name: Optional[str] = pydantic.Field(default=None, max_length=256)
    # what an OpenAI client's returned assistant message carries: taken back only empty (a conversation resent)
    refusal: Optional[str] = None
    tool_calls: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    annotations: Optional[list[Any]] = None
    # what the openai package's .parse() and .stream() return (ParsedChatCompletionMessage) carries besides: a
    # conversation resent with such a message was "unsupported parameter(s): messages.1.parsed"
    parsed: Optional[Any] = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_tool_results(cls, data: Any) -> Any:
        # a tool's result was "unsupported parameter(s): messages.1.tool_call_id" (its role refused only once that
        # was dropped): said for what it is
        if isinstance(data, dict) and data.get("role") in ("tool", "function"):
            raise FieldError("role", f"a message of role {json.dumps(data['role'])} (a tool's result) is not "
                                     "supported in a session's turn: it offers no tools (POST /v1/chat/completions "
                                     "takes tools and their results)")
        if isinstance(data, dict):
            # the assistant's tool call an OpenAI client sends back comes with content null: refused for its call,
            # not as "content: Input should be a valid string" (the after-validator runs only once content passed)
            for name in ("tool_calls", "function_call"):
                _unsupported(data.get(name), name, (None, [], ""), f"a message's {name}")
        return data

    @pydantic.model_validator(mode="after")
    def _no_tool_use(self):
        for name in ("refusal", "tool_calls", "function_call", "audio", "annotations", "parsed"):
            _unsupported(getattr(self, name), name, (None, [], ""), f"a message's {name}")
        return self

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionCall(_Base):
    """A call's function in an assistant message sent back: its name and its arguments (JSON text). The openai
    package's ``.parse()`` adds ``parsed_arguments``: what it read them as, nothing more."""

    name: str = pydantic.Field(min_length=1, max_length=64)
    arguments: str
    parsed_arguments: Optional[Any] = None


class ToolCall(_Base):
    """One of an assistant message's ``tool_calls`` (what a reply gave, sent back with the conversation). The openai
    package's ``chat.completions.stream()`` keeps the call's ``index`` in the stream: it changes nothing."""

    id: str = pydantic.Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: Optional[int] = pydantic.Field(default=None, ge=0)


class ToolChatMessage(ChatMessage):
    """A chat message of ``/v1/chat/completions``, where tools are offered (tools.py): also an assistant's
    ``tool_calls`` (``content`` null or text) and a tool's result (``role: "tool"`` with ``tool_call_id``)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[MessageContent] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = pydantic.Field(default=None, max_length=256)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_tool_results(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "function":  # the legacy functions API's result
            raise FieldError("role", 'a message of role "function" (the legacy functions API) is not supported: '
                                     'send tools, and results as role "tool"')
        if isinstance(data, dict):
            _unsupported(data.get("function_call"), "function_call", (None, ""), "a message's function_call")
        return data

    @pydantic.model_validator(mode="after")
    def _no_tool_use(self):
        for name in ("refusal", "function_call", "audio", "annotations", "parsed"):
            _unsupported(getattr(self, name), name, (None, [], ""), f"a message's {name}")
        if self.tool_calls and self.role != "assistant":
            raise FieldError("tool_calls", "only an assistant message has tool_calls")
        if self.role == "tool":
            if not self.tool_call_id:
                raise FieldError("tool_call_id", 'a message of role "tool" needs the tool_call_id it answers')
        elif self.tool_call_id is not None:
            raise FieldError("tool_call_id", 'only a message of role "tool" has a tool_call_id')
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("content", "content is required (null only in an assistant message with tool_calls)")
        return self

    def as_dict(self) -> dict:
        text = None if self.content is None else self.content if isinstance(self.content, str) \
            else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def uses_tools(self) -> bool:
        """A call or a result: the conversation needs tools.py's rendering."""
        return bool(self.tool_calls) or self.role == "tool"


class ChatRequest(SamplingFields):
    model: str
    messages: list[ToolChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: Optional[int] = pydantic.Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = pydantic.Field(default=None, ge=0, le=20)
    # the end-user id OpenAI's chat API now takes instead of ``user``: informational, as ``user``
    safety_identifier: Optional[str] = pydantic.Field(default=None, max_length=256)
    # OpenAI's prompt cache (the openai package types these, and the key as what replaces ``user``): hints only here,
    # where the servers' prefix caches reuse a shared prefix on their own; the output is the same with or without them
    prompt_cache_key: Optional[str] = pydantic.Field(default=None, max_length=1024)
    # "in-memory": what the openai packages typed before they followed the API ("in_memory"; openai-python#2912)
    prompt_cache_retention: Optional[Literal["in_memory", "in-memory", "24h"]] = None
    prompt_cache_options: Optional[PromptCacheOptions] = None
    # "medium" is OpenAI's default (what every reply here is); the others would change the output: refused
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    moderation: Optional[Any] = None
    # tool calling (tools.py), decoded under a grammar as structured outputs are
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    _tools: Optional[ToolSet] = pydantic.PrivateAttr(default=None)
    # OpenAI fields we do not implement: accepted only at their "off" values, else a 400 naming them.
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None

    @pydantic.model_validator(mode="after")
    def _unsupported_fields(self):
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options", "metadata",
                     "moderation"):
            _unsupported(getattr(self, name), name)
        # "none": no reasoning, what every reply here is (the openai package types it beside minimal ... max)
        _unsupported(self.reasoning_effort, "reasoning_effort", (None, "none"))
        if self.verbosity not in (None, "medium"):
            raise FieldError("verbosity", f"verbosity {self.verbosity!r} is not supported by this server (only "
                                          "'medium', OpenAI's default)")
        _unsupported(self.store, "store", (None, False))
        _unsupported(self.service_tier, "service_tier", (None, "auto", "default"))
        if self.modalities is not None and list(self.modalities) != ["text"]:
            raise FieldError("modalities", "modalities other than ['text'] are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise FieldError("max_completion_tokens", "max_tokens and max_completion_tokens disagree; give one")
        return self

    @pydantic.model_validator(mode="after")
    def _results_answer_calls(self):
        # as OpenAI: a tool's result with no call before it was rendered as the result of nothing
        called = False
        for i, m in enumerate(self.messages):
            called = called or bool(m.tool_calls)
            if m.role == "tool" and not called:
                raise FieldError(f"messages.{i}.role", "Invalid parameter: messages with role 'tool' must be a "
                                                       "response to a preceding message with 'tool_calls' (no "
                                                       f"assistant message before messages.{i} has tool_calls)")
        return self

    def _specs(self) -> list:
        # the tools' grammar is a structured output: one of them at most (tools.py)
        specs = super()._specs()
        self._tools = parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        return specs + [self._tools.spec() if self._tools is not None else None]

    @property
    def tool_set(self) -> Optional[ToolSet]:
        """The request's tools and tool_choice (None: no tools)."""
        return self._tools


class InputPart(_Base):
    """A text part of a Responses input message: ``input_text``, or the ``output_text`` of a response sent back (with
    the ``annotations`` and ``logprobs`` it came with: what the output said of itself, not part of the text)."""

    type: Literal["input_text", "output_text"]
    text: str
    prompt_cache_breakpoint: Optional[PromptCacheBreakpoint] = None
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in ("input_text", "output_text"):
            raise ValueError("only text parts (input_text, output_text) are supported by this server, not "
                             f"{_shown(data.get('type'))}")
        return data


InputContent = text_or_parts(InputPart, "list[InputPart]")
# why each kind of input item a client may send is not taken (the Responses API's other item types)
_ITEM_REFUSALS = {"item_reference": "this server stores no items", "reasoning": "this server does no reasoning"}


class InputMessage(_Base):
    """A message of a Responses ``input`` list: the SDK's easy input message, or a response's output message sent
    back in the next turn (with its ``id``, ``status`` and ``phase``, which change nothing)."""

    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: InputContent
    id: Optional[str] = pydantic.Field(default=None, max_length=256)
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _messages_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "message"):
            # a kind that is not a string (a list, an object) was a TypeError (unhashable) there: a 500
            why = _ITEM_REFUSALS.get(kind, "only messages are supported") if isinstance(kind, str) else \
                "only messages are supported"
            raise FieldError("type", f"input items of type {_shown(kind)} are not supported: {why} (messages, "
                                     "function_call and function_call_output are)")
        return data

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


def _direct_call(item: Any) -> Any:
    """``item`` (a call or its output), if it is a plain call's: no namespace (tool search), no program caller."""
    _unsupported(item.namespace, "namespace", (None,), "a namespace (tool search)")
    if item.caller is not None and item.caller != {"type": "direct"}:
        raise FieldError("caller", "only direct callers (caller {'type': 'direct'}) are supported")
    return item


class InputFunctionCall(_Base):
    """A ``function_call`` item sent back: a call a response made (the client ran it), rendered as chat's assistant
    ``tool_calls`` are. Its ``id`` and ``status`` change nothing."""

    type: Literal["function_call"]
    call_id: str = pydantic.Field(min_length=1, max_length=256)
    name: str = pydantic.Field(min_length=1, max_length=64)
    arguments: str
    id: Optional[str] = pydantic.Field(default=None, max_length=256)
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    namespace: Optional[str] = None
    caller: Optional[dict[str, Any]] = None

    @pydantic.model_validator(mode="after")
    def _direct_only(self):
        return _direct_call(self)

    def as_call(self) -> dict:
        """The call as chat's ``tool_calls`` entry."""
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class InputFunctionCallOutput(_Base):
    """A ``function_call_output`` item: a call's result, rendered as chat's ``role: "tool"`` message is (its text
    parts, if ``output`` is a list of them)."""

    type: Literal["function_call_output"]
    call_id: str = pydantic.Field(min_length=1, max_length=256)
    output: InputContent
    id: Optional[str] = pydantic.Field(default=None, max_length=256)
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    name: Optional[str] = pydantic.Field(default=None, max_length=64)
    namespace: Optional[str] = None
    caller: Optional[dict[str, Any]] = None

    @pydantic.model_validator(mode="after")
    def _direct_only(self):
        return _direct_call(self)

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


# the member of an input list an item is (by its type); tags as _path leaves them out of an error's location
_ITEM_TAGS = {"function_call": "dict[InputFunctionCall]", "function_call_output": "dict[InputFunctionCallOutput]"}


def _item_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    return _ITEM_TAGS.get(kind, "dict[InputMessage]") if isinstance(kind, str) else "dict[InputMessage]"


InputItem = typing.Annotated[
    Union[typing.Annotated[InputMessage, pydantic.Tag("dict[InputMessage]")],
          typing.Annotated[InputFunctionCall, pydantic.Tag("dict[InputFunctionCall]")],
          typing.Annotated[InputFunctionCallOutput, pydantic.Tag("dict[InputFunctionCallOutput]")]],
    pydantic.Discriminator(_item_kind)]


def _input_kind(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list[InputItem]" if isinstance(value, list) else None


ResponsesInput = typing.Annotated[
    Union[typing.Annotated[str, pydantic.Tag("str")],
          typing.Annotated[list[InputItem], pydantic.Tag("list[InputItem]"), pydantic.Field(min_length=1)]],
    pydantic.Discriminator(_input_kind, custom_error_type="input_type",
                           custom_error_message="Input should be a string or an array of input items")]


class ResponsesText(_Base):
    # text, json_object or json_schema (what responses.parse sends): read by StructuredSpec.from_text_format
    format: Optional[dict[str, Any]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None

    @pydantic.model_validator(mode="after")
    def _medium_only(self):
        if self.verbosity not in (None, "medium"):
            raise FieldError("verbosity", f"verbosity {self.verbosity!r} is not supported by this server (only "
                                          "'medium', OpenAI's default)")
        return self


class ResponsesReasoning(_Base):
    """``reasoning``: taken at "no reasoning" alone (what every reply here is)."""

    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None
    context: Optional[Literal["auto", "current_turn", "all_turns"]] = None  # which reasoning to keep: none here
    mode: Optional[Literal["standard"]] = None

    @pydantic.model_validator(mode="after")
    def _none_only(self):
        _unsupported(self.effort, "effort", (None, "none"), f"reasoning effort {self.effort!r} (only 'none')")
        for name in ("summary", "generate_summary"):
            _unsupported(getattr(self, name), name, (None,), f"a reasoning {name}")
        return self


class ResponsesPromptCacheOptions(_Base):
    """``prompt_cache_options``: hints about OpenAI's cache, as chat's (a comparison names a stored response)."""

    mode: Optional[Literal["implicit", "explicit"]] = None
    ttl: Optional[Literal["30m", "12h"]] = None
    prewarm: Optional[bool] = None
    comparison_response_id: Optional[str] = None

    @pydantic.model_validator(mode="after")
    def _nothing_stored(self):
        _unsupported(self.comparison_response_id, "comparison_response_id", (None,),
                     "comparison_response_id (this server stores no responses)")
        return self


MAX_METADATA = 16  # OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512
MAX_INCLUDE = 16


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``: a chat turn in the Responses API's words (``input``, ``instructions``,
    ``max_output_tokens``), with chat's sampling and our extra fields, and chat's tool calling (tools.py) in the
    Responses API's shapes: function ``tools``, ``function_call`` and ``function_call_output`` input items. What this
    server cannot do (built-in tools, stored responses and conversations, background runs, non-text input,
    reasoning) is refused, naming the field; what changes nothing here (cache hints, ``parallel_tool_calls`` without
    tools) is taken."""

    model: str
    input: ResponsesInput
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = pydantic.Field(default=None, ge=1)
    metadata: Optional[dict[str, str]] = None
    safety_identifier: Optional[str] = pydantic.Field(default=None, max_length=256)
    prompt_cache_key: Optional[str] = pydantic.Field(default=None, max_length=1024)
    prompt_cache_retention: Optional[Literal["in_memory", "in-memory", "24h"]] = None
    prompt_cache_options: Optional[ResponsesPromptCacheOptions] = None
    store: Optional[bool] = None
    text: Optional[ResponsesText] = None
    reasoning: Optional[ResponsesReasoning] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    parallel_tool_calls: Optional[bool] = None
    tool_choice: Optional[Any] = None
    tools: Optional[list[Any]] = None
    # OpenAI's limit on calls to built-in tools (none here; function calls are not counted): taken without tools
    max_tool_calls: Optional[int] = pydantic.Field(default=None, ge=1)
    _tools: Optional[ToolSet] = pydantic.PrivateAttr(default=None)
    top_logprobs: Optional[int] = pydantic.Field(default=None, ge=0, le=20)
    include: Optional[list[str]] = pydantic.Field(default=None, max_length=MAX_INCLUDE)
    service_tier: Optional[str] = None
    stream_options: Optional[ResponsesStreamOptions] = None  # type: ignore[assignment]  # the Responses API's own
    background: Optional[bool] = None
    # what needs stored state, or inputs and tools this server lacks: refused unless null
    previous_response_id: Optional[Any] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    context_management: Optional[Any] = None
    background_options: Optional[Any] = None
    image: Optional[Any] = None
    access_programs: Optional[Any] = None
    moderation: Optional[Any] = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _chat_names(cls, data: Any) -> Any:
        # chat's names for what the Responses API calls otherwise: told so (they were valid SamplingFields)
        if isinstance(data, dict):
            if data.get("max_tokens") is not None:
                raise FieldError("max_tokens", "the Responses API's output limit is max_output_tokens")
            if data.get("n") not in (None, 1):
                raise FieldError("n", "several choices (n) are not part of the Responses API: use "
                                      "/v1/chat/completions")
            if data.get("response_format") is not None:
                raise FieldError("response_format", "the Responses API's structured output is text.format")
        return data

    def _specs(self) -> list:
        # the tools' grammar is a structured output, as chat's: text.format beside it is refused (_text_format)
        self._tools = parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls, flat=True)
        return super()._specs() + [self._tools.spec() if self._tools is not None else None]

    @property
    def tool_set(self) -> Optional[ToolSet]:
        """The request's tools and tool_choice (None: no tools)."""
        return self._tools

    @pydantic.model_validator(mode="after")
    def _function_tools_counted_elsewhere(self):
        if self.max_tool_calls is not None and self.tools:
            raise FieldError("max_tool_calls", "max_tool_calls limits a response's calls to built-in tools (OpenAI's "
                                               "web search, file search, ...), which this server has none of; "
                                               "function calls are not counted by it, at OpenAI either. For at most "
                                               "one function call send parallel_tool_calls: false")
        return self

    @pydantic.model_validator(mode="after")
    def _outputs_answer_calls(self):
        # as OpenAI: an output must answer a call sent before it (it was rendered as a result of nothing), and once
        open_calls: dict[str, int] = {}  # call_id -> calls sent so far without their output
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            if isinstance(item, InputFunctionCall):
                open_calls[item.call_id] = open_calls.get(item.call_id, 0) + 1
            elif isinstance(item, InputFunctionCallOutput):
                left = open_calls.get(item.call_id)
                if left is None:
                    raise FieldError(f"input.{i}", "No tool call found for function call output with call_id "
                                                   f"{item.call_id}.")
                if left == 0:
                    raise FieldError(f"input.{i}", f"Duplicate function_call_output for call_id {item.call_id}: its "
                                                   "function_call has an output already (one output per call)")
                open_calls[item.call_id] = left - 1
        return self

    @property
    def uses_tools(self) -> bool:
        """The input holds calls or their results: the conversation needs tools.py's rendering."""
        return not isinstance(self.input, str) and any(not isinstance(m, InputMessage) for m in self.input)

    @pydantic.model_validator(mode="after")
    def _text_format(self):
        specs = [self._spec]
        if self.text is not None and self.text.format is not None:
            try:
                specs.append(StructuredSpec.from_text_format(self.text.format))
            except RequestError as e:
                raise FieldError(e.param or "text.format", str(e)) from None
        self._set_spec(specs)
        return self

    @pydantic.model_validator(mode="after")
    def _unsupported_fields(self):
        stored = "this server stores no responses or conversations"
        for name, why in (("previous_response_id", stored), ("conversation", stored),
                          ("prompt", "this server stores no prompts"), ("context_management", None),
                          ("background_options", None), ("image", None), ("access_programs", None),
                          ("moderation", None)):
            _unsupported(getattr(self, name), name, (None,), f"{name} ({why})" if why else None)
        _unsupported(self.background, "background", (None, False), "background responses (background: true)")
        _unsupported(self.store, "store", (None, False), "store: true (this server stores no responses; send "
                                                        "store: false or leave it out)")
        _unsupported(self.truncation, "truncation", (None, "disabled"), "truncation 'auto'")
        _unsupported(self.service_tier, "service_tier", (None, "auto", "default"))
        for i, item in enumerate(self.include or []):
            if item != _responses.LOGPROBS_INCLUDE:
                raise FieldError(f"include.{i}", f"include {_shown(item)} is not supported by this server (only "
                                                 f"'{_responses.LOGPROBS_INCLUDE}')")
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA:
                raise FieldError("metadata", f"at most {MAX_METADATA} metadata pairs")
            long = next((k for k, v in self.metadata.items() if len(k) > 64 or len(v) > 512), None)
            if long is not None:
                raise FieldError("metadata", f"metadata keys are at most 64 characters and values at most 512 "
                                             f"({_shown(long)})")
        return self

    @property
    def limit_field(self) -> str:
        return "max_output_tokens"

    @property
    def top(self) -> Optional[int]:
        """The logprobs asked for: how many alternatives per token (None: none asked for)."""
        if _responses.LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    def messages(self) -> list[dict]:
        """The conversation the chat template renders: ``instructions`` as its system message first; as chat's
        messages with tools: ``function_call`` items the ``tool_calls`` of one assistant message (with the
        assistant's message just before them, as a response gives them), a ``function_call_output`` a ``role:
        "tool"`` message."""
        sent: list[dict] = []
        for m in [self.input] if isinstance(self.input, str) else self.input:
            if isinstance(m, str):
                sent.append({"role": "user", "content": m})
            elif isinstance(m, InputFunctionCall):
                if sent and sent[-1]["role"] == "assistant":
                    sent[-1].setdefault("tool_calls", []).append(m.as_call())
                else:
                    sent.append({"role": "assistant", "content": None, "tool_calls": [m.as_call()]})
            elif isinstance(m, InputFunctionCallOutput):
                sent.append({"role": "tool", "tool_call_id": m.call_id, "content": m.text})
            else:
                sent.append(m.as_dict())
        return ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) + sent

    def echo(self) -> dict:
        """What a response repeats of its request."""
        return {"instructions": self.instructions, "metadata": self.metadata or {},
                "max_output_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_logprobs": self.top_logprobs,
                # with tools, OpenAI's defaults (parallel calls, auto) and the tools as sent
                "parallel_tool_calls": self.parallel_tool_calls is not False if self.tools else
                bool(self.parallel_tool_calls),
                "tool_choice": self.tool_choice or ("auto" if self.tools else "none"), "tools": self.tools or [],
                "max_tool_calls": self.max_tool_calls,
                "text": {"format": self.structured_spec.text_format() if self.structured_spec else {"type": "text"},
                         "verbosity": "medium"}, "truncation": "disabled",
                "reasoning": {"effort": self.reasoning.effort if self.reasoning else None, "summary": None},
                "user": self.user, "safety_identifier": self.safety_identifier,
                "prompt_cache_key": self.prompt_cache_key, "service_tier": "default", "store": False,
                "background": False, "previous_response_id": None}


class SessionOpenRequest(_Base):
    max_length: Optional[int] = pydantic.Field(default=None, ge=2)
    model: Optional[str] = None  # several models behind one orchestrator: which one (models.py routes by it)


class SessionGenerateRequest(SamplingFields):
    prompt: Optional[str] = None
    input_ids: Optional[list[int]] = None
    # a turn adds at least one message (none: the template had no conversation to render, a 500)
    messages: Optional[list[ChatMessage]] = pydantic.Field(default=None, min_length=1)
    add_special_tokens: Optional[bool] = None
    # the generated tokens' logprobs with this many top alternatives, in /v1/completions' format for every kind
    # of turn (messages too: the reply is this API's own, not OpenAI's chat shape, so one format serves all)
    logprobs: Optional[int] = pydantic.Field(default=None, ge=0, le=20)  # a count: chat's ``true`` is refused
    model: Optional[str] = None  # the session's own model (any of its names), as OpenAI clients send on every call
    # tool calling is chat completions' (tools.py): said so, where "unsupported parameter(s): tools" told nothing
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None

    @pydantic.model_validator(mode="after")
    def _no_tools(self):
        for name in ("tools", "tool_choice"):
            if getattr(self, name) not in (None, [], "none"):
                raise FieldError(name, f"{name} is not supported in a session's turn: it offers no tools (POST "
                                       "/v1/chat/completions takes tools)")
        return self


class EmbeddingRequest(_Base):
    """``POST /v1/embeddings`` (embeddings.py computes them): OpenAI's fields, vLLM's ``add_special_tokens``, our
    deadline fields."""

    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = pydantic.Field(default=None, ge=1)
    user: Optional[str] = pydantic.Field(default=None, max_length=256)  # informational, as OpenAI's
    add_special_tokens: bool = True  # text inputs: with the tokenizer's BOS and the like, as vLLM (and completions)
    deadline_ms: Optional[float] = pydantic.Field(default=None, gt=0, le=MAX_DEADLINE_MS, strict=True)
    ttft_deadline_ms: Optional[float] = pydantic.Field(default=None, gt=0, le=MAX_DEADLINE_MS, strict=True)
    best_effort: bool = pydantic.Field(default=False, strict=True)

    @pydantic.field_validator("input", mode="before")
    @classmethod
    def _input_kind(cls, value: Any) -> Any:
        # said once, not as pydantic's try of each member of the union ("Input should be a valid string; ... list")
        kinds = {_json_kind(x) for x in value} if isinstance(value, list) else set()
        if not isinstance(value, (str, list)) or len(kinds) > 1 or not kinds <= {"a string", "a number", "an array"}:
            got = f"an array holding {' and '.join(sorted(kinds))}" if isinstance(value, list) else _json_kind(value)
            raise ValueError("expected a string, a list of strings, a list of token ids or a list of lists of "
                             f"token ids, not {got}")
        return value

    @pydantic.model_validator(mode="after")
    def _inputs(self):
        if not self.input:
            raise FieldError("input", "input must not be empty: give a string, a list of strings, a list of token "
                                      "ids or a list of lists of token ids")
        inputs = self.inputs
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise FieldError("input", f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(inputs)}")
        many = not self.one
        for i, one in enumerate(inputs):
            if len(one) == 0:
                raise FieldError("input", f"{f'input.{i}' if many else 'input'} is empty: an embedding needs at "
                                          "least one token")
        return self

    @property
    def one(self) -> bool:
        """The input is one string or one list of token ids."""
        return isinstance(self.input, str) or isinstance(self.input[0], int)

    @property
    def inputs(self) -> list:
        """The inputs as a list (one string or one token list: a list of one)."""
        return [self.input] if self.one else list(self.input)


class TokenizeRequest(_Base):
    """vLLM's ``/tokenize``: a text ``prompt``, or ``messages`` in the model's chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ToolChatMessage]] = pydantic.Field(default=None, min_length=1)
    # default: true for a prompt; for messages, as chat completions tokenize them (embeddings.chat_special_tokens)
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True  # messages only: open the assistant's turn, as chat completions do
    continue_final_message: bool = False  # messages only: the last (assistant) message left open
    return_token_strs: bool = False

    @pydantic.model_validator(mode="after")
    def _one_shape(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give either prompt (a text) or messages (a conversation)")
        if self.prompt is not None:
            for name in ("add_generation_prompt", "continue_final_message"):
                if name in self.model_fields_set:
                    raise FieldError(name, f"{name} applies to messages, not to a prompt")
            return self
        for i, m in enumerate(self.messages):
            if m.uses_tools:
                raise FieldError(f"messages.{i}", "tool calls and tool results are not supported by /tokenize")
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise FieldError("continue_final_message", "continue_final_message and add_generation_prompt "
                                 "cannot both be true (continue the last message, or open the assistant's turn)")
            if self.messages[-1].role != "assistant":
                raise FieldError("continue_final_message", "continue_final_message needs an assistant message last")
        return self

    @property
    def special_tokens(self) -> bool:
        """A prompt's ``add_special_tokens`` (default true)."""
        return self.add_special_tokens if self.add_special_tokens is not None else True


class DetokenizeRequest(_Base):
    """vLLM's ``/detokenize``."""

    model: Optional[str] = None
    tokens: list[int]


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|(list|dict|function-\w+)\[.*\])$")


def _path(loc: Any) -> list[str]:
    """A validation error's location as the body names it: pydantic's ``body`` and the tags of the union member
    tried left out (``messages.0.content.list[ContentPart].0`` is the body's ``messages.0.content.0``)."""
    return [str(x) for x in loc if x != "body" and not (isinstance(x, str) and _UNION_MEMBER.match(x))]


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words, for an error."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return json.dumps(value)
    kinds = {str: "a string", list: "an array", dict: "an object", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


INTERNAL_ERROR_MESSAGE = "internal error ({}); the request was not completed, please report it"
OPENAI_ENDPOINTS = ("GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions, "
                    "POST /v1/responses and POST /v1/embeddings only")
# what a client puts after its base_url
_OPENAI_TAILS = ("/chat/completions", "/completions", "/models", "/responses", "/embeddings")


def _futile_retry(exc: RequestError) -> bool:
    """Whether sending ``exc``'s request again could only fail again: a 429 it gets however idle the swarm
    (:attr:`~petals_chain.orchestrator.dispatch.Admission.never_fits`: more completions than the swarm holds, more
    tokens than its key's budget per minute, a deadline an idle swarm misses). Not a 504 ``deadline_exceeded``: its
    deadline passed while it waited (behind a burst, or for a chain), the swarm's load now, as for ``queue_full``; sent
    again it has its deadline anew and is served once the burst is gone, or refused at once as
    ``deadline_unreachable`` while it lasts. Its retries are the client's choice (OpenAI's clients retry a timeout
    with the same timeout; ``max_retries=0`` fails fast)."""
    adm = ADMISSION.get()
    return exc.status == 429 and adm is not None and adm.never_fits


def _error(status: int, message: str, *, type_: str | None = None, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_object(status, message, type_=type_, param=param, code=code))


class _Logprobs:
    """Builds OpenAI ``logprobs`` objects (chat and completions formats) from :class:`TokenChoice` lists: each
    token as its own bytes show it (:class:`~petals_chain.orchestrator.tokentext.TokenText`)."""

    def __init__(self, orch: Orchestrator):
        self.orch = orch

    def _entry(self, token: int) -> tuple[str, list[int]]:
        tt = self.orch.token_text
        return tt.text_of(token), list(tt.bytes_of(token))

    def chat_entries(self, choices: list[TokenChoice], top: int) -> list[dict]:
        out = []
        for c in choices:
            text, raw = self._entry(c.token)
            entry = {"token": text, "logprob": c.logprob, "bytes": raw}
            entry["top_logprobs"] = [
                {"token": (e := self._entry(tok))[0], "logprob": lp, "bytes": e[1]}
                for tok, lp in (c.top_logprobs or [])[:top]]
            out.append(entry)
        return out

    def completion(self, choices: list[Optional[TokenChoice]], token_ids: list[int], offset0: int = 0,
                   context: list[int] | tuple = (), counter: StopMatcher | None = None,
                   text: str | None = None) -> dict:
        """``token_ids`` (those ``choices`` score: a stop token has none) decoded after ``context``, starting at
        character ``offset0`` of the returned text; ``counter`` carries a stream's position over its chunks.
        ``text``: a prompt's tokens, echoed as ``text`` (as sent: its chat markup's special tokens take room)."""
        tt = self.orch.token_text
        token_ids = list(token_ids[:len(choices)])
        if text is not None:
            offsets = [offset0 + o for o in offsets_in_text(self.orch.tokenizer, token_ids, text)]
        else:
            counter = counter if counter is not None else StopMatcher(self.orch.tokenizer, [], list(context))
            offsets = [offset0 + o for o in counter.feed_offsets(token_ids)]
        tokens = [tt.text_of(tok) for tok in token_ids]
        token_lps = [None if c is None else c.logprob for c in choices]
        tops = [None if c is None or c.top_logprobs is None else {tt.text_of(t): lp for t, lp in c.top_logprobs}
                for c in choices]
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


CALL_SCOPE_KEY = "petals_chain.call"  # the scope's :class:`_Call` (a route sets the end of its stream if cut)


class ResponsesTail:
    """The end of a Responses API stream cut by the shutdown: ``response.failed`` and ``error``, numbered on from the
    last event the client was sent, under the stream's ids, with the text it was sent. It follows the bytes that went
    out (an event built but not written, a slow reader's when the cut came, is not the client's), so it serves a
    stream relayed from another orchestrator as well as one generated here (``shape``: its builder, whose response
    object the end then carries)."""

    def __init__(self, body: dict, shape: Optional[_responses.ResponseBuilder] = None):
        self.record = ResponsesRecord(body, 0.0)
        self.shape = shape
        self._rest = b""  # a part of an event not yet followed by its end

    def delivered(self, body: bytes) -> None:
        """Bytes written to the client."""
        *events, self._rest = (self._rest + body).split(b"\n\n")
        for event in events:
            self.record.take(event + b"\n\n")

    def ending(self, status: int, message: str, code: str) -> str:
        """The events that end the stream."""
        rec, shape = self.record, self.shape
        if shape is None:
            return rec.ending(status, code, message).decode()
        text = rec.text.get(0, "")
        shape.seq, shape.text, shape.logprobs = rec.seq, [text] if text else [], list(rec.lp_entries)
        # a reply's calls as far as they went out, not as far as they were made (none out: no output)
        calls = rec.delivered_calls() if shape.calls is not None and not text else None
        return shape.failed(status, message, code=code, output=calls)


class _Call:
    """One API request under way behind a :class:`ShutdownGate`: what of its response went out."""

    def __init__(self, send: Callable[[dict], Any]):
        self.outer = send
        self.task: asyncio.Task | None = None
        self.started = self.complete = self.events = False
        self.cut = False
        # the last events of a stream cut by the shutdown, when not chat's error event and [DONE] (the Responses
        # API's: response.failed and error, numbered on from the events sent); set by the route serving it
        self.tail: Optional[ResponsesTail] = None

    async def send(self, message: dict) -> None:
        await self.outer(message)  # its flags after: a cancellation there (a slow reader's) wrote nothing
        if message["type"] == "http.response.start":
            self.started = True
            self.events = is_event_stream({k.decode("latin-1").lower(): v.decode("latin-1")
                                           for k, v in message.get("headers", [])})
        elif message["type"] == "http.response.body":
            if self.tail is not None and self.events and message.get("body"):
                self.tail.delivered(message["body"])
            if not message.get("more_body", False):
                self.complete = True


class ShutdownGate:
    """What the API does while the orchestrator stops with requests in flight (``__main__``: SIGTERM, SIGINT).

    Once :meth:`Orchestrator.begin_drain` ran, a new ``POST`` to the API (a generation, a session's turn or open) is
    answered 503 ``shutting_down`` with ``Retry-After`` and ``Connection: close`` (it was a refused connection or a
    reset one, which OpenAI's clients report as a network error), and ``GET /healthz`` answers 503. Requests under
    way run on; :meth:`cut` ends those still running once the grace is over: a stream with a last error event (503
    ``shutting_down``: a client resumes it elsewhere) and ``[DONE]`` (it was a TCP reset in mid-stream), a request
    not yet answered with the 503 (it was uvicorn's plain-text 500 "Internal Server Error" and a traceback in the
    log per request)."""

    def __init__(self, orch: Any):
        self.orch = orch
        self.calls: set[_Call] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def middleware(self, app: Any) -> Callable:
        """The ASGI middleware over ``app`` (for ``add_middleware``)."""
        async def gate(scope: dict, receive: Callable, send: Callable) -> None:
            if scope.get("type") != "http" or not _API_PATH.match(scope.get("path", "")):
                return await app(scope, receive, send)
            if self.orch.draining and scope.get("method") == "POST":
                return await self._refuse(send)
            await self._serve(app, scope, receive, send)
        return gate

    @property
    def running(self) -> int:
        """API requests under way."""
        return len(self.calls)

    async def wait_idle(self) -> None:
        """Until no API request is under way."""
        while self.calls:
            self._idle.clear()
            await self._idle.wait()

    def cut(self) -> int:
        """End every API request still under way (see the class); returns how many. :meth:`wait_idle` returns once
        their last bytes went out."""
        calls = [c for c in self.calls if not c.complete and c.task is not None and not c.task.done()]
        for call in calls:
            call.cut = True
            call.task.cancel()
        return len(calls)

    async def _serve(self, app: Any, scope: dict, receive: Callable, send: Callable) -> None:
        call = scope[CALL_SCOPE_KEY] = _Call(send)
        # its own task: cut() cancels the request alone; this one then writes the end its client can act on
        call.task = task = asyncio.ensure_future(app(scope, receive, call.send))
        self.calls.add(call)
        self._idle.clear()
        try:
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:  # uvicorn's own cancellation (its shutdown timeout): the request's too
                task.cancel()
                await asyncio.wait([task])
                raise
            if task.cancelled() and call.cut:
                await self._end(call)
                return
            error = task.exception() if not task.cancelled() else asyncio.CancelledError()
        finally:
            self.calls.discard(call)
            if not self.calls:
                self._idle.set()
        if error is not None:  # on to the outer middleware and uvicorn, as the app raised it
            # nothing here keeps it (and what its traceback holds) alive once its catcher drops it: a stream's
            # generator is closed then (a session's turn its client never saw is undone by that close)
            call.task = task = None
            try:
                raise error
            finally:
                error = None

    async def _end(self, call: _Call) -> None:
        if call.complete:
            return
        try:
            if not call.started:
                await self._refuse(call.outer, cut=True)
            else:
                # a stream (an SSE relay's too) gets the event a client acts on; another response just ends
                tail = b"" if not call.events else (
                    call.tail.ending(503, _CUT_MESSAGE, ShuttingDown.code) if call.tail is not None
                    else error_event(503, _CUT_MESSAGE, code=ShuttingDown.code) + DONE).encode()
                await call.outer({"type": "http.response.body", "body": tail, "more_body": False})
        except (OSError, RuntimeError) as e:  # the client went away meanwhile: nobody to tell
            logger.debug("could not end a request cut by the shutdown: %r", e)

    async def _refuse(self, send: Callable, cut: bool = False) -> None:
        body = json.dumps(error_object(503, _CUT_MESSAGE if cut else ShuttingDown().args[0],
                                       code=ShuttingDown.code)).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(unavailable_retry_after_s(self.orch.cfg)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
CORS_EXPOSED = (REQUEST_ID_HEADER, "retry-after", NO_RETRY_HEADER)  # what a page's script may read of a reply
_ORIGIN = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?$")


def cors_origins(text: str) -> list[str]:
    """``--cors-origins``: a comma-separated list of origins (``scheme://host[:port]``, as a browser sends its
    ``Origin`` header) or ``*`` (any page); raises ValueError naming one that a browser would never send (a path, no
    scheme), which would otherwise never match and fail silently."""
    origins = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        origin = item[:-1] if item.endswith("/") and item.count("/") == 3 else item  # "https://a.example/" too
        if origin != "*" and not _ORIGIN.match(origin):
            raise ValueError(f"{item!r} is not an origin: scheme://host[:port] (http or https, no path), or *")
        origin = origin.lower()
        if "[" in origin:  # a browser writes an IPv6 host compressed ([::1]): another spelling never matched
            head, _, rest = origin.partition("[")
            ip, _, tail = rest.partition("]")
            try:
                origin = f"{head}[{ipaddress.IPv6Address(ip).compressed}]{tail}"
            except ValueError:
                raise ValueError(f"{item!r}: {ip!r} is not an IPv6 address") from None
        for scheme, port in (("http://", ":80"), ("https://", ":443")):
            if origin.startswith(scheme) and origin.endswith(port):  # a browser leaves its scheme's port out
                origin = origin[:-len(port)]
        origins.append(origin)
    if not origins:
        raise ValueError("no origin given (scheme://host[:port], comma-separated, or *)")
    return origins


def with_cors(app: Any, origins: list[str]) -> Any:
    """``app`` behind Starlette's CORSMiddleware for ``origins``: outermost, so a browser's preflight (``OPTIONS``,
    no key) is answered before the API keys and limits see it, and every reply (an error's too) carries the allow
    header a page needs to read it. Credentials (cookies) are never allowed: keys travel in ``Authorization``, which
    a page sends itself, so ``*`` lets any page use a key it holds and none use a browser's ambient ones."""
    from starlette.middleware.cors import CORSMiddleware

    # any request header: the openai package for JavaScript sends its own (x-stainless-os, -lang, -retry-count, ...);
    # a fixed list failed its preflight (400 "Disallowed CORS headers"). Without credentials a header grants nothing
    return CORSMiddleware(app, allow_origins=origins, allow_methods=list(CORS_METHODS),
                          allow_headers=["*"], expose_headers=list(CORS_EXPOSED),
                          allow_credentials=False, max_age=600)


_CUT_MESSAGE = ("the orchestrator is shutting down and its grace for running requests is over: the request was cut "
                "off; send it again (to another orchestrator, or here once it is back)")


def create_app(orch: Orchestrator, ledger: Any = None) -> FastAPI:
    """The FastAPI app over ``orch`` (the caller runs ``orch.start()``/``stop()`` in the server's loop); ``ledger``:
    the per-client counts shared with the other models' apps behind one router (``limits.ClientLedger``)."""
    # /openapi.json's info.version: the build (package version, commit), not FastAPI's placeholder "0.1.0"
    app = FastAPI(title="petals-chain orchestrator", version=build_version().partition("/")[2])
    app.router.route_class = ReadBodyRoute  # an endpoint takes the body an outer layer read (and its JSON parse)
    app.state.orch = orch
    cfg = orch.cfg
    lp = _Logprobs(orch)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        response = _error(exc.status, str(exc), param=exc.param, code=exc.code)
        if _futile_retry(exc):
            response.headers[NO_RETRY_HEADER] = "false"
        return response

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable):
        # as a 429 does: when to come back (OpenAI's clients wait that long before their retries; others had nothing)
        response = _error(503, str(exc), code=getattr(exc, "code", None) or "swarm_unavailable")
        response.headers["Retry-After"] = str(unavailable_retry_after_s(cfg))
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":  # its loc is ("body", character): no parameter to name
            where = first.get("loc", ("body", "?"))[-1]
            reason = (first.get("ctx") or {}).get("error", "JSON decode error")
            return _error(400, f"the request body is not valid JSON: {reason} (at character {where})",
                          code="invalid_json")
        if first.get("loc") == ("body",) and isinstance(first.get("input"), bytes):
            # a body sent without Content-Type: application/json (curl -d sends a form's type) reaches us unparsed
            return _error(400, "the request body must be a JSON object sent with 'Content-Type: application/json'",
                          code="invalid_json")
        if first.get("loc") == ("body",) and first.get("type") in ("missing", "model_attributes_type"):
            # the body itself, not a parameter in it: was "body: Field required" or "body: Input should be a valid
            # dictionary or object ..."
            got = "nothing" if first.get("type") == "missing" else _json_kind(first.get("input"))
            return _error(400, f"the request body must be a JSON object, not {got}", code="invalid_json")
        loc = _path(first.get("loc", []))
        extra = [e for e in errs if e.get("type") == "extra_forbidden"]
        if extra:
            names = [".".join(_path(e.get("loc", []))) for e in extra]
            return _error(400, f"unsupported parameter(s): {', '.join(names)}", param=names[0],
                          code="unsupported_parameter")

        def message(e: dict) -> str:
            text = str(e.get("msg", "")).removeprefix("Value error, ")
            where = ".".join(_path(e.get("loc", [])))
            if not where:  # a model validator's: its FieldError's text names the parameter (was "body: ...")
                return text
            return f"{where}: {text}"

        field = getattr((first.get("ctx") or {}).get("error"), "param", None)  # a FieldError's (model validators)
        param = ".".join(loc + ([field] if field else [])) or None
        return _error(400, f"invalid request: {'; '.join(message(e) for e in errs[:5])}", param=param,
                      code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, ClientDisconnect):
            # gone before its body came: no one reads this, but the log and the counts say cancelled, not a 400
            return _error(499, "the client disconnected before its request body arrived", code="client_disconnected")
        if exc.status_code == 400 and isinstance(cause, (RecursionError, ValueError)):
            # FastAPI's "There was an error parsing the body" (code null) for what the JSON parser raised beside a
            # syntax error: a body nested ~1000 deep (RecursionError), or bytes that are not UTF-8
            if "integer string conversion" in str(cause):
                # valid JSON, but int() reads at most sys.get_int_max_str_digits() digits (its message tells the
                # server's code how to raise that: not for the client)
                return _error(400, "the request body has a number of more than "
                              f"{sys.get_int_max_str_digits()} digits, more than this server reads",
                              code="invalid_json")
            why = ("it nests arrays or objects too deeply" if isinstance(cause, RecursionError)
                   else "it is not UTF-8 text" if isinstance(cause, UnicodeDecodeError) else str(cause)[:200])
            return _error(400, f"the request body is not valid JSON: {why}", code="invalid_json")
        path = request.scope.get("path", "")
        if exc.status_code == 404 and exc.detail == "Not Found":
            # no route: an OpenAI endpoint this server does not have (the openai package's responses.create,
            # embeddings.create, ...) was a bare "Not Found", read as a wrong base_url or model
            asked = f"Invalid URL ({request.method} {shown_path(path)})"
            if "//" in path:
                # a base URL ending in "/" joined to a path starting with one: the hints below misread it ("the API is
                # under /v1" for //v1/models)
                return _error(404, f"{asked}: the path has an empty segment ('//'); without it: {request.method} "
                              f"{shown_path(re.sub('/{2,}', '/', path))}", code=default_code(404))
            if path.startswith("/v1/"):
                return _error(404, f"{asked}: this server offers OpenAI's {OPENAI_ENDPOINTS}", code=default_code(404))
            tail = next((t for t in _OPENAI_TAILS if path.rstrip("/").endswith(t)), None)
            if tail is not None:
                # an OpenAI client whose base_url lacks /v1 (http://host:8000): its bare "Not Found" did not say so
                return _error(404, f"{asked}: this server's OpenAI API is under /v1 ({request.method} /v1{tail}): "
                              "an OpenAI client's base_url ends in /v1", code=default_code(404))
        response = _error(exc.status_code, str(exc.detail),
                          code=getattr(exc, "code", None) or default_code(exc.status_code))
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 requires it), a 415's Accept-Encoding
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # a bug: the client still gets OpenAI's error shape (SDKs parse it); the traceback goes to the log (the
        # server-error middleware re-raises it after this response). It answers outside the request-id middleware:
        # the id is put on here
        rid = scope_request_id(request.scope)
        response = _error(500, INTERNAL_ERROR_MESSAGE.format(type(exc).__name__), code="internal_error")
        if not isinstance(exc, (OSError, MemoryError)):
            # OpenAI's clients send a 500 again twice (0.5-8 s apart) unless told not to: a bug fails the same way
            # each time, tripling its work and its tracebacks and delaying the error. What fails for a while and
            # then passes answers 503 with Retry-After (no chain, lost servers); of what is left, only the host's
            # state (a connection, a timeout, no file descriptors or memory) may pass on a retry: left to the client
            response.headers[NO_RETRY_HEADER] = "false"
        if rid is not None:
            response.headers[REQUEST_ID_HEADER] = rid
            logger.error("%s %s: internal error (%s) [request %s]", request.method,
                         shown_path(request.scope.get("path", "")), type(exc).__name__, rid)
        return response

    def check_model(name: str) -> None:
        """404 for a model this API does not serve; else the request runs with the LoRA adapter ``name`` names, if
        it names one (:data:`ADAPTER`, read by its jobs)."""
        adapter = orch.adapters.get(name)
        if adapter is None and name not in (orch.model_id, orch.prefix, cfg.model):
            also = f" and its LoRA adapters {', '.join(map(repr, orch.adapters))}" if orch.adapters else ""
            raise RequestError(f"the model {shown_model_name(name)} does not exist; this swarm serves "
                               f"{orch.model_id!r}{also}", status=404, param="model", code="model_not_found")
        ADAPTER.set(adapter.fingerprint if adapter is not None else "")

    def served_model() -> str:
        """The model id a response names: the request's adapter's name, else the model's."""
        fp = ADAPTER.get()
        if not fp:
            return orch.model_id
        return next((n for n, a in orch.adapters.items() if a.fingerprint == fp), orch.model_id)

    def sampling(req: SamplingFields, default_max_tokens: int | None, logprobs: int | None = None
                 ) -> tuple[SamplingParams, bool]:
        if req.n > cfg.max_n:
            raise RequestError(f"n must be at most {cfg.max_n} (the orchestrator's --max-choices)", param="n",
                               code="too_many_choices")
        params, explicit = req.sampling(cfg.max_tokens_limit, default_max_tokens, logprobs)
        orch.check_speculative(params)  # here, not only in the generation: a stream would answer 200 + an error
        vocab = orch.vocab_size
        for field, ids in (("logit_bias", list(params.logit_bias)), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=field,
                                   code="invalid_token_id")
        set_deadline(req)
        return params, explicit

    structured_requests = request_counter(orch.stats.registry)

    async def constrain(req: SamplingFields, params: SamplingParams) -> None:
        """Compile the request's structured output, if any, into ``params.structured`` (off the event loop: a large
        schema takes up to a second, a model's first one ~0.6 s more for its tokenizer); a bad one is a 400 naming
        its field, counted in ``petals_chain_structured_requests``."""
        toolset = getattr(req, "tool_set", None)
        if toolset is not None:
            params.stop_unless = toolset.stop_unless  # stop strings never cut a call (tools.py)
        spec = req.structured_spec
        if spec is None:
            return
        if params.ignore_eos:
            raise RequestError(IGNORE_EOS_WITH_GRAMMAR, param="ignore_eos", code="invalid_value")
        adm = ADMISSION.get()
        try:
            if adm is not None and adm.refused_early:  # a 429 once found valid: checked, never compiled
                await check_spec_async(spec)
                return
            params.structured = await compile_spec_async(spec, orch.tokenizer, orch.vocab_size, orch._eos)
        except RequestError:
            structured_requests.labels(spec.kind, "invalid").inc()
            raise
        structured_requests.labels(spec.kind, "ok").inc()

    def reserve_tokens(need: int, field: str = "max_tokens") -> None:
        """Hold the most tokens the request may use against its client's ``tokens_per_minute`` (429 if they do not
        fit); released when the request ends, its real use charged. ``field``: the output limit's, for the error."""
        adm = ADMISSION.get()
        if adm is not None and adm.reserve is not None:
            adm.reserve(need, field)

    def fit_context(ids: list[int], params: SamplingParams, explicit: bool, *, field: str = "prompt",
                    limit_field: str = "max_tokens", session: Any = None, index: int | None = None) -> int:
        """``orch.validate_prompt`` of a request's tokens (a session turn's: what the session would hold with it,
        against its max_length): the most it may generate. A context-length refusal names the body field the tokens
        came in (``field``: chat's ``messages``, the Responses API's ``input``, which said ``prompt``; ``index``: the
        prompt's place in a request of several) and what does not fit (a prompt of exactly the context read "has
        2048 tokens, but the maximum is 2048"; a session turn that adds 4 tokens read as a prompt of the session's
        whole length)."""
        max_length = session.max_length if session is not None else None
        try:
            return orch.validate_prompt(ids, params.max_tokens, explicit, max_length=max_length, field=limit_field)
        except RequestError as e:
            if e.code != "context_length_exceeded":
                raise
            overflow = e.param == limit_field  # the output limit, not the input alone, does not fit
            raise context_length_error(len(ids), max_length or cfg.max_length, field=field,
                                       max_tokens=params.max_tokens if overflow else None, limit_field=limit_field,
                                       held=len(session.history) if session is not None else None,
                                       scoring=explicit and params.max_tokens == 0, index=index) from None

    def set_deadline(req: SamplingFields) -> None:
        """The request's deadlines (its fields, else its API key's defaults) for the dispatcher and the report."""
        client = CLIENT.get()
        d_ms, t_ms = key_defaults(app, client) or (None, None)
        adm = ADMISSION.get()  # set by the limits middleware when the request came in, before reading its body
        dl = RequestDeadline.from_ms(client, req.deadline_ms if req.deadline_ms is not None else d_ms,
                                     req.ttft_deadline_ms if req.ttft_deadline_ms is not None else t_ms,
                                     best_effort=req.best_effort, arrival=adm.arrived if adm is not None else None)
        DEADLINE.set(dl if dl.active else None)

    def check_text(text: str, param: str) -> None:
        """Refuse text that is not Unicode text (JSON's ``\\ud800`` escapes decode to lone surrogates, which the
        tokenizer rejects with a TypeError, and which no UTF-8 reply could carry back)."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{param} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                                   f"{e.start}", param=param, code="invalid_unicode") from None

    async def tokenize(text: str, param: str = "prompt", **kw) -> list[int]:
        if len(text) > MAX_PROMPT_CHARS:
            raise RequestError("the prompt is too long", param=param, status=413, code="prompt_too_long")
        check_text(text, param)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return orch.encode(text, **kw)
        return await asyncio.to_thread(orch.encode, text, **kw)

    async def template(messages: list[dict], own: int | None = None) -> list[int]:
        """The chat template's token ids of ``messages``, of which the request sent the last ``own`` (all: None; a
        session's earlier ones were checked when they came), numbered from 0 in an error's ``param``."""
        if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
            raise RequestError("the messages are too long", param="messages", status=413, code="prompt_too_long")
        sent = messages if own is None else messages[len(messages) - own:]
        for i, m in enumerate(sent):
            for key, value in m.items():
                if isinstance(value, str):
                    check_text(value, f"messages.{i}.{key}")
        return await asyncio.to_thread(orch.encode_chat, messages)

    def tools_of(req: Any) -> Optional[ToolSet]:
        """The request's tools, called in the format of the model's chat template (tools.py): their grammar is the
        request's structured output."""
        toolset = req.tool_set
        if toolset is not None:
            toolset = req._tools = toolset.in_format(_tools.call_format(orch.tokenizer))
            if (spec := toolset.spec()) is not None:
                req._spec = spec
        return toolset

    async def tool_template(messages: list[dict], toolset: Optional[ToolSet], param: str = "messages") -> list[int]:
        """The token ids of a chat with tools, or with tool calls and results in it (tools.py renders them)."""
        if sum(len(m.get("content") or "") + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
               for m in messages) > MAX_PROMPT_CHARS:
            raise RequestError("the messages are too long", param="messages", status=413, code="prompt_too_long")
        for i, m in enumerate(messages):
            for key, value in m.items():
                if isinstance(value, str):
                    check_text(value, f"messages.{i}.{key}")
            for j, c in enumerate(m.get("tool_calls", [])):
                check_text(c["function"]["arguments"], f"messages.{i}.tool_calls.{j}.function.arguments")
        return await asyncio.to_thread(_tools.encode_conversation, orch, messages, toolset, param)

    # ---- info ----------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz():
        # stopping: a 503, so that a load balancer's health check takes this orchestrator out at once (it answered
        # 200 until its socket closed, new requests sent here meanwhile)
        body = {"ok": not orch.draining, "ready": orch.ready, "chains": len(orch.dispatch.chains),
                "queue_length": orch.dispatch.queue_length, "requests_running": app.state.gate.running,
                "uptime_s": orch.uptime_s, "version": build_version()}
        if orch.draining:
            body["shutting_down"] = True
            return JSONResponse(body, status_code=503, headers={"Connection": "close"})
        return JSONResponse(body, status_code=200)

    @app.get("/api/v1/swarm")
    async def swarm(request: Request):
        state = orch.swarm_json()
        limits = getattr(request.app.state, "limits", None)
        state["clients"] = limits.clients_json() if limits is not None else []
        state["version"] = build_version()  # the orchestrator's build (its servers' are in their rows)
        return JSONResponse(json_safe(state))

    @app.get("/metrics")
    async def metrics():
        orch.update_gauges()
        return Response(generate_latest(orch.stats.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": orch.model_id, "object": "model", "created": int(orch.started_at), "owned_by": "petals-chain",
                "max_model_len": cfg.max_length}

    def adapter_card(name: str) -> dict:
        """A LoRA adapter as a model of its own, its base model its ``parent`` (vLLM's shape)."""
        return {**model_card(), "id": name, "parent": orch.model_id,
                "adapter_fingerprint": orch.adapters[name].fingerprint}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(), *(adapter_card(n) for n in orch.adapters)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return adapter_card(model_id) if model_id in orch.adapters else model_card()

    # ---- generation helpers --------------------------------------------------------------------
    def usage(prompt: int, completion: int, cached: int = 0) -> dict:
        """OpenAI's usage object; ``cached``: prompt tokens whose KV was not computed (the servers' prefix caches,
        or a session's KV held from its last turn)."""
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def extras(gens: list[Generation]) -> dict:
        out: dict[str, Any] = {"petals_chain": [{"wait_s": g.wait_s, "service_s": g.service_s, "chain": g.chain,
                                                 "failovers": g.failovers, "forked": g.forked,
                                                 "token_ids": g.token_ids} for g in gens]}
        dl = DEADLINE.get()
        if dl is not None:
            out["deadline"] = dl.report()
        return out

    def stream_response(gen_fn, n: int, chunk: Any, include_usage: bool, prompt_tokens: int,
                        undelivered: Callable[[], None] | None = None, opens_scored: bool = False,
                        failed: Callable[..., str] = error_event, end: str = DONE) -> StreamingResponse:
        """SSE over ``gen_fn(emits) -> list[Generation]`` (``emits[i](text, choices)`` per choice); ``chunk(index,
        text, finish_reason, choices)`` builds each event's object (``first=True``: the opening event, or None;
        ``gen``: the choice's Generation, for its last event), or their SSE text (the Responses API's events).
        ``failed(status, message, param=, code=)``: the SSE text that ends a stream in error; ``end``: the last.
        ``opens_scored``: the opening events wait for the prompt's logprobs, ``gen_fn(emits, scored)`` awaiting
        ``scored(prompt_logprobs)`` (they are ``chunk``'s ``choices`` then).
        ``undelivered()`` runs after the generation ends if the client did not take the stream to its ``[DONE]``."""
        queue: asyncio.Queue = asyncio.Queue()

        def emitter(i: int):
            async def emit(text: str, choices: list[TokenChoice]) -> None:
                await queue.put(("delta", i, (text, choices)))
            return emit

        async def scored(prompt_logprobs: list) -> None:
            await queue.put(("open", -1, prompt_logprobs))

        async def run() -> None:
            try:
                emits = [emitter(i) for i in range(n)]
                gens = await (gen_fn(emits, scored) if opens_scored else gen_fn(emits))
                for i, g in enumerate(gens):
                    await queue.put(("done", i, g))
            except (RequestError, Unavailable) as e:
                await queue.put(("error", -1, e))
            except Exception as e:  # noqa: BLE001 - reported to the client in the stream
                logger.exception("generation failed")
                await queue.put(("error", -1, e))

        keepalive = float(getattr(cfg, "sse_keepalive_s", SSE_KEEPALIVE_S) or 0.0)

        def framed(obj: Any) -> str:
            return "" if obj is None else obj if isinstance(obj, str) else sse(obj)

        async def events() -> AsyncIterator[str]:
            task = asyncio.create_task(run())
            delivered = False
            done = 0
            completion = 0
            cached = 0
            last = time.monotonic()  # when the stream last had something to send
            try:
                for i in range(0 if opens_scored else n):
                    if first := framed(chunk(i, None, None, None, first=True)):
                        yield first
                while done < n:
                    if not queue.empty() or keepalive <= 0:
                        kind, i, val = await queue.get()
                    else:  # waiting (queued, the prompt scored, a slow step): a comment if silent for keepalive s
                        try:
                            kind, i, val = await asyncio.wait_for(queue.get(), last + keepalive - time.monotonic())
                        except asyncio.TimeoutError:
                            yield KEEPALIVE
                            last = time.monotonic()
                            continue
                    last = time.monotonic()
                    if kind == "open":
                        for j in range(n):
                            yield framed(chunk(j, None, None, val, first=True))
                    elif kind == "delta":
                        if delta := framed(chunk(i, val[0], None, val[1])):
                            yield delta
                    elif kind == "done":
                        done += 1
                        completion += len(val.token_ids)
                        if i == 0:
                            cached = val.cached_tokens  # the prompt is computed once, by the first choice
                        yield framed(chunk(i, "", val.finish_reason, None, gen=val))
                    else:  # as the non-streamed response would say it (status, code; a bug's message)
                        if isinstance(val, (RequestError, Unavailable)):
                            status = getattr(val, "status", 503)
                            code = getattr(val, "code", None) or default_code(status)
                            message = str(val)
                            logger.info("a stream ended in error: %d %s: %s", status, code, message)
                        else:
                            status, code, message = 500, "internal_error", INTERNAL_ERROR_MESSAGE.format(
                                type(val).__name__)
                        yield failed(status, message, param=getattr(val, "param", None), code=code)
                        break
                if include_usage and done == n:
                    u = chunk(0, "", None, None)
                    u["choices"] = []
                    u["usage"] = usage(prompt_tokens, completion, cached)
                    dl = DEADLINE.get()
                    if dl is not None:
                        u["deadline"] = dl.report()
                    yield sse(u)
                if end:
                    yield end
                delivered = True  # resumed after the last event: it was sent
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if undelivered is not None and not delivered:
                    undelivered()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def prompt_ids_of(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await tokenize(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            if sum(len(p) for p in prompt) > MAX_PROMPT_CHARS:
                raise RequestError("the prompts are too long", param="prompt", status=413, code="prompt_too_long")
            return [await tokenize(p) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
            return [list(x) for x in prompt]
        raise RequestError("prompt must be a non-empty string, list of strings, token ids or lists of token ids",
                           param="prompt", code="invalid_value")

    def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
        """``n`` copies; a seeded request gives choice ``i`` the seed ``choice_seed(seed, i)``: choice 0 its own,
        the others a mix of (seed, i), so choices differ, runs repeat, and no choice is another seed's choice 0."""
        return [SamplingParams(**{**params.__dict__, "seed": choice_seed(params.seed, i), "stop": list(params.stop)})
                for i in range(n)]

    # ---- /v1/completions -----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if (forwarded := await maybe_forward(orch, request)) is not None:
            return forwarded
        check_model(req.model)
        many = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
        if req.stream and many and len(req.prompt) != 1:  # before tokenizing them
            raise RequestError("streaming supports one prompt per request", param="prompt",
                               code="unsupported_value")
        if (len(req.prompt) if many else 1) * req.n > cfg.max_n:  # before tokenizing them all on the event loop
            raise RequestError(f"at most {cfg.max_n} completions per request (prompts x n; the orchestrator's "
                               "--max-choices)", param="prompt" if many and req.n == 1 else "n",
                               code="too_many_choices")
        prompts = await prompt_ids_of(req.prompt)  # as many as counted above
        # echo gives back each prompt as sent (its text; decoding its tokens dropped special tokens such as
        # "<|user|>" and changed the text a client strips the echo by): token-id prompts are decoded
        if not req.echo:
            texts = [""] * len(prompts)
        elif isinstance(req.prompt, str):
            texts = [req.prompt]
        elif many and isinstance(req.prompt[0], str):
            texts = list(req.prompt)
        else:
            # a prompt that ends inside a character leaves it to the completion, which shows it whole (else the echo
            # showed U+FFFD and the character twice): the echo and the completion are the decoding of both
            texts = [orch.decode(ids) if req.max_tokens == 0 else whole_text(orch.tokenizer, ids) for ids in prompts]
        # the text a prompt's tokens were tokenized from (their offsets count its chat markup); None: a token-id
        # prompt, echoed as its decoding (a special token there takes no room, though plain tokens after it may
        # spell its text)
        typed = isinstance(req.prompt, str) or (many and isinstance(req.prompt[0], str))
        sent: list[str | None] = list(texts) if typed else [None] * len(texts)
        params, explicit = sampling(req, COMPLETION_DEFAULT_MAX_TOKENS, req.logprobs)
        await constrain(req, params)
        # every prompt validated before any work starts; its tokens held: the prompt and the most it may generate (an
        # implicit limit, chat's --max-tokens-limit, only as far as its context goes)
        outputs = [fit_context(ids, params, explicit, index=i if len(prompts) > 1 else None)
                   for i, ids in enumerate(prompts)]
        reserve_tokens(sum(len(ids) + most * req.n for ids, most in zip(prompts, outputs)))
        echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            ids = prompts[0]
            echo_text = texts[0] if req.echo else None
            counters: dict[int, StopMatcher] = {}  # each choice's position: text_offset runs on across its chunks

            def chunk(i, text, finish, choices, first=False, gen=None):
                logprobs = None
                if first:
                    if echo_text is None:
                        return None
                    text = echo_text
                    if choices is not None:  # the prompt's own logprobs (echo with logprobs)
                        logprobs = lp.completion(choices, ids, text=sent[0])
                elif req.logprobs is not None and choices:
                    counter = counters.setdefault(i, StopMatcher(orch.tokenizer, [], ids))
                    logprobs = lp.completion(choices, [c.token for c in choices], offset0=len(echo_text or ""),
                                             counter=counter)
                return {"id": cid, "object": "text_completion", "created": created, "model": served_model(),
                        "choices": [{"text": text or "", "index": i, "logprobs": logprobs, "finish_reason": finish}]}

            include = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(lambda emits, scored=None: orch.generate_n(
                ids, per_choice(params, req.n), explicit, emits, prompt_logprobs=echo_logprobs, scored=scored),
                req.n, chunk, include, len(ids), opens_scored=echo_logprobs is not None)
        results = await unless_disconnected(request, gather_or_cancel(*(
            orch.generate_n(ids, per_choice(params, req.n), explicit, prompt_logprobs=echo_logprobs,
                            settle=len(prompts) == 1)
            for ids in prompts)))
        deadline = DEADLINE.get()
        if deadline is not None and len(prompts) > 1:  # met only if the last prompt's last token was in time
            orch.deadlines.settle(deadline)
        choices, gens = [], []
        for ids, prompt_text, sent_text, group in zip(prompts, texts, sent, results):
            for g in group:
                text, logprobs = g.text, None
                prefix = prompt_text if req.echo else ""
                if req.logprobs is not None:
                    gen_lp = lp.completion(g.logprobs or [], g.token_ids, offset0=len(prefix), context=ids)
                    if req.echo:
                        prompt_lp = lp.completion(g.prompt_logprobs or [None] * len(ids), ids, text=sent_text)
                        gen_lp = {k: prompt_lp[k] + gen_lp[k] for k in gen_lp}
                    logprobs = gen_lp
                choices.append({"text": prefix + text, "index": len(choices), "logprobs": logprobs,
                                "finish_reason": g.finish_reason})
                gens.append(g)
        prompt_tokens = sum(len(ids) for ids in prompts)
        completion = sum(len(g.token_ids) for g in gens)
        cached = sum(group[0].cached_tokens for group in results)
        return {"id": cid, "object": "text_completion", "created": created, "model": served_model(),
                "choices": choices, "usage": usage(prompt_tokens, completion, cached), **extras(gens)}

    # ---- /v1/chat/completions ------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        if (forwarded := await maybe_forward(orch, request)) is not None:
            return forwarded
        check_model(req.model)
        toolset = tools_of(req)
        layout = toolset.layout if toolset is not None else None  # None: the reply is text, as without tools
        if toolset is not None or any(m.uses_tools for m in req.messages):
            ids = await tool_template([m.as_dict() for m in req.messages], toolset)
        else:
            ids = await template([m.as_dict() for m in req.messages])
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params, explicit = sampling(req, None, top)
        await constrain(req, params)
        most = fit_context(ids, params, explicit, field="messages", limit_field=req.limit_field)
        reserve_tokens(len(ids) + most * req.n, req.limit_field)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chat_lp(choices: list[TokenChoice]) -> Optional[dict]:
            return {"content": lp.chat_entries(choices, top)} if top is not None else None

        if req.stream:
            scanners: dict[int, _tools.CallScanner] = {}  # each choice's reading of its reply (tool calls)

            def plain_chunk(i, text, finish, choices, first=False, gen=None):
                if first:
                    delta = {"role": "assistant", "content": ""}
                else:
                    delta = {} if finish else {"content": text or ""}
                return event(i, delta, finish, choices)

            def event(i, delta, finish, choices):
                return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": served_model(),
                        "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                     "logprobs": chat_lp(choices) if choices else None}]}

            held: dict[int, list] = {}  # each choice's logprobs of text held back (a call marker may be starting)

            def tool_chunk(i, text, finish, choices, first=False, gen=None):
                """OpenAI's tool-call stream: content null at first; a call's index, id and name in one delta,
                then its arguments in pieces; ``finish_reason`` "tool_calls" (a text reply of ``auto``: content
                deltas). Several deltas from one piece of text go as several events; text held back sends none
                (its logprobs go with the delta that shows it, or the last event)."""
                if first:
                    return event(i, {"role": "assistant", "content": None}, None, None)
                scanner = scanners.setdefault(i, _tools.CallScanner(layout, toolset.fmt))
                deltas = [tool_delta(scanner, e) for e in scanner.feed(text or "")]
                lps = held.pop(i, []) + list(choices or [])
                if gen is not None:
                    deltas += [tool_delta(scanner, e) for e in scanner.finish()]
                    end = _tools.finish_reason(scanner, finish)
                    return "".join(sse(event(i, d, None, lps if k == 0 else None)) for k, d in enumerate(deltas)) \
                        + sse(event(i, {}, end, None if deltas else lps))
                if not deltas:
                    held[i] = lps
                    return None
                return "".join(sse(event(i, d, finish, lps if k == 0 else None)) for k, d in enumerate(deltas))

            def tool_delta(scanner: _tools.CallScanner, e: tuple) -> dict:
                if e[0] == "content":
                    return {"content": e[1]}
                call = scanner.calls[e[1]]
                if e[0] == "call":
                    return {"tool_calls": [{"index": e[1], "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]}
                return {"tool_calls": [{"index": e[1], "function": {"arguments": e[2]}}]}

            include = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(lambda emits: orch.generate_n(ids, per_choice(params, req.n), explicit, emits),
                                   req.n, plain_chunk if layout is None else tool_chunk, include, len(ids))
        gens = await unless_disconnected(request, orch.generate_n(ids, per_choice(params, req.n), explicit))

        def reply(g: Generation) -> tuple[dict, str]:
            """The choice's message and finish_reason: its calls, if it made any (tools.py)."""
            if layout is None:
                return {"role": "assistant", "content": g.text}, g.finish_reason
            read = _tools.read_reply(layout, g.text, toolset.fmt)
            if not read.is_calls:
                return {"role": "assistant", "content": read.content}, g.finish_reason
            return ({"role": "assistant", "content": None, "tool_calls": _tools.openai_calls(read.calls)},
                    _tools.finish_reason(read, g.finish_reason))

        choices = [{"index": i, "message": message, "logprobs": chat_lp(g.logprobs or []), "finish_reason": finish}
                   for i, g in enumerate(gens) for message, finish in [reply(g)]]
        return {"id": cid, "object": "chat.completion", "created": created, "model": served_model(),
                "choices": choices,
                "usage": usage(len(ids), sum(len(g.token_ids) for g in gens), gens[0].cached_tokens), **extras(gens)}

    # ---- /v1/responses -------------------------------------------------------------------------
    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        """OpenAI's Responses API over chat's generation (template, sampling, limits, deadlines): responses.py."""
        call = request.scope.get(CALL_SCOPE_KEY) if req.stream else None
        if call is not None:  # cut by the shutdown (a stream relayed from another orchestrator too): as any failure
            call.tail = ResponsesTail({"model": req.model, "instructions": req.instructions,
                                       "temperature": req.temperature, "top_p": req.top_p})
        if (forwarded := await maybe_forward(orch, request)) is not None:
            return forwarded
        check_model(req.model)
        messages = req.messages()
        if sum(len(m["content"] or "") + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
               for m in messages) > MAX_PROMPT_CHARS:
            raise RequestError("the input is too long", param="input", status=413, code="prompt_too_long")
        if req.instructions is not None:
            check_text(req.instructions, "instructions")
        if isinstance(req.input, str):
            check_text(req.input, "input")
        else:
            for i, item in enumerate(req.input):  # each item's text, named as the request has it
                if isinstance(item, InputFunctionCall):
                    texts = {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
                elif isinstance(item, InputFunctionCallOutput):
                    texts = {"call_id": item.call_id, "output": item.text}
                else:
                    texts = {"content": item.as_dict()["content"]}
                for key, value in texts.items():
                    check_text(value, f"input.{i}.{key}")
        toolset = tools_of(req)
        layout = toolset.layout if toolset is not None else None  # None: the reply is text, as without tools
        if toolset is not None or req.uses_tools:
            ids = await tool_template(messages, toolset, "input")
        else:
            ids = await template(messages)
        req.max_tokens = req.max_output_tokens
        top = req.top
        params, explicit = sampling(req, None, top)
        await constrain(req, params)
        most = fit_context(ids, params, explicit, field="input", limit_field=req.limit_field)
        reserve_tokens(len(ids) + most, req.limit_field)
        shape = _responses.ResponseBuilder(served_model(), req.echo())

        def logprobs_of(choices: Optional[list[TokenChoice]]) -> Optional[list[dict]]:
            return lp.chat_entries(choices, top) if top is not None and choices else None

        def ours(gen: Generation) -> dict:
            """This server's fields of a response: the generation's (as chat's ``petals_chain``), the deadline's."""
            return extras([gen])

        if req.stream:
            # with tools the reply's text is read as it comes, into a message or function calls (responses.py)
            out = shape if layout is None else _responses.ToolStream(shape, layout, toolset.fmt)

            def chunk(i, text, finish, choices, first=False, gen=None):
                if first:
                    return out.opening()
                if gen is None:
                    return (shape.delta if layout is None else out.feed)(text or "", logprobs_of(choices))
                return out.closing(gen.finish_reason, _responses.usage(len(ids), len(gen.token_ids),
                                                                       gen.cached_tokens), ours(gen))

            if call is not None and call.tail is not None:  # its end carries this stream's response object
                call.tail.shape = shape
            return stream_response(lambda emits: orch.generate_n(ids, per_choice(params, 1), explicit, emits), 1,
                                   chunk, False, len(ids), failed=shape.failed, end="")
        gen = (await unless_disconnected(request, orch.generate_n(ids, per_choice(params, 1), explicit)))[0]
        read = _tools.read_reply(layout, gen.text, toolset.fmt) if layout is not None else None
        return shape.finished(read.content if read is not None else gen.text, gen.finish_reason,
                              _responses.usage(len(ids), len(gen.token_ids), gen.cached_tokens),
                              logprobs_of(gen.logprobs), ours(gen),
                              calls=read.calls if read is not None and read.is_calls else None)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.get("/v1/responses/{response_id}/input_items")
    @app.post("/v1/responses/{response_id}/cancel")
    async def stored_response(response_id: str, request: Request):
        # the openai package's retrieve / delete / cancel / input_items.list: nothing is kept to act on
        raise RequestError(f"no response {shown_model_name(response_id)}: this server stores no responses (each is "
                           "answered with store: false and forgotten), so none can be retrieved, listed, cancelled "
                           "or deleted", status=404, param="response_id", code="response_not_found")

    # ---- multi-turn sessions -------------------------------------------------------------------
    @app.post("/api/v1/sessions")
    async def open_session(request: Request, req: Optional[SessionOpenRequest] = None):
        if (forwarded := await maybe_forward(orch, request)) is not None:  # no chain here: opened where there is
            return forwarded
        if req is not None and req.model is not None:
            check_model(req.model)
        s = orch.open_session(req.max_length if req is not None else None)
        return {"session_id": s.id, "max_length": s.max_length, "model": served_model()}

    def session_info(s) -> dict:
        return {"session_id": s.id, "max_length": s.max_length, "tokens": len(s.history), "turns": s.turns,
                "chain": s.holder.chain_names or s.last_chain, "created": s.created, "failovers": s.holder.failovers,
                "messages": len(s.messages) if s.messages is not None else None, "busy": s.lock.locked()}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        if (forwarded := await forward_session_call(orch, request, session_id)) is not None:
            return forwarded
        return session_info(orch.get_session(session_id))

    @app.delete("/api/v1/sessions/{session_id}")
    async def close_session(session_id: str, request: Request):
        if (forwarded := await forward_session_call(orch, request, session_id)) is not None:
            return forwarded
        await orch.close_session(session_id)
        return {"session_id": session_id, "closed": True}

    @app.post("/api/v1/sessions/{session_id}/generate")
    async def session_generate(session_id: str, req: SessionGenerateRequest, request: Request):
        if (forwarded := await forward_session_call(orch, request, session_id)) is not None:
            return forwarded
        s = orch.get_session(session_id)
        if req.n != 1:
            raise RequestError("sessions generate one sequence at a time (n=1)", param="n", code="unsupported_value")
        # a session of a LoRA adapter is named by the adapter's name (its model's names by the model's)
        names = ([n for n, a in orch.adapters.items() if a.fingerprint == s.holder.adapter] if s.holder.adapter
                 else [orch.model_id, orch.prefix, cfg.model])
        if req.model is not None and req.model not in names:
            raise RequestError(f"this session is of the model {names[0]!r}, not {req.model!r}: open a session of "
                               "that model for it", param="model", code="session_model")
        if sum(x is not None for x in (req.prompt, req.input_ids, req.messages)) != 1:
            raise RequestError("give exactly one of prompt (text), input_ids or messages", param="prompt",
                               code="invalid_value")
        # a turn whose client just left (a stream broken off, then the next turn sent at once) is given up once that is
        # noticed: this one runs then; one that ends with a turn done is another client's, raced (409)
        turns = s.turns
        if not await s.wait_turn_end(TURN_GRACE_S) or s.turns != turns:
            raise RequestError("this session is already generating", status=409, code="session_busy")
        messages = None
        if req.messages is not None:
            messages = [m.as_dict() for m in req.messages]
            turns, conversation = s.turns, orch.session_messages(s, messages)  # the session the target is built on
            target = await template(conversation, own=len(messages))
            params, explicit = sampling(req, None, req.logprobs)
        else:
            # the session the BOS choice was made on: a turn ending while a long prompt is tokenized is a 409 (its
            # target would start a BOS in mid-conversation, or lack the one a first turn needs)
            turns = s.turns
            if req.prompt is not None:
                special = req.add_special_tokens if req.add_special_tokens is not None else not s.history
                new_ids = await tokenize(req.prompt, add_special_tokens=special)
            else:
                new_ids = list(req.input_ids)
            target = orch.session_target(s, new_ids)
            params, explicit = sampling(req, COMPLETION_DEFAULT_MAX_TOKENS, req.logprobs)
        orch.check_ids(target)
        await constrain(req, params)
        field = "messages" if req.messages is not None else "prompt" if req.prompt is not None else "input_ids"
        most = fit_context(target, params, explicit, field=field, limit_field=req.limit_field, session=s)
        reserve_tokens(max(0, len(target) - len(s.history)) + most)

        def gen_fn(emit=None):
            return orch.session_generate(s, target, params, explicit_max_tokens=explicit, emit=emit,
                                         messages=messages, based_on=turns)

        before = s.snapshot()

        def forget_unseen_turn() -> None:
            """The client left before it got the turn: if the turn finished anyway, it is undone."""
            if s.forget_turn(before):
                logger.info("session %s: the turn finished after its client left; undone", s.id)

        if req.stream:
            # this request's own, on this turn's context: text_offset runs on over its chunks (a turn undone or
            # sent again is a new request, counted afresh on the session as it is then)
            counter = StopMatcher(orch.tokenizer, [], target) if req.logprobs is not None else None
            sent = [0]  # token ids the events carried so far

            def chunk(i, text, finish, choices, first=False, gen=None):
                if first:
                    return None
                ids = [c.token for c in choices or ()]
                logprobs = lp.completion(choices, ids, counter=counter) if counter is not None and choices else None
                sent[0] += len(ids)
                if gen is not None:  # the turn's last event: what the non-streamed reply says of the turn, and the
                    ids = list(gen.token_ids[sent[0]:])  # tokens no event carried (a stop token is never shown)
                out = {"session_id": s.id, "text": text or "", "token_ids": ids, "logprobs": logprobs,
                       "finish_reason": finish}
                if gen is not None:
                    out.update(usage=usage(gen.prompt_tokens, len(gen.token_ids), gen.cached_tokens),
                               tokens=len(s.history))
                if finish is not None and (dl := DEADLINE.get()) is not None:
                    out["deadline"] = dl.report()
                return out

            async def run(emits):
                return [await gen_fn(emits[0])]

            # the usage chunk OpenAI sends on request (a last one with no choices), as /v1 streams do: the turn's whole
            # context as its prompt, what the chain held already as cached (the turn's last event says the same)
            include = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(run, 1, chunk, include, len(target), forget_unseen_turn)
        try:
            g = await unless_disconnected(request, gen_fn())
            if await request.is_disconnected():  # gone while the turn ran, unnoticed (checked once a second)
                raise RequestError("the client disconnected", status=499, code="client_disconnected")
        except RequestError as e:
            if e.code == "client_disconnected":  # the turn may finish while the disconnect is being noticed
                forget_unseen_turn()
            raise
        # this turn's tokens alone (a stop token has none), decoded after the context they were generated on
        logprobs = None if req.logprobs is None else lp.completion(g.logprobs or [], g.token_ids, context=target)
        out = {"session_id": s.id, "text": g.text, "token_ids": g.token_ids, "logprobs": logprobs,
               "finish_reason": g.finish_reason,
               "usage": usage(g.prompt_tokens, len(g.token_ids), g.cached_tokens), "wait_s": g.wait_s,
               "service_s": g.service_s, "chain": g.chain, "failovers": g.failovers, "tokens": len(s.history)}
        if (dl := DEADLINE.get()) is not None:
            out["deadline"] = dl.report()
        return out

    # ---- /v1/embeddings, /tokenize, /detokenize (embeddings.py) ---------------------------------
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        if (forwarded := await maybe_forward(orch, request)) is not None:
            return forwarded
        check_model(req.model)
        _embeddings.check_dimensions(orch, req.dimensions)
        inputs = req.inputs
        if isinstance(inputs[0], str):
            chars = sum(len(t) for t in inputs)
            if chars > MAX_PROMPT_CHARS:
                raise RequestError("the input is too long", param="input", status=413, code="prompt_too_long")
            for i, text in enumerate(inputs):
                check_text(text, "input" if req.one else f"input.{i}")
            ids = (_embeddings.encode_texts(orch, inputs, req.add_special_tokens) if chars <= INLINE_TOKENIZE_CHARS
                   else await asyncio.to_thread(_embeddings.encode_texts, orch, inputs, req.add_special_tokens))
        else:
            ids = [list(x) for x in inputs]
        _embeddings.check_inputs(orch, ids)
        reserve_tokens(sum(len(x) for x in ids), "input")
        set_deadline(req)
        done = await unless_disconnected(request, _embeddings.embed_inputs(orch, ids))
        body = await asyncio.to_thread(_embeddings.response, served_model(), done, req.encoding_format, DEADLINE.get())
        return Response(body, media_type="application/json")  # encoded off the event loop (embeddings.response)

    @app.post("/tokenize")
    async def tokenize_text(req: TokenizeRequest):
        if req.model is not None:
            check_model(req.model)
        if req.prompt is not None:
            return _embeddings.tokenized(orch, await tokenize(req.prompt, add_special_tokens=req.special_tokens),
                                         req.return_token_strs)
        messages = [m.as_dict() for m in req.messages]
        if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
            raise RequestError("the messages are too long", param="messages", status=413, code="prompt_too_long")
        for i, m in enumerate(messages):
            for key, value in m.items():
                if isinstance(value, str):
                    check_text(value, f"messages.{i}.{key}")
        text = await asyncio.to_thread(_embeddings.render_chat, orch, messages, req.add_generation_prompt,
                                       req.continue_final_message)
        special = _embeddings.chat_special_tokens(orch) if req.add_special_tokens is None else req.add_special_tokens
        return _embeddings.tokenized(orch, await tokenize(text, "messages", add_special_tokens=special),
                                     req.return_token_strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if req.model is not None:
            check_model(req.model)
        _embeddings.check_ids(orch, req.tokens, "tokens")
        if len(req.tokens) <= INLINE_TOKENIZE_CHARS:
            return _embeddings.detokenized(orch, req.tokens)
        return await asyncio.to_thread(_embeddings.detokenized, orch, req.tokens)

    # ---- dashboard -----------------------------------------------------------------------------
    try:
        from petals_chain.swarm.webpage import mount_dashboard

        mount_dashboard(app, "/")
    except Exception as e:  # noqa: BLE001 - the API works without the page
        logger.warning("dashboard page unavailable (%s); serving a link page at /", e)

        @app.get("/", response_class=PlainTextResponse)
        async def index():
            return (f"petals-chain orchestrator for {orch.model_id}\n"
                    "GET /api/v1/swarm  GET /v1/models  POST /v1/completions  POST /v1/chat/completions  "
                    "POST /v1/responses  POST /v1/embeddings  POST /tokenize  POST /detokenize  GET /metrics\n")

    # Bounded queue, per-client limits and body size (429/413 with Retry-After): limits.py.
    from petals_chain.orchestrator.limits import client_of, install_limits, release_client

    install_limits(app, orch, ledger=ledger, end_hook=True)

    def request_ended(scope: dict, status: Optional[int], headers: list, trace: RequestTrace,
                      error: Optional[BaseException]) -> None:
        try:
            count_endpoint(scope, status, trace, error)
            count_ended(scope, status, headers, trace, error)
        finally:  # its client's state is kept until its count is in (a removed name's goes with its last request)
            release_client(scope)

    def count_endpoint(scope: dict, status: Optional[int], trace: RequestTrace, error: Optional[BaseException]) -> None:
        """``petals_chain_endpoint_requests``: each API request once, by its route (a request the limits answered
        before the router saw it, a 401 or a 429, by the route its path matches)."""
        path = scope.get("path", "")
        if not _API_PATH.match(path):
            return
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or next(
            (r.path for r in app.router.routes if hasattr(r, "path_regex") and r.path_regex.match(path)), "other")
        if status is None:
            outcome = "cancelled" if error is None or isinstance(error, asyncio.CancelledError) else "failed"
        else:
            outcome = status_outcome(status, trace.code)
        orch.stats.m_endpoints.labels(endpoint, outcome).inc()

    def count_ended(scope: dict, status: Optional[int], headers: list, trace: RequestTrace,
                    error: Optional[BaseException]) -> None:
        """Count a generation request nothing counted (refused before its generation began: invalid, too long,
        over a limit; its client gone first) once, and log an API request answered with an error."""
        path = scope.get("path", "")
        if not _API_PATH.match(path):
            return
        code = trace.code
        # not a 401: anyone without a key could write lines at will (petals_chain_rejected_requests counts them)
        if status is not None and status >= 400 and status != 401:
            logger.log(logging.WARNING if status >= 500 else logging.INFO, "%s %s: %d %s", scope.get("method"),
                       shown_path(path), status, code or default_code(status))
        if trace.counted or not GENERATE_PATH.match(path) or status == 401:
            return  # counted where it ran; not a generation; no client (petals_chain_rejected_requests has it)
        if any(k.lower() == SERVED_BY_HEADER.encode() for k, _ in headers):
            return  # forwarded: counted by the orchestrator that served it
        limits = getattr(app.state, "limits", None)
        # as admitted: a key reload meanwhile may have removed or renamed it (it went uncounted, or under the new name)
        client = scope.get("petals_chain.client") or client_of(scope, None if limits is None else limits.limits.keys)
        if client is None:
            return
        if status is None:
            outcome = "cancelled" if error is None or isinstance(error, asyncio.CancelledError) else "failed"
        else:
            outcome = status_outcome(status, code)
        trace.counted = True
        orch.stats.end_request(outcome, client)

    install_log_ids()
    gate = app.state.gate = ShutdownGate(orch)
    app.add_middleware(gate.middleware)  # outside the limits: a request refused while stopping takes no place there
    # a gzip or deflate body decoded as the layers inside read it, bounded by the body limit once decoded; HEAD as GET
    app.add_middleware(DecodedBody, limit=lambda: app.state.limits.limits.max_body_bytes)
    app.add_middleware(HeadAsGet)
    app.add_middleware(RequestIds, on_end=request_ended)  # outermost: the limits' own answers get an id too
    # built now, not at the first request: the limits (app.state.limits) exist from the start, so a router in
    # front (models.py) refuses a request without a valid key unread from the first one on
    app.middleware_stack = app.build_middleware_stack()
    return app
