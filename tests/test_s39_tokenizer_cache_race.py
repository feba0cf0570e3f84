"""Two processes converting the same GGUF tokenizer at once (two servers started together on one machine, or the
test suite's two workers): the one that lost the race to save it in the cache left its temporary folder there."""

from __future__ import annotations

import os

import transformers

from petals_chain.swarm.sources import resolve_source


class _Converted:
    """Stands for the tokenizer converted from the GGUF vocabulary (seconds of CPU; what is tested is its saving)."""

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")


def test_a_tokenizer_saved_meanwhile_by_another_process_leaves_no_temporary_folder(smollm2_path, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))
    src = resolve_source("smollm2-135m")
    src.__dict__["fingerprint"] = "0123456789abcdef"  # (hashing every weight byte takes seconds)
    converted = _Converted()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: converted)
    real_replace = os.replace

    def other_process_saves_first(a, b, *args, **kw):
        if ".tmp" in os.path.basename(str(a)) and os.path.basename(os.path.dirname(str(b))) == "tokenizers":
            _Converted().save_pretrained(str(b))  # the other process's copy, saved between our save and rename
        return real_replace(a, b, *args, **kw)

    monkeypatch.setattr(os, "replace", other_process_saves_first)
    assert src.load_tokenizer() is converted  # used all the same
    folder = tmp_path / "cache" / "tokenizers"
    names = [p.name for p in folder.iterdir()]
    assert len(names) == 1 and ".tmp" not in names[0], names  # the saved copy only, no temporary folder left
