"""Admin surface: the HTTP API served by the daemon and the giaannctl client.

``AdminApi`` is imported on first use (PEP 562): ``giaannctl`` imports this package for its
client modules only, and the server side (aiohttp and its routes) cost every command ~0.2 s of
start-up (0.56-0.76 -> 0.36-0.43 s on this project's VM, Dec 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from giaannd.errors import AdminHTTPError

if TYPE_CHECKING:
    from giaannd.admin.api import AdminApi

__all__ = ["AdminApi", "AdminHTTPError"]


def __getattr__(name: str) -> Any:
    if name == "AdminApi":
        from giaannd.admin.api import AdminApi

        return AdminApi
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
