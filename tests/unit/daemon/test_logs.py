"""Logging: journald detection by device/inode, formats, no config at import."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

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


def test_logs_json_format_one_object_per_line_with_fields(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = logging.getLogger("giaannd.test")
    log.warning("torn tail cut file=%s offset=%d ratio=%s level=%s", "/d/log.0001", 4096, "0.5", "x")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("apply failed batch=%s", "7:1")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "WARNING" and first["logger"] == "giaannd.test"
    assert first["message"] == "torn tail cut file=/d/log.0001 offset=4096 ratio=0.5 level=x"
    assert first["file"] == "/d/log.0001" and first["offset"] == 4096 and first["ratio"] == 0.5
    assert first["field_level"] == "x"  # a field never hides a fixed key
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert second["batch"] == "7:1" and "ValueError: boom" in second["exc"]


def test_logs_json_format_from_config() -> None:
    from giaannd.config import load_config

    assert load_config(None, overrides=["logging.format=json"]).logging.format == "json"


def test_logs_json_format_keeps_a_line_with_undecodable_bytes(restore_root: None) -> None:
    # A file name that is not UTF-8 (os.fsdecode: surrogate escapes) in a message and in an
    # exception: the line was lost ("--- Logging error ---" on stderr), never written as JSON.
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    # only this handler: pytest's own log capture keeps the records for the report, and a
    # worker of pytest-xdist cannot send a report holding a surrogate escape (execnet: "strings
    # must be utf-8 encodable"), which ended the worker (restore_root puts the handlers back)
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if getattr(h, "_giaannd", False)]
    log = logging.getLogger("giaannd.test")
    name = os.fsdecode(b"/corpora/caf\xe9.txt")
    with mock.patch("logging.raiseExceptions", True), mock.patch("sys.stderr", io.StringIO()) as err:
        log.warning("corpus skipped file=%s lines=%d", name, 3)
        try:
            raise OSError(f"cannot read {name}")
        except OSError:
            log.exception("upload failed file=%s", name)
    assert err.getvalue() == ""
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == r"corpus skipped file=/corpora/caf\udce9.txt lines=3"
    assert first["file"] == r"/corpora/caf\udce9.txt" and first["lines"] == 3
    assert second["level"] == "ERROR" and r"OSError: cannot read /corpora/caf\udce9.txt" in second["exc"]


def test_logs_json_format_numbers_only_where_the_text_is_a_number(restore_root: None) -> None:
    # ``digest=%016x`` (ring.py) printed 0000000000001234: the field was 1234, another value.
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    logging.getLogger("giaannd.test").info(
        "ring changed digest=%016x name=%s n=%d s=%.3f e=%s neg=%d", 0x1234, "1_000", 7, 0.5, 1e-05, -2)
    doc = json.loads(out.getvalue())
    assert doc["digest"] == "0000000000001234" and doc["name"] == "1_000"
    assert (doc["n"], doc["s"], doc["e"], doc["neg"]) == (7, 0.5, 1e-05, -2)
