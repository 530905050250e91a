"""The verify messages' digest version (streaming/stream.py): old and new peers decode each other,
and a receiver hashes the version asked for when it knows it, else the newest below it."""

import msgspec

from giaannd.storage.engine.row_digest import ROWS_DIGEST_VERSIONS
from giaannd.storage.streaming.sender import digest_version_for
from giaannd.storage.streaming.stream import StreamReply, StreamRequest, StreamVerify, VerifyReply


class OldStreamVerify(msgspec.Struct, frozen=True, tag=3):
    """StreamVerify before ``digest_version`` (a receiver of the previous version)."""

    stream_id: int
    combined: bool = False


class OldVerifyReply(msgspec.Struct, frozen=True, tag=66):
    """VerifyReply before ``digest_version``."""


def test_old_receiver_reads_a_new_request_and_its_reply_reads_as_version_1():
    new = msgspec.msgpack.encode(StreamVerify(5, combined=True, digest_version=2))
    old = msgspec.msgpack.decode(new, type=OldStreamVerify)  # the unknown field is ignored
    assert old == OldStreamVerify(5, True)
    reply = msgspec.msgpack.decode(msgspec.msgpack.encode(OldVerifyReply()), type=StreamReply)
    assert isinstance(reply, VerifyReply) and reply.digest_version == 1


def test_old_sender_request_reads_as_version_1():
    req = msgspec.msgpack.decode(msgspec.msgpack.encode(OldStreamVerify(5, True)), type=StreamRequest)
    assert isinstance(req, StreamVerify) and req.digest_version == 1


def test_receiver_hashes_the_version_asked_for_or_the_newest_below():
    assert ROWS_DIGEST_VERSIONS == (1, 2)
    assert [digest_version_for(v) for v in (0, 1, 2, 3, 99)] == [1, 1, 2, 2, 2]
