"""LoRA adapters an orchestrator serves (``--adapter``): each is a model id of its own that requests name.

The operator names each adapter and where its files are (peft's format, :mod:`petals_chain.swarm.lora`); the
orchestrator reads them only to validate them against its model and to learn their adapter fingerprints. Servers
announce the fingerprints they serve in their records (``ServerRecord.adapters``); a request whose ``model`` is an
adapter's name is dispatched only to chains whose every server announces its fingerprint (JFFC over those chains,
:class:`~petals_chain.orchestrator.dispatch.DispatchManager`), and every server session of its job is opened naming
it. ``GET /v1/models`` lists each adapter with ``parent``: the base model's id (vLLM's shape).

While a request is served, :data:`ADAPTER` holds its adapter's fingerprint ("" for the base model): the API sets it
when it resolves the request's ``model``, and a job (``failover.ChainHolder``) reads it when it is made.
"""

from __future__ import annotations

import contextvars
from typing import Any, Iterable, Sequence

from petals_chain.swarm.lora import MAX_ADAPTERS, AdapterError, LoraAdapter, check_adapter_fits, parse_adapter_arg, \
    read_adapter

__all__ = ["ADAPTER", "load_adapters", "split_adapter_args"]

ADAPTER: contextvars.ContextVar[str] = contextvars.ContextVar("petals_chain_adapter", default="")


def split_adapter_args(values: Sequence[str], models: Sequence[str]) -> dict[str, list[str]]:
    """``--adapter`` values per model name (``models``, the first the default): ``NAME=PATH`` is the only model's
    (several models: each must say ``MODEL:NAME=PATH``). Values are returned as ``NAME=PATH``. AdapterError otherwise,
    and for a NAME that is a model's or another model's adapter's (a request names one model id: the router sent it
    to one of them, the other listed by ``/v1/models`` and never served)."""
    out: dict[str, list[str]] = {m: [] for m in models}
    owner: dict[str, str] = {}
    for value in values:
        model, name, path = parse_adapter_arg(value)
        if model is None:
            if len(models) > 1:
                raise AdapterError(f"--adapter {value!r}: with several models each --adapter is MODEL:NAME=PATH "
                                   f"(MODEL one of {', '.join(models)})")
            model = models[0]
        if model not in out:
            raise AdapterError(f"--adapter {value!r}: no model {model!r} is served (one of {', '.join(models)})")
        if len(models) > 1 and (name in out or owner.get(name, model) != model):
            what = "a model's" if name in out else f"an adapter of {owner[name]}"
            raise AdapterError(f"--adapter {value!r}: the name {name!r} is {what}; each adapter needs a model id of "
                               "its own")
        owner[name] = model
        out[model].append(f"{name}={path}")
    return out


def load_adapters(values: Iterable[str], config: Any, reserved: Iterable[str] = ()) -> dict[str, LoraAdapter]:
    """``{name: LoraAdapter}`` of ``NAME=PATH`` values, each validated against the model's ``config``; AdapterError
    (one line) for an adapter that cannot be served, a name that is taken (``reserved``: the model's own ids), the
    same adapter twice or more than ``MAX_ADAPTERS``."""
    out: dict[str, LoraAdapter] = {}
    taken = set(reserved)
    for value in values:
        _, name, path = parse_adapter_arg(value)
        if name in taken or name in out:
            raise AdapterError(f"--adapter {value!r}: the name {name!r} is taken (by the model or another adapter)")
        adapter = read_adapter(path, name)
        check_adapter_fits(adapter, config)
        same = next((a for a in out.values() if a.fingerprint == adapter.fingerprint), None)
        if same is not None:
            raise AdapterError(f"--adapter {value!r}: the same adapter as {same.name} ({adapter.fingerprint})")
        out[name] = adapter
        if len(out) > MAX_ADAPTERS:
            raise AdapterError(f"at most {MAX_ADAPTERS} adapters per model (servers announce no more)")
    return out

