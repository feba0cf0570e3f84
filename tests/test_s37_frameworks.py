"""Agent frameworks in front of the orchestrator's OpenAI API: the exact request bodies and headers that
langchain-openai 1.7.4, litellm 1.110.2, openai-agents 0.24.0, pydantic-ai 2.68.0 and the openai package 3.57.0 sent
to a real orchestrator serving SmolLM2 (recorded by a logging proxy; what was tried is in the session's rows of
docs/results.md), replayed here with httpx. Only the model name differs (the tiny model's). The defects they showed:

* a tool whose parameters are not ``strict`` (LangChain's ``bind_tools`` and litellm send none) had its objects
  open: the grammar let the model invent arguments, and a tool without arguments (``{"properties": {}}``) got
  ``{"time":{"time":...`` until ``max_tokens`` (LangChain then returned no tool call at all);
* a function named in ``tool_choice`` was a list of calls the model could go on with (LangChain ran ``now`` twice);
* a tool was shown to the model in its JSON's key order, so one agent's tool over the Responses API (openai-agents
  and pydantic-ai send ``name, parameters, ..., description``) and over chat completions (``name, description,
  parameters``) gave two prompts, and two answers;
* the message the openai package's ``chat.completions.stream()`` hands back (its calls carry ``index``) was a 400.

The orchestrator runs in this process over fake chains (test_s33_api_envelope's) on the tiny random-weight model;
the chains record the prompt they are given."""

from __future__ import annotations

import asyncio
import json

import httpx
import llguidance
import pytest
from test_s33_api_envelope import FakeChainSession, _chain, fake_chain_app

from petals_chain.orchestrator import failover
from petals_chain.orchestrator.tools import parse_tools

OPENAI_SDK = {"user-agent": "OpenAI/Python 3.57.0", "x-stainless-lang": "python",
              "x-stainless-package-version": "3.57.0", "x-stainless-os": "Linux", "x-stainless-arch": "x64",
              "x-stainless-runtime": "CPython", "x-stainless-runtime-version": "3.11.7",
              "x-stainless-async": "false", "x-stainless-retry-count": "0", "authorization": "Bearer sk-none",
              "accept": "application/json", "content-type": "application/json"}
AGENTS_SDK = {**OPENAI_SDK, "user-agent": "Agents/Python 0.24.0", "x-stainless-async": "async:asyncio",
              "x-stainless-read-timeout": "600"}
LITELLM_VLLM = {"accept": "*/*", "user-agent": "litellm/1.110.2", "authorization": "Bearer fake-api-key",
                "content-type": "application/json"}

# langchain-openai: ChatOpenAI(max_tokens=30, temperature=0).bind_tools([now], tool_choice="now") of a @tool
# ``def now() -> str``
LC_NOARGS = {"model": "smollm2-135m", "stream": False, "messages": [{"content": "What time is it?", "role": "user"}],
             "max_completion_tokens": 30, "temperature": 0.0,
             "tool_choice": {"type": "function", "function": {"name": "now"}},
             "tools": [{"type": "function", "function": {"name": "now", "description": "Current time.",
                                                         "parameters": {"properties": {}, "type": "object"}}}]}
# litellm.completion(model="hosted_vllm/...", tools=..., tool_choice="required", max_tokens=20, temperature=0)
LITELLM_NOARGS = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "time?"}], "temperature": 0,
                  "max_tokens": 20, "tool_choice": "required",
                  "tools": [{"type": "function", "function": {"name": "now", "description": "time",
                                                              "parameters": {"type": "object", "properties": {}}}}]}
# langchain-openai: the parameters of a @tool ``def add(a: int, b: int) -> int``
_INTS = {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "type": "object"}

_ADD_ARGS = {"properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
             "required": ["a", "b"], "title": "add_args", "type": "object", "additionalProperties": False}
# openai-agents: Agent(instructions=..., tools=[add], model_settings=ModelSettings(temperature=0, max_tokens=40,
# tool_choice="required")) over OpenAIResponsesModel, then over OpenAIChatCompletionsModel
AGENTS_RESPONSES = {"model": "smollm2-135m", "include": [], "input": [{"content": "What is 2+3?", "role": "user"}],
                    "instructions": "You are a calculator. Use the add tool.", "max_output_tokens": 40,
                    "temperature": 0.0, "tool_choice": "required",
                    "tools": [{"name": "add", "parameters": _ADD_ARGS, "strict": True, "type": "function",
                               "description": "Add two integers."}]}
AGENTS_CHAT = {"model": "smollm2-135m", "messages": [{"content": "You are a calculator. Use the add tool.",
                                                      "role": "system"},
                                                     {"role": "user", "content": "What is 2+3?"}],
               "max_tokens": 40, "temperature": 0.0, "tool_choice": "required",
               "tools": [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                           "parameters": _ADD_ARGS, "strict": True}}]}
_P = {"properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"],
      "type": "object", "additionalProperties": False}
_FINAL = "The final response which ends this conversation"
# pydantic-ai: Agent(model, output_type=P, model_settings=ModelSettings(max_tokens=30, temperature=0)) over
# OpenAIResponsesModel, then over OpenAIChatModel (its output tool)
PYDANTIC_AI_RESPONSES = {"model": "smollm2-135m", "stream": False, "input": [{"role": "user", "content": "Bob is 30"}],
                         "max_output_tokens": 30, "temperature": 0, "tool_choice": "required",
                         "tools": [{"name": "final_result", "parameters": _P, "type": "function",
                                    "description": _FINAL, "strict": True}]}
PYDANTIC_AI_CHAT = {"model": "smollm2-135m", "stream": False, "messages": [{"role": "user", "content": "Bob is 30"}],
                    "max_completion_tokens": 30, "temperature": 0, "tool_choice": "required",
                    "tools": [{"type": "function", "function": {"name": "final_result", "description": _FINAL,
                                                                "parameters": _P, "strict": True}}]}


# the openai package's own tool loop over a stream: ``with client.chat.completions.stream(...) as s``, then
# ``messages.append(s.get_final_completion().choices[0].message)`` and the tool's result
_NOW = [{"type": "function", "function": {"name": "now", "description": "time",
                                          "parameters": {"type": "object", "properties": {}}}}]
SDK_STREAM_LOOP = {"model": "smollm2-135m", "messages": [
    {"role": "user", "content": "time?"},
    {"content": None, "refusal": None, "role": "assistant", "annotations": None, "audio": None, "function_call": None,
     "tool_calls": [{"id": "call_ba371135971e4ab39ef8e1b3", "function": {"arguments": "{}", "name": "now",
                                                                         "parsed_arguments": None},
                     "type": "function", "index": 0}], "parsed": None},
    {"role": "tool", "tool_call_id": "call_ba371135971e4ab39ef8e1b3", "content": "12:00"}],
    "max_tokens": 5, "temperature": 0, "tools": _NOW}


class RecordingChain(FakeChainSession):
    """A fake chain that keeps the hidden states of each prefill it is sent (the prompt's embeddings)."""

    prompts: list = []

    async def step(self, i, x, position):
        if i == 0 and position == 0:
            RecordingChain.prompts.append(x.detach().clone())
        return await super().step(i, x, position)


@pytest.fixture(scope="module")
def api(tiny_model_factory):
    """(orchestrator, app) over recording fake chains, four slots up; no API keys."""
    with pytest.MonkeyPatch.context() as mp:
        for orch, app in fake_chain_app(tiny_model_factory, mp, max_length=1024, no_chain_wait_s=5.0):
            mp.setattr(failover, "ChainSession", RecordingChain)
            yield orch, app


def _send(api, *requests: tuple[str, dict, dict]) -> list[httpx.Response]:
    """POST each ``(path, body, headers)`` in turn (the body's model made the tiny model's)."""
    orch, app = api

    async def main():
        orch.dispatch.set_chains([_chain(4)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o", timeout=60) as c:
            return [await c.post(path, content=json.dumps({**body, "model": orch.model_id}), headers=headers)
                    for path, body, headers in requests]

    return asyncio.run(main())


def test_a_tool_without_arguments_from_langchain_and_litellm_is_called_with_none(api):
    """LangChain's ``bind_tools`` of a function without arguments, forced, and litellm's ``tool_choice:
    "required"``: before, the model wrote invented arguments until ``max_tokens`` (``{"time":1234567890,
    "description":"123456`` on SmolLM2: LangChain returned no tool call); now every call is ``{}``."""
    litellm = {**LITELLM_NOARGS, "max_tokens": 40}  # the tiny model's tokens are nearly characters: a call is ~30
    lc, litellm = _send(api, ("/v1/chat/completions", LC_NOARGS, OPENAI_SDK),
                        ("/v1/chat/completions", litellm, LITELLM_VLLM))
    for r in (lc, litellm):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls = [c["function"] for c in choice["message"]["tool_calls"]]
        if choice["finish_reason"] == "length" and calls[-1]["arguments"] != "{}":
            calls.pop()  # one cut by max_tokens (the tiny model may call it again and again)
        assert calls and all(c == {"name": "now", "arguments": "{}"} for c in calls), choice


def test_a_function_named_in_tool_choice_is_called_exactly_once(api):
    """``tool_choice`` naming a function (LangChain's ``bind_tools(tool_choice="now")``, streamed or not) is one
    call, as OpenAI documents it ("call exactly one specific function") and vLLM does; before, with
    ``parallel_tool_calls`` left at its default it was a list the model could go on (SmolLM2 called ``now`` twice, the
    tiny model until ``max_tokens``: LangChain ran the tool again and again)."""
    streamed = {**LC_NOARGS, "stream": True}
    whole, stream = _send(api, ("/v1/chat/completions", LC_NOARGS, OPENAI_SDK),
                          ("/v1/chat/completions", streamed, OPENAI_SDK))
    choice = whole.json()["choices"][0]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    assert choice["finish_reason"] == "tool_calls"
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls") or []]
    assert {d["index"] for d in deltas} == {0} and "".join(d["function"].get("arguments") or "" for d in deltas) == "{}"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _accepts(toolset, text: str) -> bool:
    """Whether the grammar of ``toolset``'s reply takes ``text`` whole (llguidance's tokenizer of one token per
    byte)."""
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), toolset.spec().grammar_text(), log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


@pytest.mark.parametrize("params, call, taken", [
    ({"properties": {}, "type": "object"}, '{"name":"f","arguments":{}}', True),
    ({"properties": {}, "type": "object"}, '{"name":"f","arguments":{"x":1}}', False),
    ({"type": "object"}, '{"name":"f","arguments":{"x":1}}', False),  # a function's parameters: those it names
    (_INTS, '{"name":"f","arguments":{"a":1,"b":2,"c":3}}', False),
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"type": "string"}}}}},
     '{"name":"f","arguments":{"o":{"k":"v","z":1}}}', False),
    # what a schema says stays: its own additionalProperties, a free-form object inside, a key required unnamed
    ({"type": "object", "properties": {}, "additionalProperties": True}, '{"name":"f","arguments":{"x":1}}', True),
    ({"type": "object", "properties": {"meta": {"type": "object"}}}, '{"name":"f","arguments":{"meta":{"x":1}}}',
     True),
    ({"type": "object", "required": ["x"]}, '{"name":"f","arguments":{"x":1}}', True),
    ({"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {}}}]},
     '{"name":"f","arguments":{"a":1,"b":2}}', True),
])
def test_which_objects_of_a_non_strict_tool_take_other_keys(params, call, taken):
    """The grammar of a forced call of a non-strict tool: an object that names its properties takes no others (so
    does the parameters object, which names the function's), unless the schema says otherwise; objects it leaves
    free (no properties), keys it requires without naming them and ``allOf``'s parts stay as they were."""
    toolset = parse_tools([{"type": "function", "function": {"name": "f", "parameters": params}}], "required", False)
    assert _accepts(toolset, call) is taken


@pytest.mark.parametrize("framework, responses, chat", [
    ("openai-agents", ("/v1/responses", AGENTS_RESPONSES, AGENTS_SDK), ("/v1/chat/completions", AGENTS_CHAT,
                                                                         AGENTS_SDK)),
    ("pydantic-ai", ("/v1/responses", PYDANTIC_AI_RESPONSES, OPENAI_SDK),
     ("/v1/chat/completions", PYDANTIC_AI_CHAT, OPENAI_SDK)),
])
def test_one_agents_tools_over_the_responses_api_and_chat_give_one_prompt(api, framework, responses, chat):
    """The same agent over the Responses API and over chat completions: the same prompt (before, the tool's fields
    were shown in the order its JSON had them, ``parameters`` before ``description`` from the Responses API), so the
    same call."""
    RecordingChain.prompts.clear()
    r, c = _send(api, responses, chat)
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    first, second = RecordingChain.prompts
    assert first.shape == second.shape and bool((first == second).all()), framework
    call = [item for item in r.json()["output"] if item["type"] == "function_call"][0]
    assert c.json()["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": call["name"],
                                                                               "arguments": call["arguments"]}


def test_the_message_the_openai_packages_stream_helper_hands_back_is_taken(api):
    """The openai package's ``chat.completions.stream()`` accumulates each call with its stream ``index``; its
    final message sent back for the next turn (the package's documented loop) was a 400 "unsupported parameter(s):
    messages.1.tool_calls.0.index". The index is taken and changes nothing: the reply equals the one without it."""
    plain = json.loads(json.dumps(SDK_STREAM_LOOP))
    del plain["messages"][1]["tool_calls"][0]["index"]
    with_index, without = _send(api, ("/v1/chat/completions", SDK_STREAM_LOOP, OPENAI_SDK),
                                ("/v1/chat/completions", plain, OPENAI_SDK))
    assert with_index.status_code == 200, with_index.text
    assert with_index.json()["choices"] == without.json()["choices"]
