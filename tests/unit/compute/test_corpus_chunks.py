"""corpus_chunks.py: a job's corpus uploaded GROUP_WINDOWS windows to a chunk, each window read back
from its group (the last group short), the same as uploaded one window to a chunk; emptied by
group. Registers are an in-memory dict (the CAS and read shapes of StorageClient)."""

import pytest

from giaannd.client.registers import ABSENT, CasOutcome, RegisterRead
from giaannd.compute.cluster_jobs.corpus_chunks import (
    GROUP_WINDOWS,
    GROUPED,
    UPLOADED,
    chunk_key,
    clear_windows,
    encode_texts,
    encode_window,
    read_texts,
    read_window,
    upload_windows,
)
from giaannd.model.tokens import load_bundled_corpus


class Registers:
    def __init__(self):
        self.values: dict[str, tuple[tuple[int, int, int], bytes]] = {}
        self.reads: list[str] = []

    async def cas(self, key, expect, value=b""):
        version, current = self.values.get(key, (ABSENT, b""))
        if expect is not None and expect != version:
            return CasOutcome(False, version, current)
        new = (version[0] + 1, 1, 1)
        self.values[key] = (new, value)
        return CasOutcome(True, new, value)

    async def read(self, key):
        self.reads.append(key)
        version, value = self.values.get(key, (ABSENT, b""))
        return RegisterRead(version, value, True)


@pytest.mark.asyncio
@pytest.mark.parametrize("group", [1, GROUP_WINDOWS])
async def test_windows_read_back_from_their_group_equal_the_corpus(group):
    k, corpus = 10, load_bundled_corpus(95)  # 10 windows, the last of 5 sentences
    regs = Registers()
    assert await upload_windows(regs.cas, "j", iter(corpus), k, (), group=group) == (10, 95)
    kind = GROUPED if group > 1 else UPLOADED
    assert len(regs.values) == -(-10 // group)  # one register per group (one part each)
    assert all(key.startswith(f"job/j/{kind}/") for key in regs.values)
    for w in range(10):
        assert await read_window(regs.read, "j", w, (), group=group, k=k) == corpus[w * k:(w + 1) * k]
    cleared = await clear_windows(regs.cas, regs.read, "j", 10, (), text=False, group=group)
    assert cleared == len(regs.values) and not any(v for _, v in regs.values.values())


@pytest.mark.asyncio
async def test_text_windows_read_back_from_their_group():
    texts = [f"sentence number {i}." for i in range(23)]
    regs = Registers()
    assert await upload_windows(regs.cas, "j", iter(texts), 4, (), encode_texts, group=GROUP_WINDOWS) == (6, 23)
    assert [await read_texts(regs.read, "j", w, (), group=GROUP_WINDOWS, k=4) for w in range(6)] == \
        [texts[i:i + 4] for i in range(0, 23, 4)]
    assert chunk_key("j", 1, 0, GROUPED) in regs.values  # windows 4 and 5


@pytest.mark.asyncio
@pytest.mark.parametrize("kind_group", [(GROUPED, GROUP_WINDOWS), (UPLOADED, 1)])
async def test_clear_windows_after_an_interrupted_run_empties_every_part(monkeypatch, kind_group):
    """A first run empties part 0 of a two-part chunk and then fails on part 1 (no quorum, all its
    attempts): the docstring's "a later run finishes". Part 0 holds the part count, so a later run
    that found it empty skipped the chunk and part 1 (a whole chunk's bytes on R storage nodes)
    stayed for good."""
    from giaannd.compute.cluster_jobs import corpus_chunks

    kind, group = kind_group
    corpus = load_bundled_corpus(8)
    largest = max(len(encode_window([s])[0]) for s in corpus)
    monkeypatch.setattr(corpus_chunks, "MAX_CHUNK_BYTES", largest)  # the window in several parts
    monkeypatch.setattr(corpus_chunks, "CHUNK_ATTEMPTS", 1)
    regs = Registers()
    assert await upload_windows(regs.cas, "j", iter(corpus), 8, (), group=group) == (1, 8)
    part1 = chunk_key("j", 0, 1, kind)
    assert part1 in regs.values and len(regs.values) > 2

    class NoQuorum(Exception):
        pass

    cas = regs.cas

    async def failing(key, expect, value=b""):
        if key == part1:
            raise NoQuorum(key)
        return await cas(key, expect, value)

    with pytest.raises(NoQuorum):
        await clear_windows(failing, regs.read, "j", 1, (NoQuorum,), text=False, group=group)
    await clear_windows(regs.cas, regs.read, "j", 1, (NoQuorum,), text=False, group=group)
    left = sorted(key for key, (_, value) in regs.values.items() if value)
    assert left == []
