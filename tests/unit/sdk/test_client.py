"""giaannd.Client / AsyncClient against a fake admin API: what each method sends, what it returns
(plain values, never raw documents to pick apart), and the typed errors."""

from __future__ import annotations

import asyncio
import io
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
