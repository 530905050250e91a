"""The daemon's exception tree (STYLE.md item 10).

Every exception giaannd defines roots in ``GiaannError`` (tests/unit/daemon/test_error_tree.py walks
the package to hold that). Like peers/errors.py, an error says **whose fault** it is, because that
decides what the caller does, and carries a **reason**: a short stable token (``store_full``,
``corrupt_log``) usable as a metrics label or an API ``code``. ``reason`` is a class default; one
instance may override it (``HostEnvironmentError(..., reason="port_in_use")``). The message is for
people; callers match on the type or the reason, never on the words.

Each error also knows the process exit code it maps to, so the CLI boundary turns any
``GiaannError`` into one clear line on stderr and the right status without a table of special cases.
Exit 2 means "the operator must act; restarting the same way cannot help" (a configuration or host
error, a corrupt file); exit 1 is a runtime failure a restart may cure. The fault classes:

- ``InputError``: what the user handed us is wrong. ``ConfigError`` (bad TOML, unknown key,
  out-of-range value; the key path such as ``$.storage.capacity-bytes`` in the message so the user
  can find the line to fix), or a corpus or lexicon file. Exit 2.
- ``HostEnvironmentError``: the host refuses what a correct config asks for (port in use,
  permission denied, data directory locked by another daemon, an optional dependency such as spaCy
  not installed). Exit 2, as the user fixes it, not the code.
- ``CorruptDataError``: data the daemon owns (or reads back) fails validation; ``CorruptFileError``
  when it names the file. It is never "repaired" by overwriting, because that could lose data; the
  operator decides. Exit 2 as well: restarting cannot make the file valid, so systemd must not
  restart-loop on it (``RestartPreventExitStatus=2``); the one ``giaannd: error:`` line names the
  file and the offset.
- ``RemoteFault``: another node refused, misbehaved (``ProtocolViolation``), or too few answered
  (``QuorumNotReached``); this node did nothing wrong and may retry or try another node.
- ``Refused``: this node declines in its current state (store full, another operation running, a
  hash collision); nothing changed, and the caller may retry later or elsewhere.

Two boundary errors sit directly under ``GiaannError``: ``AdminHTTPError`` (an admin API handler's
answer; its ``code`` *is* its reason) and the client's ``ClientError`` (giaannd/sdk/errors.py; a
per-instance exit code). Some errors are also a builtin (``ProtocolViolation`` is a ``ValueError``)
where existing ``except`` sites rely on it, as peers' ``TransportClosed`` is an ``OSError``.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "HOST_ERRNOS",
    "AdminHTTPError",
    "ConfigError",
    "CorruptDataError",
    "CorruptFileError",
    "GiaannError",
    "HostEnvironmentError",
    "InputError",
    "Refused",
    "RemoteFault",
]

EXIT_OK = 0
EXIT_FAILURE = 1
#: Usage and configuration errors, as argparse and the BSD sysexits convention for "usage" use;
#: also every other error a restart cannot fix (host environment, corrupt data): the systemd unit's
#: ``RestartPreventExitStatus=2`` keeps it from restart-looping.
EXIT_USAGE = 2

#: ``OSError`` numbers that mean "the host refuses" (not a bug, not a transient failure): a full or
#: read-only file system, a quota, permissions. Start-up turns them into ``HostEnvironmentError``.
HOST_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
_HOST_ERRNO_FIX = {
    errno.ENOSPC: "free space on that file system",
    errno.EDQUOT: "raise the disk quota or free space",
    errno.EROFS: "the data directory must be on a writable file system",
    errno.EACCES: "the daemon's user needs read and write access there",
    errno.EPERM: "the daemon's user needs read and write access there",
}


class GiaannError(Exception):
    """Base of every error giaannd raises on purpose; ``exit_code`` is what the CLI returns.

    Args:
        args: as for ``Exception`` (the first is the message).
        reason: overrides the class's ``reason`` token for this instance.
    """

    exit_code: int = EXIT_FAILURE
    #: short stable token: a metrics label value, an API ``code``; subclasses set their own
    reason: str = "error"

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
        if reason is not None:
            self.reason = reason


class InputError(GiaannError):
    """What the user handed us (config, corpus, lexicon) is invalid: the user's fault, exit 2."""

    exit_code = EXIT_USAGE
    reason = "bad_input"


class ConfigError(InputError):
    """The configuration (file, environment or ``--set``) is invalid.

    Args:
        message: what is wrong, in words a user can act on.
        path: the JSON-path style key (``$.section.field``) the error is about, when known.
    """

    reason = "config"

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{message} - at `{path}`" if path and path not in message else message)


class HostEnvironmentError(GiaannError):
    """The host refuses what the configuration asks for: port in use, permission denied, the data
    directory locked by another daemon, a dependency not installed. Not an ``OSError`` (the
    builtin ``EnvironmentError`` is one): it is raised after translating one, with the fix to make."""

    exit_code = EXIT_USAGE
    reason = "host_environment"

    @classmethod
    def from_os_error(cls, exc: OSError, path: str | os.PathLike[str] | None = None
                      ) -> HostEnvironmentError | None:
        """The host error an ``OSError`` stands for, or None when it is not one (``HOST_ERRNOS``).

        Args:
            exc: the error.
            path: the file or directory to name when ``exc`` carries no file name (``os.write``
                on a descriptor).
        """
        if exc.errno not in HOST_ERRNOS:
            return None
        where = exc.filename if exc.filename is not None else path
        what = exc.strerror or os.strerror(exc.errno or 0)
        text = f"{what}: {os.fsdecode(where)}" if where is not None else what
        return cls(f"{text} ({_HOST_ERRNO_FIX[exc.errno or 0]})",
                   reason="disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "file_access")


class CorruptDataError(GiaannError):
    """Data the daemon owns fails validation; it is left untouched for the operator (exit 2: a
    restart cannot fix it)."""

    exit_code = EXIT_USAGE
    reason = "corrupt_data"


class CorruptFileError(CorruptDataError):
    """A file the daemon owns exists but does not validate; it is left untouched for the operator.

    Args:
        path: the file.
        detail: what failed, in words.
        offset: the byte offset where validation failed, when the failure is in the file's bytes
            (None for "unreadable", "too large", a name that does not match the content, ...).
    """

    reason = "corrupt_file"

    def __init__(self, path: str, detail: str, *, offset: int | None = None) -> None:
        self.file_path = path
        self.offset = offset
        where = "" if offset is None else f"at byte offset {offset}: "
        super().__init__(f"{path} is corrupt: {where}{detail}")


class RemoteFault(GiaannError):
    """Another node refused, broke the protocol, or too few nodes answered: not this node's fault."""

    reason = "remote"


class Refused(GiaannError):
    """This node declines the request in its current state; nothing changed (retry later/elsewhere)."""

    reason = "refused"


class AdminHTTPError(GiaannError):
    """An admin API request is refused: the handler raises it, the API answers ``status`` with
    ``{"error": message, "code": code}``. ``code`` is a stable reason token (``bad_request``,
    ``not_found``, ``conflict``, ...) that clients match on; the message is for people. It is this
    error's ``reason`` (one attribute; ``code`` reads it)."""

    def __init__(self, status: int, message: str, code: str = "error") -> None:
        super().__init__(message, reason=code)
        self.status, self.message = status, message

    @property
    def code(self) -> str:
        return self.reason
