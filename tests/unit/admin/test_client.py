"""The admin client's error answers (issue 16.9): a 404 says what was not found, using the API's
``code`` and message; only ``not_served`` (or a 404 that says nothing) is "does not serve"."""

from __future__ import annotations

import io
import json
import urllib.error
from email.message import Message
from typing import Any

import pytest

from giaannd.sdk.errors import (
    BadRequestError,
    ClientError,
    ConflictError,
    NotFoundError,
    NotServedError,
    RequestError,
    ServiceUnavailableError,
    UnavailableError,
)
from giaannd.sdk.http import AdminClient, admin_url, check_timeout


def _answer(status: int, body: Any, reason: str = "Reason") -> urllib.error.HTTPError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return urllib.error.HTTPError("http://127.0.0.1:1/x", status, reason, Message(), io.BytesIO(raw))


@pytest.mark.parametrize(("status", "body", "kind", "code", "detail"), [
    (404, {"error": "no job 'j9' on this node", "code": "not_found"}, NotFoundError, "not_found",
     "no job 'j9' on this node"),
    (404, {"error": "unknown storage member 'ghost'", "code": "not_found"}, NotFoundError, "not_found",
     "unknown storage member 'ghost'"),
    (404, {"error": "this node does not serve /v1/generate: the compute service is not running here",
           "code": "not_served"}, NotServedError, "not_served",
     "this node does not serve /v1/generate: the compute service is not running here"),
    (404, b"<html>not found</html>", NotServedError, "not_served", "this node does not serve /v1/x"),
    (409, {"error": "another topology operation is running", "code": "conflict"}, ConflictError, "conflict",
     "another topology operation is running"),
    (503, {"status": "draining"}, ServiceUnavailableError, "request_failed", "draining"),
    (400, {"error": "limit must be an integer", "code": "bad_request"}, BadRequestError, "bad_request",
     "limit must be an integer"),
    (403, {"error": "outside compute.corpus-dir", "code": "forbidden"}, BadRequestError, "forbidden",
     "outside compute.corpus-dir"),
    (502, b"", RequestError, "request_failed", "HTTP 502 Bad Gateway"),
])
def test_client_error_answers_keep_the_code_and_message(status: int, body: Any, kind: type, code: str,
                                                       detail: str) -> None:
    client = AdminClient("127.0.0.1:1", "t")
    exc = client._http_error(_answer(status, body, "Bad Gateway" if status == 502 else "R"), "GET", "/v1/x")
    # refused as given (the arguments): a usage error, exit 2; the rest failed: exit 1
    assert type(exc) is kind and exc.reason == code and exc.exit_code == (2 if kind is BadRequestError else 1)
    assert isinstance(exc, RequestError) and exc.detail == detail and exc.status == status
    assert str(exc) == f"GET /v1/x: {detail}"
    if code == "not_found":
        assert not isinstance(exc, NotServedError) and "does not serve" not in str(exc)
    assert isinstance(exc, UnavailableError) == (status == 503)  # what a caller retries on


def test_client_refused_token_is_not_a_request_error() -> None:
    exc = AdminClient("127.0.0.1:1", "t")._http_error(_answer(401, {"error": "x"}), "GET", "/v1/status")
    assert not isinstance(exc, RequestError) and "refused the admin token" in str(exc)


@pytest.mark.parametrize(("text", "url"), [
    ("127.0.0.1:7480", "http://127.0.0.1:7480"), ("http://127.0.0.1:7480/", "http://127.0.0.1:7480"),
    ("https://node-1.example:443", "https://node-1.example:443"), ("[::1]:7480", "http://[::1]:7480"),
    ("localhost", "http://localhost"),
])
def test_client_admin_url_accepts_addresses(text: str, url: str) -> None:
    assert admin_url(text) == url


@pytest.mark.parametrize("text", ["", "not a url", "http://h:99999", "http://h:0", "ftp://h:1", "http://h:1/v1",
                                  "http://h:1?x", "http://u:p@h:1", "http://[::zz]:1", "http://h\x00:1", "h:port"])
def test_client_admin_url_refuses_the_rest(text: str) -> None:
    with pytest.raises(ValueError):
        admin_url(text)
    with pytest.raises(ClientError) as info:
        AdminClient(text, None)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 86_401.0])
def test_client_timeout_must_be_usable(bad: float) -> None:
    with pytest.raises(ValueError, match="timeout must be seconds"):
        check_timeout(bad)
    with pytest.raises(ClientError) as info:
        AdminClient("127.0.0.1:1", None, bad)
    assert info.value.exit_code == 2
    assert check_timeout(0.5) == 0.5
