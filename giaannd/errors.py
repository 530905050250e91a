"""The daemon's small exception tree (STYLE.md item 10).

Each error knows the process exit code it maps to, so the CLI boundary turns any ``GiaannError``
into one clear line on stderr and the right status without a table of special cases:

- ``ConfigError`` is a user error (bad TOML, unknown key, out-of-range value): exit 2, the key path
  in the message (``$.storage.capacity-bytes``) so the user can find the line to fix.
- ``CorruptFileError`` means a file the daemon owns failed validation. It is never "repaired" by
  overwriting, because that could lose data; the operator decides (exit 1).
- ``NotOwnerError`` is raised by the storage role when a request reaches a node that does not own
  the column; callers re-resolve owners and retry.
"""

from __future__ import annotations

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "AdminHTTPError",
    "ConfigError",
    "CorruptFileError",
    "GiaannError",
    "NotOwnerError",
]

EXIT_OK = 0
EXIT_FAILURE = 1
#: Usage and configuration errors, as argparse and the BSD sysexits convention for "usage" use.
EXIT_USAGE = 2


class GiaannError(Exception):
    """Base of every error giaannd raises on purpose; ``exit_code`` is what the CLI returns."""

    exit_code: int = EXIT_FAILURE


class ConfigError(GiaannError):
    """The configuration (file, environment or ``--set``) is invalid.

    Args:
        message: what is wrong, in words a user can act on.
        path: the JSON-path style key (``$.section.field``) the error is about, when known.
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{message} - at `{path}`" if path and path not in message else message)


class CorruptFileError(GiaannError):
    """A file the daemon owns exists but does not validate; it is left untouched for the operator.

    Args:
        path: the file.
        reason: what failed, in words.
        offset: the byte offset where validation failed, when the failure is in the file's bytes
            (None for "unreadable", "too large", a name that does not match the content, ...).
    """

    def __init__(self, path: str, reason: str, *, offset: int | None = None) -> None:
        self.file_path = path
        self.offset = offset
        where = "" if offset is None else f"at byte offset {offset}: "
        super().__init__(f"{path} is corrupt: {where}{reason}")


class NotOwnerError(GiaannError):
    """This node does not own the requested column (placement moved or the client used stale owners)."""


class AdminHTTPError(GiaannError):
    """An admin API request is refused: the handler raises it, the API answers ``status`` with
    ``{"error": message, "code": code}``. ``code`` is a stable reason token (``bad_request``,
    ``not_found``, ``conflict``, ...) that clients match on; the message is for people."""

    def __init__(self, status: int, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
