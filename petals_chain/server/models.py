"""The models a volunteer offers (``--model``, repeatable): each one's source, config, DHT prefix, sizes and speed.

A server holds the blocks of one model at a time; which one, an orchestrator serving several models decides
(``orchestrator/placement.py``) and publishes as a signed :class:`~petals_chain.swarm.records.PlacementRecord`.
Until one places it, the server serves the first model it was given. It announces itself under every model's
prefix (the others without blocks, ``serving`` naming the one it serves), so each model's planner knows its
memory and speed for that model.

LoRA adapters (``--adapter``, :func:`attach_adapters`) belong to the models they fit: each is read, validated and
fingerprinted once at start (:mod:`petals_chain.swarm.lora`), and its bytes per block count in that model's ``s_m``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from petals_chain.server.announce import PROCESS_STARTED_AT
from petals_chain.swarm.emulation import Emulation


@dataclass
class HostedModel:
    """One model this server may serve. ``tau_p``: measured s/block/job (unscaled; 0 until profiled)."""

    spec: str  # as given on the command line
    source: Any  # swarm.sources.ModelSource
    config: Any  # transformers config
    prefix: str
    torch_dtype: Any
    memory: Any  # server.memory.MemoryBudget
    tau_p: float = 0.0
    adapters: list = field(default_factory=list)  # swarm.lora.LoraAdapter: LoRA adapters served with it

    @property
    def fingerprint(self) -> str:
        return self.source.fingerprint

    @property
    def adapter_names(self) -> dict[str, str]:
        """``{adapter fingerprint: name}`` of its adapters (what its record announces)."""
        return {a.fingerprint: a.name for a in self.adapters}

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def dtype_name(self) -> str:
        return str(self.torch_dtype).replace("torch.", "")

    @classmethod
    def load(cls, spec: str, *, dtype: str, quant: str, cache_tokens_per_block: int, kv_cache: str, page_size: int,
             dht_prefix: Optional[str] = None) -> "HostedModel":
        """Resolve ``spec`` (a registry name, a .gguf file, an HF directory): ValueError/OSError if unusable."""
        from petals_chain.server.memory import MemoryBudget
        from petals_chain.swarm.checkpoint import load_config, parse_dtype
        from petals_chain.swarm.keys import check_prefix, default_dht_prefix
        from petals_chain.swarm.sources import check_family, resolve_source

        source = resolve_source(spec)
        config = load_config(source)
        check_family(config)
        torch_dtype = parse_dtype(dtype, config)
        prefix = check_prefix(dht_prefix) if dht_prefix else default_dht_prefix(source.name)
        memory = MemoryBudget(config, torch_dtype, quant, cache_tokens_per_block, kv_cache=kv_cache,
                              page_size=page_size)
        return cls(spec, source, config, prefix, torch_dtype, memory)


def load_hosted(specs: Sequence[str], *, dht_prefix: Optional[str] = None, **kwargs: Any) -> list[HostedModel]:
    """The server's models in the order given; ValueError for a prefix given with several, or two models that
    would share a DHT prefix."""
    if not specs:
        raise ValueError("give at least one --model")
    if dht_prefix and len(specs) > 1:
        raise ValueError("--dht-prefix names one model's swarm; with several --model each uses its own default prefix")
    hosted = [HostedModel.load(s, dht_prefix=dht_prefix, **kwargs) for s in specs]
    prefixes = [h.prefix for h in hosted]
    if len(set(prefixes)) != len(prefixes):
        raise ValueError(f"two --model values share a DHT prefix ({', '.join(prefixes)}): a model's prefix is its "
                         f"file or directory name (the orchestrator derives the same), so the same model twice, or two "
                         f"models named alike: rename one")
    return hosted


def attach_adapters(hosted: Sequence[HostedModel], values: Sequence[str]) -> None:
    """Read the ``--adapter`` values (``NAME=PATH``, or ``MODEL:NAME=PATH`` with ``MODEL`` a DHT prefix of
    ``hosted``) and give each model the adapters that fit it (``NAME=PATH``: every model it fits). ValueError (one
    line) for an adapter that cannot be served, fits no model (or not the one named), or a name, fingerprint or
    count a model cannot take."""
    from petals_chain.swarm.lora import MAX_ADAPTERS, AdapterError, check_adapter_fits, parse_adapter_arg, read_adapter

    read: dict[str, Any] = {}  # path -> LoraAdapter (read once, whatever names it is given)
    for value in values:
        model, name, path = parse_adapter_arg(value)
        targets = [h for h in hosted if model is None or model in (h.prefix, h.spec)]
        if not targets:
            raise AdapterError(f"--adapter {value!r}: model {model!r} is not one this server offers "
                               f"({', '.join(h.prefix for h in hosted)})")
        adapter = read.get(path)
        if adapter is None:
            adapter = read[path] = read_adapter(path, name)
        adapter = copy.copy(adapter)
        adapter.name = name
        fits, why = [], None
        for h in targets:
            try:
                check_adapter_fits(adapter, h.config)
                fits.append(h)
            except AdapterError as e:
                why = why or e
        if not fits:
            raise why
        for h in fits:
            for other in h.adapters:
                if other.name == name or other.fingerprint == adapter.fingerprint:
                    raise AdapterError(f"--adapter {value!r}: model {h.prefix} has adapter {other.name} "
                                       f"({other.fingerprint}) already: names and adapters must differ")
            if len(h.adapters) >= MAX_ADAPTERS:
                raise AdapterError(f"--adapter {value!r}: at most {MAX_ADAPTERS} adapters per model")
            h.adapters.append(adapter)
            h.memory.adapter_bytes += adapter.block_bytes(h.torch_dtype)


@dataclass
class StandbyView:
    """How a model this server offers but does not serve is announced: no blocks, that model's sizes and speed,
    the server's own device, emulation and addresses (a :class:`~petals_chain.server.announce.RecordSource`)."""

    hosted: HostedModel
    max_length: int
    emulation: Emulation
    cfg: Any
    maddrs: Sequence[str]
    reachability: str
    state: str = "joining"
    epoch: int = -1
    span: Optional[tuple[int, int]] = None
    runner: Any = None
    started_at: float = PROCESS_STARTED_AT  # the server's (ServerRecord.started_at), which every record announces

    @property
    def tau_p(self) -> float:
        return self.hosted.tau_p

    @property
    def memory(self) -> Any:
        return self.hosted.memory

    @property
    def dtype_name(self) -> str:
        return self.hosted.dtype_name

    @property
    def model_fingerprint(self) -> str:
        return self.hosted.fingerprint

    @property
    def adapter_names(self) -> dict[str, str]:
        return self.hosted.adapter_names
