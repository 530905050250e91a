"""giaannctl in-process (``main(argv)``) against a real Daemon running in a background thread.

The daemon runs a test service that plugs in the way role services do: it registers a members
source and binds the training job operations (``train.start``, ``train.status``, ``train.list``) whose job
really reads the corpus file line by line, so the progress bar polls a moving target.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from giaannd.admin import ctl
from giaannd.config import load_config
from giaannd.daemon import Daemon
from giaannd.errors import AdminHTTPError
from giaannd.sdk import locate
from giaannd.service import ServiceContext

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
WAIT_S = 10


class JobService:
    """Members source plus line-counting 'training' jobs."""

    name = "jobs"

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count(1)
        self._ctx: ServiceContext | None = None

    async def start(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        ctx.admin.set_members_source(lambda: [  # the rows the membership service answers
            {"name": ctx.node_name, "node_id": str(ctx.node_id), "addr": "127.0.0.1:1", "status": "alive",
             "incarnation": 1, "roles": "-", "data_plane": "-", "full": False},
            {"name": "peer-2", "node_id": "n2", "addr": "127.0.0.1:2", "status": "suspect", "incarnation": 4,
             "roles": "storage", "data_plane": "tcp://127.0.0.1:3", "full": True}])
        ctx.admin.bind("train.start", self._train)
        ctx.admin.bind("train.status", self._job)
        ctx.admin.bind("train.list", self._all_jobs)

    async def _train(self, request: Any, params: Mapping[str, str]) -> Any:
        body = await request.json()
        if body.get("epochs", 1) < 1:  # as the compute service refuses it
            raise AdminHTTPError(400, "epochs must be at least 1", "bad_request")
        lines = Path(body["corpus"]).read_text().splitlines()
        job_id = f"job-{next(self._ids)}"
        self.jobs[job_id] = {"job_id": job_id, "state": "running", "done": 0,
                             "total": len(lines), "unit": "sentences"}
        assert self._ctx is not None
        self._ctx.spawn(self._run(job_id, lines), job_id)
        return {"job_id": job_id}

    async def _run(self, job_id: str, lines: list[str]) -> None:
        job = self.jobs[job_id]
        for line in lines:
            await asyncio.sleep(0.002)
            if line == "FAIL":
                job.update(state="failed", error="bad sentence")
                return
            job["done"] += 1
        job["state"] = "succeeded"

    async def _all_jobs(self, request: Any, params: Mapping[str, str]) -> Any:
        return {"jobs": list(self.jobs.values())}

    async def _job(self, request: Any, params: Mapping[str, str]) -> Any:
        if params["job_id"] not in self.jobs:
            raise AdminHTTPError(404, f"no job {params['job_id']}", "not_found")
        return self.jobs[params["job_id"]]

    async def stop(self, graceful: bool) -> None:
        return None

    def health(self) -> Mapping[str, Any]:
        return {"jobs": len(self.jobs)}


@dataclass
class Node:
    data_dir: Path
    daemon: Daemon
    loop: asyncio.AbstractEventLoop
    jobs: JobService

    def ctl(self, *argv: str) -> list[str]:
        return ["--data-dir", str(self.data_dir), *argv]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    data = tmp_path / "lib" / "main"  # as systemd lays out giaannd@main (StateDirectory=giaannd/%i)
    cfg = load_config(environ={}, overrides=[f"node.data-dir={data}", "admin.listen=127.0.0.1:0",
                                             "node.name=ctl-node", "node.roles=[]"])
    loop = asyncio.new_event_loop()
    jobs = JobService()
    daemon = Daemon(cfg, [jobs], handle_signals=False)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(loop.run_until_complete(daemon.run())))
    thread.start()
    try:
        for _ in range(WAIT_S * 100):
            if daemon.state != "starting":
                break
            threading.Event().wait(0.01)
        assert daemon.state == "running"
        yield Node(data, daemon, loop, jobs)
    finally:
        loop.call_soon_threadsafe(daemon.request_stop, "test over")
        thread.join(WAIT_S)
        loop.close()
    assert result == [0]


def test_ctl_node_status_human_and_json(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(node.ctl("node", "status")) == 0
    out = capsys.readouterr().out
    assert "node_name: ctl-node" in out and "state: running" in out
    assert ctl.main(node.ctl("--json", "node", "status")) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["services"]["jobs"] == {"jobs": 0, "state": "running"}
    assert status["node_id"] == str(node.daemon.node_id)


def test_ctl_members_list(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(node.ctl("members", "list")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "ROLES", "ADDR", "DATA_PLANE"]  # curated (operations.py)
    assert lines[2].split() == ["peer-2", "suspect", "storage", "127.0.0.1:2", "tcp://127.0.0.1:3"]
    assert ctl.main(node.ctl("members", "list", "--detailed")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "NODE_ID", "ADDR"] and lines[2].split()[-1] == "yes"
    assert ctl.main(node.ctl("--json", "members", "list")) == 0
    assert len(json.loads(capsys.readouterr().out)["members"]) == 2


def test_ctl_metrics_text_and_json(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(node.ctl("metrics")) == 0
    assert "# TYPE giaannd_uptime_seconds gauge" in capsys.readouterr().out
    assert ctl.main(node.ctl("--json", "metrics")) == 0
    families = {f["name"]: f for f in json.loads(capsys.readouterr().out)}
    assert families["giaannd_service_up"]["samples"][0]["labels"] == {"service": "jobs"}



def test_ctl_metrics_count_the_event_loop_tasks(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    """The soak benchmark (tools/bench/soak.py) watches this gauge for task leaks."""
    assert ctl.main(node.ctl("metrics")) == 0
    samples = [line.split() for line in capsys.readouterr().out.splitlines()
               if line.startswith("giaannd_event_loop_tasks ")]
    assert len(samples) == 1 and float(samples[0][1]) >= 1  # at least the admin handler's task

@pytest.mark.parametrize(("argv", "path", "service"), [
    (["ring", "owners", "dog"], "/v1/ring/owners/dog", "membership"),
    (["column", "info", "dog"], "/v1/columns/dog", "membership"),
    (["generate", "the cat"], "/v1/generate", "compute"),
    (["node", "drain"], "/v1/node/drain", "membership"),
    (["keys", "remove", "k1"], "/v1/keys/k1", "membership"),
])
def test_ctl_unserved_routes_fail_honestly(node: Node, capsys: pytest.CaptureFixture[str],
                                           argv: list[str], path: str, service: str) -> None:
    assert ctl.main(node.ctl(*argv)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    command = " ".join(argv[:1 if argv[0] == "generate" else 2])
    assert captured.err == (f"giaannctl: error: {command}: this node does not serve {path}: the {service} "
                            "service is not running here\n")


def test_ctl_not_found_says_what_was_not_found(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 16.9: an unknown job was reported as "this node does not serve 'train status'"."""
    assert ctl.main(node.ctl("train", "status", "job-99")) == 1
    assert capsys.readouterr().err == "giaannctl: error: train status: no job job-99\n"
    assert ctl.main(node.ctl("train", "wait", "job-98")) == 1  # the poll's 404 too
    assert capsys.readouterr().err == "giaannctl: error: train wait: no job job-98\n"


def test_ctl_global_flags_after_the_command(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["node", "status", "--json", "--data-dir", str(node.data_dir), "--timeout", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["node_name"] == "ctl-node"
    assert ctl.main(["members", "--data-dir", str(node.data_dir), "list", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["members"]) == 2


def test_ctl_node_health_needs_no_token(node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    addr = (node.data_dir / "admin.addr").read_text().strip()
    absent = str(tmp_path / "no-token")
    assert ctl.main(["node", "health", "--addr", addr, "--token-file", absent]) == 0
    assert capsys.readouterr().out == "status: ready\n"
    assert ctl.main(["node", "health", "--json", "--addr", addr, "--token-file", absent]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "ready"}
    # node status is tokenless from loopback too (public_on_loopback: the status page polls it)
    assert ctl.main(["node", "status", "--addr", addr, "--token-file", absent]) == 0
    capsys.readouterr()
    assert ctl.main(["keys", "list", "--addr", addr, "--token-file", absent]) == 2  # the rest needs it
    assert f"cannot read token file {absent}" in capsys.readouterr().err


def test_ctl_node_health_shows_a_node_that_is_not_ready(node: Node, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A draining (or starting) node answers 503 with its status: giaannctl shows it, as text or
    JSON, and exits 1 (before: nothing on stdout, the status only in an error line)."""
    api, status = node.daemon._admin, node.daemon.status
    monkeypatch.setattr(api, "_status", lambda: {**status(), "draining": True})
    assert ctl.main(node.ctl("node", "health")) == 1
    assert capsys.readouterr().out == "status: draining\n"
    assert ctl.main(node.ctl("node", "health", "--json")) == 1
    assert json.loads(capsys.readouterr().out) == {"status": "draining"}
    monkeypatch.setattr(api, "_status", lambda: {**status(), "state": "starting"})
    assert ctl.main(node.ctl("node", "health", "--json")) == 1
    assert json.loads(capsys.readouterr().out) == {"status": "starting"}


def test_ctl_arguments_the_daemon_refuses_exit_2(node: Node, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A request refused as given (400: ``train start --epochs 0``) is bad input: exit 2, as a
    usage error, with the daemon's words (before: exit 1, as if the operation had failed)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("one\n")
    assert ctl.main(node.ctl("train", "start", str(corpus), "--epochs", "0", "--no-wait")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "giaannctl: error: train start: epochs must be at least 1\n"


def test_ctl_bare_finds_the_only_instance(node: Node, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """No --addr, --token-file, --data-dir or environment: the only running giaannd@ instance under
    the state root (/var/lib/giaannd on a systemd host) is the node."""
    for name in ("GIAANNCTL_ADDR", "GIAANNCTL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    root = node.data_dir.parent
    monkeypatch.setattr(locate, "STATE_ROOT", root)
    assert ctl.main(["node", "status"]) == 0
    assert "node_name: ctl-node" in capsys.readouterr().out
    other = root / "other"
    other.mkdir()
    (other / "admin.addr").write_text("http://127.0.0.1:1\n")
    assert ctl.main(["node", "status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 giaannd instances run here (main, other)" in err
    assert f"--data-dir {root}/INSTANCE" in err
    assert ctl.main(["node", "status", "--data-dir", str(node.data_dir)]) == 0  # choosing one works


def test_ctl_train_with_progress(node: Node, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"sentence {i}" for i in range(40)))
    assert ctl.main(node.ctl("--json", "train", "start", str(corpus))) == 0
    final = json.loads(capsys.readouterr().out)
    assert final["state"] == "succeeded" and final["done"] == 40
    assert ctl.main(node.ctl("train", "start", str(corpus))) == 0
    captured = capsys.readouterr()
    assert "job job-2 succeeded" in captured.err  # stderr is not a TTY under pytest
    assert "40/40 sentences" in captured.err
    assert ctl.main(node.ctl("train", "status", "job-2")) == 0
    assert "state: succeeded" in capsys.readouterr().out


def test_ctl_train_list_and_wait_show_a_resumed_job(node: Node, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    node.jobs.jobs["r1"] = {"job_id": "r1", "state": "succeeded", "done": 30, "total": 30, "unit": "sentences",
                      "resumed_from": 12, "resumes": 1}
    assert ctl.main(node.ctl("train", "list")) == 0
    out = capsys.readouterr().out
    assert "RESUMED_FROM" in out and "r1" in out and " 12 " in out
    assert ctl.main(node.ctl("train", "wait", "r1")) == 0
    assert "job r1 (resumed at 12)" in capsys.readouterr().err


def test_ctl_train_failure_and_bad_input(node: Node, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "bad.txt"
    corpus.write_text("ok\nFAIL\n")
    assert ctl.main(node.ctl("train", "start", str(corpus))) == 1
    assert "failed: bad sentence" in capsys.readouterr().err
    assert ctl.main(node.ctl("train", "start", str(tmp_path / "absent.txt"))) == 2
    assert "does not exist" in capsys.readouterr().err
    assert ctl.main(node.ctl("train", "status", "job-99")) == 1
    assert "no job job-99" in capsys.readouterr().err


def test_ctl_wrong_token_and_unreachable(node: Node, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.token"
    bad.write_text("nope\n")
    assert ctl.main([*node.ctl("--token-file", str(bad)), "node", "status"]) == 1
    assert "refused the admin token" in capsys.readouterr().err
    assert ctl.main(["--addr", "http://127.0.0.1:1", "--token-file", str(bad),
                     "node", "status"]) == 1
    assert "cannot reach giaannd at http://127.0.0.1:1: is it running?" in capsys.readouterr().err


def test_ctl_an_empty_word_is_a_usage_error(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    """``train status ""`` named ``/v1/jobs/``, the list of jobs, and printed it as the job's."""
    assert ctl.main(node.ctl("train", "status", "")) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "giaannctl: error: job_id must not be empty\n"
