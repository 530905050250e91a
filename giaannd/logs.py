"""Logging setup: stdlib ``logging``, key=value fields, journald-aware (STYLE.md item 21).

Modules log with ``logging.getLogger(__name__)`` and %-style arguments carrying stable
``key=value`` fields (``peer=… column=…``). Nothing here runs at import time: only the CLI calls
``configure_logging``, so importing giaannd as a library never touches the host's logging.

Under systemd, stderr is connected to journald, which adds its own timestamps and parses a
``<N>`` syslog-priority prefix (``SyslogLevelPrefix=``, on by default) into the entry's priority;
we emit that prefix and no timestamp there. systemd sets ``JOURNAL_STREAM=<dev>:<inode>`` for the
stream it connected; comparing it with stderr's own device and inode (the check sd_journal's
documentation recommends) avoids misdetecting a child whose stderr was redirected elsewhere.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

__all__ = ["configure_logging", "stream_is_journal"]

#: syslog priorities (RFC 5424 §6.2.1) for stdlib levels; journald maps ``<N>`` to PRIORITY=N.
_SYSLOG_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}

_PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _JournalFormatter(logging.Formatter):
    """No timestamp (journald adds one), syslog priority prefix on every line of a record."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _SYSLOG_PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        # A traceback spans lines; each line is a separate journal entry, so prefix them all.
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


def stream_is_journal(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``stream`` is the journald stream systemd named in ``JOURNAL_STREAM``."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, sep, inode = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(inode))
    except (OSError, ValueError, AttributeError):
        return False


def configure_logging(
    level: str = "info",
    fmt: str = "auto",
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Send the root logger to ``stream`` (stderr) at ``level`` in ``fmt`` (auto/plain/journal).

    Replaces handlers installed by an earlier call, so calling it twice does not duplicate lines.
    """
    stream = sys.stderr if stream is None else stream
    journal = fmt == "journal" or (fmt == "auto" and stream_is_journal(stream, environ))
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_JournalFormatter(_JOURNAL_FORMAT) if journal
                         else logging.Formatter(_PLAIN_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_giaannd", False):
            root.removeHandler(old)
    handler._giaannd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiohttp's access log duplicates our own request log at debug; keep it quiet.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
