"""Model profiles in a cluster: a training job records its profile in storage's vocabulary and
refuses a cluster trained under the other (issue 17, giaann-v2)."""

import numpy as np
import pytest

from giaannd.compute.flags import without_flag_row
from giaannd.compute.train import TrainingJob, TrainSettings
from giaannd.model.rows import RowBatch
from giaannd.model.subwords import ProfileMismatchError, profile_marker
from giaannd.model.tokens import load_bundled_corpus
from tests.unit.compute.test_compute_units import FakeClient

pytestmark = pytest.mark.timeout(120)

SETTINGS = TrainSettings(coalesce_sentences=20, retry_backoff_s=0)


@pytest.fixture(scope="module")
def sentences():
    return load_bundled_corpus(60)


@pytest.mark.asyncio
@pytest.mark.parametrize("first, second", [("word", "giaann-v2"), ("giaann-v2", "word")])
async def test_a_job_refuses_a_cluster_trained_under_the_other_profile(sentences, first, second):
    client = FakeClient()
    await TrainingJob(sentences, client, SETTINGS, profile=first).run()
    kind, ident, text = profile_marker(first)
    assert client.vocab[(kind, ident)] == text  # the cluster says which profile trained it
    written = len(client.applied)
    client.seq = 0  # a fresh job client
    with pytest.raises(ProfileMismatchError, match=f"trained under model profile '{first}'"):
        await TrainingJob(sentences, client, SETTINGS, profile=second).run()
    assert len(client.applied) == written  # refused before any row was written
    client.seq = 0
    await TrainingJob(sentences, client, SETTINGS, profile=first).run()  # the same profile goes on


@pytest.mark.asyncio
async def test_a_v2_job_writes_token_id_rows_and_no_vocabulary(sentences):
    client = FakeClient()
    result = await TrainingJob(sentences, client, SETTINGS, profile="giaann-v2").run()
    rows = without_flag_row(RowBatch.concat(list(client.applied.values())))
    assert rows.row_column.max() < 200_019 and rows.target_feature.max() <= 200_019
    assert list(client.vocab) == [profile_marker("giaann-v2")[:2]]  # names come from the encoding
    assert result.vocab.num_columns == result.vocab.num_features == 0  # nothing to fold into the node state
    assert np.array_equal(np.unique(result.row_column), np.unique(rows.row_column))
