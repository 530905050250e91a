"""The HTML report (giaannd/sdk/report.py): every plot present as an embedded image that decodes,
parts the node could not give said so, and the page written whole through a client."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

from giaannd.sdk.client import Client  # noqa: E402
from giaannd.sdk.report import PLOTS, ReportData, render  # noqa: E402
from tests.unit.sdk.fake_api import serving  # noqa: E402

IMG = re.compile(r'<figure id="([a-z0-9-]+)"><img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


def _data() -> ReportData:
    t0 = 1_700_000_000.0
    timeline = {"t": [t0, t0 + 1, t0 + 2.5, t0 + 4], "done": [0, 400, 900, 1200], "trained": [0, 390, 880, 1170],
                "bytes_sent": [0, 2 << 20, 5 << 20, 7 << 20]}
    return ReportData(
        node={"node_name": "compute-1", "cluster": "giaann-local", "roles": {"compute": "running"}, "version": "0.1"},
        jobs=[{"job_id": "j1", "state": "succeeded", "timeline": timeline}, {"job_id": "j2", "state": "running"}],
        evals=[{"top1": 0.05, "trained": 0, "source": "heldout", "constants": "test"},
               {"top1": 0.21, "trained": 1170, "source": "heldout", "constants": "test"}],
        usage=[{"name": f"storage-{i}", "used_bytes": 300 << 20, "capacity_bytes": 2 << 30, "disk_bytes": 120 << 20,
                "row_sizes": [5000, 2000, 700, 200, 40, 9, 1]} for i in (1, 2)],
        ring={"owner_sample": 4096, "members": [{"name": "storage-1", "owned": 4096, "primary": 2000},
                                                 {"name": "storage-2", "owned": 4096, "primary": 2096}]})


def _images(page: str) -> dict[str, Image.Image]:
    found = {}
    for anchor, b64 in IMG.findall(page):
        image = Image.open(io.BytesIO(base64.b64decode(b64)))
        image.load()  # decodes the whole image (a truncated PNG raises here)
        found[anchor] = image
    return found


def test_report_has_every_plot_as_an_image_that_decodes() -> None:
    page = render(_data())
    images = _images(page)
    assert list(images) == [anchor for anchor, _, _ in PLOTS]
    for image in images.values():
        assert image.format == "PNG" and image.size == (960, 480)
        # a drawn plot, not a blank canvas: many distinct colours
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 50
    assert "Not available" not in page and "compute-1" in page


def test_report_says_which_parts_are_missing_and_still_draws() -> None:
    data = ReportData(node={"node_name": "storage-1"}, missing={"jobs": "this node does not serve /v1/jobs",
                                                                 "evals": "this node does not serve /v1/evals"})
    page = render(data)
    assert len(_images(page)) == len(PLOTS)
    assert "Not available" in page and "this node does not serve /v1/jobs" in page


def test_client_report_writes_one_self_contained_file(tmp_path: Path) -> None:
    data = _data()
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/status", dict(data.node))
        api.on("GET", "/v1/jobs", {"jobs": data.jobs})
        api.on("GET", "/v1/evals", {"evals": data.evals})
        api.on("GET", "/v1/ring/usage", {"nodes": data.usage})
        api.on("GET", "/v1/ring", dict(data.ring))
        out = Client(data_dir=data_dir).report(tmp_path / "report.html")
    page = out.read_text(encoding="utf-8")
    assert len(_images(page)) == len(PLOTS) and "Not available" not in page
    assert "src=\"http" not in page and "<script" not in page  # nothing fetched from elsewhere
