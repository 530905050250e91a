"""The read-only HTML status page served at ``/``: a live look at the node and its cluster.

Theory of operation
-------------------
The page is one self-contained document (no external scripts, styles or fonts: it must work on a
host with no route out, through an SSH tunnel). The server renders the node facts and the member
table into it (what a client without JavaScript sees, in ``<noscript>``), plus a small inline
script that polls the admin API's read-only JSON views at once and then every ``POLL_MS``, and
redraws each section from its view:

========  ========================  ==================================================================
section   polls                     shows
========  ========================  ==================================================================
node      ``GET /v1/status``        name, cluster, version, state, uptime, roles; services' health
members   ``GET /v1/members``       the member table (status, roles, data plane, capacity)
ring      ``GET /v1/ring``          per placement member: live, weight, owner counts of the sampled
                                    column ids (as a replica, as primary); epoch, R, ring digest
storage   ``GET /v1/ring/usage``    per storage node: RAM used of capacity and disk (its files; file
                                    system use) as bars, rows, entries, errors
jobs      ``GET /v1/jobs``          this node's training jobs: progress bar and figures
========  ========================  ==================================================================

Those views, like the page, need no token from a loopback address unless
``admin.metrics-require-token`` is set (giaannd/operations.py ``public_on_loopback``), so the
script sends none. A view this node does not serve (``/v1/jobs`` on a storage node, 404) is shown
as such; a failed poll leaves the last data up and says so. The script writes data into the DOM
with ``textContent`` only, never as HTML, since member names and errors come from other nodes.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["POLL_MS", "render_status_page"]

#: How often the page polls its views. Each poll is five small local requests (one ``GetUsage``
#: per storage node behind ``/v1/ring/usage``), cheap at this rate for a handful of viewers.
POLL_MS: Final = 2000


def _table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "<p>none</p>"
    keys = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(row.get(k, '')))}</td>" for k in keys) + "</tr>"
        for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_status_page(status: Mapping[str, Any], members: Sequence[Mapping[str, Any]] | None
                       ) -> str:
    """The page (module docstring) for the node whose ``/v1/status`` document is ``status``;
    ``members`` is the member table, None when membership does not run here."""
    node = {k: v for k, v in status.items() if not isinstance(v, (dict, list))}
    services = [{"service": name, **health}
                for name, health in dict(status.get("services", {})).items()]
    member_html = _table(members) if members is not None else "<p>membership not running</p>"
    name = html.escape(str(status.get("node_name", "")))
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>giaannd {name}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>giaannd <span id='node-name'>{name}</span></h1>"
        "<span id='updated' data-polls='0'>loading…</span></header>"
        f"<noscript><h2>Node</h2>{_table([node])}<h2>Services</h2>{_table(services)}"
        f"<h2>Members</h2>{member_html}<p>(JavaScript is off: this page does not refresh)</p></noscript>"
        + "".join(f"<section id='{sid}' data-state='loading'><h2>{title}</h2><p class='note'></p>"
                  "<div class='body'></div></section>" for sid, title in _SECTIONS)
        + f"<script>const POLL_MS = {POLL_MS};\n{_SCRIPT}</script></body></html>"
    )


_SECTIONS: Final = (("node", "Node"), ("members", "Members"), ("ring", "Ring: owner counts"),
                    ("storage", "Storage fill"), ("jobs", "Training jobs"))

_CSS: Final = """
body{font-family:system-ui,sans-serif;margin:1em 2em;color:#222;background:#fafafa}
header{display:flex;align-items:baseline;gap:2em}h1{margin:.2em 0}h2{margin:1.2em 0 .3em;font-size:1.15em}
#updated{color:#666;font-size:.9em}.note{color:#a33;margin:.2em 0;font-size:.9em}
table{border-collapse:collapse;background:#fff}
td,th{padding:3px 10px;text-align:left;border-bottom:1px solid #e4e4e4;white-space:nowrap}
th{background:#eef1f5;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.bar{display:inline-block;width:140px;height:12px;background:#e6e6e6;border-radius:3px;
vertical-align:middle;margin-right:6px;overflow:hidden}.bar>span{display:block;height:100%;background:#4a8}
.bar.warn>span{background:#d94}.ok{color:#283}.bad{color:#b22}.dim{color:#888}
"""

# The client half. Plain ES2017, no libraries. Each section has a loader (its URL) and a drawer
# that builds rows of cells; a cell is text, or {bar: fraction, text} for a bar with a label.
_SCRIPT: Final = r"""
"use strict";
let polls = 0;
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function bytes(n) {
  if (n === undefined || n === null) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}
const frac = (a, b) => (b > 0 ? Math.min(1, a / b) : 0);
const pct = f => (100 * f).toFixed(1) + "%";
const secs = s => (s >= 3600 ? (s / 3600).toFixed(1) + " h" : s >= 60 ? (s / 60).toFixed(1) + " min"
                   : s.toFixed(s >= 10 ? 0 : 1) + " s");
// A bar for a share (plain) or for a fill (amber past 90%).
const bar = (f, text) => ({bar: f, text: text});
const fill = (f, text) => ({bar: f, text: text, warn: f > 0.9});
const mark = (text, cls) => ({text: text, cls: cls});
const yesno = v => mark(v ? "yes" : "no", v ? "ok" : "bad");

// A table of rows of cells (a header row unless head is null); a cell is a value, a
// mark(text, class), or a bar/fill(fraction, label).
function table(head, rows) {
  const t = el("table");
  if (head) {
    const top = el("tr");
    head.forEach(h => top.appendChild(el("th", h)));
    t.appendChild(top);
  }
  for (const r of rows) {
    const tr = el("tr");
    for (const c of r) {
      if (c !== null && typeof c === "object" && "bar" in c) {
        const td = el("td"), b = el("span", null, c.warn ? "bar warn" : "bar"), part = el("span");
        part.style.width = (100 * c.bar).toFixed(1) + "%";
        b.appendChild(part);
        td.appendChild(b);
        td.appendChild(el("span", c.text));
        tr.appendChild(td);
      } else if (c !== null && typeof c === "object") {
        tr.appendChild(el("td", c.text, c.cls));
      } else {
        tr.appendChild(el("td", c, typeof c === "number" ? "num" : undefined));
      }
    }
    t.appendChild(tr);
  }
  return t;
}

// Each drawer turns its view's JSON into [a DOM node, how many rows it shows].
const DRAW = {
  node(d) {
    const roles = Object.entries(d.roles || {}).map(([r, s]) => r + ": " + s).join(", ");
    const facts = [["node", d.node_name], ["cluster", d.cluster], ["version", d.version],
                   ["state", d.state], ["uptime", secs(d.uptime_s || 0)], ["roles", roles || "none"]];
    const flat = h => Object.entries(h || {}).filter(([, v]) => v === null || typeof v !== "object")
      .map(([k, v]) => k + "=" + v).join("  ");
    const services = Object.entries(d.services || {}).map(([name, h]) => [name, flat(h)]);
    const box = el("div");
    box.appendChild(table(null, facts));
    box.appendChild(el("h3", "Services"));
    box.appendChild(table(["service", "health"], services));
    return [box, facts.length];
  },
  members(d) {
    const m = d.members || [];
    return [table(["name", "status", "roles", "gossip", "data plane", "capacity", "full", "incarnation"],
      m.map(r => [r.name, mark(r.status, r.status === "alive" ? "ok" : "bad"), r.roles, r.addr,
                  r.data_plane, r.capacity_gib + " GiB", r.full ? "yes" : "no", r.incarnation])), m.length];
  },
  ring(d) {
    const m = d.members || [], n = d.owner_sample || 1, box = el("div");
    box.appendChild(el("p", "epoch " + (d.epoch || "-") + ", R = " + d.replicas + ", ring digest "
      + (d.ring ? d.ring.digest : "-") + "; counts of " + n + " sampled column ids", "dim"));
    box.appendChild(table(["node", "live", "weight", "owner of", "primary of"],
      m.map(r => [r.name, yesno(r.live), r.weight, bar(r.owned / n, r.owned + " (" + pct(r.owned / n) + ")"),
                  bar(r.primary / n, r.primary + " (" + pct(r.primary / n) + ")")])));
    return [box, m.length];
  },
  storage(d) {
    const m = d.nodes || [];
    const row = r => {
      if (r.error) return [r.name, yesno(r.live), "-", "-", "-", "-", "-", "-", mark(r.error, "bad")];
      const fsUsed = r.disk_total_bytes - r.disk_free_bytes;
      return [r.name, yesno(r.live),
              fill(frac(r.used_bytes, r.capacity_bytes), bytes(r.used_bytes) + " / " + bytes(r.capacity_bytes)),
              bytes(r.disk_bytes),
              r.disk_total_bytes ? fill(frac(fsUsed, r.disk_total_bytes), bytes(fsUsed) + " / "
                                       + bytes(r.disk_total_bytes)) : "-",
              r.rows, r.entries, r.full ? "yes" : "no", ""];
    };
    return [table(["node", "live", "RAM used / capacity", "disk: files", "disk: file system", "rows",
                   "entries", "full", "error"], m.map(row)), m.length];
  },
  jobs(d) {
    const m = d.jobs || [], node = document.getElementById("node-name").textContent;
    const state = s => mark(s, s === "failed" ? "bad" : s === "succeeded" ? "ok" : "");
    return [table(["node", "job", "state", "progress", "sentences/s", "trained", "skipped", "batches",
                   "sent", "elapsed", "error"],
      m.map(j => [node, j.job_id, state(j.state),
                  bar(frac(j.done, j.total), j.done + "/" + j.total + " (" + pct(frac(j.done, j.total)) + ")"),
                  j.sentences_per_s, j.trained, j.skipped, j.batches, bytes(j.bytes_sent),
                  secs(j.elapsed_s || 0), j.error || ""])), m.length];
  },
};
const URL_OF = {node: "/v1/status", members: "/v1/members", ring: "/v1/ring", storage: "/v1/ring/usage",
                jobs: "/v1/jobs"};

async function refresh(id) {
  const sec = document.getElementById(id), note = sec.querySelector(".note");
  try {
    const r = await fetch(URL_OF[id], {cache: "no-store", credentials: "same-origin"});
    const d = await r.json().catch(() => ({}));
    if (r.status === 404) {  // e.g. /v1/jobs on a node without the compute role
      sec.dataset.state = "not-served";
      note.textContent = d.error || "not served on this node";
      sec.querySelector(".body").replaceChildren();
      return;
    }
    if (!r.ok) throw new Error(d.error || "HTTP " + r.status);
    const [node, count] = DRAW[id](d);
    sec.querySelector(".body").replaceChildren(node);
    sec.dataset.state = "ok";
    sec.dataset.rows = count;
    note.textContent = "";
  } catch (e) {
    sec.dataset.state = "error";
    note.textContent = "refresh failed: " + e.message + " (showing the last data)";
  }
}

async function poll() {
  await Promise.all(Object.keys(URL_OF).map(refresh));
  polls += 1;
  const u = document.getElementById("updated");
  u.dataset.polls = polls;
  u.textContent = "updated " + new Date().toLocaleTimeString() + ", every " + POLL_MS / 1000 + " s";
  setTimeout(poll, POLL_MS);
}
poll();
"""
