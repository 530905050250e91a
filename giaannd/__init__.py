"""giaannd: the daemon that runs GIAANN, a concept-column language network, across a cluster.

For researchers, the package's names are the Python client (giaannd/sdk)::

    import giaannd
    with giaannd.LocalCluster(storage=3, compute=1) as client:
        client.train(giaannd.bundled_corpus(), limit=300).wait()
        print(client.eval(limit=50)["top1"])

They are imported on first use (PEP 562), so the daemon and giaannctl's start-up never pay for
what they do not use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from giaannd.sdk import (
        AsyncClient,
        AsyncJob,
        AuthError,
        BadRequestError,
        Client,
        ClientError,
        Column,
        ConflictError,
        Job,
        JobFailedError,
        LocalCluster,
        NodeFailed,
        NotFoundError,
        NotServedError,
        RequestError,
        ServiceUnavailableError,
        UnavailableError,
        UsageError,
        bundled_corpus,
    )

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncJob", "AuthError", "BadRequestError", "Client", "ClientError", "Column", "ConflictError",
    "Job", "JobFailedError", "LocalCluster", "NodeFailed", "NotFoundError", "NotServedError", "RequestError",
    "ServiceUnavailableError", "UnavailableError", "UsageError", "__version__", "bundled_corpus",
]
#: The names re-exported from giaannd.sdk.
_SDK = frozenset(__all__) - {"__version__"}


def __getattr__(name: str) -> Any:
    if name in _SDK:
        return getattr(importlib.import_module("giaannd.sdk"), name)
    raise AttributeError(f"module 'giaannd' has no attribute {name!r}")
