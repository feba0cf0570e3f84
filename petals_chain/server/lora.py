"""LoRA adapters on a runner's span: their tensors on the device, and the per-row deltas in a batch.

:class:`SpanAdapters` holds, for each adapter a server serves (``--adapter``, read by :mod:`petals_chain.swarm.lora`,
which defines the fingerprint, the scaling and the delta), the ``A`` and ``B`` of the runner's layers only, and hooks
every targeted Linear of those layers. While a forward runs under :meth:`SpanAdapters.rows` (one compute at a time,
under the runner's compute lock) each hook adds ``scaling * (x @ A^T) @ B^T`` to the output rows (packed tokens) of
the sessions using that adapter, in place: the other rows, base sessions' and other adapters', are left as the
Linear computed them, bit for bit what a batch without adapters gives. Outside :meth:`SpanAdapters.rows` a hook
adds nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch import nn

from petals_chain.swarm.lora import LoraAdapter

__all__ = ["SpanAdapters", "RowGroup"]

# one adapter's rows of a forward: (fingerprint, their token indices along the packed token dimension; None: all)
RowGroup = tuple[str, Optional[torch.Tensor]]


class SpanAdapters:
    """The LoRA ``adapters`` on decoder layers ``blocks`` (global indices ``start_block..``): their tensors of those
    layers in ``dtype`` on ``device``, ``names`` (``{fingerprint: name}``) and ``nbytes``."""

    def __init__(self, adapters: Sequence[LoraAdapter], blocks: nn.ModuleList, start_block: int,
                 dtype: torch.dtype, device: torch.device):
        self.names = {a.fingerprint: a.name for a in adapters}
        span = range(start_block, start_block + len(blocks))
        # (layer, module) -> {fingerprint: (A, B, scaling)}
        self._weights: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for a in adapters:
            for key, (w_a, w_b) in a.read_layers(span, dtype, device).items():
                self._weights.setdefault(key, {})[a.fingerprint] = (w_a, w_b, a.modules[key].scaling)
        self.nbytes = sum(t.numel() * t.element_size() for per in self._weights.values()
                          for w_a, w_b, _ in per.values() for t in (w_a, w_b))
        self._active: list[RowGroup] = []
        for (layer, module), per in self._weights.items():  # the hooks go with the layers when the runner is dropped
            blocks[layer - start_block].get_submodule(module).register_forward_hook(self._hook(per))

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self.names

    def _hook(self, per: dict[str, tuple[torch.Tensor, torch.Tensor, float]]):
        def add_deltas(module: nn.Module, args: tuple, out: torch.Tensor) -> Optional[torch.Tensor]:
            groups = self._active
            if not groups:
                return None
            x = args[0]
            for fingerprint, idx in groups:
                w = per.get(fingerprint)
                if w is None:  # this adapter leaves this module (or layer) as it is
                    continue
                a, b, scaling = w
                if idx is None:
                    out = out + ((x.to(a.dtype) @ a.t()) @ b.t() * scaling).to(out.dtype)
                else:
                    rows = x.index_select(-2, idx).to(a.dtype)
                    out.index_add_(-2, idx, ((rows @ a.t()) @ b.t() * scaling).to(out.dtype))
            return out

        return add_deltas

    @contextlib.contextmanager
    def rows(self, groups: Sequence[RowGroup]) -> Iterator[None]:
        """Add each group's adapter deltas to its rows in the forwards run inside (the caller holds the device)."""
        self._active = [g for g in groups if g[0] is not None]
        try:
            yield
        finally:
            self._active = []
