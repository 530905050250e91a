"""giaannd.Client / AsyncClient / LocalCluster: bad local input is a ``UsageError`` raised before
anything is sent (docs/python.md, "Errors"), not a traceback from deep inside json, http.client or
time.sleep, nor an error that blames the daemon; and the async client has every ``Client`` method."""

from __future__ import annotations

import asyncio
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import giaannd
from giaannd.sdk.client import Client
from tests.unit.sdk.fake_api import serving


def _running(body: Any, query: str) -> tuple[int, Any]:
    return 200, {"job_id": "j1", "state": "running", "done": 1, "total": 10, "unit": "sentences"}


def test_sdk_empty_path_parameter_is_a_usage_error(tmp_path: Path) -> None:
    """``job("")`` filled ``/v1/jobs/``, which the daemon answers with the list of jobs: ``status()``
    returned that list as the job's document, and ``wait()`` polled it until its timeout (forever
    without one), since the list has no ``state``. ``column("")`` read another route's answer."""
    with serving(tmp_path) as (api, data_dir):
        c = Client(data_dir=data_dir)
        with pytest.raises(giaannd.UsageError, match="job_id must not be empty"):
            c.job("").status()
        with pytest.raises(giaannd.UsageError, match="job_id must not be empty"):
            c.job("").wait(progress=False, timeout_s=5, poll_s=0.01)
        with pytest.raises(giaannd.UsageError, match="column must not be empty"):
            c.column("")
        with pytest.raises(giaannd.UsageError, match="column must not be empty"):
            asyncio.run(giaannd.AsyncClient(data_dir=data_dir).column_info(""))
        assert api.seen == []


def test_sdk_body_that_json_cannot_hold_is_a_usage_error(tmp_path: Path) -> None:
    """A numpy integer (``limit=np.int64(300)``, as numpy arithmetic hands one back) raised json's
    bare ``TypeError``; the docs promise a ``UsageError`` for a body that cannot be sent as JSON."""
    with serving(tmp_path) as (api, data_dir):
        c = Client(data_dir=data_dir)
        with pytest.raises(giaannd.UsageError, match="cannot be sent as JSON.*int64") as info:
            c.train("corpus.conllu", limit=np.int64(300))  # type: ignore[arg-type]
        assert info.value.exit_code == 2
        with pytest.raises(giaannd.UsageError, match="cannot be sent as JSON"):
            c.call("POST", "/v1/eval", {"prompt_lines": {"a set"}})
        assert api.seen == []


@pytest.mark.parametrize("path", ["v1/status", "/v1/columns/new york/rows", "/v1/columns/caf\u00e9/rows"])
def test_sdk_call_path_that_is_no_route_is_a_usage_error(tmp_path: Path, path: str) -> None:
    """``call`` with a path that is not an encoded route (no leading ``/``, a space, non-ASCII) was
    an ``UnavailableError`` "sent no complete HTTP answer ... is this its admin API address?"
    (http.client's InvalidURL: nothing was sent), or a bare ``UnicodeEncodeError``."""
    with serving(tmp_path) as (api, data_dir):
        with pytest.raises(giaannd.UsageError, match="not a route path"):
            Client(data_dir=data_dir).call("GET", path)
        assert api.seen == []


def test_sdk_wait_poll_interval_too_long_to_sleep_is_a_usage_error(tmp_path: Path) -> None:
    """``poll_s=inf`` passed ``check_wait`` (only negative and NaN were refused): the sync wait
    then died in ``time.sleep`` with ``OverflowError`` and the async one slept forever."""
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/jobs/j1", _running)
        with pytest.raises(giaannd.UsageError, match="poll_s"):
            Client(data_dir=data_dir).job("j1").wait(progress=False, timeout_s=0.05, poll_s=math.inf)

        async def wait_async() -> Any:
            job = giaannd.AsyncClient(data_dir=data_dir).job("j1")
            return await asyncio.wait_for(job.wait(progress=False, timeout_s=0.05, poll_s=math.inf), 10)

        with pytest.raises(giaannd.UsageError, match="poll_s"):
            asyncio.run(wait_async())


def test_sdk_async_client_has_call_text(tmp_path: Path) -> None:
    """docs/python.md: AsyncClient's methods are Client's, as coroutines; ``call_text`` (any route
    that answers text) was missing."""
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/debug/text", "line one\n")
        c = giaannd.AsyncClient(data_dir=data_dir)
        assert asyncio.run(c.call_text("GET", "/v1/debug/text")) == "line one\n"


def test_sdk_local_cluster_directories_may_be_given_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LocalCluster(corpus_dir="corpus")`` raised ``AttributeError: 'str' object has no attribute
    'resolve'``, after the temporary root was made: the constructor also left that behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(tmp_path)
    cluster = giaannd.LocalCluster(corpus_dir="corpus", export_dir="exports")  # type: ignore[arg-type]
    try:
        assert cluster.corpus_dir == tmp_path / "corpus" and cluster.export_dir == tmp_path / "exports"
    finally:
        cluster.close()
    assert list(tmp.iterdir()) == []


def test_sdk_column_strongest_refuses_a_negative_count() -> None:
    """``strongest(-1)`` sliced ``[:-1]``: every connection but the weakest, as if it were the top
    ``n``."""
    from giaannd.sdk.column import Column
    from tests.unit.sdk.test_client import COLUMN_DOC

    column = Column.from_doc(COLUMN_DOC)
    assert column.strongest(0) == [] and len(column.strongest(10)) == 3
    with pytest.raises(giaannd.UsageError, match="n must be >= 0"):
        column.strongest(-1)


def test_sdk_address_that_is_not_text_is_a_usage_error() -> None:
    """``Client(7480)`` (a port as a number) raised ``AttributeError: 'int' object has no attribute
    'strip'`` from deep inside the address parsing."""
    with pytest.raises(giaannd.UsageError, match="7480"):
        Client(7480)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["get ", "GE T", "G\nET", ""])
def test_sdk_call_method_that_is_no_http_method_is_a_usage_error(tmp_path: Path, method: str) -> None:
    """A method http.client cannot send raised a bare ``ValueError`` (or was sent as garbage)."""
    with serving(tmp_path) as (api, data_dir):
        with pytest.raises(giaannd.UsageError, match="method"):
            Client(data_dir=data_dir).call(method, "/v1/status")
        assert api.seen == []
