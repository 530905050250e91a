"""URL scheme → transport backend (dask's comm registry). Backends are imported lazily, so a
process that never uses ``ucx://`` never imports ucxx (0.5–0.7 s and a UCX context)."""

from __future__ import annotations

import importlib
from typing import Any, Final

from peers.errors import TransportUnavailable
from peers.transport.base import Identity, Transport

__all__ = ["BACKENDS", "scheme_of", "backend_class", "make_transport"]

#: scheme → "module:Class". Append-only in spirit: schemes are user-visible in configs.
BACKENDS: Final[dict[str, str]] = {
    "tcp": "peers.transport.tcp:TcpTransport",
    "ucx": "peers.transport.ucx:UcxTransport",
    "mem": "peers.transport.memory:MemoryTransport",
}


def scheme_of(address: str) -> str:
    """``tcp://h:p`` → ``tcp``. Raises ``ValueError`` for an address without a known scheme."""
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in BACKENDS:
        raise ValueError(f"address {address!r} has no known scheme (one of {sorted(BACKENDS)})")
    return scheme


def backend_class(scheme: str) -> type[Transport]:
    """The backend class for a scheme.

    Raises:
        TransportUnavailable: the backend cannot be imported here (e.g. ucxx missing).
    """
    module_name, _, cls_name = BACKENDS[scheme].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TransportUnavailable(f"{scheme}:// backend unavailable: {exc}") from exc
    cls: type[Transport] = getattr(module, cls_name)
    return cls


def make_transport(scheme: str, identity: Identity, **options: Any) -> Transport:
    """Instantiate the backend for ``scheme`` with backend ``options`` (pool, checksum...)."""
    return backend_class(scheme)(identity, **options)
