"""The admin API over HTTP: one request, one answer (stdlib ``urllib`` only).

The one place HTTP is spoken to a daemon: ``giaannd.Client`` sends every call through
``AdminClient``, and giaannctl through the client. Synchronous on purpose: a call is one short
request (long operations answer a job id and are polled), so an event loop and an aiohttp session
would only add start-up time; ``AsyncClient`` runs these calls in a thread. Every failure becomes
a typed ``ClientError`` (giaannd/sdk/errors.py) carrying the message for the user and the exit
status (1 operation failed, 2 usage/config). An error answer from the daemon keeps the API's
``code`` (``not_found``, ``not_served``, ``conflict``...) and message, so a caller learns *what*
was refused instead of guessing from the HTTP status (a 404 is an unknown job as often as a role
that is not running).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, Final

from giaannd.operations import fill_path
from giaannd.sdk.errors import AuthError, ClientError, UnavailableError, UsageError, request_error

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "AdminClient", "admin_url", "check_timeout", "fill_route"]

#: Bound on one admin request; long operations return a job id and are polled instead.
DEFAULT_TIMEOUT_S: Final = 30.0
#: The most ``--timeout`` accepts: one request never needs a day (long operations are followed by
#: polling, each poll its own request), and the socket layer overflows on huge values.
MAX_TIMEOUT_S: Final = 86_400.0
#: A host name as giaannctl accepts it (RFC 1123 labels, plus ``_`` seen in container names);
#: IPv6 literals are checked by ``ipaddress`` instead.
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
#: A path ``request`` sends: ``/`` then printable ASCII without spaces (parameters percent-encoded,
#: as ``operations.fill_path`` does). http.client refuses anything else before sending (InvalidURL,
#: an HTTPException read as "not an HTTP answer"; UnicodeEncodeError), or takes a path without
#: the ``/`` as part of the port.
_ROUTE_PATH = re.compile(r"/[!-~]*")
#: An HTTP method: a token (RFC 9110 §9.1), as the daemon's routes spell them (``GET``, ``POST``...).
_METHOD = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def admin_url(text: str) -> str:
    """The base URL of an admin API given as ``http[s]://host[:port]`` or ``host:port``.

    Raises:
        ValueError: not such an address (the reason, for a usage error naming where it came from).
    """
    raw = text.strip()
    if not raw or any(c.isspace() or not c.isprintable() for c in raw):
        raise ValueError("expected http://HOST:PORT or HOST:PORT, without spaces")
    try:
        parts = urllib.parse.urlsplit(raw if "://" in raw else f"http://{raw}")
        port = parts.port
    except ValueError as exc:  # a port that is not a number, or out of range; a bad IPv6 literal
        raise ValueError(str(exc)) from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"the scheme must be http or https, not {parts.scheme!r}")
    host = parts.hostname or ""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"{host!r} is not a host name or address" if host else "no host")
    if port == 0:
        raise ValueError("port 0 is not an address to connect to")
    if parts.username is not None or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError("give only the scheme, host and port (the API's paths are giaannctl's)")
    return f"{parts.scheme}://{parts.netloc}"


def check_timeout(value: float) -> float:
    """``value`` if it is a usable per-request bound in seconds.

    Raises:
        ValueError: not finite, not > 0, or above ``MAX_TIMEOUT_S``.
    """
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"a timeout must be seconds > 0 and <= {MAX_TIMEOUT_S:.0f}, not {value}")
    return value


def fill_route(template: str, params: Mapping[str, Any]) -> str:
    """``operations.fill_path``: ``template`` with ``params`` filled in, each one segment.

    Raises:
        UsageError: an empty parameter: its segment would vanish and the path name another route
            (``/v1/jobs/{job_id}`` with "" is ``/v1/jobs/``, the list of jobs, which a wait on the
            job polled until its timeout, forever without one).
    """
    for name, value in params.items():
        if str(value) == "":
            raise UsageError(f"{name} must not be empty")
    return fill_path(template, params)


class AdminClient:
    """Talks to one daemon's admin API.

    Args:
        addr: base URL, e.g. ``http://127.0.0.1:7480`` (``host:port`` is accepted too).
        token: bearer token, or None to send none (tokenless loopback ``/metrics``, ``/v1/health``).
        timeout_s: per-request bound.
        token_problem: why ``token`` is None (its file could not be read): a 401 then raises
            ``UsageError`` with this reason instead of ``AuthError`` (no token was refused).

    A loopback address is always reached directly: a proxy named in the environment
    (``http_proxy``) cannot reach this host's loopback, and would be handed the bearer token.

    Raises:
        UsageError: ``addr`` is not an admin API address or ``timeout_s`` is not usable (exit 2).
    """

    def __init__(self, addr: str, token: str | None, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 token_problem: str | None = None) -> None:
        try:
            self.addr = admin_url(addr)
            self._timeout_s = check_timeout(timeout_s)
        except ValueError as exc:
            raise UsageError(f"admin API {addr!r}: {exc}") from None
        self._token = token
        self._token_problem = None if token else token_problem
        host = urllib.parse.urlsplit(self.addr).hostname or ""
        self._open = (urllib.request.build_opener(urllib.request.ProxyHandler({})).open if _loopback(host)
                      else urllib.request.urlopen)

    def request(self, method: str, path: str, body: Any = None,
                query: dict[str, str] | None = None, *, timeout_s: float | None = None) -> tuple[bytes, str]:
        """Send one request; returns (body, content type) of a 2xx reply.

        Args:
            timeout_s: a tighter bound than the client's for this request (a wait's deadline).

        Raises:
            UnavailableError: the daemon cannot be reached, or what answers there does not speak
                HTTP (or broke off its reply).
            AuthError: 401.
            UsageError: 401 to a client whose token file could not be read (``token_problem``);
                nothing sent: ``path`` is not a route path, or ``body`` cannot be sent as JSON.
            RequestError: any other non-2xx reply, as its typed subclass (``request_error``).
        """
        if not isinstance(method, str) or not _METHOD.fullmatch(method):  # (http.client: ValueError)
            raise UsageError(f"{method!r} is not an HTTP method (GET, POST, PUT, DELETE...)")
        if not _ROUTE_PATH.fullmatch(path):
            raise UsageError(f"{method} {path!r}: not a route path (/ then percent-encoded ASCII, "
                             "e.g. /v1/columns/new%20york/rows)")
        url = self.addr + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        # JSON has no NaN or infinity (json.dumps would write them as the words NaN, Infinity), nor
        # a numpy scalar or a set (TypeError): a usage error, as for any bad local input.
        try:
            data = None if body is None else json.dumps(body, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{method} {path}: the request body cannot be sent as JSON: {exc}") from None
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._token:
            # The daemon compares the token's UTF-8 bytes; http.client sends a str header as
            # latin-1, so hand it those bytes as latin-1 characters (a token of ASCII is unchanged).
            header = f"Bearer {self._token}".encode().decode("latin-1")
            req.add_header("Authorization", header)
        timeout = self._timeout_s if timeout_s is None else min(self._timeout_s, timeout_s)
        try:
            with self._open(req, timeout=timeout) as resp:
                return resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc, method, path) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UnavailableError(f"cannot reach giaannd at {self.addr}: is it running? ({reason})"
                                   ) from None
        except http.client.HTTPException as exc:  # not an HTTP answer, or one cut short
            raise UnavailableError(f"giaannd at {self.addr} sent no complete HTTP answer for {path}: "
                                   f"is this its admin API address? ({exc!r})") from None

    def json(self, method: str, path: str, body: Any = None,
             query: dict[str, str] | None = None, *, timeout_s: float | None = None) -> Any:
        """``request`` and decode the JSON reply."""
        raw, _ = self.request(method, path, body, query, timeout_s=timeout_s)
        try:
            return json.loads(raw)
        except ValueError:
            raise ClientError(f"giaannd at {self.addr} sent a non-JSON reply for {path}") from None

    def _http_error(self, exc: urllib.error.HTTPError, method: str, path: str) -> ClientError:
        try:
            doc = json.loads(exc.read())
        except (ValueError, OSError, http.client.HTTPException):
            doc = None
        doc = doc if isinstance(doc, dict) else {}
        if exc.code == 401 and self._token_problem is not None:
            return UsageError(self._token_problem)  # no token was sent: say why, not "refused"
        if exc.code == 401:
            return AuthError(f"giaannd at {self.addr} refused the admin token "
                             "(check --token-file / GIAANNCTL_TOKEN_FILE)")
        code = str(doc.get("code") or "")
        # The API's message says what was refused; GET /v1/health says only its status.
        detail = str(doc.get("error") or doc.get("status") or "")
        if exc.code == 404 and not detail and code in ("", "not_served"):
            detail = f"this node does not serve {path}"
        return request_error(method, path, exc.code, code, detail or f"HTTP {exc.code} {exc.reason}", doc)


def _loopback(host: str) -> bool:
    """``host`` names this host's loopback interface."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
