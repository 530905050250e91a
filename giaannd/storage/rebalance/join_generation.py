"""A storage node's *join generation*: the nonce of the streams of the joins (and replaces) it
coordinates for itself.

Such an operation uses fixed stream ids (``Rebalance.stream_nonce``), so a node restarted in the
middle of its join resumes the streams its sources still run instead of starting over. When the
operation is abandoned before its cutover, its receivers discard those streams (operations.py,
rebalance/stream_discard.py ``DiscardStream``): they can never be resumed, and a later join must open
new ones. The generation, kept in ``<data dir>/join-generation`` (a decimal integer; absent: 0),
is that nonce; it goes up by one, durably, once an abandoned operation's streams are discarded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

__all__ = ["JOIN_GENERATION_FILE", "JoinGeneration"]

log = logging.getLogger(__name__)

JOIN_GENERATION_FILE: Final = "join-generation"


class JoinGeneration:
    """The join generation of the node whose data directory is ``data_dir`` (module docstring)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / JOIN_GENERATION_FILE

    def current(self) -> int:
        """The generation (0 when the file is absent).

        Raises:
            ValueError: the file holds something else than a non-negative integer.
        """
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return 0
        if not text.isdigit():
            raise ValueError(f"{self.path}: expected a non-negative integer, found {text[:40]!r} (remove the "
                             "file only if no join of this node is running)")
        return int(text)

    def advance(self) -> int:
        """Raise the generation by one, durably (written beside, fsynced, renamed); returns it."""
        value = self.current() + 1
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{value}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        log.info("join generation now %d (the abandoned join's streams were discarded)", value)
        return value
