"""Tool calling (OpenAI's function calling) on the chat API, by grammar-constrained decoding (structured.py).

A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are checked into a :class:`ToolSet` (a 400
naming the field otherwise). Its :meth:`ToolSet.spec` is the grammar the reply is decoded under, as vLLM does for
models without a native tool parser:

* ``tool_choice`` ``"required"`` or a named function: the reply is exactly the call(s), JSON
  ``{"name": <a tool's name>, "arguments": <that tool's parameters>}`` (with ``parallel_tool_calls``, OpenAI's
  default: a non-empty list of them);
* ``"auto"`` (the default when tools are given): free text that holds no ``<tool_call>``, or the call(s)
  in the Hermes format below: the branch the model took decides whether the reply is ``content`` or ``tool_calls``;
* ``"none"``: no grammar; the tools are described in the prompt and no call is made.

The conversation: an assistant message with ``tool_calls`` and ``role: "tool"`` results are rendered by the model's
chat template when it takes ``tools`` (transformers' ``apply_chat_template(tools=...)``: Qwen2.5, Llama 3.1, ...).
Otherwise (SmolLM2's template) in the Hermes format (NousResearch's, Qwen2.5's own, what vLLM's ``hermes`` parser
reads): the tool definitions are added to the system message (:data:`TOOLS_PROMPT`), a call is written
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` and results are a user message of
``<tool_response>\\n...\\n</tool_response>`` blocks.

A template that takes tools and writes calls its own way is asked for calls in that format (:func:`call_format`,
:data:`FORMATS`): Llama 3.1/3.2's bare JSON ``{"name": ..., "parameters": {...}}`` (one call a reply: its template
renders no more), Mistral's ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (``[TOOL_CALLS]`` its special
token where the tokenizer has one; call ids rendered as the 9 characters its template demands). Any other template
that takes tools (or none) is asked for Hermes ``<tool_call>`` blocks.

:class:`CallScanner` reads the reply, streamed or whole, into content and calls (an OpenAI stream's tool-call
deltas: the call's index, id and name first, then its arguments in pieces). Stop strings do not apply to calls
(:attr:`ToolSet.stop_unless`): a forced reply ignores them, an ``auto`` one only once it took the call branch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import jinja2
import llguidance

from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.structured import LIMITS, MAX_SOURCE_CHARS, StructuredSpec, _shown_error

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 2 * MAX_SOURCE_CHARS  # every tool's parameters together, as JSON: bounds the grammar's compile
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (and ".", which some frameworks use)
# the marker of a call in the Hermes format (the reply's ``auto`` branch and the rendered conversation)
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON, as structured outputs write it
_CHOICES = ("none", "auto", "required")


def _error(message: str, param: str) -> RequestError:
    return RequestError(message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Tool:
    """One function a model may call: its ``name``, ``parameters`` (a JSON schema object), and the request's
    definition as sent (``definition``: what a chat template or the tools prompt shows the model)."""

    name: str
    parameters: dict
    definition: dict


@dataclass(frozen=True)
class CallFormat:
    """How a chat template writes a reply's calls (what ``auto``'s call branch is): ``name``; ``key``: the
    arguments' key in a call's JSON; ``marker``: the text a reply of calls starts with (decoded, special tokens
    dropped), which a text reply never holds; ``opening``: the Lark that starts the calls (Mistral's token);
    ``parallel``: whether the template renders several calls in one assistant message."""

    name: str
    key: str = "arguments"
    marker: str = CALL_OPEN
    opening: str = ""
    parallel: bool = True


HERMES = CallFormat("hermes")
LLAMA3_JSON = CallFormat("llama3_json", key="parameters", marker='{"name":', parallel=False)
MISTRAL_MARKER = "[TOOL_CALLS]"
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, CallFormat("mistral", marker=MISTRAL_MARKER))}


@dataclass(frozen=True)
class ToolSet:
    """A request's tools and how it may call them: ``choice`` is ``none``, ``auto``, ``required`` or a tool's
    name; ``parallel``: several calls in one reply (OpenAI's ``parallel_tool_calls``, default true); ``fmt``: the
    model's call format (:func:`call_format`)."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True
    fmt: CallFormat = HERMES

    def in_format(self, fmt: CallFormat) -> "ToolSet":
        """These tools, called in ``fmt``."""
        return dataclasses.replace(self, fmt=fmt)

    @property
    def several(self) -> bool:
        """A reply may hold several calls (asked for, and its template renders them back)."""
        return self.parallel and self.fmt.parallel

    @property
    def layout(self) -> Optional[str]:
        """How a reply writes its calls: ``json`` (one call), ``list`` (a JSON list of calls), ``tagged`` (text or
        calls in the format's own way); None: no call can be made (``none``)."""
        if self.choice == "none":
            return None
        if self.choice == "auto":
            return "tagged"
        # a function named in tool_choice is called exactly once (OpenAI's "forced function", as vLLM does)
        return "list" if self.several and self.choice == "required" else "json"

    @property
    def stop_unless(self) -> Optional[str]:
        """Where stop strings do not apply (``SamplingParams.stop_unless``): a reply of calls, all of a forced one
        (``""``), an ``auto`` one that starts with the format's marker; None: they apply (no calls)."""
        layout = self.layout
        return None if layout is None else self.fmt.marker if layout == "tagged" else ""

    def definitions(self) -> list[dict]:
        return [t.definition for t in self.tools]

    def spec(self) -> Optional[StructuredSpec]:
        """The structured output that makes the reply a call (or text, for ``auto``); None for ``none``."""
        if self.layout is None:
            return None
        return StructuredSpec("tools", self.lark(), "tools")

    def lark(self) -> str:
        """The reply's grammar (llguidance's Lark, each call's arguments its tool's schema as ``%json``)."""
        named = [t for t in self.tools if self.choice in _CHOICES or t.name == self.choice]
        rules, fmt = [], self.fmt
        for i, t in enumerate(named):
            schema = {**t.parameters, "x-guidance": _JSON_OPTIONS}
            head = json.dumps('{"name":' + json.dumps(t.name) + f',"{fmt.key}":')
            rules.append(f"call_{i}: {head} %json {json.dumps(schema)} {json.dumps('}')}")
        call = "call: " + " | ".join(f"call_{i}" for i in range(len(named)))
        if self.layout == "json":
            start = "start: call"
        elif self.layout == "list":
            start = 'start: "[" call ("," call)* "]"'
        else:
            if fmt.name == "hermes":
                one = f"{json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}"
                tagged = one + (f' ({json.dumps(chr(10))} {one})*' if self.several else "")
            elif fmt.name == "mistral":
                tagged = f'{fmt.opening or json.dumps(MISTRAL_MARKER)} "[" call' + \
                    (' ("," call)*' if self.several else "") + ' "]"'
            else:
                tagged = "call"
            # text with no call marker anywhere: a reply is either text or calls, never a broken or unchecked call
            # (a marker after some text, "Sure.\n<tool_call>...", would come back as content holding a call)
            marker = re.escape(fmt.marker.rstrip("\n")).replace("/", "\\/")
            start = f"start: TEXT | tagged\ntagged: {tagged}\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/"
        return "\n".join([start, call, *rules])


# ---- parsing a request's tools ------------------------------------------------------------------------------------
def _closed(schema: Any) -> Any:
    """``schema`` with every object that does not say otherwise closed (``additionalProperties: false``): what a
    strict function's arguments are at OpenAI (no property beyond those declared)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: _closed(s) for name, s in v.items()}
        elif k in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "not", "if", "then",
                   "else", "contains"):
            out[k] = _closed(v)
        else:
            out[k] = v
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# what lets an object take keys it does not name, or lets another part of the schema name them
_OPENS = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf", "oneOf", "$ref",
          "not", "if", "dependentSchemas")


def _declared(schema: Any, top: bool = True) -> Any:
    """A non-strict function's ``schema`` with each object that names its properties (and the parameters object,
    which names the function's) taking no others, unless the schema says otherwise (its ``additionalProperties``, a
    key it requires without naming it, a part that may name more: ``allOf``, ``$ref``, ...). JSON schema's default
    lets a constrained model invent arguments, and small ones do (a tool without arguments got ``{"time":{"time":``
    until ``max_tokens``); vLLM's default grammar backend (xgrammar) closes them too. Free objects stay free."""
    if isinstance(schema, list):
        return [_declared(s, False) for s in schema]
    if not isinstance(schema, dict):
        return schema
    named = schema.get("properties", {} if top and schema.get("type") == "object" else None)
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _declared(s, False) for name, s in v.items()}
        elif k in ("items", "prefixItems", "additionalProperties") or (k in ("anyOf", "oneOf") and named is None):
            out[k] = _declared(v, False)  # a union's branches are whole objects unless beside named properties
        else:
            out[k] = v
    required = out.get("required", [])
    if isinstance(named, dict) and not any(k in out for k in _OPENS) and isinstance(required, list) \
            and set(map(str, required)) <= set(named):
        out["additionalProperties"] = False
    return out


def _check_unicode(value: Any, param: str) -> None:
    """A 400 when ``value`` has a string that is not Unicode text (JSON's ``\\ud800`` escapes decode to lone
    surrogates, which the tokenizer refuses with a TypeError)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise _error(f"{param} is not valid Unicode: it has a lone surrogate ({e.object[e.start]!r})", param) \
            from None
    except (RecursionError, ValueError, TypeError):
        pass  # not JSON: what the checks after this one refuse, naming it


def _tool(value: Any, i: int, flat: bool = False) -> tuple[Tool, int]:
    """Tool ``i`` of ``tools`` checked (and the size of its parameters as JSON). ``flat``: the Responses API's
    shape, the function's fields beside ``type`` (``{"type": "function", "name": ...}``), where a function is
    strict unless it says otherwise; else chat's, under ``function``."""
    where = f"tools.{i}"
    if not isinstance(value, dict):
        shape = "with type 'function' and a name" if flat else "with type 'function' and a function"
        raise _error(f"{where} must be an object {shape}", where)
    if value.get("type") != "function":  # OpenAI's custom tools (free-form input), its built-in ones: not here
        shown = json.dumps(value.get("type"))[:40] if not isinstance(value.get("type"), (dict, list)) else "an object"
        raise _error(f"{where}.type: {shown} is not supported (only 'function' tools)", f"{where}.type")
    fields = ("name", "description", "parameters", "strict")
    if flat:
        fn, at = {k: v for k, v in value.items() if k != "type"}, where
    else:
        extra = set(value) - {"type", "function"}
        if extra:
            raise _error(f"unknown field {sorted(extra)[0]!r} in {where}", f"{where}.{sorted(extra)[0]}")
        fn, at = value.get("function"), f"{where}.function"
        if not isinstance(fn, dict):
            raise _error(f"{at} must be an object with a name", at)
    extra = set(fn) - set(fields)
    if extra:
        raise _error(f"unknown field {sorted(extra)[0]!r} in {at}", f"{at}.{sorted(extra)[0]}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _error(f"{at}.name must be 1 to 64 letters, digits, '_', '-' or '.'", f"{at}.name")
    description, strict = fn.get("description"), fn.get("strict")
    if description is not None and not isinstance(description, str):
        raise _error(f"{at}.description must be a string", f"{at}.description")
    if strict is not None and not isinstance(strict, bool):
        raise _error(f"{at}.strict must be a boolean", f"{at}.strict")
    if strict is None and flat:  # the Responses API's default (chat's is false)
        strict = True
    for key in ("description", "parameters"):  # shown to the model as they came: lone surrogates would crash
        _check_unicode(fn.get(key), f"{at}.{key}")  # the tokenizer (a 500)
    param = f"{at}.parameters"
    params = fn.get("parameters")
    if params is None:  # OpenAI: a function without parameters takes none
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise _error(f"{param} must be a JSON schema (an object)", param)
    try:
        params = _closed(params) if strict else _declared(params)
        text = json.dumps(params, separators=(",", ":"), allow_nan=False)
    except (RecursionError, ValueError, TypeError) as e:
        raise _error(f"{param} is not a JSON schema that can be read back: {type(e).__name__}", param) from None
    if len(text) > MAX_SOURCE_CHARS:
        raise _error(f"{param} is too large: {len(text)} characters of JSON, at most {MAX_SOURCE_CHARS}", param)
    try:  # each schema on its own (microseconds, within llguidance's limits): the error names its tool
        problem = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS),
            limits=llguidance.LLParserLimits(**LIMITS))
    except ValueError as e:
        problem = str(e)
    if problem and not problem.startswith("WARNING"):
        raise _error(f"{param} cannot be used: {_shown_error(problem)}", param)
    # what the model is shown: chat's shape (its templates' and the tools prompt's), whichever API it came from
    # in one order (OpenAI's), not the client's: one tool is one prompt whichever API or framework sent it
    definition = {"type": "function", "function": {k: fn[k] for k in fields if fn.get(k) is not None}}
    return Tool(name, json.loads(text), definition), len(text)


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Optional[bool], flat: bool = False
                ) -> Optional[ToolSet]:
    """A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked: a :class:`ToolSet`, None when no
    tools are given (``tool_choice`` must then be absent or ``none``), or a 400 naming the field. ``flat``: the
    Responses API's shapes (a tool ``{"type": "function", "name": ...}``, a named choice ``{"type": "function",
    "name": ...}``), else chat's (``function: {"name": ...}`` in both)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise _error("tool_choice is only allowed when tools are given", "tool_choice")
        if parallel_tool_calls and not flat:  # the Responses API's default is true: taken without tools
            raise _error("parallel_tool_calls is only allowed when tools are given", "parallel_tool_calls")
        return None
    if not isinstance(tools, list):
        raise _error("tools must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise _error(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    parsed, total, seen = [], 0, set()
    for i, value in enumerate(tools):
        tool, size = _tool(value, i, flat)
        if tool.name in seen:
            at = f"tools.{i}.name" if flat else f"tools.{i}.function.name"
            raise _error(f"{at}: {tool.name!r} is given twice", at)
        seen.add(tool.name)
        parsed.append(tool)
        total += size
    if total > MAX_TOOLS_CHARS:
        raise _error(f"the tools' parameters are too large together: {total} characters of JSON, at most "
                     f"{MAX_TOOLS_CHARS}", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    named = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
    if isinstance(choice, dict):
        if flat:
            ok = set(choice) == {"type", "name"} and choice.get("type") == "function"
            name, where = choice.get("name"), "tool_choice.name"
        else:
            ok = set(choice) == {"type", "function"} and choice.get("type") == "function" \
                and isinstance(choice.get("function"), dict) and set(choice["function"]) == {"name"}
            name, where = (choice.get("function") or {}).get("name") if ok else None, "tool_choice.function.name"
        if not ok:
            raise _error(f'tool_choice must be "none", "auto", "required" or {named}', "tool_choice")
        if not isinstance(name, str) or name not in seen:
            raise _error(f"tool_choice names {json.dumps(name)[:80]}, which is not one of the tools", where)
        choice = name
    elif choice not in _CHOICES:
        raise _error(f'tool_choice must be "none", "auto", "required" or {named}', "tool_choice")
    return ToolSet(tuple(parsed), choice, True if parallel_tool_calls is None else parallel_tool_calls)


# ---- the conversation -------------------------------------------------------------------------------------------
def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (and tool calls and results) itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "tool_use" in template or any("tools" in str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def call_format(tokenizer: Any) -> CallFormat:
    """The call format the tokenizer's chat template writes (read from the template's text, as transformers'
    tool-use templates spell it): Hermes ``<tool_call>`` (Qwen2.5, Hermes), Mistral's ``[TOOL_CALLS]``, Llama 3.1's
    ``"parameters"`` JSON (with its results' ``ipython`` role: Command R's templates name ``"parameters"`` too, in
    calls of their own shape); Hermes for a template that takes no tools (:func:`hermes` renders them) or writes
    calls some other way."""
    if not template_takes_tools(tokenizer):
        return HERMES
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    if "<tool_call>" in template:
        return HERMES
    if MISTRAL_MARKER in template:
        ids = tokenizer.encode(MISTRAL_MARKER, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":  # its special token: unseen
            return dataclasses.replace(FORMATS["mistral"], marker='[{"name":', opening=f"<[{int(ids[0])}]>")
        return FORMATS["mistral"]
    if '"parameters"' in template and "ipython" in template:
        return LLAMA3_JSON
    return HERMES


def _mistral_id(call_id: str) -> str:
    """A call id as Mistral's template takes it (9 letters or digits): its last 9 when they are, else a digest."""
    tail = call_id[-9:]
    return tail if len(tail) == 9 and tail.isascii() and tail.isalnum() else \
        hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _arguments(text: str) -> Any:
    """A call's arguments as a template wants them (an object; text that is not JSON stays text)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def for_template(messages: list[dict], fmt: CallFormat = HERMES) -> list[dict]:
    """``messages`` (ours: ``tool_calls`` with JSON-text arguments) as transformers' chat templates take them (for
    Mistral's, call ids of 9 letters or digits)."""
    ids = _mistral_id if fmt.name == "mistral" else str
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": ids(c["id"]), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        if m.get("tool_call_id") is not None:
            m["tool_call_id"] = ids(m["tool_call_id"])
        out.append(m)
    return out


def call_text(name: str, arguments: str) -> str:
    """One call in the Hermes format (arguments: its JSON text)."""
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CALL_CLOSE}'


def hermes(messages: list[dict], toolset: Optional[ToolSet]) -> list[dict]:
    """``messages`` in the Hermes format for a template that knows no tools: the tools described in the system
    message (:data:`TOOLS_PROMPT`; a system message is added first if there is none), calls as ``<tool_call>``
    blocks after the assistant's text, results as a user message of ``<tool_response>`` blocks (consecutive results
    in one message)."""
    out: list[dict] = []
    results = False  # the last message is one of tool results
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        text = "\n".join(([content] if content else []) + calls)
        out.append({**{k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}, "content": text})
    if toolset is not None:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(d, ensure_ascii=False)
                                                       for d in toolset.definitions()))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}" if out[0]["content"] else described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def encode_conversation(orch: Any, messages: list[dict], toolset: Optional[ToolSet],
                        param: str = "messages") -> list[int]:
    """The token ids of a conversation with tools (its calls and results): the model's chat template with
    ``tools=`` when it takes them, else the Hermes rendering through ``orch.encode_chat``. A conversation the
    template refuses (Llama 3.1's: two calls in one message) is a 400 naming ``param``. Blocking: call it off the
    event loop."""
    tok = orch.tokenizer
    if template_takes_tools(tok):
        try:
            out = tok.apply_chat_template(for_template(messages, call_format(tok)),
                                          tools=toolset.definitions() if toolset else None,
                                          add_generation_prompt=True, tokenize=True)
        except jinja2.TemplateError as e:
            raise _error(f"the model's chat template cannot render this conversation: {str(e)[:300]}", param) \
                from None
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(x) for x in out]
    return orch.encode_chat(hermes(messages, toolset))


# ---- the reply ----------------------------------------------------------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    """A call read from the reply: its ``name``, its ``arguments`` (JSON text, cut if the reply was), ``complete``
    once its JSON closed."""

    name: str
    id: str = field(default_factory=call_id)
    arguments: str = ""
    complete: bool = False


class CallScanner:
    """Reads a reply's text, piece by piece, as the grammar of its :class:`ToolSet` shapes it (``layout``): each
    :meth:`feed` returns the events the new text completes: ``("content", text)``, ``("call", index)`` (a call's
    name is known) and ``("arguments", index, text)``. Character by character, once: a JSON scanner that knows
    strings and nesting, so a call's end is seen when it comes (no text held back but a possible call marker)."""

    def __init__(self, layout: str, fmt: CallFormat = HERMES):
        self.layout = layout
        self.fmt = fmt
        self._key = f',"{fmt.key}":'  # what ends a call's name, before its arguments
        self.calls: list[Call] = []
        self.content = ""
        self._mode = "undecided" if layout == "tagged" else "calls"
        self._head = ""  # text not yet placed: the start of a reply that may be a call marker, a call's opening
        self._depth = 0
        self._string = self._escape = False
        self._args = False  # inside the current call's arguments

    @property
    def is_calls(self) -> bool:
        """The reply is calls (not text)."""
        return self._mode == "calls"

    def feed(self, text: str) -> list[tuple]:
        events: list[tuple] = []
        if self._mode == "undecided":
            self._head += text
            if self.fmt.marker.startswith(self._head):
                return events
            if not self._head.startswith(self.fmt.marker):
                self._mode, text, self._head = "content", self._head, ""
            else:
                self._mode, text, self._head = "calls", self._head, ""
        if self._mode == "content":
            if text:
                self.content += text
                events.append(("content", text))
            return events
        piece_start = None  # where the current call's new arguments text starts in ``text``
        for j, ch in enumerate(text):
            if self._depth == 0:
                if ch == "{":
                    self._depth, self._head, self._args = 1, "{", False
                continue
            if not self._args:
                self._head += ch
                self._track(ch)
                if self._head.endswith(self._key) and self._depth == 1 and not self._string:
                    self.calls.append(Call(json.loads(self._head[len('{"name":'):-len(self._key)])))
                    events.append(("call", len(self.calls) - 1))
                    self._args, piece_start = True, j + 1
                continue
            self._track(ch)
            if self._depth == 0:  # the call's own closing brace
                call = self.calls[-1]
                piece = text[piece_start:j] if piece_start is not None else ""
                if piece:
                    call.arguments += piece
                    events.append(("arguments", len(self.calls) - 1, piece))
                call.complete, self._args, piece_start = True, False, None
            elif piece_start is None:
                piece_start = j
        if self._args and piece_start is not None and piece_start < len(text):
            piece = text[piece_start:]
            self.calls[-1].arguments += piece
            events.append(("arguments", len(self.calls) - 1, piece))
        return events

    def _track(self, ch: str) -> None:
        if self._string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._string = False
        elif ch == '"':
            self._string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def finish(self) -> list[tuple]:
        """The end of the reply: text held back as a possible call marker is content after all."""
        if self._mode == "undecided":
            self._mode, text, self._head = "content", self._head, ""
            if text:
                self.content += text
                return [("content", text)]
        return []


def read_reply(layout: str, text: str, fmt: CallFormat = HERMES) -> CallScanner:
    """A whole reply read: its content, or its calls."""
    scanner = CallScanner(layout, fmt)
    scanner.feed(text)
    scanner.finish()
    return scanner


def openai_calls(calls: list[Call]) -> list[dict]:
    """OpenAI's ``message.tool_calls``."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def finish_reason(scanner: CallScanner, finish: str) -> str:
    """A reply's ``finish_reason``: ``tool_calls`` when it ended (``stop``) with its calls whole."""
    if scanner.is_calls and scanner.calls and finish == "stop" and all(c.complete for c in scanner.calls):
        return "tool_calls"
    return finish
