"""tools.bench.row_parts runs small and prints each figure with its baseline."""

from __future__ import annotations

import json

from tools.bench.row_parts import main, measure


def test_row_parts_bench_reads_every_entry_both_ways_and_now_holds_less(capsys) -> None:
    got = measure(200_000, 10_000, 1)
    (_, base_mib), (_, now_mib) = got["whole row merged per part (before)"], got["read_part (now)"]
    assert now_mib < base_mib / 4  # the baseline holds a whole-row copy (4.2 MB), now a part (0.2 MB)
    main(["--entries", "50000", "--part-entries", "5000", "--rounds", "1", "--json"])
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [f["figure"] for f in figures][2] == "row parts: CPU, baseline / now"
    assert all(f["value"] > 0 for f in figures) and all(set(f) == {"figure", "value", "target"} for f in figures)
