"""The lease agent's vocabulary (leases.py): its settings, the events the glue feeds it and the
actions it asks the glue to run. Plain data; the rules are in leases.py and lease_table.py."""

from __future__ import annotations

from dataclasses import dataclass

from giaannd.client.registers import Version
from giaannd.compute.cluster_jobs.lease_table import JobRow

__all__ = [
    "Action",
    "Begin",
    "CancelJob",
    "CasDone",
    "CasRow",
    "DropWindow",
    "Event",
    "Finished",
    "Halt",
    "LeaseSettings",
    "OpFailed",
    "ReadRow",
    "RowRead",
    "RunWindow",
    "SetTimer",
    "Tick",
    "WindowFailed",
    "WindowWritten",
    "WriteRejected",
    "batch_seq",
]


def batch_seq(window: int) -> int:
    """The seq of window ``w``'s batch id ``(writer_id, w + 1)``: the same on every run of it."""
    return window + 1


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """The lease protocol's times and sizes (docs/compute.md has the defaults and trade-offs).

    Attributes:
        lease_s: a lease not renewed for this long may be taken over.
        renew_s: renew a lease when no write confirmed it for this long (< lease_s; lease_s / 3).
        probe_interval_s: how often the job row and the watched shards are read.
        lease_windows: windows per grant (more: fewer writes per window, more redone on a crash).
        parallel: windows this node runs at once; a new grant is asked for when fewer are left.
        retry_s: wait before writing a row again after a write whose outcome is unknown.
        idle_probe_s: how often the job row is read while this node holds no lease and the
            stage has no window left to grant (the stage's tail, run by others): the next stage
            or the job's end is seen this soon, not a probe interval late (capped by it).
    """

    lease_s: float
    renew_s: float
    probe_interval_s: float
    lease_windows: int
    parallel: int
    retry_s: float
    idle_probe_s: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.lease_s or self.probe_interval_s <= 0 or self.retry_s < 0 \
                or self.idle_probe_s <= 0:
            raise ValueError("need 0 < renew_s < lease_s, probe_interval_s > 0, idle_probe_s > 0, retry_s >= 0")
        if self.lease_windows < 1 or self.parallel < 1:
            raise ValueError("lease_windows and parallel must be >= 1")


# -- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Begin:
    """Follow the job (``create``: this node creates it, with this row in state ``created``)."""

    create: JobRow | None = None


@dataclass(frozen=True, slots=True)
class RowRead:
    """A ``ReadRow`` answered: the register's version (``ABSENT``: never written) and bytes."""

    key: str
    version: Version
    data: bytes


@dataclass(frozen=True, slots=True)
class CasDone:
    """A ``CasRow`` answered: ``ok`` (the row is now ``data`` at ``version``) or refused (the
    current row is ``data`` at ``version``)."""

    key: str
    ok: bool
    version: Version
    data: bytes


@dataclass(frozen=True, slots=True)
class OpFailed:
    """A read or write on ``key`` got no answer from a quorum (a write may or may not have landed)."""

    key: str
    error: str


@dataclass(frozen=True, slots=True)
class WriteRejected:
    """The register client rejected a ``CasRow``'s value before sending it (a row grown past the
    register value cap, ``protocol.MAX_REGISTER_VALUE_BYTES``): it never landed, and sending it
    again cannot help."""

    key: str
    error: str


@dataclass(frozen=True, slots=True)
class WindowWritten:
    """Window ``window``'s batch (and vocabulary) has W acks; ``units``: what it counted (the
    glue's unit: sentences trained), added to the completing node's tally (lease_table.Tally)."""

    stage: int
    window: int
    units: int = 0


@dataclass(frozen=True, slots=True)
class WindowFailed:
    """Window ``window`` cannot be done (after the glue's retries): the job fails."""

    stage: int
    window: int
    error: str


@dataclass(frozen=True, slots=True)
class CancelJob:
    """The operator cancels the job."""

    error: str = "cancelled"


@dataclass(frozen=True, slots=True)
class Tick:
    """The timer fired."""


@dataclass(frozen=True, slots=True)
class Halt:
    """This node stops: complete what is written, give the rest back."""


Event = Begin | RowRead | CasDone | OpFailed | WindowWritten | WindowFailed | CancelJob | Tick | Halt | WriteRejected


# -- actions --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReadRow:
    key: str


@dataclass(frozen=True, slots=True)
class CasRow:
    """Write ``data`` if the register is still at version ``expect`` (``ABSENT``: never written)."""

    key: str
    expect: Version
    data: bytes


@dataclass(frozen=True, slots=True)
class RunWindow:
    """Run window ``window`` of ``stage``; its batch id is ``(writer_id, batch_seq(window))``."""

    stage: int
    window: int
    writer_id: int


@dataclass(frozen=True, slots=True)
class DropWindow:
    """The lease on this window is lost: stop it if it still runs (finishing it is harmless)."""

    stage: int
    window: int


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Send ``Tick`` at ``at`` (replaces the timer set before)."""

    at: float


@dataclass(frozen=True, slots=True)
class Finished:
    """The agent is done: the job reached ``state`` (or ``released``: this node stopped)."""

    state: str
    error: str = ""


Action = ReadRow | CasRow | RunWindow | DropWindow | SetTimer | Finished
