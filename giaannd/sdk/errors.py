"""What a failed client call raises: one typed exception per kind of failure.

Every exception carries the message to show a person and ``exit_code`` (what giaannctl exits
with: 1 the operation failed, 2 usage or configuration). An answer the daemon refused is a
``RequestError`` keeping the API's ``code`` as ``reason`` (``not_found``, ``not_served``,
``conflict``...), its HTTP ``status`` and its own message as ``detail``; the subclass says which
kind of refusal it was, so a caller catches what it can handle::

    try:
        client.train("corpus.conllu")
    except giaannd.NotServedError:      # this node runs no compute role
        ...
    except giaannd.UnavailableError:    # the daemon is down, or its storage is
        ...

==========================  =====================================================================
``UsageError``              bad local input: an address or timeout that is not one, an unreadable
                            token file, a file that does not exist (exit 2)
``UnavailableError``        the daemon cannot be reached, or answered 503 (its storage failing)
``AuthError``               the daemon refused the admin token (401)
``BadRequestError``         400, 403 (a path outside the daemon's directories), 413: the arguments
                            were refused as given (exit 2, as bad local input)
``NotFoundError``           404 ``not_found``: no such job, column, key or node
``NotServedError``          404 ``not_served``: the route's role does not run on that node
``ConflictError``           409: the state forbids it (a running job to resume, not an export...)
``JobFailedError``          a followed job or topology operation ended failed or cancelled
==========================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from giaannd.errors import EXIT_USAGE, GiaannError

__all__ = [
    "AuthError",
    "BadRequestError",
    "ClientError",
    "ConflictError",
    "JobFailedError",
    "NotFoundError",
    "NotServedError",
    "RequestError",
    "ServiceUnavailableError",
    "UnavailableError",
    "UsageError",
    "request_error",
]


class ClientError(GiaannError):
    """A failure to report to the user; ``exit_code`` 1 (operation failed) or 2 (usage)."""

    reason = "client_failed"

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UsageError(ClientError):
    """Bad local input or configuration (exit 2)."""

    reason = "usage"

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


class UnavailableError(ClientError):
    """The daemon cannot be reached, or it answered that what it needs is unavailable (503)."""

    reason = "unavailable"


class AuthError(ClientError):
    """The daemon refused the bearer token (401)."""

    reason = "unauthorized"


class RequestError(ClientError):
    """The daemon answered ``status`` with an error: ``reason`` is the API's ``code`` (empty when
    the answer had none: an older daemon, a proxy) and ``detail`` its message, or the HTTP reason
    phrase when it sent none."""

    def __init__(self, method: str, path: str, status: int, code: str, detail: str,
                 doc: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{method} {path}: {detail}", self.exit_status)
        self.method, self.path, self.status, self.detail = method, path, status, detail
        self.reason = code or "request_failed"
        #: the answer's JSON object as sent (empty when it sent none): ``GET /v1/health``'s 503
        #: is a document to show (``Operation.shows_status``), not only an error
        self.doc: dict[str, Any] = dict(doc or {})

    #: the ``exit_code`` of this kind of answer
    exit_status = 1


class BadRequestError(RequestError):
    """400 / 403 / 413: the request was refused as given (nothing changed). Exit 2, as a usage
    error: the arguments (or a path outside the node's directories) are what to change, and the
    same request would be refused again."""

    exit_status = EXIT_USAGE


class NotFoundError(RequestError):
    """404 ``not_found``: the job, column, key or node named does not exist."""


class NotServedError(RequestError):
    """404 ``not_served``: the route's service (a role) does not run on that node."""


class ConflictError(RequestError):
    """409: the current state forbids the operation."""


class ServiceUnavailableError(RequestError, UnavailableError):
    """503: the daemon is up but cannot do it now (storage failing or absent, no tagger)."""


class JobFailedError(ClientError):
    """A followed operation ended in another state than success; ``doc`` is its final document."""

    reason = "job_failed"

    def __init__(self, message: str, doc: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.doc = dict(doc)


def request_error(method: str, path: str, status: int, code: str, detail: str,
                  doc: Mapping[str, Any] | None = None) -> RequestError:
    """The typed exception for an error answer (module docstring's table)."""
    cls: type[RequestError] = RequestError
    if status == 404:
        # No code: a daemon or proxy that says nothing; a route nobody binds is the likelier case.
        cls = NotServedError if code in ("", "not_served") else NotFoundError
        code = code or "not_served"
    elif status in (400, 403, 413, 422):
        cls = BadRequestError
    elif status == 409:
        cls = ConflictError
    elif status == 503:
        cls = ServiceUnavailableError
    return cls(method, path, status, code, detail, doc)
