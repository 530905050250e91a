"""The cluster from Python: ``Client`` / ``AsyncClient``, ``LocalCluster``, the report.

Everything here is re-exported as ``giaannd.<name>`` (giaannd/__init__.py). The client speaks
only the admin API (HTTP); it is what giaannctl uses, and nothing in the daemon imports it.
"""

from giaannd.sdk.aio import AsyncClient, AsyncJob
from giaannd.sdk.client import Client, Job
from giaannd.sdk.column import Column
from giaannd.sdk.errors import (
    AuthError,
    BadRequestError,
    ClientError,
    ConflictError,
    JobFailedError,
    NotFoundError,
    NotServedError,
    RequestError,
    ServiceUnavailableError,
    UnavailableError,
    UsageError,
)
from giaannd.sdk.local_cluster import LocalCluster, NodeFailed, bundled_corpus

__all__ = [
    "AsyncClient", "AsyncJob", "AuthError", "BadRequestError", "Client", "ClientError", "Column", "ConflictError",
    "Job", "JobFailedError", "LocalCluster", "NodeFailed", "NotFoundError", "NotServedError", "RequestError",
    "ServiceUnavailableError", "UnavailableError", "UsageError", "bundled_corpus",
]
