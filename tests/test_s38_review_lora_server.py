"""Review of 144d63b (LoRA adapters, the format a server reads): adapters peft serves that were refused, and malformed
adapters that crashed a server's start with a traceback instead of the one-line refusal (AdapterError) the
``--adapter`` flag promises.

* peft matches a list ``target_modules`` against a module's full name (``model.layers.0.self_attn.q_proj``): an
  entry equal to it or to one of its dotted suffixes. Only the path inside the decoder layer was compared, so an
  adapter trained on named layers was refused with "model.layers.0.self_attn.q_proj is not among target_modules
  ['model.layers.0.self_attn.q_proj']".
* a ``target_modules`` regex that does not compile raised ``re.error``; a rank-0 matrix (``rank_pattern`` lets a
  module's rank differ from ``r``) ``ZeroDivisionError``; a config nested past the parser's depth
  ``RecursionError``; a float8 tensor ``NotImplementedError`` (its finiteness check): none of them is a ValueError,
  so ``python -m petals_chain.server`` (and the orchestrator's ``--adapter``) printed a traceback.
"""

from __future__ import annotations

import pytest
import torch
from lora_helpers import write_adapter

from petals_chain.swarm.checkpoint import load_config
from petals_chain.swarm.lora import AdapterError, check_adapter_fits, read_adapter

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def test_target_modules_naming_whole_module_paths_are_matched_as_peft_does(tiny_model_dir, tmp_path):
    for targets in (["model.layers.0.self_attn.q_proj"], ["layers.0.self_attn.q_proj"], ["self_attn.q_proj"],
                    ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]):
        path = write_adapter(tmp_path / str(len(targets[0])) / str(len(targets)), tiny_model_dir, seed=1,
                             targets=("q_proj",), layers=[0], config={"target_modules": targets})
        adapter = read_adapter(path, "named")
        assert sorted(adapter.modules) == [(0, "self_attn.q_proj")], targets
        check_adapter_fits(adapter, load_config(tiny_model_dir))
    # a name that is not the module's (nor one of its dotted suffixes) is still refused
    for targets in (["model.layers.1.self_attn.q_proj"], ["_proj"], ["attn.q_proj"]):
        path = write_adapter(tmp_path / "other" / targets[0], tiny_model_dir, seed=1, targets=("q_proj",),
                             layers=[0], config={"target_modules": targets})
        with pytest.raises(AdapterError, match="is not among target_modules"):
            read_adapter(path, "named")


@pytest.mark.parametrize("case", ["bad-regex", "rank-0", "deep-json", "float8"])
def test_malformed_adapters_are_refused_in_one_line_not_with_a_traceback(tiny_model_dir, tmp_path, case):
    if case == "bad-regex":
        path = write_adapter(tmp_path / case, tiny_model_dir, seed=1, config={"target_modules": "model.layers.(0"})
        needle = "target_modules"
    elif case == "rank-0":
        path = write_adapter(tmp_path / case, tiny_model_dir, seed=1, config={"rank_pattern": {"q_proj": 0}},
                             tensors={f"{Q0}.lora_A.weight": torch.zeros(0, 64),
                                      f"{Q0}.lora_B.weight": torch.zeros(64, 0)})
        needle = "rank 0"
    elif case == "float8":
        path = write_adapter(tmp_path / case, tiny_model_dir, seed=1,
                             tensors={f"{Q0}.lora_A.weight": torch.zeros(4, 64, dtype=torch.float8_e4m3fn)})
        needle = "float8_e4m3fn"
    else:
        path = write_adapter(tmp_path / case, tiny_model_dir, seed=1)
        (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
        needle = "adapter_config.json"
    with pytest.raises(AdapterError) as e:  # a ValueError: the server's start says it in one line and exits
        read_adapter(path, "bad")
    text = str(e.value)
    assert "\n" not in text and text.startswith("adapter bad: ") and needle in text, text
