"""A storage node's read replies are checked by the client (client/row_parts.py, remote_vocab.py): a
reply holding rows or vocabulary entries that were not asked for, or rows past its own cursor, is
the node's ``ProtocolViolation`` (booked as its failure, the rows read from the next owner), never
rows silently added to the result nor a bare ``ValueError`` out of ``read_rows``."""

import asyncio

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.reads import read_replicated
from giaannd.client.remote_vocab import get_vocab
from giaannd.client.row_parts import read_chunked
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.ids import column_id, feature_id
from giaannd.model.rows import RowBatch
from giaannd.ramp import RampTracker


def rows(*keys):
    """One entry per row ``(column, feature)``, keys sorted (a canonical batch)."""
    keys = sorted(keys)
    n = len(keys)
    return RowBatch.from_entries([c for c, _ in keys], [f for _, f in keys], np.zeros(n), np.arange(n),
                                 np.zeros(n), np.ones(n))


def chunked(call, keys):
    cols = np.array([c for c, _ in keys], np.uint64)
    feats = np.array([f for _, f in keys], np.uint64)
    return read_chunked(call, "s0", cols, feats, chunk_entries=10, epoch="")


def test_read_chunked_row_not_asked_for_is_a_protocol_violation():
    async def call(node, msg, bulk=(), timeout_s=None):
        return p.RowsReply(), rows((5, 5), (6, 0)).buffers()  # (6, 0) was not asked for

    with pytest.raises(p.ProtocolViolation, match="not asked for"):
        asyncio.run(chunked(call, [(5, 5)]))


def test_read_chunked_row_past_the_cursor_is_a_protocol_violation():
    # 'more' after (5, 5) but the reply holds (7, 0) as well: asked again, it would come twice
    async def call(node, msg, bulk=(), timeout_s=None):
        asked = list(zip(bulk[0].tolist(), bulk[1].tolist()))
        if (5, 5) in asked:
            return p.RowsReply(True, 5, 5), rows((5, 5), (7, 0)).buffers()
        return p.RowsReply(), rows(*asked).buffers()

    with pytest.raises(p.ProtocolViolation, match="after its cursor"):
        asyncio.run(chunked(call, [(5, 5), (7, 0)]))


def test_read_chunked_large_row_also_in_the_batch_is_a_protocol_violation():
    one = rows((5, 5))
    entries = [one.segment, one.target_column, one.target_feature, one.strength]

    async def call(node, msg, bulk=(), timeout_s=None, *, recv_into=None):
        if isinstance(msg, p.ReadRows):  # (5, 5) both whole in the batch and listed to read by parts
            return p.RowsReply(large=[(5, 5, 1, 1, 0)]), one.buffers()
        part = [e[msg.offset :] for e in entries]
        for dst, src in zip(recv_into or (), part):  # received in place, as the transport does
            dst[...] = src
        return p.RowPart(1, 1, 0, msg.offset), list(recv_into) if recv_into else part

    with pytest.raises(p.ProtocolViolation, match="both in the reply and listed"):
        asyncio.run(chunked(call, [(5, 5)]))


def _view(n=3):
    t = ClusterView(replicas=3)
    t.set_members([StorageNode(f"n{i}", f"mem://n{i}") for i in range(n)])
    return t


@pytest.mark.asyncio
async def test_read_replicated_node_answering_rows_it_was_not_asked_fails_over():
    """One node answers every read with a row of another node's share as well: its rows are read
    from their next owner and the result holds exactly the rows asked for."""
    t = _view()
    cols = np.arange(1, 40, dtype=np.uint64)
    feats = np.zeros(cols.size, np.uint64)
    bad = t.names[0]
    first = t.placement.owner_indices(cols)[:, 0]
    other = int(cols[first != 0][0])  # a row another node is asked for first

    async def call(node, msg, bulk=(), timeout_s=None):
        asked = list(zip(bulk[0].tolist(), bulk[1].tolist()))
        extra = [(other, 0)] if node == bad and (other, 0) not in asked else []
        return p.RowsReply(), rows(*asked, *extra).buffers()

    async def read_from(node, c, f, timeout_s, busy_ok=False):
        return await read_chunked(call, node, c, f, chunk_entries=10, epoch="", busy_ok=busy_ok)

    got = await read_replicated(t, read_from, RampTracker(0.0), lambda: 0.0, cols, feats)
    assert got.row_column.tolist() == cols.tolist()


@pytest.mark.asyncio
async def test_get_vocab_entry_not_asked_for_or_not_hashing_to_its_id_fails_over():
    t = _view()
    word, noun = "cat", "dog"
    asked = [(1, feature_id(word))]
    owners = t.placement.owners(feature_id(word))
    replies = {
        owners[0]: [(1, feature_id(word), word), (0, column_id(noun), noun)],  # an entry not asked for
        owners[1]: [(1, feature_id(word), "cow")],  # the text does not hash to the id
    }

    async def call(node, msg, bulk=(), timeout_s=None):
        return p.VocabReply(replies.get(node, [(1, feature_id(word), word)])), []

    assert await get_vocab(t, call, asked) == {(1, feature_id(word)): word}
    replies[owners[2]] = [(1, feature_id(word), "cow")]
    replies[owners[0]] = [(1, feature_id(word), "cow")]
    with pytest.raises(Exception, match="unreadable"):
        await get_vocab(t, call, asked)


@pytest.mark.asyncio
async def test_read_replicated_a_key_asked_twice_across_request_chunks_is_read_once():
    """More keys than one request carries (``MAX_READ_ROWS``) with a key asked twice: the two asks
    must not land in two requests whose answers both hold the row (``join_disjoint`` refused that
    with a bare ValueError)."""
    t = _view(1)
    cols = np.arange(1, p.MAX_READ_ROWS + 1, dtype=np.uint64)
    cols = np.concatenate([cols, cols[:1]])  # the first key again, after a full request's worth
    feats = np.zeros(cols.size, np.uint64)

    async def read_from(node, c, f, timeout_s, busy_ok=False):
        keys = sorted(set(zip(c.tolist(), f.tolist())))
        n = len(keys)
        return RowBatch(np.array([k[0] for k in keys], np.uint64), np.array([k[1] for k in keys], np.uint64),
                        np.arange(n + 1, dtype=np.int64), np.zeros(n, np.uint8), np.zeros(n, np.uint64),
                        np.zeros(n, np.uint64), np.ones(n, np.float32))

    got = await read_replicated(t, read_from, RampTracker(0.0), lambda: 0.0, cols, feats)
    assert got.num_rows == p.MAX_READ_ROWS
