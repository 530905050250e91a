"""giaannd.Client / AsyncClient against a fake admin API: what each method sends, what it returns
(plain values, never raw documents to pick apart), and the typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import giaannd
from giaannd.sdk.client import Client
from tests.unit.sdk.fake_api import serving

COLUMN_DOC = {
    "column": 42, "word": "dog", "total_entries": 3, "truncated": False,
    "features": {"feature": ["dog", "bark"], "prime": [True, False], "entries": [2, 1]},
    "entries": {"source_feature": ["dog", "dog", "bark"], "source_prime": [True, True, False],
                "segment": [8, 3, 8], "target_column": ["dog", "cat", "dog"],
                "target_feature": ["bark", "cat", "dog"], "target_prime": [False, True, True],
                "strength": [1.5, 4.0, 0.25]},
}


def _jobs(states: list[str]) -> Any:
    """A job route that answers each state in turn (then the last one forever)."""
    def answer(body: Any, query: str) -> tuple[int, Any]:
        state = states.pop(0) if len(states) > 1 else states[0]
        return 200, {"job_id": "j1", "state": state, "done": 5, "total": 10, "unit": "sentences",
                     "trained": 5, "error": "boom" if state == "failed" else ""}
    return answer


def test_client_is_the_package_name_and_finds_the_node_like_giaannctl(tmp_path: Path) -> None:
    assert giaannd.Client is Client and giaannd.LocalCluster.__name__ == "LocalCluster"
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/status", {"node_name": "n1", "state": "running"})
        # the data directory's files, or the environment variables giaannctl reads
        assert Client(data_dir=data_dir).status()["node_name"] == "n1"
        addr = (data_dir / "admin.addr").read_text().strip()
        env = {"GIAANNCTL_ADDR": addr, "GIAANNCTL_TOKEN_FILE": str(data_dir / "admin.token")}
        assert Client(environ=env).status() == {"node_name": "n1", "state": "running"}
        assert Client(addr, data_dir / "admin.token").addr == addr


def test_client_train_returns_a_job_that_waits_for_its_figures(tmp_path: Path) -> None:
    with serving(tmp_path) as (api, data_dir):
        api.on("POST", "/v1/train", {"job_id": "j1"})
        api.on("GET", "/v1/jobs/j1", _jobs(["running", "running", "succeeded"]))
        c = Client(data_dir=data_dir)
        job = c.train("corpus.conllu", limit=300)
        assert job.job_id == "j1" and api.seen[-1][2] == {"corpus": "corpus.conllu", "limit": 300}
        figures = job.wait(progress=False, poll_s=0.01)
        assert figures["state"] == "succeeded" and figures["trained"] == 5


def test_client_job_wait_draws_progress_and_raises_typed_errors(tmp_path: Path, monkeypatch: Any) -> None:
    with serving(tmp_path) as (api, data_dir):
        c = Client(data_dir=data_dir)
        api.on("GET", "/v1/jobs/j1", _jobs(["running", "failed"]))
        stderr = io.StringIO()
        monkeypatch.setattr("sys.stderr", stderr)
        with pytest.raises(giaannd.JobFailedError, match="job j1 failed: boom") as info:
            c.job("j1").wait(progress=True, poll_s=0.01)
        assert info.value.doc["state"] == "failed" and "5/10 sentences" in stderr.getvalue()
        api.on("GET", "/v1/jobs/j1", _jobs(["running"]))
        with pytest.raises(TimeoutError, match="still running after 0.05 s"):
            c.job("j1").wait(progress=False, timeout_s=0.05, poll_s=0.01)
        api.on("GET", "/v1/jobs/nope", {"error": "no job 'nope' on this node", "code": "not_found"}, status=404)
        with pytest.raises(giaannd.NotFoundError, match="no job 'nope'") as missing:
            c.job("nope").status()
        assert missing.value.status == 404 and missing.value.reason == "not_found"
        with pytest.raises(giaannd.NotServedError):  # a route nobody serves on that node
            c.generate("hello")
        # a path parameter is one percent-encoded segment, whatever it holds (the table's fill_path)
        api.on("GET", "/v1/jobs/a%2F..%2Fx", {"job_id": "a/../x", "state": "running"})
        assert c.job("a/../x").status()["job_id"] == "a/../x"


def test_client_eval_generate_column_export(tmp_path: Path) -> None:
    with serving(tmp_path) as (api, data_dir):
        c = Client(data_dir=data_dir)
        api.on("POST", "/v1/eval", {"top1": 0.25, "matches": 1, "prediction_tokens": 4, "prompts": 2})
        assert c.eval(limit=50)["top1"] == 0.25 and api.seen[-1][2] == {"constants": "train", "limit": 50}
        c.eval(["The dog barked at the cat.", "A cat sat."], constants="test")
        assert api.seen[-1][2] == {"constants": "test", "prompt_lines": ["The dog barked at the cat.", "A cat sat."]}
        c.eval("prompts.txt")
        assert api.seen[-1][2] == {"constants": "train", "prompts": "prompts.txt"}
        with pytest.raises(giaannd.UsageError):
            c.eval([])
        api.on("POST", "/v1/generate", {"text": "In the beginning God created the heavens", "tokens": ["the"]})
        assert c.generate("In the beginning God created", max_tokens=5) == "In the beginning God created the heavens"
        assert api.seen[-1][2] == {"prompt": "In the beginning God created", "max_tokens": 5}
        api.on("GET", "/v1/columns/new%20york/rows", COLUMN_DOC)
        col = c.column("new york", limit=10)
        assert api.seen[-1][3] == "limit=10"
        assert (col.column, col.word, len(col), col.truncated) == (42, "dog", 3, False)
        assert col.connections["strength"].dtype == np.float32 and col.connections["segment"].dtype == np.uint8
        assert list(col.features["feature"]) == ["dog", "bark"] and col.features["prime"].tolist() == [True, False]
        assert col.strongest(2) == [("dog", "cat", "cat", 4.0), ("dog", "dog", "bark", 1.5)]
        api.on("POST", "/v1/export", {"path": "/x/model.jsonl", "rows": 3})
        assert c.export("model.jsonl") == {"path": "/x/model.jsonl", "rows": 3}


def test_client_column_answer_that_is_malformed_is_a_client_error(tmp_path: Path) -> None:
    with serving(tmp_path) as (api, data_dir):
        bad = {**COLUMN_DOC, "entries": {**COLUMN_DOC["entries"], "strength": [1.0]}}  # type: ignore[dict-item]
        api.on("GET", "/v1/columns/dog/rows", bad)
        with pytest.raises(giaannd.ClientError, match="malformed column answer"):
            Client(data_dir=data_dir).column("dog")


def test_client_token_and_reachability_errors(tmp_path: Path) -> None:
    with serving(tmp_path) as (api, data_dir):
        (data_dir / "admin.token").write_text("wrong\n")
        with pytest.raises(giaannd.AuthError, match="refused the admin token"):
            Client(data_dir=data_dir).status()
        addr = (data_dir / "admin.addr").read_text().strip()
    with pytest.raises(giaannd.UnavailableError, match="cannot reach giaannd"):
        Client(addr, data_dir / "admin.token", timeout_s=2).status()
    with pytest.raises(giaannd.UsageError) as usage:
        Client("http://no such host:1")
    assert usage.value.exit_code == 2


def test_client_stages_local_files_into_the_staging_dir(tmp_path: Path) -> None:
    with serving(tmp_path) as (api, data_dir):
        api.on("POST", "/v1/train", {"job_id": "j1"})
        staging = tmp_path / "corpus-dir"
        c = Client(data_dir=data_dir, staging_dir=staging)
        src = tmp_path / "mine" / "text.conllu.gz"
        src.parent.mkdir()
        src.write_bytes(b"one")
        c.train(src)
        sent = Path(api.seen[-1][2]["corpus"])
        assert sent.parent == staging.resolve() and sent.name.endswith(".conllu.gz") and sent.read_bytes() == b"one"
        c.train(src)  # unchanged: the same staged copy
        assert Path(api.seen[-1][2]["corpus"]) == sent
        src.write_bytes(b"changed")
        c.train(src)
        assert Path(api.seen[-1][2]["corpus"]) == sent and sent.read_bytes() == b"changed"
        inside = staging / "already.conllu"
        inside.write_bytes(b"x")
        c.train(inside)
        assert api.seen[-1][2]["corpus"] == str(inside.resolve())
        c.train("relative/on/the/daemon.conllu")  # not a local file: sent as given
        assert api.seen[-1][2]["corpus"] == "relative/on/the/daemon.conllu"


def test_async_client_has_the_same_methods_as_coroutines(tmp_path: Path) -> None:
    public = {n for n in dir(Client) if not n.startswith("_")} - {"addr", "api", "staging_dir", "token_problem",
                                                                  "call_text"}
    assert public <= {n for n in dir(giaannd.AsyncClient) if not n.startswith("_")}

    async def main(data_dir: Path) -> tuple[Any, ...]:
        c = giaannd.AsyncClient(data_dir=data_dir)
        job = await c.train("corpus.conllu")
        figures = await job.wait(progress=False, poll_s=0.01)
        column = await c.column("dog")
        return figures, column, await c.generate("hi"), await c.status()

    with serving(tmp_path) as (api, data_dir):
        api.on("POST", "/v1/train", {"job_id": "j1"})
        api.on("GET", "/v1/jobs/j1", _jobs(["running", "succeeded"]))
        api.on("GET", "/v1/columns/dog/rows", COLUMN_DOC)
        api.on("POST", "/v1/generate", {"text": "hi there"})
        api.on("GET", "/v1/status", {"node_name": "n1"})
        figures, column, text, status = asyncio.run(main(data_dir))
    assert figures["state"] == "succeeded" and len(column) == 3 and text == "hi there" and status["node_name"] == "n1"


def _unavailable_then(states: list[str], failures: int) -> Any:
    """A job route that answers 503 ``failures`` times (a register quorum out of reach), then
    ``_jobs(states)``."""
    jobs, left = _jobs(states), [failures]

    def answer(body: Any, query: str) -> tuple[int, Any]:
        if left[0] > 0:
            left[0] -= 1
            return 503, {"error": "storage: 1 of 3 owners of register 'job/j1' answered (need 2)",
                         "code": "unavailable"}
        return jobs(body, query)
    return answer


def test_job_wait_rides_out_unavailable_polls_then_gives_up(tmp_path: Path, monkeypatch: Any) -> None:
    """A poll that fails as unavailable does not end the wait (the job runs on): polls are repeated
    for follow.UNAVAILABLE_GRACE_S; failing longer, the wait raises the poll's error."""
    with serving(tmp_path) as (api, data_dir):
        c = Client(data_dir=data_dir)
        api.on("GET", "/v1/jobs/j1", _unavailable_then(["running", "succeeded"], failures=3))
        assert c.job("j1").wait(progress=False, poll_s=0.01)["state"] == "succeeded"
        api.on("GET", "/v1/jobs/j1", _unavailable_then(["running", "succeeded"], failures=3))
        assert asyncio.run(giaannd.AsyncClient(data_dir=data_dir).job("j1").wait(progress=False, poll_s=0.01)
                           )["state"] == "succeeded"
        monkeypatch.setattr("giaannd.sdk.follow.UNAVAILABLE_GRACE_S", 0.05)
        api.on("GET", "/v1/jobs/j1", _unavailable_then(["succeeded"], failures=10**6))
        with pytest.raises(giaannd.UnavailableError, match="owners of register"):
            c.job("j1").wait(progress=False, poll_s=0.01)
        with pytest.raises(giaannd.UnavailableError, match="owners of register"):  # its own timeout first
            c.job("j1").wait(progress=False, poll_s=0.01, timeout_s=0.02)


@contextmanager
def _raw_server(reply: bytes) -> Iterator[str]:
    """A TCP server on loopback that answers every connection ``reply`` (not necessarily HTTP)
    after reading the request; its ``host:port``."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10)
        srv.close()


@pytest.mark.parametrize("reply", [
    b"SSH-2.0-OpenSSH_9.6\r\n",  # something else listens there
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"state\"",  # cut short
])
def test_client_an_answer_that_is_not_whole_http_is_an_unavailable_error(tmp_path: Path, reply: bytes) -> None:
    """http.client's own exceptions (BadStatusLine, IncompleteRead) escaped the typed errors:
    giaannctl pointed at the wrong port printed a traceback, and a wait ended on a reply cut short."""
    token = tmp_path / "token"
    token.write_text("sekret\n")
    with _raw_server(reply) as addr:
        with pytest.raises(giaannd.UnavailableError, match="no complete HTTP answer for /v1/status"):
            Client(addr, token, timeout_s=10).status()


def test_client_whose_token_file_cannot_be_read_says_so(tmp_path: Path) -> None:
    """No token was sent, so none was refused: the call is a UsageError naming the file and why
    (docs/python.md), not an AuthError saying the daemon refused the token."""
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/status", {"node_name": "n1"})
        api.on("GET", "/v1/jobs/j1", _jobs(["running"]))
        addr = (data_dir / "admin.addr").read_text().strip()
        c = Client(addr, tmp_path / "no-such.token")
        with pytest.raises(giaannd.UsageError, match="cannot read token file .*no-such.token") as info:
            c.status()
        assert info.value.exit_code == 2
        with pytest.raises(giaannd.UsageError, match="cannot read token file"):  # a wait polls the same way
            c.job("j1").wait(progress=False, poll_s=0.01)
        with pytest.raises(giaannd.AuthError):  # a token that was read and refused is still refused
            (tmp_path / "wrong.token").write_text("wrong\n")
            Client(addr, tmp_path / "wrong.token").status()


def test_client_reaches_a_loopback_node_directly_whatever_the_proxy_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib sends to the ``http_proxy`` of the environment unless ``no_proxy`` names the host: a
    proxy cannot reach this host's loopback (LocalCluster never saw its daemons ready) and was
    handed the admin token."""
    with socket.create_server(("127.0.0.1", 0)) as proxy:  # a proxy that accepts and never answers
        proxy_url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        for name in ("http_proxy", "HTTP_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy_url)
        # urlopen's shared opener reads the environment once, when first used: as a fresh process would
        monkeypatch.setattr(urllib.request, "_opener", None)
        with serving(tmp_path) as (api, data_dir):
            api.on("GET", "/v1/status", {"node_name": "n1"})
            assert Client(data_dir=data_dir, timeout_s=2).status() == {"node_name": "n1"}
            port = (data_dir / "admin.addr").read_text().strip().rsplit(":", 1)[1]
            assert Client(f"localhost:{port}", data_dir / "admin.token", timeout_s=2).status()["node_name"] == "n1"
        proxy.settimeout(0)
        with pytest.raises(BlockingIOError):  # nothing (and no token) went to the proxy
            proxy.accept()


def test_job_wait_gives_up_at_its_timeout_when_a_poll_hangs(tmp_path: Path) -> None:
    """A poll that does not answer held ``wait(timeout_s=...)`` for the client's whole request
    timeout (30 s by default; an hour here, so the wait would outlive the test's bound)."""
    release = threading.Event()

    def hang(body: Any, query: str) -> tuple[int, Any]:
        release.wait(20)  # bounds the test before the fix: the poll answers "running" then
        return 200, {"job_id": "j1", "state": "running"}

    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/jobs/j1", hang)
        c = Client(data_dir=data_dir, timeout_s=3600)
        try:
            with pytest.raises(giaannd.UnavailableError, match="timed out"):
                c.job("j1").wait(progress=False, timeout_s=0.2, poll_s=0.01)
            with pytest.raises(giaannd.UnavailableError, match="timed out"):
                asyncio.run(giaannd.AsyncClient(data_dir=data_dir, timeout_s=3600).job("j1").wait(
                    progress=False, timeout_s=0.2, poll_s=0.01))
        finally:
            release.set()


def test_local_cluster_bad_arguments_fail_at_once_and_leave_no_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown transport was a bare ``KeyError: 'bogus'`` from ``start`` (after the key was made);
    a constructor that raised (an unknown storage option) left its temporary root behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(ValueError, match="transport must be one of auto, ucx, tcp, not 'bogus'"):
        giaannd.LocalCluster(transport="bogus")
    with pytest.raises(TypeError, match="no_such_option"):
        giaannd.LocalCluster(storage_options={"no_such_option": 1})
    assert list(tmp.iterdir()) == []


def test_local_cluster_relative_root_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LocalCluster(root="rel")``: each daemon runs inside its own data directory, so a relative
    root (and the key file, configs and logs under it) no longer pointed anywhere from there and
    every daemon failed to start. The root, and everything derived from it, is absolute."""
    monkeypatch.chdir(tmp_path)
    cluster = giaannd.LocalCluster("rel")
    assert cluster.root == tmp_path / "rel" and cluster.root.is_absolute()
    assert Path(cluster.key_file).is_absolute()
