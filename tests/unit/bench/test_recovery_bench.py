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
