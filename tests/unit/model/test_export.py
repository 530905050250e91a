import json
import os
from pathlib import Path

import pytest

from giaannd.model.export import SnapshotError, iter_jsonl, load_snapshot, save_snapshot, write_jsonl
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from giaannd.model.vocab import Vocabulary
from tests.oracle.sentences import synthetic_corpus, worked_example


def _vocab(sentences):
    v = Vocabulary()
    for s in sentences:
        for lemma in s.column_lemma:
            v.add_column(lemma)
        for t, w in enumerate(s.words):
            if not s.is_concept[t]:
                v.add_feature(w)
    return v


def test_export_jsonl_worked_example_lines():
    s = worked_example()
    store = RowStore.from_batch(train_batch([s]).rows)
    lines = [json.loads(x) for x in iter_jsonl(store, _vocab([s]))]
    assert len(lines) == store.num_entries == 41
    assert {"source_lemma": "cat", "source_word": "the", "source_prime": False, "segment": 8, "target_lemma": "cat",
            "target_word": "cat", "target_prime": True, "strength": 5.0} in lines
    assert {"source_lemma": "cat", "source_word": "on", "source_prime": False, "segment": 2, "target_lemma": "mat",
            "target_word": "the", "target_prime": False, "strength": 5.0} in lines
    dot = [x for x in lines if x["source_word"] == "the" and x["target_word"] == "."
           and x["source_lemma"] == "cat"]
    assert dot == [{"source_lemma": "cat", "source_word": "the", "source_prime": False, "segment": 2,
                    "target_lemma": "mat", "target_word": ".", "target_prime": False,
                    "strength": pytest.approx(10 / 7)}]


def test_export_jsonl_missing_vocab_is_a_clear_error(tmp_path):
    s = worked_example()
    store = RowStore.from_batch(train_batch([s]).rows)
    with pytest.raises(KeyError, match="not in the vocabulary"):
        write_jsonl(store, Vocabulary(), tmp_path / "x.jsonl")
    assert not list(tmp_path.iterdir())  # nothing half-written
    n = write_jsonl(store, _vocab([s]), tmp_path / "x.jsonl")
    assert n == 41 and len((tmp_path / "x.jsonl").read_text().splitlines()) == 41


def test_snapshot_round_trip(tmp_path):
    store = RowStore.from_batch(train_batch(synthetic_corpus(50, seed=7)).rows)
    size = save_snapshot(store, tmp_path / "s.bin")
    assert size == (tmp_path / "s.bin").stat().st_size
    back = load_snapshot(tmp_path / "s.bin")
    assert back.keys() == store.keys()
    assert all(back.get(k).equals(r) for k, r in store)
    empty = tmp_path / "e.bin"
    save_snapshot(RowStore(), empty)
    assert len(load_snapshot(empty)) == 0


@pytest.mark.parametrize("where", ["magic", "header", "payload", "truncate", "extend"])
def test_snapshot_corruption_is_detected(tmp_path, where):
    path = tmp_path / "s.bin"
    save_snapshot(RowStore.from_batch(train_batch(synthetic_corpus(10, seed=1)).rows), path)
    data = bytearray(path.read_bytes())
    if where == "magic":
        data[0] ^= 0xFF
    elif where == "header":
        data[20] ^= 0x01  # row count
    elif where == "payload":
        data[len(data) // 2] ^= 0x10
    elif where == "truncate":
        data = data[:-3]
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="s.bin"):
        load_snapshot(path)


def test_snapshot_rejects_other_version(tmp_path):
    import struct

    import xxhash

    path = tmp_path / "s.bin"
    save_snapshot(RowStore(), path)
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 99)
    data[40:48] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:40])))
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="version 99"):
        load_snapshot(path)


def _odd_vocab_batch():
    """Rows whose words need escaping (quotes, a ", " inside, non-ASCII), primes as sources and targets."""
    import numpy as np

    from giaannd.model.rows import RowBatch

    v = Vocabulary()
    cols = np.array([v.add_column(w) for w in ("cat", 'say "hi"', "café")], np.uint64)
    feats = np.array([v.add_feature(w) for w in ("a, b", "the", "naïve\\", "\u2028")] + [0], np.uint64)
    rng = np.random.default_rng(4)
    n = 400
    batch = RowBatch.from_entries(rng.choice(cols, n), rng.choice(feats, n), rng.integers(0, 9, n).astype(np.uint8),
                                  rng.choice(cols, n), rng.choice(feats, n),
                                  (rng.random(n) * 1e3).astype(np.float32) ** rng.choice([-3.0, 1.0, 4.0], n))
    return v, batch


def test_jsonl_bytes_are_the_lines_of_iter_jsonl_in_chunks_cut_inside_rows():
    from giaannd.compute.cluster_export import entry_window
    from giaannd.model.export import JsonlFragments, jsonl_bytes

    v, batch = _odd_vocab_batch()
    ref = "".join(x + "\n" for x in iter_jsonl(RowStore.from_batch(batch), v)).encode()
    assert jsonl_bytes(batch, v) == ref
    frag = JsonlFragments(v)
    parts = [jsonl_bytes(entry_window(batch, a, min(a + 37, batch.num_entries)), v, frag)
             for a in range(0, batch.num_entries, 37)]
    assert b"".join(parts) == ref


def test_jsonl_writer_commits_whole_or_nothing(tmp_path):
    from giaannd.model.export import JsonlWriter

    v, batch = _odd_vocab_batch()
    out = tmp_path / "e.jsonl"
    w = JsonlWriter(out)
    w.write(batch, v)
    with pytest.raises(KeyError, match="not in the vocabulary"):
        w.write(batch, Vocabulary())
    w.abort()
    assert list(tmp_path.iterdir()) == []
    w = JsonlWriter(out)
    w.write(batch, v)
    w.commit()
    assert w.lines == batch.num_entries and [p.name for p in tmp_path.iterdir()] == ["e.jsonl"]


def test_a_streamed_export_cut_mid_line_or_damaged_is_rejected_by_the_reader(tmp_path):
    """JSONL has no checksum: what a reader can refuse is a last line cut short or a damaged line,
    named by file and line; a file whole at its path is the writer's rename (JsonlWriter)."""
    from giaannd.model.export import JsonlWriter, read_jsonl

    v, batch = _odd_vocab_batch()
    out = tmp_path / "e.jsonl"
    w = JsonlWriter(out)
    w.write(batch, v)
    w.commit()
    data = out.read_bytes()
    assert len(list(read_jsonl(out))) == batch.num_entries
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: len(data) - 10])
    with pytest.raises(ValueError, match=rf"cut.jsonl:{batch.num_entries}: not an export entry"):
        list(read_jsonl(cut))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(data.replace(b'"segment": ', b'"segment": x', 1))
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not an export entry"):
        list(read_jsonl(bad))


def _drops_pages(tmp_path) -> bool:
    """Whether this file system frees a file's synced pages on POSIX_FADV_DONTNEED (tmpfs does not)."""
    from tools.bench.page_cache import cached_share

    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(1 << 16))
    with probe.open("rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    share = cached_share(probe)
    probe.unlink()
    return share is not None and share < 0.5


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise")
def test_an_export_leaves_the_page_cache_as_it_goes_and_when_committed(tmp_path, monkeypatch):
    """An export (up to ~9x the model's row bytes) must not evict a colocated storage node's
    cached snapshot: the writer syncs and drops what it wrote every DROP_EVERY_BYTES, and the rest
    at commit; the file's bytes are those of a plain write."""
    from giaannd.model import export as export_mod
    from giaannd.model.export import JsonlFragments, JsonlWriter, jsonl_bytes
    from tools.bench.page_cache import cached_share

    if not _drops_pages(tmp_path):
        pytest.skip("this file system keeps a file's pages in memory (tmpfs)")
    monkeypatch.setattr(export_mod, "DROP_EVERY_BYTES", 1 << 14)
    v, batch = _odd_vocab_batch()
    frag = JsonlFragments(v)
    out = tmp_path / "e.jsonl"
    w = JsonlWriter(out)
    chunks = 0
    while w._written < 1 << 17:  # noqa: SLF001 - several drops' worth
        w.write(batch, v)
        chunks += 1
    share = cached_share(Path(w._tmp))  # noqa: SLF001
    assert share is not None and share < 0.5  # dropped as it went
    w.commit()
    share = cached_share(out)
    assert share is not None and share < 0.05  # and the rest at commit
    assert out.read_bytes() == jsonl_bytes(batch, v, frag) * chunks


def test_jsonl_bytes_are_the_same_whatever_the_slices_they_are_formatted_in(monkeypatch):
    from giaannd.model import export as export_module

    v, batch = _odd_vocab_batch()
    whole = export_module.jsonl_bytes(batch, v)
    for step in (1, 7, 399, 400, 401):
        monkeypatch.setattr(export_module, "JSONL_SLICE_LINES", step)
        assert export_module.jsonl_bytes(batch, v) == whole


def test_jsonl_bytes_formats_an_export_chunk_in_slices_the_interpreter_can_switch_between():
    """The lines of a chunk were one ``"".join(map(str.format, ...))``: C from the first line to
    the last, so the thread formatting an export chunk (65,536 lines, ~80 ms) held the GIL
    throughout and a compute node's event loop waited as long (the loop watch's stall logs named
    ``jsonl_bytes``; another thread's longest wait for the GIL during the call 63 ms, now 8). Now
    no C call formats more than a slice: counted with a profile hook, which sees each C call."""
    import sys

    import numpy as np

    from giaannd.model.export import jsonl_bytes
    from giaannd.model.rows import RowBatch

    v = Vocabulary()
    cols = np.array([v.add_column(f"noun{i}") for i in range(300)], np.uint64)
    feats = np.array([v.add_feature(f"word{i}") for i in range(3000)], np.uint64)
    rng = np.random.default_rng(5)
    n = 65_536
    batch = RowBatch.from_entries(rng.choice(cols, n), rng.choice(feats, n), rng.integers(0, 9, n).astype(np.uint8),
                                  rng.choice(cols, n), rng.choice(feats, n), rng.random(n).astype(np.float32))
    joins = 0

    def hook(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal joins
        if event == "c_call" and getattr(arg, "__name__", "") == "join" and getattr(arg, "__self__", None) == "":
            joins += 1

    sys.setprofile(hook)
    try:
        text = jsonl_bytes(batch, v)
    finally:
        sys.setprofile(None)
    assert text.count(b"\n") == n
    assert joins >= n // 4096  # before: one join of all 65,536 lines
