"""Review of caf3e00 (tools and structured outputs): what it left wrong.

* Command R's templates (R7B's, R+'s tool_use) name ``"parameters"`` in their own call shape and were read as Llama
  3.1's JSON calls (one call a reply, ``{"name": ..., "parameters": ...}``); the README says any other template gets
  Hermes. Llama 3.x's is told by its results' ``ipython`` role too.
* A draft model's fork of a sequence's grammar state copied the parser (a copy that grows with the output) without
  charging its CPU to the sequence's grammar budget.
* Chat completions rendered a ``role: "tool"`` message with no assistant ``tool_calls`` before it (the result of
  nothing); OpenAI answers 400 "messages with role 'tool' must be a response to a preceding message with
  'tool_calls'".

The API test runs the orchestrator in this process over fake chains on the tiny random-weight model."""

from __future__ import annotations

import json
import pytest
from test_s33_api_envelope import fake_chain_app
from test_s36_tools_api import MSGS, TOOLS, _run
from test_s37_tools_left import LLAMA31, MISTRAL

from petals_chain.orchestrator import structured
from petals_chain.orchestrator.tools import call_format

# the parts of CohereForAI's tool-use templates that write a call (c4ai-command-r7b-12-2024's, c4ai-command-r-plus's)
COMMAND_R7B = (
    "{% if tools %}Each tool is represented as a JSON object with fields like \"name\", \"description\", "
    "\"parameters\" (per JSON Schema){% for tool in tools %}{\"name\": \"{{ tool['function']['name'] }}\", "
    "\"parameters\": {{ tool['function']['parameters']|tojson }}}{% endfor %}{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}<|START_ACTION|>[{% for tc in message.tool_calls %}"
    "{\"tool_call_id\": \"{{ loop.index0 }}\", \"tool_name\": \"{{ tc['function']['name'] }}\", \"parameters\": "
    "{{ tc['function']['arguments']|tojson }}}{% endfor %}]<|END_ACTION|>{% endif %}{% endfor %}")
COMMAND_R_PLUS = (
    "{%- for tool in tools %}{{- '```python\\ndef ' + tool.function.name + '(' }}{%- endfor %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "{{- '\\nAction:\\n```json\\n[\\n' }}{%- for tool_call in message.tool_calls %}"
    "{{- '\"tool_name\": \"' + tool_call.function.name + '\",\\n' }}{{- '\"parameters\": ' }}{%- endfor %}"
    "{%- elif message.role == 'tool' %}{{- '<results>' + message.content + '</results>' }}{%- endif %}{%- endfor %}")


def test_command_r_templates_are_not_read_as_llama_calls():
    """Command R7B's and R+'s templates take tools and name ``"parameters"``, but write calls as
    ``{"tool_call_id": ..., "tool_name": ..., "parameters": ...}`` lists: Hermes, as for any template whose format
    this server does not write (several calls a reply). Llama 3.1's (its results' ``ipython`` role) stays Llama's,
    Mistral's Mistral's. Before: both Command R templates were Llama 3.1's JSON, one call a reply."""
    class Tok:  # a tokenizer's template, and [TOOL_CALLS] as text (no special token)
        def __init__(self, template):
            self.chat_template = template

        def encode(self, text, add_special_tokens=False):
            return [1, 2]

    got = {name: call_format(Tok(t)).name
           for name, t in (("r7b", COMMAND_R7B), ("r+", COMMAND_R_PLUS), ("llama", LLAMA31), ("mistral", MISTRAL))}
    assert got == {"r7b": "hermes", "r+": "hermes", "llama": "llama3_json", "mistral": "mistral"}, got


def test_a_grammar_fork_charges_its_copy(tiny_model_factory):
    """A fork (a draft model's, at every step) copies the parser, whose rows grow with the output: that CPU is the
    sequence's, charged to its grammar budget. Before: a fork and its join left ``cpu_s`` as it was."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_factory("llama", num_layers=2))
    spec = structured.StructuredSpec("json_schema", json.dumps({"type": "array", "items": {"type": "string"}}),
                                     "response_format")
    state = structured.compile_spec(spec, tok, len(tok), [tok.eos_token_id]).state()
    state.replay(tok.encode('["' + '","'.join(f"w{i}" for i in range(100)), add_special_tokens=False))
    before = state.cpu_s
    for _ in range(5):
        twin = state.fork()
        state.join(twin)  # nothing drafted in the twin: what is charged is the copies alone
    assert state.cpu_s > before, (before, state.cpu_s)


@pytest.fixture(scope="module")
def api(tiny_model_factory):
    with pytest.MonkeyPatch.context() as patch:
        yield from fake_chain_app(tiny_model_factory, patch, max_length=1024, no_chain_wait_s=5.0)


def test_a_tool_result_without_a_call_before_it_is_refused(api):
    """A ``role: "tool"`` message with no assistant ``tool_calls`` before it (first after the user's, after a text
    reply), with tools or without, streamed or not: OpenAI's 400, naming the message's role. A result after its call
    (and a second one beside it) is taken. Before: rendered, a tool's result of nothing shown to the model (200)."""
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    refused = [(MSGS + [result], {}, "messages.1.role"),
               (MSGS + [{"role": "assistant", "content": "Let me see."}, result], {"tools": TOOLS}, "messages.2.role"),
               (MSGS + [result], {"tools": TOOLS, "stream": True}, "messages.1.role")]
    taken = MSGS + [call, result, {**result, "content": "and warm"}]

    async def fn(orch, c):
        body = {"model": orch.model_id, "max_tokens": 1, "tool_choice": "none"}
        out = [(param, await c.post("/v1/chat/completions", json={**body, "messages": msgs, **extra}))
               for msgs, extra, param in refused]
        return out, await c.post("/v1/chat/completions", json={**body, "messages": taken, "tools": TOOLS})

    out, ok = _run(api, fn)
    for param, r in out:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "must be a response to a preceding message with 'tool_calls'" in \
            err["message"], err
    assert ok.status_code == 200, ok.text
