"""PETALS-style code on petals-chain: change one import, get token ids back as from ``transformers``.

    python client/transformers_style.py [http://127.0.0.1:8000] [MODEL]
    (or set PETALS_CHAIN_URL / PETALS_CHAIN_MODEL; the model, e.g. smollm2-135m, gives the tokenizer)
"""

import os
import sys

import torch

from petals_chain.client import AutoDistributedModelForCausalLM, AutoTokenizer  # was: from petals import ...

url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PETALS_CHAIN_URL", "http://127.0.0.1:8000")
name = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("PETALS_CHAIN_MODEL", "smollm2-135m")

tokenizer = AutoTokenizer.from_pretrained(name)
model = AutoDistributedModelForCausalLM.from_pretrained(name, url=url)

inputs = tokenizer("A cat sat on", return_tensors="pt")["input_ids"]
outputs = model.generate(inputs, max_new_tokens=8)  # greedy, like transformers' default
print("greedy:", repr(tokenizer.decode(outputs[0, inputs.shape[1]:])))

# A batch with left padding and an attention mask, sampled with a seed.
tokenizer.padding_side = "left"
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
batch = tokenizer(["Hello", "The weather today is"], return_tensors="pt", padding=True)
out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6, do_sample=True,
                     temperature=0.8, top_p=0.95, seed=1, pad_token_id=tokenizer.pad_token_id)
assert isinstance(out, torch.Tensor) and out.shape[0] == 2
for row in out:
    print("sampled:", repr(tokenizer.decode(row, skip_special_tokens=True)))
