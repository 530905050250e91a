"""A cluster job's corpus in the storage cluster: one replicated chunk per window (issue 15 item 3).

Theory of operation
-------------------
The node that receives ``train start`` reads the corpus file once, in order, as a stream (never
whole: ``read_conllu`` yields a sentence at a time) and cuts it into windows of K sentences, stored
``GROUP_WINDOWS`` consecutive windows to a *group*: group ``g`` (windows ``[g * G, g * G + G)``) is
stored in registers ``job/<id>/g/<g>/<part>`` (``chunk_key``): each part a msgpack ``Chunk`` of
whole sentences, at most ``MAX_CHUNK_BYTES``; part 0 says how many parts the group has. Each
register write is a CASPaxos round (two round trips, an fsync per acceptor per phase) and so is
emptying it, which made the chunks most of a window's register traffic at the default K = 32
(issue 15): a group divides both by G, and a node reads a group once for the windows of a lease
(leases are runs of consecutive windows; window_runner.py keeps the last groups read). Jobs
created before groups (``ClusterSpec.group`` 1) keep one window per register,
``job/<id>/w/<w>/<part>``; the new key prefix makes a node that knows no groups fail such a job
(chunk missing) instead of reading a group as one window. A K = 32 CoNLL-U group is 25-50 KB and
a K = 256 one 0.2-0.4 MB, so one or two parts are the rule. Each part is written by
compare-and-set on an absent register (``cas_register(key, ABSENT, ...)``), i.e. with a majority
of the key's R owners durable before
the write returns: the chunk survives the loss of the node that uploaded it, and of a minority of
its owners. A write whose answer is lost is sent again; finding the register already holding the
same bytes counts as done (the uploads are idempotent).

When the job ends, the node whose write ended it empties every chunk (``clear_windows``: a CAS of
empty bytes; a register key is never deleted, but its bytes stop counting against the storage
node's register store, ``MAX_REGISTER_STORE_BYTES``), so finished jobs do not fill it.

The job row is written only after every chunk is (cluster_train.py): a job that exists always has
its whole corpus in the cluster. A compute node reads only the windows it leases
(``read_window``), one window at a time, so its memory holds ``parallel`` windows, whatever the
corpus size.

Why registers and not model rows: they are the storage cluster's only replicated byte values with
a read of the latest write, and a window needs nothing more (one write, a few reads). The cost is
a CASPaxos round per part (two round trips, one fsync per acceptor).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final, TypeVar

import msgspec

from giaannd.client.registers import ABSENT, CasOutcome, RegisterRead, Version
from giaannd.errors import CorruptDataError, InputError
from giaannd.model.tokens import TaggedSentence, Token
from giaannd.protocol import MAX_REGISTER_VALUE_BYTES

__all__ = [
    "GROUPED",
    "GROUP_WINDOWS",
    "MAX_CHUNK_BYTES",
    "TAGGED",
    "UPLOADED",
    "UPLOAD_CONCURRENCY",
    "ChunkMissing",
    "chunk_key",
    "clear_windows",
    "encode_texts",
    "encode_window",
    "read_texts",
    "read_window",
    "store_window",
    "upload_windows",
]

#: Windows per uploaded chunk of a new job (module docstring): the upload's and the clean-up's
#: register rounds per window and the chunk reads are divided by it; the default lease-windows, so
#: a lease reads one group. More: larger reads where a lease does not cover its group (a
#: take-over, a shard boundary, lease-windows below it); a group of K = 256 CoNLL-U windows is
#: 0.2-0.4 MB, a few register parts.
GROUP_WINDOWS: Final = 4
#: Bytes of one chunk part: the register cap less room for the msgpack header.
MAX_CHUNK_BYTES: Final = MAX_REGISTER_VALUE_BYTES - 1024
#: Chunk writes in flight while uploading: enough to hide a CAS round trip per part, few enough
#: that the uploader holds a handful of windows at a time (memory bounded by this x K sentences).
UPLOAD_CONCURRENCY: Final = 8
#: Attempts per chunk write or read whose answer was lost (no quorum, a timeout) before giving up.
CHUNK_ATTEMPTS: Final = 6

_Tok = tuple[str, str, str, str]
_T = TypeVar("_T")


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    """One part of a window: ``parts`` (in part 0; the others repeat it) and whole sentences."""

    parts: int
    sentences: list[msgspec.Raw] | list[list[_Tok]]


class _ChunkIn(msgspec.Struct, frozen=True, array_like=True):
    parts: int
    sentences: list[list[_Tok]]


class _TextChunkIn(msgspec.Struct, frozen=True, array_like=True):
    parts: int
    sentences: list[str]


class _RawChunkIn(msgspec.Struct, frozen=True, array_like=True):
    """A chunk whose sentences are left encoded (a group's: only one window's are decoded)."""

    parts: int
    sentences: list[msgspec.Raw]


class ChunkMissing(CorruptDataError):
    """A window's chunk is absent or unreadable: the job's corpus is not in the cluster."""

    reason = "corpus_chunk_missing"


_ENC: Final = msgspec.msgpack.Encoder()
_DEC: Final = msgspec.msgpack.Decoder(_ChunkIn)
_TEXT_DEC: Final = msgspec.msgpack.Decoder(_TextChunkIn)
_RAW_DEC: Final = msgspec.msgpack.Decoder(_RawChunkIn)
_SENTENCE_DEC: Final = msgspec.msgpack.Decoder(list[_Tok])
_TEXT_SENTENCE_DEC: Final = msgspec.msgpack.Decoder(str)
#: Key prefixes: ``w`` the windows as uploaded (tagged, or sentence texts), ``t`` text windows
#: tagged by the flag pass (tagging.py).
UPLOADED: Final = "w"
TAGGED: Final = "t"
#: Key prefix of the groups of windows as uploaded (module docstring).
GROUPED: Final = "g"


def chunk_key(job_id: str, window: int, part: int, kind: str = UPLOADED) -> str:
    """The register of ``part`` of ``window`` (of group ``window`` for ``GROUPED``)."""
    return f"job/{job_id}/{kind}/{window}/{part}"


def _uploaded(window: int, group: int) -> tuple[str, int, int]:
    """(key kind, its index, the window's place in it) of an uploaded window."""
    return (GROUPED, window // group, window % group) if group > 1 else (UPLOADED, window, 0)


def encode_window(sentences: list[TaggedSentence]) -> list[bytes]:
    """The parts of one window (each at most ``MAX_CHUNK_BYTES``), sentences whole and in order.

    Raises:
        InputError: one sentence alone is over ``MAX_CHUNK_BYTES``.
    """
    return _pack([msgspec.Raw(_ENC.encode([(t.form, t.lemma, t.upos, t.xpos) for t in s])) for s in sentences])


def encode_texts(texts: list[str]) -> list[bytes]:
    """``encode_window`` of a window of sentence texts (a text corpus, tagged by the flag pass)."""
    return _pack([msgspec.Raw(_ENC.encode(t)) for t in texts])


def _pack(encoded: list[msgspec.Raw]) -> list[bytes]:
    groups: list[list[msgspec.Raw]] = [[]]
    size = 0
    for raw in encoded:
        n = len(raw)
        if n > MAX_CHUNK_BYTES:
            raise InputError(f"a sentence of {len(raw)} bytes does not fit a corpus chunk ({MAX_CHUNK_BYTES})")
        if groups[-1] and size + n > MAX_CHUNK_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(raw)
        size += n
    return [_ENC.encode(Chunk(len(groups), g)) for g in groups]


def _decode(data: bytes, key: str, decoder: msgspec.msgpack.Decoder[Any] = _DEC) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ChunkMissing(f"register {key} does not hold a corpus chunk: {exc}") from None


Cas = Callable[[str, Version | None, bytes], Awaitable[CasOutcome]]
Read = Callable[[str], Awaitable[RegisterRead]]


async def _retried(call: Callable[[], Awaitable[_T]], failures: tuple[type[BaseException], ...]) -> _T:
    for attempt in range(CHUNK_ATTEMPTS):
        try:
            return await call()
        except failures:
            if attempt + 1 == CHUNK_ATTEMPTS:
                raise
            await asyncio.sleep(0.05 * 2 ** attempt)
    raise AssertionError("unreachable")


async def _put(cas: Cas, key: str, data: bytes, failures: tuple[type[BaseException], ...]) -> None:
    out = await _retried(lambda: cas(key, ABSENT, data), failures)
    if not out.ok and out.value != data:
        raise ChunkMissing(f"register {key} already holds other bytes (a job id used twice?)")


async def upload_windows(cas: Cas, job_id: str, sentences: Iterator[Any], k: int,
                         failures: tuple[type[BaseException], ...],
                         encode: Callable[[list[Any]], list[bytes]] = encode_window,
                         on_window: Callable[[int, int], None] | None = None, *,
                         group: int = 1) -> tuple[int, int]:
    """Cut ``sentences`` (tagged, or texts with ``encode_texts``) into windows of ``k`` and store
    them ``group`` windows to a chunk (module docstring); the iterator is advanced in a thread, a
    chunk at a time. Returns (windows, sentences). ``on_window(windows, sentences)``: after each
    chunk is queued.

    Raises:
        InputError: a sentence too large for a chunk; what ``sentences`` raises (a corpus format
            error); ``failures`` of a chunk write after ``CHUNK_ATTEMPTS``.
    """
    def next_chunk() -> tuple[int, list[bytes]]:
        window = list(itertools.islice(sentences, k * group))
        return len(window), encode(window) if window else []

    kind = GROUPED if group > 1 else UPLOADED
    inflight: set[asyncio.Task[None]] = set()
    index = windows = total = 0
    try:
        while True:
            n, parts = await asyncio.to_thread(next_chunk)
            if not n:
                break
            for part, data in enumerate(parts):
                while len(inflight) >= UPLOAD_CONCURRENCY:
                    done, _ = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    inflight -= done
                    for task in done:
                        task.result()
                inflight.add(asyncio.get_running_loop().create_task(
                    _put(cas, chunk_key(job_id, index, part, kind), data, failures)))
            index, windows, total = index + 1, windows + -(-n // k), total + n
            if on_window is not None:
                on_window(windows, total)
        while inflight:
            done, _ = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            inflight -= done
            for task in done:
                task.result()
    finally:
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
    return windows, total


async def read_window(read: Read, job_id: str, window: int, failures: tuple[type[BaseException], ...],
                      kind: str = UPLOADED, *, missing_ok: bool = False, group: int = 1,
                      k: int = 0) -> list[TaggedSentence] | None:
    """Window ``window``'s tagged sentences, read part by part (``kind``: as uploaded, ``group``
    windows of ``k`` sentences to a chunk, or tagged by the flag pass, one window to a chunk);
    None if absent and ``missing_ok``.

    Raises:
        ChunkMissing: a part is absent (``missing_ok``: a part after the first) or not a chunk;
            ``failures`` after ``CHUNK_ATTEMPTS``.
    """
    if kind == UPLOADED and group > 1:
        raws = await _read_group(read, job_id, window, failures, group, k)
        return [tuple(Token(*t) for t in _decode(raw, job_id, _SENTENCE_DEC)) for raw in raws]
    chunks = await _read_parts(read, job_id, window, failures, kind, _DEC, missing_ok)
    if chunks is None:
        return None
    return [tuple(Token(*t) for t in s) for c in chunks for s in c.sentences]


async def _read_group(read: Read, job_id: str, window: int, failures: tuple[type[BaseException], ...],
                      group: int, k: int) -> list[msgspec.Raw]:
    """The encoded sentences of ``window`` in its group's chunk."""
    kind, index, slot = _uploaded(window, group)
    chunks = await _read_parts(read, job_id, index, failures, kind, _RAW_DEC, False)
    assert chunks is not None
    raws = [raw for c in chunks for raw in c.sentences][slot * k:(slot + 1) * k]
    if not raws:
        raise ChunkMissing(f"group {index} of job {job_id} has no window {window}")
    return raws


async def read_texts(read: Read, job_id: str, window: int, failures: tuple[type[BaseException], ...], *,
                     group: int = 1, k: int = 0) -> list[str]:
    """Window ``window``'s sentence texts (a text corpus). Raises: as ``read_window``."""
    if group > 1:
        return [_decode(raw, job_id, _TEXT_SENTENCE_DEC) for raw in
                await _read_group(read, job_id, window, failures, group, k)]
    chunks = await _read_parts(read, job_id, window, failures, UPLOADED, _TEXT_DEC, False)
    assert chunks is not None
    return [t for c in chunks for t in c.sentences]


async def _read_parts(read: Read, job_id: str, window: int, failures: tuple[type[BaseException], ...], kind: str,
                      decoder: msgspec.msgpack.Decoder[Any], missing_ok: bool) -> list[Any] | None:
    out: list[Any] = []
    parts, part = 1, 0
    while part < parts:
        key = chunk_key(job_id, window, part, kind)
        got = await _retried(lambda key=key: read(key), failures)  # type: ignore[misc]
        if not got.version[0] or not got.value:
            if missing_ok and part == 0:
                return None
            raise ChunkMissing(f"corpus chunk {key} is absent or emptied")
        chunk = _decode(got.value, key, decoder)
        parts = chunk.parts
        out.append(chunk)
        part += 1
    return out


async def store_window(cas: Cas, job_id: str, window: int, sentences: list[TaggedSentence],
                       failures: tuple[type[BaseException], ...], kind: str = TAGGED) -> None:
    """Store a window's tagged sentences (the flag pass, for a text corpus): create-if-absent, and a
    chunk already holding the same bytes (a redo) is fine.

    Raises:
        ChunkMissing: a part holds other bytes; ``failures`` after ``CHUNK_ATTEMPTS``.
    """
    for part, data in enumerate(encode_window(sentences)):
        await _put(cas, chunk_key(job_id, window, part, kind), data, failures)


async def clear_windows(cas: Cas, read: Read, job_id: str, windows: int,
                        failures: tuple[type[BaseException], ...], *, text: bool = True, group: int = 1) -> int:
    """Empty the chunks of windows ``[0, windows)`` (module docstring; uploaded ``group`` windows
    to a chunk); returns the parts emptied. An absent chunk is skipped; a part emptied by an
    earlier run costs one read of the next part (the count is in part 0), so a second run
    finishes what a failed one left and stays cheap. ``text``: the job's windows are texts, so the
    flag pass stored tagged chunks too (a CoNLL-U job has none: looking for them cost a quorum
    read per window).

    Raises:
        ``failures`` after ``CHUNK_ATTEMPTS`` on one part (the rest stays: a later run finishes).
    """
    kind, chunks, _ = _uploaded(windows - 1, group) if windows else (UPLOADED, -1, 0)
    targets = [(kind, i) for i in range(chunks + 1)] + ([(TAGGED, w) for w in range(windows)] if text else [])

    async def clear(kind: str, index: int) -> int:
        cleared = 0
        parts, part = 1, 0
        while part < parts:
            key = chunk_key(job_id, index, part, kind)
            got = await _retried(lambda key=key: read(key), failures)  # type: ignore[misc]
            if got.value:
                # the part count is the chunk's first field, whichever the chunk's kind
                parts = max(parts, int(msgspec.msgpack.decode(got.value, type=tuple[int, Any])[0]))
                out = await _retried(lambda key=key, got=got: cas(key, got.version, b""),  # type: ignore[misc]
                                     failures)
                cleared += out.ok
            elif got.version[0]:
                # emptied by an earlier run, which may have stopped before the parts after it: the
                # count was in part 0, so look at the next part, until one never written
                parts = max(parts, part + 2)
            part += 1
        return cleared

    total = 0
    for start in range(0, len(targets), UPLOAD_CONCURRENCY):
        total += sum(await asyncio.gather(*(clear(*t) for t in targets[start:start + UPLOAD_CONCURRENCY])))
    return total
