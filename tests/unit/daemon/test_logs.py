"""Logging: journald detection by device/inode, formats, no config at import."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from giaannd.logs import configure_logging, stream_is_journal


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_logs_journal_stream_matches_only_that_file(tmp_path: Path) -> None:
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        st = os.fstat(a.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stream_is_journal(a, env)
        assert not stream_is_journal(b, env)
        assert not stream_is_journal(a, {})
        assert not stream_is_journal(a, {"JOURNAL_STREAM": "garbage"})
        assert not stream_is_journal(io.StringIO(), env)


def test_logs_journal_format_has_priority_and_no_timestamp(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("debug", "journal", stream=out)
    logging.getLogger("giaannd.test").warning("event peer=%s column=%d", "n1", 7)
    assert out.getvalue() == "<4>WARNING giaannd.test: event peer=n1 column=7\n"


def test_logs_plain_format_has_timestamp_and_level_filter(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("warning", "plain", stream=out)
    configure_logging("warning", "plain", stream=out)  # reconfiguring does not duplicate
    log = logging.getLogger("giaannd.test")
    log.info("hidden")
    log.error("shown key=%s", "v")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("ERROR giaannd.test: shown key=v")
    assert lines[0][:4].isdigit()  # asctime


def test_logs_importing_giaannd_configures_nothing() -> None:
    code = ("import logging, giaannd.cli, giaannd.daemon, giaannd.admin.api, giaannd.admin.ctl;"
            "assert logging.getLogger().handlers == [], logging.getLogger().handlers")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
