"""giaannctl and the Python client given input they cannot send, or answers they cannot read: one
``giaannctl: error:`` line and exit status 2 (bad local input) or 1 (what answered), never a
traceback; and a request body with a number JSON has no word for is a 400, on either side."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from giaannd.admin import ctl
from giaannd.admin.api import AdminApi
from giaannd.metrics import Metrics
from giaannd.sdk.aio import AsyncClient
from giaannd.sdk.client import Client
from giaannd.sdk.errors import ClientError, UsageError
from tests.unit.admin.test_health import _answer, _api_with_roles, _post
from tests.unit.sdk.fake_api import serving


@pytest.fixture(autouse=True)
def _no_node_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GIAANNCTL_ADDR", "GIAANNCTL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


def _exit(argv: list[str]) -> int:
    try:
        return ctl.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("giaannctl: error: ") and "Traceback" not in err, err
    return err


def test_ctl_metrics_json_of_an_answer_that_is_not_prometheus_text_is_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another service on the admin port (or a proxy's error page) answering 200: the parse
    raised ValueError out of main, a traceback."""
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/metrics", "<html>hello</html>")
        assert _exit(["--data-dir", str(data_dir), "metrics", "--json"]) == 1
        assert "not Prometheus text" in _one_error_line(capsys)


def test_client_metrics_answer_that_is_not_utf8_is_a_client_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(tmp_path) as (_, data_dir):
        client = Client(data_dir=data_dir)
        monkeypatch.setattr(client.api, "request", lambda *a, **k: (b"a 1\n\xff\xfe", "text/plain"))
        with pytest.raises(ClientError, match="not UTF-8"):
            client.metrics()


def test_ctl_key_file_that_is_not_utf8_is_a_usage_error(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"\xff\xfe not a key")
    with serving(tmp_path) as (api, data_dir):
        assert _exit(["--data-dir", str(data_dir), "keys", "install", str(key)]) == 2
        assert "not UTF-8" in _one_error_line(capsys) and api.seen == []


@pytest.mark.parametrize("argv", [
    ["ring", "owners", "caf\udce9"],  # a path parameter: fill_path raised UnicodeEncodeError
    ["column", "rows", "\udcff"],
    ["generate", "\udcff"],  # a body field: sent, for the daemon to refuse (400, exit 1)
    ["train", "start", "\udcff.conllu"],
])
def test_ctl_argument_that_is_not_utf8_is_a_usage_error(argv: list[str], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 in argv (a file name in another encoding) reach Python as lone
    surrogates, which no request can carry."""
    with serving(tmp_path) as (api, data_dir):
        assert _exit(["--data-dir", str(data_dir), *argv]) == 2
        assert "not UTF-8" in _one_error_line(capsys) and api.seen == []


@pytest.mark.parametrize("content", [b"\xff\xfe\n", b"sekret\nsekret2\n", b"sekret\r\n2\n"])
def test_ctl_token_file_that_cannot_be_sent_is_a_usage_error(content: bytes, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A token file that is not UTF-8 raised UnicodeDecodeError; one with a line break inside
    (two lines) raised ValueError (http.client: invalid header value)."""
    token = tmp_path / "token"
    token.write_bytes(content)
    with serving(tmp_path) as (api, data_dir):
        addr = (data_dir / "admin.addr").read_text().strip()
        assert _exit(["--addr", addr, "--token-file", str(token), "keys", "list"]) == 2
        assert f"token file {token}" in _one_error_line(capsys) and api.seen == []


@contextmanager
def _admin_api(token: str) -> Iterator[str]:
    """A real AdminApi on loopback, served from a thread of its own; its URL."""
    loop = asyncio.new_event_loop()
    api = AdminApi(token=token, metrics=Metrics(), status=lambda: {"node_name": "n1", "state": "running"})
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    host, port = asyncio.run_coroutine_threadsafe(api.start("127.0.0.1", 0), loop).result(30)
    try:
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(api.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_ctl_sends_a_utf8_token_the_daemon_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon takes any UTF-8 text as its token (``admin.token-file``) and compares its UTF-8
    bytes; giaannctl raised UnicodeEncodeError (latin-1) for such a token instead of sending it."""
    token = tmp_path / "token"
    token.write_text("s\u00e9kr\u20act\n", encoding="utf-8")
    with _admin_api("s\u00e9kr\u20act") as url:
        # node status is tokenless from loopback, but a token presented is checked: 401 if wrong
        assert _exit(["--addr", url, "--token-file", str(token), "--json", "node", "status"]) == 0
        assert json.loads(capsys.readouterr().out)["node_name"] == "n1"
        (tmp_path / "wrong").write_text("s\u00e9kr\u20ac\n", encoding="utf-8")
        assert _exit(["--addr", url, "--token-file", str(tmp_path / "wrong"), "node", "status"]) == 1
        assert "refused the admin token" in _one_error_line(capsys)


def test_ctl_admin_addr_that_is_not_utf8_is_a_usage_error(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    (data_dir / "admin.addr").write_bytes(b"http://127.0.0.1:\xff\n")
    (data_dir / "admin.token").write_text("t\n")
    assert _exit(["--data-dir", str(data_dir), "node", "status"]) == 2
    assert "admin.addr" in _one_error_line(capsys)


@pytest.mark.parametrize("argv", [["node", "topology", "rate", "inf"], ["node", "topology", "rate", "1e999"],
                                  ["node", "join-ring", "--rate", "inf"], ["node", "decommission", "--rate", "1e400"]])
def test_ctl_rate_must_be_finite(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``inf`` passed the ``> 0`` check and was sent as ``Infinity``, which is not JSON."""
    with serving(tmp_path) as (api, data_dir):
        assert _exit(["--data-dir", str(data_dir), *argv]) == 2
        assert "rate" in _one_error_line(capsys) and api.seen == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_client_body_with_a_number_json_cannot_carry_is_a_usage_error(value: float, tmp_path: Path) -> None:
    with serving(tmp_path) as (api, data_dir):
        with pytest.raises(UsageError, match="JSON"):
            Client(data_dir=data_dir).call("POST", "/v1/node/topology/rate", {"rate_bytes_s": value})
        assert api.seen == []  # json.dumps wrote NaN / Infinity, which the fake (and aiohttp) took


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [b'{"rate_bytes_s": Infinity}', b'{"rate_bytes_s": 1e999}'])
async def test_admin_body_with_a_number_json_cannot_carry_is_a_400(body: bytes, tmp_path: Path) -> None:
    """``Infinity`` is not JSON, and ``1e999`` overflows to it: the rate route took either as a
    rate > 0 and set the streams' throttle to infinity (200)."""
    api, op, _, _ = _api_with_roles(tmp_path)
    status, doc = await _answer(api, _post("/v1/node/topology/rate", body))
    assert (status, doc["code"]) == (400, "bad_request"), doc
    assert "JSON" in doc["error"] and op.rates == []



@pytest.mark.parametrize(("timeout_s", "poll_s"), [(float("nan"), 0.01), (None, -1.0), (None, float("nan"))])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_client_job_wait_with_bounds_that_are_not_usable_is_a_usage_error(
        timeout_s: float | None, poll_s: float, flavour: str, tmp_path: Path) -> None:
    """``timeout_s=nan`` never compared past its deadline: the wait polled a running job forever
    (bounded here by the join); ``poll_s=-1`` raised ValueError out of time.sleep (and polled
    without pause in the async wait, whose asyncio.sleep takes it as 0)."""
    caught: dict[str, BaseException] = {}
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/jobs/j1", {"job_id": "j1", "state": "running", "done": 1, "total": 9})

        def wait() -> None:
            try:
                if flavour == "sync":
                    Client(data_dir=data_dir).job("j1").wait(progress=False, timeout_s=timeout_s, poll_s=poll_s)
                else:
                    asyncio.run(AsyncClient(data_dir=data_dir).job("j1").wait(
                        progress=False, timeout_s=timeout_s, poll_s=poll_s))
            except BaseException as exc:  # noqa: BLE001 (what the wait raised, for the assertion)
                caught["exc"] = exc

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        thread.join(3)
        assert not thread.is_alive(), "the wait is still polling"
    assert isinstance(caught.get("exc"), UsageError), caught
