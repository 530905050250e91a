"""Planning one batch apply against the column store's rows: pure, so a refused batch changes nothing.

Theory of operation
-------------------
``ColumnStore.prepare`` (column_store.py) plans a whole batch before it changes anything, so it
can refuse the batch as a whole (capacity, validation) and the commit cannot fail half-way.
``plan_apply`` sorts the batch's non-empty delta rows into three paths, by what is stored:

- **new** rows (nothing stored under the key; only with ``install_new_rows``): a canonical delta
  row *is* the merged row, so no merge is planned; the commit lays out their regions straight from
  the batch (``regions.install_regions``).
- **large** stored rows (at least ``large_row_entries`` entries): one ``row_merge.plan_merge``
  each (keys packed once, O(m log n) search, in place when nothing is new).
- every other row (stored small rows, and new rows without ``install_new_rows``): one vectorised
  ``row_merge.plan_batch`` over all of them, their stored entries gathered by
  ``regions.rows_of_regions``.

The plan records the exact growth (``new_entries`` entries, ``new_slots`` rows), which the store
turns into bytes against its capacity. It reads the slots and never writes them: a plan is valid
only until the store next changes (``PreparedApply.version``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.storage.engine.regions import EMPTY_REGION, ENTRY_BYTES, RowSlot, rows_of_regions
from giaannd.storage.engine.row_merge import BatchPlan, MergePlan, plan_batch, plan_merge

__all__ = ["ApplyPlan", "plan_apply"]


@dataclass(frozen=True, slots=True)
class ApplyPlan:
    """A planned batch: its batch-merged rows' keys and current slots (batch order) and their plan
    (None: no such rows), the stored rows merged one at a time, the rows installed new, and the
    growth in entries and in rows."""

    keys: list[RowKey]
    slots: list[RowSlot | None]
    plan: BatchPlan | None
    #: stored rows of at least ``large_row_entries``: (key, delta, slot, per-row plan)
    large: list[tuple[RowKey, Row, RowSlot, MergePlan]]
    #: rows not stored yet (``install_new_rows``): their keys and their delta rows, as one batch
    new_keys: list[RowKey]
    new_rows: RowBatch | None
    #: entries the commit adds, and rows it creates
    new_entries: int
    new_slots: int


def plan_apply(slots: Mapping[RowKey, RowSlot], batch: RowBatch, large_row_entries: int,
               install_new_rows: bool) -> ApplyPlan:
    """Plan merging the canonical ``batch`` into the rows ``slots`` (module docstring)."""
    lengths = np.diff(batch.offsets)
    keys = list(zip(batch.row_column.tolist(), batch.row_feature.tolist()))
    get = slots.get
    found = [get(k) for k in keys]
    stored = np.fromiter((0 if slot is None else slot.region.shape[0] for slot in found), np.int64,
                         count=len(found)) // ENTRY_BYTES  # 0: not stored (a stored row is never empty)
    large_rows = (stored >= large_row_entries) & (stored > 0)
    small = (lengths > 0) & ~large_rows  # empty delta rows change nothing
    new_keys: list[RowKey] = []
    new_rows: RowBatch | None = None
    new_entries = new_slots = 0
    if install_new_rows:
        new = small & (stored == 0)
        if new.any():
            new_rows = batch if new.all() else batch.select_rows(new)
            new_keys = keys if new.all() else [k for k, keep in zip(keys, new.tolist()) if keep]
            new_entries += new_rows.num_entries
            new_slots += len(new_keys)
            small &= ~new
    large: list[tuple[RowKey, Row, RowSlot, MergePlan]] = []
    for i in np.flatnonzero(large_rows & (lengths > 0)).tolist():
        slot, delta = found[i], batch.row(i)
        assert slot is not None
        row_plan = plan_merge(slot.row, delta)
        large.append((keys[i], delta, slot, row_plan))
        new_entries += row_plan.new_count
    if not small.any():
        return ApplyPlan([], [], None, large, new_keys, new_rows, new_entries, new_slots)
    if not small.all():
        batch = batch.select_rows(small)
        keys = [k for k, keep in zip(keys, small.tolist()) if keep]
        found = [slot for slot, keep in zip(found, small.tolist()) if keep]
    base_offsets, base = rows_of_regions([slot.region if slot is not None else EMPTY_REGION for slot in found])
    plan = plan_batch(
        base_offsets, base, batch.offsets,
        Row(batch.segment, batch.target_column, batch.target_feature, batch.strength),
    )
    new_entries += int(plan.new_count.sum())
    new_slots += sum(slot is None for slot in found)
    return ApplyPlan(keys, found, plan, large, new_keys, new_rows, new_entries, new_slots)
