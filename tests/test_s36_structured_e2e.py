"""Structured outputs end to end on the real model: SmolLM2-135M served by a LocalSwarm (one server process holding
its 30 blocks), the openai package's ``chat.completions.parse`` with a pydantic model, greedy and seeded, streamed
and not: each returns a parsed object that validates (before: a 400, "response_format 'json_schema' is not
supported"). A 135M model does not write valid JSON for a schema on its own; the grammar makes it."""

from __future__ import annotations

from typing import Literal

import pydantic
import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

openai = pytest.importorskip("openai")

MAX_LENGTH = 256


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    capital: bool
    size: Literal["small", "medium", "large"]


def test_chat_completions_parse_returns_a_validated_object_on_smollm2(smollm2_path, tmp_path):
    with LocalSwarm("smollm2-135m", [LocalServer("a", memory_for(smollm2_path, MAX_LENGTH, 30, 4), tau_p=0.01)],
                    max_length=MAX_LENGTH, arrival_rate=1.0, log_dir=tmp_path) as sw:
        sw.wait_ready(timeout=240)
        client = openai.OpenAI(base_url=f"{sw.url}/v1", api_key="none", max_retries=0, timeout=120)
        msgs = [{"role": "system", "content": "Answer in JSON."},
                {"role": "user", "content": "Tell me about Paris."}]
        out = {}
        for name, kw in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 3})):
            r = client.chat.completions.parse(model="smollm2-135m", messages=msgs, response_format=City,
                                              max_completion_tokens=80, **kw)
            with client.chat.completions.stream(model="smollm2-135m", messages=msgs, response_format=City,
                                                max_completion_tokens=80, **kw) as stream:
                final = stream.get_final_completion()
            out[name] = (r.choices[0], final.choices[0])
    for name, (plain, streamed) in out.items():
        assert plain.finish_reason == "stop" and isinstance(plain.message.parsed, City), (name, plain)
        City.model_validate_json(plain.message.content)
        assert streamed.message.parsed == plain.message.parsed, name  # greedy and seeded: reproducible
    assert out["greedy"][0].message.parsed.name.strip() != ""
