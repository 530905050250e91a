"""cluster_jobs/uploads.py (pure): the upload row's encoding and when an upload may be adopted."""

import msgspec
import pytest

from giaannd.compute.cluster_jobs.uploads import (
    UploadIndex,
    UploadRow,
    UploadWatch,
    decode_upload,
    decode_uploads,
    encode,
)
from giaannd.errors import CorruptDataError

ROW = UploadRow("j", "c0", "/corpora/a.conllu", "a.conllu", 20, False)


def test_upload_rows_round_trip_and_damage_is_named():
    assert decode_upload(encode(ROW)) == ROW
    assert decode_uploads(b"") == UploadIndex() and decode_uploads(encode(UploadIndex(("j",)))).jobs == ("j",)
    with pytest.raises(CorruptDataError, match="upload row"):
        decode_upload(b"\x01")


@pytest.mark.parametrize(("reads", "want"), [
    ([(0.0, ROW), (0.5, ROW)], False),                                   # not stale for lease_s yet
    ([(0.0, ROW), (1.0, ROW)], True),                                    # same beats for lease_s
    ([(0.0, ROW), (0.9, msgspec.structs.replace(ROW, beats=1)), (1.5, msgspec.structs.replace(ROW, beats=1))],
     False),                                                             # renewed at 0.9: stale from 0.9
    ([(0.0, ROW), (2.0, UploadRow("j", "c1", ROW.path, ROW.name, 20, False))], False),  # adopted: new holder
    ([(0.0, UploadRow("j", "c0", "", "", 1, False, state="failed")), (5.0,
      UploadRow("j", "c0", "", "", 1, False, state="failed"))], False),  # ended: never adopted
])
def test_upload_watch_expiry(reads, want):
    watch = UploadWatch(lease_s=1.0)
    got = [watch.expired(t, row) for t, row in reads]
    assert got[-1] == want and not any(got[:-1])
