"""The admin HTTP API: JSON routes under ``/v1/``, ``/metrics`` and a read-only status page.

Who may call what (documented in docs/operations.md):

- ``/v1/*`` needs ``Authorization: Bearer <token>``; the token comes from a file and is compared
  in constant time (``hmac.compare_digest``) so response timing leaks nothing about it.
  The one exception is an operation declared ``public`` (``GET /v1/health``): load balancers and
  systemd checks hold no token, and its answer (ready, starting or draining) tells a caller
  nothing the TCP connect did not. ``public`` is a property of the declared operation, never of
  a path prefix, so every other ``/v1/`` route (and every unknown path) still needs the token.
- ``/metrics``, the status page ``/`` and the read-only views the page polls (operations marked
  ``public_on_loopback``: ``/v1/status``, ``/v1/members``, ``/v1/ring``, ``/v1/ring/usage``,
  ``/v1/jobs``) need no token when the request comes from a loopback address (a node-local
  Prometheus agent or an operator's browser over an SSH tunnel cannot easily send a bearer token)
  unless ``admin.metrics-require-token`` is set. From any other address they need the token like
  everything else, and a token that is presented must be right. Like ``public``, this is a
  property of the declared operation, not of a path.

Every route is an operation declared in giaannd/operations.py: services ``bind`` a handler to an
operation id, and the method and path template come from that table (a ``{name}`` segment matches
one path segment). Binding an undeclared id is refused; ``require_bound`` (called by the daemon
after each service starts) refuses a service that left one of its operations unbound. Handlers
return any msgspec-encodable value (sent as JSON) or an aiohttp response, and raise
``AdminHTTPError`` for clean error replies. An operation declaring no body argument refuses a body
that holds anything (``_refuse_body``), since its handler would ignore it; a method a path has no
route for is a 405 whose ``Allow`` names those it has.

Routing is our own small table rather than aiohttp's router because aiohttp freezes its router
when the server starts, and role services bind operations while the daemon is already serving
``/v1/status`` (a slow storage load must not make the node look dead).

Limits (config ``[admin]``, docs/operations.md "Limits and hardening"): at most
``max-connections`` open connections and a deadline for each request head (connections.py); a
body is read here, before the handler, under ``body-timeout-s`` (408) and ``max-body-bytes`` (413,
checked against a declared ``Content-Length`` before reading anything), so handlers only ever see
a body already in memory.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import unquote

import msgspec
from aiohttp import web

from giaannd.admin.connections import ConnectionGuard, GuardedSite
from giaannd.admin.status_page import render_status_page
from giaannd.config import AdminConfig
from giaannd.errors import AdminHTTPError
from giaannd.json_body import json_object, refuse_duplicate_keys
from giaannd.metrics import CONTENT_TYPE, Metrics
from giaannd.operations import OPERATIONS, Handler, Operation, match_path, operations_of, split_path

__all__ = ["AdminApi", "MembersSource", "Readiness", "health_of"]

log = logging.getLogger(__name__)

#: What the membership service registers: the current member table, one mapping per member.
MembersSource = Callable[[], Sequence[Mapping[str, Any]] | Awaitable[Sequence[Mapping[str, Any]]]]

#: On stop, in-flight admin requests get this long to finish (aiohttp's default is 60 s, which
#: would eat the whole systemd stop timeout after the drain already used its share).
ADMIN_SHUTDOWN_TIMEOUT_S = 2.0
#: After answering a request whose body was not read (408, 413), aiohttp reads and drops what is
#: still coming for this long before closing, so the client sees the answer rather than a reset
#: (its default, 10 s, would let a client claiming a 10 GB body hold the socket that long).
ADMIN_LINGER_S = 1.0


#: What ``GET /v1/health`` answers: ``ready`` (200) or, with 503, ``starting`` (services still
#: starting) or ``draining`` (``giaannctl node drain``, or the daemon is stopping).
Readiness = Literal["ready", "starting", "draining"]
_HEALTH_STATUS: Final[Mapping[Readiness, int]] = {"ready": 200, "starting": 503, "draining": 503}


def health_of(status: Mapping[str, Any]) -> Readiness:
    """The readiness of a node whose ``/v1/status`` document is ``status``: its daemon ``state``
    (starting, running, stopping, stopped; giaannd/daemon.py) and ``draining`` flag."""
    state = status.get("state")
    if state == "starting":
        return "starting"
    if state == "running" and not status.get("draining"):
        return "ready"
    return "draining"


#: HTTP methods counted under their own name in ``giaannd_admin_requests_total``; any other is
#: ``other`` (the method is the client's word: aiohttp's pure-Python parser passes unknown ones, and
#: each would be a new series).
_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


@dataclass(frozen=True)
class _Route:
    """A bound operation; ``method`` and ``template`` are the operation's, set by ``bind``."""

    op: Operation
    method: str
    template: str
    segments: tuple[str, ...]
    handler: Handler


def _is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False  # a unix socket peer or unparsable address: treat as remote


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status,
                        content_type="application/json")


class AdminApi:
    """The admin server. Built by the daemon; services bind their operations through ``bind``.

    Args:
        token: the bearer token (already read from its file).
        metrics: the daemon's registry, served at ``/metrics``; request counters go there too.
        status: returns the ``/v1/status`` document (node, roles, uptime, services' health);
            ``GET /v1/health`` answers from its ``state`` and ``draining`` (``health_of``).
        metrics_require_token: demand the token for ``/metrics`` and ``/`` even from loopback.
        config: the ``[admin]`` section, for its limits (module docstring); defaults if None.
    """

    def __init__(self, *, token: str, metrics: Metrics, status: Callable[[], Mapping[str, Any]],
                 metrics_require_token: bool = False, config: AdminConfig | None = None) -> None:
        if not token:
            raise ValueError("admin token must not be empty")
        self._token = token.encode()
        self._metrics = metrics
        self._status = status
        self._metrics_require_token = metrics_require_token
        self._limits = config or AdminConfig()
        closed = metrics.counter("giaannd_admin_connections_closed_total",
                                 "Admin connections refused over the cap or closed for a late request head.",
                                 ["reason"])
        self._guard = ConnectionGuard(max_connections=self._limits.max_connections,
                                      header_timeout_s=self._limits.header_timeout_s,
                                      on_close=lambda reason: closed.labels(reason).inc())
        metrics.gauge("giaannd_admin_connections_open", "Admin connections open now.").set_function(
            lambda: self._guard.open_connections)
        self._routes: dict[str, _Route] = {}
        self._members: MembersSource | None = None
        self._runner: web.AppRunner | None = None
        self._requests = metrics.counter(
            "giaannd_admin_requests_total", "Admin API requests by route and status.",
            ["route", "method", "status"])
        self._latency = metrics.histogram(
            "giaannd_admin_request_duration_seconds", "Admin API request latency.", ["route"])
        self.bind("node.status", self._get_status)
        self.bind("node.health", self._get_health)
        self.bind("members.list", self._get_members)
        self.bind("metrics", self._get_metrics)
        self.bind("status-page", self._get_page)

    def bind(self, op_id: str, handler: Handler) -> None:
        """Serve the operation ``op_id`` (giaannd/operations.py) with ``handler``; may be called
        while the server is running. The method and path come from the operations table.

        Args:
            op_id: e.g. ``"node.decommission"``.
            handler: ``async (request, params) -> body``; ``params`` holds the path template's
                ``{name}`` segments; the body is sent as JSON unless it is an aiohttp response.

        Raises:
            ValueError: no operation with a route has that id, or it is bound already.
        """
        op = OPERATIONS.get(op_id)
        if op is None or op.method is None or op.path is None:
            raise ValueError(f"admin operation {op_id!r} is not declared (giaannd/operations.py)")
        if op_id in self._routes:
            raise ValueError(f"admin operation {op_id} ({op.method} {op.path}) is already bound")
        self._routes[op_id] = _Route(op, op.method, op.path, split_path(op.path), handler)

    def unbound(self, service: str) -> list[str]:
        """The ids of ``service``'s declared operations that nothing has bound yet."""
        return [op.id for op in operations_of(service) if op.id not in self._routes]

    def require_bound(self, service: str) -> None:
        """Check that ``service`` bound every operation declared for it (a no-op for services
        that declare none); the daemon calls it once the service has started.

        Raises:
            RuntimeError: some are unbound: a bug in the service, which would otherwise answer
                404 for an operation its role promises.
        """
        missing = self.unbound(service)
        if missing:
            raise RuntimeError(f"service {service} started without binding its admin operations "
                               f"{', '.join(missing)} (declared in giaannd/operations.py)")

    def set_members_source(self, source: MembersSource | None) -> None:
        """Register (or clear) what ``GET /v1/members`` returns; the membership service calls it."""
        self._members = source

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0 picks one); returns the address actually bound."""
        # aiohttp stops reading a body past client_max_size; _read_body checks the exact limit.
        app = web.Application(client_max_size=self._limits.max_body_bytes + 1)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     shutdown_timeout=ADMIN_SHUTDOWN_TIMEOUT_S,
                                     keepalive_timeout=self._limits.header_timeout_s,
                                     lingering_time=ADMIN_LINGER_S)
        await self._runner.setup()
        site = GuardedSite(self._runner, host, port, self._guard)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        return site.address

    async def stop(self) -> None:
        """Stop listening and close open connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- dispatch ---------------------------------------------------------------------------

    def _authorised(self, request: web.Request, route: _Route | None) -> bool:
        if route is not None and route.op.public:
            return True
        header = request.headers.get("Authorization", "")
        # A presented token is always checked, so a wrong one is reported even where none is needed.
        if not header and route is not None and route.op.public_on_loopback \
                and not self._metrics_require_token and _is_loopback(request.remote):
            return True
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: encode them back, or a
        # token of such bytes would fail here (a 500) rather than be refused
        return hmac.compare_digest(presented.strip().encode("utf-8", "surrogateescape"), self._token)

    def _resolve(self, method: str, raw_path: str) -> tuple[_Route | None, dict[str, str], set[str]]:
        """The route and its parameters, or None and the methods the path has routes for (a
        405's ``Allow``; empty: no route has this path)."""
        # Split the path as sent, then decode each segment: a parameter's %2F (fill_path encodes
        # a value as exactly one segment) must stay in its segment, not split it.
        parts, allowed = tuple(unquote(p) for p in split_path(raw_path)), set()
        for route in self._routes.values():
            params = match_path(route.segments, parts)
            if params is None:
                continue
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                return route, params, set()
            allowed |= {route.method, "HEAD"} if route.method == "GET" else {route.method}
        return None, {}, allowed

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        self._guard.request_started(request.protocol)
        route, params, allowed = self._resolve(request.method, request.rel_url.raw_path)
        label = route.template if route else "unmatched"
        try:
            response = await self._handle(request, route, params, bool(allowed))
        except AdminHTTPError as exc:
            response = _json({"error": exc.message, "code": exc.code}, exc.status)
            if exc.status == 405:  # RFC 9110 §15.5.6: a 405 names the methods the path takes
                response.headers["Allow"] = ", ".join(sorted(allowed))
            # the body was not read (or could not be): this connection is done
            if exc.status in (408, 413) or request.content.exception() is not None:
                response.force_close()
        except web.HTTPException as exc:  # raised by aiohttp itself on a bad request
            response = _json({"error": exc.text or exc.reason,
                              "code": exc.reason.lower().replace(" ", "_")}, exc.status)
            response.force_close()
        except Exception:
            log.exception("admin handler failed route=%s", label)
            response = _json({"error": "internal error; see the daemon log", "code": "internal"},
                             500)
        method = request.method if request.method in _METHODS else "other"  # (a client's word: bounded)
        self._requests.labels(label, method, str(response.status)).inc()
        self._latency.labels(label).observe(time.perf_counter() - started)
        log.debug("admin request method=%s path=%s status=%d", request.method, request.path,
                  response.status)
        self._guard.request_finished(request.protocol)
        return response

    async def _handle(self, request: web.Request, route: _Route | None, params: dict[str, str],
                      path_known: bool) -> web.StreamResponse:
        if not self._authorised(request, route):
            # Checked before 404 so that unauthenticated callers cannot probe which routes exist.
            raise AdminHTTPError(401, "missing or wrong bearer token", "unauthorized")
        if route is None:
            if path_known:
                raise AdminHTTPError(405, f"{request.method} not allowed on {request.path}",
                                     "method_not_allowed")
            raise AdminHTTPError(404, _not_served(request.path), "not_served")
        await self._read_body(request)
        if not any(arg.into == "body" for arg in route.op.args):
            await _refuse_body(request)
        else:  # one place for every route's body, before its handler's json_object
            await refuse_duplicate_keys(request)
        result = await route.handler(request, params)
        return result if isinstance(result, web.StreamResponse) else _json(result)

    async def _read_body(self, request: web.Request) -> None:
        """Read the body into the request (``request.json()`` then reads memory) within the
        limits, so no handler can be held by a client that is slow to send it."""
        if not request.body_exists:
            return
        limit = self._limits.max_body_bytes
        too_large = AdminHTTPError(413, f"request body over the {limit}-byte limit (admin.max-body-bytes)",
                                   "request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large  # refused on the declared length: not one byte of it is awaited
        try:
            async with asyncio.timeout(self._limits.body_timeout_s):
                body = await request.read()
        except TimeoutError:
            raise AdminHTTPError(408, f"request body not received within {self._limits.body_timeout_s:g}s "
                                      "(admin.body-timeout-s)", "request_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except web.RequestPayloadError as exc:  # e.g. bytes that do not decode as their Content-Encoding
            # The rest of this body cannot be read either: mark it ended, so that aiohttp does not
            # try to drain it after the answer (and log the same error as unhandled); the
            # connection is closed (a 400 from _read_body closes it, as 408 and 413 do).
            request.content.feed_eof()
            why = getattr(exc.__cause__, "message", "") or str(exc)
            raise AdminHTTPError(400, f"request body cannot be read: {why}", "bad_request") from None
        except ConnectionResetError:  # the client went away mid-body: nobody reads the answer
            raise AdminHTTPError(400, "request body incomplete: the connection was closed",
                                 "bad_request") from None
        if len(body) > limit:  # aiohttp stops past client_max_size; its own test is > or >= by version
            raise too_large

    # -- built-in routes --------------------------------------------------------------------

    async def _get_status(self, request: web.Request, params: Mapping[str, str]) -> Any:
        return dict(self._status())

    async def _get_health(self, request: web.Request, params: Mapping[str, str]) -> Any:
        readiness = health_of(self._status())
        return _json({"status": readiness}, _HEALTH_STATUS[readiness])

    async def _members_table(self) -> list[Mapping[str, Any]]:
        if self._members is None:
            raise AdminHTTPError(404, "membership is not running on this node", "not_served")
        result = self._members()
        if inspect.isawaitable(result):
            result = await result
        return list(result)

    async def _get_members(self, request: web.Request, params: Mapping[str, str]) -> Any:
        return {"members": await self._members_table()}

    async def _get_metrics(self, request: web.Request, params: Mapping[str, str]) -> Any:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _get_page(self, request: web.Request, params: Mapping[str, str]) -> Any:
        status = self._status()
        try:
            members: list[Mapping[str, Any]] | None = await self._members_table()
        except AdminHTTPError:
            members = None
        return web.Response(text=render_status_page(status, members), content_type="text/html")


async def _refuse_body(request: web.Request) -> None:
    """Refuse a body that holds anything, for an operation that takes none: its handler reads
    none, so a field in it was ignored while the verb ran (``POST /v1/node/drain`` with
    ``{"node": "other"}`` drained this node). No body, an empty one, ``{}`` and ``null`` pass.

    Raises:
        AdminHTTPError: 400 ``bad_request`` (giaannd/json_body.py), naming what is wrong.
    """
    if request.body_exists and (await request.read()).strip():
        await json_object(request, (), null_is_empty=True)


def _not_served(path: str) -> str:
    """Why a path has no route here: which service serves it, when it is a declared operation."""
    parts = split_path(path)
    for op in OPERATIONS.values():
        if op.path is not None and match_path(split_path(op.path), parts) is not None:
            return f"this node does not serve {path}: the {op.service} service is not running here"
    return f"this node does not serve {path}"
