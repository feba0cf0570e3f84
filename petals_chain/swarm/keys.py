"""DHT key names of a petals-chain swarm (one prefix per model).

Keys (DESIGN.md "DHT records"):

* ``{prefix}.servers``    — subkey: the server's owner key ``[owner:ssh-rsa ...]``; value: a :class:`ServerRecord`.
* ``{prefix}.assignment`` — subkey: the orchestrator's owner key; value: an :class:`AssignmentRecord`.
* ``{prefix}.summary``    — subkey: the orchestrator's owner key; value: the ``GET /api/v1/swarm`` JSON.
* ``{prefix}.groups``     — subkey: an orchestrator's owner key; value: a :class:`GroupRecord` (several
  orchestrators on one swarm: each is alive there, the leader's entry holds the split of servers into groups).
* ``{prefix}.placement``  — subkey: the orchestrator's owner key; value: a :class:`PlacementRecord` (which model
  each server offering several serves; the same record under every model the orchestrator serves).
* ``petals-chain.swarms``  — subkey: an orchestrator's owner key; value: a :class:`DirectoryRecord` naming
  the swarm it runs (prefix, model, HTTP URL), so a dashboard needs only ``--initial-peers``.
"""

from __future__ import annotations

import os
import re

_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,127}$")


def default_dht_prefix(model: str) -> str:
    """DHT prefix derived from a model name or path: the last path component, sanitised.

    ``/models/Llama-2-7b-hf/`` -> ``Llama-2-7b-hf``; ``meta-llama/Llama-2-7b-hf`` -> ``Llama-2-7b-hf``.
    Characters other than letters, digits, ``-`` and ``_`` become ``-``.
    """
    if not isinstance(model, str) or not model.strip():
        raise ValueError("model name must be a non-empty string")
    name = os.path.basename(os.path.normpath(model.strip())) or "model"
    name = re.sub(r"[^A-Za-z0-9_\-]", "-", name).strip("-_") or "model"
    return name[:128]


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid DHT prefix (letters, digits, ``-``, ``_``; <= 128 chars), else raise."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(f"invalid DHT prefix {prefix!r}: use letters, digits, '-' and '_' (at most 128 characters)")
    return prefix


def servers_key(prefix: str) -> str:
    """Key holding one record per server (subkey = the server's owner key)."""
    return f"{check_prefix(prefix)}.servers"


def assignment_key(prefix: str) -> str:
    """Key holding the orchestrator's signed block assignment."""
    return f"{check_prefix(prefix)}.assignment"


def summary_key(prefix: str) -> str:
    """Key holding the orchestrator's signed swarm summary (what the dashboard shows)."""
    return f"{check_prefix(prefix)}.summary"


def groups_key(prefix: str) -> str:
    """Key holding one entry per orchestrator of the swarm (HERD groups)."""
    return f"{check_prefix(prefix)}.groups"


def placement_key(prefix: str) -> str:
    """Key holding the orchestrator's model placement of servers that offer several models."""
    return f"{check_prefix(prefix)}.placement"


DIRECTORY_KEY = "petals-chain.swarms"  # swarm directory: one signed entry per orchestrator
