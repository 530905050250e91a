"""The recovery benchmark's phase split (tools/bench/recovery.py): every wrapped function exists and
is entered by a real open, so a rename cannot leave a phase silently at zero."""

from pathlib import Path

from tools.bench import recovery, restart

ROOT = Path(recovery.__file__).resolve().parents[2]


def test_open_once_times_every_phase_of_a_real_recovery(tmp_path: Path) -> None:
    held, logged = restart.build_store(tmp_path / "store", entries=100_000, log_share=0.2)
    assert logged > 0
    spent = recovery._open_once(tmp_path / "store", ROOT)
    assert int(spent["entries"][0]) == held
    for phase in ("open", "read + checksum", "row checks", "key index", "load_bulk", "log replay"):
        assert spent[phase][0] > 0, phase
    named = sum(spent[p][0] for p in ("read + checksum", "row checks", "load_bulk", "log replay"))
    assert spent["other"][0] == spent["open"][0] - named
    assert spent["install"][0] == spent["load_bulk"][0] - spent["key index"][0]


def test_open_once_applies_and_folds_after_a_mapped_open(tmp_path: Path) -> None:
    """The end-to-end phases (the first applies and fold after the load) and the RSS lines, with the
    snapshot mapped (an empty log after it) and read."""
    held, logged = restart.build_store(tmp_path / "store", entries=60_000, log_share=0.0)
    assert logged == 0
    recovery.write_batches(tmp_path / "store", 2, tmp_path / "batches.npz")
    for kwargs in ({"map_snapshot": True}, {"map_snapshot": False}):
        spent = recovery._open_once(tmp_path / "store", ROOT, kwargs, tmp_path / "batches.npz")
        assert int(spent["entries"][0]) == held
        for phase in ("first apply", "applies", "fold"):
            assert spent[phase][0] > 0, phase
        assert spent["applies"][0] >= spent["first apply"][0]
        whole = spent["open"][0] + spent["applies"][0] + spent["fold"][0]
        assert spent["open + applies + fold"][0] == whole
        for line in ("RssAnon after open", "RssFile after open", "RssAnon after fold", "RssFile after fold"):
            assert spent[line][0] > 0, line


def test_a_log_of_new_rows_only(tmp_path: Path) -> None:
    """``--log-new-rows``: the logged batches hold rows of columns nothing before held, and the cache
    rebuilds when asked for another kind of log."""
    held, logged = restart.build_store(tmp_path / "store", entries=60_000, log_share=0.2, new_rows_log=True)
    assert logged > 0
    from giaannd.storage import DurableStore

    ds = DurableStore.open(tmp_path / "store", restart.BIG, map_snapshot=False)
    assert ds.recovery.records_replayed > 0 and ds.store.usage().num_entries == held
    ds.close()
    cache = tmp_path / "cache"
    first = restart.cached_store(cache, 60_000, 0.2, new_rows_log=True)
    assert restart.cached_store(cache, 60_000, 0.2, new_rows_log=True) == first
    assert (cache / "meta.json").read_text().count('"new_rows_log": true') == 1
    restart.cached_store(cache, 60_000, 0.2)
    assert '"new_rows_log": false' in (cache / "meta.json").read_text()
