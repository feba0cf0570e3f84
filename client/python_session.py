"""Python client examples: one-shot generation, streaming, and a multi-turn session that keeps its chain.

    python client/python_session.py [http://127.0.0.1:8000]      (or set PETALS_CHAIN_URL)
"""

import os
import sys

from petals_chain.client import Client

url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PETALS_CHAIN_URL", "http://127.0.0.1:8000")
client = Client(url)

# One request: greedy by default; .complete() also says how it was served.
completion = client.complete("The quick brown fox", max_tokens=16)
print("completion:", repr(completion.text))
print(f"  waited {completion.wait_s * 1000:.1f} ms for a chain, served in {completion.service_s * 1000:.1f} ms "
      f"by {len(completion.chain)} server(s)")

# Streaming: pieces of text as tokens are generated.
print("stream:", end=" ")
for piece in client.stream("Once upon a time", max_tokens=16, temperature=0.8, top_p=0.95, seed=1):
    print(piece, end="", flush=True)
print()

# Chat with the model's chat template.
print("chat:", repr(client.chat([{"role": "user", "content": "What is two plus two?"}], max_tokens=12)))

# A multi-turn session: the servers keep its KV cache's full pages as cached prefixes between calls (or hold
# the chain with the orchestrator's --hold-sessions), so the second call computes little more than its new tokens.
with client.session(max_length=128) as session:
    first = session.generate("Hello! My name is Alice.", max_tokens=8)
    second = session.generate(" What is my name?", max_tokens=8)
    info = session.info()
    print("session:", repr(first), "|", repr(second))
    print(f"  {info['turns']} turns, {info['tokens']} tokens held on a chain of {len(info['chain'])} server(s)")

# A chat session: send only the new turn; the orchestrator applies the chat template so the session's tokens
# always equal the whole conversation templated at once.
with client.session() as chat:
    chat.chat("Hi! I am Bob.", max_tokens=12)
    reply = chat.chat("What is my name?", max_tokens=12)
    print("chat session:", repr(reply.text), f"({len(reply.token_ids)} tokens, {reply.tokens_per_s:.1f} tokens/s)")
