"""Structured outputs: JSON mode, JSON schema, regex, choice and Lark grammars, by constrained decoding.

The one module that knows llguidance (Microsoft's grammar engine, which vLLM and llama.cpp use). A request's
``response_format`` (chat, OpenAI's shapes), ``text.format`` (the Responses API) or ``structured_outputs`` (vLLM's
extra: ``json``, ``regex``, ``choice`` or ``grammar``) is parsed into a :class:`StructuredSpec`; :func:`compile_spec`
checks and compiles it against the model's tokenizer (compiled once per model and cached) into a :class:`Grammar`,
which hands each generated sequence its own :class:`GrammarState`. The sampler masks that sequence's logits to the
tokens the grammar allows before anything else touches them (sampling.py), and the state consumes every token the
sequence emits. Once the output is complete only an end token is allowed, so a generation ends with "stop"; one cut
by ``max_tokens`` ends "length" with its text cut, as OpenAI's.

A bad or too large schema or grammar is a 400 (``invalid_request_error``) naming the body field, raised by
:func:`compile_spec` within llguidance's resource limits (lexer fuel, grammar size), never a hung orchestrator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import llguidance
import numpy as np
import torch

from petals_chain.orchestrator.errors import RequestError

logger = logging.getLogger(__name__)

# The most characters a schema (serialized), regex, grammar or list of choices may have. OpenAI's strict schemas stop
# at 15,000 characters of names and values; this is room for any schema a client writes, and bounds the compile time
# (a 150 KB schema of 3,000 patterned properties took 1.3 s).
MAX_SOURCE_CHARS = 65_536
MAX_CHOICES = 1024
# llguidance's limits for one request's grammar: below its defaults for the grammar's size and the lexer's build,
# which bound the compile time of a hostile one to well under a second on one core.
LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=100_000, verbose_errors=False)
# JSON output as OpenAI's: no whitespace between tokens of the JSON itself (a small model that may add whitespace
# anywhere can pad its output with newlines until max_tokens)
JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance takes a JSON schema's top-level "x-guidance" object as its compile options, over JSON_OPTIONS (it reads
# no nested one): removed from a client's schema, whose output format is this server's to set
GUIDANCE_OPTIONS_KEY = "x-guidance"
# The grammar CPU one sequence may spend (computing masks, taking tokens, checking drafts), in seconds of its threads'
# CPU time: GRAMMAR_CPU_BASE_S plus GRAMMAR_CPU_PER_TOKEN_S for each token taken so far. Measured on SmolLM2's 49k
# tokens: a pydantic model (nested objects, lists, enums, optionals), a 50-property anyOf object, a 50-variant anyOf,
# a 300-value enum, a repeated regex and JSON mode cost 0.010-0.03 ms a token (mask + take + a 5-token draft's
# check), at most 1.8 ms for one token (a regex's first mask): 70x under the allowance a token. An ambiguous grammar
# (``a: a a | "x"``) costs more with every token (5 ms at token 200, 170 ms at 700): past the budget (~1.1 s of CPU,
# near token 280) its request gets a 400, where llguidance's own limits let it stall the head's thread (shared by
# every generation) for minutes.
GRAMMAR_CPU_BASE_S = 0.5
GRAMMAR_CPU_PER_TOKEN_S = 0.002
# At most this many schemas or grammars compile at once (each up to ~1 s of CPU), in their own threads: a burst of
# clients compiling neither takes every core nor holds up the default executor's work (tokenizing prompts)
MAX_CONCURRENT_COMPILES = 2
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar")


def _error(message: str, param: str) -> RequestError:
    return RequestError(message, param=param, code="invalid_structured_output")


def _json_text(value: Any, param: str) -> str:
    """``value`` (a JSON schema) as compact JSON text, bounded in size and depth (a nesting deeper than Python's
    recursion limit was a RecursionError)."""
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (RecursionError, ValueError, TypeError) as e:
        raise _error(f"{param} is not a JSON schema that can be read back: {type(e).__name__}", param) from None
    if len(text) > MAX_SOURCE_CHARS:
        raise _error(f"{param} is too large: {len(text)} characters of JSON, at most {MAX_SOURCE_CHARS}", param)
    return text


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _error(f"{param} must be a non-empty string ({what})", param)
    if len(value) > MAX_SOURCE_CHARS:
        raise _error(f"{param} is too long: {len(value)} characters, at most {MAX_SOURCE_CHARS}", param)
    return value


@dataclass(frozen=True)
class StructuredSpec:
    """What a request's output must match: ``kind`` (one of :data:`KINDS`) and ``source`` (the schema as JSON text,
    the regex, the choices as a tuple, or the Lark grammar; None for ``json_object``). ``param`` is the body field it
    came in (for errors); ``name``/``description``/``strict`` are a ``json_schema`` format's own, echoed back."""

    kind: str
    source: Any = None
    param: str = "response_format"
    name: str | None = None
    description: str | None = None
    strict: bool | None = None

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_response_format(cls, fmt: Any, param: str = "response_format") -> "StructuredSpec | None":
        """OpenAI's chat ``response_format``: ``{"type": "text"}`` (None: no constraint), ``{"type": "json_object"}``
        or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``; vLLM's
        completions take the same."""
        if not isinstance(fmt, dict):
            raise _error(f"{param} must be an object with a type", param)
        kind = fmt.get("type")
        extra = set(fmt) - {"type", "json_schema"}
        if extra:
            raise _error(f"unknown field {sorted(extra)[0]!r} in {param}", f"{param}.{sorted(extra)[0]}")
        if kind == "text":
            return None
        if kind == "json_object":
            if fmt.get("json_schema") is not None:
                raise _error(f"{param}.json_schema is only for type 'json_schema'", f"{param}.json_schema")
            return cls("json_object", None, param)
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict):
                raise _error(f"{param}.json_schema must be an object with a name and a schema",
                             f"{param}.json_schema")
            return cls._json_schema(inner, f"{param}.json_schema")
        shown = json.dumps(kind)[:80] if isinstance(kind, (str, int, float, bool, type(None))) else type(kind).__name__
        where = f"{param}.type" if kind is not None else param
        raise _error(f"{where}: {shown} is not supported (only 'text', 'json_object' or 'json_schema')", where)

    @classmethod
    def from_text_format(cls, fmt: Any, param: str = "text.format") -> "StructuredSpec | None":
        """The Responses API's ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
        "json_schema", "name", "schema", "strict", "description"}`` (flat, as ``responses.parse`` sends it)."""
        if not isinstance(fmt, dict):
            raise _error(f"{param} must be an object with a type", param)
        kind = fmt.get("type")
        if kind in ("text", "json_object"):
            extra = set(fmt) - {"type"}
            if extra:
                raise _error(f"unknown field {sorted(extra)[0]!r} in {param} of type {kind!r}",
                             f"{param}.{sorted(extra)[0]}")
            return None if kind == "text" else cls("json_object", None, param)
        if kind == "json_schema":
            return cls._json_schema({k: v for k, v in fmt.items() if k != "type"}, param)
        shown = json.dumps(kind)[:80] if isinstance(kind, (str, int, float, bool, type(None))) else type(kind).__name__
        raise _error(f"{param}.type: {shown} is not supported (only 'text', 'json_object' or 'json_schema')",
                     f"{param}.type")

    @classmethod
    def _json_schema(cls, inner: dict, param: str) -> "StructuredSpec":
        extra = set(inner) - {"name", "schema", "strict", "description"}
        if extra:
            raise _error(f"unknown field {sorted(extra)[0]!r} in {param}", f"{param}.{sorted(extra)[0]}")
        name, description, strict = inner.get("name"), inner.get("description"), inner.get("strict")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise _error(f"{param}.name must be a string of 1 to 64 characters", f"{param}.name")
        if description is not None and not isinstance(description, str):
            raise _error(f"{param}.description must be a string", f"{param}.description")
        if strict is not None and not isinstance(strict, bool):
            raise _error(f"{param}.strict must be a boolean", f"{param}.strict")
        schema = inner.get("schema", {})  # OpenAI's default: any JSON object is not implied; {} is any JSON value
        if not isinstance(schema, dict):
            raise _error(f"{param}.schema must be a JSON schema (an object)", f"{param}.schema")
        return cls("json_schema", _json_text(schema, f"{param}.schema"), f"{param}.schema", name, description,
                   strict)

    @classmethod
    def from_structured_outputs(cls, value: Any, param: str = "structured_outputs") -> "StructuredSpec | None":
        """vLLM's ``structured_outputs`` (>= 0.10; ``guided_*`` before): exactly one of ``json`` (a schema, or its
        JSON text), ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark, llguidance's dialect)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise _error(f"{param} must be an object with one of {', '.join(STRUCTURED_OUTPUT_KEYS)}", param)
        unknown = [k for k in value if k not in STRUCTURED_OUTPUT_KEYS]
        if unknown:
            raise _error(f"{param}.{unknown[0]} is not supported (one of {', '.join(STRUCTURED_OUTPUT_KEYS)})",
                         f"{param}.{unknown[0]}")
        given = [k for k in STRUCTURED_OUTPUT_KEYS if value.get(k) is not None]
        if len(given) != 1:
            raise _error(f"{param} takes exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}, got "
                         f"{', '.join(given) or 'none'}", param)
        key = given[0]
        v, where = value[key], f"{param}.{key}"
        if key == "json":
            if isinstance(v, str):
                if len(v) > MAX_SOURCE_CHARS:
                    raise _error(f"{where} is too large: {len(v)} characters, at most {MAX_SOURCE_CHARS}", where)
                try:
                    v = json.loads(v)
                except (ValueError, RecursionError) as e:
                    raise _error(f"{where} is not valid JSON: {str(e)[:200]}", where) from None
            if not isinstance(v, dict):
                raise _error(f"{where} must be a JSON schema (an object, or its JSON text)", where)
            return cls("json_schema", _json_text(v, where), where)
        if key == "regex":
            return cls("regex", _text(v, where, "a regular expression"), where)
        if key == "grammar":
            return cls("grammar", _text(v, where, "a Lark grammar"), where)
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise _error(f"{where} must be a non-empty list of non-empty strings", where)
        if len(v) > MAX_CHOICES or sum(len(c) for c in v) > MAX_SOURCE_CHARS:
            raise _error(f"{where} is too large: at most {MAX_CHOICES} choices of {MAX_SOURCE_CHARS} characters in "
                         "all", where)
        return cls("choice", tuple(v), where)

    # ---- what it is ----------------------------------------------------------------------------
    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) of this spec."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            schema = json.loads(self.source)
            schema.pop(GUIDANCE_OPTIONS_KEY, None)  # the client's would override JSON_OPTIONS (whitespace anywhere)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind in ("grammar", "tools"):  # tools: tools.py's grammar of a reply's tool calls (Lark)
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        # one of the strings exactly: a Lark alternation of JSON-quoted literals (Lark takes JSON string escapes)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.source))

    def text_format(self) -> dict:
        """The Responses API's ``text.format`` echo of this spec (``json_schema``: its name, schema, strict; vLLM's
        kinds, which the Responses API has no name for: ``text``)."""
        if self.kind == "json_schema":
            return {"type": "json_schema", "name": self.name, "schema": json.loads(self.source),
                    "description": self.description, "strict": self.strict}
        return {"type": "json_object" if self.kind == "json_object" else "text"}


# ---- tokenizers -------------------------------------------------------------------------------------------------
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple, llguidance.LLTokenizer]]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab: int, eos: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of a Hugging Face fast tokenizer, with ``vocab`` tokens (the LM head's, at least the
    tokenizer's own) and ``eos`` as its end tokens; built once per (tokenizer, vocab, eos), ~0.6 s for SmolLM2's
    49k tokens: call it off the event loop. A slow tokenizer is a 400 (llguidance reads the fast one's JSON)."""
    ends = sorted({int(t) for t in eos})
    if not ends:
        raise _error("structured outputs need a model with an end-of-sequence token; this one has none",
                     "response_format")
    n_vocab = max(int(vocab), len(tokenizer))
    key = (n_vocab, tuple(ends))
    with _TOKENIZERS_LOCK:  # one build per model, not one per concurrent first request
        built = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in built:
            import llguidance.hf

            try:
                built[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=ends)
            except ValueError as e:
                raise _error(f"structured outputs are not available for this model's tokenizer ({e})",
                             "response_format") from None
        return built[key]


# ---- compiled grammars and their per-sequence states ------------------------------------------------------------
class Grammar:
    """A checked, compiled grammar bound to one model's tokenizer; :meth:`state` makes each sequence's own."""

    def __init__(self, spec: StructuredSpec, tokenizer: llguidance.LLTokenizer, vocab: int):
        self.spec = spec
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.eos = tuple(tokenizer.eos_tokens)
        limits = llguidance.LLParserLimits(**LIMITS)
        self._matcher = llguidance.LLMatcher(tokenizer, spec.grammar_text(), log_level=0, limits=limits)
        if self._matcher.is_error():
            raise _error(f"{spec.param} cannot be used: {_shown_error(self._matcher.get_error())}", spec.param)
        # an unsatisfiable schema (minLength above maxLength, a $ref to itself) compiles, and its first mask allows
        # nothing but EOS: an empty answer that says "stop". Refused here instead
        probe = GrammarState(self, self._matcher.deep_copy())
        probe._failed = True  # its error is this request's 400, not an output failed mid-way: no warning logged
        probe.allowed()
        if probe.matcher.is_error():
            raise _error(f"{spec.param} cannot be used: no output can match it "
                         f"({_shown_error(probe.matcher.get_error())})", spec.param)

    def state(self, ends: Iterable[int] = ()) -> "GrammarState":
        """A fresh state at the start of the output (a copy of the compiled matcher: microseconds)."""
        return GrammarState(self, self._matcher.deep_copy(), ends)


def _shown_error(message: str) -> str:
    """llguidance's error on one line, without the parser state it may dump after it, at most 300 characters."""
    lines = []
    for line in message.splitlines():
        if line.strip().startswith("<state>"):
            break
        if line.strip() and not line.lstrip().startswith(("^", "|")) and "|" not in line[:6]:
            lines.append(line.strip())
    return (" ".join(lines) or "invalid grammar")[:300]


# The clock of the grammar CPU budget: the calling thread's CPU time (a loaded machine's waits are not charged)
_cpu_clock = time.thread_time


class GrammarState:
    """One sequence's place in its grammar. ``ends``: the sequence's other stop token ids (``stop_token_ids``),
    allowed wherever the grammar allows an end of sequence: they end the output as EOS does.

    Every mask, token taken and draft checked is charged to the sequence's grammar CPU budget
    (:data:`GRAMMAR_CPU_BASE_S` + :data:`GRAMMAR_CPU_PER_TOKEN_S` a token); past it :attr:`error` says so, the masks
    allow nothing, :meth:`consume` raises and no draft is taken: the sampler fails that row alone (a 400)."""

    def __init__(self, grammar: Grammar, matcher: llguidance.LLMatcher, ends: Iterable[int] = ()):
        self.grammar = grammar
        self.matcher = matcher
        self._eos = grammar.eos
        self._ends = tuple(sorted({int(t) for t in ends} - set(self._eos)))
        self._mask = np.empty((grammar.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        self.consumed = 0
        self._failed = False
        self.cpu_s = 0.0  # grammar CPU spent so far (seconds)
        self._over: str | None = None  # why the budget is spent, once it is

    @property
    def error(self) -> str | None:
        """Why this output cannot go on (llguidance's limit hit, or the grammar CPU budget spent); None while it can."""
        if self._over is not None:
            return self._over
        if self.matcher.is_error():
            return (self.matcher.get_error().splitlines() or [""])[0].replace("<non-verbose/>", "").strip() or \
                "no detail"
        return None

    def _charge(self, since: float) -> None:
        """Add the CPU spent since ``since`` (a :func:`_cpu_clock` reading); past the budget, :attr:`error` says so."""
        self.cpu_s += max(0.0, _cpu_clock() - since)
        allowance = GRAMMAR_CPU_BASE_S + GRAMMAR_CPU_PER_TOKEN_S * (self.consumed + 1)
        if self._over is None and self.cpu_s > allowance:
            self._over = (f"its grammar took {self.cpu_s:.2f} s of CPU for {self.consumed} tokens, over this "
                          f"server's budget ({GRAMMAR_CPU_BASE_S:g} s + {GRAMMAR_CPU_PER_TOKEN_S * 1e3:g} ms a "
                          "token)")
            if not self._failed:
                self._failed = True
                logger.warning("a structured output failed mid-output (its request gets a 400): %s", self._over)

    def allowed(self) -> np.ndarray:
        """A bool array over the tokenizer's vocabulary: which tokens may come next (none once :attr:`error` is
        the spent budget: no more CPU goes to this grammar)."""
        if self._over is not None:
            return np.zeros(self._mask.size * 32, dtype=bool)
        start = _cpu_clock()
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        self._charge(start)
        if self.matcher.is_error() and not self._failed:  # a resource limit hit mid-output: the sampler fails the row
            self._failed = True
            logger.warning("a structured output failed mid-output (its request gets a 400): %s",
                           _shown_error(self.matcher.get_error()))
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little").view(bool)
        if self._ends and allowed[list(self._eos)].any():
            allowed[list(self._ends)] = True
        return allowed

    def mask_(self, row: torch.Tensor) -> None:
        """Set every token of ``row`` [vocab] (CPU float32 logits) the grammar forbids next to -inf, in place."""
        allowed = self.allowed()
        values = row.numpy()
        vocab = min(len(values), len(allowed))
        np.copyto(values[:vocab], -np.inf, where=~allowed[:vocab])
        values[vocab:] = -np.inf  # the head's rows past the tokenizer's vocabulary: no token to allow

    def consume(self, token: int) -> None:
        """Advance past ``token``, an emitted one. A stop token the grammar does not know (``stop_token_ids``) ends
        the output and is not consumed; a token the grammar forbids raises ValueError (a caller's bug, or a replay
        of tokens this grammar did not produce)."""
        token = int(token)
        if token in self._ends:
            return
        if self._over is not None:
            raise ValueError(self._over)
        start = _cpu_clock()
        taken = self.matcher.consume_token(token)
        if taken:
            self.consumed += 1
        self._charge(start)
        if not taken:
            raise ValueError(f"token {token} is not allowed by the grammar here: "
                             f"{_shown_error(self.matcher.get_error())}")
        if self._over is not None:
            raise ValueError(self._over)

    def fork(self) -> "GrammarState":
        """A copy at this point, for a draft to take its tokens in (this state takes them once verified); its CPU
        is this sequence's: give it back with :meth:`join`. The copy is charged too: it grows with the output (the
        parser's rows, ~1 ms at 8k tokens) and a draft model forks at every step."""
        start = _cpu_clock()
        twin = GrammarState(self.grammar, self.matcher.deep_copy(), self._ends)
        self._charge(start)
        twin.consumed, twin.cpu_s, twin._over = self.consumed, self.cpu_s, self._over
        twin._failed = True  # a draft past the budget just stops; this state's next step reports it
        return twin

    def join(self, twin: "GrammarState") -> None:
        """Charge the CPU ``twin`` (a :meth:`fork` of this state) spent to this sequence's grammar budget."""
        self.cpu_s = max(self.cpu_s, twin.cpu_s)

    def replay(self, tokens: Sequence[int]) -> None:
        """Consume ``tokens`` (a stream resumed, a test): the state they lead to."""
        for t in tokens:
            self.consume(t)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a draft) the grammar takes from here, without consuming them (none once the
        budget is spent: the next mask fails the row)."""
        if not tokens or self._over is not None:
            return 0
        start = _cpu_clock()
        n = int(self.matcher.validate_tokens([int(t) for t in tokens]))
        self._charge(start)
        return n

    @property
    def complete(self) -> bool:
        """The output so far is a whole match, and nothing more may follow (only an end token)."""
        return bool(self.matcher.is_stopped())


def compile_spec(spec: StructuredSpec, tokenizer: Any, vocab: int, eos: Iterable[int]) -> Grammar:
    """Check and compile ``spec`` for a model (its HF tokenizer, the LM head's ``vocab``, its ``eos`` ids): a
    :class:`Grammar`, or a 400 naming ``spec.param``. Takes up to about a second for a large schema (and ~0.6 s the
    first time for a model's tokenizer): run it off the event loop."""
    lltok = ll_tokenizer(tokenizer, vocab, eos)
    try:
        return Grammar(spec, lltok, vocab)
    except RequestError:
        raise
    except ValueError as e:  # llguidance raises for malformed input it reads itself (its JSON)
        raise _error(f"{spec.param} cannot be used: {_shown_error(str(e))}", spec.param) from None


def check_spec(spec: StructuredSpec) -> None:
    """The 400 :func:`compile_spec` gives ``spec``, as far as it can be told without the model's tokenizer: a bad
    schema, regex or grammar, an unsatisfiable schema, llguidance's limits on the grammar. Not what only the compile
    finds (a grammar no output can match, such as a ``$ref`` to itself; a limit hit over the vocabulary). It builds
    no lexer over the vocabulary (1.5 to 4 times less work than the compile over a 768-token one, far less over
    SmolLM2's 49k) and no llguidance tokenizer: for a request refused (429) once found valid."""
    try:
        problem = llguidance.LLMatcher.validate_grammar(spec.grammar_text(),
                                                        limits=llguidance.LLParserLimits(**LIMITS))
    except ValueError as e:
        problem = str(e)
    if problem and not problem.startswith("WARNING"):
        raise _error(f"{spec.param} cannot be used: {_shown_error(problem)}", spec.param)


_COMPILE_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_COMPILE_POOL_LOCK = threading.Lock()


async def _in_compile_pool(fn: Any, *args: Any) -> Any:
    global _COMPILE_POOL
    with _COMPILE_POOL_LOCK:
        if _COMPILE_POOL is None:
            _COMPILE_POOL = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_COMPILES,
                                                                  thread_name_prefix="grammar-compile")
        pool = _COMPILE_POOL
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


async def compile_spec_async(spec: StructuredSpec, tokenizer: Any, vocab: int, eos: Iterable[int]) -> Grammar:
    """:func:`compile_spec` off the event loop, in a pool of :data:`MAX_CONCURRENT_COMPILES` threads of its own (a
    burst of compiles waits there, not in the default executor, where prompts are tokenized)."""
    return await _in_compile_pool(compile_spec, spec, tokenizer, vocab, list(eos))


async def check_spec_async(spec: StructuredSpec) -> None:
    """:func:`check_spec` off the event loop, in the compiles' pool."""
    await _in_compile_pool(check_spec, spec)


# ---- metrics ------------------------------------------------------------------------------------------------------
_COUNTERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def request_counter(registry: Any) -> Any:
    """``petals_chain_structured_requests{kind, outcome}`` in ``registry`` (made once per registry): requests with a
    structured output, by kind, and whether their schema or grammar compiled (``ok``) or was refused (``invalid``)."""
    counter = _COUNTERS.get(registry)
    if counter is None:
        from prometheus_client import Counter

        counter = _COUNTERS[registry] = Counter(
            "petals_chain_structured_requests", "Requests with a structured output (JSON mode, JSON schema, regex, "
            "choice, grammar) by kind, and whether their schema or grammar compiled (ok) or was a 400 (invalid)",
            ["kind", "outcome"], registry=registry)
    return counter
