"""Sans-IO frame codec: fixed header + msgpack control body + raw bulk buffers.

Frame layout (little endian, see docs/transport.md)::

    offset size field
    0      2    magic      b"GP"
    2      1    version    FRAME_VERSION (the framing itself; the protocol version is negotiated)
    3      1    flags      bit 0 FLAG_OUT_OF_BAND: the bulk bytes travel elsewhere (UCX)
    4      4    body_len   u32, <= MAX_BODY_BYTES
    8      2    nbufs      u16, <= MAX_BUFFERS_PER_FRAME
    10     2    reserved   0
    12     8    bulk_len   u64, bytes of bulk that follow the body (0 if out of band)
    20     body_len        msgpack of one ``peers.wire.Message``
    ...    bulk_len        the buffers of the message's ``bulk`` specs, back to back

Lengths come first and are checked before anything is allocated (UCX truncation is silent for the
sender, and a hostile length must never allocate). The body's ``BufferSpec`` list must agree with
the header (count, total bytes) and each spec with itself (dtype × shape = nbytes).

The decoder mirrors ``asyncio.BufferedProtocol``: ``get_buffer()`` returns where the next bytes
should be written, ``buffer_updated(n)`` says how many arrived and returns complete frames. While a
frame's bulk is being received, ``get_buffer()`` returns a slice of the *destination* buffer the
``allocate`` callback chose (a pooled buffer, or the caller's tensor), so the kernel writes straight
into it: no copy between wire and tensor. Only bytes that arrive in the same read as the header (at
most ``STAGING_BYTES``) are copied once out of the staging buffer.

A body is never allocated ahead of its bytes: one larger than the staging buffer is received in
chunks of at most ``BODY_CHUNK_BYTES``, each allocated when the previous one is full, so a header
that announces 16 MiB and sends nothing more costs one chunk, not 16 MiB. ``max_body_bytes`` can be
lowered below ``MAX_BODY_BYTES`` (the session does so until the handshake has authenticated the
peer), and ``stepwise`` makes the decoder return after each frame, so that its owner can change the
limit (or its allocator's state) between a handshake frame and the frame that follows it in the
same read; ``more()`` then decodes what is still buffered.

The hot path (``whole``, once the owner sets ``deliver``): a read that holds exactly one small
request or response — header, body and at most one inline buffer whose spec ``validate_spec``
accepted before (accepted specs without a checksum are remembered) — is decoded in one call and
handed to ``deliver(message, buffers)``, with no ``Frame``, list or state machine round; a buffer
that has not fully arrived continues in place and completes there. Anything else is declined
untouched and takes the general path above. After a frame too large for one read, the next read
at a frame boundary asks for that frame's header and body only, so that a frame of the same kind
has its bulk read straight into its destination rather than copied out of staging.

Everything that affects decoding lives in this file. It does no I/O, logging or timing.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np
import xxhash

from peers import wire
from peers.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAGIC",
    "FRAME_VERSION",
    "HEADER",
    "HEADER_BYTES",
    "FLAG_OUT_OF_BAND",
    "MAX_BODY_BYTES",
    "MAX_BUFFERS_PER_FRAME",
    "MAX_BUFFER_BYTES",
    "MAX_BULK_BYTES_PER_FRAME",
    "STAGING_BYTES",
    "BODY_CHUNK_BYTES",
    "Frame",
    "Allocate",
    "FrameDecoder",
    "encode_frame",
    "spec_for",
    "device_spec",
    "is_device_buffer",
    "as_bytes_view",
    "checksum",
    "validate_spec",
    "verify_checksums",
]

MAGIC: Final = b"GP"
FRAME_VERSION: Final = 1
HEADER: Final = struct.Struct("<2sBBIHHQ")
HEADER_BYTES: Final = HEADER.size  # 20
FLAG_OUT_OF_BAND: Final = 0x01
_KNOWN_FLAGS: Final = FLAG_OUT_OF_BAND

#: Control bodies are small (ids, specs, an app payload such as a list of row keys). 16 MiB bounds a
#: hostile length while leaving room for a large key list; h11 bounds headers the same way.
MAX_BODY_BYTES: Final = 16 * 2**20
#: A request carrying more buffers than this is a bug or an attack; rows travel as a few buffers.
MAX_BUFFERS_PER_FRAME: Final = 4096
#: One buffer; larger data (snapshots) is streamed in chunks by the caller.
MAX_BUFFER_BYTES: Final = 2 * 2**30
#: All bulk bytes of one frame.
MAX_BULK_BYTES_PER_FRAME: Final = 4 * 2**30
#: Size of the staging buffer used while reading headers and bodies (one socket read).
STAGING_BYTES: Final = 64 * 2**10
#: Bodies larger than the staging buffer are received in chunks of at most this size, each allocated
#: only once the previous one is full: memory follows the bytes that arrived (plus one chunk), not
#: the length a header claims. 1 MiB keeps the chunk count of a 16 MiB body at 16 (one join copy).
BODY_CHUNK_BYTES: Final = 1 * 2**20


def checksum(view: memoryview) -> int:
    """xxh3-64 of a buffer's bytes (≈ memory bandwidth; measured in tools/bench/transport.py)."""
    return xxhash.xxh3_64_intdigest(view)


def as_bytes_view(buf: Any) -> memoryview:
    """A flat byte view (sharing memory) of a numpy array, torch CPU tensor or buffer object.

    Raises:
        LocalProtocolError: the object is not C-contiguous or exposes no buffer.
    """
    if hasattr(buf, "numpy") and hasattr(buf, "is_contiguous"):  # torch.Tensor, without importing torch
        if not buf.is_contiguous():
            raise LocalProtocolError("bulk tensors must be contiguous")
        import torch  # already imported by whoever made the tensor

        flat = buf.detach().reshape(-1)
        buf = (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()  # shares memory
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise LocalProtocolError("bulk arrays must be C-contiguous")
        return buf.reshape(-1).view(np.uint8).data if buf.size else memoryview(bytearray())
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise LocalProtocolError(f"bulk buffer {type(buf).__name__} has no buffer protocol") from exc
    if not view.c_contiguous:
        raise LocalProtocolError("bulk buffers must be C-contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def is_device_buffer(buf: Any) -> bool:
    """True for GPU memory (a CUDA tensor or any ``__cuda_array_interface__`` object)."""
    return hasattr(buf, "__cuda_array_interface__")


def device_spec(buf: Any) -> wire.BufferSpec:
    """Describe a CUDA tensor/array without touching its memory (no checksum: it is on the GPU).

    Raises:
        LocalProtocolError: unsupported dtype, non-contiguous, or over ``MAX_BUFFER_BYTES``.
    """
    iface = buf.__cuda_array_interface__
    dtype = np.dtype(iface["typestr"]).str
    shape = tuple(int(d) for d in iface["shape"])
    strides = iface.get("strides")
    if strides is not None:
        expected, step = [], np.dtype(dtype).itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if tuple(strides) != tuple(reversed(expected)):
            raise LocalProtocolError("bulk device arrays must be C-contiguous")
    if dtype not in wire.DTYPES:
        raise LocalProtocolError(f"dtype {dtype} is not allowed on the wire")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes > MAX_BUFFER_BYTES:
        raise LocalProtocolError(f"buffer of {nbytes} bytes exceeds MAX_BUFFER_BYTES")
    return wire.BufferSpec(dtype, shape, nbytes, None)


#: numpy dtype → its wire spelling, for the dtypes the wire allows.
_WIRE_DTYPES: Final = {np.dtype(name): name for name in wire.DTYPES}


def spec_for(buf: object, *, with_checksum: bool = False) -> tuple[wire.BufferSpec, memoryview]:
    """Describe a numpy array / torch CPU tensor / bytes-like for sending (host memory only).

    Raises:
        LocalProtocolError: unsupported dtype, non-contiguous, over ``MAX_BUFFER_BYTES``, or a
            device buffer (use ``device_spec``; only the ucx bulk path carries those).
    """
    arr: np.ndarray
    if type(buf) is np.ndarray:  # the hot case first: no attribute probing (a failed hasattr
        # costs an exception inside) — an ndarray is never device memory
        wire_dtype = _WIRE_DTYPES.get(buf.dtype)  # a dict hit, not ``dtype.str`` (builds a string)
        if wire_dtype is not None and buf.flags.c_contiguous and buf.nbytes <= MAX_BUFFER_BYTES:
            view = buf.data.cast("B") if buf.size else memoryview(b"")
            digest = checksum(view) if with_checksum else None
            return wire.BufferSpec(wire_dtype, buf.shape, buf.nbytes, digest), view
        arr = buf  # refused below, with the reason
    elif is_device_buffer(buf):
        raise LocalProtocolError("CUDA buffers can only travel on the ucx bulk path")
    elif hasattr(buf, "numpy") and hasattr(buf, "is_contiguous"):  # a torch CPU tensor: shares memory
        arr = buf.detach().numpy()  # type: ignore[attr-defined]
    elif isinstance(buf, np.ndarray):
        arr = buf
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
    dtype = arr.dtype.str
    if dtype not in wire.DTYPES:
        raise LocalProtocolError(f"dtype {dtype} is not allowed on the wire")
    if not arr.flags.c_contiguous:
        raise LocalProtocolError("bulk arrays must be C-contiguous")
    if arr.nbytes > MAX_BUFFER_BYTES:
        raise LocalProtocolError(f"buffer of {arr.nbytes} bytes exceeds MAX_BUFFER_BYTES")
    # a flat byte view sharing memory (C-contiguous was checked, so the cast is valid)
    view = arr.data.cast("B") if arr.size else memoryview(b"")
    digest = checksum(view) if with_checksum else None
    return wire.BufferSpec(dtype, arr.shape, arr.nbytes, digest), view


def verify_checksums(specs: Sequence[wire.BufferSpec], buffers: Sequence[memoryview]) -> None:
    """Check received buffers against the checksums their specs carry (None = not computed).

    Raises:
        RemoteProtocolError: a mismatch (reason ``checksum``).
    """
    for spec, buf in zip(specs, buffers):
        if spec.checksum is not None and checksum(buf) != spec.checksum:
            raise RemoteProtocolError("bulk checksum mismatch", reason="checksum")


#: Bytes per element of every wire dtype (``"<f4"`` → 4), looked up once per received buffer.
_ITEMSIZE: Final = {dtype: int(dtype[2:]) for dtype in wire.DTYPES}


#: Specs (without a checksum) that passed ``validate_spec``: a peer sends the same few shapes again
#: and again, and a dict hit is cheaper than the checks. Bounded: cleared when full.
_VALID_SPECS: Final[dict[wire.BufferSpec, None]] = {}
_VALID_SPECS_MAX: Final = 1024


def validate_spec(spec: wire.BufferSpec) -> None:
    """Check one descriptor is self-consistent before anything is allocated for it.

    Raises:
        RemoteProtocolError: unknown dtype, too many dims, negative dims, nbytes ≠ dtype × shape,
            or an empty shape whose other dims numpy cannot represent.
    """
    try:
        if spec in _VALID_SPECS:
            return
        cache = spec.checksum is None  # a checksum differs per payload: it would only churn the cache
    except TypeError:  # a spec built in code with a list shape (decoded ones have tuples)
        cache = False
    itemsize = _ITEMSIZE.get(spec.dtype)
    if itemsize is None:
        raise RemoteProtocolError(f"dtype {spec.dtype!r} not allowed", reason="bad_spec")
    shape = spec.shape
    if len(shape) > wire.MAX_NDIM or (min(shape) < 0 if shape else False):
        raise RemoteProtocolError(f"bad shape {spec.shape}", reason="bad_spec")
    if math.prod(shape) * itemsize != spec.nbytes:
        raise RemoteProtocolError(f"nbytes {spec.nbytes} ≠ dtype × shape", reason="bad_spec")
    if spec.nbytes > MAX_BUFFER_BYTES:
        raise RemoteProtocolError(f"buffer of {spec.nbytes} bytes over limit", reason="oversize")
    if not spec.nbytes and shape and math.prod(d for d in shape if d) * itemsize > MAX_BUFFER_BYTES:
        # an empty array whose other dimensions numpy cannot represent (``np.empty`` of the shape
        # raises ValueError: "Maximum allowed dimension exceeded" / "array is too big")
        raise RemoteProtocolError(f"bad shape {spec.shape}", reason="bad_spec")
    if cache:
        if len(_VALID_SPECS) >= _VALID_SPECS_MAX:
            _VALID_SPECS.clear()
        _VALID_SPECS[spec] = None


#: Bound once (``wire.encode`` is the same msgpack encoding, one Python call deeper).
_encode: Final = msgspec.msgpack.Encoder().encode
_HEADER_PACK: Final = HEADER.pack
_HEADER_UNPACK: Final = HEADER.unpack_from


def encode_frame(
    message: wire.Message, buffers: Sequence[memoryview] = (), *, out_of_band: bool = False
) -> list[bytes | memoryview]:
    """Frame a message and its bulk buffers as a list of parts for a vectored write.

    Raises:
        LocalProtocolError: a limit would be exceeded (we refuse to send what the peer must refuse).
    """
    body = _encode(message)
    if len(body) > MAX_BODY_BYTES:
        raise LocalProtocolError(f"control body of {len(body)} bytes exceeds MAX_BODY_BYTES")
    if not buffers:  # most frames: header and body only
        return [_HEADER_PACK(MAGIC, FRAME_VERSION, FLAG_OUT_OF_BAND if out_of_band else 0, len(body), 0, 0, 0) + body]
    if len(buffers) > MAX_BUFFERS_PER_FRAME:
        raise LocalProtocolError(f"{len(buffers)} buffers exceed MAX_BUFFERS_PER_FRAME")
    bulk_len = 0
    if not out_of_band:
        for b in buffers:  # a plain loop: cheaper than sum(generator) for the usual 1–3 buffers
            bulk_len += b.nbytes
    if bulk_len > MAX_BULK_BYTES_PER_FRAME:
        raise LocalProtocolError(f"{bulk_len} bulk bytes exceed MAX_BULK_BYTES_PER_FRAME")
    flags = FLAG_OUT_OF_BAND if out_of_band else 0
    header = HEADER.pack(MAGIC, FRAME_VERSION, flags, len(body), len(buffers), 0, bulk_len)
    parts: list[bytes | memoryview] = [header + body]
    if not out_of_band:
        for b in buffers:
            if b.nbytes:
                parts.append(b)
    return parts


@dataclass(slots=True)
class Frame:
    """One decoded frame. ``buffers`` are the destinations the allocator chose, now filled (or, for
    an out-of-band frame, still to be filled by the bulk channel)."""

    message: wire.Message
    buffers: list[memoryview]
    out_of_band: bool


#: Called once per frame with bulk, after the body is decoded and validated: returns one writable
#: byte view per spec, each exactly ``spec.nbytes`` long. May raise ``RemoteProtocolError`` (the
#: peer sent a response nobody waits for) or ``LocalProtocolError``.
Allocate = Callable[[wire.Message, Sequence[wire.BufferSpec]], list[memoryview]]

_HEADER, _BODY, _BULK = 0, 1, 2
#: The messages that may carry bulk (checked by exact type: wire's Structs are final).
_CARRIERS: Final = (wire.Request, wire.Response)
#: ``whole``'s decoders, one per carrier: ≈ 0.4 µs less per request than the union's decoder
#: (0.57 against 0.95 µs for a request with one buffer spec; 0.23 against 0.28 for a response).
_decode_request: Final = msgspec.msgpack.Decoder(wire.Request).decode
_decode_response: Final = msgspec.msgpack.Decoder(wire.Response).decode
_REQUEST_TAG: Final = wire.Request.__struct_config__.tag
_RESPONSE_TAG: Final = wire.Response.__struct_config__.tag


class FrameDecoder:
    """Incremental decoder; see the module docstring. After it raises, it is dead: close the link."""

    def __init__(self, allocate: Allocate, *, verify_checksums: bool = True,
                 max_body_bytes: int = MAX_BODY_BYTES, stepwise: bool = False) -> None:
        """Args:
            allocate: where a frame's bulk goes (see ``Allocate``).
            verify_checksums: check bulk buffers against the checksums their specs carry.
            max_body_bytes: bodies announced larger are refused (``oversize``) before anything is
                allocated; at most ``MAX_BODY_BYTES``. Settable between frames.
            stepwise: return after each complete frame; ``more()`` continues. Settable.
        """
        if not 0 <= max_body_bytes <= MAX_BODY_BYTES:
            raise ValueError(f"max_body_bytes must be in [0, {MAX_BODY_BYTES}]")
        self.allocate = allocate  # settable: where bulk goes
        self._verify = verify_checksums
        self.max_body_bytes = max_body_bytes
        self.stepwise = stepwise
        self._decode = wire.decoder().decode
        self._staging = bytearray(STAGING_BYTES)
        self._view = memoryview(self._staging)  # sliced, never copied, on the hot path
        self._staged = 0  # valid bytes at the start of _staging
        self._state = _HEADER
        self._body_len = 0
        self._flags = 0
        self._nbufs = 0
        self._bulk_len = 0
        # a body larger than the staging buffer: chunks allocated as its bytes arrive
        self._chunks: list[bytearray] = []
        self._chunk_filled = 0  # valid bytes in the last chunk
        self._big_filled = 0  # valid bytes in all chunks
        self._message: wire.Message | None = None
        self._specs: Sequence[wire.BufferSpec] = ()
        self._dests: list[memoryview] = []
        self._dest_index = 0
        self._dest_offset = 0
        self._checksums = False  # a spec of the current frame carries a checksum
        self._dead = False
        self.frames_decoded = 0
        self._head_hint = 0  # > 0: read this many bytes at the next frame boundary (``whole``)
        #: set by the owner once frames may be dispatched one by one: ``whole`` hands it the frames
        #: it completes (``deliver(message, buffers)``), without a ``Frame`` or a list
        self.deliver: Callable[[wire.Message, list[memoryview]], None] | None = None

    # -- the BufferedProtocol face ------------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next bytes from the link must be written (never empty). ``sizehint`` is
        ignored; it lets a ``BufferedProtocol`` use this method as its own ``get_buffer``."""
        if self._dead:
            raise LocalProtocolError("decoder used after an error")
        if self._state == _BULK:
            dest = self._dests[self._dest_index]
            return dest[self._dest_offset :]
        if self._chunks:
            return memoryview(self._chunks[-1])[self._chunk_filled :]
        if self._head_hint and not self._staged:  # (``whole``)
            return self._view[: self._head_hint]
        return self._view[self._staged :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last ``get_buffer()``; return completed frames.

        Raises:
            RemoteProtocolError: the bytes violate the framing (the decoder is then dead).
        """
        if self._state == _BULK:
            # the hot path while a large buffer streams in (one call per socket read): bytes
            # landed inside the current destination and complete nothing
            offset = self._dest_offset + nbytes
            if offset < self._dests[self._dest_index].nbytes:
                self._dest_offset = offset
                return []
        try:
            if self._state == _HEADER and not self._chunks:  # headers and small bodies: staging
                self._staged += nbytes
                frames: list[Frame] = []
                self._drain_staging(frames)
                return frames
            return self._advance(nbytes)
        except RemoteProtocolError:
            self._dead = True
            raise

    def whole(self, nbytes: int) -> bool:
        """The hot path of one small request or response per read (``deliver`` must be set):
        account for ``nbytes`` as ``buffer_updated`` would and return True when this read was one
        whole frame — header, body and at most one inline buffer, the buffer perhaps still partly
        to come — or the last bytes of such a buffer; the completed frame went to ``deliver``.
        Returns False, with nothing consumed, for anything else (several frames in one read, a
        frame cut before its body ends, two or more buffers, empty buffers, out of band,
        checksums, a spec not seen before, any error): ``buffer_updated(nbytes)`` then does the
        general, fully checked work.

        The checks are those of the general path: the header's limits, the body's spec count and
        total against the header, the spec itself (only specs that ``validate_spec`` accepted
        before take this path), the destination's size. The body is decoded by the decoder of
        the type its tag names (``Request`` or ``Response``); any other body is declined.
        """
        deliver = self.deliver
        assert deliver is not None
        if self._state == _BULK:  # the rest of a buffer whose frame is complete with these bytes
            dests = self._dests
            if len(dests) != 1 or self._checksums or self._dest_offset + nbytes != dests[0].nbytes:
                return False
            message = self._message
            assert message is not None
            self._message, self._specs, self._dests = None, (), []
            self._state = _HEADER
            self.frames_decoded += 1
            deliver(message, dests)
            return True
        if self._staged or self._chunks or nbytes < HEADER_BYTES or self.stepwise:
            return False
        magic, version, flags, body_len, nbufs, _reserved, bulk_len = _HEADER_UNPACK(self._staging, 0)
        end = HEADER_BYTES + body_len
        # a frame that cannot arrive in one read: the next one of its kind is read header and
        # body first, so that its bulk lands in place instead of being copied out of staging
        self._head_hint = end if end + bulk_len > STAGING_BYTES and nbufs == 1 else 0
        if (nbytes > end + bulk_len or nbytes < end or flags or nbufs > 1 or magic != MAGIC
                or version != FRAME_VERSION or body_len > self.max_body_bytes or nbufs != (bulk_len > 0)):
            return False
        view = self._view
        body = bytes(view[HEADER_BYTES:end])
        # the tag follows a fixarray's first byte: decoded by the decoder of that one type, which
        # checks the tag itself (a wrong guess fails and is declined: the union decoder decides)
        tag = body[1] if body_len > 1 else -1
        decode: Callable[[bytes], wire.Request | wire.Response]
        if tag == _REQUEST_TAG:
            decode = _decode_request
        elif tag == _RESPONSE_TAG:
            decode = _decode_response
        else:
            return False
        try:
            message = decode(body)
        except wire.DECODE_ERRORS:
            return False  # the general path raises the precise error
        specs = message.bulk
        if len(specs) != nbufs or message.bulk_via:
            return False
        if not nbufs:
            self.frames_decoded += 1
            deliver(message, [])
            return True
        spec = specs[0]
        if spec.nbytes != bulk_len or spec.checksum is not None or spec not in _VALID_SPECS:
            return False
        try:
            dests = self.allocate(message, specs)
        except RemoteProtocolError:
            self._dead = True
            raise
        if len(dests) != 1 or dests[0].nbytes != bulk_len:
            raise LocalProtocolError("allocator returned destinations of the wrong size")
        got = nbytes - end
        if got:
            dests[0][:got] = view[end:nbytes]
        if got < bulk_len:  # the rest lands straight in the destination (``get_buffer``)
            self._message, self._specs, self._dests = message, specs, dests
            self._dest_index, self._dest_offset = 0, got
            self._checksums = False
            self._state = _BULK
            return True
        self.frames_decoded += 1
        deliver(message, dests)
        return True

    def divert_response(self, req_id: int) -> bool:
        """The caller of request ``req_id`` gave up on it (a deadline, a cancellation) while its
        response's bulk is arriving into the caller's buffers (``allocate`` returned them): send
        the bytes still to come to scratch memory instead, so that nothing lands in those buffers
        after the caller was told it failed (it may use them again at once: a retry into the same
        memory). The frame still completes, to keep the stream in step, without its checksums
        checked (nobody takes its bytes). Returns whether that response was arriving.

        Only inline bulk: out-of-band bulk is received by its connection (``Connection``)."""
        message = self._message
        if self._state != _BULK or type(message) is not wire.Response or message.id != req_id:
            return False
        i = self._dest_index
        if i < len(self._dests):
            rest = [self._dests[i].nbytes - self._dest_offset] + [d.nbytes for d in self._dests[i + 1 :]]
            self._dests = self._dests[:i] + [np.empty(n, np.uint8).data for n in rest]
            self._dest_offset = 0
        self._checksums = False
        return True

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        """Convenience for tests and in-process links: copy ``data`` in through ``get_buffer``."""
        frames: list[Frame] = []
        view = memoryview(data).cast("B")
        while view.nbytes:
            target = self.get_buffer()
            n = min(target.nbytes, view.nbytes)
            target[:n] = view[:n]
            view = view[n:]
            frames.extend(self.buffer_updated(n))
        return frames

    def more(self) -> list[Frame]:
        """Frames still complete in the bytes already buffered (after a ``stepwise`` return).

        Raises:
            RemoteProtocolError: as ``buffer_updated``.
        """
        return self.buffer_updated(0)

    @property
    def idle(self) -> bool:
        """True between frames (no partial frame buffered): a clean place for EOF."""
        return self._state == _HEADER and self._staged == 0 and not self._chunks

    @property
    def buffered_bytes(self) -> int:
        """Bytes of memory the decoder holds for headers and bodies (not bulk destinations)."""
        return len(self._staging) + sum(len(c) for c in self._chunks)

    def close(self) -> None:
        """Drop every buffer (the link is gone); the decoder is dead afterwards."""
        self._dead = True
        self._staging = bytearray()
        self._view = memoryview(self._staging)
        self._staged = 0
        self._chunks = []
        self._message, self._specs, self._dests = None, (), []

    # -- internals --------------------------------------------------------------------------------

    def _advance(self, nbytes: int) -> list[Frame]:
        frames: list[Frame] = []
        if self._state == _BULK:
            self._dest_offset += nbytes
            self._finish_bulk_if_done(frames)
            return frames
        if self._chunks:
            self._chunk_filled += nbytes
            self._big_filled += nbytes
            if self._big_filled == self._body_len:
                self._on_body(self._take_chunks(), frames)
            elif self._chunk_filled == len(self._chunks[-1]):
                self._add_chunk()
            return frames
        self._staged += nbytes
        self._drain_staging(frames)
        return frames

    def _add_chunk(self) -> None:
        """Allocate the next chunk of a large body: never more than is still to come, ≤ 1 chunk."""
        size = min(BODY_CHUNK_BYTES, self._body_len - self._big_filled)
        self._chunks.append(bytearray(size))
        self._chunk_filled = 0

    def _take_chunks(self) -> bytes:
        chunks, self._chunks = self._chunks, []
        self._chunk_filled = self._big_filled = 0
        return b"".join(chunks)

    def _drain_staging(self, frames: list[Frame]) -> None:
        """Parse as many headers/bodies as the staging buffer holds; spill bulk into destinations."""
        pos = 0
        staged = self._staged
        buf = self._staging
        view = self._view  # slices of a memoryview share memory: each byte below is copied once
        while True:
            if self._state == _BULK:
                # bytes of this frame's bulk that arrived with its header: the one bounded copy
                dests = self._dests
                index, offset = self._dest_index, self._dest_offset
                while pos < staged and index < len(dests):
                    dest = dests[index]
                    n = min(dest.nbytes - offset, staged - pos)
                    if n:
                        dest[offset : offset + n] = view[pos : pos + n]
                        pos += n
                        offset += n
                    if offset >= dest.nbytes:
                        index += 1
                        offset = 0
                self._dest_index, self._dest_offset = index, offset
                self._finish_bulk_if_done(frames)  # also steps over empty buffers at the end
                if self._state == _BULK:
                    break
                continue
            if staged - pos < HEADER_BYTES:
                break
            if self.stepwise and frames:
                break  # one frame per call: the owner looks at it before the next is decoded
            magic, version, flags, body_len, nbufs, _reserved, bulk_len = _HEADER_UNPACK(buf, pos)
            if (magic != MAGIC or version != FRAME_VERSION or flags & ~_KNOWN_FLAGS
                    or body_len > self.max_body_bytes or nbufs > MAX_BUFFERS_PER_FRAME
                    or bulk_len > MAX_BULK_BYTES_PER_FRAME or (flags and bulk_len)):
                self._parse_header(buf, pos)  # raises the precise error
            self._flags, self._body_len, self._nbufs, self._bulk_len = flags, body_len, nbufs, bulk_len
            pos += HEADER_BYTES
            if self._body_len > STAGING_BYTES - HEADER_BYTES:
                # the staged part is < STAGING_BYTES ≤ BODY_CHUNK_BYTES: it fits the first chunk
                self._add_chunk()
                take = min(self._body_len, staged - pos)
                self._chunks[0][:take] = view[pos : pos + take]
                self._chunk_filled = self._big_filled = take
                pos += take
                if self._big_filled < self._body_len:
                    if self._chunk_filled == len(self._chunks[-1]):
                        self._add_chunk()
                    break
                self._on_body(self._take_chunks(), frames)
                continue
            if staged - pos < self._body_len:
                pos -= HEADER_BYTES  # wait for the whole body; re-parse the header then
                break
            # an immutable copy: decoded payloads (msgspec.Raw) are views of it, and the staging
            # buffer is reused by the next read
            end = pos + self._body_len
            self._on_body(bytes(view[pos:end]), frames)
            pos = end
            if self._state == _BULK and staged - pos >= self._bulk_len:
                # a small frame whose bulk arrived whole with its header (a 4 KiB request): each
                # buffer in one slice copy, the frame completed here, no state machine round
                for dest in self._dests:
                    end = pos + dest.nbytes
                    dest[:] = view[pos:end]
                    pos = end
                self._dest_index = len(self._dests)
                self._finish_bulk_if_done(frames)
        # keep the unconsumed tail at the front of the staging buffer
        rest = staged - pos
        if rest and pos:
            buf[:rest] = buf[pos:staged]
        self._staged = rest

    def _parse_header(self, buf: bytearray, pos: int) -> None:
        """Check a header and raise the error it deserves (the hot path checks them all at once)."""
        magic, version, flags, body_len, nbufs, _reserved, bulk_len = HEADER.unpack_from(buf, pos)
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad magic {magic!r}", reason="bad_magic")
        if version != FRAME_VERSION:
            raise RemoteProtocolError(f"unknown frame version {version}", reason="bad_version")
        if flags & ~_KNOWN_FLAGS:
            raise RemoteProtocolError(f"unknown frame flags {flags:#x}", reason="bad_flags")
        if body_len > self.max_body_bytes:
            raise RemoteProtocolError(f"body of {body_len} bytes over limit {self.max_body_bytes}",
                                      reason="oversize")
        if nbufs > MAX_BUFFERS_PER_FRAME:
            raise RemoteProtocolError(f"{nbufs} buffers over limit", reason="oversize")
        if bulk_len > MAX_BULK_BYTES_PER_FRAME:
            raise RemoteProtocolError(f"{bulk_len} bulk bytes over limit", reason="oversize")
        if flags & FLAG_OUT_OF_BAND and bulk_len:
            raise RemoteProtocolError("out-of-band frame with inline bulk", reason="bad_header")
        self._flags, self._body_len, self._nbufs, self._bulk_len = flags, body_len, nbufs, bulk_len

    def _on_body(self, body: bytes, frames: list[Frame]) -> None:
        try:
            message = self._decode(body)
        except wire.DECODE_ERRORS as exc:
            raise RemoteProtocolError(f"undecodable body: {exc}", reason="bad_body") from exc
        carries_bulk = type(message) in _CARRIERS
        if carries_bulk and not (message.bulk or self._nbufs or self._flags or self._bulk_len  # type: ignore[union-attr]
                                 or message.bulk_via):  # type: ignore[union-attr]
            frames.append(Frame(message, [], False))  # the common small request/response
            self.frames_decoded += 1
            return
        specs: Sequence[wire.BufferSpec] = message.bulk if carries_bulk else ()  # type: ignore[union-attr]
        if len(specs) != self._nbufs:
            raise RemoteProtocolError("buffer count differs from header", reason="bad_header")
        out_of_band = bool(self._flags & FLAG_OUT_OF_BAND)
        via = message.bulk_via if carries_bulk else wire.BULK_INLINE  # type: ignore[union-attr]
        if out_of_band != (via != wire.BULK_INLINE):
            raise RemoteProtocolError("bulk_via disagrees with header flags", reason="bad_header")
        if not specs:  # the common small frame: complete now, nothing to allocate or verify
            if self._bulk_len:
                raise RemoteProtocolError("bulk length differs from header", reason="bad_header")
            frames.append(Frame(message, [], out_of_band))
            self.frames_decoded += 1
            return
        total = 0
        checksums = False
        for spec in specs:
            validate_spec(spec)
            total += spec.nbytes
            if spec.checksum is not None:
                checksums = True
        self._checksums = checksums
        if not out_of_band and total != self._bulk_len:
            raise RemoteProtocolError("bulk length differs from header", reason="bad_header")
        if total > MAX_BULK_BYTES_PER_FRAME:
            raise RemoteProtocolError(f"{total} bulk bytes over limit", reason="oversize")
        dests = self.allocate(message, specs)
        if len(dests) != len(specs):
            raise LocalProtocolError("allocator returned destinations of the wrong size")
        for dest, spec in zip(dests, specs):
            if dest.nbytes != spec.nbytes:
                raise LocalProtocolError("allocator returned destinations of the wrong size")
        self._message, self._specs, self._dests = message, specs, dests
        self._dest_index = self._dest_offset = 0
        self._state = _BULK
        if out_of_band:
            self._complete(frames, out_of_band=True)
        elif not total:  # only empty buffers: nothing more to receive
            self._finish_bulk_if_done(frames)

    def _finish_bulk_if_done(self, frames: list[Frame]) -> None:
        while self._dest_index < len(self._dests):
            if self._dest_offset < self._dests[self._dest_index].nbytes:
                return
            self._dest_index += 1
            self._dest_offset = 0
        if self._verify and self._checksums:
            verify_checksums(self._specs, self._dests)
        assert self._message is not None
        frames.append(Frame(self._message, self._dests, False))
        self.frames_decoded += 1
        self._message, self._specs, self._dests = None, (), []
        self._state = _HEADER

    def _complete(self, frames: list[Frame], *, out_of_band: bool) -> None:
        assert self._message is not None
        frames.append(Frame(self._message, self._dests, out_of_band))
        self.frames_decoded += 1
        self._message, self._specs, self._dests = None, (), []
        self._state = _HEADER
