"""Which node a client (and giaannctl) talks to: the admin API's address and the bearer token file.

Each of the two comes from the first of these that gives it:

1. ``--addr`` / ``--token-file``;
2. ``GIAANNCTL_ADDR`` / ``GIAANNCTL_TOKEN_FILE``;
3. ``--data-dir DIR``: ``DIR/admin.addr`` (the daemon writes it once it listens and removes it on
   a clean exit, so a missing one means no daemon runs there) and ``DIR/admin.token``;
4. with none of the above (a bare ``giaannctl node status`` on the node): the default data
   directory ``STATE_ROOT`` (``node.data-dir``'s default) if a daemon keeps its files there; else
   the host's one running systemd instance. ``giaannd@NAME`` keeps its state in
   ``/var/lib/giaannd/NAME`` (systemd/giaannd@.service, ``StateDirectory=giaannd/%i``), so the
   running instances are the ``STATE_ROOT/*/admin.addr`` files. Exactly one is used; several are
   refused with their names, since which node to drain is not giaannctl's guess to make;
5. ``http://127.0.0.1:7480`` (``admin.listen``'s default) and ``STATE_ROOT/admin.token``.

A token file given by name (step 1 or 2), and a data directory (step 3), have ``~`` expanded,
as the daemon expands it in ``admin.token-file``: a shell leaves ``--token-file=~/t`` and a quoted
``GIAANNCTL_TOKEN_FILE`` as they are, and ``Client(token_file=...)`` meets no shell at all. A
relative one is the working directory's. This is the one place giaannctl and the Python client expand it.

``STATE_ROOT`` is read when ``locate`` runs, so tests point it at a temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from giaannd.config import AdminConfig, NodeConfig
from giaannd.operations import ADMIN_ADDR_FILE, ADMIN_TOKEN_FILE
from giaannd.sdk.errors import ClientError, UsageError
from giaannd.sdk.http import admin_url

__all__ = ["DEFAULT_ADDR", "STATE_ROOT", "Target", "find_instances", "locate"]

#: The default ``node.data-dir``, which is also where the systemd unit keeps one directory per
#: instance (``/var/lib/giaannd``): the one root both step 4 searches look in.
STATE_ROOT: Path = Path(NodeConfig().data_dir)
#: ``admin.listen``'s default, as a URL.
DEFAULT_ADDR: Final = f"http://{AdminConfig().listen}"
_TOKEN_HINT: Final = "use --token-file, GIAANNCTL_TOKEN_FILE or --data-dir"


@dataclass(frozen=True, slots=True)
class Target:
    """Where giaannctl sends its requests: ``addr`` (a checked base URL), the ``token_file`` to
    read, and ``hint``: what to tell the user if that file cannot be read."""

    addr: str
    token_file: Path
    hint: str


def locate(*, addr: str | None, token_file: str | None, data_dir: str | None,
           environ: Mapping[str, str]) -> Target:
    """The node the flags and ``environ`` designate (module docstring, in that order).

    Raises:
        ClientError: an address that is not one (exit 2), several instances and nothing to choose
            between them (exit 2), unreadable instance directories (exit 2), or a data directory
            without ``admin.addr`` (exit 1: its daemon is not running).
    """
    if addr is not None and not isinstance(addr, str):  # ``Client(7480)``: failed deep in the parsing
        raise UsageError(f"the address must be text such as '127.0.0.1:{addr}', not {addr!r}")
    root = STATE_ROOT
    addr_from = "--addr" if addr else "GIAANNCTL_ADDR"
    addr = addr or environ.get("GIAANNCTL_ADDR") or None
    token = token_file or environ.get("GIAANNCTL_TOKEN_FILE") or None
    token = None if token is None else os.path.expanduser(token)  # module docstring
    directory = Path(data_dir).expanduser() if data_dir else None
    must_listen = directory is not None  # an explicit --data-dir without admin.addr is an error
    hint = _TOKEN_HINT
    if directory is None and addr is None and token is None:
        directory, must_listen = _bare(root)
        if directory is None:
            hint = f"no running giaannd found in {root} or {root}/*; {_TOKEN_HINT}"
    if addr is None and directory is not None:
        addr_file = directory / ADMIN_ADDR_FILE
        try:
            addr, addr_from = addr_file.read_text(encoding="utf-8").strip(), str(addr_file)
        except OSError as exc:
            if must_listen:
                raise ClientError(f"cannot read {addr_file}: {exc.strerror} (is the daemon running?)") from None
        except UnicodeDecodeError as exc:  # not what the daemon writes: a damaged or foreign file
            raise UsageError(f"{addr_file} is not UTF-8 text (byte {exc.start}): not an admin API address") from None
    if addr is None:
        addr, addr_from = DEFAULT_ADDR, "the default address"
    try:
        url = admin_url(addr)
    except ValueError as exc:
        raise UsageError(f"{addr_from}: {addr!r} is not an admin API address: {exc}") from None
    return Target(url, Path(token) if token else (directory or root) / ADMIN_TOKEN_FILE, hint)


def _bare(root: Path) -> tuple[Path | None, bool]:
    """Step 4: (the data directory to use or None, whether it must hold ``admin.addr``)."""
    if any(os.path.exists(root / name) for name in (ADMIN_ADDR_FILE, ADMIN_TOKEN_FILE)):
        return root, False  # a daemon run with the default node.data-dir: the old default
    found = find_instances(root)
    if len(found) > 1:
        names = ", ".join(d.name for d in found)
        raise UsageError(f"{len(found)} giaannd instances run here ({names}): choose one with "
                       f"--data-dir {root}/INSTANCE, e.g. --data-dir {found[0]}")
    return (found[0], True) if found else (None, False)


def find_instances(root: Path) -> list[Path]:
    """The data directories ``root/*`` of running daemons (holding ``admin.addr``), sorted.

    Raises:
        UsageError: some cannot be searched (permission denied: the unit's directories are the
            giaannd user's, mode 0750), so "exactly one" cannot be told (exit 2).
    """
    try:
        dirs = sorted(d for d in root.iterdir() if d.is_dir())
    except OSError:  # no such directory (not a systemd host), or not ours to list
        return []
    found: list[Path] = []
    denied: list[str] = []
    for directory in dirs:
        try:
            os.stat(directory / ADMIN_ADDR_FILE)
        except PermissionError:
            denied.append(directory.name)
        except OSError:
            continue  # not running, or not a data directory
        else:
            found.append(directory)
    if denied:
        raise UsageError(f"cannot search {root}/{{{','.join(denied)}}} for a running giaannd: permission "
                       "denied (run giaannctl as root or as the giaannd user, or give --data-dir, or "
                       "--addr and --token-file)")
    return found
