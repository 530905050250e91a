"""The restart benchmark's pure parts (tools/bench/restart.py): the timeline read from a daemon's
log, and the store it builds. The run itself starts daemons and is exercised by running the bench."""

from datetime import datetime

import pytest

from giaannd.storage import DurableStore
from giaannd.storage.replication.service import STORE_DIR
from tools.bench import restart

LOG = """\
2026-11-28 10:00:00,000 INFO giaannd.cli: starting giaannd version=0.1.0 pid=1 roles=storage
2026-11-28 10:00:01,000 INFO giaannd.daemon: ready node=st node_id=x roles=storage
2026-11-28 10:00:05,250 INFO giaannd.cli: starting giaannd version=0.1.0 pid=2 roles=storage
2026-11-28 10:00:06,500 INFO giaannd.cli: services built roles=storage
  a continuation line of a traceback
2026-11-28 10:00:06,600 INFO giaannd.daemon: admin api listening address=127.0.0.1:1
2026-11-28 10:00:06,700 INFO giaannd.runtime.node: data plane listening addresses=tcp://x
2026-11-28 10:00:06,800 INFO giaannd.services.membership: joined cluster seeds=h:1 answered=1 members=2
2026-11-28 10:00:06,850 INFO giaannd.services.ring_sync: ring synced at start answered=1 digest=00 active=a
2026-11-28 10:00:08,000 INFO giaannd.storage.replication.service: storage recovered dir=/d snapshot_seq=3 \
replayed=2 torn_bytes=0 hints=0 snapshot_bytes=9 snapshot_load_s=1.250 log_bytes=5 replay_s=0.500
2026-11-28 10:00:08,010 INFO giaannd.daemon: ready node=st node_id=x roles=storage
"""


def test_timeline_reads_this_starts_lines_in_seconds_since_exec():
    exec_at = datetime(2026, 11, 28, 10, 0, 5).timestamp()  # after the first start's lines
    got = restart.timeline(LOG, exec_at)
    assert got == pytest.approx({
        "imports + config": 0.25, "roles built": 1.5, "admin up": 1.6,
        "listeners up": 1.7, "joined": 1.8, "ring synced": 1.85, "recovered": 3.0, "ready": 3.01,
        "snapshot_load_s": 1.25, "replay_s": 0.5})


def test_timeline_of_a_start_without_some_lines_leaves_them_out():
    exec_at = datetime(2026, 11, 28, 9, 59, 59).timestamp()
    got = restart.timeline(LOG.splitlines()[0] + "\n" + LOG.splitlines()[1], exec_at)
    assert got == pytest.approx({"imports + config": 1.0, "ready": 2.0})


def test_build_store_snapshots_then_logs(tmp_path):
    held, logged = restart.build_store(tmp_path / STORE_DIR, 100_000, 0.2)
    assert held >= 100_000 and logged >= 20_000
    store = DurableStore.open(tmp_path / STORE_DIR, 1 << 40)
    try:
        assert store.recovery.snapshot_seq > 0 and store.recovery.records_replayed > 0
        assert store.store.usage().num_entries == held
    finally:
        store.close()


def test_known_keys_only_drops_what_an_older_tree_does_not_know():
    """A before tree refuses config keys added after it: the restart bench writes it a config
    without them (and without sections it lacks), the known keys kept as they were."""
    import tomllib

    from giaannd.config import Config, to_toml
    from tools.bench.restart import known_keys_only

    text = to_toml(Config.loopback("/tmp/x"))
    full = tomllib.loads(text)
    out = tomllib.loads(known_keys_only(text, {"node": ["name", "data-dir", "roles"], "storage": ["capacity-bytes"]}))
    assert out == {"node": {k: full["node"][k] for k in ("name", "data-dir", "roles")},
                   "storage": {"capacity-bytes": full["storage"]["capacity-bytes"]}}
    # every key known: the same config
    assert tomllib.loads(known_keys_only(text, {s: list(keys) for s, keys in full.items()})) == full


def test_known_keys_lists_every_config_section_and_key():
    """What the bench asks of a tree's code (``_KNOWN_KEYS``) names every section and key of the
    config; the sections are annotated types (``Annotated[NodeConfig, Meta(...)]``), which the
    question once took for no section at all, so a before tree got an empty config and started
    with the defaults (another data directory: the bench's restarts then failed)."""
    import json
    import subprocess
    import sys
    import tomllib

    from giaannd.config import Config, to_toml

    out = subprocess.run([sys.executable, "-c", restart._KNOWN_KEYS], check=True, capture_output=True, text=True,
                         timeout=120)
    known = json.loads(out.stdout)
    full = tomllib.loads(to_toml(Config.loopback("/tmp/x")))
    assert set(full) <= set(known)
    assert all(set(full[section]) <= set(known[section]) for section in full)
