"""The row engine: many sorted rows in shared numpy arrays, updated by add in O(delta · log).

Used by the core's in-memory ``RowStore`` (giaannd/model/rowstore.py) and designed for storage's
``ColumnStore`` (engine.py explains the design). numpy, with compiled kernels for the searches and
merges (jit.py): no I/O, no threads, nothing from the rest of giaannd.
"""

from giaannd.rowengine.engine import DEFAULT_BASE_RATIO, DEFAULT_FANOUT, EngineStats, Entries, RowEngine
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.rowengine.search import lower_bound

__all__ = ["DEFAULT_BASE_RATIO", "DEFAULT_FANOUT", "EngineStats", "Entries", "KeyIndex", "RowEngine", "lower_bound"]
