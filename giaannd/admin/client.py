"""A small synchronous client for the admin API, used by giaannctl (stdlib ``urllib`` only).

Synchronous on purpose: giaannctl makes one or a few requests per run, so an event loop and an
aiohttp session would only add start-up time. Every failure becomes a ``CtlError`` carrying the
message for the user and the exit status (1 operation failed, 2 usage/config).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from giaannd.errors import GiaannError

__all__ = ["AdminClient", "CtlError", "NotServedError"]

#: Bound on one admin request; long operations return a job id and are polled instead.
DEFAULT_TIMEOUT_S = 30.0


class CtlError(GiaannError):
    """A failure to report to the user; ``exit_code`` 1 (operation failed) or 2 (usage)."""

    reason = "ctl_failed"

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class NotServedError(CtlError):
    """The daemon answered 404: the route's role is not enabled or not implemented there."""

    reason = "not_served"


class AdminClient:
    """Talks to one daemon's admin API.

    Args:
        addr: base URL, e.g. ``http://127.0.0.1:7480`` (``host:port`` is accepted too).
        token: bearer token, or None to send none (tokenless loopback ``/metrics``).
        timeout_s: per-request bound.
    """

    def __init__(self, addr: str, token: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.addr = (addr if "://" in addr else f"http://{addr}").rstrip("/")
        self._token = token
        self._timeout_s = timeout_s

    def request(self, method: str, path: str, body: Any = None,
                query: dict[str, str] | None = None) -> tuple[bytes, str]:
        """Send one request; returns (body, content type) of a 2xx reply.

        Raises:
            CtlError: connection failure, 401, or any non-2xx reply (``NotServedError`` for 404).
        """
        url = self.addr + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout_s) as resp:
                return resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc, path) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CtlError(f"cannot reach giaannd at {self.addr}: is it running? ({reason})"
                           ) from None

    def json(self, method: str, path: str, body: Any = None,
             query: dict[str, str] | None = None) -> Any:
        """``request`` and decode the JSON reply."""
        raw, _ = self.request(method, path, body, query)
        try:
            return json.loads(raw)
        except ValueError:
            raise CtlError(f"giaannd at {self.addr} sent a non-JSON reply for {path}") from None

    def _http_error(self, exc: urllib.error.HTTPError, path: str) -> CtlError:
        try:
            detail = json.loads(exc.read()).get("error", "")
        except (ValueError, AttributeError, OSError):
            detail = ""
        if exc.code == 401:
            return CtlError(f"giaannd at {self.addr} refused the admin token "
                            "(check --token-file / GIAANNCTL_TOKEN_FILE)")
        if exc.code == 404:
            return NotServedError(
                f"{path}: role not enabled or not implemented"
                + (f"; {detail}" if detail and path not in detail else ""))
        return CtlError(f"giaannd answered {exc.code} for {path}: {detail or exc.reason}")
