"""The Python client against real daemons, checked against what giaannctl answers: one small
cluster (1 storage + 1 compute, tcp) per module, trained once on 40 sentences.

The compute node runs with ``compute.column-rows-max-entries`` lowered to 1,000, an operator's
setting the route's default (100,000) no longer fits under.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.integration]

MAX_ENTRIES = 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import giaannd

    local = giaannd.LocalCluster(tmp_path_factory.mktemp("sdk") / "c", storage=1, compute=1, transport="tcp",
                                 log_level="warning", compute_options={"column_rows_max_entries": MAX_ENTRIES})
    with local as client:
        client.train(giaannd.bundled_corpus(), limit=40).wait(progress=False, timeout_s=120)
        yield local


def test_sdk_column_without_limit_reads_what_giaannctl_reads(cluster: Any) -> None:
    """``Client.column(word)`` always asked for ``limit=100000``, the route's built-in default, so on
    a node whose ``column-rows-max-entries`` is lower every call without a limit was a 400, where
    ``giaannctl column rows`` (no limit: the node's own default) answered."""
    node = cluster.compute_nodes[0]
    done = node.ctl("column", "rows", "god", "--json", timeout_s=60)
    assert done.returncode == 0, done.stderr
    want = json.loads(done.stdout)
    col = cluster.client().column("god")
    assert (col.column, col.word, col.total_entries, col.truncated) == \
        (int(want["column"]), want["word"], want["total_entries"], want["truncated"])
    assert len(col) == len(want["entries"]["strength"]) <= MAX_ENTRIES
    assert col.connections["target_feature"].tolist() == want["entries"]["target_feature"]
    np.testing.assert_array_equal(col.connections["strength"], np.asarray(want["entries"]["strength"], np.float32))


def test_sdk_job_with_an_empty_id_is_refused_not_followed(cluster: Any) -> None:
    """``job("")`` polled ``GET /v1/jobs/``, the list of jobs, as if it were the job: ``wait`` never
    saw a ``state`` and polled until its timeout (forever without one)."""
    import giaannd

    c = cluster.client()
    with pytest.raises(giaannd.UsageError, match="job_id must not be empty"):
        c.job("").wait(progress=False, timeout_s=3)
    with pytest.raises(giaannd.UsageError, match="job_id must not be empty"):
        c.job("").status()
    assert isinstance(c.jobs(), list) and Path(cluster.root).is_dir()
