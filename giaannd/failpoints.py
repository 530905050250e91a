"""Failpoints: named places in the daemon where a fault test can hold it, deterministically.

Some faults matter only in a window of milliseconds (a coordinator killed between two steps of a
topology operation's cutover). A test that kills at random lands there once in hundreds of runs;
with a failpoint it holds the process at that exact step, acts (kill -9, a partition), and checks
what the rest of the cluster does. The same idea as etcd's gofail or TiKV's fail-rs, reduced to
the one action these tests need.

Off unless the environment variable ``GIAANND_FAILPOINTS`` is set when the daemon starts:
``name=sleep:SECONDS`` entries separated by commas, e.g.
``GIAANND_FAILPOINTS=cutover.after-writers=sleep:60``. ``hit(name)`` then sleeps that long (the
event loop goes on; only the awaiting task waits) and logs a warning each time. A name this build
does not have, or a malformed entry, stops the daemon at start (``ConfigError``, exit status 2):
a fault test whose failpoint silently did nothing would pass for the wrong reason. Never set it in
production.

Failpoints (``NAMES``):

- ``cutover.after-targets``: a topology operation's coordinator, right after its targets switched
  to the new placement (docs/topology.md, cutover step a);
- ``cutover.after-writers``: right after the writers switched and drained (step b).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Final

from giaannd.errors import ConfigError

__all__ = ["ENV", "NAMES", "active", "hit", "load", "parse"]

log = logging.getLogger(__name__)

#: The environment variable that turns failpoints on (module docstring).
ENV: Final = "GIAANND_FAILPOINTS"
#: Every failpoint this build has.
NAMES: Final = frozenset({"cutover.after-targets", "cutover.after-writers"})

_active: dict[str, float] = {}


def parse(spec: str) -> dict[str, float]:
    """``name=sleep:SECONDS[,...]`` -> {name: seconds}.

    Raises:
        ConfigError: an unknown name, an action other than ``sleep``, or seconds that are not a
            finite number ≥ 0.
    """
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        kind, _, arg = action.partition(":")
        if name not in NAMES:
            raise ConfigError(f"{ENV}: unknown failpoint {name!r} (known: {', '.join(sorted(NAMES))})")
        if kind != "sleep":
            raise ConfigError(f"{ENV}: {item!r}: the only action is sleep:SECONDS")
        try:
            seconds = float(arg)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise ConfigError(f"{ENV}: {item!r}: seconds must be a finite number >= 0")
        out[name] = seconds
    return out


def load(environ: Mapping[str, str]) -> dict[str, float]:
    """Arm the failpoints ``environ`` names (none when ``ENV`` is unset); returns them.

    Raises:
        ConfigError: as ``parse`` (nothing armed).
    """
    global _active
    _active = parse(environ.get(ENV, ""))
    if _active:
        log.warning("failpoints armed (a fault test; never in production): %s",
                    ", ".join(f"{n}=sleep:{s:g}" for n, s in sorted(_active.items())))
    return dict(_active)


def active() -> dict[str, float]:
    """The failpoints armed now."""
    return dict(_active)


async def hit(name: str) -> None:
    """Hold the calling task at failpoint ``name`` if it is armed (module docstring)."""
    seconds = _active.get(name)
    if seconds is None:
        return
    log.warning("failpoint %s: holding for %gs", name, seconds)
    await asyncio.sleep(seconds)
