"""The official ``openai`` package against the orchestrator's OpenAI-compatible API (unchanged client code).

    python client/openai_example.py [http://127.0.0.1:8000]      (or set PETALS_CHAIN_URL)
"""

import os
import sys

from openai import OpenAI

url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PETALS_CHAIN_URL", "http://127.0.0.1:8000")
client = OpenAI(base_url=f"{url}/v1", api_key="not-needed")

model = client.models.list().data[0].id
print("model:", model)

completion = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16, temperature=0)
print("completion:", repr(completion.choices[0].text), completion.usage)

print("stream:", end=" ")
for chunk in client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, stream=True, seed=3):
    print(chunk.choices[0].text, end="", flush=True)
print()

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello."}],
    max_tokens=12, temperature=0.7, seed=1)
print("chat:", repr(chat.choices[0].message.content))

print("chat stream:", end=" ")
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to three."}],
                                            max_tokens=12, stream=True):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

# the Responses API (the package's newest): same generation as chat; nothing is stored on the server
response = client.responses.create(model=model, instructions="You are brief.", input="Name a colour.",
                                   max_output_tokens=12, temperature=0)
print("response:", repr(response.output_text), response.status)

print("response stream:", end=" ")
with client.responses.stream(model=model, input="Count to three.", max_output_tokens=12) as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
print()
