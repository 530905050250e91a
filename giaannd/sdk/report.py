"""The report: one self-contained HTML file with plots of what a cluster did.

Theory of operation
-------------------
``gather`` asks the node the client talks to for everything the plots need, through the client's
own methods (so it reads what any user could): the node's status, the training jobs (each
document keeps a timeline of its cumulative figures, giaannd/compute/jobs.py), the evaluation
history (each with the sentences trained at the time), every storage node's fill and row-size
histogram (``GET /v1/ring/usage``) and the placement's owner counts (``GET /v1/ring``). A part the
node cannot give (a storage-only node has no jobs, a storage node that is down has no usage) is
kept as the reason, and its plot says so instead of failing the report.

``render`` draws each plot with matplotlib's object API (``Figure``, Agg: no display, no global
pyplot state) into a PNG embedded in the page as a ``data:`` URI, so the file needs nothing beside
it. The plots, each readable without the text, with axes in units:

1. training throughput over time, per job (sentences/s between timeline points);
2. update bytes sent over time, per job (MiB, cumulative);
3. top-1 of each evaluation against sentences trained;
4. distribution of row sizes (log-log: rows per power-of-two bucket of entries; the Zipf head
   is what costs);
5. RAM and disk fill per storage node (GiB, with each node's RAM capacity);
6. owners per node (columns of the placement's fixed sample owned, and owned as primary).

matplotlib is an optional dependency (the ``report`` extra); without it ``write_report`` raises
``UsageError`` saying what to install.
"""

from __future__ import annotations

import base64
import html
import io
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from giaannd.atomic_file import atomic_write_bytes
from giaannd.sdk.errors import ClientError, UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from giaannd.sdk.client import Client

__all__ = ["PLOTS", "ReportData", "gather", "render", "write_report"]

GIB: Final = float(1 << 30)
MIB: Final = float(1 << 20)
#: Figure size (inches) and resolution: 960 x 480 px images, sharp on a laptop screen.
FIG_SIZE: Final = (8.0, 4.0)
DPI: Final = 120


@dataclass
class ReportData:
    """What the plots are drawn from; a part that could not be had is its reason (``missing``)."""

    node: Mapping[str, Any] = field(default_factory=dict)
    jobs: list[Mapping[str, Any]] = field(default_factory=list)
    evals: list[Mapping[str, Any]] = field(default_factory=list)
    usage: list[Mapping[str, Any]] = field(default_factory=list)
    ring: Mapping[str, Any] = field(default_factory=dict)
    #: part name ("jobs", "evals", "usage", "ring") -> why it is absent
    missing: dict[str, str] = field(default_factory=dict)
    generated_at: float = field(default_factory=time.time)


def gather(client: Client) -> ReportData:
    """Ask ``client``'s node for every part (module docstring); only ``status`` must answer.

    Raises:
        ClientError: the node cannot be reached at all.
    """
    data = ReportData(node=client.status())
    parts: dict[str, Callable[[], Any]] = {"jobs": client.jobs, "evals": client.evals, "usage": client.usage,
                                           "ring": client.ring}
    for name, fetch in parts.items():
        try:
            setattr(data, name, fetch())
        except ClientError as exc:
            data.missing[name] = str(getattr(exc, "detail", None) or exc)
    return data


# -- the plots ---------------------------------------------------------------------------------


def _new_figure() -> Figure:
    from matplotlib.figure import Figure  # optional dependency, checked by write_report

    return Figure(figsize=FIG_SIZE, dpi=DPI, layout="constrained")


def _no_data(fig: Figure, title: str, why: str) -> None:
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.text(0.5, 0.5, f"no data\n{why}", ha="center", va="center", wrap=True, transform=ax.transAxes)
    ax.set_axis_off()


def _label(ax: Any, title: str, xlabel: str, ylabel: str, *, from_zero: bool = False,
           grid_axis: Literal["both", "x", "y"] = "both", grid_which: Literal["major", "minor", "both"] = "major",
           ) -> None:
    """Title, axis labels (with units), a light grid and the legend: the same on every plot."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if from_zero:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis=grid_axis, which=grid_which)
    ax.legend(loc="best", fontsize="small")


def _timelines(data: ReportData) -> list[tuple[str, Mapping[str, Sequence[float]]]]:
    out = []
    for job in data.jobs:
        tl = job.get("timeline")
        if isinstance(tl, Mapping) and len(tl.get("t", ())) >= 2:
            out.append((str(job.get("job_id", "?")), tl))
    return out


def plot_throughput(fig: Figure, data: ReportData) -> None:
    title = "Training throughput"
    lines = _timelines(data)
    if not lines:
        _no_data(fig, title, data.missing.get("jobs", "no job with a timeline yet"))
        return
    ax = fig.add_subplot()
    for job_id, tl in lines:
        t, done = tl["t"], tl["done"]
        rates = [(done[i] - done[i - 1]) / max(t[i] - t[i - 1], 1e-9) for i in range(1, len(t))]
        ax.stairs(rates, [x - t[0] for x in t], label=f"job {job_id}", linewidth=1.5)
    _label(ax, title, "time since the job started (s)", "sentences per second", from_zero=True)


def plot_bytes(fig: Figure, data: ReportData) -> None:
    title = "Update bytes sent to storage"
    lines = _timelines(data)
    if not lines:
        _no_data(fig, title, data.missing.get("jobs", "no job with a timeline yet"))
        return
    ax = fig.add_subplot()
    for job_id, tl in lines:
        t = tl["t"]
        ax.plot([x - t[0] for x in t], [b / MIB for b in tl["bytes_sent"]], marker=".", label=f"job {job_id}")
    _label(ax, title, "time since the job started (s)", "bytes sent, cumulative (MiB)", from_zero=True)


def plot_top1(fig: Figure, data: ReportData) -> None:
    title = "Top-1 next-token accuracy by sentences trained"
    if not data.evals:
        _no_data(fig, title, data.missing.get("evals", "no evaluation run yet"))
        return
    ax = fig.add_subplot()
    by_source: dict[str, list[tuple[float, float]]] = {}
    for ev in data.evals:
        by_source.setdefault(f"{ev.get('source', '?')} ({ev.get('constants', '?')} constants)", []).append(
            (float(ev.get("trained", 0)), 100.0 * float(ev.get("top1", 0.0))))
    for label, points in by_source.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    _label(ax, title, "sentences trained (at the evaluation)", "top-1 accuracy (%)", from_zero=True)


def plot_row_sizes(fig: Figure, data: ReportData) -> None:
    title = "Row sizes (log-log)"
    nodes = [n for n in data.usage if n.get("row_sizes")]
    if not nodes:
        _no_data(fig, title, data.missing.get("usage", "no storage node reported row sizes"))
        return
    ax = fig.add_subplot()
    for i, node in enumerate(nodes):  # replicas often hold the same rows: styles tell the lines apart
        counts = node["row_sizes"]
        xs = [2.0 ** k for k, c in enumerate(counts) if c]
        ys = [c for c in counts if c]
        ax.plot(xs, ys, marker="os^vD"[i % 5], linestyle=("-", "--", ":", "-.")[i % 4], alpha=0.8,
                label=str(node.get("name", "?")))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _label(ax, title, "entries per row (power-of-two bucket: [n, 2n))", "rows", grid_which="both")


def plot_fill(fig: Figure, data: ReportData) -> None:
    title = "Storage fill per node"
    nodes = [n for n in data.usage if n.get("used_bytes") is not None]
    if not nodes:
        _no_data(fig, title, data.missing.get("usage", "no storage node answered"))
        return
    ax = fig.add_subplot()
    names = [str(n.get("name", "?")) for n in nodes]
    xs = list(range(len(nodes)))
    width = 0.38
    caps = [float(n.get("capacity_bytes") or 0) for n in nodes]
    ram = [float(n.get("used_bytes") or 0) for n in nodes]
    disk = [float(n.get("disk_bytes") or 0) for n in nodes]
    # The capacity is drawn (an outline around the RAM bar) only where the fill shows beside it;
    # a nearly empty node gets its share written above the bar instead, in a unit that fits.
    draw_caps = any(caps) and max(ram) >= 0.05 * max(caps)
    top = max(ram + disk + (caps if draw_caps else []))
    unit, scale = ("GiB", GIB) if top >= GIB else ("MiB", MIB)
    left = [x - width / 2 for x in xs]
    if draw_caps:
        ax.bar(left, [c / scale for c in caps], width, fill=False, edgecolor="black", linestyle="--",
               label="RAM capacity")
    ax.bar(left, [r / scale for r in ram], width, color="C0", label="RAM used")
    ax.bar([x + width / 2 for x in xs], [d / scale for d in disk], width, color="C1", label="disk (its files)")
    for x, used, cap in zip(left, ram, caps):
        if cap:
            ax.annotate(f"{100 * used / cap:.1f} % of {cap / GIB:.3g} GiB", (x, used / scale), ha="center",
                        va="bottom", fontsize="small")
    ax.set_xticks(xs, names)
    _label(ax, title, "storage node", unit, grid_axis="y")


def plot_owners(fig: Figure, data: ReportData) -> None:
    title = "Column owners per node"
    members = [m for m in data.ring.get("members", []) if isinstance(m, Mapping)]
    if not members:
        _no_data(fig, title, data.missing.get("ring", "no placement yet"))
        return
    ax = fig.add_subplot()
    names = [str(m.get("name", "?")) for m in members]
    xs = list(range(len(members)))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [int(m.get("owned") or 0) for m in members], width, label="owner (any)")
    ax.bar([x + width / 2 for x in xs], [int(m.get("primary") or 0) for m in members], width, label="primary owner")
    sample = data.ring.get("owner_sample")
    ax.set_xticks(xs, names)
    _label(ax, title + (f" (of a sample of {sample} column ids)" if sample else ""), "storage node",
           "columns owned (sample count)", grid_axis="y")


#: (anchor, caption, draw) of every plot, in page order.
PLOTS: Final[tuple[tuple[str, str, Callable[[Figure, ReportData], None]], ...]] = (
    ("throughput", "Training throughput: sentences per second between timeline points, per job.", plot_throughput),
    ("bytes", "Update bytes the compute node sent to storage, cumulative, per job.", plot_bytes),
    ("top1", "Top-1 accuracy of each evaluation against the sentences trained when it ran.", plot_top1),
    ("row-sizes", "How many rows hold how many entries, per storage node (log-log).", plot_row_sizes),
    ("fill", "RAM used (of capacity) and disk taken per storage node.", plot_fill),
    ("owners", "Columns each node owns in the placement in force (a fixed sample of ids).", plot_owners),
)


def _png(draw: Callable[[Figure, ReportData], None], data: ReportData) -> bytes:
    fig = _new_figure()
    draw(fig, data)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render(data: ReportData) -> str:
    """The report page for ``data`` (module docstring)."""
    node = data.node
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(data.generated_at))
    roles = ", ".join(sorted(node.get("roles", {}))) if isinstance(node.get("roles"), Mapping) else ""
    summary = [("node", node.get("node_name", "?")), ("cluster", node.get("cluster", "?")),
               ("roles", roles or "none"), ("version", node.get("version", "?")),
               ("jobs", len(data.jobs)), ("evaluations", len(data.evals)),
               ("storage nodes reporting", len(data.usage)), ("generated", when)]
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>giaannd report: {html.escape(str(node.get('cluster', '')))}</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em}"
             "figure{margin:2em 0}img{max-width:100%;border:1px solid #ddd}"
             "table{border-collapse:collapse}td{padding:2px 12px 2px 0}</style></head><body>",
             "<h1>giaannd report</h1>", "<table>"]
    parts += [f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in summary]
    parts.append("</table>")
    for anchor, caption, draw in PLOTS:
        b64 = base64.b64encode(_png(draw, data)).decode()
        parts.append(f'<figure id="{anchor}"><img alt="{html.escape(caption)}" src="data:image/png;base64,{b64}">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    if data.missing:
        parts.append("<h2>Not available</h2><ul>")
        parts += [f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in sorted(data.missing.items())]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(client: Client, path: Path) -> Path:
    """Gather, render and write the report to ``path`` (atomically); ``path``.

    Raises:
        UsageError: matplotlib is not installed, or ``path`` cannot be written.
        ClientError: the node cannot be reached.
    """
    try:
        import matplotlib  # noqa: F401  (optional dependency: the ``report`` extra)
    except ImportError:
        raise UsageError("the report needs matplotlib: pip install 'giaannd[report]'") from None
    page = render(gather(client))
    try:
        atomic_write_bytes(path, page.encode())
    except OSError as exc:
        raise UsageError(f"cannot write the report to {path}: {exc.strerror or exc}") from None
    return path
