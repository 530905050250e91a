"""The status page in a real headless browser, against a loopback cluster (issue 18 item 7).

2 storage + 1 compute daemons; the compute node trains a few hundred sentences; Chromium loads the
compute node's ``/`` without a token (loopback), runs the page's script for a few seconds of
virtual time (``--virtual-time-budget``: pending fetches hold the clock) and dumps the DOM. Each
section must be filled with the cluster's real data, and the page must have polled more than once.

Skipped where no Chromium or Chrome is installed (``.ci/run`` installs Debian's ``chromium``).
Set ``STATUS_PAGE_SCREENSHOT=path.png`` to also save a screenshot (docs/status-page.png is one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from giaannd.sdk.local_cluster import running_cluster, split_corpus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: Virtual milliseconds the page runs before the dump: its first poll and at least two more.
VIRTUAL_TIME_MS = 7000
#: Bound on one browser run (it starts in ~1 s; CI's shared cores make it slower).
BROWSER_TIMEOUT_S = 120
SENTENCES = 300


class Sections(HTMLParser):
    """Per ``<section id>``: its attributes and its table rows (lists of cell texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, dict[str, str | None]] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self.updated: dict[str, str | None] = {}
        self._section: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("id"):
            self._section = str(a["id"])
            self.attrs[self._section], self.rows[self._section] = a, []
        elif a.get("id") == "updated":
            self.updated = a
        elif self._section and tag == "tr":
            self.rows[self._section].append([])
        elif self._section and tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self._section = None
        elif tag in ("td", "th") and self._cell is not None and self._section:
            self.rows[self._section][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def run_browser(exe: str, url: str, profile: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", f"--user-data-dir={profile}", f"--virtual-time-budget={VIRTUAL_TIME_MS}",
         *mode, url], capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False)


def test_status_page_in_a_browser_shows_the_cluster_live(tmp_path: Path) -> None:
    exe = browser()
    if exe is None:
        pytest.skip("no Chromium or Chrome on PATH (apt-get install chromium)")
    with running_cluster(tmp_path / "c", storage=2, compute=1, transport="tcp", log_level="warning") as cluster:
        cluster.wait_converged()
        train, _, trained, _ = split_corpus(cluster.corpus_dir, SENTENCES, 0)
        compute = cluster.node("compute-1")
        job = compute.admin.json("POST", "/v1/train", {"corpus": train.name, "workers": 1})
        deadline = time.monotonic() + 180
        while (doc := compute.admin.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
            assert time.monotonic() < deadline, doc
            time.sleep(0.2)
        assert doc["state"] == "succeeded", doc
        url = compute.admin.addr + "/"
        dump = run_browser(exe, url, tmp_path / "profile", "--dump-dom")
        assert dump.returncode == 0, dump.stderr[-2000:]
        shot = os.environ.get("STATUS_PAGE_SCREENSHOT")
        if shot:
            taken = run_browser(exe, url, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,1500",
                                "--hide-scrollbars")
            assert taken.returncode == 0 and Path(shot).stat().st_size > 0, taken.stderr[-2000:]

    page = Sections()
    page.feed(dump.stdout)
    assert int(page.updated.get("data-polls") or 0) >= 2, page.updated  # refreshed live, not once
    for section in ("node", "members", "ring", "storage", "jobs"):
        assert page.attrs[section].get("data-state") == "ok", (section, page.attrs[section])

    def body(section: str) -> list[list[str]]:
        return [r for r in page.rows[section] if r and r[0] and r[0] != "name" and r[0] != "node"]

    node = {r[0]: r[1] for r in page.rows["node"] if len(r) == 2}
    assert node["node"] == "compute-1" and node["state"] == "running" and "compute: running" in node["roles"]

    members = {r[0]: r for r in body("members")}
    assert set(members) == {"storage-1", "storage-2", "compute-1"}
    assert all(r[1] == "alive" for r in members.values())

    ring = {r[0]: r for r in body("ring")}
    assert set(ring) == {"storage-1", "storage-2"}
    # R = 2 of 2 storage nodes: each owns every sampled id, and the primaries split between them.
    assert all(r[3].startswith("4096 (100.0%)") for r in ring.values()), ring
    primaries = [int(r[4].split()[0]) for r in ring.values()]
    assert sum(primaries) == 4096 and all(p > 0 for p in primaries), ring

    storage = {r[0]: r for r in body("storage")}
    assert set(storage) == {"storage-1", "storage-2"}
    for name, r in storage.items():
        ram, disk_files, fs, rows, entries = r[2], r[3], r[4], int(r[5]), int(r[6])
        assert rows > 0 and entries > rows, (name, r)  # every row is on both (R = 2)
        assert ram.endswith("/ 2.0 GiB") and not ram.startswith("0 B"), (name, ram)  # LocalCluster's capacity
        assert disk_files != "0 B" and " / " in fs, (name, r)
    assert len({r[5] for r in storage.values()}) == 1  # both hold the same rows

    jobs = body("jobs")
    assert len(jobs) == 1, jobs
    assert jobs[0][:3] == ["compute-1", job["job_id"], "succeeded"]
    assert jobs[0][3].startswith(f"{trained}/{trained} (100.0%)"), jobs[0]
