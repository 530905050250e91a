"""``cluster_export.column_contents`` (issue 21): a column's rows as arrays of the export's words,
without storage (the read is given; the vocabulary lookup is a fake)."""

from __future__ import annotations

import asyncio

import numpy as np

from giaannd.client.column_rows import ColumnRead
from giaannd.compute.cluster_export import column_contents
from giaannd.compute.flags import flags_batch
from giaannd.model.rows import RowBatch
from giaannd.model.vocab import Vocabulary


def test_column_contents_words_primes_and_missing_ids() -> None:
    vocab = Vocabulary()
    water, fire = vocab.add_column("water"), vocab.add_column("fire")
    the, hot = vocab.add_feature("the"), vocab.add_feature("hot")
    unknown = 0xABC  # a feature id no vocabulary holds: printed as <column:feature>
    # rows (water, 0) and (water, the); entries sorted by (segment, target column, target feature)
    rows = RowBatch.from_entries(
        np.array([water, water, water, water], np.uint64), np.array([0, 0, the, the], np.uint64),
        np.array([1, 2, 0, 3], np.uint8), np.array([fire, water, fire, fire], np.uint64),
        np.array([0, hot, unknown, hot], np.uint64), np.array([1.5, 2.0, 0.25, 3.0], np.float32))
    asked: list[list[tuple[int, int]]] = []

    async def get_vocab(keys):
        asked.append(list(keys))
        return {}

    doc = asyncio.run(column_contents(ColumnRead(water, "a", rows, 9, True), vocab, get_vocab))
    assert doc is not None
    assert asked == [[(1, unknown)]]  # only the id this node lacks is looked up in storage
    row_order = [0, the]  # key order: the prime neuron's row first (feature ids are never 0)
    assert rows.row_feature.tolist() == row_order
    words = {0: "water", the: "the"}
    assert doc["column"] == water and doc["word"] == "water"
    assert doc["total_entries"] == 9 and doc["truncated"] is True
    assert doc["features"] == {"feature": [words[f] for f in row_order], "prime": [f == 0 for f in row_order],
                               "entries": [2, 2]}
    e = doc["entries"]
    assert e["source_feature"] == [words[f] for f in rows.entry_source_feature().tolist()]
    assert e["source_prime"] == [f == 0 for f in rows.entry_source_feature().tolist()]
    assert e["segment"] == rows.segment.tolist()
    names = {water: "water", fire: "fire"}
    assert e["target_column"] == [names[c] for c in rows.target_column.tolist()]
    expect = {0: None, hot: "hot", unknown: None}
    assert e["target_feature"] == [
        names[c] if f == 0 else expect[f] or f"<{c:x}:{f:x}>"
        for c, f in zip(rows.target_column.tolist(), rows.target_feature.tolist())]
    assert e["target_prime"] == [f == 0 for f in rows.target_feature.tolist()]
    assert e["strength"] == rows.strength.astype(float).tolist()


def test_column_contents_of_no_rows_or_only_the_flag_row_is_none() -> None:
    async def get_vocab(keys):
        raise AssertionError("nothing to look up")

    vocab = Vocabulary()
    assert asyncio.run(column_contents(ColumnRead(5, "a", RowBatch.empty(), 0, False), vocab, get_vocab)) is None
    flags = flags_batch([7, 9])
    assert asyncio.run(column_contents(ColumnRead(0, "a", flags, 2, False), vocab, get_vocab)) is None
