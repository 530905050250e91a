"""Logging setup: stdlib ``logging``, key=value fields, journald-aware (STYLE.md item 21).

Modules log with ``logging.getLogger(__name__)`` and %-style arguments carrying stable
``key=value`` fields (``peer=… column=…``). Nothing here runs at import time: only the CLI calls
``configure_logging``, so importing giaannd as a library never touches the host's logging.

Under systemd, stderr is connected to journald, which adds its own timestamps and parses a
``<N>`` syslog-priority prefix (``SyslogLevelPrefix=``, on by default) into the entry's priority;
we emit that prefix and no timestamp there. systemd sets ``JOURNAL_STREAM=<dev>:<inode>`` for the
stream it connected; comparing it with stderr's own device and inode (the check sd_journal's
documentation recommends) avoids misdetecting a child whose stderr was redirected elsewhere.

``format = "json"`` is for operators who ship logs to Loki or Elasticsearch: one JSON object per
line with ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger`` and ``message``, plus every
``key=value`` field of the message as a key of its own (numbers as numbers), and ``exc`` with the
traceback when there is one. A field named like one of the four fixed keys is kept as
``field_<name>`` so it can never hide them.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import msgspec

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


#: A ``key=value`` field in a message: the key a word, the value up to the next blank.
_FIELD = re.compile(r"(?<![\w.])([A-Za-z_][\w.-]*)=(\S+)")
_FIXED_KEYS = frozenset({"time", "level", "logger", "message", "exc"})
_JSON = msgspec.json.Encoder()


#: A JSON number (RFC 8259 §6), ASCII digits only: what ``int``/``float`` also take (``0012``,
#: ``1_000``, ``+5``, non-ASCII digits) is another value's text and stays a string.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def _field_value(text: str) -> Any:
    """A field's value as JSON would carry it: an int or float when it is a JSON number."""
    match = _NUMBER.fullmatch(text)
    if match is None:
        return text
    if match.group(1) is None and match.group(2) is None:
        try:
            return int(text)
        except ValueError:  # over ``sys.get_int_max_str_digits``
            return text
    value = float(text)
    return value if abs(value) != float("inf") else text  # no inf in JSON


def _printable(value: Any) -> Any:
    """``value`` with lone surrogates (``os.fsdecode`` of bytes that are not UTF-8) written as
    ``\\udcXX``: UTF-8, hence JSON, cannot carry them."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(value, str) else value


class _JsonFormatter(logging.Formatter):
    """One JSON object per record (module docstring); never raises on odd messages."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        for key, value in _FIELD.findall(message):
            doc["field_" + key if key in _FIXED_KEYS else key] = _field_value(value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        try:
            return _JSON.encode(doc).decode()
        except UnicodeEncodeError:
            return _JSON.encode({_printable(k): _printable(v) for k, v in doc.items()}).decode()


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
    """Send the root logger to ``stream`` (stderr) at ``level`` in ``fmt`` (auto/plain/journal/json).

    Replaces handlers installed by an earlier call, so calling it twice does not duplicate lines.
    """
    stream = sys.stderr if stream is None else stream
    journal = fmt == "journal" or (fmt == "auto" and stream_is_journal(stream, environ))
    handler = logging.StreamHandler(stream)
    formatter: logging.Formatter
    if fmt == "json":
        formatter = _JsonFormatter()
    elif journal:
        formatter = _JournalFormatter(_JOURNAL_FORMAT)
    else:
        formatter = logging.Formatter(_PLAIN_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_giaannd", False):
            root.removeHandler(old)
    handler._giaannd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiohttp's access log duplicates our own request log at debug; keep it quiet.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
