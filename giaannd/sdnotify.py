"""sd_notify(3) over the ``NOTIFY_SOCKET`` datagram socket, without libsystemd.

The protocol is one AF_UNIX datagram of newline-separated ``KEY=VALUE`` assignments
(``READY=1``, ``STOPPING=1``, ``WATCHDOG=1``, ``STATUS=…``). ``NOTIFY_SOCKET`` is a filesystem
path or, when it starts with ``@``, a Linux abstract-namespace name (the ``@`` stands for a
leading NUL byte). Notification is best effort, as in libsystemd: a failure is logged once and
never stops the daemon, because the service manager may legitimately be gone during shutdown.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["SdNotifier", "watchdog_interval_s"]

log = logging.getLogger(__name__)


class SdNotifier:
    """Sends notifications to the service manager; a no-op when ``NOTIFY_SOCKET`` is unset.

    Args:
        address: the ``NOTIFY_SOCKET`` value; None reads it from the environment.
    """

    def __init__(self, address: str | None = None) -> None:
        raw = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self._address: str | bytes | None = None
        if raw:
            # '@name' is the abstract namespace; Python spells that with a leading NUL.
            self._address = b"\0" + raw[1:].encode() if raw.startswith("@") else raw
        self._warned = False

    @property
    def enabled(self) -> bool:
        """Whether a service manager asked for notifications."""
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``assignments`` (e.g. ``"READY=1"``) in one datagram; True if it was sent."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # MSG_DONTWAIT, as libsystemd does: if the manager is not draining its queue
                # (net.unix.max_dgram_qlen datagrams), a blocking send would freeze the event
                # loop, and with it the admin API, on a watchdog ping.
                sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify failed address=%r error=%s", self._address, exc)
                self._warned = True
            return False
        return True


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``WATCHDOG_USEC`` (sd_watchdog_enabled(3)).

    Returns None when the watchdog is off, malformed, or meant for another process
    (``WATCHDOG_PID`` set to a pid other than ours).
    """
    env = os.environ if environ is None else environ
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
