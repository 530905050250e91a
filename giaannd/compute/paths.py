"""Which files the compute admin operations may read and write (issue 16 item 6).

A holder of the admin token names files by path: corpora to train on or evaluate, and the export's
output. Left unchecked, that reads any file the daemon can read (and leaves a tagged copy of it in
the tag cache) and atomically replaces any file it can write, its own token and ring included. So
each kind of path has one allowed directory (config ``compute.corpus-dir``, ``compute.export-dir``):

- a relative path is taken inside that directory;
- the path is resolved, symlinks and ``..`` included, *before* the check, so a link inside the
  directory that points out of it is refused like the outside path itself;
- the resolved path must be the directory or lie below it, else ``PathOutside`` (403).

The resolved path is what the caller then uses. What remains open: someone who can write inside
the allowed directory could swap a checked component for a symlink between the check and the open;
only the operator can write there, and the token gives no way to create links.

An export only replaces a file that is a previous export (``giaannd.model.export.is_jsonl_export``)
unless the request says ``overwrite`` (``check_export_target``).
"""

from __future__ import annotations

import os
from pathlib import Path

from giaannd.errors import InputError
from giaannd.model.export import is_jsonl_export

__all__ = ["NotAnExport", "PathOutside", "check_export_target", "resolve_inside"]


class PathOutside(InputError):
    """A requested path resolves outside its allowed directory; the message names both."""

    reason = "forbidden"


class NotAnExport(InputError):
    """The export's target exists and is not a previous export, and overwrite was not asked."""

    reason = "not_an_export"


def resolve_inside(value: str, root: Path, *, what: str, knob: str) -> Path:
    """``value`` resolved inside ``root`` (module docstring).

    Args:
        value: the path as requested (absolute, or relative to ``root``).
        root: the allowed directory.
        what: what the path is, for the message (``"corpus"``).
        knob: the config key that sets ``root``, for the message.

    Raises:
        PathOutside: it resolves outside ``root``.
    """
    base = Path(os.path.realpath(root))
    requested = Path(value)
    resolved = Path(os.path.realpath(requested if requested.is_absolute() else base / requested))
    if resolved != base and base not in resolved.parents:
        via = "" if str(resolved) == value else f" (resolves to {resolved})"
        raise PathOutside(f"{what} {value}{via} is outside the allowed directory {base} "
                          f"(set by {knob}); put the file there or name it relative to it")
    return resolved


def check_export_target(path: Path, *, overwrite: bool) -> None:
    """Refuse to export to ``path`` (already resolved) unless it is new, a previous export, or
    ``overwrite`` is set.

    Raises:
        InputError: ``path`` is a directory or another non-regular file, or its directory is
            missing (the message names the path).
        NotAnExport: ``path`` is a regular file that is not a previous export.
        OSError: ``path`` could not be read to tell.
    """
    if path.is_dir():
        raise InputError(f"export path {path} is a directory; name a file inside it")
    if not path.parent.is_dir():
        raise InputError(f"export directory {path.parent} does not exist")
    if not path.exists():
        return
    if not path.is_file():
        raise InputError(f"export path {path} exists and is not a regular file")
    if not overwrite and not is_jsonl_export(path):
        raise NotAnExport(f"{path} exists and is not a previous export; pass overwrite "
                          "(giaannctl export --overwrite) to replace it")
